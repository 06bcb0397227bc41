"""`silverrec::masked_topk`: exact int8 top-k restricted to the rows set in a packed bitmask.

    scores, rows = torch.ops.silverrec.masked_topk(queries, codes, scale, offset, mask, active, k)
    # queries float [B, D], codes int8 [N, D], scale/offset float32 []
    # mask   int64 [B, Wm]  bit (r & 63) of word r >> 6 set = row r allowed (rows >= N ignored)
    # active bool  [B]      queries to answer; inactive rows come back as padding
    # -> scores float32 [B, k] (descending, -inf padding), rows int64 [B, k] (-1 padding)

This is the "filter, then exact scan" half of the filtered search: the filter has already run over
the whole pool (`silverrec::bloom_filter` with one window per query), and the scan touches only
the allowed rows, so its cost is proportional to the filter's selectivity. Scores are the same
int8 dot products as `silverrec::int8_topk`, ties broken by lower row.

CPU: the fused C++ scan (`silverrec.kernels._cpu.masked_topk_keys`) when the extension is built:
it walks each active query's mask 64 rows per word and scores only the allowed rows, 16 queries
per row where they share them. Otherwise (and on CUDA) the implementation is device-generic torch (bit unpacking, nonzero, a gather of the allowed rows
and one matmul per active query); int8 products are summed exactly in float32 (|sum| < 2**24 for
D <= 1040), in int64 beyond that.
"""

from __future__ import annotations

import torch

from silverrec.kernels.common import EMPTY_KEY, dequantize_scores, make_keys, quantize_queries, split_keys
from silverrec.kernels.cpu_ext import cpu_ext

_SHIFTS = torch.arange(64, dtype=torch.int64)


def unpack_rows(words: torch.Tensor, n: int) -> torch.Tensor:
    """Rows (int64 [M], ascending, < n) whose bit is set in int64 words [W]."""
    bits = (words[:, None] >> _SHIFTS.to(words.device)) & 1  # [W, 64]
    rows = bits.reshape(-1).nonzero().reshape(-1)
    return rows[rows < n]


def _check(queries, codes, mask, active, k) -> None:
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"codes must be int8 [N, D], got {codes.dtype} {tuple(codes.shape)}")
    if queries.dim() != 2 or queries.shape[1] != codes.shape[1]:
        raise ValueError(f"queries must be [B, {codes.shape[1]}], got {tuple(queries.shape)}")
    if mask.dtype != torch.int64 or mask.dim() != 2 or mask.shape[0] != queries.shape[0]:
        raise ValueError(f"mask must be int64 [B, W], got {mask.dtype} {tuple(mask.shape)}")
    if active.dtype != torch.bool or active.shape != (queries.shape[0],):
        raise ValueError(f"active must be bool [B], got {active.dtype} {tuple(active.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


@torch.library.custom_op("silverrec::masked_topk", mutates_args=())
def masked_topk(
    queries: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    mask: torch.Tensor,
    active: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    _check(queries, codes, mask, active, k)
    if not bool(active.any()):  # nothing to answer (the filtered search's usual case): padding only
        b = queries.shape[0]
        return (
            torch.full((b, k), float("-inf"), dtype=torch.float32, device=queries.device),
            torch.full((b, k), -1, dtype=torch.int64, device=queries.device),
        )
    qcodes, qscale = quantize_queries(queries)
    ext = cpu_ext() if codes.device.type == "cpu" else None
    if ext is not None:
        keys = ext.masked_topk_keys(qcodes, codes.contiguous(), mask.contiguous(), active.contiguous(), k)
        return ext.keys_to_results(keys, qscale, queries.float().sum(dim=1), scale, offset)
    keys = masked_keys_torch(qcodes, codes, mask, active, k)
    int_scores, rows = split_keys(keys)
    scores = dequantize_scores(int_scores, qscale, queries.float().sum(dim=1), scale, offset, valid=rows >= 0)
    return scores, rows


def masked_keys_torch(qcodes: torch.Tensor, codes: torch.Tensor, mask: torch.Tensor, active: torch.Tensor, k: int) -> torch.Tensor:
    """Device-generic torch path: top-k keys int64 [B, k] (descending, EMPTY_KEY padding)."""
    B = qcodes.shape[0]
    n, d = codes.shape
    keys = torch.full((B, k), EMPTY_KEY, dtype=torch.int64, device=codes.device)
    exact_float = d <= 1040
    groups: dict[bytes, list[int]] = {}  # queries with identical masks share one gather + matmul
    for b in active.nonzero().reshape(-1).tolist():
        groups.setdefault(mask[b].cpu().numpy().tobytes(), []).append(b)
    for members in groups.values():
        rows = unpack_rows(mask[members[0]], n)
        if rows.numel() == 0:
            continue
        sel = codes.index_select(0, rows)
        qg = qcodes[members]  # [G, D]
        if exact_float:
            s = (sel.float() @ qg.float().t()).round().to(torch.int64)  # [M, G]
        else:
            s = sel.to(torch.int64) @ qg.to(torch.int64).t()
        kb = make_keys(s.t(), rows[None, :])  # [G, M]
        take = min(k, rows.numel())
        keys[members, :take] = kb.topk(take, dim=1, sorted=False).values
    return keys.sort(dim=1, descending=True).values


@masked_topk.register_fake
def _(queries, codes, scale, offset, mask, active, k):
    b = queries.shape[0]
    return queries.new_empty(b, k, dtype=torch.float32), queries.new_empty(b, k, dtype=torch.int64)
