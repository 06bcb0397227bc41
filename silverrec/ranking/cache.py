"""The embedding cache: item embeddings and dense item features by canonical row, in the model.

The ranking stage receives candidate rows (int64 indexes into the pool's row space [0, N), -1 =
padding) from retrieval and needs, per candidate, its embedding (for the exact re-score and the
OverArch) and its dense features (for the OverArch and the value model). Both live here as
buffers, so the lookup is one gather inside the forward and travels with the snapshot.

Storage (measured by `bytes_per_item`):
    emb    bfloat16 [N, D]   2 * D bytes per item (half of float32; re-scores agree with float32
                             dot products to bf16 rounding, about 3 significant digits)
    feats  uint8    [N, F]   when every feature value is 0 or 1 (flags, one-hots): 1 byte each, exact
           bfloat16 [N, F]   otherwise: 2 bytes each, values rounded to bf16 (8 mantissa bits:
                             a count of 1000 may read back as 1000 or 1004 - pass
                             feats_dtype="float32" where features need more precision)
    feature_names  List[str] (length F) - the names the value model refers to
    ranker float32  [N, E]   the OverArch's item side (`item_side`), computed once per item by the
                             model that owns the OverArch (`with_ranker`); E = 0 without one.
                             float32 by default: on this CPU (AVX2, no native bf16 arithmetic)
                             the gather + bf16 -> float32 conversion of the candidates' rows costs
                             more than gathering float32 rows, for 2 * E more bytes per item (E = 192 for
                             MovieLens' MoL: 384 B). `with_ranker(..., dtype=torch.bfloat16)` halves
                             it where memory matters more (and on accelerators with bf16 math).

Example:
    >>> cache = EmbeddingCache(torch.randn(1000, 64), torch.rand(1000, 3), ["age", "price", "ctr"])
    >>> rows = torch.tensor([[3, 17, -1]])                       # [B=1, K=3], -1 = padding
    >>> emb, feats = cache.gather(rows)                          # [1, 3, 64], [1, 3, 3]; zeros at -1
    >>> scores = cache.rescore(torch.randn(1, 2, 64), rows)      # [1, 3, 2]; -inf at -1
"""


import copy
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from silverrec.errors import PoolError

FEATS_DTYPES = ("auto", "bfloat16", "uint8", "float32")


class EmbeddingCache(nn.Module):
    """bf16 item embeddings and dense item features, looked up by canonical row.

    Args:
        emb: float [N, D] item embeddings by row (N >= 1, finite); stored as bfloat16.
        feats: float [N, F] dense item features by row (finite), or None for F = 0.
        feature_names: F distinct names, in column order of `feats`.
        feats_dtype: "auto" (uint8 when every value is 0 or 1, else bfloat16), "bfloat16",
            "uint8" (refused unless every value is 0 or 1) or "float32".

    Buffers:
        emb   bfloat16 [N, D]
        feats uint8 | bfloat16 | float32 [N, F]
    """

    feature_names: List[str]

    def __init__(
        self,
        emb: Tensor,
        feats: Optional[Tensor] = None,
        feature_names: Optional[Sequence[str]] = None,
        feats_dtype: str = "auto",
    ) -> None:
        super().__init__()
        if not isinstance(emb, Tensor) or emb.dim() != 2 or not emb.is_floating_point():
            raise PoolError(f"cache embeddings must be a float tensor [N, D], got {_describe(emb)}")
        n, d = emb.shape
        if n == 0 or d == 0:
            raise PoolError(f"cache embeddings must be non-empty, got shape {tuple(emb.shape)}")
        _check_finite(emb, "embedding")
        if feats is None:
            feats = torch.zeros(n, 0, device=emb.device)
        if not isinstance(feats, Tensor) or feats.dim() != 2 or feats.shape[0] != n:
            raise PoolError(f"cache features must be a tensor [N={n}, F], got {_describe(feats)}")
        feats = feats.float()
        _check_finite(feats, "feature")
        names = [] if feature_names is None else list(feature_names)
        if len(names) != feats.shape[1]:
            raise PoolError(f"{feats.shape[1]} feature columns but {len(names)} feature names")
        for i, name in enumerate(names):
            if not isinstance(name, str) or not name:
                raise PoolError(f"feature name {i} must be a non-empty string, got {name!r}")
        dupes = sorted({x for x in names if names.count(x) > 1})
        if dupes:
            raise PoolError(f"duplicate feature names: {', '.join(dupes)}")
        if feats_dtype not in FEATS_DTYPES:
            raise PoolError(f"feats_dtype must be one of {', '.join(FEATS_DTYPES)}, got {feats_dtype!r}")
        binary = bool(((feats == 0) | (feats == 1)).all())
        if feats_dtype == "uint8" and not binary:
            bad = int((~((feats == 0) | (feats == 1))).nonzero()[0, 1])
            raise PoolError(f"feats_dtype='uint8' needs 0/1 values; feature {names[bad]!r} has others")
        if feats_dtype == "auto":
            feats_dtype = "uint8" if binary else "bfloat16"
        self.register_buffer("emb", emb.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("feats", feats.detach().to(getattr(torch, feats_dtype)).contiguous())
        self.register_buffer("ranker", torch.zeros(n, 0, dtype=torch.float32, device=emb.device))
        self.feature_names = names

    def with_ranker(self, item_side, dtype: torch.dtype = torch.float32) -> "EmbeddingCache":
        """A cache over the same stored rows (shared tensors) that also holds an OverArch's item side:
        `item_side(emb float32 [n, D], feats float32 [n, F]) -> [n, E]`, run over the stored values
        in chunks and kept as `dtype` (float32 or bfloat16; see the module docstring). This cache
        is left as it is (several models may share it)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise PoolError(f"ranker dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        out = copy.copy(self)
        out._buffers = dict(self._buffers)
        with torch.no_grad():
            parts = [item_side(self.emb[i : i + 65536].float(), self.feats[i : i + 65536].float()).float()
                     for i in range(0, self.num_items, 65536)]
        out.ranker = torch.cat(parts).to(dtype).contiguous()
        return out

    @property
    def num_items(self) -> int:
        return int(self.emb.shape[0])

    @property
    def dim(self) -> int:
        return int(self.emb.shape[1])

    def bytes_per_item(self) -> int:
        """Bytes the cache stores per item: D * 2 (bf16) + F * (1 for uint8 | 2 for bf16 | 4) + E * (4 | 2)."""
        return int(sum(t.shape[1] * t.element_size() for t in (self.emb, self.feats, self.ranker)))

    @torch.jit.export
    def embeddings(self, rows: Tensor) -> Tensor:
        """rows int64 [B, K] (-1 = padding) -> float32 [B, K, D]; padding reads row 0 (the caller
        masks what it computes from it)."""
        return _take(self.emb, rows).float()

    @torch.jit.export
    def features(self, rows: Tensor) -> Tensor:
        """rows int64 [B, K] (-1 = padding) -> float32 [B, K, F] item features; padding reads row 0."""
        return _take(self.feats, rows).float()

    @torch.jit.export
    def item_sides(self, rows: Tensor) -> Tensor:
        """rows int64 [B, K] (-1 = padding) -> the OverArch's item side [B, K, E] in its stored dtype
        (`with_ranker`); padding reads row 0."""
        return _take(self.ranker, rows)

    @torch.jit.export
    def gather(self, rows: Tensor) -> Tuple[Tensor, Tensor]:
        """Look up candidates.

        Args:
            rows: int64 [B, K] canonical rows, -1 = padding.
        Returns:
            emb   float32 [B, K, D]  (zeros at padding)
            feats float32 [B, K, F]  (zeros at padding)
        """
        flat = rows.clamp(min=0).reshape(-1)
        # the embeddings: one bag per row, weighted 1 (a row) or 0 (padding), so that one kernel
        # gathers and zeroes (index_select + float + masked_fill_ is slower: its mask pass costs
        # more than the gather)
        keep = (rows >= 0).reshape(-1).to(self.emb.dtype)
        bags = torch.arange(flat.shape[0], device=rows.device)
        emb = F.embedding_bag(flat, self.emb, bags, mode="sum", per_sample_weights=keep).float()
        emb = emb.reshape(rows.shape[0], rows.shape[1], self.emb.shape[1])
        # the features (uint8 tables have no embedding_bag): zeroed in place on the fresh copy
        feats = _take(self.feats, rows).float().masked_fill_((rows < 0).unsqueeze(-1), 0.0)
        return emb, feats

    @torch.jit.export
    def rescore(self, user: Tensor, rows: Tensor) -> Tensor:
        """Exact dot products of each task's user embedding with the cached candidate embeddings.

        Args:
            user: float32 [B, T, D] one embedding per task.
            rows: int64 [B, K] canonical rows, -1 = padding.
        Returns:
            float32 [B, K, T]: <user[b, t], emb[rows[b, k]]> (float32 arithmetic on the bf16 values);
            -inf at padding.
        """
        valid = (rows >= 0).unsqueeze(-1)
        cand = _take(self.emb, rows).float()  # [B, K, D]
        scores = torch.bmm(cand, user.float().transpose(1, 2))  # [B, K, T]
        return torch.where(valid, scores, float("-inf"))

    @torch.jit.export
    def lookup(self, rows: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The ranking stage's lookups, unmasked: rows int64 [B, K] (-1 = padding) -> emb float32
        [B, K, D], feats float32 [B, K, F], ranker [B, K, E] in its stored dtype; padding reads
        row 0 (the caller masks what it computes from it)."""
        return self.embeddings(rows), self.features(rows), _take(self.ranker, rows)

    def forward(self, user: Tensor, rows: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """Everything the ranking stage needs from the cache: `lookup` and the exact re-score.

        Args:
            user: float32 [B, T, D]; rows: int64 [B, K] (-1 = padding).
        Returns:
            emb float32 [B, K, D], feats float32 [B, K, F], ranker [B, K, E] in its stored dtype (padding
            reads row 0: the caller masks), scores float32 [B, K, T] (exact re-score, -inf at padding).
        """
        emb, feats, ranker = self.lookup(rows)
        scores = torch.bmm(emb, user.float().transpose(1, 2))
        return emb, feats, ranker, torch.where((rows >= 0).unsqueeze(-1), scores, float("-inf"))


def _take(table: Tensor, rows: Tensor) -> Tensor:
    """table[rows.clamp(min=0)] as one index_select over the flattened rows: [B, K] -> [B, K, C]
    (advanced indexing is several times slower for 10k-200k rows)."""
    flat = table.index_select(0, rows.clamp(min=0).reshape(-1))
    return flat.reshape(rows.shape[0], rows.shape[1], table.shape[1])


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _check_finite(x: Tensor, what: str) -> None:
    if x.numel() and not bool(torch.isfinite(x).all()):
        row, col = (int(v) for v in (~torch.isfinite(x)).nonzero()[0])
        raise PoolError(f"cache {what} of row {row}, column {col} is NaN or Inf")
