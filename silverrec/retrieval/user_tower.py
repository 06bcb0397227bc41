"""The user tower: request features -> T user embeddings in the item space (one per task).

The request is a TorchRec `KeyedJaggedTensor` of sparse user features, passed to the forward as its
two flat tensors (`values int64 [nnz]`, `lengths int32 [B * F]`, key-major as KJT stores them) plus
dense features `float32 [B, Fd]`. The keys, in order (`UserFeatureSpec.keys`):

    hist_item            pool rows of the user's last `history_len` items   (table "item")
    recent_item          pool rows of the last `recent_len` items           (table "item", shared)
    hist_<f>             value codes of feature f of the last history items (table "item_<f>")
    user_<g>             value codes of the user's categorical feature g    (table "user_<g>")

Value code 0 of every feature table is "unknown value" (a value not seen at training time).
Dense features: log1p(history length) and each numeric user feature standardised with the
training mean and standard deviation.

`FeatureEncoder` builds those tensors on the host from item rows and user features (numpy,
vectorised over items); `UserTower` is the nn.Module that lives in the snapshot (EBC with mean
pooling -> MLP -> T task heads, L2-normalised so that scores are cosine similarities).
"""


from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from silverrec.errors import QueryError


@dataclass
class UserFeatureSpec:
    """What the user tower reads; recorded in the manifest, so the predictor can encode requests.

    num_items: pool size (rows of the shared item table).
    item_vocabs / user_vocabs: feature name -> its values; code = position + 1 (0 = unknown).
    user_numeric: feature name -> (mean, std) of the training users.
    """

    num_items: int
    history_len: int = 50
    recent_len: int = 5
    item_vocabs: dict[str, list[str]] = field(default_factory=dict)
    user_vocabs: dict[str, list[str]] = field(default_factory=dict)
    user_numeric: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self):
        if self.num_items <= 0:
            raise ValueError(f"num_items must be positive, got {self.num_items}")
        if not 1 <= self.recent_len <= self.history_len:
            raise ValueError(f"need 1 <= recent_len <= history_len, got {self.recent_len}, {self.history_len}")
        self.user_numeric = {k: (float(v[0]), float(v[1])) for k, v in self.user_numeric.items()}

    @property
    def keys(self) -> list[str]:
        return (["hist_item", "recent_item"] + [f"hist_{f}" for f in self.item_vocabs]
                + [f"user_{g}" for g in self.user_vocabs])

    @property
    def dense_dim(self) -> int:
        return 1 + len(self.user_numeric)

    def to_json(self) -> dict[str, Any]:
        """JSON-able; features as [name, ...] pairs because their order is the KJT key order (a
        manifest written with sorted keys must not reorder them)."""
        d = asdict(self)
        for key in ("item_vocabs", "user_vocabs", "user_numeric"):
            d[key] = [[name, value] for name, value in d[key].items()]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "UserFeatureSpec":
        d = dict(d)
        for key in ("item_vocabs", "user_vocabs", "user_numeric"):
            if isinstance(d.get(key), list):
                d[key] = {name: value for name, value in d[key]}
        return cls(**d)


def _csr(lists: Sequence[Sequence[str]], vocab: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per-item value lists -> (offsets int64 [N + 1], codes int64 [nnz]) with code = vocab position + 1."""
    index = {v: i + 1 for i, v in enumerate(vocab)}
    codes = [index.get(v, 0) for vals in lists for v in vals]
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum([len(v) for v in lists], out=offsets[1:])
    return offsets, np.asarray(codes, dtype=np.int64)


def gather_csr(offsets: np.ndarray, codes: np.ndarray, rows: np.ndarray,
               bounds: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """The CSR entries of `rows`, concatenated in row order: (codes int64 [sum counts], counts int64
    [len(rows)]); with `bounds` int64 [G + 1] (groups of consecutive rows), the counts per group
    int64 [G] instead."""
    starts = offsets[rows]
    csum = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(offsets[rows + 1] - starts, out=csum[1:])
    counts = np.diff(csum) if bounds is None else csum[bounds[1:]] - csum[bounds[:-1]]
    return codes[np.repeat(starts - csum[:-1], np.diff(csum)) + np.arange(csum[-1])], counts


class FeatureEncoder:
    """Host-side request encoding: histories (pool rows) and user features -> the tower's inputs.

    item_features: feature name -> per pool row its values (the features in `spec.item_vocabs`).
    """

    def __init__(self, spec: UserFeatureSpec, item_features: Mapping[str, Sequence[Sequence[str]]]):
        missing = [f for f in spec.item_vocabs if f not in item_features]
        if missing:
            raise ValueError(f"item feature {missing[0]!r} of the user tower is missing from the item table")
        self._setup(spec, {f: _csr(item_features[f], spec.item_vocabs[f]) for f in spec.item_vocabs})

    @classmethod
    def from_arrays(cls, spec: UserFeatureSpec, csr: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> "FeatureEncoder":
        """From stored CSR arrays (the snapshot's side file) instead of value lists."""
        enc = cls.__new__(cls)
        enc._setup(spec, csr)
        return enc

    def _setup(self, spec: UserFeatureSpec, csr: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.spec = spec
        self.item_csr = {f: (np.asarray(o), np.asarray(c)) for f, (o, c) in csr.items()}
        self.user_index = {g: {v: i + 1 for i, v in enumerate(vocab)} for g, vocab in spec.user_vocabs.items()}

    def encode(
        self,
        histories: Sequence[np.ndarray],
        user_features: Optional[Sequence[Mapping[str, Any]]] = None,
        user_numeric: Optional[Sequence[Mapping[str, float]]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """histories: per user, pool rows int64 oldest first (any length; the last history_len are
        used) -> (values int64 [nnz], lengths int32 [F * B], dense float32 [B, Fd])."""
        spec, B = self.spec, len(histories)
        hist = [np.asarray(h, dtype=np.int64)[-spec.history_len:] for h in histories]
        flat = np.concatenate(hist) if B else np.zeros(0, np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= spec.num_items):
            for b, h in enumerate(hist):
                bad = h[(h < 0) | (h >= spec.num_items)]
                if bad.size:
                    raise QueryError(f"history {b} holds item row {int(bad[0])}, outside the pool's [0, {spec.num_items})")
        recent = [h[-spec.recent_len:] for h in hist]
        values: list[np.ndarray] = [flat, *recent]
        sizes = np.asarray([h.size for h in hist], dtype=np.int64)
        lengths: list[np.ndarray] = [sizes, np.minimum(sizes, spec.recent_len)]
        bounds = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(sizes, out=bounds[1:])
        for f in spec.item_vocabs:
            codes, counts = gather_csr(*self.item_csr[f], flat, bounds)
            values.append(codes)
            lengths.append(counts)
        user_values, user_lengths, dense = self.user_part([len(h) for h in histories], user_features, user_numeric)
        vals = np.concatenate(values + user_values) if values else np.zeros(0, np.int64)
        return (torch.from_numpy(vals.astype(np.int64, copy=False)),
                torch.from_numpy(np.concatenate(lengths + user_lengths).astype(np.int32)),
                torch.from_numpy(dense))

    def user_part(self, history_sizes: Sequence[int], user_features: Optional[Sequence[Mapping[str, Any]]] = None,
                  user_numeric: Optional[Sequence[Mapping[str, float]]] = None
                  ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """The keys and dense columns after the item keys: (user-feature values, their lengths: int64
        arrays, key after key; dense float32 [B, Fd]: log1p of each full history's size, then the
        standardised numeric features). `history_sizes`: each request's history length."""
        spec, B = self.spec, len(history_sizes)
        values: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        feats = list(user_features) if user_features is not None else [{}] * B
        if len(feats) != B:
            raise QueryError(f"got user features for {len(feats)} users, {B} histories")
        for g, index in self.user_index.items():
            for b in range(B):
                raw = feats[b].get(g, [])
                vals = [raw] if isinstance(raw, str) else list(raw)
                codes = np.asarray([index.get(str(v), 0) for v in vals], dtype=np.int64)
                values.append(codes)
                lengths.append(np.asarray([codes.size]))
        unknown = {k for f in feats for k in f} - set(self.user_index)
        if unknown:
            raise QueryError(f"unknown user feature {sorted(unknown)[0]!r}: the user tower reads {sorted(self.user_index) or 'none'}")
        dense = np.zeros((B, spec.dense_dim), dtype=np.float32)
        dense[:, 0] = np.log1p(history_sizes)
        nums = list(user_numeric) if user_numeric is not None else [{}] * B
        for j, (g, (mean, std)) in enumerate(spec.user_numeric.items(), start=1):
            for b in range(B):
                x = nums[b].get(g)
                dense[b, j] = 0.0 if x is None else (float(x) - mean) / std
        return values, lengths, dense


def tower_head(mlp: nn.Module, heads: nn.Linear, tasks: int, dim: int, pooled: torch.Tensor,
               dense: torch.Tensor) -> torch.Tensor:
    """The user tower after its tables: pooled float [B, P] + dense float32 [B, Fd] -> MLP -> T
    heads -> unit user embeddings float32 [B, T, D] (the MLP may be bf16)."""
    x = torch.cat([pooled.float(), dense.float()], dim=1).to(heads.weight.dtype)
    u = heads(mlp(x)).reshape(-1, tasks, dim).float()
    return torch.nn.functional.normalize(u, dim=-1)


@torch.fx.wrap  # a leaf of torchrec's fx trace (the TorchScript path): its branch runs per call
def _tbe_inputs(values: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The TBE's index dtypes, as torchrec's `_fx_trec_unwrap_kjt` makes them: on the CPU int32 or
    int64 with offsets of the indices' dtype; on a GPU int32 only."""
    if values.device.type == "cpu":
        return values, offsets.to(values.dtype)
    return values.int(), offsets.int()


class DirectTBEUserTower(nn.Module):
    """A `UserTower` whose tables torchrec quantised into one fbgemm TBE, serving without the KJT.

    torchrec's quantised EmbeddingBagCollection wraps its TBE in KeyedJaggedTensor bookkeeping
    (permute to the tables' feature order, split per TBE, offsets, KeyedTensor): with one TBE and
    the request's keys already in its feature order (what `FeatureEncoder` writes) all of it is the
    identity, yet it made the MovieLens snapshot's frozen TorchScript forward 2,665 graph nodes (161
    without it). This calls the same TBE on (values, offsets) directly, then the same MLP and heads:
    bit-equal user embeddings (tests/test_rec_model.py), 22.8 against 40.6 us per batch-1 tower call
    (MovieLens, 1 thread, TorchScript). `direct_tower` builds it where those conditions hold."""

    def __init__(self, tower: "UserTower") -> None:
        super().__init__()
        # the TBE is called the way torchrec's own forward calls it: `_emb_modules` is a plain list, so
        # torch.export sees no module holding the TBE's TorchScript objects (its counters)
        self.ebc = tower.ebc
        self.mlp, self.heads = tower.mlp, tower.heads
        self.keys: list[str] = list(tower.keys)
        self.tasks, self.dim = tower.tasks, tower.dim
        # The bounds check as a pure function of the request (`in_bounds`) instead of fbgemm's, which writes the
        # indices and a warning counter in place: AOTInductor cannot compile a write into a tensor the program
        # holds as a constant. The TBE then checks nothing itself.
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

        tbe = self.ebc._emb_modules[0]
        self.register_buffer("rows_per_key", tbe.rows_per_table.clone())  # int64 [F]
        tbe.bounds_check_mode_int = BoundsCheckMode.NONE.value

    def in_bounds(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """values with each index outside its key's table [0, rows) replaced by 0, as fbgemm's WARNING bounds check
        does (values [nnz], lengths [F * B] key-major)."""
        rows = torch.repeat_interleave(self.rows_per_key.repeat_interleave(lengths.shape[0] // self.rows_per_key.shape[0]),
                                       lengths.long(), output_size=values.shape[0])
        return torch.where((values >= 0) & (values < rows), values, torch.zeros_like(values))

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """values int64 [nnz], lengths int32 [F * B] (key-major), dense float32 [B, Fd] -> float32 [B, T, D]."""
        indices, offsets = _tbe_inputs(self.in_bounds(values, lengths),
                                       torch.ops.fbgemm.asynchronous_complete_cumsum(lengths))
        pooled = self.ebc._emb_modules[0].forward(indices=indices, offsets=offsets)
        return tower_head(self.mlp, self.heads, self.tasks, self.dim, pooled, dense)


def direct_tower(tower: nn.Module) -> nn.Module:
    """`tower` as a DirectTBEUserTower when its EmbeddingBagCollection is torchrec's quantised one with
    a single unweighted TBE over the tower's keys in their order; else `tower` unchanged."""
    ebc = getattr(tower, "ebc", None)
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

    if not isinstance(tower, UserTower) or not isinstance(ebc, QuantEBC) or ebc.is_weighted() or ebc.register_tbes:
        return tower
    order = getattr(ebc, "_features_order", None)
    if len(ebc._emb_modules) != 1 or list(ebc._feature_names) != list(tower.keys) or (order and order != sorted(order)):
        return tower
    return DirectTBEUserTower(tower)


def _mlp(sizes: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


class UserTower(nn.Module):
    """KJT of user features + dense -> user embeddings float32 [B, T, D], unit length.

    EmbeddingBagCollection (mean pooling; one table for items shared by hist_item and recent_item,
    one per feature) -> concat with dense -> MLP -> T linear task heads.
    """

    def __init__(self, spec: UserFeatureSpec, dim: int, tasks: int, item_dim: int = 64, feature_dim: int = 16,
                 hidden: Sequence[int] = (256,)):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.modules.embedding_configs import PoolingType

        tables = [EmbeddingBagConfig(name="item", embedding_dim=item_dim, num_embeddings=spec.num_items,
                                     feature_names=["hist_item", "recent_item"], pooling=PoolingType.MEAN)]
        tables += [EmbeddingBagConfig(name=f"item_{f}", embedding_dim=feature_dim, num_embeddings=len(v) + 1,
                                      feature_names=[f"hist_{f}"], pooling=PoolingType.MEAN) for f, v in spec.item_vocabs.items()]
        tables += [EmbeddingBagConfig(name=f"user_{g}", embedding_dim=feature_dim, num_embeddings=len(v) + 1,
                                      feature_names=[f"user_{g}"], pooling=PoolingType.MEAN) for g, v in spec.user_vocabs.items()]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        self.keys: list[str] = spec.keys
        pooled = 2 * item_dim + feature_dim * (len(spec.item_vocabs) + len(spec.user_vocabs))
        self.mlp = _mlp([pooled + spec.dense_dim, *hidden])
        self.heads = nn.Linear(hidden[-1] if hidden else pooled + spec.dense_dim, tasks * dim)
        self.tasks, self.dim = int(tasks), int(dim)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """values int64 [nnz], lengths int32 [F * B] (key-major), dense float32 [B, Fd] -> float32 [B, T, D]."""
        from torchrec import KeyedJaggedTensor

        kjt = KeyedJaggedTensor.from_lengths_sync(self.keys, values, lengths)
        return tower_head(self.mlp, self.heads, self.tasks, self.dim, self.ebc(kjt).values(), dense)
