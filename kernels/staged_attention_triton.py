"""Triton kernel for `silverrec::staged_attention` on CUDA: both stages fused, online softmax.

Grid: (B * KV, cdiv(W * group, BLOCK_M)). One program owns BLOCK_M query rows of one request and
one KV head — rows are (beam, head-in-group) pairs, so the shared stage is a real matrix product
[BLOCK_M, hd] x [hd, BLOCK_N] per history block, read once for all the request's beams (the point
of storing the history KV once). It then walks each row's own unshared slots (a gather: every row
has different keys) and continues the same online softmax, which is the log-sum-exp merge of the
two stages. Runs on CPU tensors under TRITON_INTERPRET=1 (tests).
"""

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _staged_attention_kernel(
    q_ptr,  # [B, W, H, hd]
    sk_ptr, sv_ptr,  # [B, KV, T, hd]
    valid_ptr,  # int8 [B, T]
    uk_ptr, uv_ptr,  # [B*W, S, KV, hd]
    out_ptr,  # [B, W, H, hd] contiguous
    W, T, HD, n_unshared, scale,
    sq_b, sq_w, sq_h,
    ss_b, ss_h, ss_t,
    sval_b,
    su_n, su_s, su_h,
    KV: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[b, w, h] = softmax over [shared keys of b (valid) ; unshared slots < n of beam w] of
    q[b, w, h] . k * scale, applied to v; head h reads KV head h // GROUP."""
    pid = tl.program_id(0)
    b = pid // KV
    kvh = pid % KV
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # (beam, head-in-group) pairs
    rmask = rows < W * GROUP
    beam = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HD
    q = tl.load(
        q_ptr + b * sq_b + beam[:, None] * sq_w + head[:, None] * sq_h + d[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q * scale
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    # stage 1: shared history, one matrix product per block of keys
    base = sk_ptr + b * ss_b + kvh * ss_h
    vbase = sv_ptr + b * ss_b + kvh * ss_h
    for t0 in range(0, T, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < T
        k = tl.load(base + t[None, :] * ss_t + d[:, None], mask=tmask[None, :] & dmask[:, None], other=0.0)
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee")  # [BLOCK_M, BLOCK_N]; fp32, not tf32 (CPU parity)
        ok = tl.load(valid_ptr + b * sval_b + t, mask=tmask, other=0) != 0
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(vbase + t[:, None] * ss_t + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    # stage 2: each row's own unshared slots (gathered per row), same running softmax
    ubase = (b * W + beam) * su_n + kvh * su_h
    for j in range(0, n_unshared):
        kj = tl.load(uk_ptr + ubase[:, None] + j * su_s + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        sj = tl.sum(q * kj.to(tl.float32), axis=1)
        m_new = tl.maximum(m_i, sj)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        pj = tl.exp(sj - m_safe)
        vj = tl.load(uv_ptr + ubase[:, None] + j * su_s + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + pj[:, None] * vj.to(tl.float32)
        l_i = l_i * alpha + pj
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    H = KV * GROUP
    o_off = ((b * W + beam) * H + head)[:, None] * HD + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def staged_attention_triton(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    key_valid: torch.Tensor,
    unshared_k: torch.Tensor,
    unshared_v: torch.Tensor,
    n_unshared: int,
) -> torch.Tensor:
    """Launcher (shapes as in kernels/staged_attention.py); returns out [B, W, H, hd]."""
    B, W, H, hd = q.shape
    KV, T = shared_k.shape[1], shared_k.shape[2]
    group = H // KV
    q = q.contiguous()
    shared_k, shared_v = shared_k.contiguous(), shared_v.contiguous()
    unshared_k, unshared_v = unshared_k.contiguous(), unshared_v.contiguous()
    valid = key_valid.to(torch.int8).contiguous()
    out = torch.empty_like(q)
    BLOCK_M = 16
    BLOCK_N = 32
    BLOCK_D = max(16, triton.next_power_of_2(hd))
    grid = (B * KV, triton.cdiv(W * group, BLOCK_M))
    _staged_attention_kernel[grid](
        q, shared_k, shared_v, valid, unshared_k, unshared_v, out,
        W, T, hd, n_unshared, 1.0 / math.sqrt(hd),
        q.stride(0), q.stride(1), q.stride(2),
        shared_k.stride(0), shared_k.stride(1), shared_k.stride(2),
        valid.stride(0),
        unshared_k.stride(0), unshared_k.stride(1), unshared_k.stride(2),
        KV=KV, GROUP=group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
    )
    return out
