"""`silverrec::candidate_rows`: the retrieval stage's tail, from the search's rows to the candidates ranked.

    cand = torch.ops.silverrec.candidate_rows(queries, found, exclude, emb, k0, limit, intersection)
    # queries float32 [B*T, D] (request b's task t at row b*T + t), found int64 [B*T, K] (the
    # search's rows per query, -1 = none, no row twice in a query's list), exclude int64 [B, E]
    # (rows never to return, any order, -1 = none), emb [N, D] (the embedding
    # cache, bfloat16 or float32), k0 <= K, limit >= 1 -> int64 [B, limit], -1 padded

Per request and task: the excluded rows dropped, the rest re-scored exactly (<query, emb[row]> in
float32 arithmetic on the stored values), the best k0 kept (ties by position in `found`; a NaN
or -inf score drops the row); then the tasks' lists merged rank by rank (every task's first row,
then every task's second, ...), each row once (union) or only the rows every task holds
(intersection, T > 1), the first `limit` of them (`merge_tasks`).

Why one op: at batch 1 these steps are ~50 tensor ops (exclusion table, gather, bf16 cast, bmm,
sort, merge table, cumsum, scatter) over a few hundred rows, whose dispatch cost ~0.19 ms of a
0.65 ms TorchScript forward on the MovieLens snapshot (1 thread) against tens of microseconds of
arithmetic. CPU: one C++ pass per request (kernels/csrc/candidates.cpp; exclusions and merge
through small hash tables, so nothing is sized by the pool). The composition below
(`candidate_rows_torch`) is the CUDA kernel and the tests' reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

# pools of at most this many rows merge and exclude through [B, N + 1] tables (merge_tasks, exclude_rows)
DENSE_MAX_ROWS = 1 << 16


def merge_tasks(rows: Tensor, intersection: bool, limit: int, num_rows: int = -1,
                dense_max_rows: int = DENSE_MAX_ROWS) -> Tensor:
    """Each task's candidate rows, best first, int64 [B, T, K] (-1 = none; no task lists a row twice)
    -> one list per request int64 [B, limit]: the tasks' rows taken rank by rank (every task's
    first row, then every task's second, ...), each row once (union) or only the rows every task
    holds (intersection), the first `limit` of them; -1 pads.

    Rank-by-rank order caps the list without comparing scores across tasks (their scales differ):
    with `limit` >= T*K it is the whole union. All static shapes. A pool of `num_rows` <=
    `dense_max_rows` rows: a [B, N + 1] table holds each row's first position (scatter-min; and
    its count, for the intersection), and a running count of the kept entries places them.
    Otherwise (or `num_rows` -1): a stable sort finds each row's first occurrence and a top-k of
    positions compacts the kept rows to the front (the list is padded by `limit` empty slots
    first, so any limit works whatever K is).
    """
    B, T, K = rows.shape
    if 0 <= num_rows <= dense_max_rows:
        order = rows.transpose(1, 2).reshape(B, K * T)  # rank-major
        m = order.shape[1]
        col = order + 1  # row -1 -> column 0
        pos = torch.arange(m, device=rows.device).expand(B, m)
        first = torch.full((B, num_rows + 1), m, dtype=order.dtype, device=rows.device).scatter_reduce(
            1, col, pos, "amin")
        keep = (first.gather(1, col) == pos) & (order >= 0)
        if intersection and T > 1:
            count = torch.zeros(B, num_rows + 1, dtype=order.dtype, device=rows.device).scatter_add(
                1, col, torch.ones_like(order))
            keep = keep & (count.gather(1, col) == T)
        slot = torch.cumsum(keep.to(order.dtype), dim=1) - 1  # where each kept entry goes
        slot = torch.where(keep & (slot < limit), slot, torch.full_like(slot, limit))  # the rest: a spare column
        out = torch.full((B, limit + 1), -1, dtype=order.dtype, device=rows.device).scatter(1, slot, order)
        return out[:, :limit]
    empty = torch.full((B, limit), -1, dtype=rows.dtype, device=rows.device)
    order = torch.cat([rows.transpose(1, 2).reshape(B, K * T), empty], dim=1)
    srt, perm = torch.sort(order, dim=1, stable=True)
    first = torch.cat([torch.ones_like(srt[:, :1], dtype=torch.bool), srt[:, 1:] != srt[:, :-1]], dim=1)
    keep = first & (srt >= 0)
    if intersection and T > 1:  # a row's first copy is kept when the T-1 next entries repeat it
        shifted = torch.cat([srt[:, T - 1:], torch.full_like(srt[:, : T - 1], -1)], dim=1)
        keep = keep & (shifted == srt)
    kept = torch.zeros_like(keep).scatter(1, perm, keep)  # back in rank-major order
    pos = torch.arange(order.shape[1], device=rows.device).expand(B, -1)
    front = torch.topk(torch.where(kept, pos, pos + order.shape[1]), limit, dim=1, largest=False).indices
    return torch.where(kept.gather(1, front), order.gather(1, front), torch.full_like(front, -1))


def exclude_rows(rows: Tensor, exclude: Tensor, num_rows: int, dense_max_rows: int = DENSE_MAX_ROWS) -> Tensor:
    """rows int64 [B, M] (-1 = none), exclude int64 [B, E >= 1] (any order, -1 = none) -> rows with
    every excluded row set to -1.

    A pool of at most `dense_max_rows` rows: one bool table [B, N + 1] per batch (column 0 is
    row -1), the exclusions scattered in, the rows gathered. A larger pool: one 1-D search over every
    request's exclusions: row b's values are shifted by b * (N + 2) so that the flattened
    exclusions stay sorted (a batched searchsorted would guard the batch size). `num_rows` is the
    snapshot's constant, so the choice is fixed at publish (no shape guard).
    """
    if num_rows <= dense_max_rows:
        table = torch.zeros(rows.shape[0], num_rows + 1, dtype=torch.bool, device=rows.device)
        table.scatter_(1, exclude + 1, torch.ones_like(exclude, dtype=torch.bool))
        hit = table.gather(1, rows + 1)
        return torch.where(hit | (rows < 0), torch.full_like(rows, -1), rows)
    base = torch.arange(rows.shape[0], device=rows.device)[:, None] * (num_rows + 2)
    ex = (torch.sort(exclude, dim=1).values + 1 + base).reshape(-1)
    q = rows + 1 + base
    pos = torch.searchsorted(ex, q.reshape(-1)).clamp_max(ex.shape[0] - 1)
    hit = ex[pos].reshape(q.shape) == q
    return torch.where(hit | (rows < 0), torch.full_like(rows, -1), rows)


def candidate_rows_torch(queries: Tensor, found: Tensor, exclude: Tensor, emb: Tensor, k0: int, limit: int,
                         intersection: bool) -> Tensor:
    """The reference (device-generic; see the module docstring): int64 [B, limit]."""
    B, E = exclude.shape
    K, D, n = found.shape[1], queries.shape[1], emb.shape[0]
    T = found.shape[0] // B if B else 1
    if found.shape[0] != B * T or emb.shape[1] != D:
        raise ValueError(f"candidate_rows: found {tuple(found.shape)}, queries {tuple(queries.shape)}, exclude "
                         f"{tuple(exclude.shape)} and emb {tuple(emb.shape)} disagree (found [B*T, K], queries "
                         f"[B*T, D], exclude [B, E], emb [N, D])")
    flat = exclude_rows(found.reshape(B, T * K), exclude, n)  # [B, T*K], task-major
    cand = emb.index_select(0, flat.clamp(min=0).reshape(-1)).to(queries.dtype).reshape(B * T, K, D)
    # task t's rows by task t only: the row-vector form [B*T, 1, D] x [B*T, D, K]
    own = torch.bmm(queries.unsqueeze(1), cand.transpose(1, 2)).reshape(B, T, K)
    own = torch.where((flat.reshape(B, T, K) >= 0) & (own > float("-inf")), own, float("-inf"))  # NaN too
    values, order = torch.sort(own, dim=2, descending=True, stable=True)
    values, order = values[:, :, :k0], order[:, :, :k0]
    rows_t = flat.reshape(B, T, K).gather(2, order)
    rows_t = torch.where(values > float("-inf"), rows_t, torch.full_like(rows_t, -1))
    return merge_tasks(rows_t, intersection, limit, n)


torch.library.register_kernel("silverrec::candidate_rows", "cuda", candidate_rows_torch)
