"""Triton path of `silverrec::filter_plan` on CUDA (the contract is in kernels/filter_plan.py).

`filter_plan_torch` issues some seventy small launches per batch (benchmarks/cuda_launches.py).
Here the candidates stay the reference's call (`centroid_candidates_torch`: one matmul on CUDA and one
stable sort, ties to the lower cluster, as plan.cpp), and everything else is two Triton kernels with one
program per query around the Triton `bloom_filter_counts` (13 launches in all):

    cand = centroid_candidates_torch(queries, centroids, max_probe)   # int64 [B, P], best first
    _plan_ranges_kernel:  posting route (sum of the query's list sizes <= posting_limit, not
                          probed mode) -> ROUTE_POSTING; row ranges [lo, hi) of the candidates
                          (lo = NO_CLUSTER: not evaluated, for posting and unprobed-mode queries)
    bloom_filter_counts_triton(lo, hi)                  # bitmask [B, P, Wc], matches [B, P]
    _plan_route_kernel:   cumulative matches (tl.cumsum), target = k x match_factor / sqrt(density),
                          probes needed, scanned rows, whole-pool estimate -> probes, route

The float32 arithmetic is the reference's operation by operation: int64 counts converted to
float32, division and square root correctly rounded (`tl.div_rn`, `tl.sqrt_rn`: a plain `/` lowers
to an approximate division on NVIDIA GPUs), no fused multiply-adds, so the routes are identical to
plan.cpp and `filter_plan_torch` (tests/test_filter_plan_triton.py). No host synchronisation;
memory O(B x C) for the scores, O(B x P x Wc) for the bitmask. Runs on CPU tensors under
TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from silverrec.kernels import constants
from silverrec.kernels.bloom_filter_triton import bloom_filter_counts_triton
from silverrec.kernels.centroid_probe import centroid_candidates_torch
from silverrec.kernels.search_args import FilteredIvfParams, FilteredIvfTensors, Program

# the shared constants (kernels/constants.py), as the compile-time globals a Triton kernel may read
MODE_AUTO = tl.constexpr(constants.MODE_AUTO)
MODE_PROBED = tl.constexpr(constants.MODE_PROBED)
MODE_UNPROBED = tl.constexpr(constants.MODE_UNPROBED)
ROUTE_PROBED = tl.constexpr(constants.ROUTE_PROBED)
ROUTE_WHOLE_POOL = tl.constexpr(constants.ROUTE_WHOLE_POOL)
ROUTE_POSTING = tl.constexpr(constants.ROUTE_POSTING)
NO_LISTS = tl.constexpr(constants.NO_LISTS)
NO_LIST = tl.constexpr(constants.NO_LIST)
NO_CLUSTER = tl.constexpr(constants.NO_CLUSTER)


@triton.jit
def _plan_ranges_kernel(
    lists_ptr,  # int64 [B, T2] posting lists per query (NO_LIST unused; lists[b, 0] == NO_LISTS: none)
    post_sizes_ptr,  # int64 [V + 1] list lengths plus a trailing 0
    mode_ptr,  # int64 [B] MODE_AUTO, MODE_PROBED or MODE_UNPROBED
    cand_ptr,  # int64 [B, P] candidate clusters, best first
    off_ptr,  # int64 [C + 1] cluster offsets
    lo_ptr,  # out int64 [B, P] first row of each candidate (NO_CLUSTER: not evaluated)
    hi_ptr,  # out int64 [B, P] end row of each candidate
    route_ptr,  # out int64 [B] ROUTE_POSTING, else ROUTE_PROBED (set by _plan_route_kernel)
    T2,
    V,
    P,
    posting_limit,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """posting[b] = lists[b, 0] != NO_LISTS and sum_t post_sizes[lists[b, t]] <= posting_limit and mode[b] !=
    MODE_PROBED (list ids outside [0, V) count 0); lo/hi[b, j] = off[cand[b, j]], off[cand[b, j] + 1], lo =
    NO_CLUSTER when the query is on the posting route or unprobed by its mode."""
    b = tl.program_id(0).to(tl.int64)
    mode = tl.load(mode_ptr + b)
    size = tl.zeros((BLOCK_T,), tl.int64)
    for t0 in range(0, T2, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        lid = tl.load(lists_ptr + b * T2 + t, mask=t < T2, other=NO_LIST)
        lid = tl.where((lid >= 0) & (lid < V), lid, V)
        size += tl.load(post_sizes_ptr + lid, mask=t < T2, other=0)
    first = tl.load(lists_ptr + b * T2, mask=T2 > 0, other=NO_LISTS)
    posting = (first != NO_LISTS) & (tl.sum(size, axis=0) <= posting_limit) & (mode != MODE_PROBED)
    skip = posting | (mode == MODE_UNPROBED)
    tl.store(route_ptr + b, tl.where(posting, ROUTE_POSTING, ROUTE_PROBED).to(tl.int64))
    j = tl.arange(0, BLOCK_P)
    c = tl.load(cand_ptr + b * P + j, mask=j < P, other=0)
    lo = tl.load(off_ptr + c, mask=j < P, other=0)
    hi = tl.load(off_ptr + c + 1, mask=j < P, other=0)
    tl.store(lo_ptr + b * P + j, tl.where(skip, NO_CLUSTER, lo), mask=j < P)
    tl.store(hi_ptr + b * P + j, hi, mask=j < P)


@triton.jit
def _plan_route_kernel(
    matches_ptr,  # int64 [B, P] matching rows per candidate (bloom_filter_counts)
    cand_ptr,  # int64 [B, P]
    off_ptr,  # int64 [C + 1]
    mode_ptr,  # int64 [B]
    probes_ptr,  # out int64 [B, P] clusters to scan, best first (NO_CLUSTER = none)
    route_ptr,  # in/out int64 [B]: ROUTE_POSTING from _plan_ranges_kernel, else ROUTE_PROBED / ROUTE_WHOLE_POOL
    P,
    nprobe,
    base,  # float32 k x match_factor
    num_items_f,  # float32 pool size
    ratio,  # float32 exact_cost_ratio
    BLOCK_P: tl.constexpr,
):
    """Per query, in filter_plan_torch's float32 arithmetic:
    target = base / sqrt(total / cand_rows), need = #{j : cum[j] < target} + 1,
    use = nprobe (MODE_PROBED) or clamp(need, nprobe, P), scanned = rows of the first `use` candidates,
    whole pool (MODE_AUTO) iff total < target or scanned > total x (num_items / cand_rows) x ratio."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_P)
    inb = j < P
    mode = tl.load(mode_ptr + b)
    posting = tl.load(route_ptr + b) == ROUTE_POSTING
    c = tl.load(cand_ptr + b * P + j, mask=inb, other=0)
    sizes = tl.load(off_ptr + c + 1, mask=inb, other=0) - tl.load(off_ptr + c, mask=inb, other=0)
    matches = tl.load(matches_ptr + b * P + j, mask=inb, other=0)
    cum = tl.cumsum(matches, axis=0)
    total = tl.sum(matches, axis=0).to(tl.float32)
    cand_rows = tl.maximum(tl.sum(sizes, axis=0), 1).to(tl.float32)
    target = tl.div_rn(base, tl.sqrt_rn(tl.div_rn(total, cand_rows)))
    need = tl.sum((inb & (cum.to(tl.float32) < target)).to(tl.int64), axis=0) + 1
    use = tl.where(mode == MODE_PROBED, nprobe, tl.minimum(tl.maximum(need, nprobe), P))
    chosen = j < use
    scanned = tl.sum(tl.where(chosen, sizes, 0), axis=0).to(tl.float32)
    est_total = total * tl.div_rn(num_items_f, cand_rows)
    auto = (total < target) | (scanned > est_total * ratio)
    unprobed = tl.where(mode == MODE_AUTO, auto, mode == MODE_UNPROBED) & ~posting
    keep = chosen & ~unprobed & ~posting
    tl.store(probes_ptr + b * P + j, tl.where(keep, c, NO_CLUSTER), mask=inb)
    route = tl.where(posting, ROUTE_POSTING, tl.where(unprobed, ROUTE_WHOLE_POOL, ROUTE_PROBED))
    tl.store(route_ptr + b, route.to(tl.int64))


def filter_plan_triton(queries, index, params, exact_cost_ratio: float, program, mode, k: int, nprobe: int,
                       max_probe: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher (same arguments and outputs as `filter_plan_torch`, checked by filter_plan.checked_args).

    Returns probes int64 [B, max_probe], bitmask int64 [B, max_probe, window_words], route int64 [B].
    """
    ix, pa, pr = FilteredIvfTensors(*index), FilteredIvfParams(*params), Program(*program)
    B, P = queries.shape[0], max_probe
    dev = queries.device
    cand = centroid_candidates_torch(queries, ix.centroids, P)  # [B, P]: the reference's call, so the same candidates
    lo = torch.empty((B, P), dtype=torch.int64, device=dev)
    hi = torch.empty((B, P), dtype=torch.int64, device=dev)
    route = torch.empty((B,), dtype=torch.int64, device=dev)
    probes = torch.empty((B, P), dtype=torch.int64, device=dev)
    if B == 0:
        return probes, torch.zeros((0, P, pa.window_words), dtype=torch.int64, device=dev), route
    T2 = pr.lists.shape[1]
    BLOCK_P = max(16, triton.next_power_of_2(P))
    _plan_ranges_kernel[(B,)](
        pr.lists, ix.post_sizes, mode, cand, ix.cluster_offsets, lo, hi, route, T2, ix.post_sizes.shape[0] - 1, P,
        pa.posting_limit, BLOCK_T=max(16, min(256, triton.next_power_of_2(max(T2, 1)))), BLOCK_P=BLOCK_P,
    )
    bitmask, matches = bloom_filter_counts_triton(ix.bits, pr.ops, pr.rows, lo, hi, pa.window_words)
    _plan_route_kernel[(B,)](
        matches, cand, ix.cluster_offsets, mode, probes, route, P, nprobe,
        float(k * pa.match_factor), float(pa.num_items), float(exact_cost_ratio), BLOCK_P=BLOCK_P,
    )
    return probes, bitmask, route
