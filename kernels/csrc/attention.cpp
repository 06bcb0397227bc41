// silverrec::merge_attention_states and silverrec::staged_attention on the CPU (kernels/merge_attention_states.py,
// kernels/staged_attention.py): compositions of ATen calls. The staged attention's two stages are each one call
// of ATen's fused flash-attention CPU kernel, which returns the log-sum-exp the merge needs.
#include "ops.h"

#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/ones.h>

#include <cmath>
#include <limits>

namespace silverrec {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The merge by log-sum-exp (either or both stages may be empty: s = -inf):
//   s = logaddexp(s_a, s_b), v = v_a exp(s_a - s) + v_b exp(s_b - s); two empty stages give v = 0, s = -inf.
Pair merge_states(const at::Tensor& v_a, const at::Tensor& s_a, const at::Tensor& v_b, const at::Tensor& s_b) {
  at::Tensor m = s_a.maximum(s_b);
  m = m.masked_fill(m.isfinite().logical_not(), 0);
  const at::Tensor w_a = s_a.sub(m).exp(), w_b = s_b.sub(m).exp();
  const at::Tensor total = w_a.add(w_b);
  const at::Tensor denom = total.masked_fill(total.gt(0).logical_not(), 1);
  const at::Tensor v = v_a.mul(w_a.div(denom).unsqueeze(-1)).add(v_b.mul(w_b.div(denom).unsqueeze(-1)));
  return {v.to(v_a.scalar_type()), m.add(total.log()).to(s_a.scalar_type())};  // log(0) = -inf: both empty
}

// One stage's partial attention state: q [N, KV, M, hd], k / v [N, KV, S, hd] (any strides), key_valid bool
// [N, S] -> (out [N, KV, M, hd] softmax-normalised, lse [N, KV, M] natural log; -inf and out 0 without a key).
Pair attention_states(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_valid) {
  const at::Tensor bias = at::zeros(key_valid.sizes(), q.options()).masked_fill(key_valid.logical_not(), kNegInf);
  at::Tensor out, lse;
  std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(
      q, k, v, 0.0, false, bias.unsqueeze(1).unsqueeze(1), 1.0 / std::sqrt(double(q.size(-1))));
  const at::Tensor empty = key_valid.any(1).logical_not().view({-1, 1, 1});
  return {out, lse.to(q.scalar_type()).masked_fill(empty, kNegInf)};
}

// All W beams of a request against its shared history: the W beams x group heads of one KV head are the M query
// rows of one attention problem, so the history is read once per request and KV head, never copied per beam.
// q [B, W, H, hd] -> (out [B*W, H, hd], lse [B*W, H]).
Pair shared_stage(const at::Tensor& q, const at::Tensor& shared_k, const at::Tensor& shared_v, const at::Tensor& key_valid) {
  const int64_t B = q.size(0), W = q.size(1), H = q.size(2), hd = q.size(3), KV = shared_k.size(1), g = H / KV;
  const at::Tensor qg = q.reshape({B, W, KV, g, hd}).permute({0, 2, 1, 3, 4}).reshape({B, KV, W * g, hd});
  at::Tensor out, lse;
  std::tie(out, lse) = attention_states(qg, shared_k, shared_v, key_valid);
  return {out.reshape({B, KV, W, g, hd}).permute({0, 2, 1, 3, 4}).reshape({B * W, H, hd}),
          lse.reshape({B, KV, W, g}).permute({0, 2, 1, 3}).reshape({B * W, H})};
}

// Each beam against its own slots [0, n), n >= 1: q [B, W, H, hd] -> (out [B*W, H, hd], lse [B*W, H]).
Pair unshared_stage(const at::Tensor& q, const at::Tensor& unshared_k, const at::Tensor& unshared_v, int64_t n) {
  const int64_t B = q.size(0), W = q.size(1), H = q.size(2), hd = q.size(3), KV = unshared_k.size(2), g = H / KV;
  const at::Tensor qg = q.reshape({B * W, KV, g, hd});
  const at::Tensor k = unshared_k.slice(1, 0, n).transpose(1, 2), v = unshared_v.slice(1, 0, n).transpose(1, 2);
  at::Tensor out, lse;
  std::tie(out, lse) = attention_states(qg, k, v, at::ones({B * W, n}, q.options().dtype(at::kBool)));
  return {out.reshape({B * W, H, hd}), lse.reshape({B * W, H})};
}

}  // namespace

Pair merge_attention_states(const at::Tensor& v_a, const at::Tensor& s_a, const at::Tensor& v_b, const at::Tensor& s_b) {
  TORCH_CHECK_VALUE(v_a.dim() == 3 && v_a.sizes() == v_b.sizes(), "v_a, v_b must both be [N, H, D], got ", v_a.sizes(),
                    " and ", v_b.sizes());
  const at::IntArrayRef nh = v_a.sizes().slice(0, 2);
  TORCH_CHECK_VALUE(s_a.sizes() == nh && s_b.sizes() == nh, "s_a, s_b must be [N, H] = ", nh, ", got ", s_a.sizes(),
                    " and ", s_b.sizes());
  return merge_states(v_a, s_a, v_b, s_b);
}

at::Tensor staged_attention(const at::Tensor& q, const at::Tensor& shared_k, const at::Tensor& shared_v,
                            const at::Tensor& key_valid, const at::Tensor& unshared_k, const at::Tensor& unshared_v,
                            int64_t n_unshared) {
  TORCH_CHECK_VALUE(q.dim() == 4, "q must be [B, W, H, hd], got ", q.sizes());
  const int64_t B = q.size(0), W = q.size(1), H = q.size(2), hd = q.size(3);
  TORCH_CHECK_VALUE(shared_k.dim() == 4 && shared_k.size(0) == B && shared_k.size(3) == hd &&
                        shared_v.sizes() == shared_k.sizes(),
                    "shared_k/v must be [B=", B, ", KV, T, hd=", hd, "], got ", shared_k.sizes(), " / ", shared_v.sizes());
  const int64_t KV = shared_k.size(1), T = shared_k.size(2);
  TORCH_CHECK_VALUE(KV > 0 && H % KV == 0, "query heads ", H, " not divisible by KV heads ", KV);
  TORCH_CHECK_VALUE(key_valid.scalar_type() == at::kBool && key_valid.dim() == 2 && key_valid.size(0) == B &&
                        key_valid.size(1) == T,
                    "key_valid must be bool [B=", B, ", T=", T, "], got ", key_valid.scalar_type(), " ", key_valid.sizes());
  TORCH_CHECK_VALUE(unshared_k.dim() == 4 && unshared_k.size(0) == B * W && unshared_k.size(2) == KV &&
                        unshared_k.size(3) == hd && unshared_v.sizes() == unshared_k.sizes(),
                    "unshared_k/v must be [B*W=", B * W, ", S, KV=", KV, ", hd=", hd, "], got ", unshared_k.sizes());
  TORCH_CHECK_VALUE(0 <= n_unshared && n_unshared <= unshared_k.size(1), "n_unshared must be in [0, ", unshared_k.size(1),
                    "], got ", n_unshared);
  at::Tensor o_a, s_a;
  std::tie(o_a, s_a) = shared_stage(q, shared_k, shared_v, key_valid);
  if (n_unshared == 0) return o_a.reshape({B, W, H, hd});
  at::Tensor o_b, s_b;
  std::tie(o_b, s_b) = unshared_stage(q, unshared_k, unshared_v, n_unshared);
  return std::get<0>(merge_states(o_a, s_a, o_b, s_b)).reshape({B, W, H, hd});
}

}  // namespace silverrec
