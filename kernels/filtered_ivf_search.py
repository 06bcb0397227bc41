"""`silverrec::filtered_ivf_search`: the whole filtered IVF search (silverrec/filtered_ivf.py) as one op.

    scores, item_ids = torch.ops.silverrec.filtered_ivf_search(
        queries, codes, dim_scale, dim_offset, cluster_offsets, centroids, row_to_item,   # the IVF
        bits, post_rows, post_offsets, post_sizes,                                        # filter indexes
        ops, rows, vops, vrows, lists, mode,                                              # the request
        k, nprobe, max_probe, window_words, match_factor, avg_cluster, num_items, exact_cost_ratio, posting_limit)
    # -> scores float32 [B, k] (descending, -inf padding), item_ids int64 [B, k] (-1 padding)

The steps are the ops of this package, in order (`filtered_ivf_search_torch` is the composition and
the CUDA path): `filter_plan` routes every query; per-dimension ranges are folded into the query;
`ivf_scan` scans the probed clusters through the Bloom mask with a margin of k / 4 + 16 results,
`verify_topk` keeps the best k that pass the exact verify program; `filtered_topk` answers the
whole-pool and posting-list routes; the routes' results are merged and rows mapped to item ids.

Why one op: at small batches the search's arithmetic is tens of microseconds (a posting list of a
thousand rows), while each eager tensor op costs several microseconds of dispatch. On CPU the C++
path (kernels/csrc/ops.cpp) runs the same steps with the same ATen calls and C++ kernels, so its
results are bit-identical to the composition, without the per-op overhead or intermediate tensors.
"""

from __future__ import annotations

import torch

from silverrec.kernels.cpu_ext import cpu_ext


def filtered_ivf_search_torch(
    queries, codes, dim_scale, dim_offset, cluster_offsets, centroids, row_to_item, bits, post_rows, post_offsets,
    post_sizes, ops, rows, vops, vrows, lists, mode, k: int, nprobe: int, max_probe: int, window_words: int,
    match_factor: int, avg_cluster: int, num_items: int, exact_cost_ratio: float, posting_limit: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The composition of the package's ops (device-generic; the reference of the C++ path)."""
    probes, bitmask, route = torch.ops.silverrec.filter_plan(
        queries, centroids, cluster_offsets, bits, ops, rows, lists, post_sizes, mode, k, nprobe, max_probe,
        window_words, match_factor, avg_cluster, num_items, exact_cost_ratio, posting_limit,
    )
    # per-dimension ranges folded into the query: score = int8-op score + constant (per query)
    q = queries.float()
    folded, constant = q * dim_scale, q @ dim_offset
    one, zero = folded.new_ones(()), folded.new_zeros(())
    # Bloom false positives may take result slots: scan a margin, verify, keep the best k.
    s_ivf, r_ivf = torch.ops.silverrec.ivf_scan(folded, codes, one, zero, cluster_offsets, probes, k + k // 4 + 16, bitmask)
    s_ivf, r_ivf = torch.ops.silverrec.verify_topk(bits, vops, vrows, s_ivf, r_ivf, k)
    # whole-pool (route 1) and posting (route 2) queries: filter then exact scan
    exact = route > 0
    src = torch.where((route == 1)[:, None], torch.full_like(lists, -2), lists)  # -2: the whole pool
    s_ex, r_ex = torch.ops.silverrec.filtered_topk(folded, codes, one, zero, bits, vops, vrows, post_rows, post_offsets, src, exact, k)
    scores = torch.where(exact[:, None], s_ex, s_ivf) + constant[:, None]
    rows_out = torch.where(exact[:, None], r_ex, r_ivf)
    ids = row_to_item[rows_out.clamp_min(0)].to(torch.int64)
    return scores, torch.where(rows_out >= 0, ids, torch.full_like(ids, -1))


@torch.library.custom_op("silverrec::filtered_ivf_search", mutates_args=())
def filtered_ivf_search(
    queries: torch.Tensor,
    codes: torch.Tensor,
    dim_scale: torch.Tensor,
    dim_offset: torch.Tensor,
    cluster_offsets: torch.Tensor,
    centroids: torch.Tensor,
    row_to_item: torch.Tensor,
    bits: torch.Tensor,
    post_rows: torch.Tensor,
    post_offsets: torch.Tensor,
    post_sizes: torch.Tensor,
    ops: torch.Tensor,
    rows: torch.Tensor,
    vops: torch.Tensor,
    vrows: torch.Tensor,
    lists: torch.Tensor,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    args = (queries, codes, dim_scale, dim_offset, cluster_offsets, centroids, row_to_item, bits, post_rows, post_offsets,
            post_sizes, ops, rows, vops, vrows, lists, mode, k, nprobe, max_probe, window_words, match_factor,
            avg_cluster, num_items, float(exact_cost_ratio), posting_limit)
    ext = cpu_ext() if queries.device.type == "cpu" else None
    if ext is not None and hasattr(ext, "filtered_ivf_search") and k >= 1 and 1 <= nprobe <= max_probe <= centroids.shape[0]:
        return ext.filtered_ivf_search(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))
    return filtered_ivf_search_torch(*args)  # also raises the sub-ops' errors for bad arguments


@filtered_ivf_search.register_fake
def _(queries, codes, dim_scale, dim_offset, cluster_offsets, centroids, row_to_item, bits, post_rows, post_offsets,
      post_sizes, ops, rows, vops, vrows, lists, mode, k, nprobe, max_probe, window_words, match_factor, avg_cluster,
      num_items, exact_cost_ratio, posting_limit):
    b = queries.shape[0]
    return queries.new_empty(b, k, dtype=torch.float32), queries.new_empty(b, k, dtype=torch.int64)
