"""Semantic IDs for generative retrieval: residual k-means codes plus a disambiguation token.

Every item gets a path of L = levels + 1 codes (docs/architecture.md, "Generative beam decode"):

    level 0..levels-1  residual k-means: level l clusters what levels < l left unexplained
                       (x - sum of the chosen centroids so far) into `codes` centroids;
    last level         disambiguation: 0 when no other item shares the item's code path, else the
                       item's rank (0, 1, ...) among the items sharing it, nearest-to-the-path first
                       (or by any key: `order`, e.g. most popular first, so that the last token
                       means the same thing under every path).

    level_sizes = [C_0, ..., C_{levels-1}, Cd] with Cd = max items sharing one code path, so paths
    int64 [N, L] are unique per item and `silverrec.generative.decoder.paths_to_tokens(paths, level_sizes)`
    turns them into the decoder's tokens.

    >>> sids = build_semantic_ids(embeddings, item_ids, levels=3, codes=256, seed=0)
    >>> sids.paths            # int64 [N, 4]
    >>> sids.level_sizes      # [256, 256, 256, Cd]
    >>> print(sids.stats.summary())

Clustering uses `silverrec.publish.kmeans` (k-means++ seeding, Lloyd iterations, deterministic
for a seed, empty clusters re-seeded).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from silverrec.generative.decoder import level_offsets, paths_to_tokens, vocab_size
from silverrec.errors import PoolError, QueryError
from silverrec.publish.kmeans import assign, kmeans


@dataclass
class SemanticIdStats:
    """Codebook usage and collisions of a set of semantic IDs (stored in the manifest config).

    used_codes: distinct codes used at each k-means level; level_sizes: codebook sizes;
    distinct_prefixes: distinct code prefixes of length 1..levels;
    colliding_paths: code paths (k-means levels only) shared by >= 2 items;
    colliding_items: items on such a path; max_items_per_path / mean_items_per_path: over the
    distinct code paths; relative_error: mean ||x - reconstruction||^2 / mean ||x||^2 after each
    level (decreasing).
    """

    n_items: int
    level_sizes: list[int]
    used_codes: list[int]
    distinct_prefixes: list[int]
    colliding_paths: int
    colliding_items: int
    max_items_per_path: int
    mean_items_per_path: float
    relative_error: list[float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        levels = len(self.used_codes)
        usage = ", ".join(f"L{l}: {self.used_codes[l]}/{self.level_sizes[l]}" for l in range(levels))
        err = ", ".join(f"{e:.3f}" for e in self.relative_error)
        return (
            f"semantic IDs: {self.n_items} items, level sizes {self.level_sizes}; codes used {usage}; "
            f"distinct prefixes {self.distinct_prefixes}; {self.colliding_paths} code paths shared by "
            f"{self.colliding_items} items (max {self.max_items_per_path}, mean "
            f"{self.mean_items_per_path:.3f} items per path); relative reconstruction error per level [{err}]"
        )


@dataclass
class SemanticIds:
    """Semantic IDs of a candidate pool.

    item_ids: int64 [N] external ids (row order of the pool); paths: int64 [N, L] codes, unique rows;
    codebooks: per k-means level float32 [C_l, D]; level_sizes: L ints; stats: usage/collisions.
    """

    item_ids: np.ndarray
    paths: np.ndarray
    codebooks: list[np.ndarray]
    level_sizes: list[int]
    stats: SemanticIdStats

    @property
    def depth(self) -> int:
        """L, the number of tokens per item (k-means levels + 1)."""
        return int(self.paths.shape[1])

    @property
    def level_offsets(self) -> list[int]:
        return level_offsets(self.level_sizes)

    @property
    def vocab_size(self) -> int:
        return vocab_size(self.level_sizes)

    def tokens(self) -> np.ndarray:
        """Decoder tokens int64 [N, L] of every item (pool row order)."""
        return paths_to_tokens(torch.from_numpy(self.paths), self.level_sizes).numpy()

    def subset(self, item_ids: np.ndarray) -> "SemanticIds":
        """The semantic IDs of `item_ids` (same level sizes, so the same vocabulary).

        Raises PoolError naming the first id that has no semantic ID here."""
        item_ids = np.asarray(item_ids, dtype=np.int64)
        order = np.argsort(self.item_ids, kind="stable")
        pos = np.searchsorted(self.item_ids[order], item_ids).clip(0, len(order) - 1)
        bad = np.flatnonzero(self.item_ids[order][pos] != item_ids)
        if bad.size:
            raise PoolError(f"item {int(item_ids[bad[0]])} has no semantic ID in the checkpoint "
                            f"({bad.size} such items): retrain on this pool or publish without --model")
        rows = order[pos]
        return SemanticIds(item_ids.copy(), self.paths[rows], self.codebooks, list(self.level_sizes), self.stats)

    def config(self) -> dict[str, Any]:
        """JSON description for a manifest (the paths themselves are stored separately)."""
        return {
            "levels": self.depth,
            "level_sizes": list(self.level_sizes),
            "level_offsets": self.level_offsets,
            "vocab_size": self.vocab_size,
            "stats": self.stats.to_dict(),
        }


def residual_kmeans(
    x: torch.Tensor, levels: int = 3, codes: int = 256, *, seed: int = 0, niter: int = 20
) -> tuple[torch.Tensor, list[torch.Tensor], list[float]]:
    """Residual k-means (RQ-style) codes.

    Args:
        x: float32 [N, D] finite item embeddings.
        levels: number of k-means levels; codes: centroids per level (capped at N).
        seed: level l uses seed + l; niter: Lloyd iterations per level.
    Returns:
        codes int64 [N, levels], codebooks float32 [C_l, D] per level, and the relative squared
        reconstruction error mean ||x - x_hat_l||^2 / mean ||x||^2 after each level.
    """
    if levels < 1:
        raise PoolError(f"semantic IDs need at least one k-means level, got levels={levels}")
    if codes < 1:
        raise PoolError(f"semantic IDs need at least one code per level, got codes={codes}")
    x = x.float()
    n = x.shape[0]
    k = min(codes, n)
    residual = x.clone()
    energy = float((x * x).sum(dim=1).mean().clamp_min(1e-30))
    out = torch.empty(n, levels, dtype=torch.int64)
    books: list[torch.Tensor] = []
    errors: list[float] = []
    for level in range(levels):
        result = kmeans(residual, k, niter=niter, seed=seed + level)
        labels, dist = assign(residual, result.centroids)  # final assignment to the final centroids
        out[:, level] = labels
        books.append(result.centroids)
        residual = residual - result.centroids[labels]
        errors.append(float(dist.mean()) / energy)
    return out, books, errors


def disambiguate(codes: torch.Tensor, residual_norm: torch.Tensor | None = None) -> torch.Tensor:
    """The disambiguation token of every item: its rank among the items sharing its code path.

    Args:
        codes: int64 [N, levels]; residual_norm: float [N] (ties ordered by it, then by row), or None
            (ordered by row).
    Returns:
        int64 [N]: 0 for an item alone on its path; 0..g-1 within a group of g items.
    """
    n = codes.shape[0]
    _, group = torch.unique(codes, dim=0, return_inverse=True)
    key = torch.zeros(n, dtype=torch.float64) if residual_norm is None else residual_norm.double()
    # Order rows by (group, key, row); rank within group = position - first position of the group.
    order = np.lexsort((np.arange(n), key.numpy(), group.numpy()))
    sorted_group = group.numpy()[order]
    starts = np.r_[0, np.flatnonzero(sorted_group[1:] != sorted_group[:-1]) + 1]
    first = np.repeat(starts, np.diff(np.r_[starts, n]))
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - first
    return torch.from_numpy(rank)


def collision_stats(codes: np.ndarray, level_sizes: list[int], relative_error: list[float]) -> SemanticIdStats:
    """Usage and collision statistics of k-means codes int64 [N, levels] (vectorised)."""
    codes = np.asarray(codes, dtype=np.int64)
    n, levels = codes.shape
    _, counts = np.unique(codes, axis=0, return_counts=True)
    used = [int(np.unique(codes[:, l]).size) for l in range(levels)]
    prefixes = [int(np.unique(codes[:, : l + 1], axis=0).shape[0]) for l in range(levels)]
    shared = counts >= 2
    return SemanticIdStats(
        n_items=int(n),
        level_sizes=[int(s) for s in level_sizes],
        used_codes=used,
        distinct_prefixes=prefixes,
        colliding_paths=int(shared.sum()),
        colliding_items=int(counts[shared].sum()),
        max_items_per_path=int(counts.max()),
        mean_items_per_path=float(n / counts.size),
        relative_error=[float(e) for e in relative_error],
    )


def build_semantic_ids(
    embeddings: np.ndarray | torch.Tensor,
    item_ids: np.ndarray,
    *,
    levels: int = 3,
    codes: int = 256,
    seed: int = 0,
    niter: int = 20,
    order: np.ndarray | None = None,
) -> SemanticIds:
    """Residual k-means + disambiguation token for every item of a pool.

    Args:
        embeddings: float [N, D] finite item embeddings (pool row order).
        item_ids: int64 [N] unique external ids.
        levels, codes: k-means levels and codes per level (defaults 3 x 256).
        seed, niter: k-means seed (deterministic) and Lloyd iterations per level.
        order: float [N] or None: items sharing a code path get disambiguation codes by ascending
            `order` (e.g. minus the training count: most popular first), ties by row; None: by the
            residual norm, nearest to the path first.
    Returns:
        SemanticIds with paths int64 [N, levels + 1] (unique rows) and level_sizes
        [C_0, ..., C_{levels-1}, Cd].
    """
    x = torch.as_tensor(np.asarray(embeddings), dtype=torch.float32)
    ids = np.asarray(item_ids, dtype=np.int64)
    if x.dim() != 2 or x.shape[0] == 0:
        raise PoolError(f"semantic IDs need a non-empty [N, D] embedding matrix, got {tuple(x.shape)}")
    if ids.shape != (x.shape[0],):
        raise PoolError(f"item_ids must be [{x.shape[0]}], got {ids.shape}")
    if not bool(torch.isfinite(x).all()):
        row = int((~torch.isfinite(x)).any(dim=1).nonzero()[0, 0])
        raise PoolError(f"embedding of item {int(ids[row])} (row {row}) contains NaN or Inf")
    km_codes, books, errors = residual_kmeans(x, levels, codes, seed=seed, niter=niter)
    recon = sum(book[km_codes[:, l]] for l, book in enumerate(books))
    if order is not None and np.shape(order) != (x.shape[0],):
        raise PoolError(f"order must be [{x.shape[0]}] (one key per item), got {np.shape(order)}")
    dis = disambiguate(km_codes, (x - recon).norm(dim=1) if order is None else torch.as_tensor(np.asarray(order, np.float64)))
    paths = torch.cat([km_codes, dis[:, None]], dim=1).numpy()
    level_sizes = [int(b.shape[0]) for b in books] + [int(dis.max()) + 1]
    stats = collision_stats(km_codes.numpy(), level_sizes, errors)
    return SemanticIds(ids, paths, [b.numpy() for b in books], level_sizes, stats)


def check_paths(paths: np.ndarray, level_sizes: list[int]) -> None:
    """Raise PoolError unless paths int64 [N, L] are unique and every code < its level size."""
    paths = np.asarray(paths)
    if paths.ndim != 2 or paths.shape[1] != len(level_sizes):
        raise PoolError(f"semantic-ID paths must be [N, {len(level_sizes)}], got {paths.shape}")
    for l, size in enumerate(level_sizes):
        bad = np.flatnonzero((paths[:, l] < 0) | (paths[:, l] >= size))
        if bad.size:
            raise PoolError(f"semantic-ID path of row {int(bad[0])} has code {int(paths[bad[0], l])} at level {l}, "
                            f"outside [0, {size})")
    uniq, inverse, counts = np.unique(paths, axis=0, return_inverse=True, return_counts=True)
    if uniq.shape[0] != paths.shape[0]:
        rows = np.flatnonzero(counts[inverse.reshape(-1)] > 1)[:2]
        raise PoolError(f"semantic-ID paths of rows {int(rows[0])} and {int(rows[1])} are equal")


def item_token_ids(item_ids: np.ndarray) -> SemanticIds:
    """One token per item (the SASRec-style reference for semantic IDs): paths int64 [N, 1] = the
    item's row, level_sizes [N]; the decoder's softmax over level 0 is a full softmax over items."""
    ids = np.asarray(item_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise PoolError("item-token IDs need at least one item")
    paths = np.arange(ids.size, dtype=np.int64)[:, None]
    return SemanticIds(ids, paths, [], [int(ids.size)], collision_stats(paths, [int(ids.size)], [0.0]))


def history_tokens(histories: list[list[int]], sorted_ids: np.ndarray, sorted_tokens: np.ndarray,
                   max_items: int) -> torch.Tensor:
    """Item-id histories -> left-padded decoder input int64 [B, T] (generative contract).

    Each row is BOS (1) + the L tokens of its last `max_items` items, oldest first, left-padded
    with PAD (0); T = max(2, longest row). sorted_ids int64 [N] ascending, sorted_tokens [N, L].
    Raises QueryError naming the first unknown item id (and its request).
    """
    if isinstance(histories, (str, bytes)) or not hasattr(histories, "__len__") or len(histories) == 0:
        raise QueryError("history_item_ids must be a non-empty list of item-id lists")
    rows = []
    for b, h in enumerate(histories):
        try:
            h = np.asarray(h, dtype=np.int64).reshape(-1)[-max_items:] if len(h) else np.zeros(0, np.int64)
        except (TypeError, ValueError, OverflowError):
            raise QueryError(f"history {b} must be a list of integer item ids") from None
        pos = np.searchsorted(sorted_ids, h).clip(0, len(sorted_ids) - 1)
        bad = np.flatnonzero(sorted_ids[pos] != h)
        if bad.size:
            raise QueryError(f"unknown history item id {int(h[bad[0]])} in history {b}: not in the snapshot's pool")
        rows.append(sorted_tokens[pos].reshape(-1))
    T = max(2, 1 + max(r.size for r in rows))
    out = torch.zeros(len(rows), T, dtype=torch.int64)
    for b, r in enumerate(rows):
        out[b, T - r.size - 1] = 1  # BOS
        out[b, T - r.size :] = torch.from_numpy(r)
    return out
