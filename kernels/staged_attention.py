"""`silverrec::staged_attention`: one decode step's attention for W beams sharing one history.

Each request b has a history KV stored ONCE (the shared stage) and each of its W beams has a few
tokens of its own (the unshared stage). A beam's attention over [history ; own tokens] is

    stage 1 (shared):   all W beams' queries of request b against shared K/V[b] as ONE batched
                        matmul: [KV, W * group, hd] x [KV, hd, T] (no per-beam copy of the history)
    stage 2 (unshared): each beam's queries against its own slots 0..n-1 of the unshared cache
    merge:              `silverrec::merge_attention_states` (log-sum-exp)

    out = torch.ops.silverrec.staged_attention(q, shared_k, shared_v, key_valid,
                                                unshared_k, unshared_v, n_unshared)
    # q            float [B, W, H, hd]      one query token per beam (RoPE applied)
    # shared_k/v   float [B, KV, T, hd]     history KV, once per request (H % KV == 0, GQA:
    #                                       head h reads KV head h // (H // KV))
    # key_valid    bool  [B, T]             False at PAD keys
    # unshared_k/v float [B*W, S, KV, hd]   per-beam KV, beam (b, w) at row b*W + w
    # n_unshared   int   in [0, S]          slots 0..n_unshared-1 are attended
    # -> out float [B, W, H, hd]  (scale 1/sqrt(hd))

CPU: kernels/csrc/attention.cpp, the two stages (each one call of ATen's fused flash-attention CPU
kernel, which returns the log-sum-exp) and the merge. CUDA: one fused
Triton kernel (`staged_attention_triton.py`) doing both stages with an online softmax.
`plain_attention` is the independent reference used by the tests: softmax over the concatenated KV.
"""

import math

import torch


def _check(q, shared_k, shared_v, key_valid, unshared_k, unshared_v, n_unshared):
    if q.dim() != 4:
        raise ValueError(f"q must be [B, W, H, hd], got {tuple(q.shape)}")
    B, W, H, hd = q.shape
    if shared_k.dim() != 4 or shared_k.shape[0] != B or shared_k.shape[3] != hd or shared_v.shape != shared_k.shape:
        raise ValueError(
            f"shared_k/v must be [B={B}, KV, T, hd={hd}], got {tuple(shared_k.shape)} / {tuple(shared_v.shape)}"
        )
    KV, T = shared_k.shape[1], shared_k.shape[2]
    if H % KV:
        raise ValueError(f"query heads {H} not divisible by KV heads {KV}")
    if key_valid.shape != (B, T) or key_valid.dtype != torch.bool:
        raise ValueError(f"key_valid must be bool [B={B}, T={T}], got {key_valid.dtype} {tuple(key_valid.shape)}")
    if (
        unshared_k.dim() != 4
        or unshared_k.shape[0] != B * W
        or unshared_k.shape[2:] != (KV, hd)
        or unshared_v.shape != unshared_k.shape
    ):
        raise ValueError(
            f"unshared_k/v must be [B*W={B * W}, S, KV={KV}, hd={hd}], got {tuple(unshared_k.shape)}"
        )
    if not 0 <= n_unshared <= unshared_k.shape[1]:
        raise ValueError(f"n_unshared must be in [0, {unshared_k.shape[1]}], got {n_unshared}")


@torch.library.register_kernel("silverrec::staged_attention", "cuda")
def _(q, shared_k, shared_v, key_valid, unshared_k, unshared_v, n_unshared):
    from silverrec.kernels.staged_attention_triton import staged_attention_triton

    _check(q, shared_k, shared_v, key_valid, unshared_k, unshared_v, n_unshared)
    return staged_attention_triton(q, shared_k, shared_v, key_valid, unshared_k, unshared_v, n_unshared)


def plain_attention(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    key_valid: torch.Tensor,
    unshared_k: torch.Tensor,
    unshared_v: torch.Tensor,
    n_unshared: int,
) -> torch.Tensor:
    """Independent reference: copy the history KV per beam, concatenate, one softmax. Same I/O."""
    B, W, H, hd = q.shape
    KV, T = shared_k.shape[1], shared_k.shape[2]
    g = H // KV
    k_hist = shared_k.permute(0, 2, 1, 3)[:, None].expand(B, W, T, KV, hd).reshape(B * W, T, KV, hd)
    v_hist = shared_v.permute(0, 2, 1, 3)[:, None].expand(B, W, T, KV, hd).reshape(B * W, T, KV, hd)
    k = torch.cat([k_hist, unshared_k[:, :n_unshared]], dim=1).repeat_interleave(g, dim=2)  # [BW, T+n, H, hd]
    v = torch.cat([v_hist, unshared_v[:, :n_unshared]], dim=1).repeat_interleave(g, dim=2)
    valid = torch.cat(
        [key_valid[:, None].expand(B, W, T).reshape(B * W, T), torch.ones(B * W, n_unshared, dtype=torch.bool, device=q.device)],
        dim=1,
    )
    scores = torch.einsum("nhd,nthd->nht", q.reshape(B * W, H, hd), k) / math.sqrt(hd)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("nht,nthd->nhd", p, v).reshape(B, W, H, hd)
