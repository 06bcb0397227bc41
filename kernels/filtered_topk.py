"""Row-level filter ops: `silverrec::verify_topk` and `silverrec::filtered_topk`.

    scores, rows = torch.ops.silverrec.verify_topk(bits, ops, prog_rows, scores_in, rows_in, k)
    # bits int64 [R, W] row bank; (ops int64 [B, L], prog_rows int64 [B, L, T]) one filter program
    # per query (kernels/bloom_filter.py); scores_in float32 [B, K2] / rows_in int64 [B, K2] a ranked
    # result list per query (best first, row -1 = padding)
    # -> float32 [B, k], int64 [B, k]: the first k entries whose row passes the program, in their
    #    input order (-inf / -1 padding)

The filtered IVF search scans with a Bloom-program mask and a margin of extra results, then keeps
the best k that pass the exact ("verify") program. The input is already ranked, so nothing is
re-sorted and the CPU path stops evaluating once k rows passed.

    scores, rows = torch.ops.silverrec.filtered_topk(queries, codes, scale, offset, bits, ops, prog_rows,
                                                     post_rows, post_offsets, lists, active, k, max_candidates)
    # queries float [B, D], codes int8 [N, D], scale / offset float32 [] (item ~= scale * code + offset)
    # post_rows int32 [E], post_offsets int64 [V + 1]: posting list l = the ascending rows
    #     post_rows[post_offsets[l]:post_offsets[l + 1]] (the rows holding one (feature, value) token)
    # lists int64 [B, T2]: posting lists whose union holds every row the query's filter passes
    #     (-1 = unused slot); lists[b, 0] == -2 (NO_LISTS): the query filters the whole pool (the
#     row's other entries are ignored)
    # active bool [B]: queries to answer (others come back as padding)
    # max_candidates int: an upper bound on the rows of any active query's lists (the filtered
    #     search's posting_limit); the CUDA path sizes its candidate buffer with it
    # -> scores float32 [B, k] (descending, -inf padding), rows int64 [B, k] (-1 padding)
    # optional cluster_offsets int64 [nlist + 1] with cluster_scores float32 [B, nlist]: residual codes,
    #     every row of cluster c scores cluster_scores[b, c] more (an int32 bias on the int8 dots,
    #     kernels/common.py cluster_bias, as silverrec::ivf_scan)

"Filter, then exact scan": the rows passing the program (from the candidate lists, or the whole
pool) are scored exactly like `silverrec::int8_topk` (int8 dot products, ties to the lower row).
With posting lists the cost is proportional to the candidates, not to N.

CPU: kernels/csrc/filter_scan.cpp (queries with the same program and lists are evaluated once; the
passing rows are scored by the fused scan); without the extension, `filtered_keys_torch` (per group
on the host: `bloom_filter` on the candidates' words, a gather and one matmul), the reference the
tests compare the C++ path with. CUDA: the Triton kernel of kernels/filtered_topk_triton.py
(`filtered_keys_triton`: the program evaluated per tile of rows, exact int8 dots, a radix select
of the k-th best row and a compaction into [B, k + slack] keys), the same keys with static shapes,
no host synchronisation and no buffer proportional to N; `max_candidates` bounds the positions
it reads from each query's lists.
"""

from __future__ import annotations

from typing import Optional

import torch

from silverrec.kernels.bloom_filter import check_program
from silverrec.kernels.common import EMPTY_KEY, cluster_bias, dequantize_scores, make_keys, quantize_queries, split_keys
from silverrec.kernels.cpu_ext import cpu_ext

NO_LISTS = -2

_SHIFTS = torch.arange(64, dtype=torch.int64)


def unpack_rows(words: torch.Tensor, n: int) -> torch.Tensor:
    """Rows (int64 [M], ascending, < n) whose bit is set in int64 words [W]."""
    bits = (words[:, None] >> _SHIFTS.to(words.device)) & 1  # [W, 64]
    rows = bits.reshape(-1).nonzero().reshape(-1)
    return rows[rows < n]


def row_passes(bits: torch.Tensor, ops: torch.Tensor, prog_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """bool [B, K]: program b on item rows int64 [B, K] (-1 -> False); one single-word window per row."""
    words = torch.ops.silverrec.bloom_filter(bits, ops, prog_rows, torch.where(rows >= 0, rows >> 6, rows), 1)
    return (((words[:, :, 0] >> (rows.clamp_min(0) & 63)) & 1) != 0) & (rows >= 0)


# ---------------------------------------------------------------------------------- verify_topk


def verify_topk_torch(bits, ops, prog_rows, scores_in, rows_in, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-generic path: verify every entry, stable-move the passing ones first, keep k."""
    ok = row_passes(bits, ops, prog_rows, rows_in)
    order = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices[:, :k]
    keep = torch.gather(ok, 1, order)
    s = torch.where(keep, torch.gather(scores_in, 1, order), torch.full_like(scores_in[:, :1], float("-inf")))
    r = torch.where(keep, torch.gather(rows_in, 1, order), torch.full_like(rows_in[:, :1], -1))
    if r.shape[1] < k:  # fewer inputs than k: pad
        pad = k - r.shape[1]
        s = torch.cat([s, s.new_full((s.shape[0], pad), float("-inf"))], dim=1)
        r = torch.cat([r, r.new_full((r.shape[0], pad), -1)], dim=1)
    return s, r


@torch.library.custom_op("silverrec::verify_topk", mutates_args=())
def verify_topk(
    bits: torch.Tensor, ops: torch.Tensor, prog_rows: torch.Tensor, scores_in: torch.Tensor, rows_in: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    _check_verify(bits, ops, prog_rows, scores_in, rows_in, k)
    ext = cpu_ext() if bits.device.type == "cpu" else None
    if ext is not None and hasattr(ext, "verify_topk"):
        return ext.verify_topk(bits.contiguous(), ops.contiguous(), prog_rows.contiguous(), scores_in.float().contiguous(), rows_in.contiguous(), k)
    return verify_topk_torch(bits, ops, prog_rows, scores_in.float(), rows_in, k)


@verify_topk.register_fake
def _(bits, ops, prog_rows, scores_in, rows_in, k):
    b = rows_in.shape[0]
    return scores_in.new_empty(b, k, dtype=torch.float32), rows_in.new_empty(b, k)


def verify_topk_cuda(bits, ops, prog_rows, scores_in, rows_in, k):
    """The op on CUDA: kernels/verify_topk_triton.py (tests run it on CPU tensors under TRITON_INTERPRET=1)."""
    from silverrec.kernels.verify_topk_triton import verify_topk_triton

    _check_verify(bits, ops, prog_rows, scores_in, rows_in, k)
    return verify_topk_triton(bits, ops, prog_rows, scores_in, rows_in, k)


torch.library.register_kernel("silverrec::verify_topk", "cuda", verify_topk_cuda)


def _check_verify(bits, ops, prog_rows, scores_in, rows_in, k: int) -> None:
    check_program(bits, ops, prog_rows)
    if rows_in.dtype != torch.int64 or rows_in.dim() != 2 or rows_in.shape[0] != ops.shape[0] or scores_in.shape != rows_in.shape:
        raise ValueError(f"scores / rows must be [B, K2] (float32 / int64) with B = {ops.shape[0]}, got {tuple(scores_in.shape)}, {tuple(rows_in.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


# -------------------------------------------------------------------------------- filtered_topk


def candidate_rows(post_rows: torch.Tensor, post_offsets: torch.Tensor, lists: torch.Tensor) -> torch.Tensor:
    """int64 [C]: the ascending union of the posting lists `lists` int64 [T2] (-1 = unused)."""
    ids = lists[lists >= 0].tolist()
    parts = [post_rows[int(post_offsets[i]) : int(post_offsets[i + 1])].to(torch.int64) for i in ids]
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=post_rows.device)
    return torch.unique(torch.cat(parts)) if len(parts) > 1 else parts[0]


def passing_rows_torch(bits, ops, prog_rows, post_rows, post_offsets, lists, b: int, n: int) -> torch.Tensor:
    """int64 [M]: ascending rows < n that pass query b's program, from its lists or the whole pool."""
    if int(lists[b, 0]) == NO_LISTS:
        start = torch.zeros(1, 1, dtype=torch.int64, device=bits.device)
        words = torch.ops.silverrec.bloom_filter(bits, ops[b : b + 1], prog_rows[b : b + 1], start, bits.shape[1])
        return unpack_rows(words[0, 0], n)
    cand = candidate_rows(post_rows, post_offsets, lists[b])
    if cand.numel() == 0:
        return cand
    ok = row_passes(bits, ops[b : b + 1], prog_rows[b : b + 1], cand[None, :])[0]
    return cand[ok]


def filtered_keys_torch(qcodes, codes, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k: int,
                        cluster_offsets=None, bias=None) -> torch.Tensor:
    """Device-generic path: top-k keys int64 [B, k] (descending, EMPTY_KEY padding); bias optional int32
    [B, nlist] added to the dots of each cluster's rows (clusters from cluster_offsets int64 [nlist + 1])."""
    B = qcodes.shape[0]
    n, d = codes.shape
    keys = torch.full((B, k), EMPTY_KEY, dtype=torch.int64, device=codes.device)
    groups: dict[tuple, list[int]] = {}  # identical (program, lists): one evaluation and one matmul
    for b in active.nonzero().reshape(-1).tolist():
        key = (ops[b].cpu().numpy().tobytes(), prog_rows[b].cpu().numpy().tobytes(), lists[b].cpu().numpy().tobytes())
        groups.setdefault(key, []).append(b)
    for members in groups.values():
        rows = passing_rows_torch(bits, ops, prog_rows, post_rows, post_offsets, lists, members[0], n)
        if rows.numel() == 0:
            continue
        sel = codes.index_select(0, rows)
        qg = qcodes[members]
        if d <= 1040:  # int8 products summed exactly in float32
            s = (sel.float() @ qg.float().t()).round().to(torch.int64)
        else:
            s = sel.to(torch.int64) @ qg.to(torch.int64).t()
        if bias is not None:
            s = s + bias[members][:, torch.searchsorted(cluster_offsets, rows, right=True) - 1].t().to(s.dtype)
        kb = make_keys(s.t(), rows[None, :])
        take = min(k, rows.numel())
        keys[members, :take] = kb.topk(take, dim=1, sorted=False).values
    return keys.sort(dim=1, descending=True).values


def _check_lists(post_rows, post_offsets, lists, active, batch: int) -> None:
    if post_rows.dtype != torch.int32 or post_rows.dim() != 1:
        raise ValueError(f"post_rows must be int32 [E], got {post_rows.dtype} {tuple(post_rows.shape)}")
    if post_offsets.dtype != torch.int64 or post_offsets.dim() != 1 or post_offsets.numel() < 1:
        raise ValueError(f"post_offsets must be int64 [V + 1], got {post_offsets.dtype} {tuple(post_offsets.shape)}")
    if lists.dtype != torch.int64 or lists.dim() != 2 or lists.shape[0] != batch:
        raise ValueError(f"lists must be int64 [{batch}, T2], got {lists.dtype} {tuple(lists.shape)}")
    if active.dtype != torch.bool or active.shape != (batch,):
        raise ValueError(f"active must be bool [{batch}], got {active.dtype} {tuple(active.shape)}")


def _check_filtered_topk(queries, codes, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k: int,
                         cluster_offsets=None, cluster_scores=None) -> None:
    """ValueError naming the first bad argument (shapes and dtypes only: no host synchronisation)."""
    if (cluster_offsets is None) != (cluster_scores is None):
        raise ValueError("cluster_offsets and cluster_scores go together (residual codes)")
    if cluster_offsets is not None and (
            cluster_offsets.dtype != torch.int64 or cluster_offsets.dim() != 1 or cluster_scores.dim() != 2
            or tuple(cluster_scores.shape) != (queries.shape[0], cluster_offsets.numel() - 1)):
        raise ValueError(f"cluster_offsets int64 [nlist + 1] and cluster_scores [B, nlist] expected, got "
                         f"{cluster_offsets.dtype} {tuple(cluster_offsets.shape)} and {tuple(cluster_scores.shape)}")
    check_program(bits, ops, prog_rows)
    _check_lists(post_rows, post_offsets, lists, active, queries.shape[0])
    if codes.dtype != torch.int8 or codes.dim() != 2 or queries.dim() != 2 or queries.shape[1] != codes.shape[1]:
        raise ValueError(f"queries [B, D] / codes int8 [N, D] expected, got {tuple(queries.shape)} / {codes.dtype} {tuple(codes.shape)}")
    if bits.shape[1] != (codes.shape[0] + 63) // 64:
        raise ValueError(f"bits must have ceil(N / 64) = {(codes.shape[0] + 63) // 64} words per row, got {bits.shape[1]}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


@torch.library.custom_op("silverrec::filtered_topk", mutates_args=())
def filtered_topk(
    queries: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bits: torch.Tensor,
    ops: torch.Tensor,
    prog_rows: torch.Tensor,
    post_rows: torch.Tensor,
    post_offsets: torch.Tensor,
    lists: torch.Tensor,
    active: torch.Tensor,
    k: int,
    max_candidates: int,
    cluster_offsets: Optional[torch.Tensor] = None,
    cluster_scores: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    _check_filtered_topk(queries, codes, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k,
                         cluster_offsets, cluster_scores)
    b = queries.shape[0]
    if not bool(active.any()):  # the usual case inside the filtered search: nothing to do
        return (
            torch.full((b, k), float("-inf"), dtype=torch.float32, device=queries.device),
            torch.full((b, k), -1, dtype=torch.int64, device=queries.device),
        )
    qcodes, qscale = quantize_queries(queries)
    bias, shift = (None, None) if cluster_scores is None else cluster_bias(cluster_scores.float(), qscale, scale)
    offsets = None if cluster_offsets is None else cluster_offsets.contiguous()
    ext = cpu_ext() if codes.device.type == "cpu" else None
    args = (bits.contiguous(), ops.contiguous(), prog_rows.contiguous(), post_rows.contiguous(), post_offsets.contiguous(), lists.contiguous(), active.contiguous(), k)
    if ext is not None and hasattr(ext, "filtered_topk_keys"):
        keys = ext.filtered_topk_keys(qcodes, codes.contiguous(), *args, offsets, bias)
        scores, rows = ext.keys_to_results(keys, qscale, queries.float().sum(dim=1), scale, offset)
    else:
        keys = filtered_keys_torch(qcodes, codes, *args, offsets, bias)
        int_scores, rows = split_keys(keys)
        scores = dequantize_scores(int_scores, qscale, queries.float().sum(dim=1), scale, offset, valid=rows >= 0)
    return scores if shift is None else scores + shift[:, None], rows


@filtered_topk.register_fake
def _(queries, codes, scale, offset, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k, max_candidates,
      cluster_offsets=None, cluster_scores=None):
    b = queries.shape[0]
    return queries.new_empty(b, k, dtype=torch.float32), queries.new_empty(b, k, dtype=torch.int64)


def filtered_topk_cuda(queries, codes, scale, offset, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k,
                       max_candidates, cluster_offsets=None, cluster_scores=None):
    """The op on CUDA: the Triton kernel (tests run it on CPU tensors under TRITON_INTERPRET=1)."""
    from silverrec.kernels.filtered_topk_triton import filtered_keys_triton

    _check_filtered_topk(queries, codes, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k,
                         cluster_offsets, cluster_scores)
    qcodes, qscale = quantize_queries(queries)
    bias, shift = (None, None) if cluster_scores is None else cluster_bias(cluster_scores.float(), qscale, scale)
    keys = filtered_keys_triton(qcodes, codes, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k, max_candidates,
                                cluster_offsets=cluster_offsets, bias=bias)
    int_scores, rows = split_keys(keys)
    scores = dequantize_scores(int_scores, qscale, queries.float().sum(dim=1), scale, offset, valid=rows >= 0)
    return scores if shift is None else scores + shift[:, None], rows


torch.library.register_kernel("silverrec::filtered_topk", "cuda", filtered_topk_cuda)
