"""`silverrec::filter_plan`: per-query routing of the filtered IVF search (silverrec/retrieval/filtered_ivf.py).

    probes, bitmask, route = torch.ops.silverrec.filter_plan(
        queries, centroids, cluster_offsets, bits, ops, rows, lists, post_sizes, mode,
        k, nprobe, max_probe, window_words, match_factor, avg_cluster, num_items, exact_cost_ratio, posting_limit)
    # queries float32 [B, D], centroids float32 [C, D], cluster_offsets int64 [C + 1]
    # (bits, ops, rows) the row bank and the Bloom filter programs (kernels/bloom_filter.py)
    # lists int64 [B, T2] posting lists per query (-1 unused; lists[b, 0] == -2: none)
    # post_sizes int64 [V + 1] list lengths plus a trailing 0; mode int64 [B] (0 auto, 1 probed, 2 unprobed)
    # -> probes int64 [B, max_probe] clusters to scan, best first (-1 = none)
    #    bitmask int64 [B, max_probe, window_words] the filter on each candidate cluster's rows
    #    route int64 [B]: 0 = scan `probes` with `bitmask`, 1 = whole pool then exact scan, 2 = posting lists

The decisions, per query (the module docstring of silverrec/retrieval/filtered_ivf.py explains why):
posting route when the lists hold <= posting_limit rows (not in probed mode); otherwise the
`max_probe` best centroids by inner product (silverrec::centroid_candidates, kernels/centroid_probe.py), the filter and its match
count on each, the shortest prefix holding target = k x match_factor / sqrt(d) matches, d = the
candidates' match density (matches / rows; at least nprobe clusters, exactly nprobe in probed
mode), and the whole-pool route when even all candidates hold fewer, or when the prefix would scan
more rows than the pool's estimated matches x exact_cost_ratio. (avg_cluster is no longer read: it
stays in the schema that published snapshots call.)

CPU: one fused C++ call (kernels/csrc/plan.cpp), same float32 arithmetic; a batch routed to posting
lists or unprobed by its mode computes no centroid scores (on every path, an unprobed query's
candidate clusters are not evaluated: its bitmask rows are zero). Without the extension: `filter_plan_torch`, the same
steps as tensor ops with no host synchronisation (the reference of the other paths). CUDA: `filter_plan_triton.py`, the
centroid matmul and the candidate sort, then two Triton kernels (one program per query) around the Triton
`bloom_filter_counts`: 13 launches instead of 74 (benchmarks/cuda_launches.py).
"""

from __future__ import annotations

import torch

from silverrec.kernels.centroid_probe import centroid_candidates_torch
from silverrec.kernels.cpu_ext import cpu_ext


def filter_plan_torch(
    queries, centroids, cluster_offsets, bits, ops, rows, lists, post_sizes, mode,
    k: int, nprobe: int, max_probe: int, window_words: int, match_factor: int, avg_cluster: int, num_items: int,
    exact_cost_ratio: float, posting_limit: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-generic path (and the reference of the C++ one)."""
    mode_t = mode.to(torch.int64)
    n_lists = post_sizes.shape[0] - 1
    sizes_l = post_sizes[torch.where(lists >= 0, lists, torch.full_like(lists, n_lists))].sum(dim=1)
    posting = (lists[:, 0] != -2) & (sizes_l <= posting_limit) & (mode_t != 1)
    cand = centroid_candidates_torch(queries, centroids, max_probe)  # [B, P] best first, ties to the lower cluster
    skip = posting | (mode_t == 2)  # posting route, or whole pool by the caller's choice: no candidates
    lo = torch.where(skip[:, None], torch.full_like(cand, -1), cluster_offsets[cand])  # -1: not evaluated
    hi = cluster_offsets[cand + 1]
    bitmask, matches = torch.ops.silverrec.bloom_filter_counts(bits, ops, rows, lo, hi, window_words)
    cum = torch.cumsum(matches, dim=1)
    sizes = hi - cluster_offsets[cand]
    cand_rows = sizes.sum(dim=1).clamp_min(1)
    total = cum[:, -1].to(torch.float32)
    # matches to collect: k x match_factor / sqrt(the candidates' match density) (float32, as plan.cpp)
    target = torch.full_like(total, float(k * match_factor)) / torch.sqrt(total / cand_rows.to(torch.float32))
    need = (cum < target[:, None]).sum(dim=1) + 1  # probes to reach the target (P + 1 if never)
    use = torch.where(mode_t == 1, torch.full_like(need, nprobe), need.clamp(min=nprobe, max=max_probe))
    slot = torch.arange(cand.shape[1], device=queries.device)[None, :]
    chosen = slot < use[:, None]
    scanned = torch.where(chosen, sizes, torch.zeros_like(sizes)).sum(dim=1)
    # one float32 division, as plan.cpp (a Python number over a tensor is reciprocal x number: two roundings)
    est_total = total * (torch.full_like(total, float(num_items)) / cand_rows.to(torch.float32))
    auto = (total < target) | (scanned.to(torch.float32) > est_total * exact_cost_ratio)
    unprobed = torch.where(mode_t == 0, auto, mode_t == 2) & ~posting
    probes = torch.where(chosen & ~unprobed[:, None] & ~posting[:, None], cand, torch.full_like(cand, -1))
    route = torch.where(posting, torch.full_like(mode_t, 2), unprobed.to(torch.int64))
    return probes, bitmask, route


@torch.library.custom_op("silverrec::filter_plan", mutates_args=())
def filter_plan(
    queries: torch.Tensor,
    centroids: torch.Tensor,
    cluster_offsets: torch.Tensor,
    bits: torch.Tensor,
    ops: torch.Tensor,
    rows: torch.Tensor,
    lists: torch.Tensor,
    post_sizes: torch.Tensor,
    mode: torch.Tensor,
    k: int,
    nprobe: int,
    max_probe: int,
    window_words: int,
    match_factor: int,
    avg_cluster: int,
    num_items: int,
    exact_cost_ratio: float,
    posting_limit: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    args = _checked_args(queries, centroids, cluster_offsets, bits, ops, rows, lists, post_sizes, mode, k, nprobe,
                         max_probe, window_words, match_factor, avg_cluster, num_items, exact_cost_ratio, posting_limit)
    ext = cpu_ext() if queries.device.type == "cpu" else None
    if ext is not None and hasattr(ext, "filter_plan"):
        return ext.filter_plan(*args)
    return filter_plan_torch(*args)


def _checked_args(queries, centroids, cluster_offsets, bits, ops, rows, lists, post_sizes, mode, k, nprobe, max_probe,
                  window_words, match_factor, avg_cluster, num_items, exact_cost_ratio, posting_limit) -> tuple:
    """The op's arguments validated and normalised (float32 / int64 contiguous tensors) for every path."""
    if not 1 <= nprobe <= max_probe <= centroids.shape[0]:
        raise ValueError(f"need 1 <= nprobe ({nprobe}) <= max_probe ({max_probe}) <= nlist ({centroids.shape[0]})")
    return (queries.float().contiguous(), centroids.float().contiguous(), cluster_offsets.contiguous(), bits.contiguous(),
            ops.contiguous(), rows.contiguous(), lists.contiguous(), post_sizes.contiguous(), mode.to(torch.int64).contiguous(),
            k, nprobe, max_probe, window_words, match_factor, avg_cluster, num_items, float(exact_cost_ratio), posting_limit)


@filter_plan.register_fake
def _(queries, centroids, cluster_offsets, bits, ops, rows, lists, post_sizes, mode, k, nprobe, max_probe, window_words,
      match_factor, avg_cluster, num_items, exact_cost_ratio, posting_limit):
    b = queries.shape[0]
    return (queries.new_empty(b, max_probe, dtype=torch.int64), queries.new_empty(b, max_probe, window_words, dtype=torch.int64),
            queries.new_empty(b, dtype=torch.int64))


def filter_plan_cuda(queries, centroids, cluster_offsets, bits, ops, rows, lists, post_sizes, mode, k, nprobe, max_probe,
                     window_words, match_factor, avg_cluster, num_items, exact_cost_ratio, posting_limit):
    """The op on CUDA: kernels/filter_plan_triton.py (tests run it on CPU tensors under TRITON_INTERPRET=1)."""
    from silverrec.kernels.filter_plan_triton import filter_plan_triton

    return filter_plan_triton(*_checked_args(queries, centroids, cluster_offsets, bits, ops, rows, lists, post_sizes, mode, k,
                                             nprobe, max_probe, window_words, match_factor, avg_cluster, num_items,
                                             exact_cost_ratio, posting_limit))


torch.library.register_kernel("silverrec::filter_plan", "cuda", filter_plan_cuda)
