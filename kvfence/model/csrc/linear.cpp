// Linear layers whose output rows do not depend on the batch they run in.
//
// out[m, n] = x[m] . w[n] + bias[n], fp32 activations. The weights come packed in panels
// of 32 rows (model/linear.py packs them), so one panel is read front to back:
//   fp32, bf16 or fp16: [N/32, K, 32]; bf16 and fp16 are widened exactly to fp32.
//   8-bit blocks: [N/32, K/32, 1280] bytes: per 32 k, the 32 rows' scales and offsets (fp32),
//                 then 32 k x 32 rows of codes (uint8).
//   4-bit blocks: [N/32, K/32, 640] bytes: per 32 k, the 32 rows' scales and offsets (fp16),
//                 then 32 k x 16 bytes of codes: byte j holds row j's code in its low nibble,
//                 row j + 16's in its high one.
//   4-bit blocks with fp32 scales: [N/32, K/32, 768] bytes: the 8-bit layout's scales and
//                 offsets, then the 4-bit layout's codes (Q4_K: its d * sc needs fp32).
//   8-bit blocks in halves: [N/32, K/32, 1536] bytes: for each 16 k, the 32 rows' scales and
//                 offsets (fp32), then the 8-bit layout's codes (a matrix that mixes Q6_K's
//                 scale per 16 k with other types, as a fused Q/K/V may).
//   K-quant super-blocks: [N/32, K/256, 4736 (Q4_K), 6784 (Q5_K) or 6720 (Q6_K)] bytes: the
//                 file's own scales per 256 k (see SuperBlocks), about its bytes a weight.
//                 Every way w = fma(scale, code, offset), which is exactly the fp32 value gguf
//                 dequantizes the block to (see model/quant.py, gguf_blocks).
// Each output is one chain of fused multiply-adds over k = 0..K-1, whatever the number of
// rows, whichever tile it falls in and whatever the vector width (AVX-512 or AVX2): a row
// comes out bit-identical alone and in a batch of 64, on either kind of CPU, and blocks give
// the same bits as their fp32 values. (MKL picks its kernel by row count, which breaks that
// below 4 rows.) At one row the kernel streams the weights once: fp32 and 8-bit weights near
// memory speed, with a software prefetch a few KB ahead (the hardware prefetcher alone leaves
// the stream waiting on memory); 4-bit blocks are bound by the instructions that decode them
// instead. Built without -ffast-math so the sums keep their order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// One vector of fp32 lanes, and the few operations the kernel needs on it.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kWidth = 16;
constexpr int kRows = 12;  // activation rows per tile: 24 accumulators of the 32 registers
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const at::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline Vec load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec load_fp16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec load_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec load_nibbles(const uint8_t* p, bool high) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (high) return _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
  // A permute reads only an index's low 4 bits: one instruction for the low nibble's float,
  // against a mask and a conversion (the single stream is bound by instructions here).
  return _mm512_permutexvar_ps(c, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
// Integer lanes, for codes assembled from bits before their conversion to floats.
using Ints = __m512i;
inline Ints ints_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Ints ints_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Ints nibbles(const uint8_t* p, bool high) {
  const Ints c = ints_u8(p);
  return high ? _mm512_srli_epi32(c, 4) : _mm512_and_si512(c, _mm512_set1_epi32(15));
}
// Codes' high bits, 8 bytes a k: byte l holds `bits` of rows l, l + 8, l + 16 and l + 24 each,
// from bit 0 up. Returns those of rows j..j + 15, at bit 4 up, OR-ed into their low 4 bits.
inline Ints with_high(Ints low, const uint8_t* p, int64_t j, int bits) {
  int64_t eight;
  std::memcpy(&eight, p, 8);
  const Ints c = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x(eight)), 4);  // rows j + l, j + 8 + l
  const Ints at = _mm512_add_epi32(_mm512_set1_epi32(bits * (j / 8)),
                                   _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, bits, bits, bits, bits, bits, bits, bits, bits));
  return _mm512_or_si512(low, _mm512_and_si512(_mm512_srlv_epi32(c, at), _mm512_set1_epi32(((1 << bits) - 1) << 4)));
}
inline Vec to_vec(Ints v) { return _mm512_cvtepi32_ps(v); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline __mmask16 lanes(int64_t n) { return n >= kWidth ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1; }
inline Vec load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
inline void store_first(float* p, Vec v, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using Vec = __m256;
constexpr int kWidth = 8;
constexpr int kRows = 6;  // 12 accumulators of the 16 registers
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec broadcast(float x) { return _mm256_set1_ps(x); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const at::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline Vec load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec load_fp16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline Vec load_u8(const uint8_t* p) { return _mm256_cvtepi32_ps(widen_u8(p)); }
inline Vec load_nibbles(const uint8_t* p, bool high) {
  const __m256i c = widen_u8(p);
  return _mm256_cvtepi32_ps(high ? _mm256_srli_epi32(c, 4) : _mm256_and_si256(c, _mm256_set1_epi32(15)));
}
using Ints = __m256i;
inline Ints ints_u8(const uint8_t* p) { return widen_u8(p); }
inline Ints ints_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline Ints nibbles(const uint8_t* p, bool high) {
  const Ints c = widen_u8(p);
  return high ? _mm256_srli_epi32(c, 4) : _mm256_and_si256(c, _mm256_set1_epi32(15));
}
inline Ints with_high(Ints low, const uint8_t* p, int64_t j, int bits) {
  const Ints c = _mm256_slli_epi32(widen_u8(p), 4);  // the same for every j: loaded once a k
  const Ints at = _mm256_set1_epi32(bits * (j / 8));
  return _mm256_or_si256(low, _mm256_and_si256(_mm256_srlv_epi32(c, at), _mm256_set1_epi32(((1 << bits) - 1) << 4)));
}
inline Vec to_vec(Ints v) { return _mm256_cvtepi32_ps(v); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline __m256i lanes(int64_t n) {
  const int count = static_cast<int>(std::clamp<int64_t>(n, 0, kWidth));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, lanes(n)); }
inline void store_first(float* p, Vec v, int64_t n) { _mm256_maskstore_ps(p, lanes(n), v); }
#else
#error "the packed linear kernel needs AVX-512, or AVX2 with FMA and F16C (model/linear.py falls back to torch)"
#endif

constexpr int64_t kPanel = 32;               // weight rows per panel
constexpr int kPanelVecs = kPanel / kWidth;   // 2 (AVX-512) or 4 (AVX2)
// Tiles of up to kWideRows rows span the whole panel; taller ones span 2 vectors of it, so
// that their accumulators fit the registers. On AVX2, spanning the panel at 1-3 rows gives 4
// independent chains of multiply-adds to overlap, not 2 (each waits on the last), which hides
// the multiply-adds' latency when there are too few rows to fill the pipes.
constexpr int kWideRows = kPanelVecs == 2 ? kRows : 3;
constexpr int64_t kBlock = 32;                // k per block of codes
constexpr int64_t kAhead = 4096;              // prefetch distance, in bytes of weights

// Asks for the cache lines of [p + kAhead, p + kAhead + bytes): prefetches never fault, so
// running past the end of the weights is harmless.
inline void prefetch_ahead(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(static_cast<const char*>(p) + kAhead + b, _MM_HINT_T0);
}

// Asks for the same lines into L2 only: the K-quant kernel at one row consumes its weights
// faster than the others, and there prefetches into L1 left it waiting on memory at about 60%
// of the rate L2 prefetches reach (docs/performance.md).
inline void prefetch_to_l2(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(static_cast<const char*>(p) + kAhead + b, _MM_HINT_T1);
}

// The block formats. Pointers to them step in bytes. Blocks of 32 k follow each other, kGroup
// of them after a header of kHeader bytes (the K-quants' super-blocks of 256 k; the others
// have none). For the vector of columns [j, j + kWidth) of a block: scale() and offset() once
// per kSub k from k = s on, weight() at its k-th step, decoded as gguf does.
struct Codes8 {
  uint8_t byte;
  static constexpr int64_t kSub = 32, kGroup = 1, kHeader = 0;
  static constexpr int64_t kBytes = 2 * kPanel * 4 + kBlock * kPanel;
  static Vec scale(const uint8_t*, const uint8_t* block, int64_t, int64_t j) { return load(reinterpret_cast<const float*>(block) + j); }
  static Vec offset(const uint8_t*, const uint8_t* block, int64_t, int64_t j) { return load(reinterpret_cast<const float*>(block) + kPanel + j); }
  static Vec weight(const uint8_t* block, int64_t k, int64_t j, Vec scale, Vec offset) {
    return fmadd(scale, load_u8(block + 2 * kPanel * 4 + k * kPanel + j), offset);
  }
};

struct Codes4 {
  uint8_t byte;
  static constexpr int64_t kSub = 32, kGroup = 1, kHeader = 0;
  static constexpr int64_t kBytes = 2 * kPanel * 2 + kBlock * kPanel / 2;
  static Vec scale(const uint8_t*, const uint8_t* block, int64_t, int64_t j) { return load_fp16(block + 2 * j); }
  static Vec offset(const uint8_t*, const uint8_t* block, int64_t, int64_t j) { return load_fp16(block + 2 * (kPanel + j)); }
  // Column j < 16 is the low nibble of byte j, column j >= 16 the high nibble of byte j - 16.
  static Vec weight(const uint8_t* block, int64_t k, int64_t j, Vec scale, Vec offset) {
    return fmadd(scale, load_nibbles(block + 2 * kPanel * 2 + k * kPanel / 2 + j % 16, j >= 16), offset);
  }
};

struct Codes4F {
  uint8_t byte;
  static constexpr int64_t kSub = 32, kGroup = 1, kHeader = 0;
  static constexpr int64_t kBytes = 2 * kPanel * 4 + kBlock * kPanel / 2;
  static Vec scale(const uint8_t* h, const uint8_t* block, int64_t s, int64_t j) { return Codes8::scale(h, block, s, j); }
  static Vec offset(const uint8_t* h, const uint8_t* block, int64_t s, int64_t j) { return Codes8::offset(h, block, s, j); }
  static Vec weight(const uint8_t* block, int64_t k, int64_t j, Vec scale, Vec offset) {
    return fmadd(scale, load_nibbles(block + 2 * kPanel * 4 + k * kPanel / 2 + j % 16, j >= 16), offset);
  }
};

struct Codes8H {
  uint8_t byte;
  static constexpr int64_t kSub = 16, kGroup = 1, kHeader = 0;
  static constexpr int64_t kScales = 2 * (kBlock / kSub) * kPanel * 4;  // bytes of scales and offsets
  static constexpr int64_t kBytes = kScales + kBlock * kPanel;
  static Vec scale(const uint8_t* h, const uint8_t* block, int64_t s, int64_t j) { return Codes8::scale(h, block + s / kSub * 2 * kPanel * 4, 0, j); }
  static Vec offset(const uint8_t* h, const uint8_t* block, int64_t s, int64_t j) { return Codes8::offset(h, block + s / kSub * 2 * kPanel * 4, 0, j); }
  static Vec weight(const uint8_t* block, int64_t k, int64_t j, Vec scale, Vec offset) {
    return fmadd(scale, load_u8(block + kScales + k * kPanel + j), offset);
  }
};

// The K-quants in their own super-blocks of 256 k (pack_super_blocks below): a
// header of the 32 rows' d (fp16), and for Q4_K/Q5_K their dmin, then 8 blocks of 32 k, each
// with the rows' 6-bit scales (Q6_K: int8, one per 16 k) and Q4_K/Q5_K's mins (uint8), the low
// 4 bits of the codes laid out as Codes4's, then 8 bytes a k of the codes' high bits (see
// with_high: a vector's lanes take them with one shift, wherever its rows are).
// gguf's scale d * sc and offset -dmin * m (Q6_K: -32 d sc) are products of an fp16 and a
// 6-bit integer, exact in fp32, so the kernel makes them from their parts with gguf's bits.
template <int kHighBits>
struct SuperBlocks {
  uint8_t byte;
  static constexpr bool kMins = kHighBits < 2;  // Q4_K, Q5_K; Q6_K's offset is -32 scale
  static constexpr int64_t kSub = kMins ? 32 : 16, kGroup = 8;
  static constexpr int64_t kHeader = kPanel * 2 * (kMins ? 2 : 1);
  static constexpr int64_t kScales = 2 * kPanel;  // bytes of scales (and mins) a block
  static constexpr int64_t kBytes = kScales + kBlock * kPanel / 2 + (kHighBits ? kBlock * 8 : 0);
  static Vec scale(const uint8_t* header, const uint8_t* block, int64_t s, int64_t j) {
    const Vec d = load_fp16(header + 2 * j);
    if constexpr (kMins) return mul(d, to_vec(ints_u8(block + j)));
    return mul(d, to_vec(ints_i8(block + s / kSub * kPanel + j)));
  }
  static Vec offset(const uint8_t* header, const uint8_t* block, int64_t s, int64_t j) {
    if constexpr (kMins) return mul(load_fp16(header + 2 * (kPanel + j)), mul(to_vec(ints_u8(block + kPanel + j)), broadcast(-1.f)));
    return mul(scale(header, block, s, j), broadcast(-32.f));
  }
  static Vec weight(const uint8_t* block, int64_t k, int64_t j, Vec scale, Vec offset) {
    Ints code = nibbles(block + kScales + k * kPanel / 2 + j % 16, j >= 16);
    if constexpr (kHighBits > 0) code = with_high(code, block + kScales + kBlock * kPanel / 2 + k * 8, j, kHighBits);
    return fmadd(scale, to_vec(code), offset);
  }
};
using Q4K = SuperBlocks<0>;
using Q5K = SuperBlocks<1>;
using Q6K = SuperBlocks<2>;

// f(std::integral_constant<int, kind>) for a K-quant type 0-2 (Q4_K, Q5_K, Q6_K) known at run
// time: the kernels and the packing take it as a template parameter.
template <typename F>
void with_k_kind(int64_t kind, F&& f) {
  if (kind == 0) f(std::integral_constant<int, 0>{});
  else if (kind == 1) f(std::integral_constant<int, 1>{});
  else f(std::integral_constant<int, 2>{});
}

static_assert(sizeof(Codes8) == 1 && sizeof(Codes4) == 1 && sizeof(Codes4F) == 1 && sizeof(Codes8H) == 1 && sizeof(Q4K) == 1);

template <typename W>
constexpr bool is_blocks = std::is_same_v<W, Codes8> || std::is_same_v<W, Codes4> || std::is_same_v<W, Codes4F> ||
                           std::is_same_v<W, Codes8H> || std::is_same_v<W, Q4K> || std::is_same_v<W, Q5K> ||
                           std::is_same_v<W, Q6K>;

template <int MR, int NV>
inline void accumulate(Vec (&acc)[MR][NV], const float* x, int64_t K, int64_t k, const Vec (&w)[NV]) {
  for (int i = 0; i < MR; ++i) {
    const Vec xv = broadcast(x[i * K + k]);
    for (int v = 0; v < NV; ++v) acc[i][v] = fmadd(xv, w[v], acc[i][v]);
  }
}

// Rows x[0..MR) against the NV vectors of columns of a panel from column c on (a constant,
// so that the decoding of 4-bit codes knows at compile time which nibble each vector takes).
template <int MR, int NV, int64_t c, typename W>
void multiply(Vec (&acc)[MR][NV], const float* x, const W* panel, int64_t K) {
  if constexpr (is_blocks<W>) {
    const uint8_t *block = reinterpret_cast<const uint8_t*>(panel), *header = block;
    for (int64_t k0 = 0; k0 < K; k0 += kBlock, block += W::kBytes) {
      if (k0 % (kBlock * W::kGroup) == 0) {
        header = block;
        block += W::kHeader;
        prefetch_ahead(block, W::kHeader);
      }
      prefetch_ahead(block, W::kBytes);
      for (int64_t s = 0; s < kBlock; s += W::kSub) {
        Vec scale[NV], offset[NV];
        for (int v = 0; v < NV; ++v) {
          scale[v] = W::scale(header, block, s, c + v * kWidth);
          offset[v] = W::offset(header, block, s, c + v * kWidth);
        }
        for (int64_t k = s; k < s + W::kSub; ++k) {
          Vec w[NV];
          for (int v = 0; v < NV; ++v) w[v] = W::weight(block, k, c + v * kWidth, scale[v], offset[v]);
          accumulate<MR, NV>(acc, x, K, k0 + k, w);
        }
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const W* row = panel + k * kPanel + c;
      prefetch_ahead(row - c, kPanel * sizeof(W));
      Vec w[NV];
      for (int v = 0; v < NV; ++v) w[v] = load(row + v * kWidth);
      accumulate<MR, NV>(acc, x, K, k, w);
    }
  }
}

// A panel of blocks decoded to the fp32 panel layout, for several row tiles to share.
template <typename W>
void decode_panel(const W* panel, float* out, int64_t K) {
  const uint8_t *block = reinterpret_cast<const uint8_t*>(panel), *header = block;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock, block += W::kBytes) {
    if (k0 % (kBlock * W::kGroup) == 0) {
      header = block;
      block += W::kHeader;
      prefetch_ahead(block, W::kHeader);
    }
    prefetch_ahead(block, W::kBytes);
    for (int64_t s = 0; s < kBlock; s += W::kSub)
      for (int64_t j = 0; j < kPanel; j += kWidth) {
        const Vec scale = W::scale(header, block, s, j), offset = W::offset(header, block, s, j);
        for (int64_t k = s; k < s + W::kSub; ++k) store(out + (k0 + k) * kPanel + j, W::weight(block, k, j, scale, offset));
      }
  }
}

// Row j of a panel of blocks decoded to fp32 out[0..K), with the bits decode_panel gives it.
template <typename W>
void decode_row(const W* panel, int64_t j, float* out, int64_t K) {
  const int64_t c = j / kWidth * kWidth;  // the vector of columns that holds row j
  alignas(64) float lanes[kWidth];
  const uint8_t *block = reinterpret_cast<const uint8_t*>(panel), *header = block;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock, block += W::kBytes) {
    if (k0 % (kBlock * W::kGroup) == 0) {
      header = block;
      block += W::kHeader;
    }
    for (int64_t s = 0; s < kBlock; s += W::kSub) {
      const Vec scale = W::scale(header, block, s, c), offset = W::offset(header, block, s, c);
      for (int64_t k = s; k < s + W::kSub; ++k) {
        store(lanes, W::weight(block, k, c, scale, offset));
        out[k0 + k] = lanes[j - c];
      }
    }
  }
}

// Rows x[0..MR) times NV vectors of columns of one panel, from column c on; writes those of
// them below `cols` (fewer at the end of the outputs) to out[0..MR).
template <int MR, int NV, typename W>
void tile(const float* x, const W* panel, const float* bias, float* out, int64_t K, int64_t N, int64_t c, int64_t cols) {
  Vec acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = zero();
  if (c == 0)
    multiply<MR, NV, 0>(acc, x, panel, K);
  else
    multiply<MR, NV, 2 * kWidth>(acc, x, panel, K);  // the second narrow tile of an AVX2 panel
  for (int v = 0; v < NV; ++v) {
    const int64_t j = c + v * kWidth, left = cols - j;
    const Vec b = bias ? load_first(bias + j, left) : zero();
    for (int i = 0; i < MR; ++i) store_first(out + i * N + j, add(acc[i][v], b), left);
  }
}

template <typename W>
using TileFn = void (*)(const float*, const W*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

template <typename W, int NV, int... MR>
TileFn<W> tile_for(int rows, std::integer_sequence<int, MR...>) {
  static constexpr TileFn<W> table[] = {tile<MR + 1, NV, W>...};
  return table[rows - 1];
}

// Rows x[0..rows) times one panel, whose first column is output n.
template <typename W>
void panel_tile(int rows, const float* x, const W* panel, const float* bias, float* out, int64_t K, int64_t N, int64_t n,
                int64_t cols) {
  const float* b = bias ? bias + n : nullptr;
  if (rows <= kWideRows) {
    tile_for<W, kPanelVecs>(rows, std::make_integer_sequence<int, kWideRows>{})(
        x, panel, b, out + n, K, N, 0, cols);
    return;
  }
  for (int64_t c = 0; c < cols; c += 2 * kWidth)  // one tile (AVX-512) or two (AVX2)
    tile_for<W, 2>(rows, std::make_integer_sequence<int, kRows>{})(x, panel, b, out + n, K, N, c, cols);
}

// Rows x[0..M) times one panel, whose outputs n..n + cols are written.
template <typename W>
void run_panel(const float* x, const W* w, const float* bias, float* out, int64_t M, int64_t N, int64_t K, int64_t n,
               int64_t cols) {
  auto tiles = [&](const auto* panel) {
    for (int64_t m = 0; m < M; m += kRows)  // the panel stays in cache for every row tile
      panel_tile(static_cast<int>(std::min<int64_t>(kRows, M - m)), x + m * K, panel, bias, out + m * N, K, N, n, cols);
  };
  if constexpr (is_blocks<W>) {
    if (M > kRows) {  // decode once, not once per row tile: same weights, same bits
      // Aligned to cache lines, as torch's tensors are: a vector load that straddles two
      // lines takes two cache accesses, and the tiles make a great many of them.
      thread_local std::vector<float> decoded;  // kept between calls: no allocation per layer
      decoded.resize(K * kPanel + 16);
      float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(decoded.data()) + 63) & ~uintptr_t{63});
      decode_panel(w, panel, K);
      tiles(panel);
      return;
    }
  }
  tiles(w);
}

template <typename W>
void run(const float* x, const W* w, int64_t panel_size, const float* bias, float* out, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      run_panel(x, w + p * panel_size, bias, out, M, N, K, p * kPanel, std::min(kPanel, N - p * kPanel));
  });
}

// A table of K-quant panels in SuperBlocks' layout (pack_k_quants below): a fused matrix whose
// parts are of different K-quant types, each panel run as its type.
void run_super_table(const float* x, const uint8_t* blob, const float* bias, float* out, int64_t M, int64_t N,
                     int64_t K) {
  const auto* table = reinterpret_cast<const int64_t*>(blob);
  at::parallel_for(0, table[0], 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t* e = table + 1 + 4 * p;  // offset, type, first output, outputs
      with_k_kind(e[1], [&](auto k) {
        using W = SuperBlocks<decltype(k)::value>;
        run_panel(x, reinterpret_cast<const W*>(blob + e[0]), bias, out, M, N, K, e[2], e[3]);
      });
    }
  });
}

// --- 8-bit activations (--dtype gguf-int8): llama.cpp's arithmetic ---------------------
//
// Each row of x is rounded per block of 32 k to int8 codes a with one scale d (max |x| / 127,
// kept as fp16, as llama.cpp's Q8_0 and Q8_1 rows keep it), and a block's dot product is
// computed on integers: x . w ~ s d sum(a c) + o S for w = s c + o, where S = fp16(d sum(a)),
// d unrounded (Q8_1's, for Q4_1 and Q5_1, whose offsets llama.cpp multiplies by it; a matrix
// that mixes them with Q4_0 or Q5_0 takes it too). Q4_0 and Q5_0's offsets, -8 s and -16 s,
// come off the integer sum instead, s d sum(a (c - 8)), as llama.cpp's signed codes give it
// (Q8_0's rows). A vpmaddubsw makes 32 byte products, against 8 or 16 per fp32 FMA, and the
// codes need no conversion to floats, so it outruns the exact path above, most where 512-bit
// VNNI sums 16 columns at once (docs/performance.md has the rates). Results are not the fp32
// ones, but still batch invariant: each row is rounded alone, integer sums do not
// depend on order, and each output's blocks are added in one order, so every CPU gives the
// same bits (AVX-512 VNNI sums the codes in fewer instructions, 16 columns at once). Packed
// weights (int8) [N/32, K/32, bytes]:
//   4-bit: 32 scales, 32 offsets (fp16), then for each 8 k (h = 0..3) and each 8 columns
//          (g = 0..3) 32 bytes, byte 4j + t holding column 8g + j's codes for k = 8h + t (low
//          nibble) and k = 8h + 4 + t (high nibble): 640 bytes (Q4_1).
//   5-bit: the 4-bit layout, then the codes' fifth bits: per 8 k, low then high nibble, 128
//          bits, bit b that of byte b of the step's codes: 768 bytes (Q5_1).
//   4- and 5-bit with a zero point: the same without the offsets, which are -8 s (4-bit,
//          Q4_0) or -16 s (5-bit, Q5_0): 576 and 704 bytes, the file's own.
//   8-bit: 32 scales (fp16), then for each 4 k (h = 0..7) and 8 columns, byte 4j + t holding
//          column 8g + j's signed code for k = 4h + t (Q8_0: the offset is 0): 1088 bytes.
// A vpmaddubsw multiplies 4 k of 8 columns by 4 broadcast codes of a row, summing pairs.

constexpr int64_t kNibbleBlock = 2 * kPanel * 2 + kBlock * kPanel / 2;  // 640
constexpr int64_t kFiveBitBlock = kNibbleBlock + kBlock * kPanel / 8;    // 768
constexpr int64_t kByteBlock = kPanel * 2 + kBlock * kPanel;             // 1088
constexpr int64_t kNibbleZeroBlock = kNibbleBlock - 2 * kPanel;    // 576
constexpr int64_t kFiveBitZeroBlock = kFiveBitBlock - 2 * kPanel;  // 704
// zero: codes with a zero point (2^(bits - 1)) in place of offsets.
constexpr int64_t int_block_bytes(int bits, bool zero) {
  return bits == 8 ? kByteBlock : (bits == 4 ? kNibbleBlock : kFiveBitBlock) - (zero ? 2 * kPanel : 0);
}
// The bytes before a block's codes: its scales, and its offsets where it has them.
constexpr int64_t int_header(int bits, bool zero) { return (bits < 8 && !zero ? 2 : 1) * 2 * kPanel; }

constexpr bool is_int_block(int64_t bytes) {
  return bytes == kNibbleBlock || bytes == kNibbleZeroBlock || bytes == kFiveBitBlock || bytes == kFiveBitZeroBlock ||
         bytes == kByteBlock;
}

// x as the nearest fp16 (ties to even), as llama.cpp stores its rows' scales.
inline float fp16_rounded(float x) { return _cvtsh_ss(_cvtss_sh(x, 0)); }

// x [M, K] -> codes [M, K] and, per row and block, d (fp16), sum(codes) and Q8_1's S:
// fp16(d sum(codes)) with d unrounded. With `unsigned_codes`, the codes are stored as a + 128
// (uint8); sum(codes) stays sum(a).
void quantize_rows(const float* x, int64_t M, int64_t K, bool unsigned_codes, int8_t* codes, float* scale,
                   int32_t* sums, float* scaled_sum) {
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    for (int64_t b = m0 * blocks; b < m1 * blocks; ++b) {
      const float* v = x + b * kBlock;
      __m256 f[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        f[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.f), f[i]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
      __m256i c[4];
      // Rounded to nearest, ties to even.
      for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv));
      const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      const int sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
      // packs works within 128-bit lanes; the permute puts the 32 codes back in order.
      __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
      if (unsigned_codes) packed = _mm256_xor_si256(packed, _mm256_set1_epi8(-128));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kBlock),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      scale[b] = fp16_rounded(top / 127.f);
      sums[b] = sum;
      scaled_sum[b] = fp16_rounded(top / 127.f * static_cast<float>(sum));
    }
  });
}

struct QuantizedRows {
  const int8_t* codes;
  const float* scale;
  const int32_t* sums;
  const float* scaled_sum;
  int64_t K;
};

// The integer kernel's vectors: with AVX-512 VNNI (and BW), 16 columns of a panel in a 512-bit
// register, else 8 in a 256-bit one: twice the products per instruction, which pays where the
// CPU's 512-bit units are full width. Each column's lane computes the same integers and float
// steps either way, so the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
using IVec = __m512i;
using FVec = __m512;
constexpr int kIntLanes = 16;
inline IVec load_codes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline void store_codes(uint8_t* p, IVec v) { _mm512_storeu_si512(p, v); }
inline IVec bytes(int8_t b) { return _mm512_set1_epi8(b); }
inline IVec low_nibbles(IVec v) { return _mm512_and_si512(v, bytes(0x0F)); }
inline IVec high_nibbles(IVec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), bytes(0x0F)); }
inline IVec words(int32_t w) { return _mm512_set1_epi32(w); }
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec sub_times_128(IVec a, IVec b) { return _mm512_sub_epi32(a, _mm512_slli_epi32(b, 7)); }
inline FVec fzero() { return _mm512_setzero_ps(); }
inline FVec to_float(IVec v) { return _mm512_cvtepi32_ps(v); }
inline FVec fp16s(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline FVec fset(float x) { return _mm512_set1_ps(x); }
inline FVec fmul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec ffma(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
inline void fstore(float* p, FVec v) { _mm512_storeu_ps(p, v); }
#else
using IVec = __m256i;
using FVec = __m256;
constexpr int kIntLanes = 8;
inline IVec load_codes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store_codes(uint8_t* p, IVec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline IVec bytes(int8_t b) { return _mm256_set1_epi8(b); }
inline IVec low_nibbles(IVec v) { return _mm256_and_si256(v, bytes(0x0F)); }
inline IVec high_nibbles(IVec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), bytes(0x0F)); }
inline IVec words(int32_t w) { return _mm256_set1_epi32(w); }
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec sub_times_128(IVec a, IVec b) { return _mm256_sub_epi32(a, _mm256_slli_epi32(b, 7)); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec to_float(IVec v) { return _mm256_cvtepi32_ps(v); }
inline FVec fp16s(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline FVec fset(float x) { return _mm256_set1_ps(x); }
inline FVec fmul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec ffma(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline void fstore(float* p, FVec v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int kIntVecs = kPanel / kIntLanes;  // vectors per panel: 2 or 4

inline IVec broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return words(v);
}

// A block's integer dot products: 4 products of unsigned codes u and signed codes s summed
// into each 32-bit lane. AVX-512 VNNI does it in one instruction; AVX2 makes 16-bit pair
// sums (vpmaddubsw; no operand here is large enough to saturate them) that a vpmaddwd adds
// up, for the nibbles once per block. Q8_0's codes are signed too: with VNNI the rows' codes
// go in unsigned, as a + 128, and 128 x each column's sum of codes comes off the block's sums
// (a + 128 would saturate vpmaddubsw's pairs, so AVX2 multiplies |w| by a with w's sign).
// The sums are exact integers every way, so all give the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kUnsignedRows = true;
inline IVec add_products(IVec sums, IVec u, IVec s) { return _mm512_dpbusd_epi32(sums, u, s); }
inline IVec nibble_sums(IVec sums) { return sums; }
#else
constexpr bool kUnsignedRows = false;
inline __m256i pair_sums(__m256i p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
// For the nibbles: 16-bit sums, at most 8 x 2 x 15 x 127.
inline IVec add_products(IVec sums, IVec u, IVec s) {
  return _mm256_add_epi16(sums, _mm256_maddubs_epi16(u, s));
}
inline IVec nibble_sums(IVec sums) { return pair_sums(sums); }
#endif

// For 5- and 6-bit codes: their high bits come in planes of bits, one a byte of codes.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// `value` in the bytes of vector v whose bit is set in `bits`.
inline IVec plane_bytes(const uint8_t* bits, int v, int8_t value) {
  uint64_t mask;
  std::memcpy(&mask, bits + 8 * v, 8);
  return _mm512_maskz_mov_epi8(_cvtu64_mask64(mask), bytes(value));
}
// Two steps of 4 products each, summed into 32-bit lanes.
inline IVec add_products2(IVec sums, IVec u0, IVec s0, IVec u1, IVec s1) {
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums, u0, s0), u1, s1);
}
inline IVec widen_scales(const uint8_t* p, bool is_signed) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}
inline IVec add32(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec sub32(IVec a, IVec b) { return _mm512_sub_epi32(a, b); }
inline IVec mul32(IVec a, IVec b) { return _mm512_mullo_epi32(a, b); }
inline IVec or_bytes(IVec a, IVec b) { return _mm512_or_si512(a, b); }
// Bytes m0[j] and m1[j] as the int16 pair of lane j.
inline IVec min_pairs(const uint8_t* m0, const uint8_t* m1) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m0));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m1));
  return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
}
// sums + each lane's int16 pair times the pair in w, summed: exact, the products are small.
inline IVec add_pair_products(IVec sums, IVec pairs, int32_t w) { return _mm512_dpwssd_epi32(sums, pairs, words(w)); }
constexpr int kKRows = 4;
#else
inline IVec plane_bytes(const uint8_t* bits, int v, int8_t value) {
  uint32_t mask;
  std::memcpy(&mask, bits + 4 * v, 4);
  // Byte b takes byte b / 8 of the mask, then tests its bit b % 8 (llama.cpp's bytes_from_bits_32).
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(mask)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                        _mm256_set1_epi64x(-1));
  return _mm256_and_si256(set, bytes(value));
}
// 16-bit pair sums of at most 2 x 2 x 63 x 127, within int16.
inline IVec add_products2(IVec sums, IVec u0, IVec s0, IVec u1, IVec s1) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline IVec widen_scales(const uint8_t* p, bool is_signed) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}
inline IVec add32(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec sub32(IVec a, IVec b) { return _mm256_sub_epi32(a, b); }
inline IVec mul32(IVec a, IVec b) { return _mm256_mullo_epi32(a, b); }
inline IVec or_bytes(IVec a, IVec b) { return _mm256_or_si256(a, b); }
inline IVec min_pairs(const uint8_t* m0, const uint8_t* m1) {
  const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m0));
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m1));
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b));
}
inline IVec add_pair_products(IVec sums, IVec pairs, int32_t w) {
  return _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, words(w)));
}
constexpr int kKRows = 2;  // the sums and accumulators of more rows spill from 16 registers
#endif

// A tile's sums, vectors v0..v0+NV of MR rows, plus the bias into the columns below `cols`.
template <int MR, int NV>
void store_tile(const FVec (&acc)[MR][NV], int v0, const float* bias, float* out, int64_t N, int64_t cols) {
  for (int v = 0; v < NV; ++v) {
    const int64_t j = kIntLanes * (v0 + v);
    float lanes[MR][kIntLanes];
    for (int i = 0; i < MR; ++i) fstore(lanes[i], acc[i][v]);
    for (int64_t c = j; c < std::min(cols, j + kIntLanes); ++c)
      for (int i = 0; i < MR; ++i) out[i * N + c] = lanes[i][c - j] + (bias ? bias[c] : 0.f);
  }
}

// Rows x[0..MR) times the vectors v0..v0+NV of one panel (kIntLanes columns each); writes the
// columns below `cols` to out[0..MR).
template <int MR, int NV, int kBits, bool kZero>
void int_tile(const QuantizedRows& x, const uint8_t* panel, int v0, const float* bias, float* out, int64_t N,
              int64_t cols) {
  constexpr bool kNibbles = kBits < 8;
  const int64_t blocks = x.K / kBlock;
  FVec acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = fzero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * int_block_bytes(kBits, kZero);
    prefetch_ahead(block, int_block_bytes(kBits, kZero));
    // Vector v's codes for step h: the 32-byte groups of its 8-column groups, side by side.
    const uint8_t* codes = block + int_header(kBits, kZero) + 32 * (kIntLanes / 8) * v0;
    auto codes_at = [&](int h, int v) { return load_codes(codes + (32 * 4) * h + 32 * (kIntLanes / 8) * v); };
    const int8_t* a = x.codes + b * kBlock;
    IVec dot[MR][NV];
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) dot[i][v] = izero();
    if constexpr (kNibbles) {
      // Kept rolled: unrolled, GCC computes every product of the block before summing them
      // and spills them to the stack.
#pragma GCC unroll 1
      for (int h = 0; h < 4; ++h) {
        IVec lo[NV], hi[NV];
        for (int v = 0; v < NV; ++v) {
          const IVec raw = codes_at(h, v);
          lo[v] = low_nibbles(raw);
          hi[v] = high_nibbles(raw);
          if constexpr (kBits == 5) {  // fifth bits: 128 per nibble of a step, after the codes
            const uint8_t* fifth = block + int_header(kBits, kZero) + kBlock * kPanel / 2 + 2 * h * 16;
            lo[v] = or_bytes(lo[v], plane_bytes(fifth, v0 + v, 16));
            hi[v] = or_bytes(hi[v], plane_bytes(fifth + 16, v0 + v, 16));
          }
        }
        for (int i = 0; i < MR; ++i) {
          const IVec a0 = broadcast4(a + i * x.K + 8 * h), a1 = broadcast4(a + i * x.K + 8 * h + 4);
          for (int v = 0; v < NV; ++v)  // 5-bit codes would overflow AVX2's 16-bit sums
            dot[i][v] = kBits == 5 ? add_products2(dot[i][v], lo[v], a0, hi[v], a1)
                                   : add_products(add_products(dot[i][v], lo[v], a0), hi[v], a1);
        }
      }
    } else if constexpr (kUnsignedRows) {
      IVec column_sums[NV];
      for (int v = 0; v < NV; ++v) column_sums[v] = izero();
      for (int h = 0; h < 8; ++h) {
        IVec w[NV];
        for (int v = 0; v < NV; ++v) {
          w[v] = codes_at(h, v);
          column_sums[v] = add_products(column_sums[v], bytes(1), w[v]);
        }
        for (int i = 0; i < MR; ++i) {
          const IVec a4 = broadcast4(a + i * x.K + 4 * h);
          for (int v = 0; v < NV; ++v) dot[i][v] = add_products(dot[i][v], a4, w[v]);
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < NV; ++v) dot[i][v] = sub_times_128(dot[i][v], column_sums[v]);
    } else {
      for (int h = 0; h < 8; ++h) {
        IVec w[NV], magnitude[NV];
        for (int v = 0; v < NV; ++v) {
          w[v] = codes_at(h, v);
          magnitude[v] = _mm256_abs_epi8(w[v]);
        }
        for (int i = 0; i < MR; ++i) {
          const IVec a4 = broadcast4(a + i * x.K + 4 * h);
          for (int v = 0; v < NV; ++v)
            dot[i][v] = _mm256_add_epi32(
                dot[i][v], pair_sums(_mm256_maddubs_epi16(magnitude[v], _mm256_sign_epi8(a4, w[v]))));
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      const int64_t j = kIntLanes * (v0 + v);
      const FVec s = fp16s(block + 2 * j);
      constexpr bool kOffsets = kNibbles && !kZero;
      const FVec o = kOffsets ? fp16s(block + 2 * (kPanel + j)) : fzero();
      for (int i = 0; i < MR; ++i) {
        const int64_t row_block = i * blocks + b;
        IVec sums = kBits == 4 ? nibble_sums(dot[i][v]) : dot[i][v];
        // The zero point comes off on integers, as llama.cpp's signed codes q - 8 (q - 16) do.
        if constexpr (kZero) sums = sub32(sums, words(x.sums[row_block] << (kBits - 1)));
        acc[i][v] = ffma(to_float(sums), fmul(s, fset(x.scale[row_block])), acc[i][v]);
        if constexpr (kOffsets) acc[i][v] = ffma(o, fset(x.scaled_sum[row_block]), acc[i][v]);
      }
    }
  }
  store_tile(acc, v0, bias, out, N, cols);
}

// Tiles of 4 rows and 2 vectors of columns: 8 sums and as many accumulators, 4 vectors of
// codes and 2 of a row's codes, in the 16 registers of AVX2 (6 rows would fit the 32 of
// AVX-512 on paper, but GCC spills them to the stack, so 4 rows there too).
constexpr int kIntRows = 4;
constexpr int kTileVecs = 2;

template <int kBits, bool kZero, int... MR>
void int_panel(int rows, std::integer_sequence<int, MR...>, const QuantizedRows& x, const uint8_t* panel,
               const float* bias, float* out, int64_t N, int64_t cols) {
  using Fn = void (*)(const QuantizedRows&, const uint8_t*, int, const float*, float*, int64_t, int64_t);
  static constexpr Fn table[] = {int_tile<MR + 1, kTileVecs, kBits, kZero>...};
  if (rows == 1) {  // the whole panel at once: independent sums to overlap
    int_tile<1, kIntVecs, kBits, kZero>(x, panel, 0, bias, out, N, cols);
    return;
  }
  for (int v0 = 0; v0 < kIntVecs && kIntLanes * v0 < cols; v0 += kTileVecs)
    table[rows - 1](x, panel, v0, bias, out, N, cols);
}

template <int kBits, bool kZero>
void run_int(const QuantizedRows& x, const uint8_t* w, int64_t panel_size, const float* bias, float* out, int64_t M,
             int64_t N) {
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * kPanel;
      for (int64_t m = 0; m < M; m += kIntRows) {
        const int64_t at = m * (x.K / kBlock);
        const QuantizedRows rows{x.codes + m * x.K, x.scale + at, x.sums + at, x.scaled_sum + at, x.K};
        int_panel<kBits, kZero>(static_cast<int>(std::min<int64_t>(kIntRows, M - m)), std::make_integer_sequence<int, kIntRows>{},
                         rows, w + p * panel_size, bias ? bias + n : nullptr, out + m * N + n, N,
                         std::min(kPanel, N - n));
      }
    }
  });
}

// --- 8-bit activations on K-quant super-blocks (Q4_K, Q5_K, Q6_K): llama.cpp's Q8_K ---------
//
// llama.cpp multiplies the K-quants by rows rounded per 256 k (Q8_K): codes
// round(-127 x / x_max), x_max the entry of largest magnitude, and the scale d = 1 / (-127 /
// x_max). A super-block's dot product is then sums on integers: sum_j sc_j (q . a)_j over its
// sub-blocks, times d_w d_x in float, less dmin_w d_x sum_j m_j sum(a)_j for the mins (Q6_K:
// 32 sum(a) comes off each 16 k's sum, for its codes' offset of -32). This kernel makes the
// same integers, and adds each super-block's two float terms to its output in order, so its
// rows are batch invariant and the same bits on every CPU. The weights come as a table of
// panels (pack_k_quants below), since the parts of a fused matrix may be of
// different types: int64 [1 + 4 P] (P, then per panel its byte offset, type 0-2 = Q4_K, Q5_K,
// Q6_K, first output and outputs), then each panel's K/256 super-blocks:
//   header: the 32 rows' d (fp16); Q4_K/Q5_K then their dmin (fp16).
//   8 sub-blocks of 32 k: the rows' 6-bit scales and mins (uint8 [2][32]; Q6_K: int8 scales
//           [2][32], one per 16 k), the codes' low 4 bits in the 4-bit layout above, then their high bits (Q5_K
//           one plane, Q6_K two): per 8 k, low and high nibble and plane, 128 bits, bit b the
//           code of byte b of those 128 bytes.

constexpr int64_t kSuper = 256;  // k per super-block, and per activation scale

template <int kKind>  // 0, 1, 2: Q4_K, Q5_K, Q6_K, also their count of high bit planes
struct KLayout {
  static constexpr bool kMins = kKind < 2;
  static constexpr int64_t kHeader = (kMins ? 2 : 1) * kPanel * 2;
  static constexpr int64_t kScales = 2 * kPanel;  // sc and m, or Q6_K's two sc
  static constexpr int64_t kCodes = kBlock * kPanel / 2;
  static constexpr int64_t kPlane = kBlock * kPanel / 64;  // bytes of bits: a nibble of 8 k
  static constexpr int64_t kSubBytes = kScales + kCodes + 8 * kKind * kPlane;
  static constexpr int64_t kBytes = kHeader + kSuper / kBlock * kSubBytes;
};

struct Q8KRows {
  const int8_t* codes;    // [M, K]
  const float* d;         // [M, K/256]
  const int32_t* pairs;   // [M, K/64]: each 32 k's sum of codes (Q4_K and Q5_K's mins), two a
                          // 32-bit word as int16 (at most 32 x 127): low, then high half
  const int32_t* sums16;  // [M, K/16]: 32 x each 16 k's sum of codes (Q6_K's offset)
  int64_t K;
};

// x [M, K] -> Q8_K rows, as llama.cpp's quantize_row_q8_K rounds them.
void quantize_rows_q8k(const float* x, int64_t M, int64_t K, int8_t* codes, float* d, int32_t* pairs,
                       int32_t* sums16) {
  const int64_t supers = K / kSuper;
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t b = m0 * supers; b < m1 * supers; ++b) {
      const float* v = x + b * kSuper;
      int8_t* q = codes + b * kSuper;
      float amax = 0.f, max = 0.f;
      for (int64_t j = 0; j < kSuper; ++j) {
        const float ax = std::fabs(v[j]);
        if (ax > amax) {
          amax = ax;
          max = v[j];
        }
      }
      int sum16[kSuper / 16] = {};
      if (amax == 0.f) {
        std::memset(q, 0, kSuper);
        d[b] = 0.f;
      } else {
        const float iscale = -127.f / max;
        for (int64_t j = 0; j < kSuper; ++j) {
          q[j] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * v[j]))));
          sum16[j / 16] += q[j];
        }
        d[b] = 1.f / iscale;
      }
      for (int g = 0; g < kSuper / 16; ++g) sums16[b * (kSuper / 16) + g] = 32 * sum16[g];
      for (int p = 0; p < kSuper / kBlock / 2; ++p) {
        const int low = sum16[4 * p] + sum16[4 * p + 1], high = sum16[4 * p + 2] + sum16[4 * p + 3];
        pairs[b * (kSuper / kBlock / 2) + p] =
            static_cast<int32_t>(static_cast<uint32_t>(high) << 16 | static_cast<uint16_t>(low));
      }
    }
  });
}

// Vector v's codes of step h (8 k) of a sub-block as bytes: lo holds k 0-3 of the step, hi
// k 4-7, each code's low nibble with its high bits (kKind planes) put back.
template <int kKind>
inline void k_codes(const uint8_t* codes, int h, int v, IVec& lo, IVec& hi) {
  using L = KLayout<kKind>;
  const IVec raw = load_codes(codes + (32 * 4) * h + 32 * (kIntLanes / 8) * v);
  lo = low_nibbles(raw);
  hi = high_nibbles(raw);
  for (int bit = 0; bit < kKind; ++bit) {
    const uint8_t* lo_bits = codes + L::kCodes + ((2 * h) * kKind + bit) * L::kPlane;
    lo = or_bytes(lo, plane_bytes(lo_bits, v, static_cast<int8_t>(16 << bit)));
    hi = or_bytes(hi, plane_bytes(lo_bits + kKind * L::kPlane, v, static_cast<int8_t>(16 << bit)));
  }
}

// Bytes of a sub-block's codes spread by spread_k_super: per step and vector, lo and hi.
constexpr int64_t kSpreadSub = 4 * kIntVecs * 2 * sizeof(IVec);

// A super-block's codes spread to bytes (8 KB), for the row tiles of a batch to share:
// spreading Q5_K and Q6_K's high bits takes about as many instructions as a tile's products.
template <int kKind>
void spread_k_super(const uint8_t* super, uint8_t* out) {
  using L = KLayout<kKind>;
  prefetch_to_l2(super, L::kBytes);
  for (int s = 0; s < kSuper / kBlock; ++s) {
    const uint8_t* codes = super + L::kHeader + s * L::kSubBytes + L::kScales;
    for (int h = 0; h < 4; ++h)
      for (int v = 0; v < kIntVecs; ++v, out += 2 * sizeof(IVec)) {
        IVec lo, hi;
        k_codes<kKind>(codes, h, v, lo, hi);
        store_codes(out, lo);
        store_codes(out + sizeof(IVec), hi);
      }
  }
}

// Rows x[0..MR) times the vectors v0..v0+NV of one panel of type kKind; writes the columns
// below `cols` to out[0..MR). kSpread: the codes come from `spread`, the panel's super-blocks
// as spread_k_super gives them, one after the other.
template <int MR, int NV, int kKind, bool kSpread>
void k_tile(const Q8KRows& x, const uint8_t* panel, const uint8_t* spread, int v0, const float* bias, float* out,
            int64_t N, int64_t cols) {
  using L = KLayout<kKind>;
  const int64_t supers = x.K / kSuper;
  FVec acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = fzero();
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* super = panel + sb * L::kBytes;
    prefetch_to_l2(super, L::kHeader);
    IVec sumi[MR][NV];
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) sumi[i][v] = izero();
    for (int s = 0; s < kSuper / kBlock; ++s) {
      const uint8_t* sub = super + L::kHeader + s * L::kSubBytes;
      prefetch_to_l2(sub, L::kSubBytes);
      const uint8_t* codes = sub + L::kScales;
      const int8_t* a = x.codes + sb * kSuper + s * kBlock;
      // Q6_K's scales are per 16 k: two halves of 2 steps of 8 k; the others one of 4.
      constexpr int kHalves = L::kMins ? 1 : 2, kSteps = 4 / kHalves;
      for (int half = 0; half < kHalves; ++half) {
        IVec dot[MR][NV];
        for (int i = 0; i < MR; ++i)
          for (int v = 0; v < NV; ++v) dot[i][v] = izero();
#pragma GCC unroll 1
        for (int h = half * kSteps; h < (half + 1) * kSteps; ++h) {
          IVec lo[NV], hi[NV];
          for (int v = 0; v < NV; ++v) {
            if constexpr (kSpread) {
              const uint8_t* at = spread + (sb * (kSuper / kBlock) + s) * kSpreadSub +
                                  (h * kIntVecs + v0 + v) * 2 * sizeof(IVec);
              lo[v] = load_codes(at);
              hi[v] = load_codes(at + sizeof(IVec));
            } else {
              k_codes<kKind>(codes, h, v0 + v, lo[v], hi[v]);
            }
          }
          for (int i = 0; i < MR; ++i) {
            const IVec a0 = broadcast4(a + i * x.K + 8 * h), a1 = broadcast4(a + i * x.K + 8 * h + 4);
            for (int v = 0; v < NV; ++v) dot[i][v] = add_products2(dot[i][v], lo[v], a0, hi[v], a1);
          }
        }
        for (int v = 0; v < NV; ++v) {
          const IVec sc = widen_scales(sub + half * kPanel + kIntLanes * (v0 + v), !L::kMins);
          for (int i = 0; i < MR; ++i) {
            IVec d = dot[i][v];
            if constexpr (!L::kMins) d = sub32(d, words(x.sums16[i * (x.K / 16) + sb * (kSuper / 16) + 2 * s + half]));
            sumi[i][v] = add32(sumi[i][v], mul32(d, sc));
          }
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      const int64_t j = kIntLanes * (v0 + v);
      const FVec dw = fp16s(super + 2 * j);
      IVec mins[kSuper / 64];  // sub-blocks 2p and 2p + 1's mins of the columns, paired
      if constexpr (L::kMins)
        for (int p = 0; p < kSuper / 64; ++p) {
          const uint8_t* m = super + L::kHeader + 2 * p * L::kSubBytes + kPanel + j;
          mins[p] = min_pairs(m, m + L::kSubBytes);
        }
      for (int i = 0; i < MR; ++i) {
        const float dx = x.d[i * supers + sb];
        acc[i][v] = ffma(to_float(sumi[i][v]), fmul(dw, fset(dx)), acc[i][v]);
        if constexpr (L::kMins) {
          const int32_t* pairs = x.pairs + i * (x.K / 64) + sb * (kSuper / 64);
          IVec summ = izero();
          for (int p = 0; p < kSuper / 64; ++p) summ = add_pair_products(summ, mins[p], pairs[p]);
          acc[i][v] = ffma(to_float(summ), fmul(fp16s(super + 2 * (kPanel + j)), fset(-dx)), acc[i][v]);
        }
      }
    }
  }
  store_tile(acc, v0, bias, out, N, cols);
}

// Rows x[0..M) times one panel of type kKind, into out[0..M) from its first output on.
template <int kKind, int... MR>
void k_panel(std::integer_sequence<int, MR...>, const Q8KRows& x, int64_t M, const uint8_t* panel, const float* bias,
             float* out, int64_t N, int64_t cols) {
  using Fn = void (*)(const Q8KRows&, const uint8_t*, const uint8_t*, int, const float*, float*, int64_t, int64_t);
  static constexpr Fn direct[] = {k_tile<MR + 1, kTileVecs, kKind, false>...};
  static constexpr Fn spreads[] = {k_tile<MR + 1, kTileVecs, kKind, true>...};
  if (M == 1) {  // the whole panel at once: independent sums to overlap
    k_tile<1, kIntVecs, kKind, false>(x, panel, nullptr, 0, bias, out, N, cols);
    return;
  }
  // Spread once for every row tile, but for Q4_K, whose nibbles take fewer instructions than
  // the loads of spread codes. Kept between calls: no allocation per layer.
  thread_local std::vector<uint8_t> spread;
  const bool spreading = M > kKRows && kKind > 0;
  const int64_t supers = x.K / kSuper;
  if (spreading) {
    spread.resize(x.K / kBlock * kSpreadSub);
    for (int64_t sb = 0; sb < supers; ++sb)
      spread_k_super<kKind>(panel + sb * KLayout<kKind>::kBytes, spread.data() + sb * (kSuper / kBlock) * kSpreadSub);
  }
  for (int64_t m = 0; m < M; m += kKRows) {
    const Q8KRows rows{x.codes + m * x.K, x.d + m * supers, x.pairs + m * (x.K / 64), x.sums16 + m * (x.K / 16), x.K};
    const int n = static_cast<int>(std::min<int64_t>(kKRows, M - m));
    for (int v0 = 0; v0 < kIntVecs && kIntLanes * v0 < cols; v0 += kTileVecs)
      (spreading ? spreads : direct)[n - 1](rows, panel, spread.data(), v0, bias, out + m * N, N, cols);
  }
}

void run_k_int(const Q8KRows& x, const uint8_t* blob, const float* bias, float* out, int64_t M, int64_t N) {
  const auto* table = reinterpret_cast<const int64_t*>(blob);
  at::parallel_for(0, table[0], 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t* e = table + 1 + 4 * p;  // offset, type, first output, outputs
      const auto seq = std::make_integer_sequence<int, kKRows>{};
      const float* b = bias ? bias + e[2] : nullptr;
      with_k_kind(e[1], [&](auto k) { k_panel<decltype(k)::value>(seq, x, M, blob + e[0], b, out + e[2], N, e[3]); });
    }
  });
}


// --- Rows of the 8-bit-activation layouts as fp32, for a tied embedding's lookup ---------
// The values gguf dequantizes to, as the exact path gives them: fma(scale, code, offset).

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Column j's code for k (0-31) in a block's nibbles, with `planes` high bits after them.
inline int nibble_code(const uint8_t* codes, int64_t j, int64_t k, int planes) {
  const int64_t step = k / 8, half = k % 8 / 4, at = 32 * (j / 8) + 4 * (j % 8) + k % 4;
  int code = codes[128 * step + at] >> (4 * half) & 15;
  const uint8_t* bits = codes + kBlock * kPanel / 2 + (2 * step + half) * planes * 16;
  for (int p = 0; p < planes; ++p) code |= (bits[p * 16 + at / 8] >> (at % 8) & 1) << (4 + p);
  return code;
}

// Row j of a panel of 32-k blocks of `bytes` (one of the 8-bit-activation layouts).
void int8_row(const uint8_t* panel, int64_t bytes, int64_t j, float* out, int64_t K) {
  const bool zero = bytes == kNibbleZeroBlock || bytes == kFiveBitZeroBlock;
  const bool five = bytes == kFiveBitBlock || bytes == kFiveBitZeroBlock;
  for (int64_t b = 0; b < K / kBlock; ++b, out += kBlock) {
    const uint8_t* block = panel + b * bytes;
    const float scale = half_at(block + 2 * j);
    if (bytes == kByteBlock) {
      const auto* codes = reinterpret_cast<const int8_t*>(block + 2 * kPanel);
      for (int64_t k = 0; k < kBlock; ++k) out[k] = scale * codes[128 * (k / 4) + 32 * (j / 8) + 4 * (j % 8) + k % 4];
      continue;
    }
    const float offset = zero ? -(five ? 16.f : 8.f) * scale : half_at(block + 2 * (kPanel + j));
    const uint8_t* codes = block + int_header(five ? 5 : 4, zero);
    for (int64_t k = 0; k < kBlock; ++k)
      out[k] = std::fma(scale, static_cast<float>(nibble_code(codes, j, k, five)), offset);
  }
}

// Row j of a K-quant panel of the table (see KLayout).
template <int kKind>
void k_row(const uint8_t* panel, int64_t j, float* out, int64_t K) {
  using L = KLayout<kKind>;
  for (int64_t sb = 0; sb < K / kSuper; ++sb) {
    const uint8_t* super = panel + sb * L::kBytes;
    const float d = half_at(super + 2 * j);
    for (int s = 0; s < kSuper / kBlock; ++s, out += kBlock) {
      const uint8_t* sub = super + L::kHeader + s * L::kSubBytes;
      for (int64_t k = 0; k < kBlock; ++k) {
        float scale, offset;
        if constexpr (L::kMins) {
          scale = d * sub[j];
          offset = -(half_at(super + 2 * (kPanel + j)) * sub[kPanel + j]);
        } else {
          scale = d * static_cast<int8_t>(sub[k / 16 * kPanel + j]);
          offset = -32.f * scale;
        }
        out[k] = std::fma(scale, static_cast<float>(nibble_code(sub + L::kScales, j, k, kKind)), offset);
      }
    }
  }
}

// One super-block (256 k) of a panel's rows as the file stores them (rows past the matrix's
// last: zeros): d, and dmin, into the header both layouts share; the codes (0-63) and the
// 6-bit scales and mins (Q6_K: its 16 int8 scales), as llama.cpp's dequantize_row_q*_K reads
// them.
template <int kKind>  // 0, 1, 2: Q4_K, Q5_K, Q6_K
void unpack_k_super(const uint8_t* raw, int64_t rows, int64_t supers, int64_t s, uint8_t* header,
                    uint8_t (&codes)[kPanel][kSuper], uint8_t (&scales)[kPanel][16]) {
  constexpr int64_t kRaw = kKind == 0 ? 144 : kKind == 1 ? 176 : 210;  // a file block's bytes
  std::memset(codes, 0, sizeof codes);
  std::memset(scales, 0, sizeof scales);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* b = raw + (r * supers + s) * kRaw;
    uint8_t* q = codes[r];
    if constexpr (kKind == 2) {  // ql [128], qh [64], int8 scales [16], d
      std::memcpy(header + 2 * r, b + 208, 2);
      std::memcpy(scales[r], b + 192, 16);
      for (int half = 0; half < 2; ++half, q += 128)
        for (int l = 0; l < 32; ++l) {
          const uint8_t *ql = b + 64 * half + l, hi = b[128 + 32 * half + l];
          q[l] = (ql[0] & 15) | (hi & 3) << 4;
          q[l + 32] = (ql[32] & 15) | (hi >> 2 & 3) << 4;
          q[l + 64] = ql[0] >> 4 | (hi >> 4 & 3) << 4;
          q[l + 96] = ql[32] >> 4 | (hi >> 6) << 4;
        }
    } else {  // d, dmin, 6-bit scales and mins [12], (Q5_K: fifth bits [32]), nibbles [128]
      std::memcpy(header + 2 * r, b, 2);
      std::memcpy(header + 2 * kPanel + 2 * r, b + 2, 2);
      const uint8_t* sm = b + 4;
      for (int j = 0; j < 4; ++j) {
        scales[r][j] = sm[j] & 63;
        scales[r][8 + j] = sm[j + 4] & 63;
        scales[r][4 + j] = (sm[j + 8] & 15) | (sm[j] >> 6) << 4;
        scales[r][12 + j] = (sm[j + 8] >> 4) | (sm[j + 4] >> 6) << 4;
      }
      const uint8_t* qs = b + (kKind == 1 ? 48 : 16);
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          q[64 * c + l] = qs[32 * c + l] & 15;
          q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
      if constexpr (kKind == 1)
        for (int j = 0; j < 8; ++j)
          for (int l = 0; l < 32; ++l) q[32 * j + l] |= (b[16 + l] >> j & 1) << 4;
    }
  }
}

// A block of 32 k's scales and mins (Q6_K: the scales of its two halves), [2][32 rows].
void put_k_scales(int kKind, const uint8_t (&scales)[kPanel][16], int64_t j, uint8_t* dst) {
  for (int64_t r = 0; r < kPanel; ++r) {
    dst[r] = scales[r][kKind == 2 ? 2 * j : j];
    dst[kPanel + r] = scales[r][kKind == 2 ? 2 * j + 1 : 8 + j];
  }
}

// A panel of K-quant rows -> SuperBlocks' layout (for fp32 activations), super-block by
// super-block; `dst` is zeros.
template <int kKind>
void pack_super_panel(const uint8_t* raw, int64_t rows, int64_t supers, uint8_t* dst) {
  using W = SuperBlocks<kKind>;
  uint8_t codes[kPanel][kSuper], scales[kPanel][16];
  for (int64_t s = 0; s < supers; ++s, dst += W::kHeader + kSuper / kBlock * W::kBytes) {
    unpack_k_super<kKind>(raw, rows, supers, s, dst, codes, scales);
    for (int64_t j = 0; j < kSuper / kBlock; ++j) {
      uint8_t* block = dst + W::kHeader + j * W::kBytes;
      put_k_scales(kKind, scales, j, block);
      uint8_t *low = block + W::kScales, *high = low + kBlock * kPanel / 2;
      for (int64_t k = 0; k < kBlock; ++k) {
        const int64_t c = kBlock * j + k;
        for (int64_t r = 0; r < kPanel / 2; ++r) low[kPanel / 2 * k + r] = (codes[r][c] & 15) | codes[r + 16][c] << 4;
        for (int64_t r = 0; kKind > 0 && r < 8; ++r)  // byte r: rows r, r + 8, r + 16, r + 24
          for (int64_t q = 0; q < 4; ++q) high[8 * k + r] |= (codes[8 * q + r][c] >> 4) << (kKind * q);
      }
    }
  }
}

// A panel of K-quant rows -> KLayout's (for 8-bit activations); `dst` is zeros.
template <int kKind>
void pack_k_panel(const uint8_t* raw, int64_t rows, int64_t supers, uint8_t* dst) {
  using L = KLayout<kKind>;
  uint8_t codes[kPanel][kSuper], scales[kPanel][16];
  for (int64_t s = 0; s < supers; ++s, dst += L::kBytes) {
    unpack_k_super<kKind>(raw, rows, supers, s, dst, codes, scales);
    for (int64_t j = 0; j < kSuper / kBlock; ++j) {
      uint8_t* sub = dst + L::kHeader + j * L::kSubBytes;
      put_k_scales(kKind, scales, j, sub);
      // Byte 32 g + 4 r + t of [8 k (h)][half] is row 8 g + r's code for k 8 h + 4 half + t.
      uint8_t order[4][2][128];
      for (int h = 0; h < 4; ++h)
        for (int half = 0; half < 2; ++half)
          for (int row = 0; row < kPanel; ++row)
            std::memcpy(&order[h][half][4 * row], &codes[row][kBlock * j + 8 * h + 4 * half], 4);
      uint8_t* low = sub + L::kScales;  // the halves' low nibbles, a byte
      uint8_t* planes = low + L::kCodes;  // then each high bit, 32 bytes to a movemask
      for (int h = 0; h < 4; ++h) {
        for (int i = 0; i < 128; ++i) low[128 * h + i] = (order[h][0][i] & 15) | order[h][1][i] << 4;
        for (int half = 0; half < 2; ++half)
          for (int bit = 0; bit < kKind; ++bit, planes += 16)
            for (int c = 0; c < 4; ++c) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(order[h][half] + 32 * c));
              const uint32_t mask = _mm256_movemask_epi8(_mm256_slli_epi16(v, 3 - bit));  // bit 4 + bit to 7
              std::memcpy(planes + 4 * c, &mask, 4);
            }
      }
    }
  }
}

// The type of K-quant blocks of `bytes` (0-2: Q4_K, Q5_K, Q6_K), refusing any other.
int64_t k_kind(const torch::Tensor& blocks) {
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 3 && blocks.is_contiguous(),
              "K-quant blocks: uint8 [N, K/256, bytes], contiguous");
  const int64_t bytes = blocks.size(2), kind = bytes == 144 ? 0 : bytes == 176 ? 1 : bytes == 210 ? 2 : -1;
  TORCH_CHECK(kind >= 0, "blocks of ", bytes, " bytes are not Q4_K, Q5_K or Q6_K");
  return kind;
}

// A panel's bytes per super-block in a table of K-quant panels: KLayout's (8-bit activations,
// an int8 table) or SuperBlocks' (fp32 activations, a uint8 table).
int64_t k_panel_bytes(int64_t kind, bool int8) {
  if (int8) return kind == 0 ? KLayout<0>::kBytes : kind == 1 ? KLayout<1>::kBytes : KLayout<2>::kBytes;
  return kind == 0 ? Q4K::kHeader + 8 * Q4K::kBytes : kind == 1 ? Q5K::kHeader + 8 * Q5K::kBytes : Q6K::kHeader + 8 * Q6K::kBytes;
}

// K-quant rows (uint8 [N, K/256, bytes], the file's blocks) -> SuperBlocks' panels,
// uint8 [ceil(N/32), K/256, bytes].
torch::Tensor pack_super_blocks(const torch::Tensor& blocks) {
  const int64_t kind = k_kind(blocks), n = blocks.size(0), supers = blocks.size(1), panels = (n + kPanel - 1) / kPanel;
  const int64_t bytes = k_panel_bytes(kind, false);
  auto out = torch::zeros({panels, supers, bytes}, torch::kUInt8);
  const uint8_t* raw = blocks.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* rows = raw + p * kPanel * supers * blocks.size(2);
      uint8_t* dst = out.data_ptr<uint8_t>() + p * supers * bytes;
      const int64_t m = std::min(kPanel, n - p * kPanel);
      with_k_kind(kind, [&](auto k) { pack_super_panel<decltype(k)::value>(rows, m, supers, dst); });
    }
  });
  return out;
}

// K-quant matrices (uint8 [N_i, K/256, the file's bytes a block], each of Q4_K, Q5_K or Q6_K)
// one below the other -> a table of panels, each at a multiple of 64 bytes: int8 [bytes] in
// KLayout's for 8-bit activations, else uint8 [bytes] in SuperBlocks' (a fused matrix whose
// parts are of different types, as a Q4_K_M file's Q/K/V).
torch::Tensor pack_k_quants(const std::vector<torch::Tensor>& parts, bool int8) {
  struct Panel { int64_t part, kind, first, outputs, at; };
  std::vector<Panel> panels;
  TORCH_CHECK(!parts.empty(), "no matrix to pack");
  const int64_t supers = parts[0].size(1);
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& p = parts[i];
    const int64_t kind = k_kind(p);
    TORCH_CHECK(p.size(1) == supers, "parts of a matrix of more than one K");
    for (int64_t row = 0; row < p.size(0); row += kPanel)
      panels.push_back({int64_t(i), kind, row, std::min(kPanel, p.size(0) - row), 0});
  }
  int64_t at = (8 * (1 + 4 * int64_t(panels.size())) + 63) / 64 * 64, first = 0;
  for (auto& e : panels) {
    e.at = at;
    at += (supers * k_panel_bytes(e.kind, int8) + 63) / 64 * 64;
  }
  auto out = torch::zeros({at}, int8 ? torch::kInt8 : torch::kUInt8);
  auto* w = static_cast<uint8_t*>(out.data_ptr());
  auto* table = reinterpret_cast<int64_t*>(w);
  table[0] = int64_t(panels.size());
  for (size_t p = 0; p < panels.size(); first += panels[p].outputs, ++p) {
    const int64_t entry[4] = {panels[p].at, panels[p].kind, first, panels[p].outputs};
    std::memcpy(table + 1 + 4 * p, entry, sizeof entry);
  }
  at::parallel_for(0, int64_t(panels.size()), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const Panel& e = panels[p];
      const uint8_t* raw = parts[e.part].data_ptr<uint8_t>() + e.first * supers * parts[e.part].size(2);
      with_k_kind(e.kind, [&](auto k) {
        constexpr int kKind = decltype(k)::value;
        int8 ? pack_k_panel<kKind>(raw, e.outputs, supers, w + e.at) : pack_super_panel<kKind>(raw, e.outputs, supers, w + e.at);
      });
    }
  });
  return out;
}

// The outputs of a table of K-quant panels (int8: for 8-bit activations), checking that each
// panel fits K and the table.
int64_t k_table_outputs(const torch::Tensor& packed, int64_t K) {
  const auto* table = static_cast<const int64_t*>(packed.data_ptr());
  TORCH_CHECK(K % kSuper == 0 && packed.numel() >= 8 && table[0] > 0 && table[0] <= (packed.numel() / 8 - 1) / 4,
              "weights: a table of K-quant panels for K a multiple of 256");
  int64_t n = 0;
  for (int64_t p = 0; p < table[0]; n += table[4 + 4 * p], ++p) {
    const int64_t *e = table + 1 + 4 * p, kind = e[1];
    const int64_t bytes = kind >= 0 && kind <= 2 ? k_panel_bytes(kind, packed.scalar_type() == torch::kInt8) : 0;
    // Each panel ends where the next begins (the last, at the end), at a multiple of 64 bytes.
    const int64_t end = p + 1 < table[0] ? e[4] : packed.numel();
    TORCH_CHECK(kind >= 0 && kind <= 2 && e[0] >= 8 * (1 + 4 * table[0]) &&
                    e[0] + (K / kSuper * bytes + 63) / 64 * 64 == end && e[2] == n && e[3] > 0 && e[3] <= kPanel,
                "weights: panel ", p, " of the K-quant table does not fit K ", K);
  }
  return n;
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
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N, "bias: [N] fp32");
    b = bias->data_ptr<float>();
  }
  const auto xc = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (packed.scalar_type() == torch::kInt8 && packed.dim() == 1 && packed.is_contiguous()) {  // 8-bit activations, K-quants
    const auto* blob = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
    TORCH_CHECK(k_table_outputs(packed, K) == N, "weights: a K-quant table of other than ", N, " outputs");
    if (M == 0) return out;
    thread_local std::vector<int8_t> codes;
    thread_local std::vector<float> scales;
    thread_local std::vector<int32_t> sums;
    const int64_t supers = K / kSuper;
    codes.resize(M * K);
    scales.resize(M * supers);
    sums.resize(M * (K / 64) + M * (K / 16));
    int32_t* sums16 = sums.data() + M * (K / 64);
    quantize_rows_q8k(xc.data_ptr<float>(), M, K, codes.data(), scales.data(), sums.data(), sums16);
    const Q8KRows rows{codes.data(), scales.data(), sums.data(), sums16, K};
    run_k_int(rows, blob, b, out.data_ptr<float>(), M, N);
    return out;
  }
  if (blocks && packed.dim() == 1 && packed.is_contiguous()) {  // fp32 activations, a table of K-quants
    TORCH_CHECK(k_table_outputs(packed, K) == N, "weights: a K-quant table of other than ", N, " outputs");
    if (M > 0) run_super_table(xc.data_ptr<float>(), packed.data_ptr<uint8_t>(), b, out.data_ptr<float>(), M, N, K);
    return out;
  }
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == (N + kPanel - 1) / kPanel,
              "weights: one panel per 32 rows, contiguous");
  const int64_t panel_size = packed.size(1) * packed.size(2);
  if (packed.scalar_type() == torch::kInt8) {  // 8-bit activations
    const int64_t bytes = packed.size(2);
    TORCH_CHECK(K % kBlock == 0 && packed.size(1) == K / kBlock && is_int_block(bytes),
                "weights: [N/32, K/32, 576, 640, 704, 768 or 1088] (blocks for 8-bit activations) for this K");
    if (M == 0) return out;
    // The caller's thread keeps these between calls: at one row a layer's call is so short
    // that allocating them at every call would be a large part of it.
    thread_local std::vector<int8_t> codes;
    thread_local std::vector<float> scales;
    thread_local std::vector<int32_t> sums;
    codes.resize(M * K);
    scales.resize(2 * M * (K / kBlock));
    sums.resize(M * (K / kBlock));
    float* scaled_sums = scales.data() + M * (K / kBlock);
    quantize_rows(xc.data_ptr<float>(), M, K, kUnsignedRows && bytes == kByteBlock, codes.data(), scales.data(),
                  sums.data(), scaled_sums);
    const QuantizedRows rows{codes.data(), scales.data(), sums.data(), scaled_sums, K};
    const auto* w = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
    float* o = out.data_ptr<float>();
    if (bytes == kNibbleBlock)
      run_int<4, false>(rows, w, panel_size, b, o, M, N);
    else if (bytes == kNibbleZeroBlock)
      run_int<4, true>(rows, w, panel_size, b, o, M, N);
    else if (bytes == kFiveBitBlock)
      run_int<5, false>(rows, w, panel_size, b, o, M, N);
    else if (bytes == kFiveBitZeroBlock)
      run_int<5, true>(rows, w, panel_size, b, o, M, N);
    else
      run_int<8, false>(rows, w, panel_size, b, o, M, N);
    return out;
  }
  // A layout of blocks is told by its bytes per group of blocks (one block, or a super-block).
  auto run_blocks = [&](auto format) {
    using W = decltype(format);
    if (!blocks || packed.size(2) != W::kHeader + W::kGroup * W::kBytes) return false;
    TORCH_CHECK(K % (kBlock * W::kGroup) == 0 && packed.size(1) == K / (kBlock * W::kGroup),
                "weights: [N/32, K/", kBlock * W::kGroup, ", ", packed.size(2), "] blocks for this K");
    if (M > 0)
      run(xc.data_ptr<float>(), reinterpret_cast<const W*>(packed.data_ptr<uint8_t>()), panel_size, b,
          out.data_ptr<float>(), M, N, K);
    return true;
  };
  if (run_blocks(Codes8{}) || run_blocks(Codes8H{}) || run_blocks(Codes4F{}) || run_blocks(Codes4{}) ||
      run_blocks(Q4K{}) || run_blocks(Q5K{}) || run_blocks(Q6K{}))
    return out;
  TORCH_CHECK(!blocks, "weights: blocks of [N/32, K/32, 1536, 1280, 768 or 640] or [N/32, K/256, 6784, 6720 or 4736] bytes");
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == kPanel, "weights: [N/32, K, 32] (fp32, bf16, fp16) for this K");
  if (M == 0) return out;
  if (packed.scalar_type() == torch::kFloat32)
    run(xc.data_ptr<float>(), packed.data_ptr<float>(), panel_size, b, out.data_ptr<float>(), M, N, K);
  else if (packed.scalar_type() == torch::kBFloat16)
    run(xc.data_ptr<float>(), packed.data_ptr<at::BFloat16>(), panel_size, b, out.data_ptr<float>(), M, N, K);
  else if (packed.scalar_type() == torch::kHalf)
    run(xc.data_ptr<float>(), packed.data_ptr<at::Half>(), panel_size, b, out.data_ptr<float>(), M, N, K);
  else
    TORCH_CHECK(false, "weights: fp32, bf16, fp16 or blocks (uint8)");
  return out;
}

// packed_rows of weights packed for 8-bit activations: a table of K-quant panels, or blocks of 32.
torch::Tensor int8_rows(const torch::Tensor& packed, const torch::Tensor& ids, int64_t K) {
  TORCH_CHECK(packed.is_contiguous() && (packed.dim() == 1 || packed.dim() == 3), "weights: int8 blocks, contiguous");
  const auto idc = ids.contiguous();
  const int64_t n = idc.numel(), *id = idc.data_ptr<int64_t>();
  const auto* w = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
  const int64_t* table = reinterpret_cast<const int64_t*>(w);  // K-quants: panels, in order
  TORCH_CHECK(packed.dim() == 1 || (packed.size(1) == K / kBlock && K % kBlock == 0 && is_int_block(packed.size(2))),
              "weights: blocks for 8-bit activations of another K, or of no layout");
  const int64_t rows = packed.dim() == 1 ? k_table_outputs(packed, K) : packed.size(0) * kPanel;
  const int64_t panels = packed.dim() == 1 ? table[0] : 0;
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < rows, "row ", id[i], " is out of range");
  auto out = torch::empty({n, K}, torch::kFloat32);
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* row = out.data_ptr<float>() + i * K;
      if (packed.dim() == 3) {
        int8_row(w + id[i] / kPanel * packed.size(1) * packed.size(2), packed.size(2), id[i] % kPanel, row, K);
        continue;
      }
      // The last panel whose first output is at most the row.
      int64_t lo = 0, hi = panels - 1;
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (table[3 + 4 * mid] <= id[i]) lo = mid; else hi = mid - 1;
      }
      const int64_t* e = table + 1 + 4 * lo;
      const int64_t j = id[i] - e[2];
      with_k_kind(e[1], [&](auto k) { k_row<decltype(k)::value>(w + e[0], j, row, K); });
    }
  });
  return out;
}

// A tied embedding's lookup, from the output layer's blocks: one copy of the matrix serves both.
torch::Tensor packed_rows(const torch::Tensor& packed, const torch::Tensor& ids, int64_t K) {
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1, "ids: [n] int64");
  if (packed.scalar_type() == torch::kInt8) return int8_rows(packed, ids, K);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 3,
              "weights: blocks, contiguous");
  const auto idc = ids.contiguous();
  const int64_t n = idc.numel(), rows = packed.size(0) * kPanel, panel_size = packed.size(1) * packed.size(2);
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < rows, "row ", id[i], " is out of range");
  auto out = torch::empty({n, K}, torch::kFloat32);
  auto decode = [&](auto format) {
    using W = decltype(format);
    if (packed.size(2) != W::kHeader + W::kGroup * W::kBytes) return false;
    TORCH_CHECK(K % (kBlock * W::kGroup) == 0 && packed.size(1) == K / (kBlock * W::kGroup), "blocks for another K");
    const auto* w = reinterpret_cast<const W*>(packed.data_ptr<uint8_t>());
    at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        decode_row(w + id[i] / kPanel * panel_size, id[i] % kPanel, out.data_ptr<float>() + i * K, K);
    });
    return true;
  };
  TORCH_CHECK(decode(Codes8{}) || decode(Codes8H{}) || decode(Codes4F{}) || decode(Codes4{}) || decode(Q4K{}) ||
                  decode(Q5K{}) || decode(Q6K{}),
              "weights: not a layout of blocks");
  return out;
}

// Kernels let the GIL go: the server's event loop runs during a step, not after it.
constexpr py::call_guard<py::gil_scoped_release> kReleaseGil{};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "x @ weight.T + bias, each row independent of the others", kReleaseGil);
  m.def("packed_rows", &packed_rows, "rows of a packed weight of blocks, as fp32", kReleaseGil);
  m.def("pack_super_blocks", &pack_super_blocks, "K-quant blocks in panels, for fp32 activations", kReleaseGil);
  m.def("pack_k_quants", &pack_k_quants, "K-quant matrices, one below the other, as a table of panels (int8: for 8-bit activations)", kReleaseGil);
  // For fused.cpp's decode_layers, which calls it without going through Python.
  m.attr("packed_linear_fn") = py::capsule(reinterpret_cast<void*>(&packed_linear), "kvfence.packed_linear");
}
