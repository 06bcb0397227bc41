"""`silverrec::filter_plan`: per-query routing of the filtered IVF search (silverrec/retrieval/filtered_ivf.py).

    probes, bitmask, route = torch.ops.silverrec.filter_plan(
        queries, index, params, exact_cost_ratio, program, mode, k, nprobe, max_probe)
    # queries float32 [B, D]; index, params, exact_cost_ratio: the filtered IVF index as silverrec::filtered_ivf_search
    # takes it (kernels/search_args.py: FILTERED_IVF_TENSORS, FILTERED_IVF_PARAMS), of which the plan reads
    # centroids float32 [C, D], cluster_offsets int64 [C + 1], the row bank bits, post_sizes int64 [V + 1] (list
    # lengths plus a trailing 0), window_words, match_factor, num_items and posting_limit
    # program: the request's filter programs (PROGRAM_TENSORS), of which the plan reads the Bloom programs
    # (ops, rows: kernels/bloom_filter.py) and lists int64 [B, T2], the posting lists per query (NO_LIST
    # unused; lists[b, 0] == NO_LISTS: none); mode int64 [B] (MODE_AUTO, MODE_PROBED, MODE_UNPROBED)
    # -> probes int64 [B, max_probe] clusters to scan, best first (NO_CLUSTER = none)
    #    bitmask int64 [B, max_probe, window_words] the filter on each candidate cluster's rows
    #    route int64 [B]: ROUTE_PROBED (scan `probes` with `bitmask`), ROUTE_WHOLE_POOL (whole pool, then exact
    #    scan), ROUTE_POSTING (posting lists, then exact scan); kernels/constants.py names them all

The decisions, per query (the module docstring of silverrec/retrieval/filtered_ivf.py explains why):
posting route when the lists hold <= posting_limit rows (not in probed mode); otherwise the
`max_probe` best centroids by inner product (silverrec::centroid_candidates, kernels/centroid_probe.py), the filter and its match
count on each, the shortest prefix holding target = k x match_factor / sqrt(d) matches, d = the
candidates' match density (matches / rows; at least nprobe clusters, exactly nprobe in probed
mode), and the whole-pool route when even all candidates hold fewer, or when the prefix would scan
more rows than the pool's estimated matches x exact_cost_ratio.

CPU: one fused C++ call (kernels/csrc/plan.cpp), same float32 arithmetic; a batch routed to posting
lists or unprobed by its mode computes no centroid scores (on every path, an unprobed query's
candidate clusters are not evaluated: its bitmask rows are zero). `filter_plan_torch`, the same
steps as tensor ops with no host synchronisation, is the tests' reference of the other paths. CUDA: the fused
search's probe and plan kernels (kernels/probe_triton.py, kernels/search_triton.py `fused_filter_plan`): a memset
and two launches where the composition issues some eighty (benchmarks/cuda_launches.py).
"""

from __future__ import annotations

import torch

from silverrec.kernels.centroid_probe import centroid_candidates_torch
from silverrec.kernels.constants import (MODE_AUTO, MODE_PROBED, MODE_UNPROBED, NO_CLUSTER, NO_LISTS, ROUTE_POSTING,
                                         ROUTE_PROBED, ROUTE_WHOLE_POOL)

# filter_plan_torch reads a route off the posting lists as int(unprobed): one cast (one kernel on a GPU), not a
# select between two filled tensors
assert (ROUTE_PROBED, ROUTE_WHOLE_POOL) == (0, 1)
from silverrec.kernels.search_args import FilteredIvfParams, FilteredIvfTensors, Program, unpack


def filter_plan_torch(queries, index, params, exact_cost_ratio: float, program, mode, k: int, nprobe: int,
                      max_probe: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same steps as tensor ops (the reference of the C++ and Triton paths); arguments as the op's, checked
    (`checked_args`)."""
    ix, pa, pr = FilteredIvfTensors(*index), FilteredIvfParams(*params), Program(*program)
    lists, post_sizes, offsets = pr.lists, ix.post_sizes, ix.cluster_offsets
    n_lists = post_sizes.shape[0] - 1
    sizes_l = post_sizes[torch.where(lists >= 0, lists, torch.full_like(lists, n_lists))].sum(dim=1)
    posting = (lists[:, 0] != NO_LISTS) & (sizes_l <= pa.posting_limit) & (mode != MODE_PROBED)
    cand = centroid_candidates_torch(queries, ix.centroids, max_probe)  # [B, P] best first, ties to the lower cluster
    skip = posting | (mode == MODE_UNPROBED)  # posting route, or whole pool by the caller's choice: no candidates
    lo = torch.where(skip[:, None], torch.full_like(cand, NO_CLUSTER), offsets[cand])  # not evaluated
    hi = offsets[cand + 1]
    bitmask, matches = torch.ops.silverrec.bloom_filter_counts(ix.bits, pr.ops, pr.rows, lo, hi, pa.window_words)
    cum = torch.cumsum(matches, dim=1)
    sizes = hi - offsets[cand]
    cand_rows = sizes.sum(dim=1).clamp_min(1)
    total = cum[:, -1].to(torch.float32)
    # matches to collect: k x match_factor / sqrt(the candidates' match density) (float32, as plan.cpp)
    target = torch.full_like(total, float(k * pa.match_factor)) / torch.sqrt(total / cand_rows.to(torch.float32))
    need = (cum < target[:, None]).sum(dim=1) + 1  # probes to reach the target (P + 1 if never)
    use = torch.where(mode == MODE_PROBED, torch.full_like(need, nprobe), need.clamp(min=nprobe, max=max_probe))
    slot = torch.arange(cand.shape[1], device=queries.device)[None, :]
    chosen = slot < use[:, None]
    scanned = torch.where(chosen, sizes, torch.zeros_like(sizes)).sum(dim=1)
    # one float32 division, as plan.cpp (a Python number over a tensor is reciprocal x number: two roundings)
    est_total = total * (torch.full_like(total, float(pa.num_items)) / cand_rows.to(torch.float32))
    auto = (total < target) | (scanned.to(torch.float32) > est_total * exact_cost_ratio)
    unprobed = torch.where(mode == MODE_AUTO, auto, mode == MODE_UNPROBED) & ~posting
    probes = torch.where(chosen & ~unprobed[:, None] & ~posting[:, None], cand, torch.full_like(cand, NO_CLUSTER))
    route = torch.where(posting, torch.full_like(mode, ROUTE_POSTING), unprobed.to(torch.int64))
    return probes, bitmask, route


def checked_args(queries, index, params, exact_cost_ratio, program, mode, k, nprobe, max_probe) -> tuple:
    """The op's arguments validated and normalised (float32 / int64 contiguous tensors) for the Python paths."""
    ix = unpack(FilteredIvfTensors, index, "filter_plan", "index")
    unpack(FilteredIvfParams, params, "filter_plan", "params")
    unpack(Program, program, "filter_plan", "program")
    if not 1 <= nprobe <= max_probe <= ix.centroids.shape[0]:
        raise ValueError(f"need 1 <= nprobe ({nprobe}) <= max_probe ({max_probe}) <= nlist ({ix.centroids.shape[0]})")
    index = ix._replace(centroids=ix.centroids.float())
    return (queries.float().contiguous(), [t.contiguous() for t in index], [int(p) for p in params], float(exact_cost_ratio),
            [t.contiguous() for t in program], mode.to(torch.int64).contiguous(), k, nprobe, max_probe)


def filter_plan_cuda(queries, index, params, exact_cost_ratio, program, mode, k, nprobe, max_probe):
    """The op on CUDA: the probe and plan kernels of kernels/search_triton.py (tests run them on CPU tensors under
    TRITON_INTERPRET=1); more candidates than the probe's merge takes: filter_plan_torch."""
    from silverrec.kernels.search_triton import fused_filter_plan

    args = checked_args(queries, index, params, exact_cost_ratio, program, mode, k, nprobe, max_probe)
    out = fused_filter_plan(*args)
    return filter_plan_torch(*args) if out is None else out


torch.library.register_kernel("silverrec::filter_plan", "cuda", filter_plan_cuda)
