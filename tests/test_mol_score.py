"""`silverrec::mol_score` (kernels/mol_score.py, kernels/csrc/mol.cpp): the MoL OverArch's pair scores
of cached candidate rows, against the module itself on the gathered rows (`MoLOverArch.score`, whose
math `mol_pair_scores` is the op's torch form) and a per-pair float64 Python evaluation of the formula
in MoLOverArch's docstring."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import silverrec.kernels  # noqa: F401  (registers the ops)
from silverrec.kernels.constants import MOL_DIMS, MOL_WEIGHTS
from silverrec.kernels.mol_score import mol_score_torch
from silverrec.ranking.overarch import MoLOverArch
from tests.helpers import runs_cpp_kernel


def _setup(seed, B, K, T, D, F_, n, p_q=3, p_x=2, c=8, hidden=12, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    arch = MoLOverArch(D, F_, T, p_q=p_q, p_x=p_x, comp_dim=c, gate_hidden=hidden, dot_scale=2.0)
    with torch.no_grad():
        for p in arch.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    arch.eval()
    emb = torch.randn(n, D, generator=g)
    feats = torch.rand(n, F_, generator=g)
    with torch.no_grad():
        ranker = arch.item_side(emb.to(dtype).float(), feats)
    user = F.normalize(torch.randn(B, T, D, generator=g), dim=-1)
    rows = torch.randint(0, n, (B, K), generator=g)
    rows[0, -2:] = -1  # padding
    return arch, user, rows, emb.to(dtype), ranker.to(dtype)


def _args(arch, user, rows, emb, ranker):
    """The op's arguments: the module's weights by their names in kernels/constants.py MOL_WEIGHTS (its gate_in
    layer's weight as gate_in_weight) and its sizes by MOL_DIMS."""
    params = {**dict(arch.named_parameters()), **dict(arch.named_buffers())}
    weights = [params[name if name != "gate_in_weight" else "gate_in.weight"].detach() for name in MOL_WEIGHTS]
    return user, rows, emb, ranker, weights, [getattr(arch, name) for name in MOL_DIMS]


def test_the_modules_op_weights_follow_the_layout():
    """MoLOverArch.op_weights (what score_rows hands the op) lists its tensors in MOL_WEIGHTS order."""
    arch = _setup(1, 1, 2, 1, 8, 1, 4)[0]
    assert all(a is b.detach() or a.data_ptr() == b.data_ptr()
               for a, b in zip(arch.op_weights(), _args(arch, None, None, None, None)[4]))


def _pair_reference(arch, u, v, item) -> list[float]:
    """One pair, every task, in float64 Python: the formula of MoLOverArch's docstring."""
    W = arch.gate_in.weight.double()
    d, f, c, pq, px = arch.dim, arch.feat_dim, arch.comp_dim, arch.p_q, arch.p_x
    x = item[: px * c].double().reshape(px, c)
    hv = item[px * c:].double()
    out = []
    for t in range(arch.tasks):
        ut = u[t].double()
        q = (arch.user_weight[t].double() @ ut + arch.user_bias[t].double()).reshape(pq, c)
        q = q / q.norm(dim=1, keepdim=True).clamp_min(1e-12)
        logit = (q[:, None, :] * x[None, :, :]).sum(-1).reshape(-1)  # i-major
        h = W[:, :d] @ ut + hv + W[:, 2 * d + f:] @ logit
        h = h * torch.sigmoid(h)
        gate = torch.softmax(arch.gate_weight[t].double() @ h + arch.gate_bias[t].double(), dim=0)
        scale = min(math.exp(float(arch.log_scale[t])), 100.0)
        out.append(float((gate * logit).sum()) * scale + float(arch.dot_scale[t]) * float(v.double() @ ut))
    return out


@pytest.mark.parametrize("B,K,T,D,F_,n", [(1, 9, 2, 16, 3, 30), (4, 33, 3, 24, 0, 50), (2, 1, 1, 8, 2, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mol_score_equals_the_module_and_a_python_walk(B, K, T, D, F_, n, dtype):
    assert runs_cpp_kernel("mol_score"), "the operator library registers the C++ kernel"
    arch, user, rows, emb, ranker = _setup(B * 7 + K, B, K, T, D, F_, n, dtype=dtype)
    with torch.no_grad():
        got = torch.ops.silverrec.mol_score(*_args(arch, user, rows, emb, ranker))
        ref = mol_score_torch(*_args(arch, user, rows, emb, ranker))
        flat = rows.clamp(min=0)
        module = arch.score(user, emb[flat].float(), ranker[flat].float(), rows >= 0)
    assert got.shape == (B, K, T) and got.dtype == torch.float32
    valid = (rows >= 0).unsqueeze(-1).expand_as(got)
    assert bool((got[~valid] == 0).all()) and bool((ref[~valid] == 0).all())
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[valid], module[valid], rtol=1e-4, atol=1e-4)
    for b, k in [(0, 0), (B - 1, K - 1 - (2 if B == 1 else 0))]:
        if rows[b, k] >= 0:
            want = _pair_reference(arch, user[b], emb[rows[b, k]].float(), ranker[rows[b, k]].float())
            torch.testing.assert_close(got[b, k].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mol_score_at_the_demo_shape(dtype):
    """MovieLens' MoL (D 64, 4 x 4 components of 32, 64 hidden units): every gather of the kernel
    is whole 16 x 16 blocks (transposed in registers with AVX-512), 40 candidates (a ragged last
    block of 8), padding among them."""
    arch, user, rows, emb, ranker = _setup(11, 2, 40, 2, 64, 5, 300, p_q=4, p_x=4, c=32, hidden=64, dtype=dtype)
    rows[1, 5] = rows[0, 39] = -1
    with torch.no_grad():
        got = torch.ops.silverrec.mol_score(*_args(arch, user, rows, emb, ranker))
        ref = mol_score_torch(*_args(arch, user, rows, emb, ranker))
    valid = (rows >= 0).unsqueeze(-1).expand_as(got)
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-4, atol=1e-4)
    assert bool((got[~valid] == 0).all())


def test_score_rows_of_a_bfloat16_module_gathers_and_scores():
    """A bfloat16 OverArch takes the torch form (the op is float32): the same scores as `score`."""
    arch, user, rows, emb, ranker = _setup(3, 2, 6, 2, 16, 2, 20)
    arch16 = arch.to(torch.bfloat16)
    with torch.no_grad():
        got = arch16.score_rows(user, rows, emb, ranker)
        flat = rows.clamp(min=0)
        want = arch16.score(user, emb[flat], ranker[flat], rows >= 0)
    valid = rows >= 0
    torch.testing.assert_close(got[valid], want[valid])
    assert bool((got[~valid] == 0).all())


def test_mol_score_bad_input_is_named():
    arch, user, rows, emb, ranker = _setup(5, 2, 4, 2, 16, 2, 20)
    args = list(_args(arch, user, rows, emb, ranker))
    bad = rows.clone()
    bad[1, 0] = 20  # the cache holds rows 0 .. 19
    args[1] = bad
    with pytest.raises(IndexError, match="out of range"):
        torch.ops.silverrec.mol_score(*args)
    args = list(_args(arch, user, rows, emb, ranker))
    args[3] = ranker[:, :5]
    with pytest.raises(RuntimeError, match="shapes disagree"):
        torch.ops.silverrec.mol_score(*args)
