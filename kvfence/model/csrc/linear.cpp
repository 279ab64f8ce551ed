// Linear layers whose output rows do not depend on the batch they run in.
//
// out[m, n] = x[m] . w[n] + bias[n], fp32 activations, fp32 or bf16 weights (bf16 is
// widened exactly to fp32). The weights come packed in panels of 32 rows, [N/32, K, 32]
// (model/linear.py packs them), so one panel is read front to back. Each output is one
// chain of fused multiply-adds over k = 0..K-1, whatever the number of rows and whichever
// tile it falls in: a row comes out bit-identical alone and in a batch of 64. (MKL picks
// its kernel by row count, which breaks that below 4 rows.) At one row the kernel streams
// the weights once, at memory speed. Built without -ffast-math so the sums keep their order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#ifndef __AVX512F__
#error "the packed linear kernel needs AVX-512 (model/linear.py falls back to torch without it)"
#endif

namespace {

constexpr int64_t kPanel = 32;  // weight rows per panel: two AVX-512 vectors of outputs
constexpr int kRows = 12;       // activation rows per tile: 24 accumulators in registers

inline __m512 widen(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 widen(const at::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// rows x[0..MR) times one panel; writes out[0..MR)[0..cols).
template <int MR, typename W>
void tile(const float* x, const W* panel, const float* bias, float* out, int64_t K, int64_t N, int64_t cols) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = widen(panel + k * kPanel), w1 = widen(panel + k * kPanel + 16);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * K + k]);
      acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
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
void run(const float* x, const W* w, const float* bias, float* out, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * kPanel, cols = std::min(kPanel, N - n);
      for (int64_t m = 0; m < M; m += kRows) {  // the panel stays in cache while every row tile passes
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m));
        tile_for<W>(rows, std::make_integer_sequence<int, kRows>{})(
            x + m * K, w + p * K * kPanel, bias ? bias + n : nullptr, out + m * N + n, K, N, cols);
      }
    }
  });
}

}  // namespace

torch::Tensor packed_linear(const torch::Tensor& x,       // [M, K] fp32
                            const torch::Tensor& packed,  // [ceil(N/32), K, 32] fp32 or bf16
                            int64_t N,
                            const c10::optional<torch::Tensor>& bias) {  // [N] fp32
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x: [M, K] fp32");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == (N + kPanel - 1) / kPanel &&
                  packed.size(1) == K && packed.size(2) == kPanel, "weights: [ceil(N/32), K, 32], contiguous");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N, "bias: [N] fp32");
    b = bias->data_ptr<float>();
  }
  const auto xc = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  if (packed.scalar_type() == torch::kFloat32)
    run(xc.data_ptr<float>(), packed.data_ptr<float>(), b, out.data_ptr<float>(), M, N, K);
  else if (packed.scalar_type() == torch::kBFloat16)
    run(xc.data_ptr<float>(), packed.data_ptr<at::BFloat16>(), b, out.data_ptr<float>(), M, N, K);
  else
    TORCH_CHECK(false, "weights: fp32 or bf16");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "x @ weight.T + bias, each row independent of the others");
}
