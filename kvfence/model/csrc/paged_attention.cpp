// Decode attention read straight from the paged KV pool on the CPU.
//
// Each (request, KV head) walks its own block table slot by slot, so the context is read
// once and never copied into a gathered tensor: decode attention is bound by memory
// traffic, and the gather used to double it. Page numbers are bounds-checked against the
// pool before any read.
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

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kh = task % KVH, len = lens[b];
      const int64_t* pages = table + b * P;
      const float* qh = qd + (b * H + kh * G) * D;  // the G query heads sharing this KV head
      float* oh = od + (b * H + kh * G) * D;
      scores.resize(G * len);
      for (int64_t pos = 0; pos < len; ++pos) {
        const float* kr = kd + ((pages[pos / page_size] * page_size + pos % page_size) * KVH + kh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kr[d];
          scores[g * len + pos] = s * fscale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        const float m = *std::max_element(sg, sg + len);
        float sum = 0.f;
        for (int64_t pos = 0; pos < len; ++pos) {
          sg[pos] = std::exp(sg[pos] - m);
          sum += sg[pos];
        }
        const float inv = 1.f / sum;
        for (int64_t pos = 0; pos < len; ++pos) sg[pos] *= inv;
      }
      std::fill(oh, oh + G * D, 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const float* vr = vd + ((pages[pos / page_size] * page_size + pos % page_size) * KVH + kh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * len + pos];
          float* og = oh + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) og[d] += w * vr[d];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV pool");
}
