// silverrec::filter_plan CPU path: the filtered IVF search's per-query routing in one call.
//
// Same decisions, in the same float32 arithmetic, as kernels/filter_plan.py `filter_plan_torch`
// (the reference and the CUDA path): posting route, centroid candidates (centroid_probe.cpp: the
// reference's scores, bit-identical; best first, ties to the lower cluster), the filter with per-cluster
// match counts on the candidates (bloom_filter_counts), widening, and the whole-pool switch. One
// call replaces some thirty small tensor ops, and a batch that takes the posting route or is
// unprobed by its mode (the caller's estimate, silverrec/retrieval/filtered_search.py) computes no
// centroid scores and evaluates no cluster at all.
#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "constants.h"
#include "program.h"
#include "scan.h"
#include "search_args.h"

namespace silverrec {

namespace {

// Routes decided before any centroid is scored: ROUTE_POSTING where the query's lists hold at most
// posting_limit rows (not in probed mode), ROUTE_WHOLE_POOL where its mode says so, else ROUTE_PROBED;
// returns the queries that need centroid candidates (the rest).
std::vector<int64_t> early_routes(const FilterIndex& fx, const at::Tensor& lists, const int64_t* md, int64_t* rt) {
  const int64_t B = lists.size(0), T2 = lists.size(1), V = fx.post_sizes.size(0) - 1;
  const int64_t *ls = lists.data_ptr<int64_t>(), *psz = fx.post_sizes.data_ptr<int64_t>();
  std::vector<int64_t> probing;
  for (int64_t b = 0; b < B; ++b) {
    int64_t size = 0;
    for (int64_t t = 0; t < T2; ++t) {
      const int64_t l = ls[b * T2 + t];
      size += psz[l >= 0 && l < V ? l : V];
    }
    const bool posting = ls[b * T2] != kNoLists && size <= fx.posting_limit && md[b] != kModeProbed;
    if (posting) {
      rt[b] = kRoutePosting;
    } else if (md[b] == kModeUnprobed) {
      rt[b] = kRouteWholePool;  // decided by the caller: no candidates
    } else {
      rt[b] = kRouteProbed;
      probing.push_back(b);
    }
  }
  return probing;
}

// Row ranges [lo, hi) of each probing query's candidates (lo = kNoCluster: not evaluated): [B, P] each.
std::tuple<at::Tensor, at::Tensor> candidate_ranges(const int64_t* off, const std::vector<int64_t>& cand,
                                                    const std::vector<int64_t>& probing, int64_t B, int64_t P) {
  // (at::empty + fill, not at::zeros / at::full: see the search's request tensors in search.cpp)
  at::Tensor lo_t = at::empty({B, P}, at::kLong), hi_t = at::empty({B, P}, at::kLong);
  int64_t *lo = lo_t.data_ptr<int64_t>(), *hi = hi_t.data_ptr<int64_t>();
  std::fill(lo, lo + B * P, kNoCluster);
  std::fill(hi, hi + B * P, int64_t{0});
  for (int64_t b : probing)
    for (int64_t j = b * P; j < (b + 1) * P; ++j) {
      lo[j] = off[cand[j]];
      hi[j] = off[cand[j] + 1];
    }
  return {lo_t, hi_t};
}

// Widening and the whole-pool switch of one probing query b from its candidates' match counts: probe the
// shortest prefix holding target = k x match_factor / sqrt(density) matches (at least nprobe clusters, exactly
// nprobe in probed mode), or go to the whole pool (auto mode) when even all candidates hold fewer, or when the
// prefix would scan more rows than the pool's estimated matches x exact_cost_ratio.
void widen_or_switch(const FilterIndex& fx, const int64_t* off, const int64_t* cand, const int64_t* cnt, int64_t mode,
                     int64_t k, int64_t nprobe, int64_t P, int64_t* probes, int64_t& route) {
  const float base = float(k * fx.match_factor), ratio = float(fx.exact_cost_ratio);
  int64_t total = 0, cand_rows = 0, cum = 0, need = 1, scanned = 0;
  for (int64_t j = 0; j < P; ++j) {
    total += cnt[j];
    cand_rows += off[cand[j] + 1] - off[cand[j]];
  }
  const float density = float(total) / float(std::max<int64_t>(cand_rows, 1));
  const float target = base / std::sqrt(density);
  for (int64_t j = 0; j < P; ++j) {
    cum += cnt[j];
    need += float(cum) < target;
  }
  const int64_t use = mode == kModeProbed ? nprobe : std::min(std::max(need, nprobe), P);
  for (int64_t j = 0; j < use; ++j) scanned += off[cand[j] + 1] - off[cand[j]];
  const float est_total = float(total) * (float(fx.num_items) / float(std::max<int64_t>(cand_rows, 1)));
  const bool auto_switch = float(total) < target || float(scanned) > est_total * ratio;
  const bool unprobed = mode == kModeAuto ? auto_switch : mode == kModeUnprobed;
  route = unprobed ? kRouteWholePool : kRouteProbed;
  if (!unprobed) std::copy(cand, cand + use, probes);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> filter_plan(const at::Tensor& queries, const IvfIndex& ix,
                                                           const FilterIndex& fx, const Program& pr,
                                                           const at::Tensor& mode, int64_t k, int64_t nprobe,
                                                           int64_t max_probe, bool mask_if_unused) {
  for (const at::Tensor* t : {&ix.cluster_offsets, &pr.lists, &fx.post_sizes, &mode})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "filter_plan: contiguous int64 CPU tensors expected");
  const int64_t B = queries.size(0), C = ix.centroids.size(0), P = max_probe;
  TORCH_CHECK(P >= 1 && P <= C && nprobe >= 1 && nprobe <= P, "filter_plan: need 1 <= nprobe <= max_probe <= nlist");
  TORCH_CHECK(pr.lists.size(0) == B && mode.size(0) == B, "filter_plan: lists / mode must have B rows");
  TORCH_CHECK(pr.lists.size(1) >= 1, "filter_plan: lists must be int64 [B, T2 >= 1] (NO_LIST = no list), got ",
              pr.lists.sizes());
  const int64_t *off = ix.cluster_offsets.data_ptr<int64_t>(), *md = mode.data_ptr<int64_t>();
  at::Tensor route = at::empty({B}, at::kLong);
  int64_t* rt = route.data_ptr<int64_t>();
  const std::vector<int64_t> probing = early_routes(fx, pr.lists, md, rt);
  at::Tensor probes = at::empty({B, P}, at::kLong);
  int64_t* pb = probes.data_ptr<int64_t>();
  std::fill(pb, pb + B * P, kNoCluster);
  // the counts steer only auto queries, the mask filters only programs that push a bank row: a
  // batch of probed queries without a filter (TRUE programs) needs neither (its scan, unmasked,
  // visits the same rows), nor more than its nprobe best centroids
  bool need_counts = false;
  for (int64_t b : probing) need_counts |= md[b] != kModeProbed;
  const bool unmasked = !mask_if_unused && !need_counts && program::pushes_nothing(pr.ops.data_ptr<int64_t>(), pr.ops.numel());
  if (probing.empty() && !mask_if_unused) return {probes, at::Tensor(), route};  // every query on an exact route
  if (unmasked) {
    std::vector<int64_t> top(B * nprobe, kNoCluster);
    centroid_candidates(ix.centroids, queries, nprobe, probing, top.data());
    for (int64_t b : probing) std::copy(top.begin() + b * nprobe, top.begin() + (b + 1) * nprobe, pb + b * P);
    return {probes, at::Tensor(), route};
  }
  std::vector<int64_t> cand(B * P, kNoCluster);
  if (!probing.empty()) centroid_candidates(ix.centroids, queries, P, probing, cand.data());
  at::Tensor lo, hi, bitmask, counts;
  std::tie(lo, hi) = candidate_ranges(off, cand, probing, B, P);
  std::tie(bitmask, counts) = bloom_filter_counts(fx.bits, pr.ops, pr.rows, lo, hi, ix.window_words);
  const int64_t* cnt = counts.data_ptr<int64_t>();
  for (int64_t b : probing)
    widen_or_switch(fx, off, cand.data() + b * P, cnt + b * P, md[b], k, nprobe, P, pb + b * P, rt[b]);
  return {probes, bitmask, route};
}

}  // namespace silverrec
