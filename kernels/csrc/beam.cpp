// silverrec::beam_topk on the CPU (kernels/beam_topk.py): one beam-search selection step as ATen calls, with
// early termination: beams are ranked by their best candidate; the top_k candidates of the first
// ceil(W / top_k) of them bound the final W-th score from below, and every beam whose best candidate is below
// that bound is never sorted (a host read of the bound: CPU only). On CUDA (`beam_topk_every_beam`) the same ATen
// selection runs on every beam: no data-dependent cut, no host synchronisation.
#include "ops.h"

#include <ATen/ops/arange.h>

#include <algorithm>
#include <limits>

namespace silverrec {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Per-beam top_k of total [B, Wi, C] over the beams `beams` int64 [B, n] (ascending; undefined: every beam), then
// the best W, ties to the lower (beam, code) (stable descending sorts keep index order); fewer admissible
// candidates than W: score -inf, parent 0, code 0.
Triple select(const at::Tensor& total_in, int64_t top_k, int64_t W, at::Tensor beams) {
  const int64_t B = total_in.size(0), Wi = total_in.size(1), C = total_in.size(2), k = std::min(top_k, C);
  at::Tensor total = total_in;
  if (beams.defined())
    total = total.gather(1, beams.unsqueeze(2).expand({B, beams.size(1), C}));
  else
    beams = at::arange(Wi, total.options().dtype(at::kLong)).unsqueeze(0).expand({B, Wi});
  const int64_t n = total.size(1);
  const auto per_beam = total.sort(/*stable=*/true, /*dim=*/2, /*descending=*/true);
  const at::Tensor vals = std::get<0>(per_beam).slice(2, 0, k).reshape({B, n * k});
  const at::Tensor codes = std::get<1>(per_beam).slice(2, 0, k).reshape({B, n * k});
  const auto top = vals.sort(/*stable=*/true, /*dim=*/1, /*descending=*/true);
  const int64_t w = std::min(W, n * k);
  const at::Tensor flat = std::get<1>(top).slice(1, 0, w);
  at::Tensor scores = at::full({B, W}, kNegInf, total.options());
  at::Tensor parent = at::zeros({B, W}, beams.options()), code = at::zeros({B, W}, beams.options());
  scores.slice(1, 0, w).copy_(std::get<0>(top).slice(1, 0, w));
  parent.slice(1, 0, w).copy_(beams.gather(1, flat.div(k, "floor")));
  code.slice(1, 0, w).copy_(codes.gather(1, flat));
  const at::Tensor dead = scores.eq(kNegInf);
  return {scores, parent.masked_fill(dead, 0), code.masked_fill(dead, 0)};
}

// Checks the arguments and returns every candidate's score beam_scores + logprobs [B, Wi, C].
at::Tensor candidate_scores(const at::Tensor& beam_scores, const at::Tensor& logprobs, int64_t top_k,
                            int64_t beam_width) {
  TORCH_CHECK_VALUE(logprobs.dim() == 3 && beam_scores.sizes() == logprobs.sizes().slice(0, 2),
                    "beam_scores must be [B, Wi] and logprobs [B, Wi, C], got ", beam_scores.sizes(), " and ",
                    logprobs.sizes());
  TORCH_CHECK_VALUE(top_k > 0 && beam_width > 0, "top_k and beam_width must be positive, got ", top_k, " and ",
                    beam_width);
  // + 0.0 turns -0.0 into +0.0 so that equal scores compare equal everywhere
  return beam_scores.unsqueeze(2).add(logprobs).add(0.0);
}

}  // namespace

Triple beam_topk(const at::Tensor& beam_scores, const at::Tensor& logprobs, int64_t top_k, int64_t beam_width) {
  const at::Tensor total = candidate_scores(beam_scores, logprobs, top_k, beam_width);
  const int64_t B = total.size(0), Wi = total.size(1), C = total.size(2), k = std::min(top_k, C);
  const int64_t m = (beam_width + k - 1) / k;  // beams whose top_k candidates alone can fill the W slots
  if (m >= Wi) return select(total, top_k, beam_width, at::Tensor());
  const at::Tensor best = std::get<0>(total.max(2));  // [B, Wi]
  const at::Tensor rank = std::get<1>(best.sort(/*stable=*/true, /*dim=*/1, /*descending=*/true));
  const at::Tensor lead = std::get<0>(rank.slice(1, 0, m).sort(1));
  const at::Tensor lead_vals =
      std::get<0>(total.gather(1, lead.unsqueeze(2).expand({B, m, C})).topk(k, 2)).reshape({B, m * k});
  const at::Tensor threshold = std::get<0>(lead_vals.topk(beam_width, 1)).select(1, beam_width - 1);  // <= final W-th
  const at::Tensor need = best.ge(threshold.unsqueeze(1)).logical_and(best.gt(kNegInf));
  const int64_t n = std::max(need.sum(1).max().item<int64_t>(), m);  // the needed beams are a prefix of `rank`
  if (n >= Wi) return select(total, top_k, beam_width, at::Tensor());
  return select(total, top_k, beam_width, std::get<0>(rank.slice(1, 0, n).sort(1)));
}

Triple beam_topk_every_beam(const at::Tensor& beam_scores, const at::Tensor& logprobs, int64_t top_k,
                            int64_t beam_width) {
  return select(candidate_scores(beam_scores, logprobs, top_k, beam_width), top_k, beam_width, at::Tensor());
}

}  // namespace silverrec
