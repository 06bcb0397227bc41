// widen: a stored value as float32 (bfloat16: its bits are a float32's upper half), for the kernels
// that read the embedding cache in either dtype (candidates.cpp, mol.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace silverrec {

inline float widen(float x) { return x; }
inline float widen(const c10::BFloat16& x) {
  uint16_t h;
  std::memcpy(&h, &x, 2);
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace silverrec
