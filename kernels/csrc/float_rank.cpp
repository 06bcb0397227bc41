// rank_in_float (scan.h FloatRanking): an exact route's few passing rows ranked by the float query.
//
// With the float re-score on, an exact route (whole pool, posting lists) whose filter passes at most
// kExactFloatRows rows hands all of them to the re-score (kernels/filtered_ivf_search.py): its answer is
// the float top k over every passing row, ties in the int8 scan's order. This computes that answer
// without the int8 scan, its top-k state and its sort, and without the re-score's second pass over
// scattered rows: each row is read once for all of a group's queries, scored with the re-score's own
// arithmetic (dot_codes: the same bits); then per query a key (the float's order-preserving int32 image,
// the row's position) per row, select_top and a radix sort. Exact float ties (equal codes, or chance) take the slow
// path: the int8 scores that order them in the re-score's list.
#include "tensor.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "scan.h"
#include "team.h"
#include "topk_state.h"
#include "widen.h"

namespace silverrec {
namespace {

inline int32_t int8_dot(const int8_t* q, const int8_t* c, int64_t D) {
  int32_t s = 0;
  for (int64_t d = 0; d < D; ++d) s += int32_t(q[d]) * int32_t(c[d]);
  return s;
}

// The float score of every row for each member query: f[i * 16 + j], the re-score's arithmetic (rescore.cpp
// one_query), so the same bits: dot_codes + constant (+ the cluster term). Rows split between the threads.
std::vector<float> float_scores(const FloatRanking& fr, const int8_t* codes, int64_t D, const std::vector<int64_t>& rows,
                                const int32_t* row_cluster, const float* terms, int64_t B, const int64_t* members,
                                int mn, bool threads) {
  const int64_t S = int64_t(rows.size());
  std::vector<float> f(S * 16);
  float constant[16] = {};
  for (int j = 0; j < mn; ++j) constant[j] = dot_lanes(fr.queries + members[j] * D, fr.dim_offset, D);
#if defined(__AVX512F__)
  std::vector<float> qt(D * 16, 0.0f);  // the folded queries transposed: qt[d * 16 + j]
  for (int j = 0; j < mn; ++j)
    for (int64_t d = 0; d < D; ++d) qt[d * 16 + j] = fr.folded[members[j] * D + d];
  auto dots = &dot_codes_x16<0>;  // compile-time widths for the common dimensions (as the scan's)
  switch (D) {
    case 64: dots = &dot_codes_x16<64>; break;
    case 96: dots = &dot_codes_x16<96>; break;
    case 128: dots = &dot_codes_x16<128>; break;
    case 256: dots = &dot_codes_x16<256>; break;
  }
#endif
  constexpr int64_t kAhead = 8;  // rows are scattered over the pool: fetch a few ahead
  team_for(0, S, threads ? 64 : S, [&](int64_t i0, int64_t i1) {
#if defined(__AVX512F__)
    std::vector<float> cf(D);
#endif
    for (int64_t i = i0; i < i1; ++i) {
      if (i + kAhead < S)
        for (int64_t o = 0; o < D; o += 64) __builtin_prefetch(codes + rows[i + kAhead] * D + o);
      const int8_t* c = codes + rows[i] * D;
      float* fi = f.data() + i * 16;
#if defined(__AVX512F__)
      dots(qt.data(), c, D, cf.data(), fi);
#else
      for (int j = 0; j < mn; ++j) fi[j] = dot_codes(fr.folded + members[j] * D, c, D);
#endif
      for (int j = 0; j < mn; ++j) {
        fi[j] += constant[j];
        if (terms) fi[j] += terms[row_cluster[i] * B + members[j]];
      }
    }
  });
  return f;
}

// Member j's (query b's) top `top` rows when equal floats sit in its top or across its edge: every row ordered by
// (float, int8 score, row), the order of the re-score's list.
void rank_ties(const float* f, int j, int64_t b, const int8_t* codes, int64_t D, const std::vector<int64_t>& rows,
               const int32_t* row_cluster, const int32_t* bias, int64_t B, const int8_t* qcodes, int64_t top, float* so,
               int64_t* ro) {
  struct Entry {
    float s;
    int32_t i8;
    int64_t i;
  };
  const float none = -std::numeric_limits<float>::infinity();
  std::vector<Entry> all;
  for (int64_t i = 0; i < int64_t(rows.size()); ++i) {
    const float s = f[i * 16 + j];
    if (!(s > none)) continue;
    int32_t i8 = int8_dot(qcodes + b * D, codes + rows[i] * D, D);
    if (bias) i8 += bias[row_cluster[i] * B + b];
    all.push_back({s, i8, i});
  }
  std::sort(all.begin(), all.end(), [](const Entry& x, const Entry& y) {
    return x.s != y.s ? x.s > y.s : x.i8 != y.i8 ? x.i8 > y.i8 : x.i < y.i;
  });
  for (int64_t t = 0; t < top; ++t) {
    so[t] = all[t].s;
    ro[t] = rows[all[t].i];
  }
}

}  // namespace

void rank_in_float(const FloatRanking& fr, const int8_t* codes, int64_t D, const std::vector<int64_t>& rows,
                   const int32_t* row_cluster, const float* terms, const int32_t* bias, int64_t B,
                   const int64_t* members, int mn, const int8_t* qcodes) {
  const int64_t S = int64_t(rows.size()), k = fr.k;
  const bool threads = S * mn >= kMinParallelKeys;  // rows split between the threads, then queries
  const std::vector<float> f = float_scores(fr, codes, D, rows, row_cluster, terms, B, members, mn, threads);
  const float none = -std::numeric_limits<float>::infinity();
  team_for(0, mn, threads ? 1 : mn, [&](int64_t j0, int64_t j1) {
    std::vector<int64_t> keys, scratch;
    std::vector<uint64_t> tmp;
    keys.reserve(S);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t b = members[j];
      keys.clear();
      for (int64_t i = 0; i < S; ++i) {
        const float s = f[i * 16 + j];
        if (s > none) keys.push_back(make_key(ordered_bits(s), i));  // NaN and -inf: dropped, as the re-score
      }
      // the top k: select_top, then a radix sort even of a short top (no mispredicted comparisons: faster than
      // std::sort of a short top, and than radix-sorting all survivors)
      const int64_t n = int64_t(keys.size()), top = std::min(k, n);
      select_top(keys.data(), n, top, scratch);
      bool tie = false;  // equal floats in the top, or across its edge: the int8 order decides
      if (top > 0 && top < n) {
        const int64_t low = *std::min_element(keys.begin(), keys.begin() + top);
        const int64_t out = *std::max_element(keys.begin() + top, keys.end());
        tie = (low >> 32) == (out >> 32);
      }
      radix_sort_keys(keys.data(), top, tmp, /*score_only=*/true);  // equal floats are ties: the slow path below
      for (int64_t t = 1; t < top && !tie; ++t) tie = (keys[t] >> 32) == (keys[t - 1] >> 32);
      float* so = fr.scores + b * k;
      int64_t* ro = fr.rows + b * k;
      if (tie) {  // rare
        rank_ties(f.data(), int(j), b, codes, D, rows, row_cluster, bias, B, qcodes, top, so, ro);
      } else {
        for (int64_t t = 0; t < top; ++t) {
          const int64_t i = key_row(keys[t]);
          so[t] = f[i * 16 + j];
          ro[t] = rows[i];
        }
      }
      std::fill(so + top, so + k, none);
      std::fill(ro + top, ro + k, kNoRow);
      fr.done[b] = true;
    }
  });
}

}  // namespace silverrec
