// silverrec::rescore_rows (kernels/rescore_rows.py): the int8 scan's top rows re-scored with the float
// query on the same codes, the best k kept (ties by position in the scan's list). One pass per query:
// the query folded by the per-dimension scales, each row's codes widened and dotted in float32 lanes
// (AVX-512, or widen.h's portable lanes), a partial sort. The same results as the composition `rescore_rows_torch` up to float
// rounding of the dot products, whose summation order differs from the batched matmul's.
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "scored.h"
#include "team.h"
#include "widen.h"

namespace silverrec {
namespace {

// Row -> cluster for residual codes: buckets of 2^shift rows (about two per cluster), first[i] the cluster
// holding row i << shift; a row's cluster is its bucket's, or a few after it (no binary search: its chain of
// dependent loads per scattered row took a selective residual search from 0.204 to 0.274 ms, warm).
struct ClusterOfRow {
  const int64_t* off = nullptr;
  int shift = 0;
  std::vector<int32_t> first;

  ClusterOfRow(const int64_t* off_, int64_t nlist) : off(off_) {
    const int64_t n = off[nlist];
    while ((n >> (shift + 1)) >= 2 * nlist) ++shift;
    // each cluster marks the first bucket starting inside or after it, then a running max (no data-dependent
    // branch per bucket: a walk of the offsets mispredicted once a bucket, 10 us of a 0.3 ms search)
    const int64_t buckets = (n >> shift) + 1;
    first.assign(buckets, 0);
    for (int64_t c = 1; c < nlist; ++c) {
      const int64_t i = (off[c] + (int64_t{1} << shift) - 1) >> shift;
      if (off[c] < n && i < buckets) first[i] = int32_t(c);  // later (higher) clusters overwrite
    }
    for (int64_t i = 1; i < buckets; ++i) first[i] = std::max(first[i], first[i - 1]);
  }
  int64_t operator()(int64_t r) const {  // 0 <= r < off[nlist]; the last c with off[c] <= r
    int64_t c = first[r >> shift];
    while (off[c + 1] <= r) ++c;
    return c;
  }
};

void one_query(const float* q, const int64_t* found, int64_t K, const int8_t* codes, int64_t n, int64_t D,
               const float* dim_scale, const float* dim_offset, const ClusterOfRow* cluster_of,
               const float* centroids, const float* terms, int64_t terms_stride, int64_t k, float* out_scores,
               int64_t* out_rows) {
  // residual codes: each row's cluster term <q, centroid>, first: the route's (terms[c * terms_stride], when given), or
  // computed once per run of rows from the same cluster
  std::vector<float> row_cs;
  if (terms) {
    row_cs.resize(K);
    for (int64_t j = 0; j < K; ++j)
      if (found[j] >= 0 && found[j] < n) row_cs[j] = terms[(*cluster_of)(found[j]) * terms_stride];
  } else if (centroids) {
    row_cs.resize(K);
    int64_t last = -1;
    float last_cs = 0.0f;
    for (int64_t j = 0; j < K; ++j) {
      if (found[j] < 0 || found[j] >= n) continue;
      const int64_t c = (*cluster_of)(found[j]);
      if (c != last) {
        last = c;
        last_cs = dot_lanes_f32(q, centroids + c * D, D);
      }
      row_cs[j] = last_cs;
    }
  }
  std::vector<float> folded(D);
  for (int64_t d = 0; d < D; ++d) folded[d] = q[d] * dim_scale[d];
  const float constant = dot_lanes(q, dim_offset, D);
  std::vector<Scored> scored;
  scored.reserve(K);
  constexpr int64_t kAhead = 8;  // rows are scattered: fetch the row kAhead positions on while this one is scored
  for (int64_t j = 0; j < K; ++j) {
    if (j + kAhead < K && found[j + kAhead] >= 0 && found[j + kAhead] < n) {
      const char* p = reinterpret_cast<const char*>(codes + found[j + kAhead] * D);
      for (int64_t o = 0; o < D; o += 64) __builtin_prefetch(p + o);
    }
    const int64_t r = found[j];
    if (r < 0) continue;
    TORCH_CHECK_INDEX(r < n, "rescore_rows: row ", r, " out of range for ", n, " coded rows");
    float s = dot_codes(folded.data(), codes + r * D, D) + constant;
    if (centroids) s += row_cs[j];  // residual codes
    if (!(s > -std::numeric_limits<float>::infinity())) continue;  // NaN or -inf: dropped
    scored.push_back({s, int32_t(j), r});
  }
  const int64_t m = int64_t(scored.size()), top = std::min(k, m);
  keep_best(scored, m, top);
  for (int64_t i = 0; i < top; ++i) {
    out_scores[i] = scored[i].score;
    out_rows[i] = scored[i].row;
  }
  std::fill(out_scores + top, out_scores + k, -std::numeric_limits<float>::infinity());
  std::fill(out_rows + top, out_rows + k, int64_t{-1});
}

}  // namespace

// rescore_rows with residual codes' cluster terms already computed by the scan's route (ClusterTerm::scores,
// float32 [nlist, B], read at each found row's cluster; null: computed here), the same bits.
std::tuple<at::Tensor, at::Tensor> rescore_rows_with_terms(const at::Tensor& queries_in, const at::Tensor& found_in,
                                                           const at::Tensor& codes_in, const at::Tensor& dim_scale_in,
                                                           const at::Tensor& dim_offset_in, int64_t k,
                                                           const std::optional<at::Tensor>& cluster_offsets_in,
                                                           const std::optional<at::Tensor>& centroids_in,
                                                           const float* terms) {
  const at::Tensor queries = queries_in.contiguous(), found = found_in.contiguous(), codes = codes_in.contiguous();
  const at::Tensor dim_scale = dim_scale_in.contiguous(), dim_offset = dim_offset_in.contiguous();
  TORCH_CHECK(queries.dim() == 2 && queries.scalar_type() == at::kFloat, "rescore_rows: queries must be float32 [B, D], got ",
              queries.scalar_type(), " ", queries.sizes());
  TORCH_CHECK(found.dim() == 2 && found.scalar_type() == at::kLong, "rescore_rows: found must be int64 [B, K], got ",
              found.scalar_type(), " ", found.sizes());
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar, "rescore_rows: codes must be int8 [N, D], got ",
              codes.scalar_type(), " ", codes.sizes());
  TORCH_CHECK(dim_scale.scalar_type() == at::kFloat && dim_offset.scalar_type() == at::kFloat,
              "rescore_rows: dim_scale and dim_offset must be float32 [D]");
  const int64_t B = found.size(0), K = found.size(1), D = codes.size(1), n = codes.size(0);
  TORCH_CHECK(queries.size(0) == B && queries.size(1) == D && dim_scale.dim() == 1 && dim_scale.size(0) == D &&
                  dim_offset.dim() == 1 && dim_offset.size(0) == D,
              "rescore_rows: queries ", queries.sizes(), ", found ", found.sizes(), ", codes ", codes.sizes(),
              ", dim_scale ", dim_scale.sizes(), " and dim_offset ", dim_offset.sizes(),
              " disagree (queries [B, D], found [B, K], codes [N, D], [D], [D])");
  TORCH_CHECK(k >= 1, "rescore_rows: k must be >= 1, got ", k);
  // residual codes: + <q, centroids[c]> for a row of cluster c (cluster_offsets int64 [nlist + 1])
  TORCH_CHECK(cluster_offsets_in.has_value() == centroids_in.has_value(),
              "rescore_rows: cluster_offsets and centroids go together");
  at::Tensor coff_t, cent_t;
  int64_t nlist = 0;
  if (cluster_offsets_in) {
    coff_t = cluster_offsets_in->contiguous();
    cent_t = centroids_in->contiguous();
    nlist = coff_t.numel() - 1;
    TORCH_CHECK(coff_t.dim() == 1 && coff_t.scalar_type() == at::kLong && nlist >= 1 &&
                    coff_t.data_ptr<int64_t>()[nlist] == n,
                "rescore_rows: cluster_offsets must be int64 [nlist + 1] ending at N = ", n);
    TORCH_CHECK(cent_t.scalar_type() == at::kFloat && cent_t.dim() == 2 && cent_t.size(0) == nlist && cent_t.size(1) == D,
                "rescore_rows: centroids must be float32 [", nlist, ", ", D, "], got ", cent_t.scalar_type(), " ",
                cent_t.sizes());
  }
  const float* cent = nlist ? cent_t.data_ptr<float>() : nullptr;
  std::optional<ClusterOfRow> cluster_of;
  if (nlist) cluster_of.emplace(coff_t.data_ptr<int64_t>(), nlist);
  at::Tensor scores = at::empty({B, k}, at::kFloat), rows = at::empty({B, k}, at::kLong);
  const float* q = queries.data_ptr<float>();
  const int64_t* f = found.data_ptr<int64_t>();
  const int8_t* c = codes.data_ptr<int8_t>();
  float* s = scores.data_ptr<float>();
  int64_t* r = rows.data_ptr<int64_t>();
  // chunks of >= 64k multiply-adds (batch 16 at k 100 + margin, D 128: 0.23M, in 3-4 chunks) for the
  // team's helpers (team.h), awake by now in a search call
  constexpr int64_t kMacsPerTask = int64_t{1} << 16;
  const int64_t grain = std::max<int64_t>(1, kMacsPerTask / std::max<int64_t>(1, K * D));
  team_for(0, B, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b)
      one_query(q + b * D, f + b * K, K, c, n, D, dim_scale.data_ptr<float>(), dim_offset.data_ptr<float>(),
                cluster_of ? &*cluster_of : nullptr, cent, terms && nlist ? terms + b : nullptr, B, k, s + b * k,
                r + b * k);
  });
  return {scores, rows};
}

std::tuple<at::Tensor, at::Tensor> rescore_rows(const at::Tensor& queries_in, const at::Tensor& found_in,
                                                const at::Tensor& codes_in, const at::Tensor& dim_scale_in,
                                                const at::Tensor& dim_offset_in, int64_t k,
                                                const std::optional<at::Tensor>& cluster_offsets_in,
                                                const std::optional<at::Tensor>& centroids_in) {
  return rescore_rows_with_terms(queries_in, found_in, codes_in, dim_scale_in, dim_offset_in, k, cluster_offsets_in,
                                 centroids_in, nullptr);
}

}  // namespace silverrec
