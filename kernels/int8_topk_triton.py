"""Triton kernel for `silverrec::int8_topk` on CUDA.

`_int8_score_keys_kernel` scores one chunk of items against all queries with int8 `tl.dot`
(int32 accumulation) and writes int64 sort keys (score << 32 | ~row), tile by tile; the launcher
merges chunk top-ks with `torch.topk` on the device. No host synchronisation: chunk count and k are
static. Runs on CPU tensors under TRITON_INTERPRET=1 (tests).
"""

import torch
import triton
import triton.language as tl

from silverrec.kernels.common import EMPTY_KEY


@triton.jit
def _int8_score_keys_kernel(
    q_ptr,  # int8 [B, D]
    x_ptr,  # int8 [C, D] (one chunk of item codes, row-major)
    out_ptr,  # int64 [B, C] sort keys
    B,
    C,
    D,
    row_base,  # external row index of the chunk's first item
    stride_q,
    stride_x,
    stride_o,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[b, n] = (sum_d q[b, d] * x[n, d]) * 2**32 + (2**32 - 1 - (row_base + n))."""
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.int32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        q = tl.load(
            q_ptr + offs_b[:, None] * stride_q + offs_d[None, :],
            mask=(offs_b[:, None] < B) & (offs_d[None, :] < D),
            other=0,
        )
        # Items are read as [BLOCK_D, BLOCK_N] tiles of the row-major [C, D] chunk: each item's
        # row is contiguous, so consecutive d within a column are coalesced.
        x = tl.load(
            x_ptr + offs_n[None, :] * stride_x + offs_d[:, None],
            mask=(offs_n[None, :] < C) & (offs_d[:, None] < D),
            other=0,
        )
        acc += tl.dot(q, x, out_dtype=tl.int32)
    rows = (row_base + offs_n).to(tl.int64)
    keys = acc.to(tl.int64) * 4294967296 + (4294967295 - rows)[None, :]
    tl.store(
        out_ptr + offs_b[:, None] * stride_o + offs_n[None, :],
        keys,
        mask=(offs_b[:, None] < B) & (offs_n[None, :] < C),
    )


def score_keys_triton(qcodes: torch.Tensor, codes: torch.Tensor, row_base: int = 0) -> torch.Tensor:
    """Sort keys int64 [B, C] for int8 queries [B, D] against an int8 chunk [C, D]."""
    qcodes = qcodes.contiguous()
    codes = codes.contiguous()
    B, D = qcodes.shape
    C = codes.shape[0]
    out = torch.empty((B, C), dtype=torch.int64, device=codes.device)
    BLOCK_B, BLOCK_N = 16, 128
    BLOCK_D = max(32, min(128, triton.next_power_of_2(D)))  # int8 tl.dot needs K >= 32 on NVIDIA (min_dot_size)
    grid = (triton.cdiv(C, BLOCK_N), triton.cdiv(B, BLOCK_B))
    _int8_score_keys_kernel[grid](
        qcodes, codes, out, B, C, D, row_base,
        qcodes.stride(0), codes.stride(0), out.stride(0),
        BLOCK_B=BLOCK_B, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
    )
    return out


def topk_keys_triton(qcodes: torch.Tensor, codes: torch.Tensor, k: int, chunk: int = 1 << 20) -> torch.Tensor:
    """Exact top-k sort keys int64 [B, k] (descending): chunked scoring + device-side merge."""
    n = codes.shape[0]
    step = max(chunk, k)
    best = torch.full((qcodes.shape[0], k), EMPTY_KEY, dtype=torch.int64, device=codes.device)
    for start in range(0, n, step):
        keys = score_keys_triton(qcodes, codes[start : start + step], start)
        best = torch.cat([best, keys], dim=1).topk(k, dim=1, sorted=False).values
    return best.sort(dim=1, descending=True).values
