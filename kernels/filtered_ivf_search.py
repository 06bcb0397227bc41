"""The IVF searches as single ops: `silverrec::ivf_search` (no filter) and `silverrec::filtered_ivf_search`.

    scores, item_ids = torch.ops.silverrec.ivf_search(queries, index, params, k, nprobe, rescore_margin=0,
                                                      rescore_max_k=0)
    scores, item_ids = torch.ops.silverrec.filtered_ivf_search(
        queries, index, params, exact_cost_ratio, program, mode, k, nprobe, max_probe, rescore_margin=0,
        rescore_max_k=0)
    # queries float [B, D]; the index as the retrieval stage hands it (silverrec/retrieval/ivf_index.py and
    # filtered_ivf.py `search_args`, kernels/search_args.py): index = [codes, dim_scale, dim_offset,
    # cluster_offsets, centroids, row_to_item] (kernels/constants.py IVF_TENSORS), for the filtered search
    # followed by [bits, post_rows, post_offsets, post_sizes] (FILTERED_IVF_TENSORS); params = [window_words,
    # residual] (IVF_PARAMS), for the filtered search followed by [match_factor, num_items, posting_limit]
    # (FILTERED_IVF_PARAMS), and exact_cost_ratio
    # program = [ops, rows, vops, vrows, lists] (PROGRAM_TENSORS: the request's Bloom and verify programs and
    # posting lists, filter_program.compile_request), mode int64 [B] (MODE_AUTO, MODE_PROBED, MODE_UNPROBED)
    # -> scores float32 [B, k] (descending, -inf padding), item_ids int64 [B, k] (NO_ROW padding);
    # a zero-length row_to_item returns the rows themselves (what RecModel's later stages read);
    # rescore_margin > 0 and k <= rescore_max_k: every route runs for k + rescore_margin rows, which
    # `rescore_rows` ranks by the float query on their codes, best k (kernels/rescore_rows.py); an
    # exact route passing at most EXACT_FLOAT_ROWS rows hands it all of them (the exact float answer)
    # residual: codes encode item - centroid (item ~= centroid[c] + dim_scale * code + dim_offset): every
    # route adds <query, centroid c> to the rows of cluster c, computed for the clusters it visits
    # (ivf_scan, filtered_topk, rescore_rows; kernels/common.py cluster_bias)
    # program and mode: one row per query, or one per group of B / ops.shape[0] consecutive queries (a
    # request's T task queries, rows b*T .. b*T + T - 1, share its filter program)

The steps are the ops of this package, in order (`compose_search`; `filtered_ivf_search_torch` composes
the registered ops, `filtered_ivf_search_cuda`, the CUDA kernel, their CUDA kernels, the Triton
launchers, directly): `filter_plan` routes every query; per-dimension ranges are folded into the
query; `ivf_scan` scans the probed clusters through the Bloom mask with a margin of
k / VERIFY_MARGIN_DIVISOR + VERIFY_MARGIN_ROWS results, `verify_topk` keeps the best k that pass the exact
verify program; `filtered_topk` answers the whole-pool and posting-list routes; the routes' results are
merged, re-scored with the float query when asked (`rescore_rows`), and rows mapped to item ids. The plain
search (`compose_ivf_search`) probes each query's nprobe best centroids (`centroid_candidates`) and scans them
(`ivf_scan`), then the same tail.

Registration: the ops, their CPU and Meta kernels are C++ (kernels/csrc/library.cpp, search.cpp: a call goes
straight to C++, no Python in between); this module registers their CUDA kernels. The compositions of the
registered ops (`filtered_ivf_search_torch`, `ivf_search_torch`) are the tests' references.

Why one op: at small batches the search's arithmetic is tens of microseconds (a posting list of a
thousand rows), while each eager tensor op costs several microseconds of dispatch. On CPU the C++
path (kernels/csrc/search.cpp) runs the same steps with the same ATen calls and C++ kernels, so
its results are bit-identical to the composition, without the per-op overhead or intermediate tensors.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from silverrec.kernels.constants import (EXACT_FLOAT_ROWS, NO_LISTS, NO_ROW, ROUTE_PROBED, ROUTE_WHOLE_POOL,
                                         VERIFY_MARGIN_DIVISOR, VERIFY_MARGIN_ROWS)
from silverrec.kernels.search_args import FilteredIvfParams, FilteredIvfTensors, IvfParams, IvfTensors, Program, unpack


class SearchSteps(NamedTuple):
    """The ops the compositions call, each with its op's signature."""

    centroid_candidates: Callable
    filter_plan: Callable
    ivf_scan: Callable
    verify_topk: Callable
    filtered_topk: Callable
    rows_to_items: Callable
    rescore_rows: Callable


def dispatched_steps() -> SearchSteps:
    """The registered ops (each picks its kernel by the tensors' device)."""
    ops = torch.ops.silverrec
    return SearchSteps(ops.centroid_candidates, ops.filter_plan, ops.ivf_scan, ops.verify_topk, ops.filtered_topk,
                       ops.rows_to_items, ops.rescore_rows)


def cuda_steps() -> SearchSteps:
    """The ops' CUDA kernels (Triton launchers), called directly: what `filtered_ivf_search_cuda` runs on a GPU and
    what tests/test_filter_plan_triton.py runs on CPU tensors under TRITON_INTERPRET=1."""
    from silverrec.kernels.centroid_probe import centroid_candidates_torch
    from silverrec.kernels.filter_plan import filter_plan_cuda
    from silverrec.kernels.filtered_topk import filtered_topk_cuda, verify_topk_cuda
    from silverrec.kernels.ivf_scan import ivf_scan_cuda
    from silverrec.kernels.rescore_rows import rescore_rows_torch
    from silverrec.kernels.rows_to_items import rows_to_items_torch

    return SearchSteps(centroid_candidates_torch, filter_plan_cuda, ivf_scan_cuda, verify_topk_cuda, filtered_topk_cuda,
                       rows_to_items_torch, rescore_rows_torch)


def verify_margin(k: int) -> int:
    """Rows the probed route scans for k results: a margin for the Bloom filter's false positives."""
    return k + k // VERIFY_MARGIN_DIVISOR + VERIFY_MARGIN_ROWS


def compose_search(
    steps: SearchSteps, queries, index, params, exact_cost_ratio: float, program, mode, k: int, nprobe: int,
    max_probe: int, rescore_margin: int = 0, rescore_max_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered search as a composition of `steps` (the op's contract, module docstring).

    Device memory beyond the inputs, B queries: centroid scores [B, C] and the plan's bitmask [B, max_probe, Wc]
    (filter_plan), the scan's keys [B, 8 x 64 Wc] (ivf_scan), the results [B, verify_margin(k)]; filtered_topk's
    Triton workspace holds nothing proportional to N either (its `workspace_shapes`). With `cuda_steps` no step
    reads a value back to the host (tests/test_filter_plan_triton.py records every op outside the kernels).
    """
    ix = unpack(FilteredIvfTensors, index, "filtered_ivf_search", "index")
    pa = unpack(FilteredIvfParams, params, "filtered_ivf_search", "params")
    pr = unpack(Program, program, "filtered_ivf_search", "program")
    k_out = k
    rescore = rescore_margin > 0 and k <= rescore_max_k  # Python ints: no device sync
    if rescore:  # every route runs for k + margin rows, re-scored to k at the end
        k = k + rescore_margin
    # exact routes (re-scored): one row more than EXACT_FLOAT_ROWS tells whether all their passing rows fit
    k_ex = max(k, EXACT_FLOAT_ROWS + 1) if rescore else k
    per = queries.shape[0] // pr.ops.shape[0] if pr.ops.shape[0] and queries.shape[0] % pr.ops.shape[0] == 0 else 1
    if per > 1:  # one program per request of `per` consecutive queries: repeated to one per query
        pr = Program(*[x.repeat_interleave(per, dim=0) for x in pr])
        mode = mode.repeat_interleave(per, dim=0)
    probes, bitmask, route = steps.filter_plan(queries, index, params, exact_cost_ratio, list(pr), mode, k, nprobe,
                                               max_probe)
    q, folded, constant, residual = _fold(queries, ix, pa.residual)
    one, zero = folded.new_ones(()), folded.new_zeros(())
    # Bloom false positives may take result slots: scan a margin, verify, keep the best k.
    s_ivf, r_ivf = steps.ivf_scan(folded, ix.codes, one, zero, ix.cluster_offsets, probes, verify_margin(k), bitmask,
                                  pa.window_words, *residual[1:])
    s_ivf, r_ivf = steps.verify_topk(ix.bits, pr.vops, pr.vrows, s_ivf, r_ivf, k)
    # whole-pool and posting-list queries: filter then exact scan
    exact = route != ROUTE_PROBED
    src = torch.where((route == ROUTE_WHOLE_POOL)[:, None], torch.full_like(pr.lists, NO_LISTS), pr.lists)
    s_ex, r_ex = steps.filtered_topk(folded, ix.codes, one, zero, ix.bits, [pr.vops, pr.vrows],
                                     [ix.post_rows, ix.post_offsets, src], exact, k_ex, pa.posting_limit, residual)
    if k_ex > k:  # the re-score takes every passing row of an exact route that has at most EXACT_FLOAT_ROWS of
        # them (its exact float answer; the C++ op ranks those without the int8 scan), else the scan's top k
        few = r_ex[:, EXACT_FLOAT_ROWS] < 0
        keep = few[:, None] | (torch.arange(k_ex, device=r_ex.device) < k)[None, :]
        r_ex = torch.where(keep, r_ex, torch.full_like(r_ex, NO_ROW))
        s_ivf = torch.cat([s_ivf, s_ivf.new_full((s_ivf.shape[0], k_ex - k), float("-inf"))], dim=1)
        r_ivf = torch.cat([r_ivf, r_ivf.new_full((r_ivf.shape[0], k_ex - k), NO_ROW)], dim=1)
    scores = torch.where(exact[:, None], s_ex, s_ivf) + constant[:, None]
    found = torch.where(exact[:, None], r_ex, r_ivf)
    return _finish(steps, q, ix, residual, scores, found, k_out, rescore)


def compose_ivf_search(steps: SearchSteps, queries, index, params, k: int, nprobe: int, rescore_margin: int = 0,
                       rescore_max_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain search as a composition of `steps`: each query's nprobe best centroids, scanned (no mask)."""
    ix = unpack(IvfTensors, index, "ivf_search", "index")
    pa = unpack(IvfParams, params, "ivf_search", "params")
    if not 1 <= nprobe <= ix.centroids.shape[0]:
        raise ValueError(f"need 1 <= nprobe ({nprobe}) <= nlist ({ix.centroids.shape[0]})")
    k_out = k
    rescore = rescore_margin > 0 and k <= rescore_max_k
    if rescore:
        k = k + rescore_margin
    q, folded, constant, residual = _fold(queries, ix, pa.residual)
    probes = steps.centroid_candidates(q, ix.centroids.float(), nprobe)
    one, zero = folded.new_ones(()), folded.new_zeros(())
    scores, found = steps.ivf_scan(folded, ix.codes, one, zero, ix.cluster_offsets, probes, k, None, pa.window_words,
                                   *residual[1:])
    return _finish(steps, q, ix, residual, scores + constant[:, None], found, k_out, rescore)


def _fold(queries, ix, residual: int) -> tuple:
    """Per-dimension ranges folded into the query: (q float32 [B, D], folded = q x dim_scale, the per-query score
    constant <q, dim_offset> [B], and the residual codes' [cluster_offsets, centroids, centroid queries], or [])."""
    q = queries.float()
    folded, constant = q * ix.dim_scale, q @ ix.dim_offset
    # residual codes (item ~= centroid + dim_scale * code + dim_offset): a row of cluster c adds <q, centroid c>
    return q, folded, constant, [ix.cluster_offsets, ix.centroids.float(), q] if residual else []


def _finish(steps, q, ix, residual: list, scores, found, k: int, rescore: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The searches' tail: the float re-score when asked, then rows to item ids (an empty map: the rows)."""
    if rescore:
        scores, found = steps.rescore_rows(q, found, ix.codes, ix.dim_scale.expand(q.shape[1]).contiguous(),
                                           ix.dim_offset, k, *residual[:2])
    return scores, found if ix.row_to_item.numel() == 0 else steps.rows_to_items(ix.row_to_item, found)


def filtered_ivf_search_torch(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """The composition of the registered ops (device-generic; the reference of the C++ path). Arguments: the op's."""
    return compose_search(dispatched_steps(), *args)


def filtered_ivf_search_cuda(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on CUDA: the fused kernels (kernels/search_triton.py, five launches); a search beyond their sizes
    runs as the composition of the ops' CUDA kernels, called without a dispatcher round trip each."""
    from silverrec.kernels.search_triton import fused_filtered_search

    out = fused_filtered_search(*args)
    return compose_search(cuda_steps(), *args) if out is None else out


def ivf_search_torch(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain search as the composition of the registered ops (the reference of the C++ path)."""
    return compose_ivf_search(dispatched_steps(), *args)


def ivf_search_cuda(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain search on CUDA: the fused kernels (four launches), else the ops' CUDA kernels, called directly."""
    from silverrec.kernels.search_triton import fused_ivf_search

    out = fused_ivf_search(*args)
    return compose_ivf_search(cuda_steps(), *args) if out is None else out


torch.library.register_kernel("silverrec::filtered_ivf_search", "cuda", filtered_ivf_search_cuda)
torch.library.register_kernel("silverrec::ivf_search", "cuda", ivf_search_cuda)
