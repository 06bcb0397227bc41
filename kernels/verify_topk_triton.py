"""Triton kernel for `silverrec::verify_topk` on CUDA (contract in kernels/filtered_topk.py).

One program per query walks its ranked list in tiles of BLOCK entries: each entry's word of the
row bank (row >> 6) goes through the query's exact verify program (`program_words`, the evaluator
of kernels/bloom_filter_triton.py, stack in a per-query scratch area of global memory), the row's
bit decides, and an in-tile prefix sum (tl.cumsum) of the passing entries gives each one its
output slot after the `kept` entries of earlier tiles. Nothing is sorted: the input order is kept.
The loop stops at the first tile after which k entries passed, so a query whose first k entries
pass reads one or two tiles; the others keep going until their list ends.

Entries with row -1 (padding) or a row past the bank never pass (as on the torch path, whose bank
windows read zeros there); the output is pre-filled with -inf / -1. Device memory: the outputs
[B, k] and the program stacks int64 [B, L, BLOCK]; no host synchronisation.
Runs on CPU tensors under TRITON_INTERPRET=1 (tests/test_verify_topk_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from silverrec.kernels.bloom_filter_triton import program_words

BLOCK = 128  # entries per tile (k + k / 4 + 16 entries come in from the filtered search)


@triton.jit
def _verify_topk_kernel(
    bits_ptr,  # int64 [R, W] row bank
    ops_ptr,  # int64 [B, L] verify programs
    prog_ptr,  # int64 [B, L, T]
    scores_ptr,  # float32 [B, K2] ranked scores
    rows_ptr,  # int64 [B, K2] ranked rows (-1 = padding)
    out_s_ptr,  # float32 [B, k], pre-filled with -inf
    out_r_ptr,  # int64 [B, k], pre-filled with -1
    scratch_ptr,  # int64 [B, L, BLOCK] program stacks
    W,
    L,
    T,
    K2,
    k,
    BLOCK: tl.constexpr,
):
    """out[b, :kept] = the entries i of row b (in order) with rows[b, i] passing program b, first k of them."""
    b = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK)
    all_lanes = lane >= 0
    scratch = scratch_ptr + b * L * BLOCK + lane
    kept = tl.zeros((), tl.int32)
    i0 = 0
    while (i0 < K2) & (kept < k):
        idx = i0 + lane
        inb = idx < K2
        rows = tl.load(rows_ptr + b * K2 + idx, mask=inb, other=-1)
        widx = rows >> 6
        valid = (rows >= 0) & (widx < W)
        words = program_words(bits_ptr, W, ops_ptr, prog_ptr, b, L, T, widx, valid, scratch, BLOCK, all_lanes, BLOCK)
        ok = valid & (((words >> (rows & 63)) & 1) != 0)
        slot = kept + tl.cumsum(ok.to(tl.int32), axis=0) - 1
        put = ok & (slot < k)
        scores = tl.load(scores_ptr + b * K2 + idx, mask=inb, other=0.0)
        tl.store(out_s_ptr + b * k + slot, scores, mask=put)
        tl.store(out_r_ptr + b * k + slot, rows, mask=put)
        kept += tl.sum(ok.to(tl.int32), axis=0)
        i0 += BLOCK


def verify_topk_triton(
    bits: torch.Tensor, ops: torch.Tensor, prog_rows: torch.Tensor, scores_in: torch.Tensor, rows_in: torch.Tensor, k: int,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: (scores float32 [B, k], rows int64 [B, k]) from a ranked list float32 / int64 [B, K2].

    `block` (a power of two >= 16) is the tile of entries per step; tests use a small one to cross tiles.
    """
    bits, ops, prog_rows, rows_in = (t.contiguous() for t in (bits, ops, prog_rows, rows_in))
    scores_in = scores_in.float().contiguous()
    B, K2 = rows_in.shape
    L = ops.shape[1]
    scores = torch.full((B, k), float("-inf"), dtype=torch.float32, device=rows_in.device)
    rows = torch.full((B, k), -1, dtype=torch.int64, device=rows_in.device)
    if B == 0 or K2 == 0 or L == 0:
        return scores, rows
    scratch = torch.empty((B, L, block), dtype=torch.int64, device=rows_in.device)
    _verify_topk_kernel[(B,)](
        bits, ops, prog_rows, scores_in, rows_in, scores, rows, scratch,
        bits.shape[1], L, prog_rows.shape[2], K2, k, BLOCK=block,
    )
    return scores, rows
