// The operators' entry points that check their arguments as kernels/*.py documents them and call the kernels
// (scan.cpp, bloom.cpp, filter_scan.cpp, plan.cpp, centroid_probe.cpp), the query quantisation and key
// decoding they share, and rows_to_items. library.cpp registers them. Bad values raise ValueError with the
// messages the contracts name.
#include "ops.h"

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
#include <sstream>
#include <tuple>
#include <stdexcept>
#include <string>

#include "constants.h"
#include "dot.h"
#include "program.h"
#include "results.h"
#include "scan.h"
#include "search_args.h"
#include "team.h"
#include "topk_state.h"
#include "widen.h"

namespace silverrec {

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

}  // namespace

// ivf_scan: probes [B, P] (-1 = empty slot, repeats of a cluster count once: the first slot), optional
// bitmask [B, P, Wc]. Segments = probed clusters, ordered by the best slot any query gave them.
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

// kernels/common.py quantize_queries, bit for bit: scale = max(amax |q|, kQueryScaleFloor) / kQueryCodeMax and
// codes = round-half-even(q / scale) clamped to [-kQueryCodeMax, kQueryCodeMax] (float32 throughout).
std::tuple<at::Tensor, at::Tensor> quantize_queries(const at::Tensor& queries) {
  TORCH_CHECK(queries.device().is_cpu() && queries.scalar_type() == at::kFloat && queries.dim() == 2 &&
                  queries.is_contiguous(), "quantize_queries: contiguous float32 [B, D] expected");
  constexpr float kScaleFloor = float(kQueryScaleFloor), kCodeMax = float(kQueryCodeMax);
  static_assert(kScaleFloor == 1e-30f, "kQueryScaleFloor: the float nearest its decimal value");
  const int64_t B = queries.size(0), D = queries.size(1);
  at::Tensor codes = at::empty({B, D}, at::kChar), scale = at::empty({B}, at::kFloat);
  const float* q = queries.data_ptr<float>();
  int8_t* c = codes.data_ptr<int8_t>();
  float* s = scale.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float* x = q + b * D;
    float m = 0.0f;
    for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(x[d]));
    const float sc = std::max(m, kScaleFloor) / kCodeMax;
    s[b] = sc;
    for (int64_t d = 0; d < D; ++d) c[b * D + d] = int8_t(std::min(kCodeMax, std::max(-kCodeMax, std::nearbyint(x[d] / sc))));
  }
  return {codes, scale};
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

namespace {

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

}  // namespace

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

namespace {

// "Long [2, 3]": a tensor's dtype and shape, for messages.
std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << t.scalar_type() << " " << t.sizes();
  return out.str();
}

bool is(const at::Tensor& t, at::ScalarType dtype, int64_t dim) { return t.scalar_type() == dtype && t.dim() == dim; }

// kernels/bloom_filter.py check_program
void check_program(const at::Tensor& bits, const at::Tensor& ops, const at::Tensor& rows) {
  TORCH_CHECK_VALUE(is(bits, at::kLong, 2), "bits must be int64 [R, W], got ", describe(bits));
  TORCH_CHECK_VALUE(is(ops, at::kLong, 2), "ops must be int64 [B, L], got ", describe(ops));
  TORCH_CHECK_VALUE(is(rows, at::kLong, 3) && rows.size(0) == ops.size(0) && rows.size(1) == ops.size(1),
                    "rows must be int64 [B, L, T] with [B, L] = ", ops.sizes(), ", got ", describe(rows));
}

// The windows' first words (bloom_filter) or row ranges' starts (bloom_filter_counts): int64 [B, P].
void check_windows(const at::Tensor& ops, const at::Tensor& starts, int64_t n_words, const char* name) {
  TORCH_CHECK_VALUE(is(starts, at::kLong, 2) && starts.size(0) == ops.size(0), name, " must be int64 [B, P], got ",
                    describe(starts));
  TORCH_CHECK_VALUE(n_words >= 1, "n_words must be >= 1, got ", n_words);
}

at::Tensor as_float(const at::Tensor& x) { return (x.scalar_type() == at::kFloat ? x : x.to(at::kFloat)).contiguous(); }

// scores [B, k] += shift[b] (residual codes: the best visited cluster term, added back)
void add_shift(at::Tensor& scores, const float* shift) {
  float* sp = scores.data_ptr<float>();
  const int64_t k = scores.size(1);
  for (int64_t i = 0; i < scores.numel(); ++i) sp[i] += shift[i / k];
}

// Padding results [B, k]: scores -inf, rows -1.
Pair empty_results(int64_t B, int64_t k) {
  return {at::full({B, k}, -std::numeric_limits<float>::infinity(), at::kFloat), at::full({B, k}, -1, at::kLong)};
}

}  // namespace

at::Tensor bloom_filter_op(const at::Tensor& bits, const at::Tensor& ops, const at::Tensor& rows,
                           const at::Tensor& word_start, int64_t n_words) {
  check_program(bits, ops, rows);
  check_windows(ops, word_start, n_words, "word_start");
  return bloom_filter(bits.contiguous(), ops.contiguous(), rows.contiguous(), word_start.contiguous(), n_words);
}

Pair bloom_filter_counts_op(const at::Tensor& bits, const at::Tensor& ops, const at::Tensor& rows, const at::Tensor& lo,
                            const at::Tensor& hi, int64_t n_words) {
  check_program(bits, ops, rows);
  check_windows(ops, lo, n_words, "lo");
  TORCH_CHECK_VALUE(is(hi, at::kLong, 2) && hi.sizes() == lo.sizes(), "lo / hi must be int64 [B, P] of equal shape, got ",
                    describe(lo), ", ", describe(hi));
  return bloom_filter_counts(bits.contiguous(), ops.contiguous(), rows.contiguous(), lo.contiguous(), hi.contiguous(),
                             n_words);
}

Pair verify_topk_op(const at::Tensor& bits, const at::Tensor& ops, const at::Tensor& rows, const at::Tensor& scores,
                    const at::Tensor& result_rows, int64_t k) {
  check_program(bits, ops, rows);
  TORCH_CHECK_VALUE(is(result_rows, at::kLong, 2) && result_rows.size(0) == ops.size(0) &&
                        scores.sizes() == result_rows.sizes(),
                    "scores / rows must be [B, K2] (float32 / int64) with B = ", ops.size(0), ", got ", scores.sizes(),
                    ", ", result_rows.sizes());
  TORCH_CHECK_VALUE(k >= 1, "k must be >= 1, got ", k);
  return verify_topk(bits.contiguous(), ops.contiguous(), rows.contiguous(), as_float(scores), result_rows.contiguous(), k);
}

at::Tensor centroid_candidates_op(const at::Tensor& queries, const at::Tensor& centroids, int64_t P, bool screen) {
  TORCH_CHECK_VALUE(centroids.dim() == 2 && 1 <= P && P <= centroids.size(0), "need 1 <= P (", P,
                    ") <= the number of centroids (", centroids.dim() == 2 ? centroids.size(0) : 0, ")");
  TORCH_CHECK_VALUE(queries.dim() == 2 && queries.size(1) == centroids.size(1),
                    "queries [B, D] and centroids [C, D] expected, got ", queries.sizes(), " and ", centroids.sizes());
  TeamCall team;  // the helpers wake once for the call's steps
  const at::Tensor c = as_float(centroids), q = as_float(queries);
  at::Tensor out = at::empty({q.size(0), P}, at::kLong);
  std::vector<int64_t> all(q.size(0));
  std::iota(all.begin(), all.end(), int64_t{0});
  centroid_candidates(c, q, P, all, out.data_ptr<int64_t>(), screen);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> filter_plan_op(const at::Tensor& queries, at::TensorList index,
                                                              at::IntArrayRef params, double exact_cost_ratio,
                                                              at::TensorList program, const at::Tensor& mode, int64_t k,
                                                              int64_t nprobe, int64_t max_probe) {
  const char* op = "filter_plan";
  const FilterIndex fx = filter_index(op, index, params, exact_cost_ratio);
  const IvfIndex ix = ivf_index(index, params);
  const Program given = request_program(op, program);
  const int64_t nlist = ix.centroids.size(0);
  TORCH_CHECK_VALUE(1 <= nprobe && nprobe <= max_probe && max_probe <= nlist, "need 1 <= nprobe (", nprobe,
                    ") <= max_probe (", max_probe, ") <= nlist (", nlist, ")");
  const Program pr{given.ops.contiguous(), given.rows.contiguous(), given.vops.contiguous(), given.vrows.contiguous(),
                   given.lists.contiguous()};
  TeamCall team;
  return filter_plan(as_float(queries), ix, fx, pr, mode.to(at::kLong).contiguous(), k, nprobe, max_probe);
}

Pair ivf_scan(const at::Tensor& queries, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
              const at::Tensor& cluster_offsets, const at::Tensor& probes, int64_t k,
              const std::optional<at::Tensor>& bitmask, int64_t /*window_words: the CUDA scan's*/,
              const std::optional<at::Tensor>& centroids, const std::optional<at::Tensor>& centroid_queries) {
  // kernels/ivf_scan.py check_inputs (shapes and dtypes; ivf_scan_keys checks the values)
  TORCH_CHECK_VALUE(centroids.has_value() == centroid_queries.has_value(),
                    "centroids and centroid_queries go together (residual codes)");
  TORCH_CHECK_VALUE(is(codes, at::kChar, 2), "codes must be int8 [N, D], got ", describe(codes));
  TORCH_CHECK_VALUE(queries.dim() == 2 && queries.size(1) == codes.size(1), "queries must be [B, ", codes.size(1),
                    "], got ", queries.sizes());
  TORCH_CHECK_VALUE(scale.numel() == 1 && offset.numel() == 1, "scale and offset must be scalars");
  TORCH_CHECK_VALUE(is(cluster_offsets, at::kLong, 1) && cluster_offsets.numel() >= 2,
                    "cluster_offsets must be int64 [nlist + 1], got ", describe(cluster_offsets));
  TORCH_CHECK_VALUE(is(probes, at::kLong, 2) && probes.size(0) == queries.size(0), "probes must be int64 [",
                    queries.size(0), ", P], got ", describe(probes));
  TORCH_CHECK_VALUE(k >= 1, "k must be >= 1, got ", k);
  if (bitmask)
    TORCH_CHECK_VALUE(is(*bitmask, at::kLong, 3) && bitmask->size(0) == probes.size(0) && bitmask->size(1) == probes.size(1),
                      "bitmask must be int64 [", probes.size(0), ", ", probes.size(1), ", Wc], got ", describe(*bitmask));
  const int64_t nlist = cluster_offsets.numel() - 1, B = queries.size(0);
  if (centroids)
    TORCH_CHECK_VALUE(centroids->dim() == 2 && centroids->size(0) == nlist && centroids->size(1) == queries.size(1) &&
                          centroid_queries->sizes() == queries.sizes(),
                      "centroids must be [nlist, D] = [", nlist, ", ", queries.size(1), "] and centroid_queries [B, D] = ",
                      queries.sizes(), ", got ", centroids->sizes(), " and ", centroid_queries->sizes());
  TeamCall team;
  const at::Tensor q = as_float(queries), off = cluster_offsets.contiguous();
  at::Tensor qcodes, qscale;
  std::tie(qcodes, qscale) = quantize_queries(q);
  // residual codes: the cluster term of each query's probed clusters, as an int32 bias (ClusterTerm)
  ClusterTerm term;
  std::vector<float> unit, shift;
  at::Tensor cen, cq;
  if (centroids) {
    cen = as_float(*centroids);
    cq = as_float(*centroid_queries);
    const float sc = scale.item<float>(), *qs = qscale.data_ptr<float>();
    unit.resize(B);
    shift.assign(B, 0.0f);
    for (int64_t b = 0; b < B; ++b) unit[b] = sc * qs[b];
    term = {&off, cen.data_ptr<float>(), cq.data_ptr<float>(), unit.data(), shift.data(), nullptr};
  }
  const std::optional<at::Tensor> mask = bitmask ? std::optional<at::Tensor>(bitmask->contiguous()) : std::nullopt;
  const at::Tensor keys = ivf_scan_keys(qcodes, codes.contiguous(), off, probes.contiguous(), mask, k, BiasTable{}, term);
  Pair out = keys_to_results(keys, qscale, q.sum(1), scale, offset);
  if (centroids) add_shift(std::get<0>(out), shift.data());
  return out;
}

Pair filtered_topk(const at::Tensor& queries, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                   const at::Tensor& bits, at::TensorList program, at::TensorList postings, const at::Tensor& active,
                   int64_t k, int64_t /*max_candidates: the CUDA path's buffer*/, at::TensorList residual) {
  TORCH_CHECK_VALUE(program.size() == 2 && postings.size() == 3,
                    "filtered_topk: program must hold [ops, prog_rows] and postings [post_rows, post_offsets, lists], got ",
                    program.size(), " and ", postings.size(), " tensors");
  TORCH_CHECK_VALUE(residual.size() == 0 || residual.size() == 3,
                    "filtered_topk: residual is [] or [cluster_offsets, centroids, centroid_queries]: the three go "
                    "together (residual codes), got ", residual.size(), " tensors");
  const at::Tensor &ops = program[0], &prog_rows = program[1];
  const at::Tensor &post_rows = postings[0], &post_offsets = postings[1], &lists = postings[2];
  const int64_t B = queries.dim() == 2 ? queries.size(0) : -1;
  if (!residual.empty()) {
    const at::Tensor &co = residual[0], &cen = residual[1], &cq = residual[2];
    TORCH_CHECK_VALUE(is(co, at::kLong, 1) && cen.dim() == 2 && cen.size(0) == co.size(0) - 1 &&
                          queries.dim() == 2 && cen.size(1) == queries.size(1) && cq.sizes() == queries.sizes(),
                      "cluster_offsets int64 [nlist + 1], centroids [nlist, D] and centroid_queries [B, D] expected, got ",
                      describe(co), ", ", cen.sizes(), " and ", cq.sizes());
  }
  check_program(bits, ops, prog_rows);
  TORCH_CHECK_VALUE(is(post_rows, at::kInt, 1), "post_rows must be int32 [E], got ", describe(post_rows));
  TORCH_CHECK_VALUE(is(post_offsets, at::kLong, 1) && post_offsets.numel() >= 1, "post_offsets must be int64 [V + 1], got ",
                    describe(post_offsets));
  TORCH_CHECK_VALUE(is(lists, at::kLong, 2) && lists.size(0) == B, "lists must be int64 [", B, ", T2], got ",
                    describe(lists));
  TORCH_CHECK_VALUE(is(active, at::kBool, 1) && active.size(0) == B, "active must be bool [", B, "], got ", describe(active));
  TORCH_CHECK_VALUE(is(codes, at::kChar, 2) && queries.dim() == 2 && queries.size(1) == codes.size(1),
                    "queries [B, D] / codes int8 [N, D] expected, got ", queries.sizes(), " / ", describe(codes));
  TORCH_CHECK_VALUE(bits.size(1) == (codes.size(0) + 63) / 64, "bits must have ceil(N / 64) = ", (codes.size(0) + 63) / 64,
                    " words per row, got ", bits.size(1));
  TORCH_CHECK_VALUE(k >= 1, "k must be >= 1, got ", k);
  const at::Tensor act = active.contiguous();
  const bool* ap = act.data_ptr<bool>();
  if (std::none_of(ap, ap + B, [](bool a) { return a; })) return empty_results(B, k);  // inside a search: the usual case
  TeamCall team;
  const at::Tensor q = as_float(queries);
  at::Tensor qcodes, qscale;
  std::tie(qcodes, qscale) = quantize_queries(q);
  std::optional<at::Tensor> co, cen, cq, unit;
  if (!residual.empty()) {
    co = residual[0].contiguous();
    cen = as_float(residual[1]);
    cq = as_float(residual[2]);
    unit = as_float(at::mul(scale, qscale));
  }
  at::Tensor keys, shift;
  std::tie(keys, shift) = filtered_topk_keys(qcodes, codes.contiguous(), bits.contiguous(), ops.contiguous(),
                                             prog_rows.contiguous(), post_rows.contiguous(), post_offsets.contiguous(),
                                             lists.contiguous(), act, k, co, cen, cq, unit);
  Pair out = keys_to_results(keys, qscale, q.sum(1), scale, offset);
  if (!residual.empty()) add_shift(std::get<0>(out), shift.data_ptr<float>());
  return out;
}

// silverrec_host::ivf_scan_keys: the scan's sort keys for int8 queries, biases given as a table (tests compare
// them with the plain references bit for bit).
at::Tensor ivf_scan_keys_op(const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& cluster_offsets,
                            const at::Tensor& probes, const std::optional<at::Tensor>& bitmask, int64_t k,
                            const std::optional<at::Tensor>& bias) {
  TeamCall team;
  const std::optional<at::Tensor> mask = bitmask ? std::optional<at::Tensor>(bitmask->contiguous()) : std::nullopt;
  return ivf_scan_keys(qcodes.contiguous(), codes.contiguous(), cluster_offsets.contiguous(), probes.contiguous(), mask, k,
                       bias_table(bias, qcodes.size(0), cluster_offsets.size(0) - 1));
}

}  // namespace silverrec
