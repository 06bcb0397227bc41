// Python bindings of the CPU fast paths (module silverrec.kernels._cpu).
//
// Each function turns one op's arguments into scan segments (scan.h) and returns int64 sort keys;
// the Python custom ops (kernels/*.py) quantise queries and dequantise scores around them. Bad
// values raise ValueError (std::invalid_argument) with the same messages as the torch paths.
#include <torch/library.h>
#include <torch/python.h>

#include "tensor.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <optional>
#include <tuple>
#include <stdexcept>
#include <string>

#include "dot.h"
#include "program.h"
#include "scan.h"
#include "team.h"
#include "topk_state.h"
#include "widen.h"

namespace silverrec {

// kernels/csrc/candidates.cpp
at::Tensor candidate_rows(const at::Tensor& queries, const at::Tensor& found, const at::Tensor& exclude,
                          const at::Tensor& emb, int64_t k0, int64_t limit, bool intersection);
// kernels/csrc/mol.cpp
at::Tensor mol_score(const at::Tensor& user, const at::Tensor& rows, const at::Tensor& emb, const at::Tensor& ranker,
                     const at::Tensor& user_weight, const at::Tensor& user_bias, const at::Tensor& gate_in_weight,
                     const at::Tensor& gate_weight, const at::Tensor& gate_bias, const at::Tensor& dot_scale,
                     const at::Tensor& log_scale, int64_t p_q, int64_t p_x, int64_t comp_dim, int64_t feat_dim);
// kernels/csrc/rescore.cpp
std::tuple<at::Tensor, at::Tensor> rescore_rows(const at::Tensor& queries, const at::Tensor& found, const at::Tensor& codes,
                                                const at::Tensor& dim_scale, const at::Tensor& dim_offset, int64_t k,
                                                const std::optional<at::Tensor>& cluster_offsets,
                                                const std::optional<at::Tensor>& centroids);
std::tuple<at::Tensor, at::Tensor> rescore_rows_with_terms(
    const at::Tensor& queries, const at::Tensor& found, const at::Tensor& codes, const at::Tensor& dim_scale,
    const at::Tensor& dim_offset, int64_t k, const std::optional<at::Tensor>& cluster_offsets,
    const std::optional<at::Tensor>& centroids, const float* terms);
// kernels/csrc/encode.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_histories(
    const at::Tensor& rows, const at::Tensor& offsets, int64_t exclude_limit, int64_t history_len, int64_t recent_len,
    const std::vector<at::Tensor>& feature_offsets, const std::vector<at::Tensor>& feature_codes, int64_t num_items);
std::tuple<at::Tensor, at::Tensor, int64_t> lookup_ids(const std::vector<std::vector<int64_t>>& lists,
                                                       const at::Tensor& table);

namespace {

ScanInput base_input(const at::Tensor& qcodes, const at::Tensor& codes, int64_t k) {
  check(qcodes, at::kChar, 2, "qcodes");
  check(codes, at::kChar, 2, "codes");
  TORCH_CHECK(qcodes.size(1) == codes.size(1), "qcodes and codes disagree on D");
  ScanInput in;
  in.qcodes = qcodes.data_ptr<int8_t>();
  in.codes = codes.data_ptr<int8_t>();
  in.B = qcodes.size(0);
  in.D = codes.size(1);
  in.N = codes.size(0);
  in.k = k;
  return in;
}

// int8_topk: every query scans [0, N).
at::Tensor topk_keys(const at::Tensor& qcodes, const at::Tensor& codes, int64_t k) {
  ScanInput in = base_input(qcodes, codes, k);
  for (int64_t b = 0; b < in.B; ++b) in.member_query.push_back(b);
  if (in.B) in.segments.push_back({0, in.N, 0, in.B});
  return scan_topk(in);
}

// ivf_scan: probes [B, P] (-1 = empty slot, repeats of a cluster count once: the first slot), optional
// bitmask [B, P, Wc]. Segments = probed clusters, ordered by the best slot any query gave them.
}  // namespace

at::Tensor ivf_scan_keys(const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& cluster_offsets,
                         const at::Tensor& probes, const std::optional<at::Tensor>& bitmask, int64_t k,
                         const BiasTable& table, const ClusterTerm& term) {
  ScanInput in = base_input(qcodes, codes, k);
  check(cluster_offsets, at::kLong, 1, "cluster_offsets");
  check(probes, at::kLong, 2, "probes");
  const int64_t nlist = cluster_offsets.size(0) - 1, P = probes.size(1);
  TORCH_CHECK(nlist >= 1 && probes.size(0) == in.B, "bad cluster_offsets / probes shape");
  const int64_t* off = cluster_offsets.data_ptr<int64_t>();
  const int64_t* pr = probes.data_ptr<int64_t>();
  bool rising = off[0] == 0 && off[nlist] == in.N;
  int64_t wc = 0;  // words per slot the index needs (kernels/ivf_scan.py bitmask_words)
  for (int64_t c = 0; c < nlist; ++c) {
    rising &= off[c + 1] >= off[c];
    wc = std::max(wc, ((off[c + 1] + 63) >> 6) - (off[c] >> 6));
  }
  if (!rising) throw std::invalid_argument("cluster_offsets must rise from 0 to N=" + std::to_string(in.N));
  for (int64_t i = 0; i < in.B * P; ++i)
    if (pr[i] < -1 || pr[i] >= nlist)
      throw std::invalid_argument("probes must hold cluster ids in [0, " + std::to_string(nlist) + ") or -1");
  int64_t wslot = 0;
  if (bitmask) {
    check(*bitmask, at::kLong, 3, "bitmask");
    TORCH_CHECK(bitmask->size(0) == in.B && bitmask->size(1) == P, "bitmask must be [B, P, Wc]");
    wslot = bitmask->size(2);
    if (wslot < wc)
      throw std::invalid_argument("bitmask has " + std::to_string(wslot) + " words per slot, the index needs " +
                                  std::to_string(wc));
    in.bitmask = bitmask->data_ptr<int64_t>();
  }
  // residual codes: a caller's bias table, or the cluster term of each query's probed clusters (ClusterTerm)
  std::vector<float> probe_score, best(in.B, 0.0f);
  if (term.centroids) {
    probe_score.assign(in.B * P, 0.0f);
    for (int64_t b = 0; b < in.B; ++b) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < P; ++j) {
        const int64_t c = pr[b * P + j];
        if (c < 0) continue;
        probe_score[b * P + j] = dot_lanes_f32(term.queries + b * in.D, term.centroids + c * in.D, in.D);
        top = std::max(top, probe_score[b * P + j]);
        if (term.scores) term.scores[c * in.B + b] = probe_score[b * P + j];
      }
      best[b] = top > -std::numeric_limits<float>::infinity() ? top : 0.0f;
      term.shift[b] = shift_back(best[b], term.unit[b]);
    }
  }
  const bool biased = bool(table) || term.centroids;
  // First slot of each (query, cluster); count members per cluster and each cluster's best slot.
  std::vector<int64_t> last_query(nlist, -1), count(nlist, 0), best_slot(nlist, P);
  std::vector<int64_t> first_slot(in.B * P, -1);  // slot j of query b if it is the first for its cluster
  for (int64_t b = 0; b < in.B; ++b)
    for (int64_t j = 0; j < P; ++j) {
      const int64_t c = pr[b * P + j];
      if (c < 0 || last_query[c] == b) continue;
      last_query[c] = b;
      if (off[c + 1] == off[c]) continue;  // empty cluster: nothing to scan
      first_slot[b * P + j] = j;
      ++count[c];
      best_slot[c] = std::min(best_slot[c], j);
    }
  std::vector<int64_t> order;
  for (int64_t c = 0; c < nlist; ++c)
    if (count[c]) order.push_back(c);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return best_slot[x] < best_slot[y]; });
  std::vector<int64_t> cursor(nlist, 0);
  int64_t m = 0;
  for (int64_t c : order) {
    in.segments.push_back({off[c], off[c + 1], m, count[c]});
    cursor[c] = m;
    m += count[c];
  }
  in.member_query.assign(m, 0);
  in.member_word.assign(m, 0);
  if (biased) in.member_bias.assign(m, 0);
  for (int64_t b = 0; b < in.B; ++b)
    for (int64_t j = 0; j < P; ++j) {
      if (first_slot[b * P + j] < 0) continue;
      const int64_t c = pr[b * P + j], i = cursor[c]++;
      in.member_query[i] = b;
      in.member_word[i] = (b * P + j) * wslot - (off[c] >> 6);
      if (table) in.member_bias[i] = table(b, c);  // residual codes: dot + bias[b, c]
      else if (biased) in.member_bias[i] = cluster_bias(probe_score[b * P + j], best[b], term.unit[b]);
    }
  return scan_topk(in);
}

namespace {

// The core routine on explicit ranges: range i = rows [range_start[i], range_end[i]) for query
// range_query[i], with word base range_word_base[i] into the flat bitmask (both optional).
at::Tensor scan_ranges(const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& range_query,
                       const at::Tensor& range_start, const at::Tensor& range_end,
                       const std::optional<at::Tensor>& range_word_base, const std::optional<at::Tensor>& bitmask,
                       int64_t k) {
  ScanInput in = base_input(qcodes, codes, k);
  check(range_query, at::kLong, 1, "range_query");
  check(range_start, at::kLong, 1, "range_start");
  check(range_end, at::kLong, 1, "range_end");
  const int64_t R = range_query.size(0);
  TORCH_CHECK(range_start.size(0) == R && range_end.size(0) == R, "range arrays must have equal lengths");
  TORCH_CHECK(range_word_base.has_value() == bitmask.has_value(), "range_word_base and bitmask go together");
  const int64_t *rq = range_query.data_ptr<int64_t>(), *rs = range_start.data_ptr<int64_t>(),
                *re = range_end.data_ptr<int64_t>();
  const int64_t* rw = nullptr;
  if (bitmask) {
    check(*range_word_base, at::kLong, 1, "range_word_base");
    TORCH_CHECK(range_word_base->size(0) == R, "range_word_base must have one entry per range");
    TORCH_CHECK(bitmask->device().is_cpu() && bitmask->scalar_type() == at::kLong && bitmask->is_contiguous(),
                "bitmask must be a contiguous int64 CPU tensor");
    rw = range_word_base->data_ptr<int64_t>();
    in.bitmask = bitmask->data_ptr<int64_t>();
  }
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(rq[i] >= 0 && rq[i] < in.B && rs[i] >= 0 && re[i] <= in.N, "range ", i, " out of bounds");
    if (re[i] <= rs[i]) continue;
    in.segments.push_back({rs[i], re[i], int64_t(in.member_query.size()), 1});
    in.member_query.push_back(rq[i]);
    in.member_word.push_back(rw ? rw[i] : 0);
  }
  return scan_topk(in);
}

// kernels/common.py quantize_queries, bit for bit: scale = max(amax |q|, 1e-30) / 127 and
// codes = round-half-even(q / scale) clamped to [-127, 127] (float32 throughout).
std::tuple<at::Tensor, at::Tensor> quantize_queries(const at::Tensor& queries) {
  TORCH_CHECK(queries.device().is_cpu() && queries.scalar_type() == at::kFloat && queries.dim() == 2 &&
                  queries.is_contiguous(), "quantize_queries: contiguous float32 [B, D] expected");
  const int64_t B = queries.size(0), D = queries.size(1);
  at::Tensor codes = at::empty({B, D}, at::kChar), scale = at::empty({B}, at::kFloat);
  const float* q = queries.data_ptr<float>();
  int8_t* c = codes.data_ptr<int8_t>();
  float* s = scale.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float* x = q + b * D;
    float m = 0.0f;
    for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(x[d]));
    const float sc = std::max(m, 1e-30f) / 127.0f;
    s[b] = sc;
    for (int64_t d = 0; d < D; ++d) c[b * D + d] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[d] / sc))));
  }
  return {codes, scale};
}

// One sort key -> (score, row): float(score) * mul + add, one rounding per operation; padding -> (-inf, -1).
inline void decode_key(int64_t key, float mul, float add, float& score, int64_t& row) {
  if (key == kEmptyKey) {
    score = -std::numeric_limits<float>::infinity();
    row = -1;
  } else {
    const float prod = float(key >> 32) * mul;
    score = prod + add;
    row = key_row(key);
  }
}

// Sort keys -> (scores float32 [B, k], rows int64 [B, k]), exactly like kernels/common.py
// split_keys + dequantize_scores: float(score) * (scale * qscale[b]) + offset * qsum[b] with one
// rounding per operation (built with -ffp-contract=off: no FMA); padding -> (-inf, -1).
// keys int64 [B, k] -> (scores float32, rows int64) [B, k]: score = key score x scale x qs[b] + offset x qm[b]
std::tuple<at::Tensor, at::Tensor> decode_keys(const at::Tensor& keys, const float* qs, const float* qm, float sc, float of) {
  const int64_t B = keys.size(0), k = keys.size(1);
  at::Tensor scores = at::empty({B, k}, at::kFloat), rows = at::empty({B, k}, at::kLong);
  const int64_t* kp = keys.data_ptr<int64_t>();
  float* sp = scores.data_ptr<float>();
  int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const float mul = sc * qs[b], add = of * qm[b];
    for (int64_t i = b * k; i < (b + 1) * k; ++i) decode_key(kp[i], mul, add, sp[i], rp[i]);
  }
  return {scores, rows};
}

std::tuple<at::Tensor, at::Tensor> keys_to_results(const at::Tensor& keys, const at::Tensor& qscale,
                                                   const at::Tensor& qsum, const at::Tensor& scale,
                                                   const at::Tensor& offset) {
  check(keys, at::kLong, 2, "keys");
  check(qscale, at::kFloat, 1, "qscale");
  check(qsum, at::kFloat, 1, "qsum");
  const int64_t B = keys.size(0);
  TORCH_CHECK(qscale.size(0) == B && qsum.size(0) == B, "qscale / qsum must have B entries");
  return decode_keys(keys, qscale.data_ptr<float>(), qsum.data_ptr<float>(), scale.item<float>(), offset.item<float>());
}

// o[i] = id[r[i]] as int64, -1 where r[i] < 0; a row >= n is an IndexError. A run of padding (the
// tail of a selective search's rows at large k) is one fill: no per-element check or gather.
template <typename Id>
void map_rows(const Id* id, int64_t n, const int64_t* r, int64_t m, int64_t* o) {
  for (int64_t i = 0; i < m;) {
    if (r[i] < 0) {
      int64_t j = i + 1;
#if defined(__AVX2__)
      // 4 rows per step while all are negative (their sign bits)
      while (j + 4 <= m && _mm256_movemask_pd(_mm256_castsi256_pd(
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + j)))) == 0xF)
        j += 4;
#endif
      while (j < m && r[j] < 0) ++j;
      std::fill(o + i, o + j, int64_t{-1});
      i = j;
      continue;
    }
    TORCH_CHECK_INDEX(r[i] < n, "rows_to_items: row ", r[i], " out of range for ", n, " rows");
    o[i] = int64_t(id[r[i]]);
    ++i;
  }
}

// silverrec::rows_to_items (kernels/rows_to_items.py): row_to_item int32/int64 [N], rows int64 (any
// shape, -1 = none) -> item ids int64, -1 kept; one pass instead of clamp / index / cast / where.
at::Tensor rows_to_items(const at::Tensor& row_to_item_in, const at::Tensor& rows_in) {
  const at::Tensor map = row_to_item_in.contiguous(), rows = rows_in.contiguous();
  TORCH_CHECK(map.dim() == 1 && (map.scalar_type() == at::kInt || map.scalar_type() == at::kLong),
              "rows_to_items: row_to_item must be int32 or int64 [N], got ", map.scalar_type(), " ", map.sizes());
  TORCH_CHECK(rows.scalar_type() == at::kLong, "rows_to_items: rows must be int64, got ", rows.scalar_type());
  at::Tensor out = at::empty(rows.sizes(), at::kLong);
  const int64_t n = map.size(0), m = rows.numel();
  const int64_t* r = rows.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  if (map.scalar_type() == at::kInt) map_rows(map.data_ptr<int32_t>(), n, r, m, o);
  else map_rows(map.data_ptr<int64_t>(), n, r, m, o);
  return out;
}

// The padding of a large result (k 4096 over a few hundred matches: 768 KB per batch of 16, most of it
// padding) written with streaming stores: no read of each line before it is written, and the caches keep
// the search's own data. Short fills use ordinary stores; callers fence (streaming_done) after their fills.
constexpr int64_t kStreamingMinBytes = 4096;
template <typename T>
void fill_streaming(T* p, int64_t n, T v) {
#if defined(__AVX512F__)
  if (n * int64_t(sizeof(T)) >= kStreamingMinBytes) {
    constexpr int64_t kPerLine = 64 / sizeof(T);
    for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 63); --n) *p++ = v;  // to a line boundary
    T line[kPerLine];
    std::fill(line, line + kPerLine, v);
    const __m512i w = _mm512_loadu_si512(line);
    for (; n >= kPerLine; n -= kPerLine, p += kPerLine) _mm512_stream_si512(reinterpret_cast<__m512i*>(p), w);
  }
#endif
  std::fill(p, p + n, v);
}

inline void streaming_done() {
#if defined(__AVX512F__)
  _mm_sfence();
#endif
}

// silverrec::filtered_ivf_search (kernels/filtered_ivf_search.py): filter_plan, fold, ivf_scan,
// verify_topk, filtered_topk, merge and item ids, with the same ATen calls and kernels as the
// composition `filtered_ivf_search_torch` (bit-identical results), without per-op dispatch.
std::tuple<at::Tensor, at::Tensor> filtered_ivf_search(
    const at::Tensor& queries_in, const at::Tensor& codes_in, const at::Tensor& dim_scale_in, const at::Tensor& dim_offset_in,
    const at::Tensor& cluster_offsets_in, const at::Tensor& centroids_in, const at::Tensor& row_to_item_in, const at::Tensor& bits_in,
    const at::Tensor& post_rows_in, const at::Tensor& post_offsets_in, const at::Tensor& post_sizes_in, const at::Tensor& ops_in,
    const at::Tensor& rows_in, const at::Tensor& vops_in, const at::Tensor& vrows_in, const at::Tensor& lists_in, const at::Tensor& mode_in,
    int64_t k, int64_t nprobe, int64_t max_probe, int64_t window_words, int64_t match_factor, int64_t avg_cluster,
    int64_t num_items, double exact_cost_ratio, int64_t posting_limit, int64_t rescore_margin, int64_t rescore_max_k,
    bool residual) {
  TeamCall team;  // the helpers wake now, to be awake by the first parallel step
  // inputs may come from anywhere (eager calls, other graphs): contiguous views for the kernels
  const at::Tensor queries = queries_in.contiguous();
  const at::Tensor codes = codes_in.contiguous();
  const at::Tensor dim_scale = dim_scale_in.contiguous();
  const at::Tensor dim_offset = dim_offset_in.contiguous();
  const at::Tensor cluster_offsets = cluster_offsets_in.contiguous();
  const at::Tensor centroids = centroids_in.contiguous();
  const at::Tensor row_to_item = row_to_item_in.contiguous();
  const at::Tensor bits = bits_in.contiguous();
  const at::Tensor post_rows = post_rows_in.contiguous();
  const at::Tensor post_offsets = post_offsets_in.contiguous();
  const at::Tensor post_sizes = post_sizes_in.contiguous();
  // the request tensors: one row per query, or one per group of `per` consecutive queries (a
  // request's task queries share its filter), repeated here to one per query
  const int64_t per = ops_in.size(0) > 0 && queries_in.size(0) % ops_in.size(0) == 0 ? queries_in.size(0) / ops_in.size(0) : 1;
  const auto per_query = [per](const at::Tensor& x) {  // x [R, ...] -> [R * per, ...], row r per times
    if (per == 1) return x.contiguous();
    std::vector<int64_t> shape = x.sizes().vec();
    shape.insert(shape.begin() + 1, per);
    at::Tensor repeated = x.unsqueeze(1).expand(shape).contiguous();  // one copy (repeat_interleave took 5 us a call)
    shape.erase(shape.begin() + 1);
    shape[0] *= per;
    return repeated.view(shape);
  };
  const at::Tensor ops = per_query(ops_in);
  const at::Tensor rows = per_query(rows_in);
  const at::Tensor vops = per_query(vops_in);
  const at::Tensor vrows = per_query(vrows_in);
  const at::Tensor lists = per_query(lists_in);
  const at::Tensor mode = per_query(mode_in);
  if (k < 1) throw std::invalid_argument("k must be >= 1, got " + std::to_string(k));
  // float re-score (kernels/rescore_rows.py): every route runs for k + margin rows, re-scored to k at the end
  const int64_t k_out = k;
  const bool rescore = rescore_margin > 0 && k <= rescore_max_k;
  if (rescore) k += rescore_margin;
  if (!(1 <= nprobe && nprobe <= max_probe && max_probe <= centroids.size(0)))
    throw std::invalid_argument("need 1 <= nprobe (" + std::to_string(nprobe) + ") <= max_probe (" +
                                std::to_string(max_probe) + ") <= nlist (" + std::to_string(centroids.size(0)) + ")");
  const int64_t B = queries.size(0), D = queries.size(1);
  // the request's small tensors are made with plain loops, not ATen calls: after other work has
  // evicted libtorch's code, each ATen call costs tens of microseconds (a k 4096 search of 241
  // matches: 20% of the op's time went to zeros / full / clone / ones calls on a few hundred bytes)
  const auto as_float = [](const at::Tensor& x) { return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat).contiguous(); };
  const at::Tensor q = as_float(queries);
  at::Tensor probes, bitmask, route;
  std::tie(probes, bitmask, route) =
      filter_plan(q, as_float(centroids), cluster_offsets, bits, ops, rows, lists, post_sizes,
                  mode.scalar_type() == at::kLong ? mode : mode.to(at::kLong).contiguous(), k, nprobe, max_probe,
                  window_words, match_factor, avg_cluster, num_items, exact_cost_ratio, posting_limit,
                  /*mask_if_unused=*/false);
  const at::Tensor centroids_f = residual ? as_float(centroids) : at::Tensor();
  TORCH_CHECK(dim_scale.scalar_type() == at::kFloat && (dim_scale.numel() == D || dim_scale.numel() == 1),
              "dim_scale: float32 [D] (or one value) expected");
  const int64_t step = dim_scale.numel() == 1 ? 0 : 1;
  const at::Tensor constant = at::matmul(q, dim_offset).contiguous();  // BLAS, as the composition: identical sums
  // folded = q x dim_scale (elementwise: identical to at::mul); qsum its row sums (only ever x 0: the
  // composition's keys_to_results offset, so its rounding cannot show)
  at::Tensor folded = at::empty({B, D}, at::kFloat), qsum = at::empty({B}, at::kFloat);
  {
    const float *qp = q.data_ptr<float>(), *ds = dim_scale.data_ptr<float>();
    float *fp = folded.data_ptr<float>(), *sp = qsum.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      float sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) sum += (fp[b * D + d] = qp[b * D + d] * ds[d * step]);
      sp[b] = sum;
    }
  }
  at::Tensor qcodes, qscale;
  std::tie(qcodes, qscale) = quantize_queries(folded);
  // residual codes: every row of cluster c adds <q, centroid c>, computed by each route for the clusters it
  // visits (ClusterTerm); each route's shift is added back to its scores
  std::vector<float> shift(B, 0.0f), shift_ex(B, 0.0f), unit(B, 0.0f);
  ClusterTerm term, term_ex;
  std::optional<at::Tensor> offsets_if_residual;
  // the terms each route computed, [nlist, B] (written at the clusters query b visits: those of its rows),
  // handed to the re-score instead of computing them again
  std::unique_ptr<float[]> terms;
  if (residual) {
    const float* qs = qscale.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) unit[b] = 1.0f * qs[b];  // the ops' scale (1) x qscale, as cluster_bias
    if (rescore) terms.reset(new float[B * centroids.size(0)]);
    term = {&cluster_offsets, centroids_f.data_ptr<float>(), q.data_ptr<float>(), unit.data(), shift.data(), terms.get()};
    term_ex = term;
    term_ex.shift = shift_ex.data();
    offsets_if_residual = cluster_offsets;
  }
  const int64_t* rt = route.data_ptr<int64_t>();
  // probed route: scan with a margin for Bloom false positives, keep the best k that verify. Programs
  // that push no bank row (no filter: TRUE) have no false positives: scan k, nothing to verify (the
  // composition's verify_topk would keep the first k of the k2 ranked rows: the same k rows).
  const bool unfiltered = program::pushes_nothing(ops.data_ptr<int64_t>(), ops.numel()) &&
                          program::pushes_nothing(vops.data_ptr<int64_t>(), vops.numel());
  const int64_t k2 = unfiltered ? k : k + k / 4 + 16;
  const int64_t* pr = probes.data_ptr<int64_t>();
  bool any_probe = false, any_exact = false;
  for (int64_t i = 0; i < probes.numel(); ++i) any_probe |= pr[i] >= 0;
  for (int64_t b = 0; b < B; ++b) any_exact |= rt[b] > 0;
  // probed route: the scan's keys, decoded in the output pass when nothing needs verifying; else
  // (scores, rows) of the best k that verify
  at::Tensor keys_pr, s_ivf, r_ivf;
  if (any_probe) {
    const std::optional<at::Tensor> mask = bitmask.defined() ? std::optional<at::Tensor>(bitmask) : std::nullopt;
    keys_pr = ivf_scan_keys(qcodes, codes, cluster_offsets, probes, mask, k2, BiasTable{}, term);
    if (!unfiltered) {
      std::tie(s_ivf, r_ivf) = decode_keys(keys_pr, qscale.data_ptr<float>(), qsum.data_ptr<float>(), 1.0f, 0.0f);
      if (residual) {  // ivf_scan's scores carry the shift
        float* sp = s_ivf.data_ptr<float>();
        for (int64_t i = 0; i < s_ivf.numel(); ++i) sp[i] += shift[i / k2];
      }
      std::tie(s_ivf, r_ivf) = verify_topk(bits, vops, vrows, s_ivf, r_ivf, k);
    }
  }
  // whole-pool (route 1) and posting-list (route 2) queries: filter, then exact scan; query b's
  // count_ex[b] keys, unpadded (padding is written once, below)
  at::Tensor keys_ex;
  std::vector<int64_t> count_ex(B, 0);
  // re-scored exact routes passing at most kExactFloatRows rows: ranked in float by filtered_topk_into itself
  // (the re-score of a list holding all of them), into float_scores / float_rows
  FloatRanking ranking;
  at::Tensor float_scores, float_rows;
  std::unique_ptr<bool[]> float_done(new bool[B]());
  if (any_exact && rescore) {
    TORCH_CHECK(dim_offset.scalar_type() == at::kFloat && dim_offset.numel() == D, "dim_offset: float32 [D] expected");
    float_scores = at::empty({B, k_out}, at::kFloat);
    float_rows = at::empty({B, k_out}, at::kLong);
    ranking = {q.data_ptr<float>(), folded.data_ptr<float>(), dim_offset.data_ptr<float>(), k_out,
               float_scores.data_ptr<float>(), float_rows.data_ptr<int64_t>(), float_done.get()};
  }
  if (any_exact) {
    at::Tensor src = at::empty_like(lists), exact = at::empty({B}, at::kBool);
    std::memcpy(src.data_ptr<int64_t>(), lists.data_ptr<int64_t>(), lists.numel() * sizeof(int64_t));
    int64_t* sp = src.data_ptr<int64_t>();
    bool* ep = exact.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b) {
      ep[b] = rt[b] > 0;
      if (rt[b] == 1) std::fill(sp + b * src.size(1), sp + (b + 1) * src.size(1), int64_t{-2});
    }
    keys_ex = at::empty({B, k}, at::kLong);
    filtered_topk_into(qcodes, codes, bits, vops, vrows, post_rows, post_offsets, src, exact, k,
                       keys_ex.data_ptr<int64_t>(), count_ex.data(), term_ex, rescore ? &ranking : nullptr);
  }
  at::Tensor scores = at::empty({B, k}, at::kFloat), ids = at::empty({B, k}, at::kLong);
  float* so = scores.data_ptr<float>();
  int64_t* io = ids.data_ptr<int64_t>();
  const float* cst = constant.data_ptr<float>();
  const bool ids32 = row_to_item.scalar_type() == at::kInt;
  TORCH_CHECK(ids32 || row_to_item.scalar_type() == at::kLong, "row_to_item must be int32 or int64");
  const bool as_rows = row_to_item.numel() == 0;  // an empty map: the rows themselves (RecModel's stages)
  const bool map_ids = !as_rows && !rescore;      // (the re-score reads rows: mapped after it)
  const int64_t* k_pr = unfiltered && keys_pr.defined() ? keys_pr.data_ptr<int64_t>() : nullptr;
  const float* s_pr = s_ivf.defined() ? s_ivf.data_ptr<float>() : nullptr;
  const int64_t* r_pr = r_ivf.defined() ? r_ivf.data_ptr<int64_t>() : nullptr;
  const int64_t* k_ex = keys_ex.defined() ? keys_ex.data_ptr<int64_t>() : nullptr;
  const float *qs = qscale.data_ptr<float>(), *qm = qsum.data_ptr<float>();
  const int32_t* id32 = ids32 ? row_to_item.data_ptr<int32_t>() : nullptr;
  const int64_t* id64 = ids32 ? nullptr : row_to_item.data_ptr<int64_t>();
  const auto item_of = [&](int64_t r) { return id32 ? int64_t(id32[r]) : id64[r]; };
  const float none = -std::numeric_limits<float>::infinity();
  // a large result (k 4096: 768 KB per 16 queries) is decoded and padded by every thread, a query each
  const int64_t grain = B * k * int64_t(sizeof(float) + sizeof(int64_t)) >= kParallelResultBytes ? 1 : B;
  team_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      // keys decode here (keys_to_results with scale 1, offset 0): the exact routes' count_ex[b], or
      // the unverified probed scan's k (padded); then padding once
      float* sb = so + b * k;
      int64_t* ib = io + b * k;
      const float mul = 1.0f * qs[b], add = 0.0f * qm[b];
      int64_t i = 0;
      if (rt[b] > 0 || k_pr) {
        const int64_t* key = (rt[b] > 0 ? k_ex : k_pr) + b * k;
        const int64_t n = rt[b] > 0 ? count_ex[b] : k;
        for (; i < n; ++i) {
          float sc;
          int64_t r;
          decode_key(key[i], mul, add, sc, r);
          sb[i] = (residual ? sc + (rt[b] > 0 ? shift_ex[b] : shift[b]) : sc) + cst[b];
          ib[i] = r < 0 ? -1 : !map_ids ? r : item_of(r);
        }
      } else if (s_pr) {
        for (; i < k; ++i) {
          const int64_t r = r_pr[b * k + i];
          sb[i] = s_pr[b * k + i] + cst[b];
          ib[i] = r < 0 ? -1 : !map_ids ? r : item_of(r);
        }
      }
      fill_streaming(sb + i, k - i, none + cst[b]);
      fill_streaming(ib + i, k - i, int64_t{-1});
    }
    streaming_done();  // each thread's streaming stores, before anyone reads the outputs
  });
  if (!rescore) return {scores, ids};
  at::Tensor top_scores = float_scores, top_rows = float_rows;  // every query ranked in float: no re-score
  const bool all_float = float_scores.defined() && std::all_of(float_done.get(), float_done.get() + B, [](bool d) { return d; });
  if (!all_float) {
    std::tie(top_scores, top_rows) = rescore_rows_with_terms(
        q, ids, codes, step ? dim_scale : dim_scale.expand({D}).contiguous(), dim_offset, k_out, offsets_if_residual,
        residual ? std::optional<at::Tensor>(centroids_f) : std::nullopt, terms.get());
    for (int64_t b = 0; b < B; ++b)  // the queries ranked in float above (their scan lists were empty)
      if (float_done[b]) {
        std::memcpy(top_scores.data_ptr<float>() + b * k_out, float_scores.data_ptr<float>() + b * k_out, k_out * sizeof(float));
        std::memcpy(top_rows.data_ptr<int64_t>() + b * k_out, float_rows.data_ptr<int64_t>() + b * k_out, k_out * sizeof(int64_t));
      }
  }
  if (!as_rows) {
    int64_t* tr = top_rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < B * k_out; ++i)
      if (tr[i] >= 0) tr[i] = item_of(tr[i]);
  }
  return {top_scores, top_rows};
}

}  // namespace
}  // namespace silverrec

// The CPU kernel of silverrec::filtered_ivf_search, registered with the dispatcher so that a call
// goes straight to C++ (no Python between the predictor and the search). The op itself (schema,
// fake, CUDA kernel, and a CPU kernel when this extension is not built) is defined in
// kernels/filtered_ivf_search.py, which is imported before this library is loaded.
TORCH_LIBRARY_IMPL(silverrec, CPU, m) {
  m.impl("filtered_ivf_search", &silverrec::filtered_ivf_search);
  m.impl("rows_to_items", &silverrec::rows_to_items);
}

// The instruction set this build's kernels use: "avx512-vnni", "avx512" (AVX-512F without VNNI: the dot products
// take the AVX2 path, dot.h), "avx2" or "sse" (make test-portable checks each build is the one it claims).
std::string isa() {
#if SILVERREC_VNNI
  return "avx512-vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif SILVERREC_AVX2
  return "avx2";
#else
  return "sse";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace silverrec;
  m.doc() = "silverrec CPU fast paths: fused int8 scan + bitmask + top-k, bloom filter programs";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("topk_keys", &topk_keys, "exact top-k keys int64 [B, k]", py::arg("qcodes"), py::arg("codes"), py::arg("k"), nogil);
  m.def("ivf_scan_keys", [](const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& cluster_offsets,
                            const at::Tensor& probes, const std::optional<at::Tensor>& bitmask, int64_t k,
                            const std::optional<at::Tensor>& bias) {
          return ivf_scan_keys(qcodes, codes, cluster_offsets, probes, bitmask, k,
                               bias_table(bias, qcodes.size(0), cluster_offsets.size(0) - 1), ClusterTerm{});
        }, "top-k keys over probed clusters", py::arg("qcodes"), py::arg("codes"),
        py::arg("cluster_offsets"), py::arg("probes"), py::arg("bitmask"), py::arg("k"), py::arg("bias") = py::none(),
        nogil);
  m.def("scan_ranges", &scan_ranges, "top-k keys over explicit row ranges", py::arg("qcodes"), py::arg("codes"),
        py::arg("range_query"), py::arg("range_start"), py::arg("range_end"), py::arg("range_word_base"),
        py::arg("bitmask"), py::arg("k"), nogil);
  m.def("quantize_queries", &quantize_queries, "per-query symmetric int8 codes and scales (common.py, bit for bit)",
        py::arg("queries"), nogil);
  m.def("set_team_pin", &silverrec::set_team_pin,
        "tests: -1 the team under OMP_WAIT_POLICY=PASSIVE, else OpenMP; 0 every step on the calling thread; "
        "1 the team, each step of several chunks waiting for a helper to take one; 2 OpenMP (team.h)", py::arg("pin"));
  m.def("parallel_runner", &silverrec::parallel_runner, "who runs the ops' parallel steps: team, openmp or alone");
  m.def("team_helper_chunks", &silverrec::team_helper_chunks, "chunks of the ops' steps run on helper threads so far");
  m.def("centroid_candidates", [](const at::Tensor& queries, const at::Tensor& centroids, int64_t P, bool screen) {
          TeamCall team;  // the helpers wake once for the call's steps
          const at::Tensor c = centroids.contiguous(), q = queries.contiguous();
          at::Tensor out = at::empty({q.size(0), P}, at::kLong);
          std::vector<int64_t> all(q.size(0));
          std::iota(all.begin(), all.end(), int64_t{0});
          centroid_candidates(c, q, P, all, out.data_ptr<int64_t>(), screen);
          return out;
        }, "each query's best P centroids int64 [B, P] as filter_plan picks them (centroid_probe.cpp); screen "
        "false: every score computed", py::arg("queries"), py::arg("centroids"), py::arg("P"), py::arg("screen") = true, nogil);
  m.def("team_probe", &silverrec::team_probe, "tests: the thread that ran each index of a team_for (team.h)",
        py::arg("n"), py::arg("grain"), py::arg("throw_at") = -1, nogil);
  m.def("isa", &isa, "the instruction set of this build's kernels (avx512-vnni, avx512, avx2, sse)");
  m.def("keys_to_results", &keys_to_results, "keys -> (scores float32, rows int64), -inf / -1 padding",
        py::arg("keys"), py::arg("qscale"), py::arg("qsum"), py::arg("scale"), py::arg("offset"), nogil);
  m.def("bloom_filter", &silverrec::bloom_filter, "filter programs over word windows -> int64 [B, P, n_words]",
        py::arg("bits"), py::arg("ops"), py::arg("rows"), py::arg("word_start"), py::arg("n_words"), nogil);
  m.def("bloom_filter_counts", &silverrec::bloom_filter_counts,
        "filter programs over row ranges [lo, hi) -> (int64 [B, P, n_words] mask, int64 [B, P] counts)",
        py::arg("bits"), py::arg("ops"), py::arg("rows"), py::arg("lo"), py::arg("hi"), py::arg("n_words"), nogil);
  m.def("verify_topk", &silverrec::verify_topk, "first k ranked entries whose row passes the program",
        py::arg("bits"), py::arg("ops"), py::arg("rows"), py::arg("scores"), py::arg("result_rows"), py::arg("k"), nogil);
  m.def("filtered_topk_keys", &silverrec::filtered_topk_keys,
        "top-k keys over rows passing the program, from posting lists or the whole pool", py::arg("qcodes"),
        py::arg("codes"), py::arg("bits"), py::arg("ops"), py::arg("rows"), py::arg("post_rows"),
        py::arg("post_offsets"), py::arg("lists"), py::arg("active"), py::arg("k"),
        py::arg("cluster_offsets") = py::none(), py::arg("centroids") = py::none(),
        py::arg("centroid_queries") = py::none(), py::arg("unit") = py::none(), nogil);
  m.def("filter_plan", [](const at::Tensor& queries, const at::Tensor& centroids, const at::Tensor& cluster_offsets,
                          const at::Tensor& bits, const at::Tensor& ops, const at::Tensor& rows, const at::Tensor& lists,
                          const at::Tensor& post_sizes, const at::Tensor& mode, int64_t k, int64_t nprobe,
                          int64_t max_probe, int64_t window_words, int64_t match_factor, int64_t avg_cluster,
                          int64_t num_items, double exact_cost_ratio, int64_t posting_limit) {
          return silverrec::filter_plan(queries, centroids, cluster_offsets, bits, ops, rows, lists, post_sizes, mode, k,
                                        nprobe, max_probe, window_words, match_factor, avg_cluster, num_items,
                                        exact_cost_ratio, posting_limit, true);
        }, "filtered IVF routing: (probes, bitmask, route)", py::arg("queries"),
        py::arg("centroids"), py::arg("cluster_offsets"), py::arg("bits"), py::arg("ops"), py::arg("rows"),
        py::arg("lists"), py::arg("post_sizes"), py::arg("mode"), py::arg("k"), py::arg("nprobe"), py::arg("max_probe"),
        py::arg("window_words"), py::arg("match_factor"), py::arg("avg_cluster"), py::arg("num_items"),
        py::arg("exact_cost_ratio"), py::arg("posting_limit"), nogil);
  m.def("candidate_rows", &silverrec::candidate_rows, "the retrieval tail: exclude, re-score, best k0 per task, merge",
        py::arg("queries"), py::arg("found"), py::arg("exclude"), py::arg("emb"), py::arg("k0"), py::arg("limit"),
        py::arg("intersection"), nogil);
  m.def("mol_score", &silverrec::mol_score, "mixture-of-logits pair scores of cached candidate rows [B, K, T]",
        py::arg("user"), py::arg("rows"), py::arg("emb"), py::arg("ranker"), py::arg("user_weight"), py::arg("user_bias"),
        py::arg("gate_in_weight"), py::arg("gate_weight"), py::arg("gate_bias"), py::arg("dot_scale"),
        py::arg("log_scale"), py::arg("p_q"), py::arg("p_x"), py::arg("comp_dim"), py::arg("feat_dim"), nogil);
  m.def("rescore_rows", &silverrec::rescore_rows, "the scan's top rows re-scored with the float query, best k",
        py::arg("queries"), py::arg("found"), py::arg("codes"), py::arg("dim_scale"), py::arg("dim_offset"), py::arg("k"),
        py::arg("cluster_offsets") = py::none(), py::arg("centroids") = py::none(), nogil);
  m.def("lookup_ids", &silverrec::lookup_ids, "id lists -> (rows int64, offsets int64, first list with an unknown id or -1)",
        py::arg("lists"), py::arg("table"));
  m.def("encode_histories", &silverrec::encode_histories,
        "history rows -> (exclusions [B, E], the user tower's item-key values, lengths)", py::arg("rows"),
        py::arg("offsets"), py::arg("exclude_limit"), py::arg("history_len"), py::arg("recent_len"),
        py::arg("feature_offsets"), py::arg("feature_codes"), py::arg("num_items"), nogil);
  m.def("rows_to_items", &silverrec::rows_to_items, "rows -> item ids int64 (-1 kept)", py::arg("row_to_item"), py::arg("rows"), nogil);
  m.def("filtered_ivf_search", &filtered_ivf_search, "the filtered IVF search in one call", py::arg("queries"),
        py::arg("codes"), py::arg("dim_scale"), py::arg("dim_offset"), py::arg("cluster_offsets"), py::arg("centroids"),
        py::arg("row_to_item"), py::arg("bits"), py::arg("post_rows"), py::arg("post_offsets"), py::arg("post_sizes"),
        py::arg("ops"), py::arg("rows"), py::arg("vops"), py::arg("vrows"), py::arg("lists"), py::arg("mode"),
        py::arg("k"), py::arg("nprobe"), py::arg("max_probe"), py::arg("window_words"), py::arg("match_factor"),
        py::arg("avg_cluster"), py::arg("num_items"), py::arg("exact_cost_ratio"), py::arg("posting_limit"),
        py::arg("rescore_margin") = 0, py::arg("rescore_max_k") = 0, py::arg("residual") = false, nogil);
  m.attr("vnni") = py::bool_(
#if defined(__AVX512VNNI__)
      true
#else
      false
#endif
  );
}
