"""Masked scaled-dot-product attention that torch.export keeps batch-generic on every torch we run.

On torch releases before 2.13 (2.11 is the GPU machine's), exporting a 4-D
`F.scaled_dot_product_attention` with a boolean mask broadcast over the heads ([B, 1, S, T] or
[B, 1, 1, T]) adds the guard `batch != 1`, so a published program could not answer one request.
Folding the batch into the heads (one call of batch 1 over B x H heads, the mask expanded to every
head) exports without it and gives equal results (tests/test_decoder.py, tests/test_ranking.py);
it is slower on the CPU (1.2x per attention at 513 tokens, 1.8x at 2,049), so torch >= 2.13 uses
the plain call. Used by the generative prefill and the list-wise OverArch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SDPA_BATCH_IN_HEADS: bool = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     batch_in_heads: bool) -> torch.Tensor:
    """q [B, H, S, d], k / v [B, H, T, d], mask bool broadcastable to [B, H, S, T] (True: may
    attend) -> [B, H, S, d]. `batch_in_heads`: fold the batch into the heads (SDPA_BATCH_IN_HEADS)."""
    if not batch_in_heads:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    B, H, S, d = q.shape
    T = k.shape[2]
    BH = B * H
    return F.scaled_dot_product_attention(
        q.reshape(1, BH, S, d), k.reshape(1, BH, T, d), v.reshape(1, BH, T, d),
        attn_mask=mask.expand(B, H, S, T).reshape(1, BH, S, T)).view(B, H, S, d)
