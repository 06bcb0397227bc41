"""The item tower and the two-tower retrieval loss (sampled softmax with logQ correction).

The item tower runs only at publish time (over the pool, into the embedding cache and the IVF), so
it lives here and not in the snapshot. Item features come from `UserFeatureSpec.item_vocabs` (the
same vocabularies the user tower reads), as CSR buffers indexed by pool row.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from silverrec.publish.logs import Logs
from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec, _csr, _mlp


class ItemTower(nn.Module):
    """Pool rows int64 [n] -> item embeddings float32 [n, D], unit length.

    TorchRec EmbeddingBagCollection over the item id and each categorical feature (mean pooling of
    multi-valued features) -> MLP -> D.
    """

    def __init__(self, spec: UserFeatureSpec, item_features: Mapping[str, Sequence[Sequence[str]]], dim: int,
                 item_dim: int = 64, feature_dim: int = 16, hidden: Sequence[int] = (256,)):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.modules.embedding_configs import PoolingType

        self.features = list(spec.item_vocabs)
        tables = [EmbeddingBagConfig(name="item_id", embedding_dim=item_dim, num_embeddings=spec.num_items,
                                     feature_names=["item_id"], pooling=PoolingType.SUM)]
        tables += [EmbeddingBagConfig(name=f"item_{f}", embedding_dim=feature_dim, num_embeddings=len(v) + 1,
                                      feature_names=[f"item_{f}"], pooling=PoolingType.MEAN) for f, v in spec.item_vocabs.items()]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        for i, f in enumerate(self.features):
            offsets, codes = _csr(item_features[f], spec.item_vocabs[f])
            self.register_buffer(f"offsets_{i}", torch.from_numpy(offsets))
            self.register_buffer(f"codes_{i}", torch.from_numpy(codes))
        width = item_dim + feature_dim * len(self.features)
        self.mlp = _mlp([width, *hidden])
        self.out = nn.Linear(hidden[-1] if hidden else width, dim)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        from torchrec import KeyedJaggedTensor

        n = rows.shape[0]
        values, lengths = [rows], [torch.ones(n, dtype=torch.int64)]
        for i in range(len(self.features)):
            offsets, codes = getattr(self, f"offsets_{i}"), getattr(self, f"codes_{i}")
            starts = offsets[rows]
            counts = offsets[rows + 1] - starts
            base = torch.repeat_interleave(starts - (torch.cumsum(counts, 0) - counts), counts)
            values.append(codes[base + torch.arange(base.shape[0])])
            lengths.append(counts)
        kjt = KeyedJaggedTensor.from_lengths_sync(["item_id"] + [f"item_{f}" for f in self.features],
                                                  torch.cat(values), torch.cat(lengths).to(torch.int32))
        h = self.mlp(self.ebc(kjt).values())
        return torch.nn.functional.normalize(self.out(h), dim=-1)

    @torch.no_grad()
    def embed_all(self, num_items: int, batch: int = 8192, progress=None) -> torch.Tensor:
        """float32 [N, D] embeddings of every pool row, in batches."""
        self.eval()
        out = []
        for start in range(0, num_items, batch):
            out.append(self(torch.arange(start, min(num_items, start + batch))))
            if progress is not None:
                progress.update(out[-1].shape[0])
        return torch.cat(out)


def sampled_softmax_loss(
    user: torch.Tensor,
    targets: torch.Tensor,
    item_tower: ItemTower,
    log_q: torch.Tensor,
    num_uniform: Optional[int],
    temperature: float,
    weights: torch.Tensor,
    generator: torch.Generator,
    in_batch: Optional[int] = None,
) -> torch.Tensor:
    """Sampled softmax over in-batch + uniform negatives with logQ correction (Yi et al., RecSys 2019).

    user float32 [B, T, D]; targets int64 [B] pool rows; log_q float32 [N]: log of each item's share
    of the training targets; weights float32 [B, T]: 1 where the example is a positive of task t.
    The negatives, shared by every example: the targets of `in_batch` examples drawn without
    replacement (None or >= B: all of them) and `num_uniform` uniform draws, or with `num_uniform`
    None every item once (with in_batch 0: the full softmax). Every logit is
    <u, v_j> / temperature - log Q(j), Q(j) = K * share(j) + R / N the expected count of item j in
    the negatives (K in-batch draws by target frequency, R uniform; every item once: R / N = 1); a
    negative equal to the example's own target is masked. The item tower runs once per distinct row.
    Returns the mean cross-entropy of the target against the negatives over (example, task) positives.
    """
    n = log_q.shape[0]
    B = targets.shape[0]
    K = B if in_batch is None else min(int(in_batch), B)
    shared = targets if K == B else targets[torch.randperm(B, generator=generator)[:K]]
    if num_uniform is None:
        uniform, per_item = torch.arange(n), 1.0
    else:
        uniform, per_item = torch.randint(0, n, (num_uniform,), generator=generator), num_uniform / n
    cands = torch.cat([shared, uniform])
    rows, where = torch.unique(torch.cat([targets, cands]), return_inverse=True)
    v = item_tower(rows)  # [distinct rows, D]
    log_count = torch.log(K * log_q.exp() + per_item)  # log Q [N]
    pos = torch.einsum("btd,bd->bt", user, v[where[:B]]) / temperature - log_count[targets][:, None]  # [B, T]
    neg = torch.einsum("btd,cd->btc", user, v[where[B:]]) / temperature - log_count[cands][None, None, :]
    neg = neg.masked_fill((cands[None, :] == targets[:, None])[:, None, :], float("-inf"))
    logits = torch.cat([pos[:, :, None], neg], dim=2)  # the target at 0
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.int64),
                                           reduction="none")
    w = weights.reshape(-1)
    return (ce * w).sum() / w.sum().clamp_min(1.0)


LOGITS_BLOCK = 1 << 24  # most logits `full_softmax_loss` forms at once (64 MB in float32, before its gradient)


def full_softmax_loss(user: torch.Tensor, targets: torch.Tensor, items: torch.Tensor, temperature: float,
                      weights: torch.Tensor, chunk: Optional[int] = None) -> torch.Tensor:
    """Softmax cross-entropy over every item of the pool (no sampling, so no logQ correction).

    user float32 [B, T, D]; targets int64 [B] pool rows; items float32 [N, D]: every pool row's
    embedding (the item tower over the whole pool, once per step); weights float32 [B, T] as
    `sampled_softmax_loss`'s. The logits <u, v_j> / temperature are formed `chunk` (example, task)
    pairs at a time (a [chunk, N] block; default LOGITS_BLOCK // N), so that memory stays bounded on
    a large catalogue. Returns the mean cross-entropy over (example, task) positives.
    """
    D = user.shape[-1]
    # the (example, task) pairs that count, as rows of one [P, D] x [D, N] product (an einsum over
    # the task axis runs far slower on CPU); a pair of weight 0 costs nothing
    w = weights.reshape(-1)
    keep = torch.nonzero(w).squeeze(1)
    rows, t, w = user.reshape(-1, D)[keep], targets[keep // user.shape[1]], w[keep]
    total = user.new_zeros(())
    chunk = chunk or max(1, LOGITS_BLOCK // items.shape[0])
    for s in range(0, rows.shape[0], chunk):
        logits = (rows[s:s + chunk] / temperature) @ items.T  # [p, N]
        ce = torch.nn.functional.cross_entropy(logits, t[s:s + chunk], reduction="none")
        total = total + (ce * w[s:s + chunk]).sum()
    return total / weights.sum().clamp_min(1.0)


def target_log_q(target_rows: np.ndarray, num_items: int) -> torch.Tensor:
    """float32 [N]: log of each item's share of the training targets (add-one smoothed)."""
    counts = np.bincount(target_rows, minlength=num_items).astype(np.float64) + 1.0
    return torch.from_numpy(np.log(counts / counts.sum()).astype(np.float32))


def user_side(logs: Logs, users: np.ndarray) -> tuple[list[dict], list[dict]]:
    """Per user index: its categorical and numeric features as the encoder takes them."""
    cats = [{g: lists[u] for g, lists in logs.user_features.items()} for u in users]
    nums = [{g: float(x[u]) for g, x in logs.user_numeric.items()} for u in users]
    return cats, nums


def user_embeddings(user: nn.Module, encoder: FeatureEncoder, logs: Logs, users: np.ndarray,
                    histories: list[np.ndarray], batch: int = 512) -> torch.Tensor:
    """Either user tower's embeddings of `users` (indices into logs) with these histories: float32
    [len(users), T, D], in batches of `batch`."""
    out = []
    for s in range(0, len(users), batch):
        sl = slice(s, s + batch)
        out.append(user(*encoder.encode(histories[sl], *user_side(logs, users[sl]))))
    return torch.cat(out)
