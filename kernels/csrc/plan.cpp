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

#include "program.h"
#include "scan.h"

namespace silverrec {

namespace {
constexpr int64_t kModeAuto = 0, kModeProbed = 1, kModeUnprobed = 2;
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> filter_plan(
    const at::Tensor& queries, const at::Tensor& centroids, const at::Tensor& cluster_offsets, const at::Tensor& bits,
    const at::Tensor& ops, const at::Tensor& rows, const at::Tensor& lists, const at::Tensor& post_sizes,
    const at::Tensor& mode, int64_t k, int64_t nprobe, int64_t max_probe, int64_t window_words, int64_t match_factor,
    int64_t avg_cluster, int64_t num_items, double exact_cost_ratio, int64_t posting_limit, bool mask_if_unused) {
  for (const at::Tensor* t : {&cluster_offsets, &lists, &post_sizes, &mode})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "filter_plan: contiguous int64 CPU tensors expected");
  const int64_t B = queries.size(0), C = centroids.size(0), P = max_probe, T2 = lists.size(1);
  const int64_t V = post_sizes.size(0) - 1;
  TORCH_CHECK(P >= 1 && P <= C && nprobe >= 1 && nprobe <= P, "filter_plan: need 1 <= nprobe <= max_probe <= nlist");
  TORCH_CHECK(lists.size(0) == B && mode.size(0) == B, "filter_plan: lists / mode must have B rows");
  TORCH_CHECK(T2 >= 1, "filter_plan: lists must be int64 [B, T2 >= 1] (-1 = no list), got ", lists.sizes());
  const int64_t *off = cluster_offsets.data_ptr<int64_t>(), *ls = lists.data_ptr<int64_t>(),
                *psz = post_sizes.data_ptr<int64_t>(), *md = mode.data_ptr<int64_t>();

  // (at::empty + fill, not at::zeros / at::full: see filtered_ivf_search in ops.cpp)
  at::Tensor route = at::empty({B}, at::kLong);
  int64_t* rt = route.data_ptr<int64_t>();
  std::fill(rt, rt + B, int64_t{0});
  std::vector<int64_t> probing;  // queries that need centroid candidates
  for (int64_t b = 0; b < B; ++b) {
    int64_t size = 0;
    for (int64_t t = 0; t < T2; ++t) {
      const int64_t l = ls[b * T2 + t];
      size += psz[l >= 0 && l < V ? l : V];
    }
    const bool posting = ls[b * T2] != kNoLists && size <= posting_limit && md[b] != kModeProbed;
    if (posting) rt[b] = 2;
    else if (md[b] == kModeUnprobed) rt[b] = 1;  // whole pool, decided by the caller: no candidates
    else probing.push_back(b);
  }
  at::Tensor probes = at::empty({B, P}, at::kLong);
  int64_t* pr = probes.data_ptr<int64_t>();
  std::fill(pr, pr + B * P, int64_t{-1});
  // the counts steer only auto queries, the mask filters only programs that push a bank row: a
  // batch of probed queries without a filter (TRUE programs) needs neither (its scan, unmasked,
  // visits the same rows), nor more than its nprobe best centroids
  bool need_counts = false;
  for (int64_t b : probing) need_counts |= md[b] != kModeProbed;
  const bool unmasked = !mask_if_unused && !need_counts && program::pushes_nothing(ops.data_ptr<int64_t>(), ops.numel());
  if (probing.empty() && !mask_if_unused) return {probes, at::Tensor(), route};  // every query on posting lists
  if (unmasked) {
    std::vector<int64_t> top(B * nprobe, -1);
    centroid_candidates(centroids, queries, nprobe, probing, top.data());
    for (int64_t b : probing) std::copy(top.begin() + b * nprobe, top.begin() + (b + 1) * nprobe, pr + b * P);
    return {probes, at::Tensor(), route};
  }
  std::vector<int64_t> cand(B * P, -1);
  at::Tensor lo_t = at::empty({B, P}, at::kLong), hi_t = at::empty({B, P}, at::kLong);
  std::fill(lo_t.data_ptr<int64_t>(), lo_t.data_ptr<int64_t>() + B * P, int64_t{-1});
  std::fill(hi_t.data_ptr<int64_t>(), hi_t.data_ptr<int64_t>() + B * P, int64_t{0});
  if (!probing.empty()) {
    centroid_candidates(centroids, queries, P, probing, cand.data());
    int64_t *lo = lo_t.data_ptr<int64_t>(), *hi = hi_t.data_ptr<int64_t>();
    for (int64_t b : probing)
      for (int64_t j = b * P; j < (b + 1) * P; ++j) {
        lo[j] = off[cand[j]];
        hi[j] = off[cand[j] + 1];
      }
  }
  at::Tensor bitmask, counts;
  std::tie(bitmask, counts) = bloom_filter_counts(bits, ops, rows, lo_t, hi_t, window_words);
  const int64_t* cnt = counts.data_ptr<int64_t>();
  const float base = float(k * match_factor);
  const float ratio = float(exact_cost_ratio);
  for (int64_t b : probing) {
    int64_t total = 0, cand_rows = 0, cum = 0, need = 1, scanned = 0;
    for (int64_t j = 0; j < P; ++j) {
      const int64_t c = cand[b * P + j];
      total += cnt[b * P + j];
      cand_rows += off[c + 1] - off[c];
    }
    // matches to collect: k x match_factor / sqrt(the candidates' match density)
    const float density = float(total) / float(std::max<int64_t>(cand_rows, 1));
    const float target = base / std::sqrt(density);
    for (int64_t j = 0; j < P; ++j) {
      cum += cnt[b * P + j];
      need += float(cum) < target;
    }
    const int64_t use = md[b] == kModeProbed ? nprobe : std::min(std::max(need, nprobe), P);
    for (int64_t j = 0; j < use; ++j) scanned += off[cand[b * P + j] + 1] - off[cand[b * P + j]];
    const float est_total = float(total) * (float(num_items) / float(std::max<int64_t>(cand_rows, 1)));
    const bool autosw = float(total) < target || float(scanned) > est_total * ratio;
    const bool unprobed = md[b] == kModeAuto ? autosw : md[b] == kModeUnprobed;
    rt[b] = unprobed ? 1 : 0;
    if (!unprobed)
      for (int64_t j = 0; j < use; ++j) pr[b * P + j] = cand[b * P + j];
  }
  return {probes, bitmask, route};
}

}  // namespace silverrec
