// Decode attention read straight from the paged KV pool on the CPU.
//
// Each request walks its own block table page by page, so the context is read once and
// never copied into a gathered tensor: decode attention is bound by memory traffic, and
// the gather used to double it. Page numbers are bounds-checked against the pool before
// any read. Built with -ffast-math so that exp and the reductions vectorize.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor paged_decode_attention(const torch::Tensor& q,             // [B, H, D]
                                     const torch::Tensor& k_cache,       // [slots, KVH, D]
                                     const torch::Tensor& v_cache,       // [slots, KVH, D]
                                     const torch::Tensor& block_tables,  // [B, P] int64
                                     const torch::Tensor& lengths,       // [B] int64
                                     int64_t page_size, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32, "fp32 tensors only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && lengths.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64, "int64 tables");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(2), "shape mismatch");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && block_tables.size(0) == B && lengths.size(0) == B, "shape mismatch");
  const int64_t G = H / KVH, P = block_tables.size(1), num_pages = k_cache.size(0) / page_size;
  const int64_t* table = block_tables.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= P * page_size, "length outside the block table");
    for (int64_t p = 0; p < (lens[b] + page_size - 1) / page_size; ++p)
      TORCH_CHECK(table[b * P + p] >= 0 && table[b * P + p] < num_pages, "page outside the pool");
  }
  auto out = torch::empty_like(q);
  const float* qd = q.data_ptr<float>();
  const float* kd = k_cache.data_ptr<float>();
  const float* vd = v_cache.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One task per request: a slot's K (or V) row holds every KV head side by side, so a task
  // that takes all heads reads whole contiguous rows and no cache line twice.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b], row = KVH * D;
      const int64_t* pages = table + b * P;
      const float* qb = qd + b * H * D;
      float* ob = od + b * H * D;
      // Calls fn(row, position) for each of the request's slots in `cache`, page by page.
      auto for_each_slot = [&](const float* cache, auto&& fn) {
        for (int64_t start = 0; start < len; start += page_size) {
          const float* page = cache + pages[start / page_size] * page_size * row;
          const int64_t n = std::min(page_size, len - start);
          for (int64_t i = 0; i < n; ++i) fn(page + i * row, start + i);
        }
      };
      scores.resize(H * len);
      for_each_slot(kd, [&](const float* kr, int64_t pos) {
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qb + h * D;
          const float* k_head = kr + (h / G) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * k_head[d];
          scores[h * len + pos] = s * fscale;
        }
      });
      for (int64_t h = 0; h < H; ++h) {
        float* sh = scores.data() + h * len;
        const float m = *std::max_element(sh, sh + len);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t pos = 0; pos < len; ++pos) {
          sh[pos] = std::exp(sh[pos] - m);
          sum += sh[pos];
        }
        const float inv = 1.f / sum;
        for (int64_t pos = 0; pos < len; ++pos) sh[pos] *= inv;
      }
      std::fill(ob, ob + H * D, 0.f);
      for_each_slot(vd, [&](const float* vr, int64_t pos) {
        for (int64_t h = 0; h < H; ++h) {
          const float w = scores[h * len + pos];
          const float* vh = vr + (h / G) * D;
          float* oh = ob + h * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) oh[d] += w * vh[d];
        }
      });
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV pool");
}
