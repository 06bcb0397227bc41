"""AOTInductor packages of a snapshot's program: compiled by the publisher, run by `silverrec.load(..., backend="aoti")`.

A package (`torch._inductor.aoti_compile_and_package`) is the exported program compiled ahead of time into a
shared library with its weights: the forward runs as generated C++ that calls ATen and the silverrec ops (from
libsilverrec_ops.so, which a package does not bundle: the process loads it, as `silverrec.kernels` does) with no
Python between them. On a GPU machine the CUDA package has the Triton kernels compiled in.

The exported forward takes Python ints (k, nprobe, ...), which AOTInductor's runner, a tensors-only interface (and
a C++ predictor's), cannot pass. The compiled entry point (`TensorEntry`) takes each int as the length of an
empty tensor [value, 0] instead (`int_arg`: no bytes), read back as a size: the same backed symbolic size the int
was under torch.export, so the graph is the exported program's. `AotiProgram` makes the conversion, so a loaded
package is called like the module.

    DIR/model.cpu.pt2    the CPU package      manifest config.aoti: {"cpu": {"file", "torch", "int_args",
    DIR/model.cuda.pt2   the CUDA package                             "compile_s"}, ...}
"""

from __future__ import annotations

import copy
import inspect
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

PACKAGE_FILES = {"cpu": "model.cpu.pt2", "cuda": "model.cuda.pt2"}


def enabled() -> bool:
    """Whether publishing compiles the packages by default: yes, unless SILVERREC_AOTI=0 (a compile takes
    minutes on a small machine; the test suite turns it off except where a test asks for it)."""
    return os.environ.get("SILVERREC_AOTI", "1") != "0"


def int_arg(value: int) -> torch.Tensor:
    """An int as the entry point takes it: an empty tensor of `value` rows (its length; no data)."""
    return torch.empty(int(value), 0)


class TensorEntry(torch.nn.Module):
    """`module`'s forward with each int argument (at `int_positions`) given as `int_arg(value)`."""

    def __init__(self, module: torch.nn.Module, int_positions: Sequence[int]):
        super().__init__()
        self.module = module
        self.int_positions = tuple(int_positions)

    def forward(self, *args):
        return self.module(*[a.shape[0] if i in self.int_positions else a for i, a in enumerate(args)])


def entry_arguments(module: torch.nn.Module, example_args: tuple, dynamic_shapes: dict[str, Any]):
    """(int positions, the entry point's example args, its dynamic shapes) for `module`'s example and shapes
    (dynamic_shapes by forward argument name, as torch.export takes them for the module)."""
    names = list(inspect.signature(module.forward).parameters)[: len(example_args)]
    positions = [i for i, a in enumerate(example_args) if isinstance(a, int) and not isinstance(a, bool)]
    args = tuple(int_arg(a) if i in positions else a for i, a in enumerate(example_args))
    specs = tuple({0: dynamic_shapes.get(name)} if i in positions and dynamic_shapes.get(name) is not None
                  else dynamic_shapes.get(name) for i, name in enumerate(names))
    return positions, args, {"args": specs}


Export = Callable[[torch.nn.Module, tuple, dict], Any]  # (module, example args, dynamic shapes) -> ExportedProgram


def compile_package(module: torch.nn.Module, example_args: tuple, dynamic_shapes: dict[str, Any], directory: Path,
                    export_program: Export, device: str = "cpu") -> dict[str, Any]:
    """Export `module` through `TensorEntry` with `export_program` (the snapshot's, silverrec/snapshot.py) and
    compile it with AOTInductor for `device` into directory / PACKAGE_FILES[device]; returns its manifest entry
    (file, torch version, int argument positions, compile seconds). `module` and the example on `device`."""
    positions, args, dynamic = entry_arguments(module, example_args, dynamic_shapes)
    t0 = time.perf_counter()
    program = export_program(TensorEntry(module, positions), args, dynamic)
    path = directory / PACKAGE_FILES[device]
    torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    if not path.is_file():
        raise RuntimeError(f"AOTInductor wrote no package at {path}")
    return {"file": path.name, "torch": torch.__version__, "int_args": positions,
            "compile_s": round(time.perf_counter() - t0, 1)}


def compile_packages(module: torch.nn.Module, example_args: tuple, dynamic_shapes: dict[str, Any],
                     directory: Path, export_program: Export) -> dict[str, dict[str, Any]]:
    """The CPU package and, where CUDA is available, the CUDA one (a copy of the module and the example moved
    there), by device: their manifest entries (`compile_package`). A package is an extra program beside model.pt2:
    one that does not compile (a module Inductor cannot lower) is recorded as {"error": why, "torch"} instead, with
    a warning, and the snapshot publishes without it."""
    devices = {"cpu": (module, example_args)}
    if torch.cuda.is_available():
        devices["cuda"] = (copy.deepcopy(module).to("cuda"),
                           tuple(a.to("cuda") if isinstance(a, torch.Tensor) else a for a in example_args))
    packages = {}
    for device, (m, args) in devices.items():
        try:
            packages[device] = compile_package(m, args, dynamic_shapes, directory, export_program, device)
        except Exception as e:  # noqa: BLE001  (any compiler failure: the reason goes into the manifest)
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            warnings.warn(f"no AOTInductor {device} package: {why}")
            (directory / PACKAGE_FILES[device]).unlink(missing_ok=True)
            packages[device] = {"error": why, "torch": torch.__version__}
    return packages


def package_entry(manifest: dict[str, Any], device: torch.device | str) -> dict[str, Any] | None:
    """The manifest's entry of the compiled package for `device`'s type, or None (none, or its compile failed:
    config.backend.aoti)."""
    packages = manifest.get("config", {}).get("backend", {}).get("aoti") or {}
    entry = packages.get(torch.device(device).type)
    return entry if entry is not None and "file" in entry else None


def loaded_cpu_package(packages: dict[str, dict[str, Any]], directory: Path) -> "AotiProgram | None":
    """The CPU package `compile_packages` wrote into `directory`, loaded (None when it did not compile)."""
    entry = packages.get("cpu", {})
    return AotiProgram(directory / entry["file"], entry["int_args"]) if "file" in entry else None


class AotiProgram:
    """A loaded package, called like the module it was compiled from (ints converted with `int_arg`)."""

    def __init__(self, path: Path, int_positions: Sequence[int], device: torch.device | str = "cpu"):
        import silverrec.kernels  # noqa: F401  (the package calls the silverrec ops: the library must be loaded)

        device = torch.device(device)
        index = device.index if device.index is not None else (0 if device.type == "cuda" else -1)
        self.runner = torch._inductor.aoti_load_package(str(path), device_index=index)
        self.int_positions = tuple(int_positions)
        # The runner's own __call__ parses its input and output tree specs from JSON on every call; the entry
        # point takes a flat tuple, so they are read once here and the tensors go straight to `boxed_run`.
        in_spec, self._out_spec = (pytree.treespec_loads(s) for s in self.runner.loader.get_call_spec())
        self._num_args = in_spec.num_leaves  # (args, {}): the entry point's arguments, flat

    def __call__(self, *args):
        if len(args) != self._num_args:
            raise TypeError(f"the AOTInductor program takes {self._num_args} arguments, got {len(args)}")
        flat = [int_arg(a) if i in self.int_positions else a for i, a in enumerate(args)]
        flat = [a for a in flat if isinstance(a, torch.Tensor)]  # a bool or None was a constant of the program
        return pytree.tree_unflatten(self.runner.loader.boxed_run(flat), self._out_spec)

    def eval(self) -> "AotiProgram":
        return self
