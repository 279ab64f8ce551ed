// Decode attention read straight from the paged KV pool on the CPU.
//
// Each request walks its own block table page by page, so the context is read once and
// never copied into a gathered tensor: decode attention is bound by memory traffic, and
// the gather used to double it. Page numbers are bounds-checked against the pool before
// any read. The pool holds fp32, bf16 or fp8 (e4m3); the math is fp32 every way. Built with
// -ffast-math so that exp and the reductions vectorize. With AVX-512 and 64-dim heads, the
// query heads' sums stay in registers across the context and dot products are summed 16 at
// a time, where the compiler's own loops kept the sums in memory.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "elements.h"

namespace {

// The pages lie anywhere in the pool: while one page is read, the one two pages on is
// fetched (a page fetched only one page ahead has not arrived from memory when it is read).
constexpr int64_t kPagesAhead = 2;

struct Shape {
  int64_t heads, kv_heads, group, dim, page_size;
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
// fp8 e4m3's bits moved into an fp16 (exponent bias 15 against 7: 2^-8 times the value,
// subnormals included), which the CPU widens to fp32; kUnit puts the 2^8 back once per sum,
// which gives the same bits as scaling every element.
inline __m512 load16(const at::Float8_e4m3fn* p) {
  const __m256i sign_extended = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(sign_extended, 7), _mm256_set1_epi16(-0x4080)));
}
template <typename T>
constexpr float kUnit = std::is_same_v<T, at::Float8_e4m3fn> ? 256.f : 1.f;

// Calls fn(std::integral_constant<int, n>{}, g0) for query heads [g0, g0 + n), n at most 4:
// 4 heads' sums (16 vectors) fill half the registers.
template <typename Fn>
void in_fours(int64_t G, Fn&& fn) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: fn(std::integral_constant<int, 1>{}, g0); break;
      case 2: fn(std::integral_constant<int, 2>{}, g0); break;
      case 3: fn(std::integral_constant<int, 3>{}, g0); break;
      default: fn(std::integral_constant<int, 4>{}, g0);
    }
  }
}

// out[i] = the sum of p[i]'s lanes, for 16 vectors at once: a tree that transposes as it adds
// (45 instructions, against 8 a vector summed alone, each waiting on the last).
inline __m512 lane_sums(const __m512 (&p)[16]) {
  __m512 c[4];  // c[j]'s 128-bit lane L: p[4j..4j+3]'s sums over their own lane L
  for (int j = 0; j < 4; ++j) {
    const __m512* v = p + 4 * j;
    const __m512 a01 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
    const __m512 a23 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
    c[j] = _mm512_add_ps(_mm512_shuffle_ps(a01, a23, 0x44), _mm512_shuffle_ps(a01, a23, 0xEE));
  }
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

// scores[g * len + pos] = scale q[g] . k[pos] for GC query heads of 64 dims: each key loaded
// once, and the dot products' lanes summed 16 positions at a time.
template <int GC, typename T, typename ForEachSlot>
void score_keys(const float* q, int64_t len, float scale, ForEachSlot&& for_each_slot, const T* k_cache,
                float* scores) {
  __m512 qv[GC][4], partial[GC][16];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < 4; ++c) qv[g][c] = _mm512_loadu_ps(q + g * 64 + c * 16);
  for_each_slot(k_cache, [&](const T* k, int64_t pos) {
    const __m512 k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
    const int i = pos % 16;
    for (int g = 0; g < GC; ++g)
      partial[g][i] = _mm512_add_ps(_mm512_fmadd_ps(qv[g][0], k0, _mm512_mul_ps(qv[g][1], k1)),
                                    _mm512_fmadd_ps(qv[g][2], k2, _mm512_mul_ps(qv[g][3], k3)));
    if (i == 15 || pos == len - 1) {
      for (int g = 0; g < GC; ++g) {
        for (int j = i + 1; j < 16; ++j) partial[g][j] = _mm512_setzero_ps();
        _mm512_mask_storeu_ps(scores + g * len + pos - i, static_cast<__mmask16>((2u << i) - 1),
                              _mm512_mul_ps(lane_sums(partial[g]), _mm512_set1_ps(scale * kUnit<T>)));
      }
    }
  });
}

// out[g] = sum over positions of w[g * len + pos] v[pos], for GC query heads of 64 dims, the
// GC x 4 sums held in registers across the whole context.
template <int GC, typename T, typename ForEachSlot>
void weigh_values(const float* w, int64_t len, ForEachSlot&& for_each_slot, const T* v_cache, float* out) {
  __m512 acc[GC][4];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for_each_slot(v_cache, [&](const T* v, int64_t pos) {
    const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
    for (int g = 0; g < GC; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * len + pos]);
      acc[g][0] = _mm512_fmadd_ps(wg, v0, acc[g][0]);
      acc[g][1] = _mm512_fmadd_ps(wg, v1, acc[g][1]);
      acc[g][2] = _mm512_fmadd_ps(wg, v2, acc[g][2]);
      acc[g][3] = _mm512_fmadd_ps(wg, v3, acc[g][3]);
    }
  });
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * 64 + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(kUnit<T>)));
}
#endif

// One KV head of one request: q and out are the [G, D] query heads that share it; its slots
// are read through `pages`. T is the pool's element (float, at::BFloat16, at::Float8_e4m3fn);
// kD is the head dimension fixed at compile time (the loops over it then vectorize without
// remainders), or 0 to take s.dim at run time.
template <typename T, int kD>
void attend(const float* q, const T* k_cache, const T* v_cache, int64_t kv_head, const int64_t* pages, int64_t len,
            const Shape& s, float scale, float* out, std::vector<float>& scores) {
  const int64_t D = kD ? kD : s.dim, G = s.group, row = s.kv_heads * D;
  // Calls fn(this head's D elements of a slot, position) for each of the request's slots in
  // `cache`, page by page.
  auto for_each_slot = [&](const T* cache, auto&& fn) {
    cache += kv_head * D;
    auto page_of = [&](int64_t p) { return cache + pages[p] * s.page_size * row; };
    auto fetch = [&](const T* slot) {
      for (int64_t c = 0; c < D; c += 64 / sizeof(T)) __builtin_prefetch(slot + c);
    };
    const int64_t num_pages = (len + s.page_size - 1) / s.page_size;
    for (int64_t p = 1; p < std::min(kPagesAhead, num_pages); ++p)
      for (int64_t i = 0; i < s.page_size; ++i) fetch(page_of(p) + i * row);
    for (int64_t p = 0; p < num_pages; ++p) {
      const T* page = page_of(p);
      const T* ahead = p + kPagesAhead < num_pages ? page_of(p + kPagesAhead) : nullptr;
      const int64_t n = std::min(s.page_size, len - p * s.page_size);
      for (int64_t i = 0; i < n; ++i) {
        if (ahead) fetch(ahead + i * row);
        fn(page + i * row, p * s.page_size + i);
      }
    }
  };
  scores.resize(G * len);
#if defined(__AVX512F__)
  if constexpr (kD == 64)
    in_fours(G, [&](auto n, int64_t g0) {
      score_keys<decltype(n)::value>(q + g0 * D, len, scale, for_each_slot, k_cache, scores.data() + g0 * len);
    });
  else
#endif
  // Each K row is loaded once for the G query heads that share it.
  for_each_slot(k_cache, [&](const T* k, int64_t pos) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * load(k[d]);
      scores[g * len + pos] = dot * scale;
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * len;
    const float m = *std::max_element(sg, sg + len);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t pos = 0; pos < len; ++pos) {
      sg[pos] = std::exp(sg[pos] - m);
      sum += sg[pos];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t pos = 0; pos < len; ++pos) sg[pos] *= inv;
  }
#if defined(__AVX512F__)
  if constexpr (kD == 64) {
    in_fours(G, [&](auto n, int64_t g0) {
      weigh_values<decltype(n)::value>(scores.data() + g0 * len, len, for_each_slot, v_cache, out + g0 * D);
    });
    return;
  }
#endif
  std::fill(out, out + G * D, 0.f);
  for_each_slot(v_cache, [&](const T* v, int64_t pos) {
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * len + pos];
      float* og = out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += w * load(v[d]);
    }
  });
}

// Runs every (request, KV head) of the batch, each whole on one thread, so that a result
// depends on neither the batch nor the thread count. The threads split the batch's positions
// times its KV heads, not its requests: lengths in a decode batch vary several-fold, so an
// even split of requests leaves some threads more to read than others, and a lone request
// still gets more than one thread. A task goes to the thread whose share holds its middle position.
template <typename T>
void attend_all(const float* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* lens,
                int64_t B, int64_t P, const Shape& s, float scale, float* out) {
  const auto run = s.dim == 64 ? attend<T, 64> : s.dim == 128 ? attend<T, 128> : attend<T, 0>;
  const int64_t tasks = B * s.kv_heads, group_size = s.group * s.dim;
  std::vector<int64_t> middle(tasks);
  int64_t total = 0;
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t len = lens[t / s.kv_heads];
    middle[t] = total + (len - 1) / 2;
    total += len;
  }
  // No more shares than tasks.
  at::parallel_for(0, total, (total + tasks - 1) / tasks, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t t = 0; t < tasks; ++t)
      if (middle[t] >= begin && middle[t] < end)
        run(q + t * group_size, k_cache, v_cache, t % s.kv_heads, tables + (t / s.kv_heads) * P, lens[t / s.kv_heads],
            s, scale, out + t * group_size, scores);
  });
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q,             // [B, H, D]
                                     const torch::Tensor& k_cache,       // [slots, KVH, D]
                                     const torch::Tensor& v_cache,       // [slots, KVH, D]
                                     const torch::Tensor& block_tables,  // [B, P] int64
                                     const torch::Tensor& lengths,       // [B] int64
                                     int64_t page_size, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == cache_type &&
                  (cache_type == torch::kFloat32 || cache_type == torch::kBFloat16 ||
                   cache_type == torch::kFloat8_e4m3fn),
              "fp32 queries and an fp32, bf16 or fp8 e4m3 pool only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && lengths.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64, "int64 tables");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(2), "shape mismatch");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && block_tables.size(0) == B && lengths.size(0) == B, "shape mismatch");
  const int64_t P = block_tables.size(1), num_pages = k_cache.size(0) / page_size;
  const int64_t* table = block_tables.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= P * page_size, "length outside the block table");
    for (int64_t p = 0; p < (lens[b] + page_size - 1) / page_size; ++p)
      TORCH_CHECK(table[b * P + p] >= 0 && table[b * P + p] < num_pages, "page outside the pool");
  }
  auto out = torch::empty_like(q);
  const Shape shape{H, KVH, H / KVH, D, page_size};
  const float fscale = static_cast<float>(scale);
  if (cache_type == torch::kFloat32)
    attend_all(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), table, lens, B, P, shape,
               fscale, out.data_ptr<float>());
  else if (cache_type == torch::kBFloat16)
    attend_all(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), table, lens,
               B, P, shape, fscale, out.data_ptr<float>());
  else
    attend_all(q.data_ptr<float>(), k_cache.data_ptr<at::Float8_e4m3fn>(), v_cache.data_ptr<at::Float8_e4m3fn>(),
               table, lens, B, P, shape, fscale, out.data_ptr<float>());
  return out;
}

// Kernels let the GIL go: the server's event loop runs during a step, not after it.
constexpr py::call_guard<py::gil_scoped_release> kReleaseGil{};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV pool", kReleaseGil);
  // For fused.cpp's decode_layers, which calls it without going through Python.
  m.attr("paged_decode_attention_fn") =
      py::capsule(reinterpret_cast<void*>(&paged_decode_attention), "kvfence.paged_decode_attention");
}
