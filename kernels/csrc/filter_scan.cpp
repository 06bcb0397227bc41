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
// over that range's words, a block at a time, as the whole-pool route does (a dense list's rows share
// words: a block pass reads each once); sparse rows gather their own words. Lists are ascending
// (publish/postings.py).
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

// filtered_topk's inputs, checked, as raw pointers and sizes; live = the active queries.
struct FilterScan {
  const int8_t *qcodes, *codes;
  const int64_t *bank, *ops, *prog, *lists, *post_off;
  const int32_t* post_rows;
  const bool* act;
  int64_t R, W, B, L, T, T2, V, N, D;
  const int64_t* coff = nullptr;  // residual codes: cluster offsets [nlist + 1] (ClusterTerm)
  int64_t nlist = 0;
  std::vector<int64_t> live;
};

FilterScan filter_scan_inputs(const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& bits,
                              const at::Tensor& ops_t, const at::Tensor& rows_t, const at::Tensor& post_rows_t,
                              const at::Tensor& post_off_t, const at::Tensor& lists_t, const at::Tensor& active_t,
                              const ClusterTerm& term) {
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
  FilterScan in;
  in.R = bits.size(0), in.W = bits.size(1), in.B = ops_t.size(0), in.L = ops_t.size(1), in.T = rows_t.size(2);
  in.T2 = lists_t.size(1), in.V = post_off_t.size(0) - 1, in.N = codes.size(0), in.D = codes.size(1);
  TORCH_CHECK(lists_t.size(0) == in.B && active_t.size(0) == in.B && qcodes.size(0) == in.B,
              "filtered_topk: B rows expected");
  TORCH_CHECK(in.W == (in.N + 63) / 64, "filtered_topk: bits must have ceil(N / 64) words per row");
  if (term.offsets) {  // residual codes: row r of cluster c scores dot + bias(b, c) (group_biases)
    in.nlist = term.offsets->size(0) - 1;
    in.coff = term.offsets->data_ptr<int64_t>();
    TORCH_CHECK(in.nlist >= 1 && in.coff[0] == 0 && in.coff[in.nlist] == in.N,
                "filtered_topk: cluster_offsets must rise from 0 to N");
  }
  in.qcodes = qcodes.data_ptr<int8_t>();
  in.codes = codes.data_ptr<int8_t>();  // once, not per row (data_ptr checks the tensor each call)
  in.bank = bits.data_ptr<int64_t>(), in.ops = ops_t.data_ptr<int64_t>(), in.prog = rows_t.data_ptr<int64_t>();
  in.lists = lists_t.data_ptr<int64_t>(), in.post_off = post_off_t.data_ptr<int64_t>();
  in.post_rows = post_rows_t.data_ptr<int32_t>();
  in.act = active_t.data_ptr<bool>();
  for (int64_t b = 0; b < in.B; ++b)
    if (in.act[b]) in.live.push_back(b);
  return in;
}

// The live queries' programs and list ids (a whole-pool row, kNoLists first, ignores its other entries).
void check_programs(const FilterScan& in) {
  validate(in.ops, in.prog, in.live, in.L, in.T, in.R);
  for (int64_t b : in.live)
    for (int64_t t = 0; t < in.T2 && in.lists[b * in.T2] != kNoLists; ++t) {
      const int64_t l = in.lists[b * in.T2 + t];
      if (l >= in.V || l < kNoList)
        throw std::invalid_argument("posting list id " + std::to_string(l) + " out of range [0, " + std::to_string(in.V) + ")");
    }
}

// One group per distinct (program, lists) among the live queries, evaluated once (a probed query with the same
// program and lists as a whole-pool one must not stand for it: that query went unanswered).
struct Groups {
  std::vector<int64_t> rep;                   // [B] each query's representative
  std::vector<int64_t> heads;                 // the groups' representatives
  std::vector<int64_t> group_of;              // [B] group of a representative (else -1)
  std::vector<std::vector<int64_t>> members;  // each group's live queries, ascending
};

Groups group_queries(const FilterScan& in) {
  Groups g;
  g.rep = representatives(in.ops, in.prog, in.L, in.T, in.lists, nullptr, in.T2, in.B, in.act);
  for (int64_t b : in.live)
    if (g.rep[b] == b) g.heads.push_back(b);
  g.group_of.assign(in.B, -1);
  for (size_t i = 0; i < g.heads.size(); ++i) g.group_of[g.heads[i]] = int64_t(i);
  g.members.resize(g.heads.size());
  for (int64_t b : in.live) g.members[g.group_of[g.rep[b]]].push_back(b);
  return g;
}

bool whole_pool(const FilterScan& in, int64_t b) { return in.lists[b * in.T2] == kNoLists; }

// Each group's passing rows, ascending. Tasks: a slice of a group's posting-list rows, or of the pool's words
// for a whole-pool group (a group's evaluation is split when there are fewer groups than threads).
std::vector<std::vector<int64_t>> passing_rows(const FilterScan& in, const Groups& groups) {
  const size_t G = groups.heads.size();
  const int64_t threads = team_threads();
  const bool split = int64_t(G) < threads;
  struct Task {
    int64_t g, a, z;  // words [a, z) of the pool, or entries [a, z) of the group's list rows
  };
  std::vector<Task> tasks;
  std::vector<ListRows> cand(G);  // each posting-list group's rows
  std::vector<std::vector<int32_t>> merged(G);
  int64_t work = 0;  // words evaluated, or posting-list entries (one word gathered each)
  for (size_t g = 0; g < G; ++g) {
    const bool posting = !whole_pool(in, groups.heads[g]);
    if (posting) cand[g] = list_rows(in.lists, in.T2, groups.heads[g], in.post_rows, in.post_off, merged[g]);
    const int64_t n = posting ? cand[g].n : in.W, step = posting ? 1 : kBlock;
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
      const int64_t b = groups.heads[tk.g];
      part[t] = !whole_pool(in, b)
                    ? list_passing_rows(in.bank, in.W, in.ops, in.prog, in.L, in.T, b, cand[tk.g].rows, tk.a, tk.z)
                    : pool_passing_rows(in.bank, in.W, in.N, in.ops, in.prog, in.L, in.T, b, tk.a, tk.z);
    }
  });
  std::vector<std::vector<int64_t>> passing(G);
  for (size_t t = 0; t < tasks.size(); ++t) {  // a group's slices in order: its rows stay ascending
    auto& p = passing[tasks[t].g];
    if (p.empty()) p.swap(part[t]);
    else p.insert(p.end(), part[t].begin(), part[t].end());
  }
  return passing;
}

// How each group is ranked: groups passing at most kExactFloatRows rows, with a float ranking, in float (no
// int8 scan); groups passing more than N / kMaskDivisor rows by a scan of the pool through a mask; the others
// by a scan of a compact buffer of their rows' codes.
struct Placement {
  std::vector<bool> in_float;
  std::vector<int64_t> mask_group;  // the group's mask (-1: none)
  std::vector<int64_t> buf_start;   // the group's first position in the compact buffer
  int64_t total = 0, masked = 0;    // buffer rows, masks
};

Placement place_groups(const std::vector<std::vector<int64_t>>& passing, int64_t N, bool ranking) {
  const size_t G = passing.size();
  Placement pl;
  pl.in_float.assign(G, false);
  pl.mask_group.assign(G, -1);
  pl.buf_start.assign(G, 0);
  for (size_t g = 0; g < G; ++g) {
    const int64_t n = int64_t(passing[g].size());
    if (ranking && n <= kExactFloatRows) {
      pl.in_float[g] = true;
    } else if (n * kMaskDivisor > N) {
      pl.mask_group[g] = pl.masked++;
    } else {
      pl.buf_start[g] = pl.total;
      pl.total += n;
    }
  }
  return pl;
}

// Residual codes: one walk of each group's passing rows (ascending) along the offsets gives the clusters holding
// them and each row's cluster (in the compact buffer, or for the float ranking); per live query the cluster term of
// those clusters, its best (the shift) and the biases bias(b, c), [nlist, B] (zero but where present).
struct GroupBiases {
  BiasTable table;
  std::unique_ptr<int32_t[]> store;                 // [nlist, B], a cluster's queries together
  std::vector<std::vector<int64_t>> present;        // per group, ascending
  std::vector<int32_t> row_cluster;                 // [total] each compact-buffer row's cluster
  std::vector<std::vector<int32_t>> float_cluster;  // groups ranked in float: each passing row's cluster
};

GroupBiases group_biases(const FilterScan& in, const Groups& groups, const std::vector<std::vector<int64_t>>& passing,
                         const Placement& pl, const ClusterTerm& term) {
  const size_t G = groups.heads.size();
  GroupBiases gb;
  gb.present.resize(G);
  gb.float_cluster.resize(G);
  if (!in.coff) return gb;
  gb.store.reset(new int32_t[in.B * in.nlist]());  // zeros: a 16-row tile may read rows past its segment (masked)
  gb.table = {gb.store.get(), 1, in.B};
  gb.row_cluster.resize(pl.total);
  for (size_t g = 0; g < G; ++g) {
    int64_t c = 0;
    if (pl.in_float[g]) gb.float_cluster[g].resize(passing[g].size());
    for (size_t i = 0; i < passing[g].size(); ++i) {
      while (in.coff[c + 1] <= passing[g][i]) ++c;
      if (gb.present[g].empty() || gb.present[g].back() != c) gb.present[g].push_back(c);
      if (pl.in_float[g]) gb.float_cluster[g][i] = int32_t(c);
      else if (pl.mask_group[g] < 0) gb.row_cluster[pl.buf_start[g] + int64_t(i)] = int32_t(c);
    }
  }
  for (size_t g = 0; g < G; ++g) {
    if (gb.present[g].empty()) continue;
    const auto& mg = groups.members[g];
    for (size_t m0 = 0; m0 < mg.size(); m0 += 16)
      group_terms(term, mg.data() + m0, int(std::min<size_t>(16, mg.size() - m0)), gb.present[g], in.D, in.B,
                  gb.store.get());
  }
  return gb;
}

// The rows the scans read: the compact buffer (the small groups' passing rows' codes, and each position's pool
// row) and the big whole-pool groups' masks over the pool.
struct ScanRows {
  std::vector<int8_t> buf;       // [total, D]
  std::vector<int64_t> buf_row;  // [total]
  std::vector<int64_t> mask;     // [masked, W] (none without big groups: no W words to zero for a selective search)
};

ScanRows copy_passing_rows(const FilterScan& in, const std::vector<std::vector<int64_t>>& passing, const Placement& pl) {
  ScanRows sr;
  sr.buf.resize(std::max<int64_t>(pl.total, 1) * in.D);
  sr.buf_row.resize(std::max<int64_t>(pl.total, 1));
  sr.mask.assign(pl.masked * in.W, 0);
  for (size_t g = 0; g < passing.size(); ++g) {
    const auto& p = passing[g];
    if (pl.in_float[g]) continue;
    if (pl.mask_group[g] >= 0) {
      int64_t* m = sr.mask.data() + pl.mask_group[g] * in.W;
      for (int64_t r : p) m[r >> 6] |= int64_t(uint64_t{1} << (r & 63));
      continue;
    }
    int8_t* dst = sr.buf.data() + pl.buf_start[g] * in.D;
    for (size_t i = 0; i < p.size(); ++i) {
      std::memcpy(dst + i * in.D, in.codes + p[i] * in.D, in.D);
      sr.buf_row[pl.buf_start[g] + i] = p[i];
    }
  }
  return sr;
}

// The two scans' segments, members of every group in group order: `small` over the compact buffer (one segment
// per group; residual codes: per-row biases), `big` over the pool through the masks (one segment per group, or,
// residual codes, one per cluster holding passing rows, its bias per member).
void scan_inputs(const FilterScan& in, const Groups& groups, const std::vector<std::vector<int64_t>>& passing,
                 const Placement& pl, const GroupBiases& gb, const ScanRows& sr, int64_t k, ScanInput& small,
                 ScanInput& big) {
  for (ScanInput* s : {&small, &big}) {
    s->qcodes = in.qcodes;
    s->B = in.B;
    s->D = in.D;
    s->k = k;
  }
  small.codes = sr.buf.data();
  small.N = pl.total;
  big.codes = in.codes;
  big.N = in.N;
  big.bitmask = sr.mask.data();
  for (size_t g = 0; g < groups.heads.size(); ++g) {
    ScanInput& s = pl.mask_group[g] >= 0 ? big : small;
    // segment [a, z) of the scanned codes (pool rows, or buffer positions) with the group's queries as members,
    // whose rows are all in cluster c (c = -1: no member biases)
    const auto add_segment = [&](int64_t a, int64_t z, int64_t c) {
      const int64_t first = int64_t(s.member_query.size());
      for (int64_t b : groups.members[g]) {
        s.member_query.push_back(b);
        s.member_word.push_back(pl.mask_group[g] >= 0 ? pl.mask_group[g] * in.W : 0);
        if (c >= 0) s.member_bias.push_back(gb.table(b, c));
      }
      s.segments.push_back({a, z, first, int64_t(s.member_query.size()) - first});
    };
    const auto& p = passing[g];
    if (p.empty() || pl.in_float[g]) continue;
    if (pl.mask_group[g] < 0) add_segment(pl.buf_start[g], pl.buf_start[g] + int64_t(p.size()), -1);
    else if (!gb.table) add_segment(0, in.N, -1);
    else
      for (int64_t c : gb.present[g]) add_segment(in.coff[c], in.coff[c + 1], c);
  }
  if (in.coff && pl.total > 0) {  // the compact buffer's per-row biases: the table itself, [nlist, B]
    small.row_cluster = gb.row_cluster.data();
    small.row_bias = gb.store.get();
    small.row_bias_stride = in.B;
  }
}

// Both scans, each writing its own members' keys (unpadded) straight into the output; the compact buffer's
// positions mapped back to pool rows (increasing within a group: the order, score then lower row, holds).
void scan_groups(const FilterScan& in, const Groups& groups, const Placement& pl, const ScanRows& sr,
                 const ScanInput& small, const ScanInput& big, int64_t* kp, int64_t* count) {
  const int64_t k = small.k;
  const auto masked = [&](int64_t b) { return pl.mask_group[groups.group_of[groups.rep[b]]] >= 0; };
  if (!small.segments.empty()) {
    scan_topk_into(small, kp, count);
    for (int64_t b : in.live) {
      if (masked(b)) continue;
      for (int64_t i = b * k; i < b * k + count[b]; ++i) {
        const int64_t pos = key_row(kp[i]);
        kp[i] = (kp[i] & ~int64_t{0xFFFFFFFF}) | (int64_t{0xFFFFFFFF} - sr.buf_row[pos]);
      }
    }
  }
  if (!big.segments.empty()) {
    std::vector<int64_t> count_big(in.B, 0);
    scan_topk_into(big, kp, count_big.data());
    for (int64_t b : in.live)
      if (masked(b)) count[b] = count_big[b];
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
  const FilterScan in = filter_scan_inputs(qcodes, codes, bits, ops_t, rows_t, post_rows_t, post_off_t, lists_t, active_t,
                                           term);
  std::fill(count, count + in.B, int64_t{0});
  if (in.live.empty() || k == 0) return;
  check_programs(in);
  const Groups groups = group_queries(in);
  const std::vector<std::vector<int64_t>> passing = passing_rows(in, groups);
  TORCH_CHECK(!ranking || !in.coff || term.scores, "filtered_topk: a float ranking of residual codes needs the terms");
  const Placement place = place_groups(passing, in.N, ranking != nullptr);
  const GroupBiases biases = group_biases(in, groups, passing, place, term);
  const ScanRows scan_rows = copy_passing_rows(in, passing, place);
  ScanInput small, big;
  scan_inputs(in, groups, passing, place, biases, scan_rows, k, small, big);
  for (size_t g = 0; g < groups.heads.size(); ++g) {  // the groups ranked in float: the ranking's outputs (count 0)
    if (!place.in_float[g]) continue;
    const auto& mg = groups.members[g];
    for (size_t m0 = 0; m0 < mg.size(); m0 += 16)
      rank_in_float(*ranking, in.codes, in.D, passing[g], in.coff ? biases.float_cluster[g].data() : nullptr,
                    in.coff ? term.scores : nullptr, in.coff ? biases.store.get() : nullptr, in.B, mg.data() + m0,
                    int(std::min<size_t>(16, mg.size() - m0)), in.qcodes);
  }
  scan_groups(in, groups, place, scan_rows, small, big, kp, count);
}

}  // namespace silverrec
