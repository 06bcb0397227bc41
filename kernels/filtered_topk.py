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

    scores, rows = torch.ops.silverrec.filtered_topk(queries, codes, scale, offset, bits, [ops, prog_rows],
                                                     [post_rows, post_offsets, lists], active, k, max_candidates,
                                                     residual)
    # queries float [B, D], codes int8 [N, D], scale / offset float32 [] (item ~= scale * code + offset)
    # bits int64 [R, W] the row bank, (ops, prog_rows) the filter programs, as verify_topk's
    # postings: post_rows int32 [E], post_offsets int64 [V + 1]: posting list l = the ascending rows
    #     post_rows[post_offsets[l]:post_offsets[l + 1]] (the rows holding one (feature, value) token);
    #     lists int64 [B, T2]: posting lists whose union holds every row the query's filter passes
    #     (NO_LIST = unused slot); lists[b, 0] == NO_LISTS: the query filters the whole pool (the
    #     row's other entries are ignored)
    # active bool [B]: queries to answer (others come back as padding)
    # max_candidates int: an upper bound on the rows of any active query's lists (the filtered
    #     search's posting_limit); the CUDA path sizes its candidate buffer with it
    # -> scores float32 [B, k] (descending, -inf padding), rows int64 [B, k] (-1 padding)
    # residual: [] for direct codes, or [cluster_offsets int64 [nlist + 1], centroids float32 [nlist, D],
    #     centroid_queries float32 [B, D]] (the unfolded queries): residual codes, every row of cluster c scores
    #     <centroid_queries[b], centroid c> more: an int32 bias on the int8 dots (`cluster_term`), for the
    #     clusters holding the query's passing rows only (a selective filter computes no other)

"Filter, then exact scan": the rows passing the program (from the candidate lists, or the whole
pool) are scored exactly like `silverrec::ivf_scan` scores rows (int8 dot products, ties to the lower row).
With posting lists the cost is proportional to the candidates, not to N.

CPU: kernels/csrc/filter_scan.cpp (queries with the same program and lists are evaluated once; the
passing rows are scored by the fused scan); `filtered_keys_torch` (per group on the host: `bloom_filter` on
the candidates' words, a gather and one matmul) is the reference the tests compare the C++ path with. CUDA: the Triton kernel of kernels/filtered_topk_triton.py
(`filtered_keys_triton`: the program evaluated per tile of rows, exact int8 dots, a radix select
of the k-th best row and a compaction into [B, k + slack] keys), the same keys with static shapes,
no host synchronisation and no buffer proportional to N; `max_candidates` bounds the positions
it reads from each query's lists.
"""

from __future__ import annotations


import torch

from silverrec.kernels.bloom_filter import check_program
from silverrec.kernels.common import cluster_bias, cluster_of_rows, dequantize_scores, dot_lanes, make_keys, quantize_queries, split_keys
from silverrec.kernels.constants import EMPTY_KEY, NO_LISTS

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
    """The reference: verify every entry, stable-move the passing ones first, keep k."""
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


def cluster_term(queries, centroids, clusters, unit) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual codes' cluster term over the clusters a query visits: queries float32 [M, D], centroids
    float32 [nlist, D], clusters int64 [C] (those holding the passing rows), unit float32 [M] (the scores'
    integer unit) -> (bias int32 [M, C], shift float32 [M]): kernels/common.py cluster_bias over those
    clusters only (csrc/filter_scan.cpp computes the same)."""
    scores = dot_lanes(queries[:, None, :], centroids.float()[clusters][None])  # the C++ kernel's sums
    return cluster_bias(scores, unit, torch.ones((), device=unit.device))


def filtered_keys_torch(qcodes, codes, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k: int,
                        cluster_offsets=None, centroids=None, centroid_queries=None, unit=None):
    """The reference: top-k keys int64 [B, k] (descending, EMPTY_KEY padding); with residual codes
    (cluster_offsets, centroids, centroid_queries, unit: see the op) also the shift float32 [B] to add to
    the scores, else None."""
    B = qcodes.shape[0]
    n, d = codes.shape
    keys = torch.full((B, k), EMPTY_KEY, dtype=torch.int64, device=codes.device)
    shift = None if centroids is None else torch.zeros(B, dtype=torch.float32, device=codes.device)
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
        if centroids is not None:  # + the cluster term of each row's cluster (those present only)
            present, of_row = torch.unique(cluster_of_rows(cluster_offsets, rows), return_inverse=True)
            bias, shift[members] = cluster_term(centroid_queries[members], centroids, present, unit[members])
            s = s + bias[:, of_row].t().to(s.dtype)
        kb = make_keys(s.t(), rows[None, :])
        take = min(k, rows.numel())
        keys[members, :take] = kb.topk(take, dim=1, sorted=False).values
    return keys.sort(dim=1, descending=True).values, shift


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
                         cluster_offsets=None, centroids=None, centroid_queries=None) -> None:
    """ValueError naming the first bad argument (shapes and dtypes only: no host synchronisation)."""
    if not (cluster_offsets is None) == (centroids is None) == (centroid_queries is None):
        raise ValueError("cluster_offsets, centroids and centroid_queries go together (residual codes)")
    if cluster_offsets is not None and (
            cluster_offsets.dtype != torch.int64 or cluster_offsets.dim() != 1
            or tuple(centroids.shape) != (cluster_offsets.numel() - 1, queries.shape[1])
            or tuple(centroid_queries.shape) != tuple(queries.shape)):
        raise ValueError(f"cluster_offsets int64 [nlist + 1], centroids [nlist, D] and centroid_queries [B, D] expected, "
                         f"got {cluster_offsets.dtype} {tuple(cluster_offsets.shape)}, {tuple(centroids.shape)} and "
                         f"{tuple(centroid_queries.shape)}")
    check_program(bits, ops, prog_rows)
    _check_lists(post_rows, post_offsets, lists, active, queries.shape[0])
    if codes.dtype != torch.int8 or codes.dim() != 2 or queries.dim() != 2 or queries.shape[1] != codes.shape[1]:
        raise ValueError(f"queries [B, D] / codes int8 [N, D] expected, got {tuple(queries.shape)} / {codes.dtype} {tuple(codes.shape)}")
    if bits.shape[1] != (codes.shape[0] + 63) // 64:
        raise ValueError(f"bits must have ceil(N / 64) = {(codes.shape[0] + 63) // 64} words per row, got {bits.shape[1]}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


def _unpacked(program, postings, residual) -> tuple:
    """The op's lists as (ops, prog_rows, post_rows, post_offsets, lists, cluster_offsets, centroids,
    centroid_queries), the last three None for direct codes; a ValueError naming a list of the wrong length."""
    if len(program) != 2 or len(postings) != 3:
        raise ValueError(f"filtered_topk: program must hold [ops, prog_rows] and postings [post_rows, post_offsets, "
                         f"lists], got {len(program)} and {len(postings)} tensors")
    if len(residual) not in (0, 3):
        raise ValueError(f"filtered_topk: residual is [] or [cluster_offsets, centroids, centroid_queries]: the "
                         f"three go together (residual codes), got {len(residual)} tensors")
    return (*program, *postings, *(residual if residual else (None, None, None)))


def filtered_topk_cuda(queries, codes, scale, offset, bits, program, postings, active, k, max_candidates, residual):
    """The op on CUDA: the Triton kernel (tests run it on CPU tensors under TRITON_INTERPRET=1). Residual codes:
    the cluster term of every cluster, shifted by the best of all (no host read of the clusters present): the
    ranking is the CPU's (`cluster_bias` differences do not depend on the shift), the scores may differ by the
    float rounding of the shift."""
    from silverrec.kernels.filtered_topk_triton import filtered_keys_triton

    ops, prog_rows, post_rows, post_offsets, lists, cluster_offsets, centroids, centroid_queries = _unpacked(
        program, postings, residual)
    _check_filtered_topk(queries, codes, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k,
                         cluster_offsets, centroids, centroid_queries)
    qcodes, qscale = quantize_queries(queries)
    bias, shift = (None, None) if centroids is None else cluster_bias(
        dot_lanes(centroid_queries.float()[:, None, :], centroids.float()[None]), qscale, scale)
    keys = filtered_keys_triton(qcodes, codes, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k, max_candidates,
                                cluster_offsets=cluster_offsets, bias=bias)
    int_scores, rows = split_keys(keys)
    scores = dequantize_scores(int_scores, qscale, queries.float().sum(dim=1), scale, offset, valid=rows >= 0)
    return scores if shift is None else scores + shift[:, None], rows


torch.library.register_kernel("silverrec::filtered_topk", "cuda", filtered_topk_cuda)
