"""Triton kernel for `silverrec::merge_attention_states` on CUDA (runs under TRITON_INTERPRET=1).

One program merges BLOCK_R (row, head) states over the whole head dimension.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_states_kernel(
    va_ptr, sa_ptr, vb_ptr, sb_ptr,  # v [R, D] (R = N * H rows, contiguous), s [R]
    v_ptr, s_ptr,  # outputs
    R, D,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """s = logaddexp(s_a, s_b); v = v_a exp(s_a - s) + v_b exp(s_b - s); empty+empty -> 0, -inf."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    sa = tl.load(sa_ptr + rows, mask=rmask, other=float("-inf")).to(tl.float32)
    sb = tl.load(sb_ptr + rows, mask=rmask, other=float("-inf")).to(tl.float32)
    m = tl.maximum(sa, sb)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(sa - m)
    wb = tl.exp(sb - m)
    total = wa + wb
    denom = tl.where(total > 0, total, 1.0)
    offs = rows[:, None] * D + cols[None, :]
    mask = rmask[:, None] & (cols[None, :] < D)
    va = tl.load(va_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    vb = tl.load(vb_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = va * (wa / denom)[:, None] + vb * (wb / denom)[:, None]
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, (m + tl.log(total)).to(s_ptr.dtype.element_ty), mask=rmask)


def merge_states_triton(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: v [N, H, D], s [N, H] -> merged (v, s), same dtypes."""
    N, H, D = v_a.shape
    v_a, v_b = v_a.contiguous(), v_b.contiguous()
    s_a, s_b = s_a.contiguous(), s_b.contiguous()
    v = torch.empty_like(v_a)
    s = torch.empty_like(s_a)
    R = N * H
    BLOCK_R = 16
    BLOCK_D = triton.next_power_of_2(D)
    grid = (triton.cdiv(R, BLOCK_R),)
    _merge_states_kernel[grid](v_a, s_a, v_b, s_b, v, s, R, D, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
    return v, s
