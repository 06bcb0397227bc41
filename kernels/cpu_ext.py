"""Lazy loader of the optional C++ CPU fast paths (`silverrec.kernels._cpu`, built from kernels/csrc/).

The CPU implementations of `ivf_scan`, `bloom_filter(_counts)`,
`filter_plan`, `verify_topk`, `filtered_topk` and the query quantisation call `cpu_ext()` and use
the extension when it is importable; otherwise (no compiler at install time, or
`SILVERREC_CPU_EXT=0` in the environment) they run their torch / numpy implementations, which stay
the reference semantics, after one warning. Results are bit-identical either way
(tests/test_cpu_scan.py, tests/test_filtered_topk.py, tests/test_postings.py). These ops stay
Python custom ops. `ivf_search`, `filtered_ivf_search`, `rows_to_items`, `candidate_rows`, `mol_score` and
`rescore_rows` are defined in Python too, and loading the extension registers their CPU kernels with the
dispatcher (kernels/filtered_ivf_search.py); snapshots name the ops, not their kernels, so export /
TorchScript are unaffected.

`SILVERREC_CPU_EXT_PATH` loads the extension from another build of the same sources instead (a .so
built for another instruction set: `make test-portable` runs the kernel tests on the AVX-512-without-VNNI
and AVX2 builds of kernels/csrc/, whose paths a machine with AVX-512 VNNI never executes otherwise).
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType
from typing import Optional

_state: dict[str, Optional[ModuleType]] = {}


def cpu_ext() -> Optional[ModuleType]:
    """The compiled module, or None (torch fallback). Import is attempted once per process."""
    if "ext" not in _state:
        mod = None
        if os.environ.get("SILVERREC_CPU_EXT", "1") != "0":
            import importlib.util

            path = os.environ.get("SILVERREC_CPU_EXT_PATH")
            try:
                loaded = sys.modules.get("silverrec.kernels._cpu")
                if path and loaded is not None and getattr(loaded, "__file__", None) == path:
                    built, mod = True, loaded  # (set_enabled(True) after a switch-off)
                elif path:  # another build: imported under the package's name, from its file
                    spec = importlib.util.spec_from_file_location("silverrec.kernels._cpu", path)
                    if spec is None or not os.path.isfile(path):
                        raise ImportError(f"SILVERREC_CPU_EXT_PATH={path!r} is not an extension module file")
                    built = True
                    mod = importlib.util.module_from_spec(spec)
                    sys.modules["silverrec.kernels._cpu"] = mod  # later imports of the name get this build
                    spec.loader.exec_module(mod)  # type: ignore[union-attr]
                else:
                    built = importlib.util.find_spec("silverrec.kernels._cpu") is not None
                    from silverrec.kernels import _cpu as mod  # type: ignore[attr-defined,no-redef]
            except ImportError as e:
                # not built (a checkout run without an install, as `make test-gpu` does) or built
                # for another torch: the message says which, not Python's "partially initialized"
                why = f"cannot load it: {e}" if built else "not built in this checkout (kernels/_cpu*.so)"
                warnings.warn(
                    f"silverrec: C++ CPU kernels unavailable ({why}); using the slower torch implementations. "
                    "Build them with `pip install --no-build-isolation -e .` (needs a C++ compiler).",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _state["ext"] = mod
    return _state["ext"]


def set_enabled(enabled: bool) -> None:
    """Switch the extension on/off in this process (benchmarks compare both paths)."""
    _state.pop("ext", None)
    os.environ["SILVERREC_CPU_EXT"] = "1" if enabled else "0"
