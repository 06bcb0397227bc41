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

CPU, fast path: the fused C++ scan (`kernels/csrc/`, `silverrec.kernels._cpu.ivf_scan_keys`) when the
extension is built: each probed cluster is one segment with the queries that probe it, visited in
order of the best probe rank; rows whose bitmask bit is 0 are skipped before any dot product (a zero
word skips 64 rows); int8 VNNI dot products feed a per-query running top-k (threshold + candidate
buffer compacted with nth_element); no Python per cluster.

CPU, torch path (`scan_keys_cpu`, the fallback without the extension): the union of the batch's probed clusters is visited in order of the best
probe rank any query gave it (so each query's nearest clusters come first and its k-th best score
rises early), in chunks of about CHUNK_ROWS rows. Within a chunk, clusters are sorted by id and
merged into contiguous row runs (small gaps included and masked) and each run is one int8 x int8 ->
int32 `torch._int_mm` (AMX / VNNI) of all B queries into a [rows, B] buffer. An entry becomes a
candidate only if its query probed that cluster and its score reaches the query's current k-th
best; candidates (after the bitmask) are merged into the running top-k sort keys. Memory is
O(CHUNK_ROWS * B + B * k): no [B, N] matrix, no copy of the probed rows. CUDA: the Triton kernel in
`ivf_scan_triton.py`.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import numpy as np
import torch

from silverrec.kernels.common import cluster_bias, cluster_of_rows, dequantize_scores, dot_lanes, make_keys, quantize_queries, split_keys
from silverrec.kernels.constants import EMPTY_KEY
from silverrec.kernels.cpu_ext import cpu_ext

CHUNK_ROWS = 32768  # rows of the union scored per chunk: buffer int32 [CHUNK_ROWS, B]
GAP_ROWS = 512  # unprobed rows between two runs cheaper to score (and mask) than a second matmul


def merge_candidates(best: torch.Tensor, cand_query: torch.Tensor, cand_keys: torch.Tensor) -> torch.Tensor:
    """Merge ragged candidates into the running top-k keys.

    Args:
        best: int64 [B, k] current best keys.
        cand_query: int64 [M] query index of each candidate (sorted ascending).
        cand_keys: int64 [M] candidate keys.
    Returns:
        int64 [B, k] new best keys (unsorted).
    """
    B, k = best.shape
    counts = torch.bincount(cand_query, minlength=B)
    width = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(cand_query.numel(), device=best.device) - starts[cand_query]
    padded = torch.full((B, width), EMPTY_KEY, dtype=torch.int64, device=best.device)
    padded[cand_query, pos] = cand_keys
    return torch.cat([best, padded], dim=1).topk(k, dim=1, sorted=False).values


INT32_MAX = torch.iinfo(torch.int32).max


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


def _check_values(codes, cluster_offsets, probes, bitmask) -> None:
    """Data-dependent checks (host side; CPU implementation only)."""
    nlist = cluster_offsets.numel() - 1
    off = cluster_offsets
    if int(off[0]) != 0 or int(off[-1]) != codes.shape[0] or bool((off[1:] < off[:-1]).any()):
        raise ValueError(f"cluster_offsets must rise from 0 to N={codes.shape[0]}")
    if probes.numel() and (int(probes.min()) < -1 or int(probes.max()) >= nlist):
        raise ValueError(f"probes must hold cluster ids in [0, {nlist}) or -1")
    if bitmask is not None and bitmask.shape[2] < bitmask_words(off):
        raise ValueError(f"bitmask has {bitmask.shape[2]} words per slot, the index needs {bitmask_words(off)}")


def _allowed(bitmask, cand_b, rows, clusters, slot_of, off) -> torch.Tensor:
    """Bitmask test for candidate (query, row) pairs -> bool [M]."""
    slot = slot_of[cand_b, clusters]
    word = bitmask[cand_b, slot, (rows >> 6) - (off[clusters] >> 6)]
    return ((word >> (rows & 63)) & 1).bool()


def _plan_segments(off: np.ndarray, probes: np.ndarray, chunk_rows: int, gap_rows: int):
    """Host-side plan: the row ranges to score, grouped into chunks.

    The union of the batch's probed clusters, in id order, is merged into contiguous row runs
    (gaps of <= gap_rows unprobed rows are included: one matmul over them is cheaper than two
    calls), and the runs are cut into chunks of at most chunk_rows rows.

    Returns a list of chunks, each a list of (start, stop) row ranges.
    """
    B, P = probes.shape
    nlist = off.shape[0] - 1
    hit = np.zeros(nlist + 1, dtype=bool)
    hit[np.where(probes >= 0, probes, nlist).ravel()] = True
    union = np.flatnonzero(hit[:nlist])
    union = union[off[union + 1] > off[union]]  # empty clusters need no scan
    if union.size == 0:
        return []
    starts, stops = off[union], off[union + 1]
    new_run = np.ones(union.size, dtype=bool)
    new_run[1:] = starts[1:] - stops[:-1] > gap_rows
    first = np.flatnonzero(new_run)
    last = np.r_[first[1:], union.size] - 1
    chunks, current, filled = [], [], 0
    for a, z in zip(starts[first].tolist(), stops[last].tolist()):
        while a < z:
            take = min(z - a, chunk_rows - filled)
            current.append((a, a + take))
            filled += take
            a += take
            if filled == chunk_rows:
                chunks.append(current)
                current, filled = [], 0
    if current:
        chunks.append(current)
    return chunks


def _pilot_slots(cluster_offsets: torch.Tensor, probes: torch.Tensor, k: int) -> torch.Tensor:
    """bool [B, P]: each query's first probe slots until they hold >= k items (all slots if fewer)."""
    sizes = cluster_offsets[1:] - cluster_offsets[:-1]
    slot_sizes = torch.where(probes >= 0, sizes[probes.clamp_min(0)], 0)
    before = torch.cumsum(slot_sizes, dim=1) - slot_sizes
    return (before < k) & (probes >= 0)


def _pairs(probes: torch.Tensor, slots: torch.Tensor, nlist: int) -> torch.Tensor:
    """bool [nlist + 1, B]: pairs[c, b] = query b scans cluster c in the given slots."""
    B = probes.shape[0]
    c = torch.where(slots, probes, nlist)
    pairs = torch.zeros(nlist + 1, B, dtype=torch.bool)
    pairs[c, torch.arange(B)[:, None].expand_as(probes)] = True
    pairs[nlist] = False
    return pairs


def _nonzero_by_query(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (b, j) of the True entries of a sparse bool [R, B], sorted by query b.

    Rows without any hit are dropped first, 8 entries per int64 compare (B a multiple of 8), so
    nonzero only walks the rare rows that have one.
    """
    R, B = mask.shape
    if B % 8 == 0 and R > 0:
        hit = mask.view(torch.int64).ne(0).any(dim=1).nonzero().flatten()
        b, jj = mask[hit].t().nonzero(as_tuple=True)
        return b, hit[jj]
    return mask.t().nonzero(as_tuple=True)


def _scan_pass(best, qt, codes, cluster_offsets, pairs, probes_np, chunk_rows, gap_rows, dense, bitmask, slot_of, bias):
    """Score the clusters in `pairs` chunk by chunk and merge qualifying entries into `best`.

    dense: mask entries by pairs before the threshold (first pass, when thresholds are still
    low); otherwise only candidates above the threshold are looked up in `pairs`.
    """
    B = qt.shape[1]
    buf = torch.empty(chunk_rows, B, dtype=torch.int32)
    for segments in _plan_segments(cluster_offsets.numpy(), probes_np, chunk_rows, gap_rows):
        pos = 0
        for a, z in segments:
            torch._int_mm(codes[a:z], qt, out=buf[pos : pos + z - a])
            pos += z - a
        scores = buf[:pos]
        seg = torch.tensor(segments, dtype=torch.int64)  # [S, 2] row ranges
        seg_len = seg[:, 1] - seg[:, 0]
        if bias is not None:  # residual codes: + bias[b, cluster of the row]
            chunk_rows_ = torch.cat([torch.arange(a, z) for a, z in segments])
            scores = scores + bias[:, cluster_of_rows(cluster_offsets, chunk_rows_)].t()
        # Only entries reaching the query's current k-th best can enter (EMPTY -> int32 min: all).
        threshold = (best.amin(dim=1) >> 32).to(torch.int32)  # [B]
        mask = scores >= threshold[None, :]
        if dense:
            all_rows = torch.repeat_interleave(seg[:, 0] - (torch.cumsum(seg_len, 0) - seg_len), seg_len)
            all_rows += torch.arange(pos)
            mask &= pairs[cluster_of_rows(cluster_offsets, all_rows)]
        b, j = _nonzero_by_query(mask)
        if b.numel() == 0:
            continue
        seg_end = torch.cumsum(seg_len, 0)
        s_of_j = torch.searchsorted(seg_end, j, right=True)
        rows = seg[s_of_j, 1] - (seg_end[s_of_j] - j)
        clusters = cluster_of_rows(cluster_offsets, rows)
        ok = None if dense else pairs[clusters, b]  # drops gap rows and other queries' clusters
        if bitmask is not None:
            allowed = _allowed(bitmask, b, rows, clusters, slot_of, cluster_offsets)
            ok = allowed if ok is None else ok & allowed
        if ok is not None and not bool(ok.all()):
            b, j, rows = b[ok], j[ok], rows[ok]
            if b.numel() == 0:
                continue
        best = merge_candidates(best, b, make_keys(scores[j, b], rows))
    return best


def scan_keys_cpu(
    qcodes: torch.Tensor,
    codes: torch.Tensor,
    cluster_offsets: torch.Tensor,
    probes: torch.Tensor,
    k: int,
    bitmask: Optional[torch.Tensor],
    chunk_rows: int = CHUNK_ROWS,
    gap_rows: int = GAP_ROWS,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Top-k sort keys int64 [B, k] (descending, EMPTY_KEY padding) of the probed, allowed rows.

    Two passes over disjoint (query, cluster) pairs: the pilot pass scans each query's first probe
    slots until they hold k items (its nearest clusters, so its k-th best score there is a tight
    lower bound of the final one), exactly; the main pass scans the remaining pairs and only looks
    at entries reaching that bound.

    Args: qcodes int8 [B, D]; codes int8 [N, D]; cluster_offsets int64 [nlist + 1];
    probes int64 [B, P] canonical (no repeats, see `canonical_probes`); bitmask as in the op; bias
    optional int32 [B, nlist] added to the dot products of each cluster's rows (`common.cluster_bias`).
    """
    B = qcodes.shape[0]
    nlist = cluster_offsets.numel() - 1
    best = torch.full((B, k), EMPTY_KEY, dtype=torch.int64)
    if probes.shape[1] == 0 or B == 0:
        return best
    qt = qcodes.contiguous().t()  # [D, B] column-major, as _int_mm wants its second operand
    slot_of = None
    if bitmask is not None:
        slot_of = torch.zeros(B, nlist + 1, dtype=torch.int64)
        slot_c = torch.where(probes >= 0, probes, nlist)
        slot_of[torch.arange(B)[:, None].expand_as(probes), slot_c] = torch.arange(probes.shape[1]).expand_as(probes)
    pilot = _pilot_slots(cluster_offsets, probes, k)
    rest = (probes >= 0) & ~pilot
    for slots, dense in ((pilot, True), (rest, False)):
        if not bool(slots.any()):
            continue
        pairs = _pairs(probes, slots, nlist)
        probes_np = torch.where(slots, probes, -1).numpy()
        best = _scan_pass(best, qt, codes, cluster_offsets, pairs, probes_np, chunk_rows, gap_rows, dense, bitmask, slot_of,
                          bias)
    return best.sort(dim=1, descending=True).values


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


@torch.library.custom_op("silverrec::ivf_scan", mutates_args=())
def ivf_scan(
    queries: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    cluster_offsets: torch.Tensor,
    probes: torch.Tensor,
    k: int,
    bitmask: Optional[torch.Tensor] = None,
    window_words: int = 0,
    centroids: Optional[torch.Tensor] = None,
    centroid_queries: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU (C++ fast path, torch fallback). See the module docstring for the contract."""
    check_inputs(queries, codes, scale, offset, cluster_offsets, probes, k, bitmask, centroids, centroid_queries)
    ext = cpu_ext()
    if ext is None:
        _check_values(codes, cluster_offsets, probes, bitmask)
        return _ivf_scan_impl(queries, codes, scale, offset, cluster_offsets, probes, k, bitmask, scan_keys_cpu,
                              centroids, centroid_queries)
    if probes.numel() and int(probes.max()) < 0:  # nothing probed (e.g. every query took another route)
        b = queries.shape[0]
        return torch.full((b, k), float("-inf")), torch.full((b, k), -1, dtype=torch.int64)
    qcodes, qscale = quantize_queries(queries)
    bias, shift = (None, None) if centroids is None else probe_terms(
        centroid_queries, centroids, canonical_probes(probes), qscale, scale)
    # value checks (cluster_offsets, probe ids, bitmask width) happen in C++ and raise ValueError
    keys = ext.ivf_scan_keys(
        qcodes, codes.contiguous(), cluster_offsets.contiguous(), probes.contiguous(),
        None if bitmask is None else bitmask.contiguous(), k, bias,
    )
    scores, rows = ext.keys_to_results(keys, qscale, queries.float().sum(dim=1), scale, offset)
    return scores if shift is None else scores + shift[:, None], rows


@ivf_scan.register_fake
def _(queries, codes, scale, offset, cluster_offsets, probes, k, bitmask=None, window_words=0, centroids=None,
      centroid_queries=None):
    b = queries.shape[0]
    return queries.new_empty(b, k, dtype=torch.float32), queries.new_empty(b, k, dtype=torch.int64)


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
