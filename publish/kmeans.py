"""k-means for the IVF coarse quantiser: k-means++ seeding, then batched Lloyd iterations in torch.

Runs on the device of the input (CPU or CUDA), deterministically for a given seed. Clustering is
on the raw (or, with `spherical=True`, normalised) embeddings with squared-L2 assignment; the
runtime probes clusters by inner product with the centroids (DESIGN.md, "Int8 IVF ANN index").

    >>> result = kmeans(embeddings, nlist=default_nlist(len(embeddings)), seed=0)
    >>> result.centroids      # float32 [nlist, D]
    >>> result.assignment     # int64 [N], cluster of every input row
    >>> result.stats[-1]      # IterationStats(objective=..., imbalance=..., reseeded=..., ...)

Like faiss `Clustering`, Lloyd iterations run on a random sample of at most
`max_points_per_centroid * nlist` points; the final assignment covers every point. Clusters that
become empty are re-seeded with the points worst served by their current centroid.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from silverrec.errors import PoolError
from silverrec.publish.progress import bar

ASSIGN_CHUNK = 16384  # rows per assignment matmul: memory O(ASSIGN_CHUNK * nlist)


def default_nlist(n: int) -> int:
    """About 4 * sqrt(N) clusters (at least 1, at most N)."""
    if n <= 0:
        raise PoolError("cannot cluster an empty pool")
    return max(1, min(n, int(round(4 * math.sqrt(n)))))


@dataclass
class IterationStats:
    """One Lloyd iteration: mean squared distance to the assigned centroid, imbalance factor
    (nlist * sum(size^2) / n^2; 1.0 = perfectly balanced), number of re-seeded empty clusters,
    and wall time in seconds."""

    iteration: int
    objective: float
    imbalance: float
    reseeded: int
    seconds: float


@dataclass
class KMeansResult:
    """centroids float32 [nlist, D]; assignment int64 [N]; stats per Lloyd iteration."""

    centroids: torch.Tensor
    assignment: torch.Tensor
    stats: list[IterationStats] = field(default_factory=list)


def assign(x: torch.Tensor, centroids: torch.Tensor, chunk: int = ASSIGN_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid by squared L2 for every row, in chunks.

    Args:
        x: float32 [N, D]; centroids: float32 [K, D].
    Returns:
        (assignment int64 [N], squared distance float32 [N]); ties go to the lower centroid id.
    """
    c_sq = (centroids * centroids).sum(dim=1)  # [K]
    labels = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    dist = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], chunk):
        xs = x[start : start + chunk]
        # |x - c|^2 = |x|^2 - 2 x.c + |c|^2; argmin over c does not need |x|^2.
        partial = torch.addmm(c_sq[None, :], xs, centroids.t(), alpha=-2.0)  # [c, K]
        best, lab = partial.min(dim=1)
        labels[start : start + chunk] = lab
        dist[start : start + chunk] = (best + (xs * xs).sum(dim=1)).clamp_min_(0.0)
    return labels, dist


def kmeanspp_init(x: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding (Arthur & Vassilvitskii 2007): D^2-weighted sampling of k distinct rows.

    Args:
        x: float32 [N, D] with N >= k; generator: seeded, on x's device.
    Returns:
        float32 [k, D] initial centroids (copies of rows of x).
    """
    n = x.shape[0]
    if not 0 < k <= n:
        raise PoolError(f"k-means++ needs 1 <= nlist <= {n} points, got nlist={k}")
    chosen = torch.empty(k, dtype=torch.int64, device=x.device)
    chosen[0] = torch.randint(n, (1,), generator=generator, device=x.device)[0]
    x_sq = (x * x).sum(dim=1)
    first = x[chosen[0]]
    d2 = (x_sq - 2.0 * (x @ first) + (first * first).sum()).clamp_min_(0.0)
    for i in range(1, k):
        total = d2.sum()
        if bool(total <= 0):  # fewer than k distinct points: take unchosen rows in order
            d2 = torch.ones_like(d2)
            d2[chosen[:i]] = 0.0
            if bool(d2.sum() <= 0):
                raise PoolError(f"cannot seed {k} clusters from {n} points")
        nxt = torch.multinomial(d2, 1, generator=generator)[0]
        chosen[i] = nxt
        c = x[nxt]
        d2 = torch.minimum(d2, (x_sq - 2.0 * (x @ c) + (c * c).sum()).clamp_min_(0.0))
        d2[nxt] = 0.0
    return x[chosen].clone()


def lloyd_step(
    x: torch.Tensor, centroids: torch.Tensor, spherical: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One Lloyd iteration: assign every row, move each centroid to its members' mean.

    A cluster left without members is re-seeded with one of the rows farthest from their current
    centroid (distinct rows for distinct empty clusters, farthest first).

    Args:
        x: float32 [N, D]; centroids: float32 [K, D].
    Returns:
        (new centroids float32 [K, D], member counts int64 [K] of the assignment step,
        squared distance float32 [N] of each row to its assigned centroid, number re-seeded).
    """
    k = centroids.shape[0]
    labels, dist = assign(x, centroids)
    counts = torch.bincount(labels, minlength=k)
    sums = torch.zeros_like(centroids).index_add_(0, labels, x)
    new = sums / counts.clamp_min(1).to(sums.dtype)[:, None]
    empty = (counts == 0).nonzero().flatten()
    if empty.numel():
        far = dist.topk(min(empty.numel(), dist.numel())).indices
        new[empty[: far.numel()]] = x[far]
    if spherical:
        new = torch.nn.functional.normalize(new, dim=1)
    return new, counts, dist, int(empty.numel())


def _sample(n: int, size: int, generator: torch.Generator, device) -> torch.Tensor:
    if size >= n:
        return torch.arange(n, device=device)
    return torch.randperm(n, generator=generator, device=device)[:size].sort().values


def kmeans(
    x: torch.Tensor,
    nlist: int | None = None,
    *,
    niter: int = 10,
    seed: int = 0,
    max_points_per_centroid: int = 256,
    seed_points_per_centroid: int = 32,
    spherical: bool = False,
) -> KMeansResult:
    """Cluster `x` into `nlist` groups (progress bar on stderr unless SILVERREC_QUIET=1).

    Args:
        x: float [N, D], finite. Any device.
        nlist: number of clusters (default `default_nlist(N)`).
        niter: Lloyd iterations.
        seed: RNG seed; the result is a deterministic function of (x, arguments).
        max_points_per_centroid: Lloyd iterations run on at most this many points per cluster.
        seed_points_per_centroid: k-means++ seeding runs on at most this many points per cluster.
        spherical: normalise centroids to unit norm after each update.
    Returns:
        KMeansResult with centroids float32 [nlist, D], assignment int64 [N], per-iteration stats.
    """
    if x.dim() != 2 or x.shape[0] == 0:
        raise PoolError(f"k-means needs a non-empty [N, D] matrix, got shape {tuple(x.shape)}")
    x = x.float().contiguous()
    if not bool(torch.isfinite(x).all()):
        raise PoolError("k-means input contains NaN or Inf")
    n = x.shape[0]
    nlist = default_nlist(n) if nlist is None else int(nlist)
    if not 0 < nlist <= n:
        raise PoolError(f"nlist must be in [1, {n}] (the item count), got {nlist}")
    g = torch.Generator(device=x.device).manual_seed(int(seed))

    train = x[_sample(n, max_points_per_centroid * nlist, g, x.device)]
    seed_rows = train[_sample(train.shape[0], max(seed_points_per_centroid * nlist, nlist), g, x.device)]
    centroids = kmeanspp_init(seed_rows, nlist, g)
    if spherical:
        centroids = torch.nn.functional.normalize(centroids, dim=1)

    stats: list[IterationStats] = []
    m = train.shape[0]
    with bar(niter, f"k-means nlist={nlist}") as pbar:
        for it in range(niter):
            t0 = time.perf_counter()
            centroids, counts, dist, reseeded = lloyd_step(train, centroids, spherical=spherical)
            stats.append(
                IterationStats(
                    iteration=it,
                    objective=float(dist.mean()),  # of this iteration's assignment step
                    imbalance=float(nlist * (counts.double() ** 2).sum() / (m * m)),
                    reseeded=reseeded,
                    seconds=time.perf_counter() - t0,
                )
            )
            pbar.set_postfix(obj=f"{stats[-1].objective:.4g}", imb=f"{stats[-1].imbalance:.2f}")
            pbar.update(1)
    assignment, _ = assign(x, centroids)
    return KMeansResult(centroids=centroids, assignment=assignment, stats=stats)
