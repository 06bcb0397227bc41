// silverrec::mol_score (kernels/mol_score.py): the mixture-of-logits OverArch's pair scores for
// candidate rows, read from the embedding cache, in one pass per (request, candidate). The math of
// silverrec/ranking/overarch.py `MoLOverArch.score` (its torch form, `mol_score_torch`, is the
// reference and the CUDA path), without its [T, B*K, H] intermediates: per pair, the P component
// logits, the gate's hidden layer, its softmax and the mixture stay in a few hundred bytes.
// The extension builds with -ffp-contract=off (other kernels match torch bit for bit); this one agrees
// with its reference only up to rounding anyway, so its multiply-adds may fuse.
#pragma GCC optimize("fp-contract=fast")

#include "ops.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "constants.h"
#include "team.h"
#include "widen.h"

namespace silverrec {
namespace {

// x / max(|x|, 1e-12), F.normalize's formula
void normalize(float* x, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  const float inv = 1.0f / std::max(std::sqrt(s), 1e-12f);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

struct Weights {
  int64_t T, D, F, H, P, pq, px, c;
  std::vector<float> q;       // per (b, t): the user components q_i, normalised [pq, c]
  std::vector<float> hu;      // per (b, t): the gate's user part W[:, :D] u_t [H]
  std::vector<float> wl_t;    // the gate's logit columns, transposed: [P, H]
  std::vector<float> gate_t;  // per task, the gate's output layer transposed: [T, H, P]
  const float* gate_bias;     // [T, P]
  std::vector<float> dot_scale, temperature;  // [T]: r_t, min(exp(log_scale_t), 100)
};

constexpr int kLanes = 16;  // candidates scored together: every vector op runs across 16 candidates
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));      // GCC vector extensions: one
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));  // lane per candidate

// exp(x) on every lane, to ~1e-7 relative error, branch-free: 2^floor by the exponent bits, 2^fraction
// by a degree-6 polynomial (the gate's SiLU and softmax)
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.0f, hi = vf{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf t = x * 1.44269504088896341f;
  vf fi = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
  fi = fi > t ? fi - 1.0f : fi;  // floor
  const vf f = t - fi;
  vf p = vf{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const vi bits = (__builtin_convertvector(fi, vi) + 127) << 23;
  return p * (vf)bits;
}

// 1 / x on every lane: the hardware's 14-bit estimate and one Newton step (~1e-7 relative error,
// like vexp) where AVX-512 has it; a divide (16-cycle throughput per vector) otherwise
inline vf recip(vf x) {
#ifdef __AVX512F__
  const vf r = (vf)_mm512_rcp14_ps((__m512)x);
  return r * (2.0f - x * r);
#else
  return 1.0f / x;
#endif
}

#ifdef __AVX512F__
// 16 consecutive values of a row as float32
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16: the upper halves of float32s
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// r[i][q] <- r[q][i] for a 16 x 16 block of float32 in registers: pairs of rows interleaved by
// floats, then by pairs of floats, then 128-bit lanes exchanged twice (64 shuffles)
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif

// out[i] (lane q) = widen(base[rows[q] * stride + i]) for i in [0, n): the kLanes rows transposed,
// 16 x 16 blocks in registers where AVX-512 has the shuffles, one value at a time otherwise (and
// for a ragged tail)
template <typename E>
void gather_transposed(const E* base, int64_t stride, const int64_t* rows, int64_t n, vf* out) {
  int64_t i = 0;
#ifdef __AVX512F__
  static_assert(kLanes == 16, "transpose16 transposes 16 lanes");
  for (; i + 16 <= n; i += 16) {
    __m512 blk[16];
    for (int q = 0; q < 16; ++q) blk[q] = load16(base + rows[q] * stride + i);
    transpose16(blk);
    for (int q = 0; q < 16; ++q) out[i + q] = (vf)blk[q];
  }
#endif
  for (; i < n; ++i)
    for (int q = 0; q < kLanes; ++q) out[i][q] = widen(base[rows[q] * stride + i]);
}

constexpr int kAcc = 8;  // accumulators of one loop (8 vector registers)

// Scores of up to kLanes candidates (rows r[0..m), m <= kLanes) for every task of request b. Lane
// q holds candidate q (lanes past m repeat candidate 0): every step of the formula is a vector
// operation across the candidates (no reduction across lanes); the weights are broadcast scalars.
template <typename Emb, typename Rank>
void score_block(const Weights& w, int64_t b, const float* user, const int64_t* r, int64_t m, const Emb* emb,
                 const Rank* ranker, int64_t E, float* out, std::vector<vf>& buf) {
  const int64_t T = w.T, D = w.D, H = w.H, P = w.P, nx = w.px * w.c, c = w.c, px = w.px;
  vf* v = buf.data();  // [D]
  vf* x = v + D;       // [nx]
  vf* hv = x + nx;     // [H]
  vf* l = hv + H;      // [P]
  vf* g = l + P;       // [P]
  vf* h = g + P;       // [H]: the gate's hidden layer
  int64_t rr[kLanes];  // the block's rows, lanes past m repeating the first
  for (int q = 0; q < kLanes; ++q) rr[q] = r[q < m ? q : 0];
  gather_transposed(emb, D, rr, D, v);  // the block, transposed: lane q of v[d] = emb[rr[q], d]
  gather_transposed(ranker, E, rr, nx, x);
  gather_transposed(ranker + nx, E, rr, H, hv);
  for (int64_t t = 0; t < T; ++t) {
    // Every loop below keeps kAcc accumulators in registers and loads each candidate vector once for
    // all of them (one accumulator per loop kept it in memory: two loads per multiply-add).
    const float* qt = w.q.data() + (b * T + t) * w.pq * c;
    for (int64_t j = 0; j < px; ++j)  // l[i * px + j] = <q_i, x_j>
      for (int64_t i0 = 0; i0 < w.pq; i0 += kAcc) {
        const int64_t ni = std::min<int64_t>(kAcc, w.pq - i0);
        vf acc[kAcc] = {};
        for (int64_t e = 0; e < c; ++e) {
          const vf xe = x[j * c + e];
          for (int64_t i = 0; i < kAcc; ++i) acc[i] += (i < ni ? qt[(i0 + i) * c + e] : 0.0f) * xe;
        }
        for (int64_t i = 0; i < ni; ++i) l[(i0 + i) * px + j] = acc[i];
      }
    const float* hu = w.hu.data() + (b * T + t) * H;
    const float* gt = w.gate_t.data() + t * H * P;
    for (int64_t j0 = 0; j0 < H; j0 += kAcc) {  // hidden units: item part + user part + logit columns, SiLU
      const int64_t nj = std::min<int64_t>(kAcc, H - j0);
      vf acc[kAcc];
      for (int64_t i = 0; i < kAcc; ++i) acc[i] = i < nj ? hv[j0 + i] + hu[j0 + i] : vf{};
      for (int64_t p = 0; p < P; ++p) {
        const vf lp = l[p];
        const float* wp = w.wl_t.data() + p * H + j0;
        for (int64_t i = 0; i < kAcc; ++i) acc[i] += (i < nj ? wp[i] : 0.0f) * lp;
      }
      for (int64_t i = 0; i < nj; ++i) h[j0 + i] = acc[i] * recip(1.0f + vexp(-acc[i]));
    }
    for (int64_t p0 = 0; p0 < P; p0 += kAcc) {  // the gate's outputs over every hidden unit
      const int64_t np = std::min<int64_t>(kAcc, P - p0);
      vf acc[kAcc];
      for (int64_t i = 0; i < kAcc; ++i) acc[i] = vf{} + (i < np ? w.gate_bias[t * P + p0 + i] : 0.0f);
      for (int64_t j = 0; j < H; ++j) {
        const vf hj = h[j];
        const float* gj = gt + j * P + p0;
        for (int64_t i = 0; i < kAcc; ++i) acc[i] += (i < np ? gj[i] : 0.0f) * hj;
      }
      for (int64_t i = 0; i < np; ++i) g[p0 + i] = acc[i];
    }
    vf top = g[0];
    for (int64_t p = 1; p < P; ++p) top = g[p] > top ? g[p] : top;
    vf z = {}, mixed = {}, dot = {};
    for (int64_t p = 0; p < P; ++p) {
      const vf e = vexp(g[p] - top);
      z += e;
      mixed += e * l[p];
    }
    const float* u = user + (b * T + t) * D;
    for (int64_t d = 0; d < D; ++d) dot += u[d] * v[d];
    const vf s = mixed / z * w.temperature[t] + dot * w.dot_scale[t];
    for (int64_t q = 0; q < m; ++q) out[q * T + t] = s[q];
  }
}

// Candidates [k0, k0 + kLanes) of request b (fewer at the end of the list): padding rows score 0,
// the others one score_block. buf: a worker's scratch.
template <typename Emb, typename Rank>
void score_span(const Weights& w, int64_t b, int64_t k0, const float* user, const int64_t* rows, int64_t K,
                const Emb* emb, const Rank* ranker, int64_t E, int64_t n, float* out, std::vector<vf>& buf) {
  const int64_t T = w.T, D = w.D;
  int64_t live[kLanes], slot[kLanes], m = 0;
  for (int64_t k = k0; k < std::min(K, k0 + kLanes); ++k) {
    const int64_t r = rows[k];
    if (r < 0) {  // padding: a finite score the caller masks
      std::fill(out + k * T, out + (k + 1) * T, 0.0f);
      continue;
    }
    TORCH_CHECK_INDEX(r < n, "mol_score: row ", r, " out of range for ", n, " cached rows");
    live[m] = r;
    slot[m++] = k;
  }
  // the next block's rows towards the cache while this one computes (rows are random in a pool of
  // megabytes: the transposing loads below stalled on them)
  for (int64_t k = k0 + kLanes; k < std::min(K, k0 + 2 * kLanes); ++k) {
    const int64_t r = rows[k];
    if (r < 0 || r >= n) continue;
    for (int64_t o = 0; o < int64_t(D * sizeof(Emb)); o += 64) __builtin_prefetch(reinterpret_cast<const char*>(emb + r * D) + o);
    for (int64_t o = 0; o < int64_t(E * sizeof(Rank)); o += 64) __builtin_prefetch(reinterpret_cast<const char*>(ranker + r * E) + o);
  }
  if (!m) return;
  float scores[kLanes * 8];
  std::vector<float> wide;
  float* sc = scores;
  if (T > 8) {
    wide.resize(kLanes * T);
    sc = wide.data();
  }
  score_block(w, b, user, live, m, emb, ranker, E, sc, buf);
  for (int64_t q = 0; q < m; ++q) std::copy_n(sc + q * T, T, out + slot[q] * T);
}

}  // namespace

// weights: the MoLOverArch's tensors, dims: its sizes, in the orders of constants.h mol_weights / mol_dims.
at::Tensor mol_score(const at::Tensor& user_in, const at::Tensor& rows_in, const at::Tensor& emb_in,
                     const at::Tensor& ranker_in, at::TensorList weights, at::IntArrayRef dims) {
  if (int64_t(weights.size()) != mol_weights::kCount || int64_t(dims.size()) != mol_dims::kCount)
    throw std::invalid_argument("mol_score: weights must hold " + std::to_string(mol_weights::kCount) + " tensors and dims " +
                                std::to_string(mol_dims::kCount) + " sizes (kernels/constants.py MOL_WEIGHTS, MOL_DIMS)");
  const int64_t p_q = dims[mol_dims::kPQ], p_x = dims[mol_dims::kPX], comp_dim = dims[mol_dims::kCompDim];
  const int64_t feat_dim = dims[mol_dims::kFeatDim];
  const at::Tensor &dot_scale_in = weights[mol_weights::kDotScale], &log_scale_in = weights[mol_weights::kLogScale];
  const at::Tensor user = user_in.contiguous(), rows = rows_in.contiguous(), emb = emb_in.contiguous();
  const at::Tensor ranker = ranker_in.contiguous();
  const at::Tensor uw = weights[mol_weights::kUserWeight].contiguous(), ub = weights[mol_weights::kUserBias].contiguous();
  const at::Tensor gw = weights[mol_weights::kGateInWeight].contiguous();
  const at::Tensor gout = weights[mol_weights::kGateWeight].contiguous(), gbias = weights[mol_weights::kGateBias].contiguous();
  for (const at::Tensor* t : {&user, &uw, &ub, &gw, &gout, &gbias, &dot_scale_in, &log_scale_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "mol_score: user and weights must be float32");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2, "mol_score: rows must be int64 [B, K]");
  TORCH_CHECK(emb.scalar_type() == at::kFloat || emb.scalar_type() == at::kBFloat16, "mol_score: emb must be float32 or bfloat16");
  TORCH_CHECK(ranker.scalar_type() == at::kFloat || ranker.scalar_type() == at::kBFloat16,
              "mol_score: ranker must be float32 or bfloat16");
  Weights w;
  w.T = user.size(1), w.D = user.size(2), w.F = feat_dim, w.H = gw.size(0), w.pq = p_q, w.px = p_x, w.c = comp_dim;
  w.P = p_q * p_x;
  const int64_t B = user.size(0), K = rows.size(1), T = w.T, D = w.D, H = w.H, P = w.P;
  const int64_t E = ranker.size(1), n = emb.size(0);
  TORCH_CHECK(user.dim() == 3 && rows.size(0) == B && emb.dim() == 2 && emb.size(1) == D && ranker.size(0) == n &&
                  E >= p_x * comp_dim + H && uw.sizes() == at::IntArrayRef({T, p_q * comp_dim, D}) &&
                  gw.size(1) == 2 * D + feat_dim + P && gout.sizes() == at::IntArrayRef({T, P, H}) &&
                  gbias.sizes() == at::IntArrayRef({T, P}) && dot_scale_in.numel() == T && log_scale_in.numel() == T,
              "mol_score: shapes disagree (user [B, T, D], rows [B, K], emb [N, D], ranker [N, E], weights of a "
              "MoLOverArch(D, F, T, p_q, p_x, comp_dim, H))");
  const float* u = user.data_ptr<float>();
  const float* W = gw.data_ptr<float>();  // [H, 2D + F + P]
  const int64_t ld = gw.size(1), pqc = p_q * comp_dim;
  w.q.resize(B * T * pqc);
  w.hu.resize(B * T * H);
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t t = bt % T;
    const float* ut = u + bt * D;
    float* q = w.q.data() + bt * pqc;
    for (int64_t m = 0; m < pqc; ++m)
      q[m] = ub.data_ptr<float>()[t * pqc + m] + dot_lanes(uw.data_ptr<float>() + (t * pqc + m) * D, ut, D);
    for (int64_t i = 0; i < p_q; ++i) normalize(q + i * comp_dim, comp_dim);
    for (int64_t j = 0; j < H; ++j) w.hu[bt * H + j] = dot_lanes(W + j * ld, ut, D);
  }
  w.wl_t.resize(P * H);
  for (int64_t j = 0; j < H; ++j)
    for (int64_t p = 0; p < P; ++p) w.wl_t[p * H + j] = W[j * ld + 2 * D + feat_dim + p];
  w.gate_t.resize(T * H * P);
  const float* go = gout.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t j = 0; j < H; ++j) w.gate_t[(t * H + j) * P + p] = go[(t * P + p) * H + j];
  w.gate_bias = gbias.data_ptr<float>();
  w.dot_scale.resize(T);
  w.temperature.resize(T);
  const at::Tensor ds = dot_scale_in.contiguous(), ls = log_scale_in.contiguous();
  for (int64_t t = 0; t < T; ++t) {
    w.dot_scale[t] = ds.data_ptr<float>()[t];
    w.temperature[t] = std::min(std::exp(ls.data_ptr<float>()[t]), 100.0f);
  }
  at::Tensor out = at::empty({B, K, T}, at::kFloat);
  const int64_t* r = rows.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  // one task per (request, block of kLanes candidates): a batch of one long list splits across threads too
  const int64_t blocks = (K + kLanes - 1) / kLanes;
  team_for(0, B * blocks, 4, [&](int64_t lo, int64_t hi) {
    std::vector<vf> buf(D + p_x * comp_dim + 2 * H + 2 * P);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / blocks, k0 = (i % blocks) * kLanes;
      const int64_t* rb = r + b * K;
      float* ob = o + b * K * T;
      if (emb.scalar_type() == at::kFloat && ranker.scalar_type() == at::kFloat)
        score_span(w, b, k0, u, rb, K, emb.data_ptr<float>(), ranker.data_ptr<float>(), E, n, ob, buf);
      else if (emb.scalar_type() == at::kBFloat16 && ranker.scalar_type() == at::kFloat)
        score_span(w, b, k0, u, rb, K, emb.data_ptr<at::BFloat16>(), ranker.data_ptr<float>(), E, n, ob, buf);
      else if (emb.scalar_type() == at::kFloat)
        score_span(w, b, k0, u, rb, K, emb.data_ptr<float>(), ranker.data_ptr<at::BFloat16>(), E, n, ob, buf);
      else
        score_span(w, b, k0, u, rb, K, emb.data_ptr<at::BFloat16>(), ranker.data_ptr<at::BFloat16>(), E, n, ob, buf);
    }
  });
  return out;
}

}  // namespace silverrec
