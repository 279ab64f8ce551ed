// The element-wise steps between the matmuls (residual add + RMSNorm, SiLU x up, RoPE + the
// KV write) and the greedy pick after the last one, fused so that each reads its rows once:
// PyTorch runs them as several ops, each a pass over memory with its own overhead, which
// adds up to a large part of a step at large batches. Rows are independent (one thread
// computes a whole row, the same way at any batch size), so batch invariance holds.
// Activations are fp32 or bf16 (rounded to nearest even), the KV pool fp32, bf16 or fp8; math
// is fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "elements.h"

namespace {

template <typename Delta, typename Out>
void norm_rows(float* x, const Delta* delta, const float* weight, Out* out, int64_t M, int64_t H, float eps) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* xr = x + m * H;
      if (delta) {
        const Delta* dr = delta + m * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) xr[h] += load(dr[h]);
      }
      // llama.cpp's scale: the squares summed in double, then 1 / sqrt rounded once (written
      // with intrinsics, which -ffast-math would otherwise approximate with vrsqrtss). Off by
      // an ulp on some rows, the scale moves gguf-int8's 8-bit rounding of x, and logits by 0.1.
      double squares = 0.;
#pragma omp simd reduction(+ : squares)
      for (int64_t h = 0; h < H; ++h) squares += static_cast<double>(xr[h] * xr[h]);
      const __m128 mean = _mm_set_ss(static_cast<float>(squares / H) + eps);
      const float inv = _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(1.f), _mm_sqrt_ss(mean)));
      // x * inv, then times the weight, as llama.cpp rounds them: in two passes, which
      // -ffast-math cannot reorder into (x * weight) * inv.
      thread_local std::vector<float> scaled;
      scaled.resize(H);
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) scaled[h] = xr[h] * inv;
      Out* orow = out + m * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) store(orow + h, scaled[h] * weight[h]);
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t M, int64_t I) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* gate = gate_up + m * 2 * I;
      const T* up = gate + I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float g = load(gate[i]);
        store(out + m * I + i, g / (1.f + std::exp(-g)) * load(up[i]));
      }
    }
  });
}

// out[d] = x[d] * cos[d] + x[(d + D/2) % D] * sin[d], sin's first half negated: HF's
// x * cos + rotate_half(x) * sin.
template <typename In, typename Out>
inline void rotate(const In* x, const float* cos, const float* sin, Out* out, int64_t D) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) store(out + d, load(x[d]) * cos[d] + load(x[d + half]) * sin[d]);
#pragma omp simd
  for (int64_t d = half; d < D; ++d) store(out + d, load(x[d]) * cos[d] + load(x[d - half]) * sin[d]);
}

template <typename In, typename Cache>
void rope_rows(const In* qkv, const float* cos, const float* sin, Cache* k_cache, Cache* v_cache, const int64_t* slots,
               float* q, int64_t M, int64_t H, int64_t KVH, int64_t D) {
  const int64_t width = (H + 2 * KVH) * D;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const In* row = qkv + m * width;
      const float* c = cos + m * D;
      const float* s = sin + m * D;
      for (int64_t h = 0; h < H; ++h) rotate(row + h * D, c, s, q + (m * H + h) * D, D);
      Cache* k = k_cache + slots[m] * KVH * D;
      Cache* v = v_cache + slots[m] * KVH * D;
      for (int64_t h = 0; h < KVH; ++h) rotate(row + (H + h) * D, c, s, k + h * D, D);
      const In* vin = row + (H + KVH) * D;
#pragma omp simd
      for (int64_t d = 0; d < KVH * D; ++d) store(v + d, load(vin[d]));
    }
  });
}

// x (fp32) rounded in place to bf16's precision: x.to(bf16).to(fp32) without two new tensors.
void round_to_bf16(torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32");
  float* p = x.data_ptr<float>();
  // Over [begin, end) the loop vectorizes (a bound re-read from x.numel() at each step kept
  // it scalar).
  at::parallel_for(0, x.numel(), 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      at::BFloat16 rounded;
      store(&rounded, p[i]);
      p[i] = load(rounded);
    }
  });
}

}  // namespace

// qkv [M, (H + 2 KVH) D] (fp32 or bf16) -> RoPE'd queries [M, H, D] fp32; RoPE'd keys and the
// values go straight into the pool (fp32, bf16 or fp8 e4m3, [slots, KVH, D]) at slots[m].
torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                            torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& slots, int64_t num_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.is_contiguous(), "qkv: contiguous [M, (H + 2 KVH) D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches: contiguous [slots, KVH, D], alike");
  const int64_t M = qkv.size(0), KVH = k_cache.size(1), D = k_cache.size(2), H = num_heads;
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D && D % 2 == 0, "qkv: width is not (H + 2 KVH) D");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == M * D && sin.numel() == M * D, "cos, sin: fp32 [M, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == M, "slots: int64 [M]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(slot[m] >= 0 && slot[m] < k_cache.size(0), "slot outside the pool");
  auto q = torch::empty({M, H, D}, qkv.options().dtype(torch::kFloat32));
  auto run = [&](auto* in) {
    if (k_cache.scalar_type() == torch::kFloat32)
      rope_rows(in, cos.data_ptr<float>(), sin.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                slot, q.data_ptr<float>(), M, H, KVH, D);
    else if (k_cache.scalar_type() == torch::kBFloat16)
      rope_rows(in, cos.data_ptr<float>(), sin.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(),
                v_cache.data_ptr<at::BFloat16>(), slot, q.data_ptr<float>(), M, H, KVH, D);
    else if (k_cache.scalar_type() == torch::kFloat8_e4m3fn)
      rope_rows(in, cos.data_ptr<float>(), sin.data_ptr<float>(), k_cache.data_ptr<at::Float8_e4m3fn>(),
                v_cache.data_ptr<at::Float8_e4m3fn>(), slot, q.data_ptr<float>(), M, H, KVH, D);
    else
      TORCH_CHECK(false, "caches: fp32, bf16 or fp8 e4m3");
  };
  if (qkv.scalar_type() == torch::kFloat32)
    run(qkv.data_ptr<float>());
  else if (qkv.scalar_type() == torch::kBFloat16)
    run(qkv.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "qkv: fp32 or bf16");
  return q;
}

// x [M, H] fp32, updated in place to x + delta when delta is given (fp32 or bf16, [M, H]);
// returns rms_norm(x) * weight in `out_dtype` (fp32 or bf16).
torch::Tensor add_rms_norm(torch::Tensor x, const c10::optional<torch::Tensor>& delta, const torch::Tensor& weight,
                           double eps, at::ScalarType out_dtype) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "x: contiguous fp32 [M, H] on the CPU");
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == H, "weight: fp32 [H]");
  TORCH_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16, "out_dtype: fp32 or bf16");
  auto out = torch::empty({M, H}, x.options().dtype(out_dtype));
  const float e = static_cast<float>(eps);
  const float* w = weight.data_ptr<float>();
  auto run = [&](auto* d) {
    if (out_dtype == torch::kFloat32)
      norm_rows(x.data_ptr<float>(), d, w, out.data_ptr<float>(), M, H, e);
    else
      norm_rows(x.data_ptr<float>(), d, w, out.data_ptr<at::BFloat16>(), M, H, e);
  };
  if (!delta) {
    run(static_cast<const float*>(nullptr));
  } else {
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->is_contiguous(), "delta: contiguous [M, H]");
    if (delta->scalar_type() == torch::kFloat32)
      run(delta->data_ptr<float>());
    else if (delta->scalar_type() == torch::kBFloat16)
      run(delta->data_ptr<at::BFloat16>());
    else
      TORCH_CHECK(false, "delta: fp32 or bf16");
  }
  return out;
}

// gate_up [M, 2I] (gate, then up) -> silu(gate) * up [M, I], in gate_up's dtype.
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up: contiguous [M, 2I] on the CPU");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({M, I}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32)
    silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), M, I);
  else if (gate_up.scalar_type() == torch::kBFloat16)
    silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), M, I);
  else
    TORCH_CHECK(false, "gate_up: fp32 or bf16");
  return out;
}

// logits [M, V] fp32 -> int64 [M]: each row's first maximum, as torch.argmax picks it (which
// tracks indices in scalar code, slow over a vocabulary of tens of thousands). Sixteen lanes
// each keep their own maximum and its first index; then the lanes meet.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.scalar_type() == torch::kFloat32 && logits.size(1) > 0 && logits.size(1) < (1LL << 31),
              "logits: contiguous fp32 [M, V] on the CPU");
  const int64_t M = logits.size(0), V = logits.size(1);
  const float* x = logits.data_ptr<float>();
  auto out = torch::empty({M}, logits.options().dtype(torch::kInt64));
  int64_t* best = out.data_ptr<int64_t>();
  constexpr int kLanes = 16;
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * V;
      float top[kLanes];
      int32_t at[kLanes];
      std::fill(top, top + kLanes, row[0]);
      std::fill(at, at + kLanes, 0);
      int64_t v = 0;
      for (; v + kLanes <= V; v += kLanes)
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) {
          const bool higher = row[v + l] > top[l];  // strictly: a lane keeps its first maximum
          top[l] = higher ? row[v + l] : top[l];
          at[l] = higher ? static_cast<int32_t>(v + l) : at[l];
        }
      for (; v < V; ++v)
        if (row[v] > top[0]) top[0] = row[v], at[0] = static_cast<int32_t>(v);
      int b = 0;
      for (int l = 1; l < kLanes; ++l)
        if (top[l] > top[b] || (top[l] == top[b] && at[l] < at[b])) b = l;
      best[m] = at[b];
    }
  });
  return out;
}

using LinearFn = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t,
                                   const c10::optional<torch::Tensor>&);
using AttentionFn = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                      const torch::Tensor&, const torch::Tensor&, int64_t, double);

template <typename Fn>
Fn function_of(const py::capsule& capsule, const char* name) {
  TORCH_CHECK(capsule.name() && std::string(capsule.name()) == name, "expected the capsule ", name);
  return reinterpret_cast<Fn>(capsule.get_pointer());
}

// The layers of a decode-only step with fp32 linear layers: the kernel calls of
// LlamaModel.forward's loop, in the same order on the same tensors (so the same bits), in
// one call from Python instead of nine per layer. The linear and attention kernels live in
// their own modules (built with other flags) and are reached through the function
// pointers they export. Built once per model with its weights: `layers` holds 7 tensors per
// layer (attn_norm, packed qkv, qkv bias (empty: none), packed o, ffn_norm, packed gate_up,
// packed down), `out_features` the four linear widths. (Bound once, so that the tensors are
// not converted and handed over from Python at every step.)
class DecodeLayers {
 public:
  DecodeLayers(const py::capsule& linear_fn, const py::capsule& attention_fn, std::vector<torch::Tensor> layers,
               std::vector<int64_t> out_features, double scale, double eps, int64_t num_heads)
      : linear_(function_of<LinearFn>(linear_fn, "kvfence.packed_linear")),
        attention_(function_of<AttentionFn>(attention_fn, "kvfence.paged_decode_attention")),
        layers_(std::move(layers)), out_features_(std::move(out_features)), scale_(scale), eps_(eps),
        num_heads_(num_heads) {
    TORCH_CHECK(!layers_.empty() && layers_.size() % 7 == 0 && out_features_.size() == 4, "7 tensors per layer, 4 widths");
  }

  // x [B, hidden] is updated in place; returns the last layer's delta.
  torch::Tensor operator()(torch::Tensor x, const std::vector<std::tuple<torch::Tensor, torch::Tensor>>& kv_layers,
                           const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
                           const torch::Tensor& block_tables, const torch::Tensor& lengths, int64_t page_size) const {
    TORCH_CHECK(layers_.size() == 7 * kv_layers.size(), "one pool layer per model layer");
    const int64_t B = x.size(0);
    const c10::optional<torch::Tensor> none;
    c10::optional<torch::Tensor> delta;
    for (size_t l = 0; l < kv_layers.size(); ++l) {
      const torch::Tensor* w = &layers_[7 * l];
      const auto& [k_cache, v_cache] = kv_layers[l];
      const c10::optional<torch::Tensor> qkv_bias = w[2].numel() ? c10::optional<torch::Tensor>(w[2]) : none;
      auto h = add_rms_norm(x, delta, w[0], eps_, torch::kFloat32);
      auto q = rope_write_kv(linear_(h, w[1], out_features_[0], qkv_bias), cos, sin, k_cache, v_cache, slots,
                             num_heads_);
      auto attn = attention_(q, k_cache, v_cache, block_tables, lengths, page_size, scale_);
      // As the Python path, which hands the attention output on in the pool's dtype.
      if (k_cache.scalar_type() == torch::kBFloat16) round_to_bf16(attn);
      h = add_rms_norm(x, linear_(attn.view({B, -1}), w[3], out_features_[1], none), w[4], eps_, torch::kFloat32);
      delta = linear_(silu_mul(linear_(h, w[5], out_features_[2], none)), w[6], out_features_[3], none);
    }
    return *delta;
  }

 private:
  LinearFn linear_;
  AttentionFn attention_;
  std::vector<torch::Tensor> layers_;
  std::vector<int64_t> out_features_;
  double scale_, eps_;
  int64_t num_heads_;
};

// Kernels let the GIL go: the server's event loop runs during a step, not after it.
constexpr py::call_guard<py::gil_scoped_release> kReleaseGil{};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeLayers>(m, "DecodeLayers", "a decode-only step's layers with fp32 linear kernels, in one call")
      .def(py::init<const py::capsule&, const py::capsule&, std::vector<torch::Tensor>, std::vector<int64_t>, double,
                    double, int64_t>())
      .def("__call__", &DecodeLayers::operator(), kReleaseGil);
  m.def("argmax_rows", &argmax_rows, "each row's first maximum (torch.argmax(dim=-1))", kReleaseGil);
  m.def("add_rms_norm", &add_rms_norm, "x += delta (in place), then rms_norm(x) * weight", kReleaseGil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up", kReleaseGil);
  m.def("rope_write_kv", &rope_write_kv, "RoPE on queries and keys; keys and values written into the pool", kReleaseGil);
}
