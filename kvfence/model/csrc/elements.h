// Pool and activation elements (fp32, bf16, fp8 e4m3) read and written as fp32, in a form the
// compiler vectorizes.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstdint>
#include <cstring>

template <typename To, typename From>
inline To bits_as(From x) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &x, sizeof to);
  return to;
}

inline float load(float x) { return x; }
inline float load(at::BFloat16 x) { return bits_as<float>(static_cast<uint32_t>(x.x) << 16); }  // bf16: an fp32's top half
inline float load(at::Float8_e4m3fn x) {  // selects that vectorize, where c10's conversion branches
  const uint32_t magnitude = x.x & 0x7f;
  const float value = magnitude < 8 ? static_cast<float>(magnitude) * 0x1p-9f  // subnormals: multiples of 2^-9
                                    : bits_as<float>((magnitude << 20) + (120u << 23));  // exponent rebiased 7 -> 127
  return x.x & 0x80 ? -value : value;  // 0x7f and 0xff (NaN) are never stored: writes saturate
}

inline void store(float* p, float x) { *p = x; }
inline void store(at::BFloat16* p, float x) {  // round to nearest even; activations are finite
  const uint32_t bits = bits_as<uint32_t>(x);
  p->x = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// fp8 e4m3 (bias 7, no infinities, largest 448), rounded to nearest even and saturated at +-448
// as torch's .clamp(-448, 448).to(torch.float8_e4m3fn): integer steps that vectorize, where
// c10's conversion branches.
inline void store(at::Float8_e4m3fn* p, float x) {
  const uint32_t sign = (bits_as<uint32_t>(x) >> 24) & 0x80;
  float a = std::fabs(x);
  a = a < 448.f ? a : 448.f;
  const uint32_t abits = bits_as<uint32_t>(a);
  // From 2^-6 on: 3 mantissa bits, rounded to nearest even, and the exponent rebiased 127 -> 7.
  const uint32_t normal = ((abits + 0x7ffff + ((abits >> 20) & 1)) >> 20) - (120 << 3);
  // Below: multiples of 2^-9, which adding 2^14 (whose last mantissa bit is worth 2^-9) rounds.
  const uint32_t subnormal = bits_as<uint32_t>(a + 16384.f) - bits_as<uint32_t>(16384.f);
  p->x = static_cast<uint8_t>(sign | (a < 0.015625f ? subnormal : normal));
}
