"""Plain PyTorch towers and a list-wise OverArch for silverrec's bring-your-own-model publish.

Nothing here imports silverrec: these are the interfaces a team's own models implement.

    UserTower  (values int64 [nnz], lengths int32 [3 * B], dense float32 [B, 1]) -> [B, D] | [B, T, D]
               keys (key-major, like a KeyedJaggedTensor): hist_item, recent_item (items as rows of
               items.parquet), hist_<feature> (value codes, 0 = unknown); dense: log1p(history length)
    ItemTower  (values int64 [nnz], lengths int32 [2 * N], dense float32 [N, 0]) -> [N, D]
               keys: item (row of items.parquet), <feature> (value codes)
    ListwiseRanker (user [B, T, D], cand [B, K, D], feats [B, K, F], valid bool [B, K]) -> [B, K, T]
               a small transformer over the candidate list with the user as extra tokens

Bags are pooled with `index_add` over `repeat_interleave`d bag ids (static shapes, so
torch.export and TorchScript both take it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def pool_bags(emb: Tensor, lengths: Tensor) -> Tensor:
    """emb [nnz, E] of the values of F * B bags (lengths int32 [F * B]) -> mean per bag [F * B, E]."""
    bags = torch.repeat_interleave(torch.arange(lengths.shape[0], device=emb.device), lengths.long(),
                                   output_size=emb.shape[0])
    total = torch.zeros(lengths.shape[0], emb.shape[1], dtype=emb.dtype, device=emb.device).index_add(0, bags, emb)
    return total / lengths.clamp_min(1).unsqueeze(1).to(emb.dtype)


def key_of_values(lengths: Tensor, batch: int, nnz: int) -> Tensor:
    """int64 [nnz]: the key index of every value (key-major layout, `batch` bags per key)."""
    bag_key = torch.arange(lengths.shape[0], device=lengths.device) // batch
    return torch.repeat_interleave(bag_key, lengths.long(), output_size=nnz)


class UserTower(nn.Module):
    """Mean of the history's item and feature embeddings, the recent items', log history length -> MLP.

    Args: num_items (rows of items.parquet), num_values (feature vocabulary size), dim D, tasks T, hidden.
    """

    def __init__(self, num_items: int, num_values: int, dim: int = 32, tasks: int = 1, hidden: int = 128):
        super().__init__()
        self.num_items, self.num_values, self.dim, self.tasks = num_items, num_values, dim, tasks
        self.item = nn.Embedding(num_items, dim)
        self.value = nn.Embedding(num_values + 1, dim)
        self.mlp = nn.Sequential(nn.Linear(3 * dim + 1, hidden), nn.ReLU(), nn.Linear(hidden, tasks * dim))

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor) -> Tensor:
        B = dense.shape[0]
        key = key_of_values(lengths, B, values.shape[0])
        emb = torch.where((key < 2).unsqueeze(1), self.item(values.clamp(0, self.num_items - 1)),
                          self.value(values.clamp(0, self.num_values)))
        pooled = pool_bags(emb, lengths).reshape(3, B, self.dim)  # hist_item, recent_item, hist_<feature>
        x = torch.cat([pooled[0], pooled[1], pooled[2], dense[:, :1]], dim=1)
        u = F.normalize(self.mlp(x).reshape(B, self.tasks, self.dim), dim=-1)
        return u[:, 0] if self.tasks == 1 else u


class ItemTower(nn.Module):
    """Item embedding + mean feature embedding -> MLP, unit length."""

    def __init__(self, num_items: int, num_values: int, dim: int = 32, hidden: int = 128):
        super().__init__()
        self.num_items, self.num_values, self.dim = num_items, num_values, dim
        self.item = nn.Embedding(num_items, dim)
        self.value = nn.Embedding(num_values + 1, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor) -> Tensor:
        N = dense.shape[0]
        key = key_of_values(lengths, N, values.shape[0])
        emb = torch.where((key < 1).unsqueeze(1), self.item(values.clamp(0, self.num_items - 1)),
                          self.value(values.clamp(0, self.num_values)))
        pooled = pool_bags(emb, lengths).reshape(2, N, self.dim)
        return F.normalize(self.mlp(torch.cat([pooled[0], pooled[1]], dim=1)), dim=-1)


class Block(nn.Module):
    """Pre-LN transformer block over [B, S, M] tokens; keys where mask [B, 1, 1, S] is False are ignored."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ffn = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        B, S, M = x.shape
        H, d = self.heads, M // self.heads
        q, k, v = self.qkv(self.norm1(x)).reshape(B, S, 3, H, d).permute(2, 0, 3, 1, 4).reshape(3, 1, B * H, S, d).unbind(0)
        # the batch folded into the heads: torch.export of the plain 4-D call with a mask broadcast over the
        # heads guards `batch != 1` on torch < 2.13, so the published program could not answer one request
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(B, H, S, S).reshape(1, B * H, S, S))
        x = x + self.proj(a.view(B, H, S, d).transpose(1, 2).reshape(B, S, M))
        return x + self.ffn(self.norm2(x))


class ListwiseRanker(nn.Module):
    """Tokens [T user tokens, K candidate tokens] -> transformer -> a score per candidate and task,
    plus s * <u_t, v_k> (the retrieval score, s learned) so training starts at the retrieval order."""

    def __init__(self, dim: int = 32, feat_dim: int = 0, tasks: int = 1, width: int = 32, heads: int = 2,
                 layers: int = 1):
        super().__init__()
        self.tasks = tasks
        self.user_in = nn.Linear(dim, width)
        self.item_in = nn.Linear(dim + feat_dim, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, tasks)
        self.scale = nn.Parameter(torch.tensor(10.0))

    def forward(self, user: Tensor, cand: Tensor, feats: Tensor, valid: Tensor) -> Tensor:
        tokens = torch.cat([self.user_in(user), self.item_in(torch.cat([cand, feats], dim=-1))], dim=1)
        keep = torch.cat([torch.ones_like(valid[:, :1]).expand(-1, user.shape[1]), valid], dim=1)
        mask = keep[:, None, None, :]
        for block in self.blocks:
            tokens = block(tokens, mask)
        h = self.norm(tokens[:, user.shape[1]:])
        return self.head(h) + self.scale * torch.bmm(cand, user.transpose(1, 2))  # [B, K, T]
