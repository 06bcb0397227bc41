"""Masked scaled-dot-product attention that torch.export keeps batch-generic on every torch we run.

On torch releases before 2.13 (2.11 is the GPU machine's), exporting a 4-D
`F.scaled_dot_product_attention` with a boolean mask broadcast over the heads ([B, 1, S, T] or
[B, 1, 1, T]) adds the guard `batch != 1`, so a published program could not answer one request.
Folding the batch into the heads (one call of batch 1 over B x H heads, the mask expanded to every
head) exports without it and gives equal results (tests/test_decoder.py, tests/test_ranking.py);
it is slower on the CPU (1.2x per attention at 513 tokens, 1.8x at 2,049), so torch >= 2.13 uses
the plain call. Used by the generative prefill, the list-wise OverArch and the sequential user tower
(`PreLNBlock`, the transformer block the last two share).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


class PreLNBlock(nn.Module):
    """Pre-LN transformer block: x += MHA(LN x) over the allowed keys; x += FFN(LN x) (GELU).

    `dropout` (on both residual branches) acts in training mode only. The list-wise OverArch
    (silverrec/ranking/overarch.py) and the sequential user tower (silverrec/retrieval/sequence_tower.py)
    are stacks of it."""

    def __init__(self, model_dim: int, heads: int, ffn: int, dropout: float = 0.0) -> None:
        super().__init__()
        if model_dim % heads:
            raise ValueError(f"model_dim {model_dim} is not divisible by heads {heads}")
        self.heads = heads
        self.batch_in_heads: bool = SDPA_BATCH_IN_HEADS  # torch < 2.13 exports a dynamic batch only so
        self.norm1 = nn.LayerNorm(model_dim)
        self.qkv = nn.Linear(model_dim, 3 * model_dim)
        self.proj = nn.Linear(model_dim, model_dim)
        self.norm2 = nn.LayerNorm(model_dim)
        self.ffn_in = nn.Linear(model_dim, ffn)
        self.ffn_out = nn.Linear(ffn, model_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, last: bool = False) -> torch.Tensor:
        """x [B, S, M], mask bool broadcastable to [B, H, S, S] (True = may attend) -> [B, S, M];
        with `last`, the last position's output alone, [B, 1, M] (mask [B, 1, 1 or S, S]: its last
        query row is used), for a stack whose next stage reads only that position."""
        qkv = self.qkv(self.norm1(x)).unflatten(-1, [3, self.heads, -1]).permute(2, 0, 3, 1, 4).unbind(0)
        q = qkv[0]
        if last:
            q, x, mask = q[:, :, -1:], x[:, -1:], mask[:, :, -1:]
        a = masked_attention(q, qkv[1], qkv[2], mask, self.batch_in_heads)  # [B, H, S or 1, M/H]
        x = x + self.dropout(self.proj(a.transpose(1, 2).flatten(2)))
        return x + self.dropout(self.ffn_out(F.gelu(self.ffn_in(self.norm2(x)))))
