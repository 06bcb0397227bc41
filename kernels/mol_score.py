"""`silverrec::mol_score`: the mixture-of-logits OverArch's pair scores for candidate rows of the embedding cache.

    scores = torch.ops.silverrec.mol_score(user, rows, emb, ranker, user_weight, user_bias, gate_in_weight,
                                           gate_weight, gate_bias, dot_scale, log_scale, p_q, p_x, comp_dim, feat_dim)
    # user float32 [B, T, D], rows int64 [B, K] (-1 = padding), emb [N, D] and ranker [N, E] (the cache's
    # embeddings and the OverArch's item side, float32 or bfloat16), the float32 weights of a
    # MoLOverArch (silverrec/ranking/overarch.py) -> float32 [B, K, T] (0 at padding)

The math is `MoLOverArch.score` on the gathered rows (`mol_pair_scores`, one place for it). Why one
op: at batch 1 the torch form is some forty tensor ops over [T, B*K, H] intermediates (0.2 ms of a
0.65 ms MovieLens forward), at batch 16 half the forward; per (request, candidate) the arithmetic is
a few thousand multiply-adds. CPU: kernels/csrc/mol.cpp, one pass per pair with every intermediate in
a few hundred bytes; the torch form (`mol_score_torch`) is the reference, the CUDA path and the
fallback without the extension. Results agree up to float32 summation order.
"""

from __future__ import annotations

import torch
from torch import Tensor


def mol_score_torch(user: Tensor, rows: Tensor, emb: Tensor, ranker: Tensor, user_weight: Tensor, user_bias: Tensor,
                    gate_in_weight: Tensor, gate_weight: Tensor, gate_bias: Tensor, dot_scale: Tensor,
                    log_scale: Tensor, p_q: int, p_x: int, comp_dim: int, feat_dim: int) -> Tensor:
    """The reference (device-generic): the rows gathered, `mol_pair_scores`, 0 at padding (`mol_row_scores`)."""
    from silverrec.ranking.overarch import mol_row_scores

    eye = torch.eye(p_x, dtype=user_weight.dtype, device=user_weight.device)
    return mol_row_scores(user, rows, emb, ranker, user_weight, user_bias, gate_in_weight, gate_weight, gate_bias,
                          dot_scale, log_scale, p_q, p_x, comp_dim, feat_dim, eye)


# Defined before kernels/filtered_ivf_search.py loads the C++ extension, which registers the CPU kernel.
torch.library.define(
    "silverrec::mol_score",
    "(Tensor user, Tensor rows, Tensor emb, Tensor ranker, Tensor user_weight, Tensor user_bias, Tensor gate_in_weight, "
    "Tensor gate_weight, Tensor gate_bias, Tensor dot_scale, Tensor log_scale, int p_q, int p_x, int comp_dim, "
    "int feat_dim) -> Tensor")
torch.library.impl("silverrec::mol_score", "CUDA", mol_score_torch)


def register_cpu_fallback() -> None:
    """CPU kernel when the extension is not built (kernels/filtered_ivf_search.py calls this)."""
    torch.library.impl("silverrec::mol_score", "CPU", mol_score_torch)


@torch.library.register_fake("silverrec::mol_score")
def _(user, rows, emb, ranker, user_weight, user_bias, gate_in_weight, gate_weight, gate_bias, dot_scale, log_scale,
      p_q, p_x, comp_dim, feat_dim):
    return user.new_empty(rows.shape[0], rows.shape[1], user.shape[1], dtype=torch.float32)
