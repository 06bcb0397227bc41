"""`silverrec::int8_topk`: exact top-k by inner product against int8 item codes.

Items are stored as int8 codes with one global scale and offset (item ~= scale * code + offset).
Queries are quantised to int8 per query, so the hot loop is int8 x int8 -> int32 (dp4a / IMMA on
a GPU, VNNI / AMX on a CPU). The ranking is exact for the int8 scores: ties break by lower row.

    scores, rows = torch.ops.silverrec.int8_topk(queries, codes, scale, offset, k)
    # queries float [B, D], codes int8 [N, D], scale/offset float32 [] ; k <= N
    # -> scores float32 [B, k] (descending), rows int64 [B, k]

CPU: the fused C++ scan (`kernels/csrc/`, `silverrec.kernels._cpu.topk_keys`: VNNI dot products
of 16 queries per row, running top-k per query) when the extension is built; otherwise
`topk_keys_cpu`, the torch reference path: chunked over N (memory O(B * chunk)), with a running
per-query threshold so that after the first chunk only items that beat the current k-th best are
touched. CUDA: the Triton kernel in
`int8_topk_triton.py` scores a chunk into sort keys, `torch.topk` merges on the device.
"""

import torch

from silverrec.kernels.cpu_ext import cpu_ext
from silverrec.kernels.common import (
    EMPTY_KEY,
    dequantize_scores,
    make_keys,
    quantize_queries,
    split_keys,
)

CHUNK_ROWS = 65536
TILE = 64  # items per threshold tile in the CPU scan


def _check(queries: torch.Tensor, codes: torch.Tensor, k: int) -> None:
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"codes must be int8 [N, D], got {codes.dtype} {tuple(codes.shape)}")
    if queries.dim() != 2 or queries.shape[1] != codes.shape[1]:
        raise ValueError(
            f"queries must be [B, {codes.shape[1]}], got {tuple(queries.shape)}"
        )
    if not 0 < k <= codes.shape[0]:
        raise ValueError(f"k must be in [1, {codes.shape[0]}] (the item count), got {k}")


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


def topk_keys_cpu(qcodes: torch.Tensor, codes: torch.Tensor, k: int, chunk: int = CHUNK_ROWS) -> torch.Tensor:
    """Exact top-k sort keys of int8 dot products, chunked over the items.

    Per chunk: one int8 GEMM (`torch._int_mm`, VNNI/AMX on x86) into int32 scores [B, c]. The first
    chunk's top-k sets a per-query threshold (its k-th best score); later chunks keep only tiles of
    64 items whose max beats the threshold and, inside them, only items that beat it (later rows
    lose ties to earlier ones, so "beats" is strict). Candidates are merged into the top-k only when
    B * k of them are pending, which tightens the threshold without a merge per chunk.

    Args:
        qcodes: int8 [B, D]; codes: int8 [N, D]; k <= N.
    Returns:
        int64 [B, k] sort keys, sorted descending.
    """
    n = codes.shape[0]
    B = qcodes.shape[0]
    step = -(-max(chunk, k) // TILE) * TILE  # the first chunk alone fills the top-k
    first = torch._int_mm(qcodes, codes[:step].t())  # [B, c] int32
    # k-th best int32 score of the first chunk; only items reaching it get (int64) sort keys.
    top_scores, top_rows = first.topk(k, dim=1, sorted=False)
    kth = top_scores.amin(dim=1)
    if bool(((first >= kth[:, None]).sum(dim=1, dtype=torch.int32) == k).all()):  # no tie straddles k-th place
        best = make_keys(top_scores, top_rows)
    else:
        b, j = (first >= kth[:, None]).nonzero(as_tuple=True)
        best = merge_candidates(torch.full((B, k), EMPTY_KEY, dtype=torch.int64), b, make_keys(first[b, j], j))
    threshold = (best.amin(dim=1) >> 32).to(torch.int32)
    pending_q: list[torch.Tensor] = []
    pending_keys: list[torch.Tensor] = []
    pending = 0
    for start in range(step, n, step):
        scores = torch._int_mm(qcodes, codes[start : start + step].t())  # [B, c] int32
        full = scores.shape[1] // TILE * TILE
        tiles = scores[:, :full].unflatten(1, (-1, TILE))  # [B, c / TILE, TILE]
        b, t = (tiles.amax(dim=2) > threshold[:, None]).nonzero(as_tuple=True)
        if b.numel():
            values = tiles[b, t]  # [M, TILE]
            m, j = (values > threshold[b][:, None]).nonzero(as_tuple=True)
            pending_q.append(b[m])
            pending_keys.append(make_keys(values[m, j], start + t[m] * TILE + j))
            pending += m.numel()
        if full < scores.shape[1]:  # ragged tail of the last chunk (< TILE items)
            tail = scores[:, full:]
            b, j = (tail > threshold[:, None]).nonzero(as_tuple=True)
            pending_q.append(b)
            pending_keys.append(make_keys(tail[b, j], start + full + j))
            pending += j.numel()
        if pending > B * k:
            best = _merge_pending(best, pending_q, pending_keys)
            threshold = (best.amin(dim=1) >> 32).to(torch.int32)
            pending_q, pending_keys, pending = [], [], 0
    if pending:
        best = _merge_pending(best, pending_q, pending_keys)
    return best.sort(dim=1, descending=True).values


def _merge_pending(best: torch.Tensor, queries: list[torch.Tensor], keys: list[torch.Tensor]) -> torch.Tensor:
    q = torch.cat(queries)
    order = torch.argsort(q, stable=True)
    return merge_candidates(best, q[order], torch.cat(keys)[order])


def _int8_topk_impl(queries, codes, scale, offset, k, keys_fn):
    _check(queries, codes, k)
    qcodes, qscale = quantize_queries(queries)
    keys = keys_fn(qcodes, codes, k)
    int_scores, rows = split_keys(keys)
    scores = dequantize_scores(int_scores, qscale, queries.float().sum(dim=1), scale, offset)
    return scores, rows


@torch.library.custom_op("silverrec::int8_topk", mutates_args=())
def int8_topk(
    queries: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU (C++ fast path, torch fallback). See module docstring for the contract."""
    ext = cpu_ext()
    if ext is None:
        return _int8_topk_impl(queries, codes, scale, offset, k, topk_keys_cpu)
    _check(queries, codes, k)
    qcodes, qscale = quantize_queries(queries)
    keys = ext.topk_keys(qcodes, codes.contiguous(), k)
    return ext.keys_to_results(keys, qscale, queries.float().sum(dim=1), scale, offset)


@int8_topk.register_fake
def _(queries, codes, scale, offset, k):
    b = queries.shape[0]
    return queries.new_empty(b, k, dtype=torch.float32), queries.new_empty(b, k, dtype=torch.int64)


@torch.library.register_kernel("silverrec::int8_topk", "cuda")
def _(queries, codes, scale, offset, k):
    from silverrec.kernels.int8_topk_triton import topk_keys_triton

    return _int8_topk_impl(queries, codes, scale, offset, k, topk_keys_triton)


def int8_topk_reference(
    queries: torch.Tensor, codes: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent integer reference: exact int64 dot products, full stable sort.

    Returns (int64 integer scores [B, k], int64 rows [B, k]), ties broken by lower row.
    """
    qcodes, _ = quantize_queries(queries)
    s = qcodes.to(torch.int64) @ codes.to(torch.int64).t()  # [B, N]
    order = torch.sort(-s, dim=1, stable=True).indices[:, :k]
    return torch.gather(s, 1, order), order
