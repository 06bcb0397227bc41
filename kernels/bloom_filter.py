"""`silverrec::bloom_filter`: run per-query filter programs over word windows of a bit-sliced row bank.

    mask = torch.ops.silverrec.bloom_filter(bits, ops, rows, word_start, n_words)
    # bits       int64 [R, W]     row bank: Bloom rows [0, M) then exact value-code planes;
    #                             word w of a row covers item rows 64w..64w+63, bit (row & 63)
    # ops        int64 [B, L]     postfix opcodes per query (NOP padding), OP_* of kernels/constants.py
    # rows       int64 [B, L, T]  PUSH operands: AND of bits[r] (r >= 0) or ~bits[~r] (r < 0)
    # word_start int64 [B, P]     first word of each window; -1 = empty window (all zeros)
    # n_words    int              window width in words
    # -> int64 [B, P, n_words]    mask[b, p, w] = program_b evaluated on words word_start[b, p] + w
    #                             (words past W and empty windows are 0)

The IVF co-design passes one window per probed cluster (`word_start = cluster_offsets[c] >> 6`,
`n_words = Wc`), which yields exactly the `[B, P, Wc]` bitmask `silverrec::ivf_scan` takes; the
unprobed mode passes one window `word_start = 0, n_words = W` per query.
Scratch memory is O(B * P * n_words * stack depth): proportional to the probed items, not N.

CPU: the C++ evaluator (`kernels/csrc/bloom.cpp`: blocks of 256 words per instruction). CUDA: the Triton
kernel in `bloom_filter_triton.py` (one program per window block, stack in scratch memory).
`bloom_filter_reference` is an independent per-query stack machine used by the tests.

    mask, counts = torch.ops.silverrec.bloom_filter_counts(bits, ops, rows, lo, hi, n_words)
    # lo, hi int64 [B, P]  item row range [lo, hi) of each window (lo < 0 = empty window); the window
    #                      starts at word lo >> 6
    # -> mask int64 [B, P, n_words]  bloom_filter's mask with bits outside [lo, hi) cleared
    #    counts int64 [B, P]         set bits per window (matching items in the range)

The IVF planner's fused step (per-cluster match counts next to the bitmask). CPU (C++): evaluates
only the words each range touches, so a small cluster costs its own size, not the largest
cluster's `n_words`; identical (program, ranges) queries run once. CUDA: the Triton bloom_filter, then a
Triton range-mask + popcount kernel. `bloom_filter_counts_torch`, the composition of bloom_filter with the
range masks, is the tests' reference.
"""

from __future__ import annotations

import torch

from silverrec.kernels.constants import OP_AND, OP_FALSE, OP_NOT, OP_OR, OP_PUSH, OP_TRUE

def check_program(bits, ops, rows) -> None:
    """ValueError unless bits int64 [R, W], ops int64 [B, L] and rows int64 [B, L, T]."""
    if bits.dtype != torch.int64 or bits.dim() != 2:
        raise ValueError(f"bits must be int64 [R, W], got {bits.dtype} {tuple(bits.shape)}")
    if ops.dtype != torch.int64 or ops.dim() != 2:
        raise ValueError(f"ops must be int64 [B, L], got {ops.dtype} {tuple(ops.shape)}")
    if rows.dtype != torch.int64 or rows.dim() != 3 or rows.shape[:2] != ops.shape:
        raise ValueError(f"rows must be int64 [B, L, T] with [B, L] = {tuple(ops.shape)}, got {tuple(rows.shape)}")


def _check(bits, ops, rows, word_start, n_words) -> None:
    check_program(bits, ops, rows)
    if word_start.dtype != torch.int64 or word_start.dim() != 2 or word_start.shape[0] != ops.shape[0]:
        raise ValueError(f"word_start must be int64 [B, P], got {word_start.dtype} {tuple(word_start.shape)}")
    if n_words < 1:
        raise ValueError(f"n_words must be >= 1, got {n_words}")


@torch.library.register_kernel("silverrec::bloom_filter", "cuda")
def _(bits, ops, rows, word_start, n_words):
    from silverrec.kernels.bloom_filter_triton import bloom_filter_triton

    _check(bits, ops, rows, word_start, n_words)
    return bloom_filter_triton(bits, ops, rows, word_start, n_words)


def _check_ranges(lo: torch.Tensor, hi: torch.Tensor) -> None:
    if lo.dtype != torch.int64 or hi.dtype != torch.int64 or lo.dim() != 2 or hi.shape != lo.shape:
        raise ValueError(f"lo / hi must be int64 [B, P] of equal shape, got {lo.dtype} {tuple(lo.shape)}, {hi.dtype} {tuple(hi.shape)}")


def range_starts(lo: torch.Tensor) -> torch.Tensor:
    """Word start of each range window: lo >> 6, -1 for empty windows (lo < 0)."""
    return torch.where(lo >= 0, lo >> 6, torch.full_like(lo, -1))


def bloom_filter_counts_torch(bits, ops, rows, lo, hi, n_words: int, bloom=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Composite: bloom_filter (or `bloom`, same signature) on lo >> 6, & the range masks, popcount."""
    starts = range_starts(lo)
    words = (bloom or torch.ops.silverrec.bloom_filter)(bits, ops, rows, starts, n_words)
    masked = words & range_word_masks(lo, hi, starts, n_words)
    return masked, popcount64(masked).sum(dim=2)


@torch.library.register_kernel("silverrec::bloom_filter_counts", "cuda")
def _(bits, ops, rows, lo, hi, n_words):
    from silverrec.kernels.bloom_filter_triton import bloom_filter_counts_triton

    _check(bits, ops, rows, lo, n_words)
    _check_ranges(lo, hi)
    return bloom_filter_counts_triton(bits, ops, rows, lo, hi, n_words)


def bloom_filter_reference(
    bits: torch.Tensor, ops: torch.Tensor, rows: torch.Tensor, word_start: torch.Tensor, n_words: int
) -> torch.Tensor:
    """Independent reference: a plain stack machine per query (Python list stack of [P, n] words)."""
    B, L = ops.shape
    P = word_start.shape[1]
    R, W = bits.shape
    padded = torch.cat([bits, torch.zeros(R, n_words, dtype=torch.int64)], dim=1)
    out = torch.zeros(B, P, n_words, dtype=torch.int64)
    for b in range(B):
        starts = word_start[b]
        idx = starts.clamp_min(0)[:, None] + torch.arange(n_words)  # [P, n]
        idx = torch.where(idx < W, idx, torch.full_like(idx, W))  # past-the-end -> zero padding
        stack: list[torch.Tensor] = []
        for l in range(L):
            op = int(ops[b, l])
            if op == OP_PUSH:
                acc = torch.full((P, n_words), -1, dtype=torch.int64)
                for r in rows[b, l].tolist():
                    acc &= ~padded[~r][idx] if r < 0 else padded[r][idx]
                stack.append(acc)
            elif op in (OP_AND, OP_OR):
                y, x = stack.pop(), stack.pop()
                stack.append(x & y if op == OP_AND else x | y)
            elif op == OP_NOT:
                stack.append(~stack.pop())
            elif op == OP_FALSE:
                stack.append(torch.zeros(P, n_words, dtype=torch.int64))
            elif op == OP_TRUE:
                stack.append(torch.full((P, n_words), -1, dtype=torch.int64))
        assert len(stack) == 1, "malformed program"
        valid = (starts[:, None] >= 0) & (starts.clamp_min(0)[:, None] + torch.arange(n_words) < W)
        out[b] = torch.where(valid, stack[0], torch.zeros_like(stack[0]))
    return out


def popcount64(x: torch.Tensor) -> torch.Tensor:
    """Per-element population count of int64 words (SWAR; sign bit included). Export-safe torch ops."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    return ((x * 0x0101010101010101) >> 56) & 0xFF


def range_word_masks(lo: torch.Tensor, hi: torch.Tensor, word_start: torch.Tensor, n_words: int) -> torch.Tensor:
    """int64 [..., n_words] masks selecting item rows [lo, hi) inside windows starting at `word_start`.

    lo, hi, word_start: int64 [...] (same shape). Bit j of word w stands for row 64 * (word_start + w) + j.
    """
    first = (word_start * 64)[..., None] + torch.arange(n_words, device=lo.device) * 64  # [..., n]
    a = (lo[..., None] - first).clamp(0, 64)
    b = (hi[..., None] - first).clamp(0, 64)
    ones = torch.full_like(first, -1)
    upto_b = torch.where(b >= 64, ones, (torch.ones_like(b) << b) - 1)
    upto_a = torch.where(a >= 64, ones, (torch.ones_like(a) << a) - 1)
    return upto_b & ~upto_a
