"""Helpers of the GPU suite: compare outputs (integers exactly, floats within a tolerance) and record
op calls. Moving a snapshot program to a device (`program_on`) and running it behind the CPU API
(`OnDevice`) are the runtime's own: silverrec/serving/device.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._python_dispatch
from torch.utils._pytree import tree_map


FLOAT_TOL = {"atol": 1e-4, "rtol": 1e-4}  # float32 results on CUDA vs CPU (scores, attention)


def assert_same(got: Any, want: Any, what: str = "output") -> None:
    """Equal trees of tensors: integer and bool tensors bit-exact, floats within FLOAT_TOL (same
    -inf / NaN positions)."""
    got_leaves = got if isinstance(got, (tuple, list)) else (got,)
    want_leaves = want if isinstance(want, (tuple, list)) else (want,)
    assert len(got_leaves) == len(want_leaves), f"{what}: {len(got_leaves)} outputs, expected {len(want_leaves)}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if not isinstance(w, torch.Tensor):
            assert g == w, f"{what}[{i}]: {g!r} != {w!r}"
            continue
        g = g.cpu()
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}[{i}]: {g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)}"
        if w.is_floating_point():
            torch.testing.assert_close(g, w, **FLOAT_TOL, equal_nan=True, msg=lambda m: f"{what}[{i}]: {m}")
        else:
            assert torch.equal(g, w), f"{what}[{i}]: {int((g != w).sum())} of {w.numel()} entries differ"


def assert_ranking_close(got_ids, got_scores, want_ids, want_scores, tol: float = FLOAT_TOL["atol"]) -> None:
    """Two rankings [B, k] equal up to float noise: scores within `tol`, and the same item at every
    position whose score is more than `tol` away from its neighbours' (tie groups may reorder)."""
    got_ids, got_scores = got_ids.cpu(), got_scores.cpu()
    torch.testing.assert_close(got_scores, want_scores, atol=tol, rtol=tol)
    s = want_scores.double()
    gap = torch.full_like(s, float("inf"))
    gap[:, 1:] = (s[:, 1:] - s[:, :-1]).abs()
    apart = torch.minimum(gap, torch.cat([gap[:, 1:], torch.full_like(gap[:, :1], float("inf"))], dim=1)) > tol
    apart |= torch.isinf(s)  # padding (-inf, id -1) must match exactly
    assert torch.equal(got_ids[apart], want_ids[apart]), f"{int((got_ids != want_ids)[apart].sum())} items differ"


class RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every top-level `torch.ops.silverrec.*` call made while active, with copies of its
    arguments and outputs: the real inputs of a CPU forward, to replay each op on another device."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "silverrec":
            copy = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
            self.calls.append((func, tree_map(copy, args), tree_map(copy, kwargs), tree_map(copy, out)))
        return out
