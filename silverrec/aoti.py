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
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

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
    there), by device: their manifest entries (`compile_package`)."""
    packages = {"cpu": compile_package(module, example_args, dynamic_shapes, directory, export_program, "cpu")}
    if torch.cuda.is_available():
        on_gpu = copy.deepcopy(module).to("cuda")
        args = tuple(a.to("cuda") if isinstance(a, torch.Tensor) else a for a in example_args)
        packages["cuda"] = compile_package(on_gpu, args, dynamic_shapes, directory, export_program, "cuda")
    return packages


def package_entry(manifest: dict[str, Any], device: torch.device | str) -> dict[str, Any] | None:
    """The manifest's entry of the package for `device`'s type, or None (config.backend.aoti)."""
    packages = manifest.get("config", {}).get("backend", {}).get("aoti") or {}
    return packages.get(torch.device(device).type)


class AotiProgram:
    """A loaded package, called like the module it was compiled from (ints converted with `int_arg`)."""

    def __init__(self, path: Path, int_positions: Sequence[int], device: torch.device | str = "cpu"):
        import silverrec.kernels  # noqa: F401  (the package calls the silverrec ops: the library must be loaded)

        device = torch.device(device)
        index = device.index if device.index is not None else (0 if device.type == "cuda" else -1)
        self.runner = torch._inductor.aoti_load_package(str(path), device_index=index)
        self.int_positions = tuple(int_positions)

    def __call__(self, *args):
        return self.runner(*[int_arg(a) if i in self.int_positions else a for i, a in enumerate(args)])

    def eval(self) -> "AotiProgram":
        return self
