"""`silverrec::filtered_ivf_search`: the whole filtered IVF search (silverrec/retrieval/filtered_ivf.py) as one op.

    scores, item_ids = torch.ops.silverrec.filtered_ivf_search(
        queries, codes, dim_scale, dim_offset, cluster_offsets, centroids, row_to_item,   # the IVF
        bits, post_rows, post_offsets, post_sizes,                                        # filter indexes
        ops, rows, vops, vrows, lists, mode,                                              # the request
        k, nprobe, max_probe, window_words, match_factor, avg_cluster, num_items, exact_cost_ratio, posting_limit,
        rescore_margin=0, rescore_max_k=0)
    # -> scores float32 [B, k] (descending, -inf padding), item_ids int64 [B, k] (-1 padding);
    # a zero-length row_to_item returns the rows themselves (what RecModel's later stages read);
    # rescore_margin > 0 and k <= rescore_max_k: every route runs for k + rescore_margin rows, which
    # `rescore_rows` ranks by the float query on their codes, best k (kernels/rescore_rows.py); an
    # exact route passing at most EXACT_FLOAT_ROWS rows hands it all of them (the exact float answer)
    # residual: codes encode item - centroid (item ~= centroid[c] + dim_scale * code + dim_offset): every
    # route adds <query, centroid c> to the rows of cluster c, computed for the clusters it visits
    # (ivf_scan, filtered_topk, rescore_rows; kernels/common.py cluster_bias)
    # ops .. mode: one row per query, or one per group of B / ops.shape[0] consecutive queries (a
    # request's T task queries, rows b*T .. b*T + T - 1, share its filter program)

The steps are the ops of this package, in order (`compose_search`; `filtered_ivf_search_torch` composes
the registered ops, `filtered_ivf_search_cuda`, the CUDA kernel, their CUDA kernels, the Triton
launchers, directly): `filter_plan` routes every query; per-dimension ranges are folded into the
query; `ivf_scan` scans the probed clusters through the Bloom mask with a margin of k / 4 + 16 results,
`verify_topk` keeps the best k that pass the exact verify program; `filtered_topk` answers the
whole-pool and posting-list routes; the routes' results are merged, re-scored with the float query
when asked (`rescore_rows`), and rows mapped to item ids.

Registration: this module defines the op, its fake and its CUDA kernel; loading the C++ extension
registers the CPU kernel with the dispatcher (a call goes straight to C++, no Python in between).
Without the extension the CPU kernel is the composition.

Why one op: at small batches the search's arithmetic is tens of microseconds (a posting list of a
thousand rows), while each eager tensor op costs several microseconds of dispatch. On CPU the C++
path (kernels/csrc/ops.cpp) runs the same steps with the same ATen calls and C++ kernels, so its
results are bit-identical to the composition, without the per-op overhead or intermediate tensors.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from silverrec.kernels.cpu_ext import cpu_ext
from silverrec.kernels import candidate_rows as _candidate_rows
from silverrec.kernels import mol_score as _mol_score
from silverrec.kernels import rescore_rows as _rescore_rows
from silverrec.kernels.rescore_rows import EXACT_FLOAT_ROWS
from silverrec.kernels.rows_to_items import register_cpu_fallback


class SearchSteps(NamedTuple):
    """The ops the composition calls, each with its op's signature."""

    filter_plan: Callable
    ivf_scan: Callable
    verify_topk: Callable
    filtered_topk: Callable
    rows_to_items: Callable
    rescore_rows: Callable


def dispatched_steps() -> SearchSteps:
    """The registered ops (each picks its kernel by the tensors' device)."""
    ops = torch.ops.silverrec
    return SearchSteps(ops.filter_plan, ops.ivf_scan, ops.verify_topk, ops.filtered_topk, ops.rows_to_items,
                       ops.rescore_rows)


def cuda_steps() -> SearchSteps:
    """The ops' CUDA kernels (Triton launchers), called directly: what `filtered_ivf_search_cuda` runs on a GPU and
    what tests/test_filter_plan_triton.py runs on CPU tensors under TRITON_INTERPRET=1."""
    from silverrec.kernels.filter_plan import filter_plan_cuda
    from silverrec.kernels.filtered_topk import filtered_topk_cuda, verify_topk_cuda
    from silverrec.kernels.ivf_scan import ivf_scan_cuda
    from silverrec.kernels.rescore_rows import rescore_rows_torch
    from silverrec.kernels.rows_to_items import rows_to_items_torch

    return SearchSteps(filter_plan_cuda, ivf_scan_cuda, verify_topk_cuda, filtered_topk_cuda, rows_to_items_torch,
                       rescore_rows_torch)


def compose_search(
    steps: SearchSteps, queries, codes, dim_scale, dim_offset, cluster_offsets, centroids, row_to_item, bits, post_rows,
    post_offsets, post_sizes, ops, rows, vops, vrows, lists, mode, k: int, nprobe: int, max_probe: int, window_words: int,
    match_factor: int, avg_cluster: int, num_items: int, exact_cost_ratio: float, posting_limit: int,
    rescore_margin: int = 0, rescore_max_k: int = 0, residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The search as a composition of `steps` (the op's contract, module docstring).

    Device memory beyond the inputs, B queries: centroid scores [B, C] and the plan's bitmask [B, max_probe, Wc]
    (filter_plan), the scan's keys [B, 8 x 64 Wc] (ivf_scan), the results [B, k + k / 4 + 16]; filtered_topk's
    Triton workspace holds nothing proportional to N either (its `workspace_shapes`). With `cuda_steps` no step
    reads a value back to the host (tests/test_filter_plan_triton.py records every op outside the kernels).
    """
    k_out = k
    rescore = rescore_margin > 0 and k <= rescore_max_k  # Python ints: no device sync
    if rescore:  # every route runs for k + margin rows, re-scored to k at the end
        k = k + rescore_margin
    # exact routes (re-scored): one row more than EXACT_FLOAT_ROWS tells whether all their passing rows fit
    k_ex = max(k, EXACT_FLOAT_ROWS + 1) if rescore else k
    per = queries.shape[0] // ops.shape[0] if ops.shape[0] and queries.shape[0] % ops.shape[0] == 0 else 1
    if per > 1:  # one program per request of `per` consecutive queries: repeated to one per query
        ops, rows, vops, vrows, lists, mode = [x.repeat_interleave(per, dim=0) for x in (ops, rows, vops, vrows, lists, mode)]
    probes, bitmask, route = steps.filter_plan(
        queries, centroids, cluster_offsets, bits, ops, rows, lists, post_sizes, mode, k, nprobe, max_probe,
        window_words, match_factor, avg_cluster, num_items, exact_cost_ratio, posting_limit,
    )
    # per-dimension ranges folded into the query: score = int8-op score + constant (per query)
    q = queries.float()
    folded, constant = q * dim_scale, q @ dim_offset
    one, zero = folded.new_ones(()), folded.new_zeros(())
    # residual codes (item ~= centroid + dim_scale * code + dim_offset): a row of cluster c adds <q, centroid c>
    offsets, cent, cq = (cluster_offsets, centroids.float(), q) if residual else (None, None, None)
    # Bloom false positives may take result slots: scan a margin, verify, keep the best k.
    s_ivf, r_ivf = steps.ivf_scan(folded, codes, one, zero, cluster_offsets, probes, k + k // 4 + 16, bitmask,
                                  window_words, cent, cq)
    s_ivf, r_ivf = steps.verify_topk(bits, vops, vrows, s_ivf, r_ivf, k)
    # whole-pool (route 1) and posting (route 2) queries: filter then exact scan
    exact = route > 0
    src = torch.where((route == 1)[:, None], torch.full_like(lists, -2), lists)  # -2: the whole pool
    s_ex, r_ex = steps.filtered_topk(
        folded, codes, one, zero, bits, vops, vrows, post_rows, post_offsets, src, exact, k_ex, posting_limit, offsets,
        cent, cq
    )
    if k_ex > k:  # the re-score takes every passing row of an exact route that has at most EXACT_FLOAT_ROWS of
        # them (its exact float answer; the C++ op ranks those without the int8 scan), else the scan's top k
        few = r_ex[:, EXACT_FLOAT_ROWS] < 0
        keep = few[:, None] | (torch.arange(k_ex, device=r_ex.device) < k)[None, :]
        r_ex = torch.where(keep, r_ex, torch.full_like(r_ex, -1))
        s_ivf = torch.cat([s_ivf, s_ivf.new_full((s_ivf.shape[0], k_ex - k), float("-inf"))], dim=1)
        r_ivf = torch.cat([r_ivf, r_ivf.new_full((r_ivf.shape[0], k_ex - k), -1)], dim=1)
    scores = torch.where(exact[:, None], s_ex, s_ivf) + constant[:, None]
    found = torch.where(exact[:, None], r_ex, r_ivf)
    if rescore:
        scores, found = steps.rescore_rows(q, found, codes, dim_scale.expand(q.shape[1]).contiguous(), dim_offset, k_out,
                                           offsets, cent)
    return scores, found if row_to_item.numel() == 0 else steps.rows_to_items(row_to_item, found)


def filtered_ivf_search_torch(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """The composition of the registered ops (device-generic; the reference of the C++ path). Arguments: the op's."""
    return compose_search(dispatched_steps(), *args)


def filtered_ivf_search_cuda(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on CUDA: the composition of the ops' CUDA kernels, called without a dispatcher round trip each."""
    return compose_search(cuda_steps(), *args)


SCHEMA = (
    "(Tensor queries, Tensor codes, Tensor dim_scale, Tensor dim_offset, Tensor cluster_offsets, Tensor centroids, "
    "Tensor row_to_item, Tensor bits, Tensor post_rows, Tensor post_offsets, Tensor post_sizes, Tensor ops, Tensor rows, "
    "Tensor vops, Tensor vrows, Tensor lists, Tensor mode, SymInt k, SymInt nprobe, SymInt max_probe, int window_words, "
    "int match_factor, int avg_cluster, int num_items, float exact_cost_ratio, int posting_limit, SymInt rescore_margin=0, "
    "int rescore_max_k=0, bool residual=False) -> (Tensor, Tensor)"
)


torch.library.define("silverrec::filtered_ivf_search", SCHEMA)
_ext = cpu_ext()  # loading the extension registers the op's C++ CPU kernel (kernels/csrc/ops.cpp)
if _ext is None or not hasattr(_ext, "filtered_ivf_search"):  # no extension: the composition on CPU
    torch.library.impl("silverrec::filtered_ivf_search", "CPU", filtered_ivf_search_torch)
torch.library.impl("silverrec::filtered_ivf_search", "CUDA", filtered_ivf_search_cuda)
if _ext is None or not hasattr(_ext, "rows_to_items"):  # the extension registers the C++ one
    register_cpu_fallback()
if _ext is None or not hasattr(_ext, "candidate_rows"):
    _candidate_rows.register_cpu_fallback()
if _ext is None or not hasattr(_ext, "mol_score"):
    _mol_score.register_cpu_fallback()
if _ext is None or not hasattr(_ext, "rescore_rows"):
    _rescore_rows.register_cpu_fallback()


@torch.library.register_fake("silverrec::filtered_ivf_search")
def _(queries, codes, dim_scale, dim_offset, cluster_offsets, centroids, row_to_item, bits, post_rows, post_offsets,
      post_sizes, ops, rows, vops, vrows, lists, mode, k, nprobe, max_probe, window_words, match_factor, avg_cluster,
      num_items, exact_cost_ratio, posting_limit, rescore_margin=0, rescore_max_k=0, residual=False):
    b = queries.shape[0]
    return queries.new_empty(b, k, dtype=torch.float32), queries.new_empty(b, k, dtype=torch.int64)
