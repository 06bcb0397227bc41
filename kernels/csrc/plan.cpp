// silverrec::filter_plan CPU path: the filtered IVF search's per-query routing in one call.
//
// Same decisions, in the same float32 arithmetic, as kernels/filter_plan.py `filter_plan_torch`
// (the reference and the CUDA path): posting route, centroid candidates (one at::mm, so the
// scores are bit-identical; best first, ties to the lower cluster), the filter with per-cluster
// match counts on the candidates (bloom_filter_counts), widening, and the whole-pool switch. One
// call replaces some thirty small tensor ops, and a batch that takes the posting route or is
// unprobed by its mode (the caller's estimate, silverrec/retrieval/filtered_search.py) computes no
// centroid scores and evaluates no cluster at all.
#include "tensor.h"
#include <c10/core/InferenceMode.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "program.h"
#include "scan.h"
#include "team.h"
#include "topk_state.h"

namespace silverrec {

// libtorch's MKL, where torch was built with it (weak: absent from other builds): this thread's own count,
// which overrides the process-wide one torch.set_num_threads sets (0: none of its own)
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));  // mkl.h: mkl_set_num_threads_local

namespace {
// BLAS calls on this thread use one thread while it lives: MKL's thread-local count, and the OpenMP
// count of this thread (MKL without a count of its own and OpenMP BLAS builds read it).
struct OneBlasThread {
  const int omp_before = omp_get_max_threads();
  const int mkl_before = MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0;
  OneBlasThread() { omp_set_num_threads(1); }
  ~OneBlasThread() {
    omp_set_num_threads(omp_before);
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(mkl_before);
  }
};
}  // namespace

// centroids @ queries^T float32 [C, B], as one at::mm computes it, in blocks of centroid rows shared with
// the team's helpers (team.h), each block one single-threaded at::mm. MKL splits this form's rows between
// its own threads and gives the same bits at any thread count (tests/test_team.py checks the blocks
// against one at::mm); run as one mm it took 220 us on one thread at C 4000, B 16, D 128, and 270-290 us on
// two under PASSIVE (its sleeping worker's wakes), ~40% of an unfiltered nprobe-4 search.
at::Tensor centroid_scores(const at::Tensor& centroids, const at::Tensor& queries) {
  const int64_t C = centroids.size(0), B = queries.size(0);
  const at::Tensor qt = queries.t();
  at::Tensor out = at::empty({C, B}, centroids.options());
  constexpr int64_t kRows = 128;  // rows a block (a multiple of MKL's 16-row panels)
  const int64_t blocks = (C + kRows - 1) / kRows;
  const bool inference = c10::InferenceMode::is_enabled();
  float* o = out.data_ptr<float>();
  team_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    OneBlasThread one;
    c10::InferenceMode mode(inference);
    const int64_t lo = b0 * kRows, hi = std::min(C, b1 * kRows);
    at::Tensor dst = at::from_blob(o + lo * B, {hi - lo, B}, centroids.options());
    at::mm_out(dst, centroids.narrow(0, lo, hi - lo), qt);
  });
  return out;
}

namespace {
constexpr int64_t kModeAuto = 0, kModeProbed = 1, kModeUnprobed = 2;
constexpr int64_t kInsertMax = 16;  // candidates up to which the top-P is kept by insertion (beyond: select + sort)
#if defined(__AVX2__)
// Queries b0 .. b0 + 7 whose score of a centroid (row[b]) beats their threshold: an 8-bit mask.
inline int beats8(const float* row, const float* thr) {
  return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row), _mm256_loadu_ps(thr), _CMP_GT_OQ));
}
#endif

// The best P (<= kInsertMax) centroids of each probing query from the scores sc float32 [C, B]
// (row c: every query's score of centroid c), best first, equal scores to the lower centroid:
// cand[b * P + j]. One pass over the rows: each query's P-th best score is its threshold, a whole
// row is compared against the thresholds at once, and the few centroids that beat one are inserted.
// The same comparisons, in the same order per query, as one insertion pass per query.
void top_p_rows(const float* sc, int64_t C, int64_t B, int64_t P, const std::vector<int64_t>& probing,
                int64_t* cand) {
  std::vector<float> best(B * P), thr(B, std::numeric_limits<float>::infinity());  // +inf: never beaten
  auto insert = [&](int64_t b, int64_t c, int64_t held) {
    float* bs = best.data() + b * P;
    int64_t* id = cand + b * P;
    const float s = sc[c * B + b];
    int64_t j = held < P ? held : P - 1;
    for (; j > 0 && bs[j - 1] < s; --j) {
      bs[j] = bs[j - 1];
      id[j] = id[j - 1];
    }
    bs[j] = s;
    id[j] = c;
  };
  for (int64_t c = 0; c < P; ++c)  // the first P fill the lists
    for (int64_t b : probing) insert(b, c, c);
  for (int64_t b : probing) thr[b] = best[b * P + P - 1];
  for (int64_t c = P; c < C; ++c) {
    const float* row = sc + c * B;
    int64_t b = 0;
#if defined(__AVX2__)
    for (; b + 8 <= B; b += 8)
      for (int m = beats8(row + b, thr.data() + b); m; m &= m - 1) {
        const int64_t q = b + __builtin_ctz(m);
        insert(q, c, P);
        thr[q] = best[q * P + P - 1];
      }
#endif
    for (; b < B; ++b)
      if (row[b] > thr[b]) {
        insert(b, c, P);
        thr[b] = best[b * P + P - 1];
      }
  }
}

// The best P centroids of each probing query (cand[b * P + j], best first, equal scores to the lower
// centroid) from the scores sc float32 [C, B]: by insertion up to kInsertMax, else a selection and a
// sort of the selected.
void top_candidates(const float* sc, int64_t C, int64_t B, int64_t P, const std::vector<int64_t>& probing,
                    int64_t* cand) {
  if (P <= kInsertMax) return top_p_rows(sc, C, B, P, probing, cand);
  // as the scan's sort keys (topk_state.h): the score's bits made to order as signed ints in the high
  // half, the centroid in the low half, so that one vectorised selection and one radix sort of
  // distinct int64 keys give the order (higher score, then lower centroid) without a comparator
  std::vector<int64_t> keys(C), scratch;
  std::vector<uint64_t> tmp;
  for (int64_t b : probing) {
    for (int64_t c = 0; c < C; ++c) {
      const float x = sc[c * B + b] + 0.0f;  // -0 as +0: equal scores, equal keys' high halves
      int32_t bits;
      std::memcpy(&bits, &x, 4);
      keys[c] = make_key(bits < 0 ? bits ^ 0x7FFFFFFF : bits, c);
    }
    select_top(keys.data(), C, P, scratch);
    sort_keys_descending(keys.data(), P, tmp);
    for (int64_t j = 0; j < P; ++j) cand[b * P + j] = int64_t{0xFFFFFFFF} - (keys[j] & int64_t{0xFFFFFFFF});
  }
}

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
  // the reference's scores: centroids @ queries^T, [C, B]
  const at::Tensor scores = probing.empty() ? at::Tensor() : centroid_scores(centroids, queries);
  if (unmasked) {
    std::vector<int64_t> top(B * nprobe, -1);
    top_candidates(scores.data_ptr<float>(), C, B, nprobe, probing, top.data());
    for (int64_t b : probing) std::copy(top.begin() + b * nprobe, top.begin() + (b + 1) * nprobe, pr + b * P);
    return {probes, at::Tensor(), route};
  }
  std::vector<int64_t> cand(B * P, -1);
  at::Tensor lo_t = at::empty({B, P}, at::kLong), hi_t = at::empty({B, P}, at::kLong);
  std::fill(lo_t.data_ptr<int64_t>(), lo_t.data_ptr<int64_t>() + B * P, int64_t{-1});
  std::fill(hi_t.data_ptr<int64_t>(), hi_t.data_ptr<int64_t>() + B * P, int64_t{0});
  if (!probing.empty()) {
    top_candidates(scores.data_ptr<float>(), C, B, P, probing, cand.data());
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
