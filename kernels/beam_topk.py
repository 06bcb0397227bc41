"""`silverrec::beam_topk`: one beam-search selection step — per-beam top_k, then global top W.

    scores, parent, code = torch.ops.silverrec.beam_topk(beam_scores, logprobs, top_k, beam_width)
    # beam_scores float [B, Wi]     cumulative log-prob of each live beam (-inf = no beam)
    # logprobs    float [B, Wi, C]  next-code log-probs, -inf where the code is not allowed
    # -> scores float [B, W] (= beam_scores[parent] + logprobs[parent, code], descending),
    #    parent int64 [B, W] in [0, Wi), code int64 [B, W] in [0, C)

Semantics (exactly what a full sort returns): candidate (i, c) has score beam_scores[i] +
logprobs[i, c]; it is admissible if finite and among the top_k of beam i (ties: lower c first);
the result is the W best admissible candidates, ties broken by lower (i, c). Fewer than W
admissible candidates: the remaining slots get score -inf, parent 0, code 0 (never a real
candidate). top_k >= C (or >= W) means "no per-beam cut", i.e. ordinary beam search.

Both kernels are ATen calls in C++ (kernels/csrc/beam.cpp). CPU (host logic is fine inside the op) uses early
termination: beams are ranked by their best candidate; the top_k candidates of the first ceil(W / top_k) of them
give a lower bound on the final W-th score, and every beam whose best candidate is below it is skipped (never
sorted). CUDA: the same selection on every beam, without the data-dependent cut (no host sync);
`torch.ops.silverrec_host.beam_topk_every_beam` runs it on any device, for the tests.
`beam_topk_reference` is the independent full-sort reference used by the tests.
"""

import torch


def beam_topk_reference(beam_scores: torch.Tensor, logprobs: torch.Tensor, top_k: int, beam_width: int):
    """Independent reference: rank every candidate, mask the non-admissible, one full stable sort
    over all Wi * C candidates (flat index i * C + c breaks ties). Same outputs as the op."""
    total = beam_scores[:, :, None] + logprobs + 0.0  # + 0.0: -0.0 becomes +0.0, equal scores compare equal
    B, Wi, C = total.shape
    order = torch.sort(total, dim=2, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(2, order, torch.arange(C).expand(B, Wi, C).contiguous())
    admissible = (rank < top_k) & (total > float("-inf"))
    flat = torch.where(admissible, total, torch.full_like(total, float("-inf"))).reshape(B, Wi * C)
    top = torch.sort(flat, dim=1, descending=True, stable=True)
    scores = top.values[:, :beam_width]
    idx = top.indices[:, :beam_width]
    parent, code = idx // C, idx % C
    if scores.shape[1] < beam_width:
        pad = beam_width - scores.shape[1]
        scores = torch.cat([scores, scores.new_full((B, pad), float("-inf"))], dim=1)
        parent = torch.cat([parent, parent.new_zeros(B, pad)], dim=1)
        code = torch.cat([code, code.new_zeros(B, pad)], dim=1)
    dead = scores == float("-inf")
    return scores, parent.masked_fill(dead, 0), code.masked_fill(dead, 0)
