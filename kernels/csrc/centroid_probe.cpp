// The probe candidates of the IVF search: each query's best P centroids by float32 inner product, in
// dot_lanes's summation order (widen.h; kernels/common.py `centroid_scores`, the reference), best first,
// equal scores to the lower centroid.
//
// Scoring every centroid in float is most of a light search's fixed cost (an unfiltered nprobe-4 search
// of 16 queries over 4000 x 128 centroids is 8.2M multiply-adds, as one MKL sgemm a third of it spent
// packing the centroids). Here an int8 pass bounds every score instead (VNNI: 64
// multiply-adds an instruction, on centroid codes packed as 16-row tiles once per centroid tensor), and
// only the centroids whose bound can reach a query's top P are scored in float:
//   centroid c ~= sc * code_c (per-row scale, codes cached per centroid tensor), query q ~= sq * code_q;
//   <q, c> - sq sc <code_q, code_c> = <q - q^, c> + <q^, c - c^>, so
//   |<q, c> - approx| <= sq / 2 * |c|_1 + sc / 2 * |q^|_1 = err (plus float rounding, below);
//   T = the P-th largest (approx - err) over the centroids; a centroid of the true top P has
//   <q, c> >= the P-th largest score >= T, so approx + err >= T: the survivors (approx + err >= T)
//   hold every centroid of the top P, and every one tied with its last. Scoring the survivors exactly
//   gives the same P, in the same order, as scoring all of them.
// Builds without AVX512-VNNI (AVX2: vpmaddwd does no more multiply-adds an instruction than an FMA) screen
// with a BLAS sgemm instead, whose sums (any order, fused or not) lie within gamma x |q|_inf |c|_1 of the
// exact ones: the same survivors' logic, at the sgemm's speed.
#include "tensor.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/intrusive_ptr.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dot.h"
#include "scan.h"
#include "team.h"
#include "topk_state.h"
#include "widen.h"

namespace silverrec {

// libtorch's MKL, where torch was built with it (weak: absent from other builds): this thread's own count,
// which overrides the process-wide one torch.set_num_threads sets (0: none of its own)
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));  // mkl.h: mkl_set_num_threads_local

namespace {

constexpr int64_t kInsertMax = 16;  // candidates up to which the top-P is kept by insertion (beyond: select + sort)
constexpr int64_t kRowsPerStep = 256;  // centroid rows per parallel chunk

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
  // as the scan's sort keys (topk_state.h): the score's ordered bits in the high half, the centroid in the
  // low half, so that one vectorised selection and one radix sort of distinct int64 keys give the order
  // (higher score, then lower centroid) without a comparator
  std::vector<int64_t> keys(C), scratch;
  std::vector<uint64_t> tmp;
  for (int64_t b : probing) {
    for (int64_t c = 0; c < C; ++c) keys[c] = make_key(ordered_bits(sc[c * B + b]), c);
    select_top(keys.data(), C, P, scratch);
    sort_keys_descending(keys.data(), P, tmp);
    for (int64_t j = 0; j < P; ++j) cand[b * P + j] = key_row(keys[j]);
  }
}

// Rows of x float32 [n, D] as int8 codes with one scale per row: code = round(x / scale), scale =
// max |x| / 127 (0 for a zero row), and the row's |x|_1 and max |x|. false when a value is not finite.
bool quantize_rows(const float* x, int64_t n, int64_t D, int8_t* codes, float* scale, float* l1, float* amax) {
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float* r = x + i * D;
    float m = 0.0f;
    double sum = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      m = std::max(m, std::fabs(r[d]));
      sum += std::fabs(r[d]);
    }
    finite &= std::isfinite(sum);  // (not m: std::max passes over a NaN)
    const float s = m / 127.0f;
    int8_t* q = codes + i * D;
    if (s > 0.0f && std::isfinite(s)) {
      for (int64_t d = 0; d < D; ++d) q[d] = int8_t(std::max(-127.0f, std::min(127.0f, std::nearbyint(r[d] / s))));
    } else {
      std::memset(q, 0, size_t(D));
    }
    scale[i] = s;
    l1[i] = float(sum);
    amax[i] = m;
  }
  return finite;
}

// A centroid matrix's int8 codes (quantize_rows) as 16-row tiles (VNNI builds), kept for as long as its tensor lives
// unchanged: tile t holds centroids 16t .. 16t + 15 as [G][16][4] bytes (G = ceil(D / 4); group g of row l
// at [g][l]: one vector per group, each lane a row's 4 bytes, the VNNI operand), each byte flipped to u8
// (code + 128: vpdpbusd multiplies unsigned by signed bytes); rows past C and dimensions past D code 0.
struct CentroidCodes {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> source;  // never a dangling address
  const void* data;
  int64_t version, C, D, G, tiles;
  std::vector<uint8_t> packed;         // [tiles][G][16][4]
  std::vector<float> scale, l1, amax;  // [tiles * 16], zeros past C
  float max_l1;                        // the largest |c|_1
  bool finite;

  explicit CentroidCodes(const at::Tensor& t)
      : source(t.getIntrusivePtr()), data(t.data_ptr()), version(t.is_inference() ? -1 : t._version()),
        C(t.size(0)), D(t.size(1)), G((D + 3) / 4), tiles((C + kTile - 1) / kTile), packed(SILVERREC_VNNI ? tiles * G * 64 : 0, 0x80),
        scale(tiles * kTile, 0.0f), l1(tiles * kTile, 0.0f), amax(tiles * kTile, 0.0f), finite(true) {
    const float* x = t.data_ptr<float>();
    std::vector<char> ok(tiles, 1);
    team_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
      std::vector<int8_t> codes(kTile * D);
      for (int64_t ti = t0; ti < t1; ++ti) {
        const int64_t r0 = ti * kTile, n = std::min<int64_t>(kTile, C - r0);
        ok[ti] = quantize_rows(x + r0 * D, n, D, codes.data(), scale.data() + r0, l1.data() + r0, amax.data() + r0);
        if (!SILVERREC_VNNI) continue;  // the BLAS screen reads the floats (and l1, amax) only
        uint8_t* tile = packed.data() + ti * G * 64;
        for (int64_t l = 0; l < n; ++l)
          for (int64_t d = 0; d < D; ++d) tile[(d / 4) * 64 + l * 4 + d % 4] = uint8_t(codes[l * D + d] ^ 0x80);
      }
    });
    finite = std::all_of(ok.begin(), ok.end(), [](char v) { return v != 0; });
    max_l1 = *std::max_element(l1.begin(), l1.end());
  }

  bool same(const at::Tensor& t) const {
    return !source.expired() && source._unsafe_get_target() == t.unsafeGetTensorImpl() && data == t.data_ptr() &&
           C == t.size(0) && D == t.size(1) && version == (t.is_inference() ? -1 : t._version());
  }
};

// The codes of every centroid tensor searched in this process and still alive: built on a tensor's
// first search (or after it changed in place), dropped when it dies. An inference tensor keeps no
// version count, so an in-place change would go unseen: its codes are built for each call instead.
std::shared_ptr<const CentroidCodes> codes_of(const at::Tensor& centroids) {
  if (centroids.is_inference()) return std::make_shared<const CentroidCodes>(centroids);
  static std::mutex& mu = *new std::mutex;  // leaked with the cache: nothing to destroy at exit
  static auto& cache = *new std::vector<std::shared_ptr<const CentroidCodes>>;
  {
    std::lock_guard<std::mutex> lock(mu);
    cache.erase(std::remove_if(cache.begin(), cache.end(), [](const auto& e) { return e->source.expired(); }),
                cache.end());
    for (const auto& e : cache)
      if (e->same(centroids)) return e;
  }
  auto built = std::make_shared<const CentroidCodes>(centroids);  // outside the lock: other searches go on
  std::lock_guard<std::mutex> lock(mu);
  cache.erase(std::remove_if(cache.begin(), cache.end(),
                             [&](const auto& e) { return e->source._unsafe_get_target() == centroids.unsafeGetTensorImpl(); }),
              cache.end());
  cache.push_back(built);
  return built;
}

// Every centroid's exact score, sc float32 [C, Qp] (row c: <q_i, c> in dot_lanes's order for the Q queries
// q float32 [Q, D], 16 at a time; the columns past Q zeros).
void exact_scores(const float* cen, const float* q, int64_t C, int64_t D, int64_t Q, int64_t Qp, float* sc) {
  team_for(0, (C + kRowsPerStep - 1) / kRowsPerStep, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> qt(16 * D);
    float out[16];
    for (int64_t g = 0; g < Q; g += 16) {
      const int n = int(std::min<int64_t>(16, Q - g));
      std::fill(qt.begin(), qt.end(), 0.0f);
      for (int j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) qt[d * 16 + j] = q[(g + j) * D + d];
      for (int64_t c = s0 * kRowsPerStep; c < std::min(C, s1 * kRowsPerStep); ++c) {
        dot_lanes_x16(qt.data(), cen + c * D, D, out);
        std::copy(out, out + kTile, sc + c * Qp + g);  // the lanes past Q: zero queries, 0
      }
    }
  });
}

// The queries' codes (quantize_rows) as the screen reads them: in blocks of 16 queries, each group g of 4
// bytes one int32, the block's 16 side by side (qg[(i / 16) * G * 16 + g * 16 + i % 16]: one address for the
// 16 broadcasts of a group; zeros past D and for the absent queries), the VNNI correction 128 x sum(code)
// (the centroids' bytes are flipped), and |q^|_1 = scale x sum |code|.
struct QueryCodes {
  int64_t Q, G;
  std::vector<int32_t> qg;                   // [Qp / 16][G][16]
  std::vector<int32_t> corr;                 // [Qp]
  std::vector<float> scale, l1, amax;        // [Qp]
  bool finite;
  QueryCodes(const float* q, int64_t Q_, int64_t Qp, int64_t D)
      : Q(Q_), G((D + 3) / 4), qg(Qp * G, 0), corr(Qp, 0), scale(Qp), l1(Qp), amax(Qp) {
    std::vector<int8_t> codes(Q * D);
    finite = quantize_rows(q, Q, D, codes.data(), scale.data(), l1.data(), amax.data());
    for (int64_t i = 0; i < Q; ++i) {
      int32_t sum = 0, abs_sum = 0;
      for (int64_t d = 0; d < D; ++d) {
        const int8_t c = codes[i * D + d];
        sum += c;
        abs_sum += std::abs(int32_t(c));
        qg[(i / kTile) * G * kTile + (d / 4) * kTile + i % kTile] |= int32_t(uint32_t(uint8_t(c)) << (8 * (d % 4)));
      }
      corr[i] = SILVERREC_VNNI ? 128 * sum : 0;
      l1[i] = float(abs_sum) * scale[i];
    }
  }
};

#if SILVERREC_VNNI
// acc += the u8 x s8 dot of v's 4-byte lanes with *b broadcast (embedded broadcast). In asm: gcc 12 keeps
// an array of 16 intrinsic accumulators in rotating registers (two copies per vpdpbusd, two of them on the
// stack), which made it most of this screen's time.
static inline void dpbusd_bcast(__m512i& acc, __m512i v, const int32_t* b) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*b));
}

// The screen of one tile (16 centroids) against the first J queries of the block from q0 (a multiple of 16):
// lo / hi [.., stride] rows q0 + j, columns 16t .. 16t + 15, the bounds of <q_j, c>.
template <int J>
void screen_tile(const CentroidCodes& cc, int64_t t, const QueryCodes& qc, int64_t q0, float slack, float* lo,
                 float* hi, int64_t stride) {
  const int64_t G = cc.G;
  alignas(64) int32_t dots[J][kTile];
  const int32_t* qg = qc.qg.data() + q0 * G;  // the block's [G][16]
  const uint8_t* tile = cc.packed.data() + t * G * 64;
  __m512i acc[J];
#pragma GCC unroll 16
  for (int j = 0; j < J; ++j) acc[j] = _mm512_setzero_si512();
  for (int64_t g = 0; g < G; ++g) {
    const __m512i v = _mm512_loadu_si512(tile + g * 64);
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) dpbusd_bcast(acc[j], v, qg + g * kTile + j);
  }
#pragma GCC unroll 16
  for (int j = 0; j < J; ++j)
    _mm512_store_si512(dots[j], _mm512_sub_epi32(acc[j], _mm512_set1_epi32(qc.corr[q0 + j])));
  const int64_t c0 = t * kTile;
  const float *scr = cc.scale.data() + c0, *l1r = cc.l1.data() + c0;
  const int live = int(std::min<int64_t>(kTile, cc.C - c0));  // rows past C: never candidates
  for (int j = 0; j < J; ++j) {
    const float sq = qc.scale[q0 + j], ql1 = qc.l1[q0 + j], qmax = qc.amax[q0 + j];
    float* lr = lo + (q0 + j) * stride + c0;
    float* hr = hi + (q0 + j) * stride + c0;
    for (int l = 0; l < kTile; ++l) {  // one vector each
      const float a = float(dots[j][l]) * (sq * scr[l]);
      // the quantisation bound with 2e-4 to spare for the rounding of the codes and of this sum, plus the
      // float rounding of the exact dot (slack x |q|_inf |c|_1 >= its error) and of a itself
      const float e = 0.5001f * (sq * l1r[l] + scr[l] * ql1) + slack * (qmax * l1r[l]) + 1e-6f * std::fabs(a);
      lr[l] = a - e;
      hr[l] = a + e;
    }
    for (int l = live; l < kTile; ++l) lr[l] = hr[l] = -std::numeric_limits<float>::infinity();
  }
}

#else
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

// The screen without VNNI: lo / hi [Qp, Cp] from the scores of q float32 [Q, D] by sgemm, in blocks of
// centroid rows on the team, each one single-threaded call; the bound gamma x |q|_inf |c|_1 covers any
// summation order of the sgemm and of dot_lanes, with spare.
void screen_blas(const at::Tensor& centroids, const float* q, const CentroidCodes& cc, const QueryCodes& qc,
                 int64_t Q, float* lo, float* hi, int64_t Cp) {
  const int64_t C = cc.C, D = cc.D;
  const at::Tensor qm = at::from_blob(const_cast<float*>(q), {Q, D}, at::kFloat);
  const float gamma = float((D + D / 16 + 16) * 1.2e-7);
  const bool inference = c10::InferenceMode::is_enabled();
  constexpr int64_t kRows = 128;  // rows a block (a multiple of MKL's 16-row panels)
  team_for(0, (C + kRows - 1) / kRows, 1, [&](int64_t b0, int64_t b1) {
    OneBlasThread one;
    c10::InferenceMode mode(inference);
    const int64_t c0 = b0 * kRows, c1 = std::min(C, b1 * kRows);
    at::Tensor out = at::from_blob(lo + c0, {Q, c1 - c0}, {Cp, 1}, at::kFloat);
    at::mm_out(out, qm, centroids.narrow(0, c0, c1 - c0).t());
    for (int64_t i = 0; i < Q; ++i)
      for (int64_t c = c0; c < c1; ++c) {
        const float a = lo[i * Cp + c];
        const float e = gamma * (qc.amax[i] * cc.l1[c]) + 1e-6f * std::fabs(a);
        lo[i * Cp + c] = a - e;
        hi[i * Cp + c] = a + e;
      }
  });
  for (int64_t i = 0; i < Q; ++i)  // rows past C: never candidates
    std::fill(lo + i * Cp + C, lo + (i + 1) * Cp, -std::numeric_limits<float>::infinity()),
        std::fill(hi + i * Cp + C, hi + (i + 1) * Cp, -std::numeric_limits<float>::infinity());
}
#endif

// The P-th largest of x[0, n) (P <= n): by insertion into a sorted P-list with a vector pre-test (P <=
// kInsertMax), else a selection of the orderable keys.
float pth_largest(const float* x, int64_t n, int64_t P, std::vector<int64_t>& keys, std::vector<int64_t>& scratch) {
  if (P <= kInsertMax) {
    float best[kInsertMax];
    std::copy(x, x + P, best);
    std::sort(best, best + P, [](float a, float b) { return a > b; });
    float thr = best[P - 1];
    const auto offer = [&](float v) {
      if (!(v > thr)) return;
      int64_t j = P - 1;
      for (; j > 0 && best[j - 1] < v; --j) best[j] = best[j - 1];
      best[j] = v;
      thr = best[P - 1];
    };
    int64_t i = P;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
      for (__mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(thr), _CMP_GT_OQ); m; m &= m - 1)
        offer(x[i + __builtin_ctz(m)]);
#endif
    for (; i < n; ++i) offer(x[i]);
    return thr;
  }
  keys.resize(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = make_key(ordered_bits(x[i]), i);
  select_top(keys.data(), n, P, scratch);
  const int64_t k = *std::min_element(keys.begin(), keys.begin() + P);
  const int64_t c = key_row(k);
  return x[c];
}

}  // namespace

void centroid_candidates(const at::Tensor& centroids, const at::Tensor& queries, int64_t P,
                         const std::vector<int64_t>& probing, int64_t* cand, bool screen) {
  const int64_t C = centroids.size(0), D = centroids.size(1);
  TORCH_CHECK(centroids.scalar_type() == at::kFloat && queries.scalar_type() == at::kFloat && centroids.is_contiguous() &&
                  queries.is_contiguous() && queries.size(1) == D && P >= 1 && P <= C,
              "centroid_candidates: contiguous float32 centroids [C, D], queries [B, D] and 1 <= P <= C expected");
  const int64_t Q = int64_t(probing.size());
  if (Q == 0) return;
  const float* cen = centroids.data_ptr<float>();
  std::vector<float> q(Q * D);  // the probing queries, in order
  for (int64_t i = 0; i < Q; ++i) std::memcpy(q.data() + i * D, queries.data_ptr<float>() + probing[i] * D, D * sizeof(float));
  const int64_t Qp = (Q + kTile - 1) / kTile * kTile;
  std::shared_ptr<const CentroidCodes> cc;
  std::unique_ptr<QueryCodes> qc;
  bool screened = screen && C > P;
  if (screened) {
    cc = codes_of(centroids);
    qc.reset(new QueryCodes(q.data(), Q, Qp, D));
    // no product and no sum may overflow (the bound would not hold): |q|_inf |c|_1 well inside float
    screened = cc->finite && qc->finite;
    for (int64_t i = 0; i < Q && screened; ++i) screened &= qc->amax[i] * cc->max_l1 < 1e30f;
  }
  if (!screened) {  // every score exact: [C, Qp], the best P of each column
    std::unique_ptr<float[]> sc(new float[C * Qp]);
    std::vector<int64_t> every(Q), top(Qp * P);
    std::iota(every.begin(), every.end(), int64_t{0});
    exact_scores(cen, q.data(), C, D, Q, Qp, sc.get());
    top_candidates(sc.get(), C, Qp, P, every, top.data());
    for (int64_t i = 0; i < Q; ++i) std::copy(top.begin() + i * P, top.begin() + (i + 1) * P, cand + probing[i] * P);
    return;
  }
  // 1. the screen: lower and upper bounds of every score, [Qp, Cp] (query i's row: all centroids)
  const int64_t tiles = cc->tiles, Cp = tiles * kTile;
  std::unique_ptr<float[]> lo(new float[Qp * Cp]), hi(new float[Qp * Cp]);
#if SILVERREC_VNNI
  const float slack = float((D / 16 + 8) * 1.2e-7);  // dot_lanes: D/16 + 4 rounded adds per product, and spare
  team_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t q0 = 0; q0 < Q; q0 += kTile) {
        const int64_t n = std::min<int64_t>(kTile, Q - q0);  // queries past Q: zero codes, their rows unread
        if (n > 8) screen_tile<16>(*cc, t, *qc, q0, slack, lo.get(), hi.get(), Cp);
        else if (n > 4) screen_tile<8>(*cc, t, *qc, q0, slack, lo.get(), hi.get(), Cp);
        else if (n > 2) screen_tile<4>(*cc, t, *qc, q0, slack, lo.get(), hi.get(), Cp);
        else if (n > 1) screen_tile<2>(*cc, t, *qc, q0, slack, lo.get(), hi.get(), Cp);
        else screen_tile<1>(*cc, t, *qc, q0, slack, lo.get(), hi.get(), Cp);
      }
  });
#else
  screen_blas(centroids, q.data(), *cc, *qc, Q, lo.get(), hi.get(), Cp);
#endif
  // 2. per query: the threshold (its P-th largest lower bound), the survivors (upper bound >= it) scored
  // exactly, and the best P of them in the reference's order
  team_for(0, Q, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> keys, scratch;
    std::vector<std::pair<float, int64_t>> scored;
    for (int64_t i = i0; i < i1; ++i) {
      const float* lr = lo.get() + i * Cp;
      const float* hr = hi.get() + i * Cp;
      const float thr = pth_largest(lr, Cp, P, keys, scratch);
      scored.clear();
      int64_t c = 0;
#if defined(__AVX512F__)
      for (; c + 16 <= Cp; c += 16)
        for (__mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(hr + c), _mm512_set1_ps(thr), _CMP_GE_OQ); m; m &= m - 1) {
          const int64_t r = c + __builtin_ctz(m);
          scored.emplace_back(dot_lanes_f32(q.data() + i * D, cen + r * D, D), r);
        }
#endif
      for (; c < Cp; ++c)
        if (hr[c] >= thr) scored.emplace_back(dot_lanes_f32(q.data() + i * D, cen + c * D, D), c);
      TORCH_CHECK(int64_t(scored.size()) >= P, "centroid_candidates: the screen kept fewer than P centroids");
      // higher score first, equal scores (-0 == +0) to the lower centroid: a stable descending sort's order
      std::partial_sort(scored.begin(), scored.begin() + P, scored.end(), [](const auto& x, const auto& y) {
        return x.first > y.first || (x.first == y.first && x.second < y.second);
      });
      for (int64_t j = 0; j < P; ++j) cand[probing[i] * P + j] = scored[j].second;
    }
  });
}

}  // namespace silverrec
