// int8 x int8 -> int32 dot products for the CPU scan (see scan.cpp).
//
// Two kernels, both exact (int32 accumulation, no saturation):
//
//   RowTileKernel   one query x 16 consecutive rows -> 16 scores (one zmm). AVX512-VNNI `vpdpbusd`
//                   needs one unsigned operand: the rows are flipped to u8 (c + 128, one xor per 64
//                   bytes) and the query stays s8, so   sum (c + 128) q = <c, q> + 128 * sum(q):
//                   the correction is one constant per query. 16 per-row accumulators are then
//                   reduced to one vector of 16 row sums by a shuffle tree.
//   LaneKernel      up to 16 queries x one row -> 16 scores (query lanes). Each 4-byte group of
//                   the row is broadcast to all lanes (the s8 operand, an embedded-broadcast
//                   memory operand), the queries are u8 (q + 128) in a transposed [D/4, 16] layout:
//                   sum (q + 128) c = <q, c> + 128 * sum(c): the correction is one number per row.
//                   No horizontal reduction, so this is ~3x fewer instructions per (row, query)
//                   when many queries scan the same rows (exact top-k, shared clusters).
//
// Without AVX512-VNNI at build time (the extension is built with -march=native) both fall back to
// plain loops that gcc vectorises.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SILVERREC_VNNI 1
#else
#define SILVERREC_VNNI 0
#endif

namespace silverrec {

constexpr int kTile = 16;  // rows per RowTileKernel call, lanes per LaneKernel call

// One query prepared for RowTileKernel: s8 codes zero-padded to a multiple of 64 bytes.
struct PaddedQuery {
  std::vector<int8_t> q;  // [Dp], Dp = ceil(D / 64) * 64, zeros past D
  int32_t correction = 0;  // 128 * sum(q) (VNNI path), 0 for the plain loop

  PaddedQuery(const int8_t* codes, int64_t D) : q(((D + 63) / 64) * 64, 0) {
    std::memcpy(q.data(), codes, D);
    int32_t s = 0;
    for (int64_t d = 0; d < D; ++d) s += codes[d];
    correction = SILVERREC_VNNI ? 128 * s : 0;
  }
};

#if SILVERREC_VNNI

// Reduce 16 vectors of 16 int32 partial sums to one vector whose lane i is the sum of acc[i].
static inline __m512i reduce16(const __m512i* acc) {
  __m512i s2[8], s4[4], s8[2];
  for (int i = 0; i < 8; ++i) {  // [x0+x2, y0+y2, x1+x3, y1+y3] per 128-bit lane
    __m512i x = acc[2 * i], y = acc[2 * i + 1];
    s2[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: partial sums of rows 4i .. 4i+3
    __m512i x = s2[2 * i], y = s2[2 * i + 1];
    s4[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes: [x.L0+x.L1, x.L2+x.L3, y.L0+y.L1, y.L2+y.L3]
    __m512i x = s4[2 * i], y = s4[2 * i + 1];
    s8[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_epi32(_mm512_shuffle_i32x4(s8[0], s8[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(s8[0], s8[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#endif

// One query against 16 consecutive rows. DC: D as a compile-time constant (0 = runtime D), so that
// the common widths get fully unrolled loops with constant row offsets.
template <int DC>
struct RowTileKernel {
  int64_t D;
  int64_t full;      // whole 64-byte chunks per row
  uint64_t tail;     // byte mask of the last partial chunk (0: none)

  explicit RowTileKernel(int64_t D_) : D(DC ? DC : D_), full(D / 64), tail(D % 64 ? (uint64_t{1} << (D % 64)) - 1 : 0) {}

#if SILVERREC_VNNI
  // Lanes i of the result: <row0 + i * D, q>, i < 16 (all 16 rows must be readable).
  inline __m512i tile(const int8_t* row0, const PaddedQuery& pq) const {
    constexpr int64_t kFull = DC / 64;
    constexpr bool kTail = DC % 64 != 0;
    const int64_t d = DC ? DC : D;
    const int64_t nfull = DC ? kFull : full;
    const bool has_tail = DC ? kTail : tail != 0;
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    const int8_t* q = pq.q.data();
    __m512i acc[kTile];
    for (int i = 0; i < kTile; ++i) {  // row-outer: one accumulator live per row, queries from L1
      const int8_t* p = row0 + i * d;
      __m512i a = _mm512_setzero_si512();
      for (int64_t c = 0; c < nfull; ++c)
        a = _mm512_dpbusd_epi32(a, _mm512_xor_si512(_mm512_loadu_si512(p + 64 * c), flip), _mm512_loadu_si512(q + 64 * c));
      if (has_tail)  // masked-off bytes load as 0 -> 0x80 after the flip, times a zero query byte
        a = _mm512_dpbusd_epi32(a, _mm512_xor_si512(_mm512_maskz_loadu_epi8(tail, p + 64 * nfull), flip),
                                _mm512_loadu_si512(q + 64 * nfull));
      acc[i] = a;
    }
    return _mm512_sub_epi32(reduce16(acc), _mm512_set1_epi32(pq.correction));
  }
#endif

  // scores[i] = <row0 + i * D, q>, i < 16 (all 16 rows must be readable).
  inline void tile(const int8_t* row0, const PaddedQuery& pq, int32_t* scores) const {
#if SILVERREC_VNNI
    _mm512_storeu_si512(scores, tile(row0, pq));
#else
    for (int i = 0; i < kTile; ++i) scores[i] = one(row0 + i * D, pq);
#endif
  }

  // <row, q> for a single row (sparse masks: cheaper than a tile for 1-3 allowed rows).
  inline int32_t one(const int8_t* row, const PaddedQuery& pq) const {
#if SILVERREC_VNNI
    __m512i acc = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    const int8_t* q = pq.q.data();
    for (int64_t c = 0; c < full; ++c)
      acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(row + 64 * c), flip), _mm512_loadu_si512(q + 64 * c));
    if (tail)
      acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_maskz_loadu_epi8(tail, row + 64 * full), flip),
                                _mm512_loadu_si512(q + 64 * full));
    return _mm512_reduce_add_epi32(acc) - pq.correction;
#else
    int32_t s = 0;
    const int8_t* q = pq.q.data();
    for (int64_t d = 0; d < D; ++d) s += int32_t(row[d]) * int32_t(q[d]);
    return s;
#endif
  }
};

// Up to 16 queries (lanes) against one row at a time. DC as in RowTileKernel.
template <int DC>
struct LaneKernel {
  int64_t D;
  int64_t groups;                 // ceil(D / 4)
  std::vector<int32_t> qt;        // [groups, 16]: lane l = 4 bytes of query l (u8 = q + 128; 0 past D / unused lanes)
  std::vector<int32_t> qplain;    // [16, D] fallback layout

  LaneKernel(int64_t D_, const int8_t* const* queries, int nq) : D(DC ? DC : D_), groups((D + 3) / 4), qt(groups * kTile, 0) {
    for (int l = 0; l < nq; ++l)
      for (int64_t d = 0; d < D; ++d) {
        uint32_t u = uint8_t(int32_t(queries[l][d]) + 128);
        qt[(d / 4) * kTile + l] |= int32_t(u << (8 * (d % 4)));
      }
#if !SILVERREC_VNNI
    qplain.assign(kTile * D, 0);
    for (int l = 0; l < nq; ++l)
      for (int64_t d = 0; d < D; ++d) qplain[l * D + d] = queries[l][d];
#endif
  }

#if SILVERREC_VNNI
  // Row sum of s8 codes.
  inline int32_t row_sum(const int8_t* row) const {
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    __m512i acc = _mm512_setzero_si512();
    const int64_t d = DC ? DC : D;
    int64_t c = 0, chunks = 0;
    for (; c + 64 <= d; c += 64, ++chunks)
      acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_xor_si512(_mm512_loadu_si512(row + c), flip), _mm512_setzero_si512()));
    if (c < d) {  // masked-off bytes become 0x80 = 128 after the flip: subtracted below with the rest
      const __mmask64 m = (uint64_t{1} << (d - c)) - 1;
      acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_xor_si512(_mm512_maskz_loadu_epi8(m, row + c), flip), _mm512_setzero_si512()));
      ++chunks;
    }
    return int32_t(_mm512_reduce_add_epi64(acc) - 128 * 64 * chunks);
  }

  // Group g of the row as an int32 (the tail group zero-padded; never reads past the row).
  inline int32_t group(const int8_t* row, int64_t g) const {
    const int64_t d = DC ? DC : D;
    int32_t v = 0;
    std::memcpy(&v, row + 4 * g, (4 * g + 4 <= d) ? 4 : size_t(d - 4 * g));
    return v;
  }
#endif

  // scores[r][l] = <row_r, query_l> for 4 rows at once (independent accumulator chains).
  inline void rows4(const int8_t* const* rows, int32_t (*scores)[kTile]) const {
#if SILVERREC_VNNI
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    const int64_t whole = (DC ? DC : D) / 4;
    const int8_t *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3];
    for (int64_t g = 0; g < whole; ++g) {
      const __m512i q = _mm512_loadu_si512(qt.data() + g * kTile);
      int32_t v0, v1, v2, v3;
      std::memcpy(&v0, r0 + 4 * g, 4);
      std::memcpy(&v1, r1 + 4 * g, 4);
      std::memcpy(&v2, r2 + 4 * g, 4);
      std::memcpy(&v3, r3 + 4 * g, 4);
      a0 = _mm512_dpbusd_epi32(a0, q, _mm512_set1_epi32(v0));
      a1 = _mm512_dpbusd_epi32(a1, q, _mm512_set1_epi32(v1));
      a2 = _mm512_dpbusd_epi32(a2, q, _mm512_set1_epi32(v2));
      a3 = _mm512_dpbusd_epi32(a3, q, _mm512_set1_epi32(v3));
    }
    if (whole < groups) {
      const __m512i q = _mm512_loadu_si512(qt.data() + whole * kTile);
      a0 = _mm512_dpbusd_epi32(a0, q, _mm512_set1_epi32(group(r0, whole)));
      a1 = _mm512_dpbusd_epi32(a1, q, _mm512_set1_epi32(group(r1, whole)));
      a2 = _mm512_dpbusd_epi32(a2, q, _mm512_set1_epi32(group(r2, whole)));
      a3 = _mm512_dpbusd_epi32(a3, q, _mm512_set1_epi32(group(r3, whole)));
    }
    _mm512_storeu_si512(scores[0], _mm512_sub_epi32(a0, _mm512_set1_epi32(128 * row_sum(r0))));
    _mm512_storeu_si512(scores[1], _mm512_sub_epi32(a1, _mm512_set1_epi32(128 * row_sum(r1))));
    _mm512_storeu_si512(scores[2], _mm512_sub_epi32(a2, _mm512_set1_epi32(128 * row_sum(r2))));
    _mm512_storeu_si512(scores[3], _mm512_sub_epi32(a3, _mm512_set1_epi32(128 * row_sum(r3))));
#else
    for (int r = 0; r < 4; ++r)
      for (int l = 0; l < kTile; ++l) {
        int32_t s = 0;
        for (int64_t d = 0; d < D; ++d) s += int32_t(rows[r][d]) * qplain[l * D + d];
        scores[r][l] = s;
      }
#endif
  }
};

}  // namespace silverrec
