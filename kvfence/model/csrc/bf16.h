// fp32 and bf16 elements read and written as fp32, in a form the compiler vectorizes.
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

inline float load(float x) { return x; }
inline float load(at::BFloat16 x) {  // bf16 is the top half of an fp32
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
