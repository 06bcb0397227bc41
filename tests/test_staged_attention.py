"""Staged attention (shared history KV once + per-beam unshared KV, merged by log-sum-exp) equals
plain attention over the concatenated KV; merge_attention_states vs a concatenated softmax;
the Triton kernels (interpreter) vs the references."""

import math

import pytest
import torch

import silverrec.kernels  # noqa: F401
from silverrec.kernels.staged_attention import plain_attention


def _inputs(B, W, H, KV, T, S, hd, dtype=torch.float64, n_pad=None):
    q = torch.randn(B, W, H, hd, dtype=dtype)
    sk = torch.randn(B, KV, T, hd, dtype=dtype)
    sv = torch.randn(B, KV, T, hd, dtype=dtype)
    valid = torch.ones(B, T, dtype=torch.bool)
    for b in range(B):  # left padding, at least one real key per request
        pad = int(torch.randint(0, T, ())) if n_pad is None else n_pad[b]
        valid[b, :pad] = False
        sk[b, :, :pad] = 1e3  # garbage under the mask must not leak
    uk = torch.randn(B * W, S, KV, hd, dtype=dtype)
    uv = torch.randn(B * W, S, KV, hd, dtype=dtype)
    return q, sk, sv, valid, uk, uv


@pytest.mark.parametrize(
    "B,W,H,KV,T,S,hd",
    [(1, 1, 1, 1, 1, 1, 2), (2, 5, 6, 2, 13, 3, 8), (3, 7, 4, 4, 9, 4, 6), (1, 19, 8, 1, 33, 2, 16)],
)
def test_staged_equals_plain(B, W, H, KV, T, S, hd):
    q, sk, sv, valid, uk, uv = _inputs(B, W, H, KV, T, S, hd)
    for n in range(S + 1):
        out = torch.ops.silverrec.staged_attention(q, sk, sv, valid, uk, uv, n)
        ref = plain_attention(q, sk, sv, valid, uk, uv, n)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


def test_unshared_slots_beyond_n_are_ignored():
    q, sk, sv, valid, uk, uv = _inputs(2, 3, 4, 2, 5, 3, 4)
    a = torch.ops.silverrec.staged_attention(q, sk, sv, valid, uk, uv, 1)
    uk2, uv2 = uk.clone(), uv.clone()
    uk2[:, 1:] = 50.0
    uv2[:, 1:] = -7.0
    b = torch.ops.silverrec.staged_attention(q, sk, sv, valid, uk2, uv2, 1)
    torch.testing.assert_close(a, b)
    c = torch.ops.silverrec.staged_attention(q, sk, sv, valid, uk2, uv2, 3)
    assert not torch.allclose(a, c)


def test_bad_shapes_raise():
    q, sk, sv, valid, uk, uv = _inputs(2, 3, 4, 2, 5, 3, 4)
    with pytest.raises(ValueError, match="n_unshared"):
        torch.ops.silverrec.staged_attention(q, sk, sv, valid, uk, uv, 4)
    with pytest.raises(ValueError, match="unshared"):
        torch.ops.silverrec.staged_attention(q, sk, sv, valid, uk[:5], uv[:5], 1)
    with pytest.raises(ValueError, match="key_valid"):
        torch.ops.silverrec.staged_attention(q, sk, sv, valid.int(), uk, uv, 1)


def _partial(scores, v):
    """(softmax(scores) @ v, logsumexp(scores)) of one stage, -inf scores masked."""
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.softmax(scores, dim=-1), torch.zeros_like(scores))
    return torch.einsum("nhk,nhkd->nhd", p.nan_to_num(0.0), v), lse


def _merge_case(N=11, H=3, D=5, Ka=4, Kb=6, dtype=torch.float64):
    sa = torch.randn(N, H, Ka, dtype=dtype) * 3
    sb = torch.randn(N, H, Kb, dtype=dtype) * 3
    va = torch.randn(N, H, Ka, D, dtype=dtype)
    vb = torch.randn(N, H, Kb, D, dtype=dtype)
    sa[0] = float("-inf")  # stage a empty for row 0
    sb[1] = float("-inf")  # stage b empty for row 1
    sa[2, 0] = sb[2, 0] = float("-inf")  # both empty for (2, 0)
    return sa, sb, va, vb


def test_merge_attention_states_vs_concatenated_softmax():
    sa, sb, va, vb = _merge_case()
    oa, la = _partial(sa, va)
    ob, lb = _partial(sb, vb)
    v, s = torch.ops.silverrec.merge_attention_states(oa, la, ob, lb)
    ref_o, ref_s = _partial(torch.cat([sa, sb], dim=2), torch.cat([va, vb], dim=2))
    torch.testing.assert_close(s, ref_s, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(v, ref_o, atol=1e-12, rtol=1e-12)
    assert s[2, 0] == float("-inf") and torch.all(v[2, 0] == 0)


@pytest.mark.filterwarnings("ignore:divide by zero")  # log(0) = -inf for two empty stages
def test_merge_triton_interpreter():
    from silverrec.kernels.merge_attention_states_triton import merge_states_triton

    sa, sb, va, vb = _merge_case(N=9, H=2, D=6, dtype=torch.float32)
    oa, la = _partial(sa, va)
    ob, lb = _partial(sb, vb)
    v, s = merge_states_triton(oa, la, ob, lb)
    rv, rs = torch.ops.silverrec.merge_attention_states(oa, la, ob, lb)
    torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, rs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B,W,H,KV,T,S,hd,n", [(2, 3, 4, 2, 37, 3, 8, 2), (1, 9, 2, 1, 5, 2, 12, 0), (2, 2, 3, 3, 16, 1, 16, 1)])
def test_staged_triton_interpreter(B, W, H, KV, T, S, hd, n):
    from silverrec.kernels.staged_attention_triton import staged_attention_triton

    q, sk, sv, valid, uk, uv = _inputs(B, W, H, KV, T, S, hd, dtype=torch.float32)
    out = staged_attention_triton(q, sk, sv, valid, uk, uv, n)
    ref = plain_attention(q.double(), sk.double(), sv.double(), valid, uk.double(), uv.double(), n)
    torch.testing.assert_close(out, ref.float(), atol=1e-4, rtol=1e-4)
    assert math.isfinite(float(out.abs().max()))
