"""The operator library `libsilverrec_ops.so` (kernels/csrc/, built by setup.py): loaded once per process.

Every `silverrec::` op is defined there, in C++ (schema, CPU kernel, Meta kernel), and so are the
`silverrec_host::` functions (the predictor's request encoding; the kernels' parts and controls that tests
and benchmarks call). `load()` puts them in the dispatcher with `torch.ops.load_library`; importing
`silverrec.kernels` calls it, then registers the CUDA kernels written in Python (Triton). A C++ process
loads the same file (dlopen) and runs a TorchScript or AOTInductor program without Python.

`SILVERREC_OPS_PATH` loads another build of the same sources instead (a library built for another
instruction set: `make test-portable` runs the kernel tests on the AVX-512-without-VNNI and AVX2 builds,
whose paths a machine with AVX-512 VNNI never executes otherwise). One process holds one build: the
namespaces can be defined once.

There is no fallback: without the library (no C++ compiler at install time) no silverrec op exists, and
loading raises an ImportError that says how to build it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

LIBRARY_NAME = "libsilverrec_ops.so"
_loaded: dict[str, str] = {}


def library_path() -> Path:
    """The build this process loads: SILVERREC_OPS_PATH, else the one beside this module."""
    given = os.environ.get("SILVERREC_OPS_PATH")
    return Path(given) if given else Path(__file__).resolve().parent / LIBRARY_NAME


def load() -> str:
    """Load the operator library once (later calls return the path loaded). ImportError when it is missing or
    built for another torch."""
    if "path" not in _loaded:
        path = library_path()
        if not path.is_file():
            why = (f"SILVERREC_OPS_PATH={os.environ['SILVERREC_OPS_PATH']!r} is not a file" if "SILVERREC_OPS_PATH"
                   in os.environ else f"{path} is not built")
            raise ImportError(f"silverrec's operator library is missing: {why}. Build it with `make setup` or "
                              "`pip install --no-build-isolation -e .` (needs a C++17 compiler); without it no "
                              "silverrec operator exists, so no snapshot can be published, loaded or served")
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            raise ImportError(f"cannot load {path}: {e} (built for another torch? rebuild it with `make setup`)") from e
        _loaded["path"] = str(path)
    return _loaded["path"]


def host():
    """The `silverrec_host::` functions (kernels/csrc/library.cpp), the library loaded."""
    load()
    return torch.ops.silverrec_host


def lookup_ids(lists: list[list[int]], table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Item-id lists -> (rows int64, offsets int64 [L + 1], the first list with an unknown id or -1) through the
    predictor's dense id table int32 (kernels/csrc/encode.cpp lookup_ids)."""
    flat = [i for one in lists for i in one]
    return host().lookup_ids(flat, [len(one) for one in lists], table)
