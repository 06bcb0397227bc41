"""Triton kernels for `silverrec::verify_topk` on CUDA (contract in kernels/filtered_topk.py).

The ranked list of each query is cut into tiles of BLOCK entries, and two launches with one
program per (query, tile) do the work, so a batch of 16 queries at k = 4096 (5136 entries each)
runs 16 x 41 programs instead of 16 programs walking 41 tiles one after the other:

    _verify_pass_kernel   each entry's word of the row bank (row >> 6) goes through the query's
                          exact verify program (`program_words`, the evaluator of
                          kernels/bloom_filter_triton.py; stack in scratch memory), the row's bit
                          decides: pass flags int8 [B, K2] and passing entries per tile int32 [B, NT]
    _verify_place_kernel  the tile's first output slot = passing entries of the earlier tiles (a
                          masked sum over the query's tile counts); tl.cumsum inside the tile gives
                          each passing entry its slot; slots >= k are dropped

Nothing is sorted: the input order is kept. Every entry is evaluated (the CPU path stops at k; the
list holds k + k / 4 + 16 entries, so at most a quarter more work, done in parallel). Entries with
row -1 (padding) or a row past the bank never pass (as on the torch path, whose bank windows read
zeros there); the outputs are pre-filled with -inf / -1. Device memory: outputs [B, k], flags
[B, K2], counts [B, NT], program stacks int64 [B, NT, L, BLOCK] (B x K2 x L words); no host
synchronisation. Runs on CPU tensors under TRITON_INTERPRET=1 (tests/test_verify_topk_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from silverrec.kernels import constants
from silverrec.kernels.bloom_filter_triton import program_words

NO_ROW = tl.constexpr(constants.NO_ROW)  # padding row (kernels/constants.py)
BLOCK = 128  # entries per tile (k + k / 4 + 16 entries come in from the filtered search)


@triton.jit
def _verify_pass_kernel(
    bits_ptr,  # int64 [R, W] row bank
    ops_ptr,  # int64 [B, L] verify programs
    prog_ptr,  # int64 [B, L, T]
    rows_ptr,  # int64 [B, K2] ranked rows (-1 = padding)
    flags_ptr,  # out int8 [B, K2] 1 = the entry passes
    counts_ptr,  # out int32 [B, NT] passing entries per tile
    scratch_ptr,  # int64 [B, NT, L, BLOCK] program stacks
    W,
    L,
    T,
    K2,
    NT,
    BLOCK: tl.constexpr,
):
    """flags[b, i] = bit (rows[b, i] & 63) of program b on bank word rows[b, i] >> 6, for tile t's entries i."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    idx = t * BLOCK + lane
    inb = idx < K2
    rows = tl.load(rows_ptr + b * K2 + idx, mask=inb, other=NO_ROW)
    widx = rows >> 6
    valid = (rows >= 0) & (widx < W)
    scratch = scratch_ptr + (b * NT + t) * L * BLOCK + lane
    words = program_words(bits_ptr, W, ops_ptr, prog_ptr, b, L, T, widx, valid, scratch, BLOCK, lane >= 0, BLOCK)
    ok = valid & (((words >> (rows & 63)) & 1) != 0)
    tl.store(flags_ptr + b * K2 + idx, ok.to(tl.int8), mask=inb)
    tl.store(counts_ptr + b * NT + t, tl.sum(ok.to(tl.int32), axis=0))


@triton.jit
def _verify_place_kernel(
    scores_ptr,  # float32 [B, K2] ranked scores
    rows_ptr,  # int64 [B, K2]
    flags_ptr,  # int8 [B, K2]
    counts_ptr,  # int32 [B, NT]
    out_s_ptr,  # float32 [B, k], pre-filled with -inf
    out_r_ptr,  # int64 [B, k], pre-filled with -1
    K2,
    NT,
    k,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """out[b, before + j] = the j-th passing entry of tile t (before = passing entries of tiles < t), if < k."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    before = tl.zeros((), tl.int32)
    for t0 in range(0, NT, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        before += tl.sum(tl.load(counts_ptr + b * NT + tt, mask=tt < t, other=0), axis=0)
    if before < k:
        idx = t * BLOCK + tl.arange(0, BLOCK)
        inb = idx < K2
        ok = tl.load(flags_ptr + b * K2 + idx, mask=inb, other=0) != 0
        slot = before + tl.cumsum(ok.to(tl.int32), axis=0) - 1
        put = ok & (slot < k)
        tl.store(out_s_ptr + b * k + slot, tl.load(scores_ptr + b * K2 + idx, mask=put, other=0.0), mask=put)
        tl.store(out_r_ptr + b * k + slot, tl.load(rows_ptr + b * K2 + idx, mask=put, other=NO_ROW), mask=put)


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
    rows = torch.full((B, k), constants.NO_ROW, dtype=torch.int64, device=rows_in.device)
    if B == 0 or K2 == 0 or L == 0:
        return scores, rows
    nt = triton.cdiv(K2, block)
    flags = torch.empty((B, K2), dtype=torch.int8, device=rows_in.device)
    counts = torch.empty((B, nt), dtype=torch.int32, device=rows_in.device)
    scratch = torch.empty((B, nt, L, block), dtype=torch.int64, device=rows_in.device)
    _verify_pass_kernel[(B, nt)](bits, ops, prog_rows, rows_in, flags, counts, scratch, bits.shape[1], L, prog_rows.shape[2],
                                 K2, nt, BLOCK=block)
    _verify_place_kernel[(B, nt)](scores_in, rows_in, flags, counts, scores, rows, K2, nt, k, BLOCK=block,
                                  BLOCK_T=max(16, min(1024, triton.next_power_of_2(nt))))
    return scores, rows
