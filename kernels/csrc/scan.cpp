// Fused CPU scan: int8 dot products + optional packed bitmask + running top-k, in one pass.
//
// One core routine serves the CPU paths of silverrec::ivf_scan, silverrec::int8_topk and the
// explicit row ranges of `scan_ranges`. Its input is a list of *segments*: a row range [start, end) of the int8
// codes and the queries ("members") that scan it, each with an optional word base into a flat
// int64 bitmask:
//
//     row r of a segment is allowed for member m  iff  bitmask[word_base[m] + (r >> 6)] >> (r & 63) & 1
//
// (no bitmask: every row of the range is allowed). For ivf_scan a segment is one probed cluster
// and its members are the queries that probe it, word_base = (b * P + slot) * Wc - (off[c] >> 6);
// for int8_topk it is [0, N) with every query and no bitmask.
//
// Work: segments are cut into pieces of <= kPieceRows rows (64-aligned), and worker threads
// (team_for, team.h: one per thread) take pieces from an atomic counter in the given order (for
// ivf_scan: clusters ordered by the best probe rank any query gave them, so every query's nearest
// clusters come first and its threshold rises early). Each worker keeps its own TopK per query;
// per-query results are merged at the end. A piece walks 64-row words: the allowed-row word of
// each member (range bits & bitmask word) is computed first, and rows whose bit is 0 are never
// scored (a zero word skips 64 rows). Members are scored one query at a time against 16-row
// tiles (RowTileKernel), or, when >= kLaneMin queries share the segment, 16 queries at a time
// against each row (LaneKernel). Scores below a query's current k-th best never become keys.
//
// Output: keys int64 [B, k], sorted descending, kEmptyKey padding: bit-identical to the torch paths.
#include "scan.h"

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#include "dot.h"
#include "team.h"
#include "topk_state.h"

namespace silverrec {
namespace {

constexpr int64_t kPieceRows = 8192;  // rows per work item (a multiple of 64)
constexpr int kLaneMin = 4;           // members sharing a segment from which LaneKernel is used

struct Piece {
  int64_t segment, start, end;
};

inline uint64_t range_bits(int64_t blk, int64_t a, int64_t z) {
  // bits of rows [a, z) inside the 64-row word starting at row blk
  const int64_t lo = std::max<int64_t>(a - blk, 0), hi = std::min<int64_t>(z - blk, 64);
  if (hi <= lo) return 0;
  const uint64_t upto_hi = hi >= 64 ? ~uint64_t{0} : (uint64_t{1} << hi) - 1;
  return upto_hi & ~((uint64_t{1} << lo) - 1);
}

inline uint32_t ge_mask16(const int32_t* scores, const int32_t* thr) {
#if SILVERREC_VNNI
  return _mm512_cmpge_epi32_mask(_mm512_loadu_si512(scores), _mm512_loadu_si512(thr));
#elif SILVERREC_AVX2
  // scores >= thr  <=>  !(thr > scores): the sign bits of cmpgt, inverted
  const __m256i lt0 = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(thr)),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scores)));
  const __m256i lt1 = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(thr + 8)),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scores + 8)));
  const uint32_t lt = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(lt0))) |
                      uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(lt1))) << 8;
  return ~lt & 0xFFFF;
#else
  uint32_t m = 0;
  for (int i = 0; i < kTile; ++i) m |= uint32_t(scores[i] >= thr[i]) << i;
  return m;
#endif
}

inline uint32_t ge_mask16(const int32_t* scores, int32_t thr) {
  int32_t t[kTile];
  for (int i = 0; i < kTile; ++i) t[i] = thr;
  return ge_mask16(scores, t);
}

class Scanner {
 public:
  Scanner(const ScanInput& in) : in_(in) {
    queries_.reserve(in.B);
    for (int64_t b = 0; b < in.B; ++b) queries_.emplace_back(in.qcodes + b * in.D, in.D);
    switch (in.D) {  // compile-time widths for the common dimensions
      case 32: scan_piece_ = &Scanner::scan_piece<32>; break;
      case 64: scan_piece_ = &Scanner::scan_piece<64>; break;
      case 96: scan_piece_ = &Scanner::scan_piece<96>; break;
      case 128: scan_piece_ = &Scanner::scan_piece<128>; break;
      case 256: scan_piece_ = &Scanner::scan_piece<256>; break;
      default: scan_piece_ = &Scanner::scan_piece<0>;
    }
  }

  // Scan, then merge into out (B * k keys): padded with kEmptyKey when count is null, else count[b] set.
  void run(int64_t* out, int64_t* count) {
    std::vector<Piece> pieces;
    int64_t work = 0, rows = 0;  // (row, query) pairs, to decide whether threads pay off
    for (const Segment& seg : in_.segments) {
      work += (seg.end - seg.start) * seg.count;
      rows += seg.end - seg.start;
    }
    const int64_t threads = work < kMinParallelWork ? 1 : team_threads();
    // pieces of <= kPieceRows rows, and small enough that every thread gets some (a few thousand
    // passing rows shared by a batch are one segment: one piece would leave the other threads idle)
    const int64_t piece_rows = threads == 1 ? kPieceRows : std::max<int64_t>(64, std::min(kPieceRows, rows / (4 * threads)));
    for (int64_t s = 0; s < int64_t(in_.segments.size()); ++s) {
      const Segment& seg = in_.segments[s];
      for (int64_t a = seg.start; a < seg.end;) {
        const int64_t z = std::min(seg.end, ((a + piece_rows) & ~int64_t{63}));
        pieces.push_back({s, a, z});
        a = z;
      }
    }
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, int64_t(pieces.size())));
    states_.assign(workers, std::vector<TopK>(in_.B));
    std::atomic<int64_t> next{0};
    auto work_fn = [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w)
        for (int64_t i; (i = next.fetch_add(1)) < int64_t(pieces.size());) (this->*scan_piece_)(pieces[i], states_[w]);
    };
    if (workers == 1)
      work_fn(0, 1);
    else
      team_for(0, workers, 1, work_fn);
    merge(out, count);
  }

 private:
  const ScanInput& in_;
  std::vector<PaddedQuery> queries_;
  std::vector<std::vector<TopK>> states_;  // [worker][query]
  void (Scanner::*scan_piece_)(const Piece&, std::vector<TopK>&);

  inline uint64_t allowed(int64_t member, int64_t blk, uint64_t rb) const {
    return in_.bitmask ? rb & uint64_t(in_.bitmask[in_.member_word[member] + (blk >> 6)]) : rb;
  }

  // 16 readable rows from r0: the codes themselves, or (at the end of the codes) a zero-padded copy.
  const int8_t* tile_rows(int64_t r0, std::vector<int8_t>& pad) const {
    if (r0 + kTile <= in_.N) return in_.codes + r0 * in_.D;
    pad.assign(kTile * in_.D, 0);
    std::memcpy(pad.data(), in_.codes + r0 * in_.D, (in_.N - r0) * in_.D);
    return pad.data();
  }

  template <int DC>
  void scan_piece(const Piece& pc, std::vector<TopK>& st) {
    const Segment& seg = in_.segments[pc.segment];
    int64_t m = seg.first;
    const int64_t m_end = seg.first + seg.count;
    for (; m + kLaneMin <= m_end; m += kTile) lanes<DC>(pc, m, std::min<int64_t>(m_end - m, kTile), st);
    for (; m < m_end; ++m) one_query<DC>(pc, m, st[in_.member_query[m]]);
  }

  // One query, 16-row tiles (1-3 allowed rows of a tile: scored one by one).
  template <int DC>
  void one_query(const Piece& pc, int64_t member, TopK& st) {
    const RowTileKernel<DC> kernel(in_.D);
    const PaddedQuery& q = queries_[in_.member_query[member]];
    // score = dot + bias: the member's (one cluster), or each row's (rbias[cluster of the row])
    const int32_t* rbias = in_.row_cluster ? in_.row_bias + in_.member_query[member] : nullptr;  // + cluster * stride
    const int32_t bias = rbias || in_.member_bias.empty() ? 0 : in_.member_bias[member];
    st.ensure(in_.k);
    std::vector<int8_t> pad;
    alignas(64) int32_t scores[kTile], row_bias[kTile];
    for (int64_t blk = pc.start & ~int64_t{63}; blk < pc.end; blk += 64) {
      const uint64_t w = allowed(member, blk, range_bits(blk, pc.start, pc.end));
      if (!w) continue;
      for (int sub = 0; sub < 4; ++sub) {
        uint32_t bits = uint32_t(w >> (16 * sub)) & 0xFFFF;
        if (!bits) continue;
        const int64_t r0 = blk + 16 * sub;
        if (__builtin_popcount(bits) <= 3) {
          for (; bits; bits &= bits - 1) {
            const int64_t r = r0 + __builtin_ctz(bits);
            const int32_t s =
                kernel.one(in_.codes + r * in_.D, q) + (rbias ? rbias[in_.row_cluster[r] * in_.row_bias_stride] : bias);
            if (s >= st.thr_score) st.offer(s, r);
          }
          continue;
        }
        const int8_t* rows = tile_rows(r0, pad);
        if (rbias)
          for (int i = 0; i < kTile; ++i)
            row_bias[i] = r0 + i < in_.N ? rbias[in_.row_cluster[r0 + i] * in_.row_bias_stride] : 0;
#if SILVERREC_VNNI
        __m512i sv = kernel.tile(rows, q);
        if (rbias) sv = _mm512_add_epi32(sv, _mm512_load_si512(row_bias));
        uint32_t c = bits & _mm512_cmpge_epi32_mask(sv, _mm512_set1_epi32(st.thr_score - bias));
        if (!c) continue;
        _mm512_store_si512(scores, sv);
#else
        kernel.tile(rows, q, scores);
        if (rbias)
          for (int i = 0; i < kTile; ++i) scores[i] += row_bias[i];
        uint32_t c = bits & ge_mask16(scores, st.thr_score - bias);
#endif
        for (; c; c &= c - 1) {
          const int i = __builtin_ctz(c);
          if (scores[i] + bias >= st.thr_score) st.offer(scores[i] + bias, r0 + i);  // threshold may have risen
        }
      }
    }
  }

  // Up to 16 queries at once: each allowed row is scored against all of them (LaneKernel).
  template <int DC>
  void lanes(const Piece& pc, int64_t first, int64_t count, std::vector<TopK>& st) {
    const int8_t* qptr[kTile];
    TopK* lane_state[kTile];
    alignas(64) int32_t thr[kTile];
    int32_t bias[kTile] = {};  // score = dot + bias (residual codes: the member's cluster), or + the row's
                               // cluster's (row_bias + cluster * stride + the lane's query)
    int64_t lane_query[kTile] = {};
    for (int l = 0; l < kTile; ++l) {
      thr[l] = std::numeric_limits<int32_t>::max();  // unused lanes never qualify
      if (l < count) {
        const int64_t b = lane_query[l] = in_.member_query[first + l];
        if (!in_.row_cluster && !in_.member_bias.empty()) bias[l] = in_.member_bias[first + l];
        qptr[l] = in_.qcodes + b * in_.D;
        lane_state[l] = &st[b];
        lane_state[l]->ensure(in_.k);
      }
    }
    const LaneKernel<DC> lk(in_.D, qptr, int(count));
    const uint32_t all_lanes = (uint32_t{1} << count) - 1;
    bool lanes_consecutive = true;  // the lanes' queries b0, b0 + 1, ...: their row biases are one run
    for (int l = 0; l < count; ++l) {
      thr[l] = lane_state[l]->thr_score - bias[l];
      lanes_consecutive &= lane_query[l] == lane_query[0] + l;
    }
#if SILVERREC_VNNI
    alignas(64) int32_t lane_index32[kTile] = {};
    for (int l = 0; l < count; ++l) lane_index32[l] = int32_t(lane_query[l]);
    const __m512i lane_index = _mm512_load_si512(lane_index32);
#endif
    alignas(64) int32_t scores[4][kTile];
    uint64_t words[kTile];
    for (int64_t blk = pc.start & ~int64_t{63}; blk < pc.end; blk += 64) {
      const uint64_t rb = range_bits(blk, pc.start, pc.end);
      uint64_t any = rb;
      if (in_.bitmask) {
        any = 0;
        for (int l = 0; l < count; ++l) any |= (words[l] = allowed(first + l, blk, rb));
      }
      while (any) {
        int64_t rows[4];
        const int8_t* ptr[4];
        int n = 0;
        for (; n < 4 && any; any &= any - 1, ++n) rows[n] = blk + __builtin_ctzll(any);
        for (int i = 0; i < 4; ++i) ptr[i] = in_.codes + rows[i < n ? i : n - 1] * in_.D;
        lk.rows4(ptr, scores);
        for (int i = 0; i < n; ++i) {
          if (in_.row_cluster) {
            const int32_t* rb = in_.row_bias + in_.row_cluster[rows[i]] * in_.row_bias_stride;
#if SILVERREC_VNNI
            const __m512i add = lanes_consecutive
                                    ? _mm512_maskz_loadu_epi32(__mmask16(all_lanes), rb + lane_query[0])
                                    : _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), __mmask16(all_lanes), lane_index, rb, 4);
            _mm512_store_si512(scores[i], _mm512_add_epi32(_mm512_load_si512(scores[i]), add));
#else
            (void)lanes_consecutive;
            for (int l = 0; l < count; ++l) scores[i][l] += rb[lane_query[l]];
#endif
          }
          uint32_t lane_ok = all_lanes;
          if (in_.bitmask) {
            const int bit = int(rows[i] - blk);
            lane_ok = 0;
            for (int l = 0; l < count; ++l) lane_ok |= uint32_t((words[l] >> bit) & 1) << l;
          }
          for (uint32_t c = lane_ok & ge_mask16(scores[i], thr); c; c &= c - 1) {
            const int l = __builtin_ctz(c);
            lane_state[l]->offer(scores[i][l] + bias[l], rows[i]);
            thr[l] = lane_state[l]->thr_score - bias[l];  // a threshold moves only when its lane takes a row
          }
        }
      }
    }
  }

  // Per query: the best k of all workers' candidates, sorted descending, then padded (count null)
  // or counted (count[b]).
  void merge(int64_t* o, int64_t* count) {
    const int64_t B = in_.B, k = in_.k;
    int64_t pending = 0;
    for (auto& per_worker : states_)
      for (auto& st : per_worker) pending += st.n;
    team_for(0, B, pending < kMinParallelKeys ? B : 1, [&](int64_t b0, int64_t b1) {
      std::vector<int64_t> all, scratch;
      std::vector<uint64_t> tmp;
      for (int64_t b = b0; b < b1; ++b) {
        int64_t* row = o + b * k;
        int64_t total = 0;
        const std::vector<int64_t>* only = nullptr;
        for (auto& per_worker : states_) {
          total += per_worker[b].n;
          if (per_worker[b].n) only = &per_worker[b].buf;
        }
        int64_t* first;
        if (total == 0) {
          if (count) count[b] = 0;
          else std::fill(row, row + k, kEmptyKey);
          continue;
        }
        bool single = false;
        for (auto& per_worker : states_) single |= per_worker[b].n == total;
        if (single) {
          first = const_cast<int64_t*>(only->data());
        } else {
          all.clear();
          for (auto& per_worker : states_) all.insert(all.end(), per_worker[b].buf.begin(), per_worker[b].buf.begin() + per_worker[b].n);
          first = all.data();
        }
        const int64_t take = std::min(total, k);
        select_top(first, total, k, scratch);
        sort_keys_descending(first, take, tmp);
        std::copy(first, first + take, row);
        if (count) count[b] = take;
        else std::fill(row + take, row + k, kEmptyKey);
      }
    });
  }
};

}  // namespace

BiasTable bias_table(const std::optional<at::Tensor>& bias, int64_t B, int64_t nlist) {
  if (!bias) return {};
  TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kInt && bias->dim() == 2 && bias->size(0) == B &&
                  bias->size(1) == nlist,
              "bias must be an int32 CPU tensor [", B, ", ", nlist, "], got ", bias->scalar_type(), " ", bias->sizes());
  const BiasTable t{bias->data_ptr<int32_t>(), bias->stride(0), bias->stride(1)};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < nlist; ++c)
      if (t(b, c) < kBiasFloor || t(b, c) > 0)
        throw std::invalid_argument("bias values must lie in [" + std::to_string(kBiasFloor) + ", 0], got " +
                                    std::to_string(t(b, c)));
  return t;
}

at::Tensor scan_topk(const ScanInput& in) {
  if (in.k < 1) throw std::invalid_argument("k must be >= 1, got " + std::to_string(in.k));
  at::Tensor out = at::empty({in.B, in.k}, at::kLong);
  Scanner(in).run(out.data_ptr<int64_t>(), nullptr);
  return out;
}

void scan_topk_into(const ScanInput& in, int64_t* out, int64_t* count) {
  if (in.k < 1) throw std::invalid_argument("k must be >= 1, got " + std::to_string(in.k));
  Scanner(in).run(out, count);
}

}  // namespace silverrec
