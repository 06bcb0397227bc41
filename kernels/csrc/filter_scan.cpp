// Row-level filter evaluation: silverrec::verify_topk and silverrec::filtered_topk (CPU paths).
//
// verify_topk   keeps, per query, the first k entries of an already ranked list whose row passes
//               the query's program: the program runs on the rows' own words (gathered, kBlock
//               rows per pass) and stops as soon as k rows passed.
// filtered_topk the "filter, then exact scan" search over the whole pool or over posting lists:
//               queries with the same (program, lists) form one group; each group computes its
//               passing rows once (ascending), then the groups' rows are copied into a compact
//               code buffer and scanned by scan_topk (scan.cpp) with the group's queries as
//               members. Keys are remapped from buffer positions to pool rows; the map is
//               increasing within a group, so the order (score, then lower row) is unchanged.
//               Whole-pool groups with more than half the pool passing scan it through a bitmask
//               instead of copying their rows.

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "program.h"
#include "scan.h"
#include "team.h"
#include "topk_state.h"
#include "widen.h"

namespace silverrec {
namespace {

using namespace program;

// A whole-pool group scans the pool through its mask only when more than N / kMaskDivisor rows pass:
// below that, copying the passing rows' codes (D bytes each) costs less than the dot products of
// the rows the mask would drag along (16-row blocks with any passing row are scored whole).
constexpr int64_t kMaskDivisor = 2;

// A posting-list slice runs its program over its rows' whole range of words (not each row's own word)
// when it holds at least one row per kDenseListWords words of that range.
constexpr int64_t kDenseListWords = 4;

// Program b on rows[0, n) (n <= kBlock, each row >= 0): pass[i] = bit (row & 63) of its word.
void eval_rows(const int64_t* bank, int64_t W, const int64_t* ops, const int64_t* prog_rows, int64_t L, int64_t T,
               int64_t b, const int64_t* rows, int64_t n, int64_t* widx, int64_t* stack, uint8_t* pass) {
  for (int64_t i = 0; i < n; ++i) widx[i] = rows[i] >> 6;
  eval_block(bank, W, ops, prog_rows, L, T, b, widx[0], widx, n, stack);
  for (int64_t i = 0; i < n; ++i) pass[i] = (uint64_t(stack[i]) >> (rows[i] & 63)) & 1;
}

// Rows of group representative b that pass its program, ascending, from the pool's words [wa, wz).
std::vector<int64_t> pool_passing_rows(const int64_t* bank, int64_t W, int64_t N, const int64_t* ops,
                                       const int64_t* prog_rows, int64_t L, int64_t T, int64_t b, int64_t wa, int64_t wz) {
  std::vector<int64_t> out;
  std::vector<int64_t> stack((L + 1) * kBlock);
  for (int64_t w0 = wa; w0 < wz; w0 += kBlock) {
    const int64_t n = std::min(kBlock, wz - w0);
    eval_block(bank, W, ops, prog_rows, L, T, b, w0, nullptr, n, stack.data());
    const auto take = [&](int64_t i) {  // the passing rows of word i
      for (uint64_t v = uint64_t(stack[i]); v; v &= v - 1) {
        const int64_t r = 64 * (w0 + i) + __builtin_ctzll(v);
        if (r < N) out.push_back(r);
      }
    };
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 8 <= n; i += 8) {  // a selective filter's words are mostly zero: skip them 8 at a time
      const __m512i w = _mm512_loadu_si512(stack.data() + i);
      for (uint32_t nz = _mm512_test_epi64_mask(w, w); nz; nz &= nz - 1) take(i + __builtin_ctz(nz));
    }
#endif
    for (; i < n; ++i) take(i);
  }
  return out;
}

// The rows of group representative b's posting lists, ascending, each once: one list's own entries (no
// copy), or several lists' merged into `merged`.
struct ListRows {
  const int32_t* rows = nullptr;
  int64_t n = 0;
};
ListRows list_rows(const int64_t* lists, int64_t T2, int64_t b, const int32_t* post_rows, const int64_t* post_off,
                   std::vector<int32_t>& merged) {
  const int64_t* lb = lists + b * T2;
  int64_t used = 0, only = -1;
  for (int64_t t = 0; t < T2; ++t)
    if (lb[t] >= 0) ++used, only = lb[t];
  if (used <= 1) return only < 0 ? ListRows{} : ListRows{post_rows + post_off[only], post_off[only + 1] - post_off[only]};
  for (int64_t t = 0; t < T2; ++t)
    if (lb[t] >= 0) merged.insert(merged.end(), post_rows + post_off[lb[t]], post_rows + post_off[lb[t] + 1]);
  std::sort(merged.begin(), merged.end());  // a row can sit in several of the lists: one candidate each
  merged.erase(std::unique(merged.begin(), merged.end()), merged.end());
  return {merged.data(), int64_t(merged.size())};
}

// The rows of cand[ca, cz) (ascending) that pass group representative b's program, ascending. Rows
// dense in their words' range (at least one per kDenseListWords words) are read from the program run
// over that range's words, a block at a time, as the whole-pool route does; sparse rows gather their own
// words (a 3-value AND whose rarest value has a list of 24k rows, 1M rows: 0.32 ms gathered on one thread,
// 0.21 ms now, the whole-pool route 0.18 ms). Lists are ascending (publish/postings.py).
std::vector<int64_t> list_passing_rows(const int64_t* bank, int64_t W, const int64_t* ops, const int64_t* prog_rows,
                                       int64_t L, int64_t T, int64_t b, const int32_t* cand, int64_t ca, int64_t cz) {
  std::vector<int64_t> out;
  std::vector<int64_t> stack((L + 1) * kBlock), widx(kBlock);
  if (ca >= cz) return out;
  const int64_t w_first = cand[ca] >> 6, w_end = (cand[cz - 1] >> 6) + 1;
  if (w_end - w_first <= kDenseListWords * (cz - ca)) {
    for (int64_t w0 = w_first, i = ca; w0 < w_end; w0 += kBlock) {
      const int64_t n = std::min(kBlock, w_end - w0);
      eval_block(bank, W, ops, prog_rows, L, T, b, w0, nullptr, n, stack.data());
      for (; i < cz && (cand[i] >> 6) < w0 + n; ++i) {
        const int64_t wi = (cand[i] >> 6) - w0;  // >= 0 for an ascending list; never read before the block
        if (wi >= 0 && (uint64_t(stack[wi]) >> (cand[i] & 63)) & 1) out.push_back(cand[i]);
      }
    }
    return out;
  }
  std::vector<int64_t> rows(kBlock);
  std::vector<uint8_t> pass(kBlock);
  for (int64_t i0 = ca; i0 < cz; i0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, cz - i0);
    std::copy(cand + i0, cand + i0 + n, rows.begin());
    eval_rows(bank, W, ops, prog_rows, L, T, b, rows.data(), n, widx.data(), stack.data(), pass.data());
    for (int64_t i = 0; i < n; ++i)
      if (pass[i]) out.push_back(rows[i]);
  }
  return out;
}

// Residual codes: the cluster terms of up to 16 queries of one group (members, mn of them) for the clusters
// holding its passing rows (pc, ascending): each query's shift, its biases at bias[c * B + b], and the terms
// themselves when the caller keeps them (term.scores), both [nlist, B]. Several queries: dot_lanes_x16, each
// centroid read once for all of them; one query: dot_lanes_f32 per cluster. Either way the same bits as
// cluster_bias(dot_lanes).
void group_terms(const ClusterTerm& term, const int64_t* members, int mn, const std::vector<int64_t>& pc, int64_t D,
                 int64_t B, int32_t* bias) {
  const int64_t P = int64_t(pc.size());
  std::vector<float> cs(P * 16);  // several queries: [P][16] (query j in lane j); one: [P] padded to 16
  std::vector<float> best(16, -std::numeric_limits<float>::infinity());
  if (mn > 1) {
    constexpr int64_t kAhead = 6;
    std::vector<float> qt(16 * D, 0.0f);
    for (int j = 0; j < mn; ++j)
      for (int64_t d = 0; d < D; ++d) qt[d * 16 + j] = term.queries[members[j] * D + d];
    for (int64_t i = 0; i < P; ++i) {
      if (i + kAhead < P)  // the clusters are scattered: fetch centroids a few ahead (a DRAM miss outlasts ~4 dots)
        for (int64_t o = 0; o < D; o += 16) __builtin_prefetch(term.centroids + pc[i + kAhead] * D + o);
      dot_lanes_x16(qt.data(), term.centroids + pc[i] * D, D, cs.data() + i * 16);
      for (int j = 0; j < 16; ++j) best[j] = std::max(best[j], cs[i * 16 + j]);
    }
  } else {
    for (int64_t i = 0; i < P; ++i) {
      cs[i] = dot_lanes_f32(term.queries + members[0] * D, term.centroids + pc[i] * D, D);
      best[0] = std::max(best[0], cs[i]);
    }
  }
  double u[16], rounded_shift[16];
  int32_t out[16];
  for (int j = 0; j < 16; ++j) {
    const int q = mn > 1 ? j : 0;  // one query: its values in every lane
    u[j] = q < mn ? double(term.unit[members[q]]) : 1.0;
    rounded_shift[j] = q < mn ? std::nearbyint(double(best[q]) / u[j]) : 0.0;
  }
  for (int j = 0; j < mn; ++j) term.shift[members[j]] = shift_back(best[j], term.unit[members[j]]);
  if (mn > 1) {
    for (int64_t i = 0; i < P; ++i) {
      cluster_bias_x16(cs.data() + i * 16, rounded_shift, u, out);
      for (int j = 0; j < mn; ++j) {
        bias[pc[i] * B + members[j]] = out[j];
        if (term.scores) term.scores[pc[i] * B + members[j]] = cs[i * 16 + j];
      }
    }
    return;
  }
  const int64_t b = members[0];
  for (int64_t i0 = 0; i0 < P; i0 += 16) {
    cluster_bias_x16(cs.data() + i0, rounded_shift, u, out);
    for (int64_t i = i0; i < std::min(P, i0 + 16); ++i) {
      bias[pc[i] * B + b] = out[i - i0];
      if (term.scores) term.scores[pc[i] * B + b] = cs[i];
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> verify_topk(const at::Tensor& bits, const at::Tensor& ops_t, const at::Tensor& rows_t,
                                               const at::Tensor& scores_in, const at::Tensor& rows_in, int64_t k) {
  check(bits, at::kLong, 2, "bits");
  check(ops_t, at::kLong, 2, "ops");
  check(rows_t, at::kLong, 3, "rows");
  check(rows_in, at::kLong, 2, "result rows");
  TORCH_CHECK(scores_in.device().is_cpu() && scores_in.scalar_type() == at::kFloat && scores_in.is_contiguous() &&
                  scores_in.sizes() == rows_in.sizes(),
              "verify_topk: scores must be contiguous float32 shaped like rows");
  const int64_t W = bits.size(1), R = bits.size(0), B = ops_t.size(0), L = ops_t.size(1), T = rows_t.size(2);
  const int64_t K2 = rows_in.size(1);
  TORCH_CHECK(rows_in.size(0) == B, "verify_topk: one result row per program");
  at::Tensor scores = at::full({B, k}, -std::numeric_limits<float>::infinity(), at::kFloat);
  at::Tensor out_rows = at::full({B, k}, -1, at::kLong);
  if (B == 0 || K2 == 0 || k == 0) return {scores, out_rows};
  const int64_t *bank = bits.data_ptr<int64_t>(), *ops = ops_t.data_ptr<int64_t>(), *prog = rows_t.data_ptr<int64_t>();
  const int64_t* rin = rows_in.data_ptr<int64_t>();
  const float* sin = scores_in.data_ptr<float>();
  std::vector<int64_t> live;
  for (int64_t b = 0; b < B; ++b) live.push_back(b);
  validate(ops, prog, live, L, T, R);
  for (int64_t i = 0; i < B * K2; ++i)
    if (rin[i] >= 64 * W) throw std::invalid_argument("verify_topk: result row " + std::to_string(rin[i]) + " is outside the bank");
  float* so = scores.data_ptr<float>();
  int64_t* ro = out_rows.data_ptr<int64_t>();
  int64_t valid = 0;  // threads only for enough rows to evaluate
  for (int64_t i = 0; i < B * K2; ++i) valid += rin[i] >= 0;
  team_for(0, B, valid * L < (int64_t{1} << 15) ? B : 1, [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> stack((L + 1) * kBlock), widx(kBlock), rows(kBlock), pos(kBlock);
    std::vector<uint8_t> pass(kBlock);
    for (int64_t b = b0; b < b1; ++b) {
      int64_t kept = 0;
      for (int64_t i0 = 0; i0 < K2 && kept < k;) {
        int64_t n = 0;  // next block of valid entries
        for (; i0 < K2 && n < kBlock; ++i0)
          if (rin[b * K2 + i0] >= 0) {
            rows[n] = rin[b * K2 + i0];
            pos[n++] = i0;
          }
        if (n == 0) break;
        eval_rows(bank, W, ops, prog, L, T, b, rows.data(), n, widx.data(), stack.data(), pass.data());
        for (int64_t i = 0; i < n && kept < k; ++i)
          if (pass[i]) {
            so[b * k + kept] = sin[b * K2 + pos[i]];
            ro[b * k + kept++] = rows[i];
          }
      }
    }
  });
  return {scores, out_rows};
}

std::tuple<at::Tensor, at::Tensor> filtered_topk_keys(
    const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& bits, const at::Tensor& ops_t,
    const at::Tensor& rows_t, const at::Tensor& post_rows_t, const at::Tensor& post_off_t, const at::Tensor& lists_t,
    const at::Tensor& active_t, int64_t k, const std::optional<at::Tensor>& cluster_offsets,
    const std::optional<at::Tensor>& centroids, const std::optional<at::Tensor>& centroid_queries,
    const std::optional<at::Tensor>& unit) {
  TeamCall team;  // the helpers wake now, to be awake by the first parallel step
  check(ops_t, at::kLong, 2, "ops");
  const int64_t B = ops_t.size(0);
  at::Tensor keys = at::empty({B, k}, at::kLong), shift;
  std::vector<int64_t> count(B, 0);
  int64_t* kp = keys.data_ptr<int64_t>();
  ClusterTerm term;
  TORCH_CHECK(cluster_offsets.has_value() == centroids.has_value() && centroids.has_value() == centroid_queries.has_value() &&
                  centroids.has_value() == unit.has_value(),
              "filtered_topk: cluster_offsets, centroids, centroid_queries and unit go together (residual codes)");
  if (cluster_offsets) {
    check(*cluster_offsets, at::kLong, 1, "cluster_offsets");
    check(*centroids, at::kFloat, 2, "centroids");
    check(*centroid_queries, at::kFloat, 2, "centroid_queries");
    check(*unit, at::kFloat, 1, "unit");
    TORCH_CHECK(centroids->size(0) == cluster_offsets->size(0) - 1 && centroids->size(1) == centroid_queries->size(1) &&
                    centroid_queries->size(0) == B && unit->size(0) == B,
                "filtered_topk: centroids [nlist, D], centroid_queries [B, D] and unit [B] expected");
    shift = at::zeros({B}, at::kFloat);
    term = {&*cluster_offsets, centroids->data_ptr<float>(), centroid_queries->data_ptr<float>(), unit->data_ptr<float>(),
            shift.data_ptr<float>()};
  }
  filtered_topk_into(qcodes, codes, bits, ops_t, rows_t, post_rows_t, post_off_t, lists_t, active_t, k, kp,
                     count.data(), term);
  for (int64_t b = 0; b < B; ++b) std::fill(kp + b * k + count[b], kp + (b + 1) * k, kEmptyKey);
  return {keys, shift};
}

void filtered_topk_into(const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& bits,
                        const at::Tensor& ops_t, const at::Tensor& rows_t, const at::Tensor& post_rows_t,
                        const at::Tensor& post_off_t, const at::Tensor& lists_t, const at::Tensor& active_t, int64_t k,
                        int64_t* kp, int64_t* count, const ClusterTerm& term, const FloatRanking* ranking) {
  check(bits, at::kLong, 2, "bits");
  check(ops_t, at::kLong, 2, "ops");
  check(rows_t, at::kLong, 3, "rows");
  check(post_off_t, at::kLong, 1, "post_offsets");
  check(lists_t, at::kLong, 2, "lists");
  TORCH_CHECK(post_rows_t.device().is_cpu() && post_rows_t.scalar_type() == at::kInt && post_rows_t.dim() == 1 &&
                  post_rows_t.is_contiguous(),
              "post_rows: expected a contiguous int32 CPU tensor [E]");
  TORCH_CHECK(active_t.device().is_cpu() && active_t.scalar_type() == at::kBool && active_t.dim() == 1, "active: bool [B]");
  TORCH_CHECK(qcodes.scalar_type() == at::kChar && codes.scalar_type() == at::kChar && qcodes.dim() == 2 &&
                  codes.dim() == 2 && qcodes.size(1) == codes.size(1) && qcodes.is_contiguous() && codes.is_contiguous(),
              "qcodes / codes: contiguous int8 [B, D] / [N, D]");
  const int64_t R = bits.size(0), W = bits.size(1), B = ops_t.size(0), L = ops_t.size(1), T = rows_t.size(2);
  const int64_t T2 = lists_t.size(1), V = post_off_t.size(0) - 1, N = codes.size(0), D = codes.size(1);
  TORCH_CHECK(lists_t.size(0) == B && active_t.size(0) == B && qcodes.size(0) == B, "filtered_topk: B rows expected");
  TORCH_CHECK(W == (N + 63) / 64, "filtered_topk: bits must have ceil(N / 64) words per row");
  std::fill(count, count + B, int64_t{0});
  // residual codes: row r of cluster c scores dot + bias(b, c) (ClusterTerm; the table is filled below)
  const int64_t* coff = nullptr;
  int64_t nlist = 0;
  if (term.offsets) {
    nlist = term.offsets->size(0) - 1;
    coff = term.offsets->data_ptr<int64_t>();
    TORCH_CHECK(nlist >= 1 && coff[0] == 0 && coff[nlist] == N, "filtered_topk: cluster_offsets must rise from 0 to N");
  }
  const bool* act = active_t.data_ptr<bool>();
  const int64_t *bank = bits.data_ptr<int64_t>(), *ops = ops_t.data_ptr<int64_t>(), *prog = rows_t.data_ptr<int64_t>();
  const int64_t *lists = lists_t.data_ptr<int64_t>(), *post_off = post_off_t.data_ptr<int64_t>();
  const int32_t* post_rows = post_rows_t.data_ptr<int32_t>();
  std::vector<int64_t> live;
  for (int64_t b = 0; b < B; ++b)
    if (act[b]) live.push_back(b);
  if (live.empty() || k == 0) return;
  validate(ops, prog, live, L, T, R);
  for (int64_t b : live)  // a whole-pool row (kNoLists first) ignores its other entries
    for (int64_t t = 0; t < T2 && lists[b * T2] != kNoLists; ++t) {
      const int64_t l = lists[b * T2 + t];
      if (l >= V || l < -1)
        throw std::invalid_argument("posting list id " + std::to_string(l) + " out of range [0, " + std::to_string(V) + ")");
    }
  // one evaluation per distinct (program, lists) among the live queries (a probed query with the same
  // program and lists as a whole-pool one must not stand for it: that query went unanswered)
  const std::vector<int64_t> rep = representatives(ops, prog, L, T, lists, nullptr, T2, B, act);
  std::vector<int64_t> groups;  // representatives of live queries
  for (int64_t b : live)
    if (rep[b] == b) groups.push_back(b);
  // tasks: a slice of a group's posting-list rows, or of the pool's words for a whole-pool group (a
  // group's evaluation is split when there are fewer groups than threads)
  const int64_t threads = team_threads();
  const bool split = int64_t(groups.size()) < threads;
  struct Task {
    int64_t g, a, z;  // words [a, z) of the pool, or entries [a, z) of the group's list rows
  };
  std::vector<Task> tasks;
  std::vector<ListRows> cand(groups.size());  // each posting-list group's rows
  std::vector<std::vector<int32_t>> merged(groups.size());
  int64_t work = 0;  // words evaluated, or posting-list entries (one word gathered each)
  for (size_t g = 0; g < groups.size(); ++g) {
    const bool posting = lists[groups[g] * T2] != kNoLists;
    if (posting) cand[g] = list_rows(lists, T2, groups[g], post_rows, post_off, merged[g]);
    const int64_t n = posting ? cand[g].n : W, step = posting ? 1 : kBlock;
    const int64_t slices = split && n >= kMinSliceWords ? threads : 1;
    for (int64_t s = 0; s < slices; ++s)  // slices of whole blocks (pool words)
      tasks.push_back({int64_t(g), n * s / slices / step * step, s + 1 == slices ? n : n * (s + 1) / slices / step * step});
    work += n;
  }
  std::vector<std::vector<int64_t>> part(tasks.size());
  const int64_t grain = work >= kMinSliceWords ? 1 : int64_t(tasks.size());
  team_for(0, int64_t(tasks.size()), grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Task& tk = tasks[t];
      const int64_t b = groups[tk.g];
      part[t] = lists[b * T2] != kNoLists ? list_passing_rows(bank, W, ops, prog, L, T, b, cand[tk.g].rows, tk.a, tk.z)
                                          : pool_passing_rows(bank, W, N, ops, prog, L, T, b, tk.a, tk.z);
    }
  });
  std::vector<std::vector<int64_t>> passing(groups.size());
  for (size_t t = 0; t < tasks.size(); ++t) {  // a group's slices in order: its rows stay ascending
    auto& p = passing[tasks[t].g];
    if (p.empty()) p.swap(part[t]);
    else p.insert(p.end(), part[t].begin(), part[t].end());
  }
  std::vector<int64_t> group_of(B, -1), buf_start(groups.size(), 0), mask_group(groups.size(), -1);
  for (size_t g = 0; g < groups.size(); ++g) group_of[groups[g]] = int64_t(g);
  std::vector<std::vector<int64_t>> members(groups.size());  // each group's live queries, ascending
  for (int64_t b : live) members[group_of[rep[b]]].push_back(b);
  // groups passing at most kExactFloatRows rows, with a FloatRanking: ranked in float, no int8 scan;
  // groups passing more than N / kMaskDivisor rows scan the pool through a mask, the others a compact buffer
  TORCH_CHECK(!ranking || !coff || term.scores, "filtered_topk: a float ranking of residual codes needs the terms");
  std::vector<bool> in_float(groups.size(), false);
  int64_t total = 0, masked = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (ranking && int64_t(passing[g].size()) <= kExactFloatRows) {
      in_float[g] = true;
      continue;
    }
    if (int64_t(passing[g].size()) * kMaskDivisor > N) {
      mask_group[g] = masked++;
      continue;
    }
    buf_start[g] = total;
    total += int64_t(passing[g].size());
  }
  // residual codes: one walk of each group's passing rows (ascending) along the offsets gives the clusters
  // holding them and, in the compact buffer, each row's cluster; per live query the cluster term of those
  // clusters, its best (the shift) and the biases bias(b, c)
  BiasTable bp;
  std::unique_ptr<int32_t[]> bias_store;  // [nlist, B], a cluster's queries together; zero but where present
  std::vector<std::vector<int64_t>> present(groups.size());  // per group, ascending
  std::vector<int32_t> row_cluster;                          // [total]
  std::vector<std::vector<int32_t>> float_cluster(groups.size());  // groups ranked in float: each row's cluster
  if (coff) {
    bias_store.reset(new int32_t[B * nlist]());  // zeros: a 16-row tile may read rows past its segment (masked)
    bp = {bias_store.get(), 1, B};
    row_cluster.resize(total);
    for (size_t g = 0; g < groups.size(); ++g) {
      int64_t c = 0;
      if (in_float[g]) float_cluster[g].resize(passing[g].size());
      for (size_t i = 0; i < passing[g].size(); ++i) {
        while (coff[c + 1] <= passing[g][i]) ++c;
        if (present[g].empty() || present[g].back() != c) present[g].push_back(c);
        if (in_float[g]) float_cluster[g][i] = int32_t(c);
        else if (mask_group[g] < 0) row_cluster[buf_start[g] + int64_t(i)] = int32_t(c);
      }
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      if (present[g].empty()) continue;
      const auto& mg = members[g];
      for (size_t m0 = 0; m0 < mg.size(); m0 += 16)
        group_terms(term, mg.data() + m0, int(std::min<size_t>(16, mg.size() - m0)), present[g], D, B,
                    bias_store.get());
    }
  }
  // compact buffer: the passing rows of each small group; big whole-pool groups scan via a mask
  std::vector<int8_t> buf(std::max<int64_t>(total, 1) * D);
  std::vector<int64_t> buf_row(std::max<int64_t>(total, 1));
  std::vector<int64_t> mask(masked * W, 0);  // none without big groups (W words zeroed were ~5% of a selective search)
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& p = passing[g];
    if (in_float[g]) continue;
    if (mask_group[g] >= 0) {
      int64_t* m = mask.data() + mask_group[g] * W;
      for (int64_t r : p) m[r >> 6] |= int64_t(uint64_t{1} << (r & 63));
      continue;
    }
    const int8_t* src = codes.data_ptr<int8_t>();  // once, not per row (its checks were 4% of a search)
    int8_t* dst = buf.data() + buf_start[g] * D;
    for (size_t i = 0; i < p.size(); ++i) {
      std::memcpy(dst + i * D, src + p[i] * D, D);
      buf_row[buf_start[g] + i] = p[i];
    }
  }
  // members of every group, in group order
  ScanInput small, big;
  for (ScanInput* in : {&small, &big}) {
    in->qcodes = qcodes.data_ptr<int8_t>();
    in->B = B;
    in->D = D;
    in->k = k;
  }
  small.codes = buf.data();
  small.N = total;
  big.codes = codes.data_ptr<int8_t>();
  big.N = N;
  big.bitmask = mask.data();
  for (size_t g = 0; g < groups.size(); ++g) {
    ScanInput& in = mask_group[g] >= 0 ? big : small;
    // segment [a, z) of the scanned codes (pool rows, or buffer positions) with the group's queries as members,
    // whose rows are all in cluster c (c = -1: no member biases)
    const auto add_segment = [&](int64_t a, int64_t z, int64_t c) {
      const int64_t first = int64_t(in.member_query.size());
      for (int64_t b : members[g]) {
        in.member_query.push_back(b);
        in.member_word.push_back(mask_group[g] >= 0 ? mask_group[g] * W : 0);
        if (c >= 0) in.member_bias.push_back(bp(b, c));
      }
      in.segments.push_back({a, z, first, int64_t(in.member_query.size()) - first});
    };
    const auto& p = passing[g];
    if (p.empty() || in_float[g]) continue;
    if (mask_group[g] < 0) {  // the compact buffer: one segment (residual codes: per-row biases, above)
      add_segment(buf_start[g], buf_start[g] + int64_t(p.size()), -1);
      continue;
    }
    if (!bp) {
      add_segment(0, N, -1);
      continue;
    }
    // the pool through the mask, residual codes: one segment per cluster holding passing rows, its bias per member
    for (int64_t c : present[g]) add_segment(coff[c], coff[c + 1], c);
  }
  if (coff && total > 0) {  // the compact buffer's per-row biases: the table itself, [nlist, B]
    small.row_cluster = row_cluster.data();
    small.row_bias = bias_store.get();
    small.row_bias_stride = B;
  }
  // the groups ranked in float: their members' results go to the ranking's outputs (count stays 0)
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!in_float[g]) continue;
    const auto& mg = members[g];
    for (size_t m0 = 0; m0 < mg.size(); m0 += 16)
      rank_in_float(*ranking, codes.data_ptr<int8_t>(), D, passing[g], coff ? float_cluster[g].data() : nullptr,
                    coff ? term.scores : nullptr, coff ? bias_store.get() : nullptr, B, mg.data() + m0,
                    int(std::min<size_t>(16, mg.size() - m0)), qcodes.data_ptr<int8_t>());
  }
  // each scan writes the rows of its own members only (unpadded), straight into the output
  std::vector<int64_t> count_big(B, 0);
  if (!small.segments.empty()) {
    scan_topk_into(small, kp, count);
    for (int64_t b : live) {
      if (mask_group[group_of[rep[b]]] >= 0) continue;
      for (int64_t i = b * k; i < b * k + count[b]; ++i) {  // buffer positions -> pool rows
        const int64_t pos = key_row(kp[i]);
        kp[i] = (kp[i] & ~int64_t{0xFFFFFFFF}) | (int64_t{0xFFFFFFFF} - buf_row[pos]);
      }
    }
  }
  if (!big.segments.empty()) {
    scan_topk_into(big, kp, count_big.data());
    for (int64_t b : live)
      if (mask_group[group_of[rep[b]]] >= 0) count[b] = count_big[b];
  }
}

}  // namespace silverrec
