"""Triton kernel for `silverrec::bloom_filter` on CUDA.

One program per (query b, window p, block of BLOCK_W words). It walks query b's postfix program
instruction by instruction with a scalar stack pointer (`program_words`, the evaluator that
kernels/filtered_topk_triton.py also calls per tile of rows); the stack lives in a per-program
scratch area of global memory (`scratch[b, p, slot, words]`). A lane's slot is written by one thread
and read by every thread holding that lane: a block of 64 lanes in 4 warps is held twice, and Triton
stores a replicated element from one thread only. So each stack store sits between two CTA barriers
(`_stack_store`). Without them a warp could read a slot before (or after) another warp rewrote it: on
an H200 a posting-list conjunction at 1M rows got recall 0.60 and 0.62 in two runs, and its eager and
graphed answers differed. Runs on CPU tensors under TRITON_INTERPRET=1 (tests), where the barriers do
nothing: programs run one at a time and cannot race.
"""

import torch
import triton
import triton.language as tl

from silverrec.kernels import constants

# the filter program's opcodes (kernels/constants.py), as the compile-time globals a Triton kernel may read
OP_PUSH = tl.constexpr(constants.OP_PUSH)
OP_AND = tl.constexpr(constants.OP_AND)
OP_OR = tl.constexpr(constants.OP_OR)
OP_NOT = tl.constexpr(constants.OP_NOT)
OP_FALSE = tl.constexpr(constants.OP_FALSE)
OP_TRUE = tl.constexpr(constants.OP_TRUE)


@triton.jit
def _stack_store(ptr, value, lanes):
    """One stack slot written between CTA barriers (module docstring): every thread has read the old
    value before it changes, and the new value is visible to every thread before anyone reads it."""
    tl.debug_barrier()
    tl.store(ptr, value, mask=lanes)
    tl.debug_barrier()


@triton.jit
def program_words(bits_ptr, W, ops_ptr, rows_ptr, b, L, T, widx, valid, scratch, slot_stride, lanes, BLOCK: tl.constexpr):
    """Query b's filter program over words widx int64 [BLOCK] of the row bank -> int64 [BLOCK].

    PUSH l: AND over t of bits[r] (r = rows[b, l, t] >= 0) or ~bits[~r]; AND / OR / NOT / FALSE /
    TRUE on the stack. Lanes with `valid` False read 0 words. The stack lives in global scratch
    memory: slot s of lane i at scratch[i + s * slot_stride] (`scratch` a pointer block [BLOCK],
    at least L slots); only lanes in `lanes` write it, and each lane reads back its own writes.
    Shared by `_bloom_filter_kernel` and kernels/filtered_topk_triton.py.
    """
    sp = 0
    for l in range(0, L):
        op = tl.load(ops_ptr + b * L + l)
        if op == OP_PUSH:
            acc = tl.full((BLOCK,), -1, tl.int64)
            for t in range(0, T):
                r = tl.load(rows_ptr + (b * L + l) * T + t)
                row = tl.where(r < 0, ~r, r)
                w = tl.load(bits_ptr + row * W + widx, mask=valid, other=0)
                acc = acc & tl.where(r < 0, ~w, w)
            _stack_store(scratch + sp * slot_stride, acc, lanes)
            sp += 1
        elif op == OP_AND or op == OP_OR:
            x = tl.load(scratch + (sp - 2) * slot_stride, mask=lanes, other=0)
            y = tl.load(scratch + (sp - 1) * slot_stride, mask=lanes, other=0)
            z = tl.where(op == OP_AND, x & y, x | y)
            _stack_store(scratch + (sp - 2) * slot_stride, z, lanes)
            sp -= 1
        elif op == OP_NOT:
            x = tl.load(scratch + (sp - 1) * slot_stride, mask=lanes, other=0)
            _stack_store(scratch + (sp - 1) * slot_stride, ~x, lanes)
        elif op == OP_FALSE or op == OP_TRUE:
            c = tl.where(op == OP_TRUE, -1, 0).to(tl.int64)
            _stack_store(scratch + sp * slot_stride, tl.zeros((BLOCK,), tl.int64) + c, lanes)
            sp += 1
    return tl.load(scratch, mask=lanes, other=0)


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
    """out[b, p, w] = program_b over words start[b, p] + w (see `program_words`)."""
    bp = tl.program_id(0)
    b = bp // P
    offs = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    start = tl.load(start_ptr + bp)
    widx = start + offs
    valid = ((widx - offs) >= 0) & (offs < NW) & (widx < W)  # widx - offs == start, as a block
    in_block = offs < NW
    scratch = scratch_ptr + bp.to(tl.int64) * L * NW + offs
    res = program_words(bits_ptr, W, ops_ptr, rows_ptr, b, L, T, widx, valid, scratch, NW, in_block, BLOCK_W)
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


@triton.jit
def _range_count_kernel(
    words_ptr,  # int64 [B * P, NW] bloom_filter output, masked in place
    lo_ptr,  # int64 [B * P]
    hi_ptr,  # int64 [B * P]
    counts_ptr,  # int64 [B * P]
    NW,
    BLOCK_W: tl.constexpr,
):
    """Clear bits outside rows [lo, hi) of window bp (words start at lo >> 6) and count the rest."""
    bp = tl.program_id(0)
    lo = tl.load(lo_ptr + bp)
    hi = tl.load(hi_ptr + bp)
    base = tl.where(lo >= 0, lo >> 6, 0) * 64
    total = tl.zeros((BLOCK_W,), tl.int64)
    for w0 in range(0, NW, BLOCK_W):
        offs = w0 + tl.arange(0, BLOCK_W)
        inb = offs < NW
        x = tl.load(words_ptr + bp.to(tl.int64) * NW + offs, mask=inb, other=0)
        first = base + offs.to(tl.int64) * 64
        a = tl.minimum(tl.maximum(lo - first, 0), 64)
        b = tl.minimum(tl.maximum(hi - first, 0), 64)
        one = tl.full((BLOCK_W,), 1, tl.int64)
        upto_b = tl.where(b >= 64, -1, (one << tl.minimum(b, 63)) - 1)
        upto_a = tl.where(a >= 64, -1, (one << tl.minimum(a, 63)) - 1)
        x = tl.where(lo >= 0, x & upto_b & ~upto_a, 0)
        tl.store(words_ptr + bp.to(tl.int64) * NW + offs, x, mask=inb)
        # SWAR popcount on the unsigned bit pattern (logical shifts)
        u = x.to(tl.uint64, bitcast=True)
        u = u - ((u >> 1) & 0x5555555555555555)
        u = (u & 0x3333333333333333) + ((u >> 2) & 0x3333333333333333)
        u = (u + (u >> 4)) & 0x0F0F0F0F0F0F0F0F
        u = (u * 0x0101010101010101) >> 56
        total += u.to(tl.int64)
    tl.store(counts_ptr + bp, tl.sum(total, axis=0))


def bloom_filter_counts_triton(
    bits: torch.Tensor, ops: torch.Tensor, rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_words: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: (mask int64 [B, P, n_words], counts int64 [B, P]) (contract in kernels/bloom_filter.py)."""
    lo, hi = lo.contiguous(), hi.contiguous()
    starts = torch.where(lo >= 0, lo >> 6, torch.full_like(lo, -1))
    words = bloom_filter_triton(bits, ops, rows, starts, n_words)
    counts = torch.zeros(lo.shape, dtype=torch.int64, device=bits.device)
    if words.numel() == 0:
        return words, counts
    BLOCK_W = max(16, min(256, triton.next_power_of_2(n_words)))
    _range_count_kernel[(lo.numel(),)](words, lo, hi, counts, n_words, BLOCK_W=BLOCK_W)
    return words, counts
