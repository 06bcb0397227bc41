"""k-means for the IVF coarse quantiser: k-means++ seeding, then batched Lloyd iterations in torch.

Runs on the device of the input (CPU or CUDA), deterministically for a given seed. Clustering is
on the raw embeddings with squared-L2 assignment; with `spherical=True` every centroid update is
normalised to unit length (both methods, every step). The runtime probes clusters by inner product
with the centroids (docs/architecture.md, "Int8 IVF ANN index"): for unit-length items, unit
centroids make that probe rank clusters exactly as the L2 assignment placed the items
(|x - c|^2 = 2 - 2 <x, c>), which is why publish clusters a pool of constant-norm embeddings
spherically (publish/ivf.py `IVFConfig`).

    >>> result = kmeans(embeddings, nlist=default_nlist(len(embeddings)), seed=0)
    >>> result.centroids      # float32 [nlist, D]
    >>> result.assignment     # int64 [N], cluster of every input row
    >>> result.stats[-1]      # IterationStats(objective=..., imbalance=..., reseeded=..., ...)

Like faiss `Clustering`, Lloyd iterations run on a random sample of at most
`max_points_per_centroid * nlist` points (POINTS_PER_CENTROID per cluster by default); the final
assignment covers every point. Clusters that become empty are re-seeded with the points worst
served by their current centroid.

Catalogue scale (`method="two_level"`, the automatic choice from nlist >= TWO_LEVEL_MIN_NLIST):
flat Lloyd costs sample x nlist x D per iteration and k-means++ seeding loops nlist times, which is
too slow at catalogue nlist on a CPU. The two-level build trains on the same sample as flat: it
clusters the sample into G ~ sqrt(nlist) groups, then each group's members into a share of nlist
proportional to its size (one thread: small matrices), then runs `refine` (TWO_LEVEL_REFINE) global
Lloyd steps, which move the boundaries the per-group build drew along the group borders. On pools
whose clusters overlap, a smaller sample or fewer refine steps leave centroids that reach fewer
true neighbours at equal nprobe than flat k-means'. The refine steps' assignments (and the final
one over all N rows of a pool above EXACT_ASSIGN_PAIRS) are `assign_grouped`, an IVF search over
the centroids: a row is compared only with the centroids of its `reach` nearest group centres
(default a quarter of the groups). Rows it leaves off their nearest centroid cost recall too, so
the final assignment over all N rows is exact (`assign`) while N x nlist is at most
EXACT_ASSIGN_PAIRS (one N x nlist x D matmul in chunks), and grouped above, where the exact one
costs many times the build. docs/benchmarks.md (kmeans_recall.py, recall_gap.py, update.py) has the
measurements against flat k-means and Faiss IVF-SQ8.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from silverrec.errors import PoolError
from silverrec.publish.progress import bar
from silverrec.threads import num_threads

ASSIGN_CHUNK = 16384  # rows per assignment matmul: memory O(ASSIGN_CHUNK * nlist)
ASSIGN_SCORES = 1 << 25  # at most this many scores (128 MiB) per assignment matmul
GROUPED_PAIRS = 1 << 21  # (row, group) pairs per grouped-assignment batch, ~80 bytes of temporaries each (~170 MB)
TWO_LEVEL_MIN_NLIST = 1024  # method="auto" switches to two_level from this many clusters
GROUPS_PER_SQRT = 1.0  # two_level: G = GROUPS_PER_SQRT * sqrt(nlist) groups
REACH_SHARE = 4  # assign_grouped compares a row with the centroids of its ceil(G / REACH_SHARE) nearest groups
POINTS_PER_CENTROID = 256  # Lloyd iterations (both methods) run on at most this many points per cluster
TWO_LEVEL_REFINE = 8  # two_level: global Lloyd steps after the per-group build
EXACT_ASSIGN_PAIRS = 1 << 32  # two_level: exact final assignment up to N x nlist = this (1M x 4,000), grouped above


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
    """centroids float32 [nlist, D]; assignment int64 [N]; stats per Lloyd iteration; spherical: unit centroids."""

    centroids: torch.Tensor
    assignment: torch.Tensor
    stats: list[IterationStats] = field(default_factory=list)
    spherical: bool = False


def assign(x: torch.Tensor, centroids: torch.Tensor, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid by squared L2 for every row, in chunks.

    Args:
        x: float32 [N, D]; centroids: float32 [K, D]; chunk: rows per matmul (default: ASSIGN_CHUNK,
            fewer when K is large, so that a chunk's scores stay within ASSIGN_SCORES floats).
    Returns:
        (assignment int64 [N], squared distance float32 [N]); ties go to the lower centroid id.
    """
    chunk = chunk or max(1, min(ASSIGN_CHUNK, ASSIGN_SCORES // max(1, centroids.shape[0])))
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


def cluster_sums(x: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """Sum of the rows of each cluster: float32 [N, D], labels int64 [N] -> float32 [k, D].

    index_add_ runs on one thread: its multi-threaded path was slower for both large and small
    inputs on a loaded CPU."""
    with num_threads(1):
        return torch.zeros(k, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, labels, x)


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
    sums = cluster_sums(x, labels, k)
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


def _lloyd(
    train: torch.Tensor,
    k: int,
    niter: int,
    g: torch.Generator,
    seed_points_per_centroid: int,
    spherical: bool,
    stats: list | None = None,
    pbar=None,
) -> torch.Tensor:
    """k-means++ on a subsample of `train`, then `niter` Lloyd steps -> centroids float32 [k, D]."""
    m = train.shape[0]
    seed_rows = train[_sample(m, max(seed_points_per_centroid * k, k), g, train.device)]
    centroids = kmeanspp_init(seed_rows, k, g)
    if spherical:
        centroids = torch.nn.functional.normalize(centroids, dim=1)
    for it in range(niter):
        t0 = time.perf_counter()
        centroids, counts, dist, reseeded = lloyd_step(train, centroids, spherical=spherical)
        if stats is not None:
            stats.append(_stats(it, dist, counts, k, m, reseeded, t0))
            if pbar is not None:
                pbar.set_postfix(obj=f"{stats[-1].objective:.4g}", imb=f"{stats[-1].imbalance:.2f}")
        if pbar is not None:
            pbar.update(1)
    return centroids


def _stats(it: int, dist: torch.Tensor, counts: torch.Tensor, k: int, m: int, reseeded: int, t0: float) -> IterationStats:
    return IterationStats(
        iteration=it,
        objective=float(dist.mean()),  # of this iteration's assignment step
        imbalance=float(k * (counts.double() ** 2).sum() / (m * m)),
        reseeded=reseeded,
        seconds=time.perf_counter() - t0,
    )


def allocate(sizes: torch.Tensor, total: int) -> torch.Tensor:
    """Split `total` clusters over groups in proportion to their sizes (largest remainder), at least
    one per non-empty group and never more than a group's size. sizes int64 [G] -> int64 [G]."""
    sizes = sizes.to(torch.int64)
    if int(sizes.sum()) < total:
        raise PoolError(f"cannot make {total} clusters from {int(sizes.sum())} points")
    share = sizes.double() * total / sizes.sum()
    out = torch.minimum(share.floor().to(torch.int64).clamp_min((sizes > 0).to(torch.int64)), sizes)
    while int(out.sum()) != total:
        room = sizes - out
        if int(out.sum()) < total:  # add to the groups furthest below their share, with room
            gap = torch.where(room > 0, share - out.double(), torch.full_like(share, -math.inf))
            out[int(gap.argmax())] += 1
        else:  # remove from the groups furthest above their share, keeping >= 1
            over = torch.where(out > 1, out.double() - share, torch.full_like(share, -math.inf))
            out[int(over.argmax())] -= 1
    return out


@dataclass
class Groups:
    """A coarse level over the centroids for `assign_grouped`: group_centroids float32 [G, D],
    group int64 [K] (group of each centroid), members[g] int64 the centroid ids of group g, and
    reach, the groups each row is compared with (its `reach` nearest group centres)."""

    group_centroids: torch.Tensor
    group: torch.Tensor
    members: list[torch.Tensor]
    reach: int

    @classmethod
    def build(cls, centroids: torch.Tensor, group_centroids: torch.Tensor, reach: int | None = None) -> "Groups":
        """reach None: a quarter of the groups (REACH_SHARE), rounded up."""
        group, _ = assign(centroids, group_centroids)
        n_groups = group_centroids.shape[0]
        order = torch.sort(group, stable=True).indices
        bounds = torch.zeros(n_groups + 1, dtype=torch.int64)
        bounds[1:] = torch.cumsum(torch.bincount(group, minlength=n_groups), 0)
        members = [order[bounds[h] : bounds[h + 1]] for h in range(n_groups)]
        reach = math.ceil(n_groups / REACH_SHARE) if reach is None else int(reach)
        return cls(group_centroids.contiguous(), group, members, max(1, min(reach, n_groups)))


def assign_grouped(
    x: torch.Tensor,
    centroids: torch.Tensor,
    groups: Groups,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Approximate nearest centroid, searched like an IVF over the centroids: each row is compared
    with the centroids of its `groups.reach` nearest group centres only. Same outputs as `assign`:
    (assignment int64 [N], squared distance float32 [N]).

    Per chunk of rows, the (row, group) pairs are sorted by group so that each group is one matmul
    over its rows (index_select) against its members; results are written into contiguous slices in
    that order and put back in row order once (no per-group scatter)."""
    c_sq = (centroids * centroids).sum(dim=1)
    mem_c = [centroids[m].t().contiguous() for m in groups.members]  # [D, |group|] each
    mem_sq = [c_sq[m][None, :] for m in groups.members]
    member_ids = torch.cat(groups.members)  # centroid ids, group by group
    member_base = torch.zeros(len(groups.members), dtype=torch.int64)
    member_base[1:] = torch.cumsum(torch.tensor([m.numel() for m in groups.members[:-1]], dtype=torch.int64), 0)
    g_t = groups.group_centroids.t().contiguous()
    g_sq = (groups.group_centroids * groups.group_centroids).sum(dim=1)[None, :]
    labels = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    dist = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    n_groups, t = len(groups.members), groups.reach
    chunk = chunk or max(1, GROUPED_PAIRS // t)
    for start in range(0, x.shape[0], chunk):
        xs = x[start : start + chunk]
        c = xs.shape[0]
        near = torch.addmm(g_sq, xs, g_t, alpha=-2.0).topk(t, dim=1, largest=False).indices.reshape(-1)  # [c * t]
        order = torch.sort(near, stable=True).indices  # pairs (row, group) sorted by group
        counts = torch.bincount(near, minlength=n_groups)
        bounds = [0] + torch.cumsum(counts, 0).tolist()
        rows = order // t
        best = torch.full((c * t,), math.inf)
        local = torch.zeros(c * t, dtype=torch.int64)
        for gi in range(n_groups):
            a, b = bounds[gi], bounds[gi + 1]
            if a == b or mem_c[gi].shape[1] == 0:
                continue
            part = torch.addmm(mem_sq[gi], xs.index_select(0, rows[a:b]), mem_c[gi], alpha=-2.0)
            torch.min(part, dim=1, out=(best[a:b], local[a:b]))
        lab_sorted = member_ids[(member_base.repeat_interleave(counts) + local).clamp_max_(member_ids.numel() - 1)]
        pair_best = torch.empty_like(best).index_copy_(0, order, best).reshape(c, t)
        pair_lab = torch.empty_like(lab_sorted).index_copy_(0, order, lab_sorted).reshape(c, t)
        bv, which = pair_best.min(dim=1)
        labels[start : start + c] = pair_lab.gather(1, which[:, None]).squeeze(1)
        dist[start : start + c] = (bv + (xs * xs).sum(dim=1)).clamp_min_(0.0)
    return labels, dist


def kmeans(
    x: torch.Tensor,
    nlist: int | None = None,
    *,
    niter: int = 10,
    seed: int = 0,
    max_points_per_centroid: int | None = None,
    seed_points_per_centroid: int = 32,
    spherical: bool = False,
    method: str = "auto",
    refine: int = TWO_LEVEL_REFINE,
    reach: int | None = None,
) -> KMeansResult:
    """Cluster `x` into `nlist` groups (progress bar on stderr unless SILVERREC_QUIET=1).

    Args:
        x: float [N, D], finite. Any device.
        nlist: number of clusters (default `default_nlist(N)`).
        niter: Lloyd iterations.
        seed: RNG seed; the result is a deterministic function of (x, arguments).
        max_points_per_centroid: Lloyd iterations run on at most this many points per cluster
            (default POINTS_PER_CENTROID).
        seed_points_per_centroid: k-means++ seeding runs on at most this many points per cluster.
        spherical: normalise centroids to unit norm after each update.
        method: "flat" (Lloyd over all nlist centroids), "two_level" (module docstring), or "auto"
            (two_level from nlist >= TWO_LEVEL_MIN_NLIST, else flat).
        refine, reach: two_level only: global Lloyd steps after the per-group build; groups an
            item is compared with in `assign_grouped` (None: a quarter of them, `Groups.build`).
    Returns:
        KMeansResult with centroids float32 [nlist, D], assignment int64 [N], per-iteration stats
        (two_level: the group-level iterations, then the refine steps).
    """
    if x.dim() != 2 or x.shape[0] == 0:
        raise PoolError(f"k-means needs a non-empty [N, D] matrix, got shape {tuple(x.shape)}")
    if method not in ("auto", "flat", "two_level"):
        raise PoolError(f"k-means method must be 'auto', 'flat' or 'two_level', got {method!r}")
    x = x.float().contiguous()
    if not all(bool(torch.isfinite(x[i : i + ASSIGN_CHUNK]).all()) for i in range(0, x.shape[0], ASSIGN_CHUNK)):
        raise PoolError("k-means input contains NaN or Inf")  # (chunked: a whole bool mask is N x D bytes)
    n = x.shape[0]
    nlist = default_nlist(n) if nlist is None else int(nlist)
    if not 0 < nlist <= n:
        raise PoolError(f"nlist must be in [1, {n}] (the item count), got {nlist}")
    if method == "auto":
        method = "two_level" if nlist >= TWO_LEVEL_MIN_NLIST else "flat"
    g = torch.Generator(device=x.device).manual_seed(int(seed))

    if max_points_per_centroid is None:
        max_points_per_centroid = POINTS_PER_CENTROID
    train = x[_sample(n, max_points_per_centroid * nlist, g, x.device)]
    stats: list[IterationStats] = []
    if method == "flat":
        with bar(niter, f"k-means nlist={nlist}") as pbar:
            centroids = _lloyd(train, nlist, niter, g, seed_points_per_centroid, spherical, stats, pbar)
        assignment, _ = assign(x, centroids)
        return KMeansResult(centroids=centroids, assignment=assignment, stats=stats, spherical=spherical)

    groups, centroids = _two_level(train, nlist, niter, g, seed_points_per_centroid, spherical, stats, reach)
    m = train.shape[0]
    with bar(refine, f"k-means refine nlist={nlist}") as pbar:
        for it in range(refine):
            t0 = time.perf_counter()
            labels, dist = assign_grouped(train, centroids, groups)
            counts = torch.bincount(labels, minlength=nlist)
            sums = cluster_sums(train, labels, nlist)
            new = sums / counts.clamp_min(1).to(sums.dtype)[:, None]
            if spherical:
                new = torch.nn.functional.normalize(new, dim=1)
            empty = counts == 0
            centroids = torch.where(empty[:, None], centroids, new)  # an emptied cluster keeps its centroid
            stats.append(_stats(len(stats), dist, counts, nlist, m, 0, t0))
            pbar.update(1)
    del train
    assignment, _ = assign(x, centroids) if n * nlist <= EXACT_ASSIGN_PAIRS else assign_grouped(x, centroids, groups)
    return KMeansResult(centroids=centroids, assignment=assignment, stats=stats, spherical=spherical)


def _two_level(
    train: torch.Tensor,
    nlist: int,
    niter: int,
    g: torch.Generator,
    seed_points_per_centroid: int,
    spherical: bool,
    stats: list,
    reach: int | None,
) -> tuple[Groups, torch.Tensor]:
    """G ~ sqrt(nlist) groups on the sample, then each group's members into its share of nlist."""
    n_groups = max(2, min(nlist, int(round(GROUPS_PER_SQRT * math.sqrt(nlist)))))
    with bar(niter, f"k-means groups G={n_groups}") as pbar:
        top = _lloyd(train, n_groups, niter, g, seed_points_per_centroid, spherical, stats, pbar)
    lab, _ = assign(train, top)
    sizes = torch.bincount(lab, minlength=n_groups)
    share = allocate(sizes, nlist)
    order = torch.sort(lab, stable=True).indices
    bounds = torch.zeros(n_groups + 1, dtype=torch.int64)
    bounds[1:] = torch.cumsum(sizes, 0)
    parts = []
    with bar(n_groups, f"k-means within groups nlist={nlist}") as pbar:
        for gi in range(n_groups):
            k = int(share[gi])
            if k:
                members = train[order[bounds[gi] : bounds[gi + 1]]]
                with num_threads(1):  # small matrices: one thread (see cluster_sums)
                    parts.append(_lloyd(members, k, niter, g, seed_points_per_centroid, spherical))
            pbar.update(1)
    centroids = torch.cat(parts).contiguous()
    return Groups.build(centroids, top, reach), centroids
