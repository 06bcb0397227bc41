"""The sequential user tower: a causal transformer over the user's ordered history -> T user embeddings.

A drop-in for `UserTower` (silverrec/retrieval/user_tower.py): the same forward contract,
(values int64 [nnz], lengths int32 [F * B], dense float32 [B, Fd]) -> float32 [B, T, D] unit rows,
and the same request encoding (`UserFeatureSpec` keys, `FeatureEncoder`). It reads

    hist_item   the user's last `history_len` pool rows, oldest first (the KJT keeps their order)
    user_<g>    the user's categorical features, mean-pooled
    dense       log1p(history length) and the standardised numeric user features

and skips recent_item and hist_<f>: the history items' categorical features are needed per
position, which the bag encoding does not give, so the tower holds every pool row's feature codes
and looks them up by row. The forward:

    rows int64 [B, L] (L = history_len, left-padded: the newest item at position L - 1)
      -> item embedding + the mean embedding of each item feature's values + learned position
         (counted from the oldest item of the window)
      -> `layers` pre-LN blocks over a causal mask, padded keys masked (attention.PreLNBlock)
      -> LayerNorm -> the last position's state [B, M]
      -> concat the user-feature embeddings and dense -> linear -> T heads -> L2-normalised [B, T, D]

Training (publish/train.py) reads every position (`position_embeddings`): position j's state,
having seen items <= j, predicts item j + 1. A padded query attends to itself alone (no row of the
mask is empty, so no NaN) and no valid query attends to a padded key: padding never changes a valid
position's state. No host synchronisation: the padded rows come from a gather over the lengths'
cumulative sum.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from silverrec.attention import PreLNBlock
from silverrec.retrieval.user_tower import UserFeatureSpec, _csr


ITEM_TABLES = ("own", "shared", "tower")


@dataclass
class SequenceConfig:
    """The sequential tower's shape (train.toml's [sequence] table).

    model_dim: transformer width M; layers, heads: pre-LN blocks and attention heads (one block by
    default: on MovieLens its retrieval measured level with two blocks' and its final list within
    the seeds' spread, docs/recommendation.md; a request pays for one block's last query alone,
    where a second block needs the first over every position); ffn: the
    blocks' hidden width (0 = 4 * model_dim); dropout: on the inputs and residual branches, in
    training only; feature_dim: width of each user-feature embedding; item_table: where a history
    item's input vector comes from: "tower" (the default: the item tower's output, the candidate
    side's own vector, so that an item trained only as a target is a known input; the item tower's
    output width `dim` must then be model_dim, and its features come with it), "own" (the tower's
    item-id table + its feature embeddings) or "shared" (the same, the id table trained as one with
    the item tower's, whose width must then be model_dim). "tower" is the default because it
    measured well ahead of "own" on both development data sets and kept improving for twice the
    steps before it overfitted (docs/recommendation.md). The snapshot holds one input vector per
    item either way (`fold_item_features`; "tower": the item tower's outputs, written at training's
    end), so a request costs the same.
    """

    model_dim: int = 64
    layers: int = 1
    heads: int = 2
    ffn: int = 0
    dropout: float = 0.2
    feature_dim: int = 16
    item_table: str = "tower"

    def __post_init__(self):
        for name in ("model_dim", "layers", "heads", "feature_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"sequence.{name} must be a positive int, got {v!r}")
        if isinstance(self.ffn, bool) or not isinstance(self.ffn, int) or self.ffn < 0:
            raise ValueError(f"sequence.ffn must be an int >= 0 (0 = 4 * model_dim), got {self.ffn!r}")
        if self.model_dim % self.heads:
            raise ValueError(f"sequence.model_dim {self.model_dim} is not divisible by sequence.heads {self.heads}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"sequence.dropout must be in [0, 1), got {self.dropout!r}")
        if self.item_table not in ITEM_TABLES:
            raise ValueError(f"sequence.item_table must be one of {ITEM_TABLES}, got {self.item_table!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def item_feature_codes(spec: UserFeatureSpec, item_features: Mapping[str, Sequence[Sequence[str]]]
                       ) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Every pool row's item-feature values as one padded table: (codes int64 [N, K], weights float32
    [N, K], table offsets per feature). Feature f's value code c is row `offsets[f] + c` of one shared
    table (c = 0: unknown value); a row's entries of feature f weigh 1 / (its count of f's values), so
    that the weighted sum is the sum over features of each feature's mean embedding; padding weighs 0."""
    n = spec.num_items
    blocks_c, blocks_w, offsets, base = [], [], [], 0
    for f, vocab in spec.item_vocabs.items():
        if len(item_features[f]) != n:
            raise ValueError(f"item feature {f!r} has {len(item_features[f])} rows, the pool {n}")
        off, codes = _csr(item_features[f], vocab)
        counts = np.diff(off)
        width = max(1, int(counts.max()) if n else 1)
        c = np.zeros((n, width), dtype=np.int64)
        w = np.zeros((n, width), dtype=np.float32)
        row = np.repeat(np.arange(n), counts)
        col = np.arange(codes.size) - np.repeat(off[:-1], counts)
        c[row, col] = codes + base
        w[row, col] = 1.0 / counts[row]
        blocks_c.append(c)
        blocks_w.append(w)
        offsets.append(base)
        base += len(vocab) + 1
    if not blocks_c:
        return np.zeros((n, 0), dtype=np.int64), np.zeros((n, 0), dtype=np.float32), []
    return np.concatenate(blocks_c, axis=1), np.concatenate(blocks_w, axis=1), offsets


class SequenceUserTower(nn.Module):
    """KJT of user features + dense -> user embeddings float32 [B, T, D], unit length (module docstring).

    Args:
        spec: the request encoding (history_len is the sequence length L).
        dim, tasks: D and T, as `UserTower`'s.
        item_features: feature name -> per pool row its values (every feature of spec.item_vocabs).
        config: `SequenceConfig`.
    """

    script_directly = True  # TorchScript as it is (publish/rec.py `scriptable_tower`): no TorchRec modules

    def __init__(self, spec: UserFeatureSpec, dim: int, tasks: int,
                 item_features: Optional[Mapping[str, Sequence[Sequence[str]]]] = None,
                 config: Optional[SequenceConfig] = None):
        super().__init__()
        cfg = config if config is not None else SequenceConfig()
        m, length = cfg.model_dim, spec.history_len
        self.tasks, self.dim, self.length = int(tasks), int(dim), int(length)
        self.num_items = int(spec.num_items)
        self.items = nn.Embedding(spec.num_items, m)
        self.positions = nn.Parameter(torch.zeros(length, m))
        missing = [f for f in spec.item_vocabs if f not in (item_features or {})]
        if missing:
            raise ValueError(f"item feature {missing[0]!r} of the user tower is missing from the item table")
        codes, weights, _ = item_feature_codes(spec, item_features or {})
        if cfg.item_table == "tower":  # the item tower's outputs carry the features
            codes, weights = codes[:, :0], weights[:, :0]
        self.has_features: bool = codes.shape[1] > 0
        self.features = nn.Embedding(max(1, sum(len(v) + 1 for v in spec.item_vocabs.values())), m)
        self.register_buffer("feature_codes", torch.from_numpy(codes))
        self.register_buffer("feature_weights", torch.from_numpy(weights))
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(PreLNBlock(m, cfg.heads, cfg.ffn or 4 * m, cfg.dropout) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(m)
        self.user_tables = nn.ModuleList(nn.Embedding(len(v) + 1, cfg.feature_dim) for v in spec.user_vocabs.values())
        self.first_user_key = 2 + len(spec.item_vocabs)  # hist_item, recent_item, hist_<f>..., user_<g>...
        self.out = nn.Linear(m + cfg.feature_dim * len(spec.user_vocabs) + spec.dense_dim, tasks * dim)
        self.register_buffer("steps", torch.arange(length, dtype=torch.int64))
        self.register_buffer("causal", torch.ones(length, length, dtype=torch.bool).tril())
        self.register_buffer("diagonal", torch.eye(length, dtype=torch.bool))
        for table in (self.items, self.features):
            nn.init.normal_(table.weight, std=0.02)
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor) -> Tensor:
        """values int64 [nnz], lengths int32 [F * B] (key-major), dense float32 [B, Fd] -> float32 [B, T, D]."""
        batch = dense.shape[0]
        rows, valid = self.history(values, lengths, batch)
        state = self.states(rows, valid, True)[:, -1]  # [B, M]
        return self.head(state, self.user_features(values, lengths, batch, self.first_user_key), dense)

    def history(self, values: Tensor, lengths: Tensor, batch: int) -> tuple[Tensor, Tensor]:
        """The hist_item key (the first) as left-padded rows int64 [B, L] (0 at padding) and valid
        bool [B, L]: position j of request b holds its item L - 1 - j steps before the newest."""
        n = lengths[:batch].to(torch.int64)
        ends = torch.cumsum(n, 0)  # request b's items are values[ends[b] - n[b]:ends[b]]
        idx = ends[:, None] - self.length + self.steps[None, :]  # [B, L]
        valid = idx >= (ends - n)[:, None]
        # one leading 0 so that every index is in range, an empty batch of histories included
        padded = torch.cat([values.new_zeros(1), values])
        return torch.where(valid, padded[(idx + 1).clamp_min(0)], 0), valid

    def item_inputs(self, rows: Tensor) -> Tensor:
        """rows int64 [..., ] -> float [..., M]: the item embedding plus its features' mean embeddings."""
        x = self.items(rows)
        if self.has_features:
            w = self.feature_weights[rows].unsqueeze(-1)
            x = x + (self.features(self.feature_codes[rows]) * w).sum(-2)
        return x

    def states(self, rows: Tensor, valid: Tensor, last: bool = False, inputs: Optional[Tensor] = None) -> Tensor:
        """rows int64 [B, W], valid bool [B, W], left-padded windows of W <= L positions -> the final
        LayerNorm's states float [B, W, M] ([B, 1, M], the last position alone, with `last`). Positions
        count from the window's oldest item (0), so that a training window that starts at a history's
        first item gives position j the forward's answer for the history's first j + 1 items. `inputs`
        float [B, W, M]: the items' input vectors in place of `item_inputs(rows)` (training with
        item_table "tower")."""
        w = rows.shape[1]
        order = (torch.cumsum(valid.to(torch.int64), 1) - 1).clamp_min(0)  # 0 = the window's oldest item
        items = self.item_inputs(rows) if inputs is None else inputs
        x = (items + self.positions[order]) * valid.unsqueeze(-1).to(self.positions.dtype)
        x = self.dropout(x)
        mask = (self.causal[:w, :w] & (valid[:, None, :] | self.diagonal[:w, :w])).unsqueeze(1)  # [B, 1, W, W]
        final = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            x = block(x, mask, last and i == final)
        return self.norm(x)

    def user_features(self, values: Tensor, lengths: Tensor, batch: int, first_key: int) -> Tensor:
        """float [B, G * feature_dim]: the mean embedding of each user_<g> key, keys g at
        first_key + g of the KJT (values, lengths). Each table pools every key's bags (offsets from 0,
        no slicing of values: no host synchronisation) and keeps its own key's rows."""
        out = [torch.zeros(batch, 0, dtype=self.out.weight.dtype, device=values.device)]
        if len(self.user_tables) > 0:
            offsets = torch.cat([lengths.new_zeros(1).to(torch.int64), torch.cumsum(lengths.to(torch.int64), 0)])
            for g, table in enumerate(self.user_tables):
                codes = values.clamp(0, table.weight.shape[0] - 1)
                bags = F.embedding_bag(codes, table.weight, offsets, mode="mean", include_last_offset=True)
                key = first_key + g
                out.append(bags[key * batch:(key + 1) * batch])
        return torch.cat(out, dim=1)

    def head(self, state: Tensor, user: Tensor, dense: Tensor) -> Tensor:
        """state [..., M], user features [..., P], dense [..., Fd] -> unit user embeddings float32 [..., T, D]."""
        x = torch.cat([state, user.to(state.dtype), dense.to(state.dtype)], dim=-1)
        u = self.out(x).unflatten(-1, [self.tasks, self.dim]).float()
        return F.normalize(u, dim=-1)

    def position_embeddings(self, rows: Tensor, valid: Tensor, user: Tensor, dense: Tensor,
                            inputs: Optional[Tensor] = None) -> Tensor:
        """Every position's user embeddings (training): rows int64 [B, L], valid bool [B, L], user
        features [B, P] (`user_features`), dense float32 [B, L, Fd] (each position's own), `inputs` as
        `states` -> float32 [B, L, T, D]; position j's embedding is the forward's answer for the history
        ending at j."""
        h = self.states(rows, valid, inputs=inputs)
        return self.head(h, user[:, None, :].expand(-1, h.shape[1], -1), dense)

    @torch.no_grad()
    def permute_items(self, perm: Tensor) -> None:
        """Reorder every per-item table so that row r holds pool row perm[r] (the snapshot's canonical order)."""
        self.items.weight.copy_(self.items.weight[perm])
        self.feature_codes = self.feature_codes[perm]
        self.feature_weights = self.feature_weights[perm]

    @torch.no_grad()
    def fold_item_features(self) -> "SequenceUserTower":
        """Add each row's feature embeddings into its item embedding, once (at publish): the same
        inputs, one lookup per position instead of 1 + K."""
        if self.has_features:
            rows = torch.arange(self.num_items, device=self.items.weight.device)
            self.items.weight.copy_(self.item_inputs(rows))
            self.has_features = False
            self.feature_codes = self.feature_codes[:, :0]
            self.feature_weights = self.feature_weights[:, :0]
            self.features = nn.Embedding(1, self.items.weight.shape[1])
        return self
