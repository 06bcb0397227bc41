// silverrec::candidate_rows (kernels/candidate_rows.py): the retrieval stage's tail in one pass per
// request: exclusions dropped, exact re-score from the embedding cache, each task's best k0 (ties by
// position in the search's list), tasks merged rank by rank (union or intersection), first `limit`.
// The same results as the composition `candidate_rows_torch` (up to float rounding of the dot
// products, whose summation order differs from the batched matmul's).
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "row_counts.h"
#include "scored.h"
#include "team.h"
#include "widen.h"

namespace silverrec {
namespace {

template <typename E>
void one_request(const float* q, const int64_t* found, const int64_t* ex, int64_t T, int64_t K, int64_t D, int64_t E_,
                 const E* emb, int64_t n, int64_t k0, int64_t limit, bool intersection, int64_t* out) {
  RowCounts excluded(E_);
  for (int64_t e = 0; e < E_; ++e)
    if (ex[e] >= 0) excluded.at(ex[e]) = 1;
  const int64_t keep = std::min(k0, K);
  std::vector<int64_t> lists(T * keep);
  std::vector<int64_t> sizes(T);
  std::vector<Scored> scored(K);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* f = found + t * K;
    const float* qt = q + t * D;
    int64_t m = 0;
    constexpr int64_t kAhead = 8;  // rows are random: fetch the row kAhead positions on while this one is scored
    const int64_t row_bytes = D * int64_t(sizeof(E));
    for (int64_t j = 0; j < K; ++j) {
      if (j + kAhead < K && f[j + kAhead] >= 0 && f[j + kAhead] < n) {
        const char* p = reinterpret_cast<const char*>(emb + f[j + kAhead] * D);
        for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o);
      }
      const int64_t r = f[j];
      if (r < 0 || excluded.get(r)) continue;
      TORCH_CHECK_INDEX(r < n, "candidate_rows: row ", r, " out of range for ", n, " cached rows");
      const float s = dot_lanes(qt, emb + r * D, D);
      if (!(s > -std::numeric_limits<float>::infinity())) continue;  // NaN or -inf: dropped
      scored[m++] = {s, int32_t(j), r};
    }
    const int64_t top = std::min(keep, m);
    keep_best(scored, m, top);
    for (int64_t i = 0; i < top; ++i) lists[t * keep + i] = scored[i].row;
    sizes[t] = top;
  }
  std::fill(out, out + limit, int64_t{-1});
  const bool all_tasks = intersection && T > 1;
  RowCounts held(all_tasks ? T * keep : 0);
  if (all_tasks)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < sizes[t]; ++i) ++held.at(lists[t * keep + i]);
  RowCounts seen(T * keep);
  int64_t c = 0;
  for (int64_t i = 0; i < keep && c < limit; ++i) {
    for (int64_t t = 0; t < T && c < limit; ++t) {
      if (i >= sizes[t]) continue;
      const int64_t r = lists[t * keep + i];
      if (all_tasks && held.get(r) != T) continue;
      int32_t& s = seen.at(r);
      if (s) continue;
      s = 1;
      out[c++] = r;
    }
  }
}

}  // namespace

at::Tensor candidate_rows(const at::Tensor& queries_in, const at::Tensor& found_in, const at::Tensor& exclude_in,
                          const at::Tensor& emb_in, int64_t k0, int64_t limit, bool intersection) {
  const at::Tensor queries = queries_in.contiguous(), found = found_in.contiguous();
  const at::Tensor exclude = exclude_in.contiguous(), emb = emb_in.contiguous();
  TORCH_CHECK(queries.dim() == 2 && queries.scalar_type() == at::kFloat, "candidate_rows: queries must be float32 [B*T, D], got ",
              queries.scalar_type(), " ", queries.sizes());
  TORCH_CHECK(found.dim() == 2 && found.scalar_type() == at::kLong, "candidate_rows: found must be int64 [B*T, K], got ",
              found.scalar_type(), " ", found.sizes());
  TORCH_CHECK(exclude.dim() == 2 && exclude.scalar_type() == at::kLong, "candidate_rows: exclude must be int64 [B, E], got ",
              exclude.scalar_type(), " ", exclude.sizes());
  TORCH_CHECK(emb.dim() == 2 && (emb.scalar_type() == at::kBFloat16 || emb.scalar_type() == at::kFloat),
              "candidate_rows: emb must be bfloat16 or float32 [N, D], got ", emb.scalar_type(), " ", emb.sizes());
  const int64_t B = exclude.size(0), E = exclude.size(1), K = found.size(1), D = queries.size(1), n = emb.size(0);
  const int64_t T = B ? found.size(0) / B : 1;
  TORCH_CHECK(found.size(0) == B * T && queries.size(0) == B * T && emb.size(1) == D,
              "candidate_rows: found ", found.sizes(), ", queries ", queries.sizes(), ", exclude ", exclude.sizes(),
              " and emb ", emb.sizes(), " disagree (found [B*T, K], queries [B*T, D], exclude [B, E], emb [N, D])");
  TORCH_CHECK(k0 >= 1 && limit >= 1, "candidate_rows: k0 and limit must be >= 1, got ", k0, " and ", limit);
  at::Tensor out = at::empty({B, limit}, at::kLong);
  const float* q = queries.data_ptr<float>();
  const int64_t* f = found.data_ptr<int64_t>();
  const int64_t* ex = exclude.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  team_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      if (emb.scalar_type() == at::kFloat)
        one_request(q + b * T * D, f + b * T * K, ex + b * E, T, K, D, E, emb.data_ptr<float>(), n, k0, limit,
                    intersection, o + b * limit);
      else
        one_request(q + b * T * D, f + b * T * K, ex + b * E, T, K, D, E, emb.data_ptr<at::BFloat16>(), n, k0, limit,
                    intersection, o + b * limit);
    }
  });
  return out;
}

}  // namespace silverrec
