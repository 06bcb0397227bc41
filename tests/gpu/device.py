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
    """A snapshot's program loaded onto `device`: model.pt2 through torch.export's device pass (the
    CPU-traced graph holds device constants: a plain `.to` would leave them on the CPU), model.ts
    with map_location."""
    if backend == "export":
        from torch.export.passes import move_to_device_pass

        return move_to_device_pass(torch.export.load(Path(path) / EXPORT_FILE), device).module()
    if backend == "torchscript":
        return torch.jit.load(str(Path(path) / SCRIPT_FILE), map_location=device)
    raise ValueError(f"unknown backend {backend!r}")


class OnDevice:
    """`module` on `device` called with CPU tensors: arguments moved there, outputs moved back (so a
    loaded `Snapshot`'s API runs unchanged with `snap.module = OnDevice(...)`)."""

    def __init__(self, module, device: torch.device | str):
        self.module = module
        self.device = torch.device(device)

    def __call__(self, *args, **kwargs):
        out = self.module(*to_device(args, self.device), **to_device(kwargs, self.device))
        torch.cuda.synchronize(self.device) if self.device.type == "cuda" else None
        return to_device(out, "cpu")


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
