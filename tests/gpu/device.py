"""Helpers of the GPU suite: move a loaded snapshot program to a device, run a snapshot's forward
there behind the CPU API, and compare outputs (integers exactly, floats within a tolerance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.utils._python_dispatch
from torch.utils._pytree import tree_map

from silverrec.snapshot import EXPORT_FILE, SCRIPT_FILE

FLOAT_TOL = {"atol": 1e-4, "rtol": 1e-4}  # float32 results on CUDA vs CPU (scores, attention)


def to_device(tree: Any, device: torch.device | str) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def program_on(path: Path, backend: str, device: torch.device | str):
    """A snapshot's program loaded by silverrec's own loaders (state tensors attached) and put on
    `device`: model.pt2 through torch.export's device pass (the CPU-traced graph holds device
    constants, which a plain `.to` would leave on the CPU), model.ts with map_location."""
    from silverrec import snapshot as io

    root = Path(path)
    manifest = io.read_manifest(root)
    if backend == "export":
        from torch.export.passes import move_to_device_pass

        load = getattr(io, "load_exported", None)  # attaches tensors.pt (format 5); absent before
        program = load(root, manifest) if load else torch.export.load(root / EXPORT_FILE)
        return move_to_device_pass(program, device).module()
    if backend == "torchscript":
        load = getattr(io, "load_scripted", None)
        if load:
            return load(root, manifest, map_location=device)
        return torch.jit.load(str(root / SCRIPT_FILE), map_location=device)
    raise ValueError(f"unknown backend {backend!r}")


class OnDevice:
    """`module` on `device` called with CPU tensors: arguments moved there, outputs moved back (so a
    loaded `Snapshot`'s API runs unchanged with `snap.module = OnDevice(...)`)."""

    def __init__(self, module, device: torch.device | str):
        self.module = module
        self.device = torch.device(device)

    def __getattr__(self, name):  # the program's other methods (TorchScript `rank`), as they are
        return getattr(self.module, name)

    def __call__(self, *args, **kwargs):
        out = self.module(*to_device(args, self.device), **to_device(kwargs, self.device))
        return to_device(out, "cpu")  # (the copy back waits for the device)


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
