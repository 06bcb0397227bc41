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
// AVX2 without AVX512-VNNI (AMD before Zen 4, Intel client CPUs): no unsigned x signed byte dot
// is exact there (`vpmaddubsw` saturates int16 pairs: 255 * 127 * 2 > 32767), so both kernels
// sign-extend bytes to int16 (`vpmovsxbw`) and use `vpmaddwd` (int16 pairs -> int32, exact: at most
// 2 * 128 * 128): no flip, no correction.
//   RowTileKernel   per row, 16 bytes per step against the int16 query; a row whose D is not a
//                   multiple of 16 ends with one overlapping 16-byte load [D - 16, D) against a
//                   query copy whose already-counted positions are zero (never reads past the row;
//                   D < 16: plain loop). 16 row accumulators -> 16 sums by hadd trees.
//   LaneKernel      the queries as int16 pairs in a transposed [ceil(D / 2), 16] layout, each row
//                   sign-extended once into an int16 buffer whose 2-dim groups are broadcast.
//
// Without either at build time (the extension is built with -march=native) both fall back to
// plain loops that gcc vectorises.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SILVERREC_VNNI 1
#define SILVERREC_AVX2 0
#elif defined(__AVX2__)
#include <immintrin.h>
#define SILVERREC_VNNI 0
#define SILVERREC_AVX2 1
#else
#define SILVERREC_VNNI 0
#define SILVERREC_AVX2 0
#endif

namespace silverrec {

constexpr int kTile = 16;  // rows per RowTileKernel call, lanes per LaneKernel call

// One query prepared for RowTileKernel: s8 codes zero-padded to a multiple of 64 bytes.
struct PaddedQuery {
  std::vector<int8_t> q;  // [Dp], Dp = ceil(D / 64) * 64, zeros past D
  int32_t correction = 0;  // 128 * sum(q) (VNNI path), 0 for the plain loop
#if SILVERREC_AVX2
  std::vector<int16_t> q16;  // [Dp] q sign-extended (AVX2 path)
  int16_t tail16[16] = {};   // q[D - 16 + j] where D - 16 + j >= 16 * (D / 16), else 0 (D >= 16)
#endif

  PaddedQuery(const int8_t* codes, int64_t D) : q(((D + 63) / 64) * 64, 0) {
    std::memcpy(q.data(), codes, D);
    int32_t s = 0;
    for (int64_t d = 0; d < D; ++d) s += codes[d];
    correction = SILVERREC_VNNI ? 128 * s : 0;
#if SILVERREC_AVX2
    q16.assign(q.begin(), q.end());
    if (D >= 16)
      for (int j = 0; j < 16; ++j) {
        const int64_t d = D - 16 + j;
        tail16[j] = d >= 16 * (D / 16) ? int16_t(codes[d]) : int16_t(0);
      }
#endif
  }
};

#if SILVERREC_AVX2

// Sum of 16 int8 x int16 products as 8 int32 partial sums (exact).
static inline __m256i madd16(const int8_t* row, const int16_t* q) {
  return _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
}

// Lane i of the result: the sum of the 8 lanes of acc[i], i < 8.
static inline __m256i reduce8(const __m256i* acc) {
  const __m256i s01 = _mm256_hadd_epi32(acc[0], acc[1]), s23 = _mm256_hadd_epi32(acc[2], acc[3]);
  const __m256i s45 = _mm256_hadd_epi32(acc[4], acc[5]), s67 = _mm256_hadd_epi32(acc[6], acc[7]);
  const __m256i t0 = _mm256_hadd_epi32(s01, s23), t1 = _mm256_hadd_epi32(s45, s67);  // per 128-bit half: rows 0-3 / 4-7
  return _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20), _mm256_permute2x128_si256(t0, t1, 0x31));
}

static inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

#endif

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

#if SILVERREC_AVX2
  // <row, q> as 8 int32 partial sums (D >= 16).
  inline __m256i partial(const int8_t* row, const PaddedQuery& pq) const {
    const int64_t d = DC ? DC : D;
    const int64_t n16 = d / 16;
    const int16_t* q = pq.q16.data();
    __m256i a = madd16(row, q), b = _mm256_setzero_si256();  // two chains
    int64_t c = 1;
    for (; c + 1 < n16; c += 2) {
      a = _mm256_add_epi32(a, madd16(row + 16 * c, q + 16 * c));
      b = _mm256_add_epi32(b, madd16(row + 16 * c + 16, q + 16 * c + 16));
    }
    if (c < n16) a = _mm256_add_epi32(a, madd16(row + 16 * c, q + 16 * c));
    if (d % 16) b = _mm256_add_epi32(b, madd16(row + d - 16, pq.tail16));
    return _mm256_add_epi32(a, b);
  }
#endif

  // scores[i] = <row0 + i * D, q>, i < 16 (all 16 rows must be readable).
  inline void tile(const int8_t* row0, const PaddedQuery& pq, int32_t* scores) const {
#if SILVERREC_VNNI
    _mm512_storeu_si512(scores, tile(row0, pq));
#elif SILVERREC_AVX2
    if ((DC ? DC : D) < 16) {
      for (int i = 0; i < kTile; ++i) scores[i] = one(row0 + i * D, pq);
      return;
    }
    const int64_t d = DC ? DC : D;
    __m256i acc[8];
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 8; ++i) acc[i] = partial(row0 + (8 * h + i) * d, pq);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(scores + 8 * h), reduce8(acc));
    }
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
#if SILVERREC_AVX2
    if ((DC ? DC : D) >= 16) return hsum8(partial(row, pq));
#endif
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

#if SILVERREC_AVX2
  int64_t pairs;                  // ceil(D / 2)
  std::vector<int32_t> qp;        // [pairs, 16]: lane l = (q_l[2p], q_l[2p + 1]) as int16 (0 past D / unused lanes)
#endif

  LaneKernel(int64_t D_, const int8_t* const* queries, int nq)
      : D(DC ? DC : D_), groups((D + 3) / 4), qt(SILVERREC_AVX2 ? 0 : groups * kTile, 0) {
#if SILVERREC_AVX2
    pairs = (D + 1) / 2;
    qp.assign(pairs * kTile, 0);
    for (int l = 0; l < nq; ++l)
      for (int64_t d = 0; d < D; ++d)
        qp[(d / 2) * kTile + l] |= int32_t(uint32_t(uint16_t(int16_t(queries[l][d]))) << (16 * (d % 2)));
#else
    // group g of query l: its 4 bytes as one int32, each flipped to u8 (q + 128 = q ^ 0x80); the tail group
    // byte by byte (0 past D)
    const int64_t whole = D / 4;
    for (int l = 0; l < nq; ++l) {
      for (int64_t g = 0; g < whole; ++g) {
        uint32_t v;
        std::memcpy(&v, queries[l] + 4 * g, 4);
        qt[g * kTile + l] = int32_t(v ^ 0x80808080u);
      }
      for (int64_t d = 4 * whole; d < D; ++d) {
        uint32_t u = uint8_t(int32_t(queries[l][d]) + 128);
        qt[(d / 4) * kTile + l] |= int32_t(u << (8 * (d % 4)));
      }
    }
#endif
#if !SILVERREC_VNNI && !SILVERREC_AVX2
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
#elif SILVERREC_AVX2
    // each row sign-extended to int16 with vector stores only (later 4-byte loads forward from
    // them), zero-padded to a whole number of pairs: [d, d + 16) zeroed, then the last 16 bytes
    // [d - 16, d) overlapping (d < 16: through a zeroed copy)
    const int64_t d = DC ? DC : D;
    const int64_t np = DC ? (DC + 1) / 2 : pairs;
    constexpr int64_t kStack = 512;  // int16 per row on the stack; beyond: heap
    alignas(32) int16_t stack[4][kStack];
    std::vector<int16_t> heap;
    int16_t* buf[4];
    const int64_t width = ((d + 15) / 16) * 16 + 16;
    if (width <= kStack) {
      for (int r = 0; r < 4; ++r) buf[r] = stack[r];
    } else {
      heap.resize(4 * width);
      for (int r = 0; r < 4; ++r) buf[r] = heap.data() + r * width;
    }
    for (int r = 0; r < 4; ++r) {
      int64_t c = 0;
      for (; c + 16 <= d; c += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf[r] + c),
                            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + c))));
      if (c < d) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf[r] + d), _mm256_setzero_si256());
        if (d >= 16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf[r] + d - 16),
                              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + d - 16))));
        } else {
          alignas(16) int8_t tmp[16] = {};
          std::memcpy(tmp, rows[r], size_t(d));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf[r]), _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp))));
        }
      }
    }
    __m256i a0 = _mm256_setzero_si256(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    const int32_t *p0 = reinterpret_cast<const int32_t*>(buf[0]), *p1 = reinterpret_cast<const int32_t*>(buf[1]);
    const int32_t *p2 = reinterpret_cast<const int32_t*>(buf[2]), *p3 = reinterpret_cast<const int32_t*>(buf[3]);
    for (int64_t p = 0; p < np; ++p) {
      const __m256i qlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp.data() + p * kTile));
      const __m256i qhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp.data() + p * kTile + 8));
      __m256i v = _mm256_set1_epi32(p0[p]);
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(qlo, v));
      b0 = _mm256_add_epi32(b0, _mm256_madd_epi16(qhi, v));
      v = _mm256_set1_epi32(p1[p]);
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(qlo, v));
      b1 = _mm256_add_epi32(b1, _mm256_madd_epi16(qhi, v));
      v = _mm256_set1_epi32(p2[p]);
      a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(qlo, v));
      b2 = _mm256_add_epi32(b2, _mm256_madd_epi16(qhi, v));
      v = _mm256_set1_epi32(p3[p]);
      a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(qlo, v));
      b3 = _mm256_add_epi32(b3, _mm256_madd_epi16(qhi, v));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(scores[0]), a0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(scores[0] + 8), b0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(scores[1]), a1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(scores[1] + 8), b1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(scores[2]), a2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(scores[2] + 8), b2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(scores[3]), a3);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(scores[3] + 8), b3);
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
