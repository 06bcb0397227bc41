// silverrec::ivf_search and silverrec::filtered_ivf_search: their CPU kernels (kernels/filtered_ivf_search.py).
//
// The steps of the compositions `ivf_search_torch` and `filtered_ivf_search_torch`, with the same ATen calls
// and C++ kernels (bit-identical results), without per-op dispatch or intermediate tensors:
//   plan     the filtered search routes every query (filter_plan, plan.cpp); the plain search probes each
//            query's nprobe best centroids (centroid_candidates, centroid_probe.cpp)
//   fold     per-dimension ranges folded into the queries, which are quantised to int8 (`fold`)
//   probed   the probed route's scan (ivf_scan_keys), verified unless no program filters (`probed_route`)
//   exact    the whole-pool and posting-list routes (filtered_topk_into, filter_scan.cpp; `exact_routes`)
//   merge    each query's route decoded, its constant and cluster shift added, padding written once
//   rescore  the float re-score when asked (rescore.cpp), then rows to item ids (`rescore_results`)
// The request's small tensors are made with plain loops, not ATen calls: after other work has evicted
// libtorch's code, an ATen call on a few hundred bytes costs more than the loop it replaces.
#include "ops.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "constants.h"
#include "program.h"
#include "results.h"
#include "scan.h"
#include "search_args.h"
#include "team.h"

namespace silverrec {

// kernels/csrc/rescore.cpp
std::tuple<at::Tensor, at::Tensor> rescore_rows_with_terms(
    const at::Tensor& queries, const at::Tensor& found, const at::Tensor& codes, const at::Tensor& dim_scale,
    const at::Tensor& dim_offset, int64_t k, const std::optional<at::Tensor>& cluster_offsets,
    const std::optional<at::Tensor>& centroids, const float* terms);

namespace {

at::Tensor as_float(const at::Tensor& x) { return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat).contiguous(); }

// x [R, ...] -> [R * per, ...], row r per times: the request's tensors given once per request of `per`
// consecutive queries (a request's task queries share its filter), one row per query.
at::Tensor per_query(const at::Tensor& x, int64_t per) {
  if (per == 1) return x.contiguous();
  std::vector<int64_t> shape = x.sizes().vec();
  shape.insert(shape.begin() + 1, per);
  at::Tensor repeated = x.unsqueeze(1).expand(shape).contiguous();  // one copy (cheaper than repeat_interleave)
  shape.erase(shape.begin() + 1);
  shape[0] *= per;
  return repeated.view(shape);
}

// Results returned (k_out) and rows each route finds (k: k_out + the re-score margin when the re-score runs).
struct Sizes {
  int64_t k_out, k;
  bool rescore;
};

Sizes search_sizes(int64_t k, int64_t rescore_margin, int64_t rescore_max_k) {
  if (k < 1) throw std::invalid_argument("k must be >= 1, got " + std::to_string(k));
  const bool rescore = rescore_margin > 0 && k <= rescore_max_k;
  return {k, rescore ? k + rescore_margin : k, rescore};
}

// Per-dimension ranges folded into the queries (score = int8-op score + constant, per query), quantised.
struct Folded {
  at::Tensor q;               // float32 [B, D], the queries
  at::Tensor folded;          // q x dim_scale (elementwise: identical to at::mul)
  at::Tensor constant;        // [B] <q, dim_offset> (BLAS, as the composition: identical sums)
  at::Tensor qsum;            // [B] folded's row sums (only ever x 0: the composition's keys_to_results offset,
                              // so their rounding cannot show)
  at::Tensor qcodes, qscale;  // quantize_queries(folded)
};

Folded fold(const at::Tensor& q, const IvfIndex& ix) {
  const int64_t B = q.size(0), D = q.size(1);
  TORCH_CHECK(ix.dim_scale.scalar_type() == at::kFloat && (ix.dim_scale.numel() == D || ix.dim_scale.numel() == 1),
              "dim_scale: float32 [D] (or one value) expected");
  const int64_t step = ix.dim_scale.numel() == 1 ? 0 : 1;
  Folded f;
  f.q = q;
  f.constant = at::matmul(q, ix.dim_offset).contiguous();
  f.folded = at::empty({B, D}, at::kFloat);
  f.qsum = at::empty({B}, at::kFloat);
  const float *qp = q.data_ptr<float>(), *ds = ix.dim_scale.data_ptr<float>();
  float *fp = f.folded.data_ptr<float>(), *sp = f.qsum.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    float sum = 0.0f;
    for (int64_t d = 0; d < D; ++d) sum += (fp[b * D + d] = qp[b * D + d] * ds[d * step]);
    sp[b] = sum;
  }
  std::tie(f.qcodes, f.qscale) = quantize_queries(f.folded);
  return f;
}

// Residual codes: every row of cluster c adds <q, centroid c>, computed by each route for the clusters it visits
// (ClusterTerm); each route's shift is added back to its scores. Built in place (the terms point into it).
struct Residual {
  bool on = false;
  std::vector<float> shift, shift_ex, unit;  // [B] the probed and the exact routes' shifts; the scores' unit
  std::unique_ptr<float[]> terms;            // [nlist, B] the terms the routes computed, for the re-score
  ClusterTerm probed, exact;                 // the probed route's and the exact routes' terms
  std::optional<at::Tensor> offsets;         // cluster_offsets when on (the re-score's argument)
};

void residual_terms(Residual& r, const IvfIndex& ix, const Folded& f, bool rescore) {
  const int64_t B = f.q.size(0);
  r.shift.assign(B, 0.0f);
  r.shift_ex.assign(B, 0.0f);
  r.unit.assign(B, 0.0f);
  if (!ix.residual) return;
  r.on = true;
  const float* qs = f.qscale.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) r.unit[b] = 1.0f * qs[b];  // the ops' scale (1) x qscale, as cluster_bias
  if (rescore) r.terms.reset(new float[B * ix.centroids.size(0)]);
  r.probed = {&ix.cluster_offsets, ix.centroids.data_ptr<float>(), f.q.data_ptr<float>(), r.unit.data(),
              r.shift.data(), r.terms.get()};
  r.exact = r.probed;
  r.exact.shift = r.shift_ex.data();
  r.offsets = ix.cluster_offsets;
}

// The probed route: each query's probes scanned. Filtered (`verify`: the request's programs), with a margin
// for Bloom false positives, the best k that pass the verify program kept as (scores, rows); unfiltered (no
// program pushes a bank row: no false positives) k rows whose keys the merge decodes (the composition's
// verify_topk would keep the first k of its ranked rows: the same k rows).
struct Probed {
  at::Tensor keys;          // unfiltered: [B, k]
  at::Tensor scores, rows;  // filtered: [B, k]
};

Probed probed_route(const IvfIndex& ix, const Folded& f, const at::Tensor& probes, const at::Tensor& bitmask,
                    const Residual& res, int64_t k, const at::Tensor* bits, const Program* verify) {
  Probed out;
  const int64_t* pb = probes.data_ptr<int64_t>();
  if (std::none_of(pb, pb + probes.numel(), [](int64_t c) { return c >= 0; })) return out;
  const int64_t k_scan = verify ? k + k / kVerifyMarginDivisor + kVerifyMarginRows : k;
  const std::optional<at::Tensor> mask = bitmask.defined() ? std::optional<at::Tensor>(bitmask) : std::nullopt;
  at::Tensor keys = ivf_scan_keys(f.qcodes, ix.codes, ix.cluster_offsets, probes, mask, k_scan, BiasTable{}, res.probed);
  if (!verify) {
    out.keys = keys;
    return out;
  }
  at::Tensor scores, rows;
  std::tie(scores, rows) = decode_keys(keys, f.qscale.data_ptr<float>(), f.qsum.data_ptr<float>(), 1.0f, 0.0f);
  if (res.on) {  // ivf_scan's scores carry the shift
    float* sp = scores.data_ptr<float>();
    for (int64_t i = 0; i < scores.numel(); ++i) sp[i] += res.shift[i / k_scan];
  }
  std::tie(out.scores, out.rows) = verify_topk(*bits, verify->vops, verify->vrows, scores, rows, k);
  return out;
}

// The exact routes (kRouteWholePool, kRoutePosting): filter, then exact scan; query b's count[b] keys, unpadded
// (the merge pads once). With the re-score, a query whose filter passes at most kExactFloatRows rows is ranked
// in float by filtered_topk_into itself (the re-score of a list holding all of them): float_scores / float_rows,
// float_done[b] set.
struct Exact {
  at::Tensor keys;  // [B, k], undefined when no query takes an exact route
  std::vector<int64_t> count;
  at::Tensor float_scores, float_rows;  // [B, k_out]
  std::unique_ptr<bool[]> float_done;   // [B]
  explicit Exact(int64_t B) : count(B, 0), float_done(new bool[B]()) {}
};

void exact_routes(Exact& ex, const IvfIndex& ix, const FilterIndex& fx, const Program& pr, const int64_t* rt,
                  const Folded& f, const Residual& res, const Sizes& sz) {
  const int64_t B = f.q.size(0), D = f.q.size(1);
  if (std::all_of(rt, rt + B, [](int64_t r) { return r == kRouteProbed; })) return;
  FloatRanking ranking;
  if (sz.rescore) {
    TORCH_CHECK(ix.dim_offset.scalar_type() == at::kFloat && ix.dim_offset.numel() == D, "dim_offset: float32 [D] expected");
    ex.float_scores = at::empty({B, sz.k_out}, at::kFloat);
    ex.float_rows = at::empty({B, sz.k_out}, at::kLong);
    ranking = {f.q.data_ptr<float>(), f.folded.data_ptr<float>(), ix.dim_offset.data_ptr<float>(), sz.k_out,
               ex.float_scores.data_ptr<float>(), ex.float_rows.data_ptr<int64_t>(), ex.float_done.get()};
  }
  // the lists each exact query draws from: its posting lists, or kNoLists (the whole pool)
  at::Tensor src = at::empty_like(pr.lists), active = at::empty({B}, at::kBool);
  std::memcpy(src.data_ptr<int64_t>(), pr.lists.data_ptr<int64_t>(), pr.lists.numel() * sizeof(int64_t));
  int64_t* sp = src.data_ptr<int64_t>();
  bool* ap = active.data_ptr<bool>();
  const int64_t T2 = src.size(1);
  for (int64_t b = 0; b < B; ++b) {
    ap[b] = rt[b] != kRouteProbed;
    if (rt[b] == kRouteWholePool) std::fill(sp + b * T2, sp + (b + 1) * T2, kNoLists);
  }
  ex.keys = at::empty({B, sz.k}, at::kLong);
  filtered_topk_into(f.qcodes, ix.codes, fx.bits, pr.vops, pr.vrows, fx.post_rows, fx.post_offsets, src, active, sz.k,
                     ex.keys.data_ptr<int64_t>(), ex.count.data(), res.exact, sz.rescore ? &ranking : nullptr);
}

// Rows -> item ids through row_to_item (int32 or int64 [N]).
struct ItemMap {
  const int32_t* id32 = nullptr;
  const int64_t* id64 = nullptr;
  explicit ItemMap(const at::Tensor& row_to_item) {
    const bool ids32 = row_to_item.scalar_type() == at::kInt;
    TORCH_CHECK(ids32 || row_to_item.scalar_type() == at::kLong, "row_to_item must be int32 or int64");
    if (ids32) id32 = row_to_item.data_ptr<int32_t>();
    else id64 = row_to_item.data_ptr<int64_t>();
  }
  int64_t operator()(int64_t r) const { return id32 ? int64_t(id32[r]) : id64[r]; }
};

// Each query's results [B, k]: its route's keys decoded (the exact routes' count[b], or the unverified probed
// scan's k) or its verified probed (score, row)s, plus the cluster shift and the query's constant; rows mapped
// to item ids when `map_ids`; padding written once. A large result is decoded and padded by every thread, a
// query each (k 4096: 768 KB per 16 queries).
std::tuple<at::Tensor, at::Tensor> merge_routes(const IvfIndex& ix, const Folded& f, const int64_t* rt,
                                                const Probed& probed, const Exact& ex, const Residual& res, int64_t k,
                                                bool map_ids) {
  const int64_t B = f.q.size(0);
  at::Tensor scores = at::empty({B, k}, at::kFloat), ids = at::empty({B, k}, at::kLong);
  float* so = scores.data_ptr<float>();
  int64_t* io = ids.data_ptr<int64_t>();
  const float* cst = f.constant.data_ptr<float>();
  const ItemMap item_of(ix.row_to_item);
  const int64_t* k_pr = probed.keys.defined() ? probed.keys.data_ptr<int64_t>() : nullptr;
  const float* s_pr = probed.scores.defined() ? probed.scores.data_ptr<float>() : nullptr;
  const int64_t* r_pr = probed.rows.defined() ? probed.rows.data_ptr<int64_t>() : nullptr;
  const int64_t* k_ex = ex.keys.defined() ? ex.keys.data_ptr<int64_t>() : nullptr;
  const float *qs = f.qscale.data_ptr<float>(), *qm = f.qsum.data_ptr<float>();
  const float none = -std::numeric_limits<float>::infinity();
  const int64_t grain = B * k * int64_t(sizeof(float) + sizeof(int64_t)) >= kParallelResultBytes ? 1 : B;
  team_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* sb = so + b * k;
      int64_t* ib = io + b * k;
      const bool exact = rt[b] != kRouteProbed;
      const float mul = 1.0f * qs[b], add = 0.0f * qm[b];  // keys_to_results with scale 1, offset 0
      int64_t i = 0;
      if (exact || k_pr) {
        const int64_t* key = (exact ? k_ex : k_pr) + b * k;
        const int64_t n = exact ? ex.count[b] : k;
        for (; i < n; ++i) {
          float sc;
          int64_t r;
          decode_key(key[i], mul, add, sc, r);
          sb[i] = (res.on ? sc + (exact ? res.shift_ex[b] : res.shift[b]) : sc) + cst[b];
          ib[i] = r < 0 ? kNoRow : !map_ids ? r : item_of(r);
        }
      } else if (s_pr) {
        for (; i < k; ++i) {
          const int64_t r = r_pr[b * k + i];
          sb[i] = s_pr[b * k + i] + cst[b];
          ib[i] = r < 0 ? kNoRow : !map_ids ? r : item_of(r);
        }
      }
      fill_streaming(sb + i, k - i, none + cst[b]);
      fill_streaming(ib + i, k - i, kNoRow);
    }
    streaming_done();  // each thread's streaming stores, before anyone reads the outputs
  });
  return {scores, ids};
}

// The float re-score of every query's rows (the queries the exact routes ranked in float kept as they are),
// then rows to item ids unless `as_rows`.
std::tuple<at::Tensor, at::Tensor> rescore_results(const IvfIndex& ix, const Folded& f, const at::Tensor& rows,
                                                   const Exact& ex, const Residual& res, int64_t k_out, bool as_rows) {
  const int64_t B = f.q.size(0), D = f.q.size(1);
  at::Tensor top_scores = ex.float_scores, top_rows = ex.float_rows;  // every query ranked in float: no re-score
  const bool all_float = ex.float_scores.defined() && std::all_of(ex.float_done.get(), ex.float_done.get() + B,
                                                                  [](bool d) { return d; });
  if (!all_float) {
    const at::Tensor dim_scale = ix.dim_scale.numel() == D ? ix.dim_scale : ix.dim_scale.expand({D}).contiguous();
    std::tie(top_scores, top_rows) = rescore_rows_with_terms(
        f.q, rows, ix.codes, dim_scale, ix.dim_offset, k_out, res.offsets,
        res.on ? std::optional<at::Tensor>(ix.centroids) : std::nullopt, res.terms.get());
    for (int64_t b = 0; b < B; ++b)  // the queries ranked in float by the exact routes (their scan lists were empty)
      if (ex.float_done[b]) {
        std::memcpy(top_scores.data_ptr<float>() + b * k_out, ex.float_scores.data_ptr<float>() + b * k_out, k_out * sizeof(float));
        std::memcpy(top_rows.data_ptr<int64_t>() + b * k_out, ex.float_rows.data_ptr<int64_t>() + b * k_out, k_out * sizeof(int64_t));
      }
  }
  if (!as_rows) {
    const ItemMap item_of(ix.row_to_item);
    int64_t* tr = top_rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < B * k_out; ++i)
      if (tr[i] >= 0) tr[i] = item_of(tr[i]);
  }
  return {top_scores, top_rows};
}

// The tail both searches share: merge the routes, then the re-score when asked. A zero-length row_to_item
// asks for rows (RecModel's later stages read rows); the re-score reads rows, so ids are mapped after it.
std::tuple<at::Tensor, at::Tensor> finish(const IvfIndex& ix, const Folded& f, const int64_t* rt, const Probed& probed,
                                          const Exact& ex, const Residual& res, const Sizes& sz) {
  const bool as_rows = ix.row_to_item.numel() == 0;
  at::Tensor scores, ids;
  std::tie(scores, ids) = merge_routes(ix, f, rt, probed, ex, res, sz.k, !as_rows && !sz.rescore);
  if (!sz.rescore) return {scores, ids};
  return rescore_results(ix, f, ids, ex, res, sz.k_out, as_rows);
}

}  // namespace

// silverrec::filtered_ivf_search (kernels/filtered_ivf_search.py).
std::tuple<at::Tensor, at::Tensor> filtered_ivf_search(const at::Tensor& queries_in, at::TensorList index,
                                                       at::IntArrayRef params, double exact_cost_ratio,
                                                       at::TensorList program, const at::Tensor& mode_in, int64_t k,
                                                       int64_t nprobe, int64_t max_probe, int64_t rescore_margin,
                                                       int64_t rescore_max_k) {
  TeamCall team;  // the helpers wake now, to be awake by the first parallel step
  const char* op = "filtered_ivf_search";
  const FilterIndex fx = filter_index(op, index, params, exact_cost_ratio);
  const IvfIndex ix = ivf_index(index, params);
  const Program given = request_program(op, program);
  const at::Tensor queries = queries_in.contiguous();
  const int64_t R = given.ops.size(0), per = R > 0 && queries.size(0) % R == 0 ? queries.size(0) / R : 1;
  const Program pr = {per_query(given.ops, per), per_query(given.rows, per), per_query(given.vops, per),
                      per_query(given.vrows, per), per_query(given.lists, per)};
  at::Tensor mode = per_query(mode_in, per);
  if (mode.scalar_type() != at::kLong) mode = mode.to(at::kLong).contiguous();
  const Sizes sz = search_sizes(k, rescore_margin, rescore_max_k);
  if (!(1 <= nprobe && nprobe <= max_probe && max_probe <= ix.centroids.size(0)))
    throw std::invalid_argument("need 1 <= nprobe (" + std::to_string(nprobe) + ") <= max_probe (" +
                                std::to_string(max_probe) + ") <= nlist (" + std::to_string(ix.centroids.size(0)) + ")");
  const at::Tensor q = as_float(queries);
  at::Tensor probes, bitmask, route;
  std::tie(probes, bitmask, route) = filter_plan(q, ix, fx, pr, mode, sz.k, nprobe, max_probe, /*mask_if_unused=*/false);
  const Folded f = fold(q, ix);
  Residual res;
  residual_terms(res, ix, f, sz.rescore);
  const int64_t* rt = route.data_ptr<int64_t>();
  const bool unfiltered = program::pushes_nothing(pr.ops.data_ptr<int64_t>(), pr.ops.numel()) &&
                          program::pushes_nothing(pr.vops.data_ptr<int64_t>(), pr.vops.numel());
  const Probed probed = probed_route(ix, f, probes, bitmask, res, sz.k, &fx.bits, unfiltered ? nullptr : &pr);
  Exact ex(q.size(0));
  exact_routes(ex, ix, fx, pr, rt, f, res, sz);
  return finish(ix, f, rt, probed, ex, res, sz);
}

// silverrec::ivf_search (kernels/filtered_ivf_search.py): the probed route of every query, unfiltered.
std::tuple<at::Tensor, at::Tensor> ivf_search(const at::Tensor& queries_in, at::TensorList index, at::IntArrayRef params,
                                              int64_t k, int64_t nprobe, int64_t rescore_margin, int64_t rescore_max_k) {
  TeamCall team;
  const IvfIndex ix = plain_index("ivf_search", index, params);
  const Sizes sz = search_sizes(k, rescore_margin, rescore_max_k);
  if (!(1 <= nprobe && nprobe <= ix.centroids.size(0)))
    throw std::invalid_argument("need 1 <= nprobe (" + std::to_string(nprobe) + ") <= nlist (" +
                                std::to_string(ix.centroids.size(0)) + ")");
  const at::Tensor q = as_float(queries_in.contiguous());
  const int64_t B = q.size(0);
  at::Tensor probes = at::empty({B, nprobe}, at::kLong);
  std::vector<int64_t> every(B);
  std::iota(every.begin(), every.end(), int64_t{0});
  centroid_candidates(ix.centroids, q, nprobe, every, probes.data_ptr<int64_t>());
  const Folded f = fold(q, ix);
  Residual res;
  residual_terms(res, ix, f, sz.rescore);
  const std::vector<int64_t> routes(B, kRouteProbed);
  const Probed probed = probed_route(ix, f, probes, at::Tensor(), res, sz.k, nullptr, nullptr);
  return finish(ix, f, routes.data(), probed, Exact(B), res, sz);
}

}  // namespace silverrec
