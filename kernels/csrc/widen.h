// widen: a stored value as float32 (bfloat16: its bits are a float32's upper half; int8: a code), and
// dot_lanes, a float32 dot product with such values, for the kernels that read the embedding cache in
// either dtype (candidates.cpp, mol.cpp) or re-score int8 codes (rescore.cpp, without AVX-512). Both
// are static: each file compiles its own copy under its own floating-point flags (mol.cpp fuses
// multiply-adds, candidates.cpp does not).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace silverrec {

static inline float widen(float x) { return x; }
static inline float widen(int8_t x) { return float(x); }
static inline float widen(const c10::BFloat16& x) {
  uint16_t h;
  std::memcpy(&h, &x, 2);
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// <q, e> in float32, 16 independent lanes (vectorised without reassociating one sum), then the lanes
// summed as a tree (not a chain of 16 dependent adds).
template <typename E>
static inline float dot_lanes(const float* q, const E* e, int64_t n) {
  float lane[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lane[l] += q[i + l] * widen(e[i + l]);
  for (int l = 0; i < n; ++i, ++l) lane[l] += q[i] * widen(e[i]);
  for (int w = 8; w > 0; w >>= 1)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

}  // namespace silverrec
