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

CPU: the C++ evaluator (`kernels/csrc/bloom.cpp`, `silverrec.kernels._cpu.bloom_filter`: blocks of
256 words per instruction, no numpy temporaries) when the extension is built; otherwise numpy,
vectorised over queries, windows and words, with one step per instruction (the
per-query stack slot of every instruction is precomputed from the opcodes). CUDA: the Triton
kernel in `bloom_filter_triton.py` (one program per window block, stack in scratch memory).
`bloom_filter_reference` is an independent per-query stack machine used by the tests.

    mask, counts = torch.ops.silverrec.bloom_filter_counts(bits, ops, rows, lo, hi, n_words)
    # lo, hi int64 [B, P]  item row range [lo, hi) of each window (lo < 0 = empty window); the window
    #                      starts at word lo >> 6
    # -> mask int64 [B, P, n_words]  bloom_filter's mask with bits outside [lo, hi) cleared
    #    counts int64 [B, P]         set bits per window (matching items in the range)

The IVF planner's fused step (per-cluster match counts next to the bitmask). CPU (C++): evaluates
only the words each range touches, so a small cluster costs its own size, not the largest
cluster's `n_words`; identical (program, ranges) queries run once. Without the extension, and on
CUDA (after the Triton bloom_filter, a Triton range-mask + popcount kernel), it is the composition
`bloom_filter_counts_torch`.
"""

from __future__ import annotations

import numpy as np
import torch

from silverrec.kernels.constants import OP_AND, OP_FALSE, OP_NOP, OP_NOT, OP_OR, OP_PUSH, OP_STACK_EFFECT, OP_TRUE
from silverrec.kernels.cpu_ext import cpu_ext

_DELTA = np.array(OP_STACK_EFFECT, dtype=np.int64)  # stack depth change per opcode


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


def stack_slots(ops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stack slots of every instruction: (dst, src_a, src_b) int64 [B, L] each.

    Raises ValueError for a malformed program (stack underflow, or not exactly one result).
    """
    if ops.size and (ops.min() < 0 or ops.max() > OP_TRUE):
        raise ValueError(f"unknown opcode in filter program (valid: 0..{OP_TRUE})")
    delta = _DELTA[ops]
    before = np.cumsum(delta, axis=1) - delta
    binary = (ops == OP_AND) | (ops == OP_OR)
    need = np.where(binary, 2, np.where(ops == OP_NOT, 1, 0))
    if (before < need).any():
        raise ValueError("malformed filter program: stack underflow")
    final = before[:, -1] + delta[:, -1] if ops.shape[1] else np.zeros(ops.shape[0], np.int64)
    if (final != 1).any():
        raise ValueError("malformed filter program: it must leave exactly one result on the stack")
    dst = np.where(binary, before - 2, np.where(ops == OP_NOT, before - 1, before))
    src_a = np.where(binary, before - 2, before - 1)
    src_b = before - 1
    scratch = ops.shape[1]  # NOPs write to a slot nobody reads
    dst = np.where(ops == OP_NOP, scratch, dst)
    return dst, np.maximum(src_a, 0), np.maximum(src_b, 0)


def _windows(word_start: np.ndarray, n_words: int, total_words: int) -> tuple[np.ndarray, np.ndarray]:
    widx = word_start[..., None] + np.arange(n_words, dtype=np.int64)  # [B, P, n]
    valid = (word_start[..., None] >= 0) & (widx < total_words)
    return np.clip(widx, 0, max(total_words - 1, 0)), valid


def bloom_filter_numpy(bits: np.ndarray, ops: np.ndarray, rows: np.ndarray, word_start: np.ndarray, n_words: int) -> np.ndarray:
    """The fast CPU path (numpy int64 arrays in, int64 [B, P, n_words] out)."""
    B, L = ops.shape
    P = word_start.shape[1]
    R, W = bits.shape
    out = np.zeros((B, P, n_words), dtype=np.int64)
    if B == 0 or P == 0 or W == 0 or L == 0:
        return out
    live = np.flatnonzero((word_start >= 0).any(axis=1))
    if live.size < B:  # queries without any window cost nothing
        if live.size:
            out[live] = bloom_filter_numpy(bits, ops[live], rows[live], word_start[live], n_words)
        return out
    dst, src_a, src_b = stack_slots(ops)
    widx, valid = _windows(word_start, n_words, W)
    flat = bits.reshape(-1)

    # All PUSH values at once: [Np, P, n] = AND over T of (+/-) bits[row, window words].
    pb, pl = np.nonzero(ops == OP_PUSH)
    push_val = None
    if pb.size:
        r = rows[pb, pl]  # [Np, T]
        if ((r >= R) | (~r >= R)).any():
            raise ValueError(f"filter program addresses a row outside the bank of {R} rows")
        ridx = np.where(r < 0, ~r, r)
        inv = np.where(r < 0, np.int64(-1), np.int64(0))
        base = widx[pb]  # [Np, P, n]
        push_val = np.take(flat, ridx[:, 0, None, None] * W + base) ^ inv[:, 0, None, None]
        for t in range(1, r.shape[1]):
            push_val &= np.take(flat, ridx[:, t, None, None] * W + base) ^ inv[:, t, None, None]
    push_index = np.full((B, L), -1, dtype=np.int64)
    push_index[pb, pl] = np.arange(pb.size)

    stack = np.zeros((L + 1, B, P, n_words), dtype=np.int64)
    for l in range(L):
        o = ops[:, l]
        for code in np.unique(o):
            bs = np.nonzero(o == code)[0]
            d = dst[bs, l]
            if code == OP_PUSH:
                stack[d, bs] = push_val[push_index[bs, l]]
            elif code == OP_AND:
                stack[d, bs] = stack[src_a[bs, l], bs] & stack[src_b[bs, l], bs]
            elif code == OP_OR:
                stack[d, bs] = stack[src_a[bs, l], bs] | stack[src_b[bs, l], bs]
            elif code == OP_NOT:
                stack[d, bs] = ~stack[src_a[bs, l], bs]
            elif code == OP_FALSE:
                stack[d, bs] = 0
            elif code == OP_TRUE:
                stack[d, bs] = -1
    np.copyto(out, stack[0], where=valid)
    return out


@torch.library.custom_op("silverrec::bloom_filter", mutates_args=())
def bloom_filter(
    bits: torch.Tensor, ops: torch.Tensor, rows: torch.Tensor, word_start: torch.Tensor, n_words: int
) -> torch.Tensor:
    """CPU (fast path). See the module docstring for the contract."""
    _check(bits, ops, rows, word_start, n_words)
    ext = cpu_ext()
    if ext is not None:  # same validation messages (ValueError) and output as the numpy path
        return ext.bloom_filter(bits.contiguous(), ops.contiguous(), rows.contiguous(), word_start.contiguous(), n_words)
    out = bloom_filter_numpy(
        bits.contiguous().numpy(), ops.numpy(), rows.numpy(), word_start.contiguous().numpy(), n_words
    )
    return torch.from_numpy(out)


@bloom_filter.register_fake
def _(bits, ops, rows, word_start, n_words):
    return bits.new_empty(word_start.shape[0], word_start.shape[1], n_words)


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


@torch.library.custom_op("silverrec::bloom_filter_counts", mutates_args=())
def bloom_filter_counts(
    bits: torch.Tensor, ops: torch.Tensor, rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_words: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU (fast path). See the module docstring for the contract."""
    _check(bits, ops, rows, lo, n_words)
    _check_ranges(lo, hi)
    ext = cpu_ext()
    if ext is not None and hasattr(ext, "bloom_filter_counts"):
        return ext.bloom_filter_counts(bits.contiguous(), ops.contiguous(), rows.contiguous(), lo.contiguous(), hi.contiguous(), n_words)
    return bloom_filter_counts_torch(bits, ops, rows, lo, hi, n_words)


@bloom_filter_counts.register_fake
def _(bits, ops, rows, lo, hi, n_words):
    return bits.new_empty(lo.shape[0], lo.shape[1], n_words), bits.new_empty(lo.shape[0], lo.shape[1])


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
