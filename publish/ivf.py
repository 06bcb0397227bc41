"""Build the int8 IVF index: k-means, per-dimension int8 quantisation, cluster-major layout
(published inside the root module by publish/filtered_ivf.py `publish_index`)."""

from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from silverrec.errors import PoolError
from silverrec.retrieval.ivf_index import Int8IVFIndex
from silverrec.kernels.ivf_scan import bitmask_words
from silverrec.publish.kmeans import KMeansResult, default_nlist, kmeans
from silverrec.publish.pool import Pool
from silverrec.publish.quantize import quantize_per_dim
from silverrec.publish.stages import StageClock

LAYOUT_CHUNK = 1 << 17  # rows quantised per step of the cluster-major layout
TORCHSCRIPT_MAX_BYTES = 256 << 20  # auto: no model.ts beside model.pt2 above this many tensor bytes


def default_nprobe(nlist: int) -> int:
    """A sensible default probe count: about 1/16 of the clusters, at least 1, at most 128."""
    return max(1, min(nlist, 128, (nlist + 15) // 16))


@dataclass
class IVFConfig:
    """How an IVF index is built. nlist None = `default_nlist(N)` (about 4 * sqrt(N))."""

    nlist: int | None = None
    seed: int = 0
    niter: int = 10
    max_points_per_centroid: int | None = None  # None: kmeans' default (POINTS_PER_CENTROID)
    seed_points_per_centroid: int = 32
    residual: bool | str = "auto"  # codes of item - its centroid (`cluster_major_layout`); "auto": `residual_helps`
    spherical: bool | str = "auto"  # unit-length centroids (kmeans); "auto": when `constant_norm` (the pool's rows)

    def __post_init__(self):
        if self.nlist is not None and (isinstance(self.nlist, bool) or int(self.nlist) < 1):
            raise PoolError(f"nlist must be a positive int, got {self.nlist!r}")
        for name in ("residual", "spherical"):
            if getattr(self, name) not in (True, False, "auto"):
                raise PoolError(f"{name} must be true, false or 'auto', got {getattr(self, name)!r}")
        if self.niter < 0:
            raise PoolError(f"niter must be >= 0, got {self.niter}")


def cluster_major_layout(
    embeddings: torch.Tensor,
    item_ids: torch.Tensor,
    centroids: torch.Tensor,
    assignment: torch.Tensor,
    consume: bool = False,
    residual: bool = False,
) -> Int8IVFIndex:
    """Sort items by cluster (stable: pool order within a cluster), quantise with per-dimension
    ranges (folded into the query at search time: measured recall@100 on a 200k Gaussian mixture,
    exact int8 search, 0.9908 vs 0.9889 with one global range).

    residual: quantise item - centroid of its cluster (as Faiss IVF-SQ8 does by default): its range
    per dimension is narrower than the items' own (0.60x on benchmarks/ann.py's 1M x 128 mixture), so
    the codes lose less; recall@100 at nprobe 16 there 0.9910 against 0.9862 with direct codes
    (benchmarks/residual_codes.py). The scans add <q, centroid> per cluster (`Int8IVFIndex`).

    Args:
        embeddings: float [N, D]; item_ids: int64 [N]; centroids: float [nlist, D];
        assignment: int64 [N] cluster of each item.
        consume: `embeddings` (contiguous float32 on the CPU) may be destroyed: they are quantised
            over their own buffer and most of it goes back to the OS before the cluster-major copy
            (`quantize_over`), so the float32 pool and the int8 copy are never resident together.
    """
    nlist = centroids.shape[0]
    order = torch.sort(assignment, stable=True).indices
    counts = torch.bincount(assignment, minlength=nlist)
    offsets = torch.zeros(nlist + 1, dtype=torch.int64, device=embeddings.device)
    offsets[1:] = torch.cumsum(counts, 0)
    centroids = centroids.float()
    base = (lambda rows: centroids[assignment[rows]]) if residual else None  # what the codes are relative to
    # per-dimension min/max ranges as in quantize_per_dim, of the items or of their residuals
    if residual:
        lo = torch.full((embeddings.shape[1],), float("inf"), device=embeddings.device)
        hi = torch.full_like(lo, float("-inf"))
        for start in range(0, embeddings.shape[0], LAYOUT_CHUNK):
            rows = torch.arange(start, min(start + LAYOUT_CHUNK, embeddings.shape[0]), device=embeddings.device)
            r = embeddings[start : start + rows.numel()].float() - base(rows)
            lo, hi = torch.minimum(lo, r.amin(dim=0)), torch.maximum(hi, r.amax(dim=0))
    else:
        lo, hi = embeddings.amin(dim=0).float(), embeddings.amax(dim=0).float()
    dim_scale = ((hi - lo) / 255.0).clamp_min(1e-12)
    dim_offset = lo + 128.0 * dim_scale
    if consume and embeddings.dtype == torch.float32 and embeddings.is_contiguous() and embeddings.device.type == "cpu":
        codes = quantize_over(embeddings, dim_scale, dim_offset, base).index_select(0, order)
    else:  # quantised straight into cluster-major order, a chunk at a time: one int8 copy of the pool
        codes = torch.empty(embeddings.shape, dtype=torch.int8, device=embeddings.device)
        for start in range(0, order.numel(), LAYOUT_CHUNK):
            rows = order[start : start + LAYOUT_CHUNK]
            chunk = embeddings[rows].float()  # a copy: quantised in place (one chunk of temporaries)
            if residual:
                chunk.sub_(base(rows))
            codes[start : start + rows.numel()] = chunk.sub_(dim_offset).div_(dim_scale).round_().clamp_(-128, 127)
    return Int8IVFIndex(codes, dim_scale, dim_offset, offsets, centroids, item_ids[order], residual=residual)


def residual_helps(embeddings: torch.Tensor, centroids: torch.Tensor, assignment: torch.Tensor,
                   sample: int = 1 << 15, seed: int = 0) -> bool:
    """Whether residual codes reconstruct the pool closer than direct codes: the mean squared error of
    both on a sample of rows, each with per-dimension min/max ranges of that sample.

    Which wins depends on the data: on benchmarks/ann.py's Gaussian mixture the residuals' ranges are
    0.60x the items' (recall@100 0.9910 vs 0.9862 at nprobe 16), while bigann10k's SIFT values are
    integers in [0, 255) that direct codes hold exactly and residuals do not (error 0.061 vs 0.032)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(embeddings.shape[0], generator=g)[:sample].to(embeddings.device)
    x = embeddings[rows].float()

    def error(v: torch.Tensor) -> float:
        codes, scale, offset = quantize_per_dim(v)
        return float((codes.float() * scale + offset - v).square().mean())

    return error(x - centroids.float()[assignment[rows]]) < error(x)


NORM_SPREAD = 0.01  # `constant_norm`: (largest - smallest row norm) / largest at most this


def constant_norm(embeddings: torch.Tensor) -> bool:
    """Whether every row has (nearly) the same length: normalised embeddings, searched by cosine.

    Then publish clusters spherically (`IVFConfig.spherical` "auto"): unit centroids, so that the probe's
    inner-product ranking of the clusters is the ranking the L2 assignment placed the items by, as Faiss
    trains an inner-product IVF. Mean centroids of such a pool have lengths from ~0.3 (diffuse clusters)
    to ~1 (tight ones) and the probe over-ranks the tight ones: on benchmarks/noisy_pool.py's pool (100k
    x 96) recall@100 at nprobe 8 / 32 / 128 was 0.627 / 0.857 / 0.964 with mean centroids and 0.699 /
    0.879 / 0.970 with unit ones, at about the same rows scanned (benchmarks/recall_gap.py). Not for
    pools whose norms carry meaning (MovieLens factors: popular items are long; there unit centroids
    cost recall at every probe depth)."""
    lo, hi = float("inf"), 0.0
    for start in range(0, embeddings.shape[0], LAYOUT_CHUNK):
        norms = torch.linalg.vector_norm(embeddings[start : start + LAYOUT_CHUNK].float(), dim=1)
        lo, hi = min(lo, float(norms.min())), max(hi, float(norms.max()))
    return hi > 0 and (hi - lo) <= NORM_SPREAD * hi


def quantize_over(x: torch.Tensor, dim_scale: torch.Tensor, dim_offset: torch.Tensor, base=None) -> torch.Tensor:
    """Codes int8 [N, D] of x (contiguous float32 [N, D], pool order) written over x's own first N x D
    bytes, a chunk at a time; the other 3 N x D bytes are then handed back to the OS
    (`release_pages`). x is destroyed; the codes are a view of its buffer. base: optional function of
    rows int64 [M] -> float32 [M, D] subtracted first (residual codes: the rows' centroids).

    The codes of rows [a, b) fill bytes [a D, b D), which held float rows [a / 4, b / 4): rows already
    read, since rows [a, b) are copied out before their codes are written. At 10M x 96 the layout
    then peaks at the float32 pool (3.84 GB) instead of the float32 pool + the int8 copy (+ 0.96 GB).
    """
    n, d = x.shape
    flat = x.view(-1).view(torch.int8)  # [4 N D] bytes of x
    codes = flat[: n * d].view(n, d)
    for start in range(0, n, LAYOUT_CHUNK):
        chunk = x[start : start + LAYOUT_CHUNK].clone()
        if base is not None:
            chunk.sub_(base(torch.arange(start, start + chunk.shape[0])))
        codes[start : start + chunk.shape[0]] = chunk.sub_(dim_offset).div_(dim_scale).round_().clamp_(-128, 127)
    release_pages(flat[n * d :])
    return codes


def release_pages(t: torch.Tensor) -> int:
    """Hand the whole memory pages inside contiguous CPU tensor t back to the OS (Linux
    madvise(MADV_DONTNEED): they read as zeros afterwards); returns the bytes released (0 elsewhere)."""
    page = 4096
    start = (t.data_ptr() + page - 1) // page * page
    stop = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if stop <= start:
        return 0
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return stop - start if madvise(start, stop - start, 4) == 0 else 0  # 4 = MADV_DONTNEED
    except (OSError, AttributeError):
        return 0


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    k-means frees its temporaries, but glibc keeps the pages: at 10M x 96 the layout stage, which
    adds the int8 copy to the float32 pool, peaked at 1.58x the pool's bytes with ~1 GB of them held."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build_ivf(
    pool: Pool, config: IVFConfig | None = None, clock: StageClock | None = None, consume: bool = False
) -> tuple[Int8IVFIndex, KMeansResult]:
    """k-means the pool's embeddings and lay them out as an Int8IVFIndex (stages timed on `clock`).

    consume: the layout quantises over pool.embeddings (`cluster_major_layout`), which is then
    replaced by an empty [0, D] array: for a pool whose float32 matrix nothing else uses (the CLI)."""
    config = config or IVFConfig()
    clock = clock or StageClock()
    x = torch.from_numpy(pool.embeddings)
    nlist = default_nlist(pool.size) if config.nlist is None else int(config.nlist)
    if nlist > pool.size:
        raise PoolError(f"nlist={nlist} exceeds the {pool.size} items in the pool")
    release_freed_memory()  # the Parquet reader's freed batches
    spherical = constant_norm(x) if config.spherical == "auto" else bool(config.spherical)
    with clock(f"k-means: {pool.size} items into {nlist} clusters{' (spherical)' if spherical else ''}"):
        km = kmeans(
            x,
            nlist,
            niter=config.niter,
            seed=config.seed,
            max_points_per_centroid=config.max_points_per_centroid,
            seed_points_per_centroid=config.seed_points_per_centroid,
            spherical=spherical,
        )
    release_freed_memory()
    residual = residual_helps(x, km.centroids, km.assignment) if config.residual == "auto" else bool(config.residual)
    with clock(f"quantising to int8 ({'residual' if residual else 'direct'} codes), cluster-major layout"):
        index = cluster_major_layout(x, torch.from_numpy(pool.item_ids), km.centroids, km.assignment,
                                     consume=consume and pool.embeddings.flags.writeable, residual=residual)
    if consume:
        del x
        pool.embeddings = np.empty((0, pool.dim), dtype=np.float32)
    return index, km


def ivf_manifest_config(pool: Pool, index: Int8IVFIndex, config: IVFConfig, km: KMeansResult) -> dict[str, Any]:
    """Everything needed to describe the index (and rebuild it) for the snapshot manifest."""
    sizes = index.cluster_offsets[1:] - index.cluster_offsets[:-1]
    last = km.stats[-1] if km.stats else None
    return {
        "dim": pool.dim,
        "index": "ivf_int8",
        "nlist": index.nlist,
        "default_nprobe": default_nprobe(index.nlist),
        "bitmask_words": bitmask_words(index.cluster_offsets),
        "quantization": {"kind": "per_dim_minmax", "folded_into_query": True, "residual": index.residual},
        "build": asdict(config) | {"nlist": index.nlist, "spherical": km.spherical, "residual": index.residual},
        "clusters": {
            "min_size": int(sizes.min()),
            "max_size": int(sizes.max()),
            "empty": int((sizes == 0).sum()),
            "imbalance": float(index.nlist * (sizes.double() ** 2).sum() / max(1, pool.size) ** 2),
            "kmeans_objective": None if last is None else last.objective,
        },
        "features": sorted(pool.features),
    }


def tensor_bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())
