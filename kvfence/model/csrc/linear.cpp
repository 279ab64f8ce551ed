// Linear layers whose output rows do not depend on the batch they run in.
//
// out[m, n] = x[m] . w[n] + bias[n], fp32 activations. The weights come packed in panels
// of 32 rows (model/linear.py packs them), so one panel is read front to back:
//   fp32 or bf16: [N/32, K, 32]; bf16 is widened exactly to fp32.
//   8-bit blocks: [N/32, K/32, 1280] bytes: per 32 k, the 32 rows' scales and offsets (fp32),
//                 then 32 k x 32 rows of codes (uint8).
//   4-bit blocks: [N/32, K/32, 640] bytes: per 32 k, the 32 rows' scales and offsets (fp16),
//                 then 32 k x 16 bytes of codes: byte j holds row j's code in its low nibble,
//                 row j + 16's in its high one.
//                 Either way w = fma(scale, code, offset), which is exactly the fp32 value gguf
//                 dequantizes Q4_0, Q4_1 and Q8_0 blocks to.
// Each output is one chain of fused multiply-adds over k = 0..K-1, whatever the number of
// rows and whichever tile it falls in: a row comes out bit-identical alone and in a batch
// of 64, and blocks give the same bits as their fp32 values. (MKL picks its kernel by row
// count, which breaks that below 4 rows.) At one row the kernel streams the weights once:
// fp32 and 8-bit weights at memory speed (software prefetch a few KB ahead took fp32 from
// about half the measured read bandwidth to 80-90% here); 4-bit blocks are bound by the
// instructions that decode them instead. Built without -ffast-math so the sums keep their order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#ifndef __AVX512F__
#error "the packed linear kernel needs AVX-512 (model/linear.py falls back to torch without it)"
#endif

namespace {

constexpr int64_t kPanel = 32;  // weight rows per panel: two AVX-512 vectors of outputs
constexpr int kRows = 12;       // activation rows per tile: 24 accumulators in registers
constexpr int64_t kBlock = 32;  // k per block of codes
constexpr int64_t kAhead = 4096;  // bytes of weights prefetched ahead of the ones being read

// Asks for the cache lines of [p + kAhead, p + kAhead + bytes): prefetches never fault, so
// running past the end of the weights is harmless.
inline void prefetch_ahead(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(static_cast<const char*>(p) + kAhead + b, _MM_HINT_T0);
}

inline __m512 widen(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 widen(const at::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// The two block formats. Pointers to them step in bytes; scales() reads a block's 32 scales
// and offsets once, weights() decodes its k-th 32 weights (rows 0-15, 16-31) as gguf does.
struct Scales { __m512 scale0, scale1, offset0, offset1; };

struct Codes8 {
  uint8_t byte;
  static constexpr int64_t kBytes = 2 * kPanel * 4 + kBlock * kPanel;
  static Scales scales(const uint8_t* block) {
    const float* s = reinterpret_cast<const float*>(block);
    return {_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16), _mm512_loadu_ps(s + 32), _mm512_loadu_ps(s + 48)};
  }
  static void weights(const uint8_t* block, const Scales& s, int64_t k, __m512& w0, __m512& w1) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2 * kPanel * 4 + k * kPanel));
    w0 = _mm512_fmadd_ps(s.scale0, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(c))), s.offset0);
    w1 = _mm512_fmadd_ps(s.scale1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(c, 1))), s.offset1);
  }
};

struct Codes4 {
  uint8_t byte;
  static constexpr int64_t kBytes = 2 * kPanel * 2 + kBlock * kPanel / 2;
  static Scales scales(const uint8_t* block) {
    auto half = [&](int i) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block) + i)); };
    return {half(0), half(1), half(2), half(3)};
  }
  static void weights(const uint8_t* block, const Scales& s, int64_t k, __m512& w0, __m512& w1) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 * kPanel * 2 + k * kPanel / 2)));
    // A permute reads only an index's low 4 bits: one instruction for the low nibble's float,
    // against a mask and a conversion (the single stream is bound by instructions here).
    const __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    w0 = _mm512_fmadd_ps(s.scale0, _mm512_permutexvar_ps(c, nibbles), s.offset0);
    w1 = _mm512_fmadd_ps(s.scale1, _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)), s.offset1);
  }
};

static_assert(sizeof(Codes8) == 1 && sizeof(Codes4) == 1);

template <typename W>
constexpr bool is_blocks = std::is_same_v<W, Codes8> || std::is_same_v<W, Codes4>;

template <int MR>
inline void accumulate(__m512 (&acc)[MR][2], const float* x, int64_t K, int64_t k, __m512 w0, __m512 w1) {
  for (int i = 0; i < MR; ++i) {
    const __m512 xv = _mm512_set1_ps(x[i * K + k]);
    acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
    acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
  }
}

template <int MR, typename W>
void multiply(__m512 (&acc)[MR][2], const float* x, const W* panel, int64_t K) {
  if constexpr (is_blocks<W>) {
    const uint8_t* block = reinterpret_cast<const uint8_t*>(panel);
    for (int64_t k0 = 0; k0 < K; k0 += kBlock, block += W::kBytes) {
      prefetch_ahead(block, W::kBytes);
      const Scales s = W::scales(block);
      for (int64_t k = 0; k < kBlock; ++k) {
        __m512 w0, w1;
        W::weights(block, s, k, w0, w1);
        accumulate<MR>(acc, x, K, k0 + k, w0, w1);
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      prefetch_ahead(panel + k * kPanel, kPanel * sizeof(W));
      accumulate<MR>(acc, x, K, k, widen(panel + k * kPanel), widen(panel + k * kPanel + 16));
    }
  }
}

// A panel of blocks decoded to the fp32 panel layout, for several row tiles to share.
template <typename W>
void decode_panel(const W* panel, float* out, int64_t K) {
  const uint8_t* block = reinterpret_cast<const uint8_t*>(panel);
  for (int64_t k0 = 0; k0 < K; k0 += kBlock, block += W::kBytes) {
    prefetch_ahead(block, W::kBytes);
    const Scales s = W::scales(block);
    for (int64_t k = 0; k < kBlock; ++k, out += kPanel) {
      __m512 w0, w1;
      W::weights(block, s, k, w0, w1);
      _mm512_storeu_ps(out, w0);
      _mm512_storeu_ps(out + 16, w1);
    }
  }
}

// rows x[0..MR) times one panel; writes out[0..MR)[0..cols).
template <int MR, typename W>
void tile(const float* x, const W* panel, const float* bias, float* out, int64_t K, int64_t N, int64_t cols) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  multiply<MR>(acc, x, panel, K);
  const __mmask16 mask0 = cols >= 16 ? 0xFFFF : (1u << cols) - 1;
  const __mmask16 mask1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mask0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(mask1, bias + 16) : _mm512_setzero_ps();
  for (int i = 0; i < MR; ++i) {
    _mm512_mask_storeu_ps(out + i * N, mask0, _mm512_add_ps(acc[i][0], b0));
    _mm512_mask_storeu_ps(out + i * N + 16, mask1, _mm512_add_ps(acc[i][1], b1));
  }
}

template <typename W>
using TileFn = void (*)(const float*, const W*, const float*, float*, int64_t, int64_t, int64_t);

template <typename W, int... MR>
TileFn<W> tile_for(int rows, std::integer_sequence<int, MR...>) {
  static constexpr TileFn<W> table[] = {tile<MR + 1, W>...};
  return table[rows - 1];
}

template <typename W>
void run(const float* x, const W* w, int64_t panel_size, const float* bias, float* out, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> decoded;  // kept between calls: no allocation per layer
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * kPanel, cols = std::min(kPanel, N - n);
      auto tiles = [&](const auto* panel) {
        using T = std::remove_cv_t<std::remove_pointer_t<decltype(panel)>>;
        for (int64_t m = 0; m < M; m += kRows) {  // the panel stays in cache while every row tile passes
          const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m));
          tile_for<T>(rows, std::make_integer_sequence<int, kRows>{})(
              x + m * K, panel, bias ? bias + n : nullptr, out + m * N + n, K, N, cols);
        }
      };
      if constexpr (is_blocks<W>) {
        if (M > kRows) {  // decode once, not once per row tile: same weights, same bits
          decoded.resize(K * kPanel);
          decode_panel(w + p * panel_size, decoded.data(), K);
          tiles(decoded.data());
          continue;
        }
      }
      tiles(w + p * panel_size);
    }
  });
}

}  // namespace

torch::Tensor packed_linear(const torch::Tensor& x,       // [M, K] fp32
                            const torch::Tensor& packed,  // see the top of this file
                            int64_t N,
                            const c10::optional<torch::Tensor>& bias) {  // [N] fp32
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x: [M, K] fp32");
  const int64_t M = x.size(0), K = x.size(1);
  const bool blocks = packed.scalar_type() == torch::kUInt8;
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == (N + kPanel - 1) / kPanel,
              "weights: one panel per 32 rows, contiguous");
  TORCH_CHECK(blocks ? K % kBlock == 0 && packed.size(1) == K / kBlock &&
                           (packed.size(2) == Codes8::kBytes || packed.size(2) == Codes4::kBytes)
                     : packed.size(1) == K && packed.size(2) == kPanel,
              "weights: [N/32, K, 32] (fp32, bf16) or [N/32, K/32, 1280 or 640] (blocks) for this K");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N, "bias: [N] fp32");
    b = bias->data_ptr<float>();
  }
  const auto xc = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const int64_t panel_size = packed.size(1) * packed.size(2);
  if (packed.scalar_type() == torch::kFloat32)
    run(xc.data_ptr<float>(), packed.data_ptr<float>(), panel_size, b, out.data_ptr<float>(), M, N, K);
  else if (packed.scalar_type() == torch::kBFloat16)
    run(xc.data_ptr<float>(), packed.data_ptr<at::BFloat16>(), panel_size, b, out.data_ptr<float>(), M, N, K);
  else if (blocks && packed.size(2) == Codes8::kBytes)
    run(xc.data_ptr<float>(), reinterpret_cast<const Codes8*>(packed.data_ptr<uint8_t>()), panel_size, b,
        out.data_ptr<float>(), M, N, K);
  else if (blocks)
    run(xc.data_ptr<float>(), reinterpret_cast<const Codes4*>(packed.data_ptr<uint8_t>()), panel_size, b,
        out.data_ptr<float>(), M, N, K);
  else
    TORCH_CHECK(false, "weights: fp32, bf16 or blocks (uint8)");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "x @ weight.T + bias, each row independent of the others");
  // For fused.cpp's decode_layers, which calls it without going through Python.
  m.attr("packed_linear_fn") = py::capsule(reinterpret_cast<void*>(&packed_linear), "kvfence.packed_linear");
}
