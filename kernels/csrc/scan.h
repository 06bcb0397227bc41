// Fused CPU scan (scan.cpp) and the bloom filter evaluator (bloom.cpp): shared declarations.
#pragma once

#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "constants.h"
#include "search_args.h"
#include "threads.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace silverrec {

// Per-(query, cluster) score biases lie in [kBiasFloor, 0] (constants.h), so score + bias and threshold - bias
// never overflow int32.

// A bias in units (double) clamped to [kBiasFloor, 0], as an int32.
inline int32_t clamp_bias(double v) { return int32_t(std::max(double(kBiasFloor), std::min(0.0, v))); }

// The int32 bias of a cluster score for a query with the given shift and integer unit (kernels/common.py
// cluster_bias, bit for bit): round(score / unit) - round(shift / unit) in double, half to even, clamped to
// [kBiasFloor, 0].
inline int32_t cluster_bias(float score, float shift, float unit) {
  const double u = unit;
  return clamp_bias(std::nearbyint(double(score) / u) - std::nearbyint(double(shift) / u));
}

// cluster_bias of 16 scores at once, the same bits: out[i] = round(score[i] / u[i]) - rounded_shift[i] clamped,
// rounded_shift[i] = round(shift / u[i]) (the shift's half, computed once per query), u[i] = double(unit).
inline void cluster_bias_x16(const float* score, const double* rounded_shift, const double* u, int32_t* out) {
#if defined(__AVX512F__)
  for (int h = 0; h < 16; h += 8) {
    const __m512d s = _mm512_cvtps_pd(_mm256_loadu_ps(score + h));
    const __m512d r = _mm512_roundscale_pd(_mm512_div_pd(s, _mm512_loadu_pd(u + h)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d v = _mm512_sub_pd(r, _mm512_loadu_pd(rounded_shift + h));
    v = _mm512_max_pd(_mm512_set1_pd(double(kBiasFloor)), _mm512_min_pd(_mm512_setzero_pd(), v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + h), _mm512_cvttpd_epi32(v));
  }
#else
  for (int i = 0; i < 16; ++i)
    out[i] = clamp_bias(std::nearbyint(double(score[i]) / u[i]) - rounded_shift[i]);
#endif
}

// What the caller adds back to the scores for a shift: round(shift / unit) * unit (cluster_bias, bit for bit).
inline float shift_back(float shift, float unit) {
  const double u = unit;
  return float(std::nearbyint(double(shift) / u) * u);
}

// Per-(query, cluster) int32 score biases [B, nlist], any strides (a caller's table).
struct BiasTable {
  const int32_t* p = nullptr;  // null: no biases
  int64_t sb = 0, sc = 0;      // strides of query b and cluster c
  explicit operator bool() const { return p != nullptr; }
  int32_t operator()(int64_t b, int64_t c) const { return p[b * sb + c * sc]; }
};

// The checked table (int32 CPU, shape [B, nlist], values in [kBiasFloor, 0]); empty when absent.
BiasTable bias_table(const std::optional<at::Tensor>& bias, int64_t B, int64_t nlist);

// Device, dtype, rank and contiguity of a kernel argument (a TORCH_CHECK naming it).
inline void check(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == dim && t.is_contiguous(),
              name, ": expected a contiguous CPU tensor of ", dim, " dims and dtype ", dtype, ", got ",
              t.scalar_type(), " ", t.sizes());
}

// A row range of the codes and the queries that scan it: members [first, first + count) of
// ScanInput::member_query / member_word.
struct Segment {
  int64_t start, end, first, count;
};

struct ScanInput {
  const int8_t* qcodes;  // [B, D] int8 query codes
  const int8_t* codes;   // [N, D] int8 item codes
  int64_t B, D, N, k;
  std::vector<Segment> segments;      // visiting order
  std::vector<int64_t> member_query;  // [M] query of each member
  std::vector<int64_t> member_word;   // [M] word base into bitmask (unused without one)
  std::vector<int32_t> member_bias;   // [M] added to every score of member m (residual codes: its query's
                                      // cluster term, in [kBiasFloor, 0]); empty = none
  // residual codes, per row (segments whose rows mix clusters: filtered_topk's compact buffer): row r of
  // member m (query b = member_query[m]) scores dot + row_bias[row_cluster[r] * row_bias_stride + b]
  // (member_bias unused); cluster-major, so a row's queries read one short run
  const int32_t* row_cluster = nullptr;  // [N] cluster of each row, or null
  const int32_t* row_bias = nullptr;     // [nlist, row_bias_stride >= B]
  int64_t row_bias_stride = 0;
  const int64_t* bitmask = nullptr;   // flat words; row r of member m allowed iff bit (r & 63) of
                                      // bitmask[member_word[m] + (r >> 6)]
};

// kernels/common.py quantize_queries (ops.cpp): float32 [B, D] -> (int8 codes [B, D], float32 scales [B]).
std::tuple<at::Tensor, at::Tensor> quantize_queries(const at::Tensor& queries);

// Top-k keys int64 [B, k] (score * 2**32 + 2**32 - 1 - row), descending, INT64_MIN padding.
at::Tensor scan_topk(const ScanInput& in);

// The same keys written to out[b * k, b * k + count[b]) (out: B * k entries), nothing after them:
// callers that decode only the real results skip the padding pass (a [B, k] write that dominates
// selective searches at large k).
void scan_topk_into(const ScanInput& in, int64_t* out, int64_t* count);

// silverrec::bloom_filter: int64 [B, P, n_words] (see kernels/bloom_filter.py).
at::Tensor bloom_filter(const at::Tensor& bits, const at::Tensor& ops, const at::Tensor& rows,
                        const at::Tensor& word_start, int64_t n_words);

// silverrec::bloom_filter_counts: (int64 [B, P, n_words] mask of rows [lo, hi), int64 [B, P] counts).
std::tuple<at::Tensor, at::Tensor> bloom_filter_counts(const at::Tensor& bits, const at::Tensor& ops,
                                                       const at::Tensor& rows, const at::Tensor& lo,
                                                       const at::Tensor& hi, int64_t n_words);

// silverrec::verify_topk: the first k entries per query whose row passes its program.
std::tuple<at::Tensor, at::Tensor> verify_topk(const at::Tensor& bits, const at::Tensor& ops, const at::Tensor& rows,
                                               const at::Tensor& scores_in, const at::Tensor& rows_in, int64_t k);

// Residual codes computed by the scan: row r of cluster c scores dot + cluster_bias(<queries[b], centroids[c]>,
// shift[b], unit[b]), the cluster term (dot_lanes) computed for the clusters the query visits only (its probed
// clusters; for filtered_topk, those holding its passing rows: a selective filter's call computes no other),
// shift[b] the best of them (the caller adds it back to the scores).
struct ClusterTerm {
  const at::Tensor* offsets = nullptr;  // int64 [nlist + 1]; null: no cluster term
  const float* centroids = nullptr;     // [nlist, D] float32
  const float* queries = nullptr;       // [B, D] float32, unfolded
  const float* unit = nullptr;          // [B] the scores' integer unit (scale x query scale)
  float* shift = nullptr;               // [B] out: shift_back(the best visited score) (0 without any)
  float* scores = nullptr;              // [nlist, B] out, optional: the term at (c, b) for each c query b visits
};

// silverrec::filtered_topk: top-k keys int64 [B, k] over the rows passing each active query's
// program, drawn from its posting lists or the whole pool (lists[b, 0] == -2); with residual codes
// (cluster_offsets, centroids, centroid_queries float32 [B, D], unit float32 [B]) also the shift [B]
// (ClusterTerm), else an empty tensor.
std::tuple<at::Tensor, at::Tensor> filtered_topk_keys(
    const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& bits, const at::Tensor& ops,
    const at::Tensor& rows, const at::Tensor& post_rows, const at::Tensor& post_offsets, const at::Tensor& lists,
    const at::Tensor& active, int64_t k, const std::optional<at::Tensor>& cluster_offsets = std::nullopt,
    const std::optional<at::Tensor>& centroids = std::nullopt, const std::optional<at::Tensor>& centroid_queries = std::nullopt,
    const std::optional<at::Tensor>& unit = std::nullopt);

// ivf_scan's top-k keys (kernels/csrc/ops.cpp), biases given as a table or computed (BiasTable).
at::Tensor ivf_scan_keys(const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& cluster_offsets,
                         const at::Tensor& probes, const std::optional<at::Tensor>& bitmask, int64_t k,
                         const BiasTable& bias, const ClusterTerm& term = {});

// Exact routes with the float re-score: a query whose (program, lists) pass at most kExactFloatRows rows
// (constants.h) ranks every one of them by the float query on its codes.
// Where filtered_topk_into ranks such queries itself (kernels/csrc/float_rank.cpp): each passing row scored
// <folded[b], code> + <queries[b], dim_offset> (+ the cluster term ClusterTerm::scores, residual codes), the best
// k kept, ties by the int8 scan's order (its score, then the row): the re-score of an int8 top list that holds
// every passing row, without the int8 scan.
struct FloatRanking {
  const float* queries = nullptr;     // [B, D] float32, unfolded
  const float* folded = nullptr;      // [B, D] queries x dim_scale
  const float* dim_offset = nullptr;  // [D]
  int64_t k = 0;                      // results per query
  float* scores = nullptr;            // [B, k] out: descending, -inf padded (NaN and -inf scores dropped)
  int64_t* rows = nullptr;            // [B, k] out: pool rows, -1 padded
  bool* done = nullptr;               // [B] out: true where ranked here (those queries' count stays 0)
};

// The same keys, unpadded: query b's count[b] keys at out[b * k ...] (count 0 for inactive queries, and for
// those `ranking` ranked in float).
void filtered_topk_into(const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& bits,
                        const at::Tensor& ops, const at::Tensor& rows, const at::Tensor& post_rows,
                        const at::Tensor& post_offsets, const at::Tensor& lists, const at::Tensor& active, int64_t k,
                        int64_t* out, int64_t* count, const ClusterTerm& term = {},
                        const FloatRanking* ranking = nullptr);

// One group's passing rows (ascending pool rows, at most kExactFloatRows) ranked for its members (<= 16
// queries) as FloatRanking says. row_cluster[i]: row i's cluster, and terms [nlist, B] the float cluster
// terms, bias [nlist, B] the int8 scan's biases (residual codes; all three null otherwise); qcodes [B, D]:
// the int8 queries (ties only).
void rank_in_float(const FloatRanking& fr, const int8_t* codes, int64_t D, const std::vector<int64_t>& rows,
                   const int32_t* row_cluster, const float* terms, const int32_t* bias, int64_t B,
                   const int64_t* members, int mn, const int8_t* qcodes);

// The best P centroids of each probing query b (centroid_probe.cpp): cand[b * P + j], best first by float32
// <q, c> in dot_lanes's order, equal scores to the lower centroid. centroids float32 [C, D], queries float32
// [B, D], both contiguous; screen false: every score computed (the tests' second path).
void centroid_candidates(const at::Tensor& centroids, const at::Tensor& queries, int64_t P,
                         const std::vector<int64_t>& probing, int64_t* cand, bool screen = true);

// silverrec::filter_plan: (probes int64 [B, P], bitmask int64 [B, P, Wc], route int64 [B]) for float32 queries
// [B, D] and the program and mode per query (int64, contiguous). mask_if_unused false (the search's own call):
// no mask (an undefined tensor) when no query needs one.
std::tuple<at::Tensor, at::Tensor, at::Tensor> filter_plan(const at::Tensor& queries, const IvfIndex& ix,
                                                           const FilterIndex& fx, const Program& pr,
                                                           const at::Tensor& mode, int64_t k, int64_t nprobe,
                                                           int64_t max_probe, bool mask_if_unused = true);

}  // namespace silverrec
