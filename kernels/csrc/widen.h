// widen: a stored value as float32 (bfloat16: its bits are a float32's upper half; int8: a code), and
// dot_lanes, a float32 dot product with such values, for the kernels that read the embedding cache in
// either dtype (candidates.cpp, mol.cpp) or re-score int8 codes (rescore.cpp, without AVX-512); and
// dot_codes / dot_codes_x16, the re-score's dot of int8 codes (rescore.cpp, float_rank.cpp). All
// are static: each file compiles its own copy under its own floating-point flags (mol.cpp fuses
// multiply-adds, candidates.cpp does not).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// dot_lanes for two float32 vectors, the same bits, 16 lanes held in one AVX-512 register (the portable
// loop keeps them in memory): each chunk's products added to the lanes (multiply, then add: no FMA), the
// tail's missing lanes read as zeros, then the same tree (8, 4, 2, 1). The residual codes' cluster terms.
static inline float dot_lanes_f32(const float* q, const float* e, int64_t n) {
#if defined(__AVX512F__)
  __m512 lane = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) lane = _mm512_add_ps(lane, _mm512_mul_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(e + i)));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    lane = _mm512_mask_add_ps(lane, m, lane, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, q + i), _mm512_maskz_loadu_ps(m, e + i)));
  }
  const __m256 w8 = _mm256_add_ps(_mm512_castps512_ps256(lane), _mm512_extractf32x8_ps(lane, 1));
  const __m128 w4 = _mm_add_ps(_mm256_castps256_ps128(w8), _mm256_extractf128_ps(w8, 1));
  const __m128 w2 = _mm_add_ps(w4, _mm_movehl_ps(w4, w4));
  return _mm_cvtss_f32(_mm_add_ss(w2, _mm_shuffle_ps(w2, w2, 1)));
#else
  return dot_lanes(q, e, n);
#endif
}

// dot_lanes_f32 of up to 16 queries with one vector e, the same bits for each: the queries transposed
// (qt[d * 16 + j] = query j's value d; absent queries zeros), lane l of query j's sum held in lane j of
// acc[l], so there is no horizontal add and e is read once for all of them (the residual codes' cluster
// terms of one filter's queries: 16 x the clusters holding its passing rows). out[j] = <query j, e>.
static inline void dot_lanes_x16(const float* qt, const float* e, int64_t n, float* out) {
#if defined(__AVX512F__)
  __m512 acc[16];  // every index below is a constant once the loops unroll: the 16 stay in registers
#pragma GCC unroll 16
  for (int l = 0; l < 16; ++l) acc[l] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)  // whole chunks: no per-element test
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l)
      acc[l] = _mm512_add_ps(acc[l], _mm512_mul_ps(_mm512_loadu_ps(qt + (i + l) * 16), _mm512_set1_ps(e[i + l])));
  if (i < n)  // the tail's first n - i lanes
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l)
      if (i + l < n) acc[l] = _mm512_add_ps(acc[l], _mm512_mul_ps(_mm512_loadu_ps(qt + (i + l) * 16), _mm512_set1_ps(e[i + l])));
#pragma GCC unroll 4
  for (int w = 8; w > 0; w >>= 1)
#pragma GCC unroll 8
    for (int l = 0; l < w; ++l) acc[l] = _mm512_add_ps(acc[l], acc[l + w]);
  _mm512_storeu_ps(out, acc[0]);
#else
  for (int j = 0; j < 16; ++j) {
    float lane[16] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      for (int l = 0; l < 16; ++l) lane[l] += qt[(i + l) * 16 + j] * e[i + l];
    for (int l = 0; i < n; ++i, ++l) lane[l] += qt[i * 16 + j] * e[i];
    for (int w = 8; w > 0; w >>= 1)
      for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
    out[j] = lane[0];
  }
#endif
}

#if defined(__AVX512F__)
// 16 int8 codes as float32 lanes.
static inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

// <q, codes> in float32: 16 codes widened per AVX-512 register, two accumulators, one reduction at
// the end (dot_lanes's portable form keeps its 16 lanes in memory, which is slower). The re-score's dot
// (rescore.cpp) and the exact routes' float ranking (float_rank.cpp): the same bits in both.
static inline float dot_codes(const float* q, const int8_t* c, int64_t D) {
#if defined(__AVX512F__)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= D; i += 32) {
    acc0 = _mm512_add_ps(acc0, _mm512_mul_ps(_mm512_loadu_ps(q + i), widen16(c + i)));
    acc1 = _mm512_add_ps(acc1, _mm512_mul_ps(_mm512_loadu_ps(q + i + 16), widen16(c + i + 16)));
  }
  if (i + 16 <= D) {
    acc0 = _mm512_add_ps(acc0, _mm512_mul_ps(_mm512_loadu_ps(q + i), widen16(c + i)));
    i += 16;
  }
  float tail = 0.0f;
  for (; i < D; ++i) tail += q[i] * float(c[i]);
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + tail;
#else
  return dot_lanes(q, c, D);
#endif
}

#if defined(__AVX512F__)
// dot_codes of up to 16 queries with one row of codes, the same bits for each: the queries transposed
// (qt[d * 16 + j] = query j's value d; absent queries zeros), query j in lane j. Lane l of dot_codes's two
// accumulators becomes a vector over the queries (acc0's chunks first, held in memory while acc1's are
// summed: 16 registers at a time), added, then summed in _mm512_reduce_add_ps's tree (halves of 8, 4,
// then pairs), plus the scalar tail, as there. cf: D floats of scratch (the row widened once, each value
// then a broadcast memory operand). DC: D as a compile-time constant (0 = runtime D). out[j] =
// dot_codes(query j, c, D).
template <int DC>
static inline void dot_codes_x16(const float* qt, const int8_t* c, int64_t D_, float* cf, float* out) {
  const int64_t D = DC ? DC : D_;
  int64_t w = 0;
  for (; w + 16 <= D; w += 16) _mm512_storeu_ps(cf + w, widen16(c + w));
  for (; w < D; ++w) cf[w] = float(c[w]);
  const auto chunk = [&](__m512* acc, int64_t i) {  // acc[l] += q[i + l] * c[i + l]
    for (int l = 0; l < 16; ++l)
      acc[l] = _mm512_add_ps(acc[l], _mm512_mul_ps(_mm512_loadu_ps(qt + (i + l) * 16), _mm512_set1_ps(cf[i + l])));
  };
  alignas(64) float first[16 * 16];  // acc0's lanes
  __m512 v[16];
  for (int l = 0; l < 16; ++l) v[l] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= D; i += 32) chunk(v, i);
  const int64_t end32 = i;
  if (i + 16 <= D) {
    chunk(v, i);
    i += 16;
  }
  for (int l = 0; l < 16; ++l) _mm512_store_ps(first + l * 16, v[l]);
  for (int l = 0; l < 16; ++l) v[l] = _mm512_setzero_ps();
  for (int64_t j = 16; j + 16 <= end32; j += 32) chunk(v, j);
  __m512 tail = _mm512_setzero_ps();
  for (; i < D; ++i) tail = _mm512_add_ps(tail, _mm512_mul_ps(_mm512_loadu_ps(qt + i * 16), _mm512_set1_ps(cf[i])));
  for (int l = 0; l < 16; ++l) v[l] = _mm512_add_ps(_mm512_load_ps(first + l * 16), v[l]);
  for (int l = 0; l < 8; ++l) v[l] = _mm512_add_ps(v[8 + l], v[l]);  // _mm512_reduce_add_ps: upper half + lower
  for (int l = 0; l < 4; ++l) v[l] = _mm512_add_ps(v[4 + l], v[l]);
  const __m512 even = _mm512_add_ps(v[0], v[2]), odd = _mm512_add_ps(v[1], v[3]);
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(even, odd), tail));
}
#endif

}  // namespace silverrec
