// The element-wise steps between the matmuls, fused so that each reads its rows once:
// PyTorch runs them as several ops, each a pass over memory with its own overhead, and at
// a batch of 512 rows they cost as much as attention. Rows are independent (one thread
// computes a whole row, the same way at any batch size), so batch invariance holds.
// Activations are fp32 or bf16 (rounded to nearest even); math is fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float load(float x) { return x; }
inline float load(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(at::BFloat16* p, float x) {  // round to nearest even; activations are finite
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  p->x = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

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
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t h = 0; h < H; ++h) squares += xr[h] * xr[h];
      const float inv = 1.f / std::sqrt(squares / H + eps);
      Out* orow = out + m * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) store(orow + h, xr[h] * inv * weight[h]);
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

}  // namespace

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "x += delta (in place), then rms_norm(x) * weight");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
}
