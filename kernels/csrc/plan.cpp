// silverrec::filter_plan CPU path: the filtered IVF search's per-query routing in one call.
//
// Same decisions, in the same float32 arithmetic, as kernels/filter_plan.py `filter_plan_torch`
// (the reference and the CUDA path): posting route, centroid candidates (one at::mm, so the
// scores are bit-identical; best first, ties to the lower cluster), the filter with per-cluster
// match counts on the candidates (bloom_filter_counts), widening, and the whole-pool switch. One
// call replaces some thirty small tensor ops, and a batch that takes the posting route or is
// unprobed by its mode (the caller's estimate, silverrec/retrieval/filtered_search.py) computes no
// centroid scores and evaluates no cluster at all.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <vector>

#include "scan.h"

namespace silverrec {

namespace {
constexpr int64_t kModeAuto = 0, kModeProbed = 1, kModeUnprobed = 2;
constexpr int64_t kInsertMax = 64;  // candidates up to which the top-P is kept by insertion
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
  const int64_t *off = cluster_offsets.data_ptr<int64_t>(), *ls = lists.data_ptr<int64_t>(),
                *psz = post_sizes.data_ptr<int64_t>(), *md = mode.data_ptr<int64_t>();

  at::Tensor route = at::zeros({B}, at::kLong);
  int64_t* rt = route.data_ptr<int64_t>();
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
  at::Tensor probes = at::full({B, P}, -1, at::kLong);
  at::Tensor lo_t = at::full({B, P}, -1, at::kLong), hi_t = at::zeros({B, P}, at::kLong);
  std::vector<int64_t> cand(B * P, -1);
  if (!probing.empty()) {
    // the reference's scores: centroids @ queries^T (MKL splits this form across threads; the
    // queries @ centroids^T form ran on one), [C, B], read per query (no transposed copy)
    const at::Tensor scores = at::mm(centroids, queries.t()).contiguous();
    const float* sc = scores.data_ptr<float>();
    int64_t *lo = lo_t.data_ptr<int64_t>(), *hi = hi_t.data_ptr<int64_t>();
    std::vector<int64_t> idx(C);
    std::vector<float> col(C), best_s(P);
    for (int64_t b : probing) {
      for (int64_t c = 0; c < C; ++c) col[c] = sc[c * B + b];
      const float* s = col.data();
      if (P <= kInsertMax) {  // one compare per centroid against the P-th best, rare insertions
        int64_t n = 0;
        for (int64_t c = 0; c < C; ++c) {
          if (n == P && !(s[c] > best_s[P - 1])) continue;  // equal scores: the lower cluster stays
          int64_t j = n < P ? n++ : P - 1;
          for (; j > 0 && best_s[j - 1] < s[c]; --j) {
            best_s[j] = best_s[j - 1];
            idx[j] = idx[j - 1];
          }
          best_s[j] = s[c];
          idx[j] = c;
        }
      } else {
        std::iota(idx.begin(), idx.end(), 0);
        std::partial_sort(idx.begin(), idx.begin() + P, idx.end(),
                          [s](int64_t x, int64_t y) { return s[x] > s[y] || (s[x] == s[y] && x < y); });
      }
      for (int64_t j = 0; j < P; ++j) {
        const int64_t c = idx[j];
        cand[b * P + j] = c;
        lo[b * P + j] = off[c];
        hi[b * P + j] = off[c + 1];
      }
    }
  }
  if (probing.empty() && !mask_if_unused) return {probes, at::Tensor(), route};  // every query on posting lists
  at::Tensor bitmask, counts;
  std::tie(bitmask, counts) = bloom_filter_counts(bits, ops, rows, lo_t, hi_t, window_words);
  const int64_t* cnt = counts.data_ptr<int64_t>();
  int64_t* pr = probes.data_ptr<int64_t>();
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
