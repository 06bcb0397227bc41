"""Triton kernel for `silverrec::bloom_filter` on CUDA.

One program per (query b, window p, block of BLOCK_W words). It walks query b's postfix program
instruction by instruction with a scalar stack pointer; the stack lives in a per-program scratch
area of global memory (`scratch[b, p, slot, words]`), so each lane only ever reads its own writes.
Runs on CPU tensors under TRITON_INTERPRET=1 (tests).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _bloom_filter_kernel(
    bits_ptr,  # int64 [R, W]
    ops_ptr,  # int64 [B, L]
    rows_ptr,  # int64 [B, L, T]
    start_ptr,  # int64 [B, P]
    out_ptr,  # int64 [B, P, NW]
    scratch_ptr,  # int64 [B, P, L, NW]
    W,
    L,
    T,
    P,
    NW,
    BLOCK_W: tl.constexpr,
):
    """out[b, p, w] = program_b over words start[b, p] + w (PUSH: AND_t +/-bits[rows[b, l, t]])."""
    bp = tl.program_id(0)
    b = bp // P
    offs = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    start = tl.load(start_ptr + bp)
    widx = start + offs
    valid = ((widx - offs) >= 0) & (offs < NW) & (widx < W)  # widx - offs == start, as a block
    in_block = offs < NW
    scratch = scratch_ptr + bp.to(tl.int64) * L * NW + offs
    sp = 0
    for l in range(0, L):
        op = tl.load(ops_ptr + b * L + l)
        if op == 1:  # PUSH
            acc = tl.full((BLOCK_W,), -1, tl.int64)
            for t in range(0, T):
                r = tl.load(rows_ptr + (b * L + l) * T + t)
                row = tl.where(r < 0, ~r, r)
                w = tl.load(bits_ptr + row * W + widx, mask=valid, other=0)
                acc = acc & tl.where(r < 0, ~w, w)
            tl.store(scratch + sp * NW, acc, mask=in_block)
            sp += 1
        elif op == 2 or op == 3:  # AND, OR
            x = tl.load(scratch + (sp - 2) * NW, mask=in_block, other=0)
            y = tl.load(scratch + (sp - 1) * NW, mask=in_block, other=0)
            z = tl.where(op == 2, x & y, x | y)
            tl.store(scratch + (sp - 2) * NW, z, mask=in_block)
            sp -= 1
        elif op == 4:  # NOT
            x = tl.load(scratch + (sp - 1) * NW, mask=in_block, other=0)
            tl.store(scratch + (sp - 1) * NW, ~x, mask=in_block)
        elif op == 5 or op == 6:  # FALSE, TRUE
            c = tl.where(op == 6, -1, 0).to(tl.int64)
            tl.store(scratch + sp * NW, tl.zeros((BLOCK_W,), tl.int64) + c, mask=in_block)
            sp += 1
    res = tl.load(scratch, mask=in_block, other=0)
    tl.store(out_ptr + bp.to(tl.int64) * NW + offs, tl.where(valid, res, 0), mask=in_block)


def bloom_filter_triton(
    bits: torch.Tensor, ops: torch.Tensor, rows: torch.Tensor, word_start: torch.Tensor, n_words: int
) -> torch.Tensor:
    """Launcher: int64 [B, P, n_words] mask (contract in kernels/bloom_filter.py)."""
    bits, ops, rows, word_start = (t.contiguous() for t in (bits, ops, rows, word_start))
    B, L = ops.shape
    P = word_start.shape[1]
    out = torch.zeros((B, P, n_words), dtype=torch.int64, device=bits.device)
    if B == 0 or P == 0 or L == 0:
        return out
    scratch = torch.empty((B, P, L, n_words), dtype=torch.int64, device=bits.device)
    BLOCK_W = max(16, min(256, triton.next_power_of_2(n_words)))
    grid = (B * P, triton.cdiv(n_words, BLOCK_W))
    _bloom_filter_kernel[grid](
        bits, ops, rows, word_start, out, scratch, bits.shape[1], L, rows.shape[2], P, n_words, BLOCK_W=BLOCK_W
    )
    return out
