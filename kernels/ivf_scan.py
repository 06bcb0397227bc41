"""`silverrec::ivf_scan`: top-k by inner product over the probed clusters of a cluster-major int8 IVF.

    scores, rows = torch.ops.silverrec.ivf_scan(queries, codes, scale, offset, cluster_offsets, probes, k, bitmask,
                                                window_words)

Args:
    queries: float [B, D].
    codes: int8 [N, D], rows sorted by cluster; item ~= scale * code + offset.
    scale, offset: float32 [] global quantisation parameters.
    cluster_offsets: int64 [nlist + 1]; cluster c holds rows [off[c], off[c + 1]).
    probes: int64 [B, P]; probes[b, j] is a cluster id, or -1 for an empty slot (skipped). A cluster
        repeated in one query's row is scanned once (its first slot counts, also for the bitmask).
    k: results per query, >= 1 (may exceed the number of probed items: see padding).
    bitmask: optional int64 [B, P, Wc], 1 bit per item (the bit-sliced Bloom layout): for slot j of
        query b with cluster c = probes[b, j], row r in [off[c], off[c + 1]) is allowed iff
        `(bitmask[b, j, (r >> 6) - (off[c] >> 6)] >> (r & 63)) & 1`. Word w of the window covers rows
        64 * ((off[c] >> 6) + w) .. + 63; Wc = max over clusters of
        ((off[c + 1] + 63) >> 6) - (off[c] >> 6) (see `bitmask_words`). None = every item allowed.
    window_words: Wc of `cluster_offsets` (`bitmask_words`), an index constant, or 0 = unknown. The
        CUDA scan without a bitmask sizes its key columns from it; 0 makes it read the largest cluster
        from the device, a host synchronisation that a CUDA graph cannot capture. The CPU ignores it.
    centroids, centroid_queries: optional float32 [nlist, D] and [B, D] (the unfolded queries), residual
        codes (item ~= centroid[c] + scale * code + offset): every row of cluster c scores
        <centroid_queries[b], centroid c> more, computed for the probed clusters only (`probe_terms`) and
        added as an int32 bias to the int8 dot products (`common.cluster_bias`), so it ranks.
Returns:
    scores float32 [B, k], descending; rows int64 [B, k] (cluster-major rows), ties broken by lower
    row. Fewer than k allowed items in the probed clusters: the tail is padded with row -1 and
    score -inf.

Queries are quantised to int8 per query (`common.quantize_queries`), so the ranking is exact for the
int8 scores: with every cluster probed it is the exact int8 top k of the whole pool (an exact index is the
configuration with one cluster).

CPU: the fused C++ scan (kernels/csrc/scan.cpp, ops.cpp): each probed cluster is one segment with the
queries that probe it, visited in order of the best probe rank; rows whose bitmask bit is 0 are skipped
before any dot product (a zero word skips 64 rows); int8 VNNI dot products feed a per-query running top-k
(threshold + candidate buffer compacted with nth_element); no Python per cluster. Residual codes: the cluster
term of the probed clusters (csrc/scan.h ClusterTerm, the bits of `probe_terms`). CUDA: the Triton kernel in
`ivf_scan_triton.py`. `ivf_scan_reference` is the tests' independent reference.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from silverrec.kernels.common import cluster_bias, dequantize_scores, dot_lanes, quantize_queries, split_keys


def bitmask_words(cluster_offsets: torch.Tensor) -> int:
    """Wc: words per probe slot in the ivf_scan bitmask, max over clusters of the 64-row words
    its row range touches."""
    off = cluster_offsets.to(torch.int64)
    if off.numel() < 2:
        return 0
    return int((((off[1:] + 63) >> 6) - (off[:-1] >> 6)).max())


def canonical_probes(probes: torch.Tensor) -> torch.Tensor:
    """Replace repeats of a cluster within one query's probe row by -1 (first slot wins).

    int64 [B, P] -> int64 [B, P]; device-side, no host synchronisation.
    """
    if probes.shape[1] < 2:
        return probes
    sorted_c, order = torch.sort(probes, dim=1, stable=True)
    dup = torch.zeros_like(sorted_c, dtype=torch.bool)
    dup[:, 1:] = (sorted_c[:, 1:] == sorted_c[:, :-1]) & (sorted_c[:, 1:] >= 0)
    dup_orig = torch.zeros_like(dup).scatter_(1, order, dup)
    return torch.where(dup_orig, torch.full_like(probes, -1), probes)


def check_inputs(queries, codes, scale, offset, cluster_offsets, probes, k, bitmask, centroids=None,
                 centroid_queries=None) -> None:
    """Shapes and dtypes (no data-dependent checks: those need a host sync)."""
    if (centroids is None) != (centroid_queries is None):
        raise ValueError("centroids and centroid_queries go together (residual codes)")
    if centroids is not None and (tuple(centroids.shape) != (cluster_offsets.numel() - 1, queries.shape[1])
                                  or tuple(centroid_queries.shape) != tuple(queries.shape)):
        raise ValueError(f"centroids must be [nlist, D] = [{cluster_offsets.numel() - 1}, {queries.shape[1]}] and "
                         f"centroid_queries [B, D] = {tuple(queries.shape)}, got {tuple(centroids.shape)} and "
                         f"{tuple(centroid_queries.shape)}")
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"codes must be int8 [N, D], got {codes.dtype} {tuple(codes.shape)}")
    if queries.dim() != 2 or queries.shape[1] != codes.shape[1]:
        raise ValueError(f"queries must be [B, {codes.shape[1]}], got {tuple(queries.shape)}")
    if scale.numel() != 1 or offset.numel() != 1:
        raise ValueError("scale and offset must be scalars")
    if cluster_offsets.dtype != torch.int64 or cluster_offsets.dim() != 1 or cluster_offsets.numel() < 2:
        raise ValueError(
            f"cluster_offsets must be int64 [nlist + 1], got {cluster_offsets.dtype} {tuple(cluster_offsets.shape)}"
        )
    if probes.dtype != torch.int64 or probes.dim() != 2 or probes.shape[0] != queries.shape[0]:
        raise ValueError(f"probes must be int64 [{queries.shape[0]}, P], got {probes.dtype} {tuple(probes.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if bitmask is not None:
        if bitmask.dtype != torch.int64 or bitmask.dim() != 3 or tuple(bitmask.shape[:2]) != tuple(probes.shape):
            raise ValueError(
                f"bitmask must be int64 [{probes.shape[0]}, {probes.shape[1]}, Wc], "
                f"got {bitmask.dtype} {tuple(bitmask.shape)}"
            )


def probe_terms(centroid_queries, centroids, probes, query_scale, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual codes: the cluster term of each query's probed clusters (probes int64 [B, P], -1 = none) as
    (bias int32 [B, nlist], meaningful at the probed clusters; shift float32 [B], the best of them):
    `common.cluster_bias` over the visited clusters, scores in csrc/widen.h's order (`common.dot_lanes`, as
    the C++ search computes them)."""
    B, nlist = probes.shape[0], centroids.shape[0]
    slot = probes.clamp(min=0)
    scores = torch.zeros(B, nlist, dtype=torch.float32, device=probes.device)
    scores.scatter_(1, slot, dot_lanes(centroid_queries[:, None, :], centroids.float()[slot]))
    visited = torch.zeros(B, nlist + 1, dtype=torch.bool, device=probes.device)
    visited.scatter_(1, torch.where(probes >= 0, probes, nlist), True)
    return cluster_bias(scores, query_scale, scale, visited[:, :nlist])


def _ivf_scan_impl(queries, codes, scale, offset, cluster_offsets, probes, k, bitmask, keys_fn, centroids=None,
                   centroid_queries=None):
    check_inputs(queries, codes, scale, offset, cluster_offsets, probes, k, bitmask, centroids, centroid_queries)
    qcodes, qscale = quantize_queries(queries)
    probes = canonical_probes(probes)
    bias, shift = (None, None) if centroids is None else probe_terms(centroid_queries, centroids, probes, qscale, scale)
    keys = keys_fn(qcodes, codes, cluster_offsets, probes, k, bitmask, bias=bias)
    int_scores, rows = split_keys(keys)
    scores = dequantize_scores(int_scores, qscale, queries.float().sum(dim=1), scale, offset, valid=rows >= 0)
    return scores if shift is None else scores + shift[:, None], rows


def ivf_scan_cuda(queries, codes, scale, offset, cluster_offsets, probes, k, bitmask=None, window_words=0,
                  centroids=None, centroid_queries=None):
    """The op on CUDA: the Triton scan (tests run it on CPU tensors under TRITON_INTERPRET=1)."""
    from silverrec.kernels.ivf_scan_triton import scan_keys_triton

    keys_fn = partial(scan_keys_triton, window_words=window_words)
    return _ivf_scan_impl(queries, codes, scale, offset, cluster_offsets, probes, k, bitmask, keys_fn, centroids,
                          centroid_queries)


torch.library.register_kernel("silverrec::ivf_scan", "cuda", ivf_scan_cuda)


def ivf_scan_reference(
    queries: torch.Tensor,
    codes: torch.Tensor,
    cluster_offsets: torch.Tensor,
    probes: torch.Tensor,
    k: int,
    bitmask: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent, straightforward reference (for tests and benchmarks); bias: optional int32
    [B, nlist] added to the dot products of each cluster's rows.

    Per query: walk its probe slots, skip -1 and repeated clusters, test each row's bit one by one,
    score the allowed rows with exact int64 dot products, stable-sort. Returns (int64 integer
    scores [B, k], int64 rows [B, k]) with padding score INT64_MIN... no: padding score 0, row -1.
    """
    qcodes, _ = quantize_queries(queries)
    q64 = qcodes.to(torch.int64)
    off = [int(v) for v in cluster_offsets]
    out_s = torch.zeros(queries.shape[0], k, dtype=torch.int64)
    out_r = torch.full((queries.shape[0], k), -1, dtype=torch.int64)
    for b in range(queries.shape[0]):
        seen, rows = set(), []
        for j, c in enumerate(int(v) for v in probes[b]):
            if c < 0 or c in seen:
                continue
            seen.add(c)
            for r in range(off[c], off[c + 1]):
                if bitmask is not None:
                    word = int(bitmask[b, j, (r >> 6) - (off[c] >> 6)]) & ((1 << 64) - 1)
                    if not (word >> (r & 63)) & 1:
                        continue
                rows.append(r)
        if not rows:
            continue
        rows_t = torch.tensor(sorted(rows), dtype=torch.int64)
        s = codes[rows_t].to(torch.int64) @ q64[b]
        if bias is not None:
            s = s + bias[b].to(torch.int64)[torch.searchsorted(cluster_offsets, rows_t, right=True) - 1]
        order = torch.sort(-s, stable=True).indices[:k]
        out_s[b, : order.numel()] = s[order]
        out_r[b, : order.numel()] = rows_t[order]
    return out_s, out_r
