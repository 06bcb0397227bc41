"""silverrec: large-scale recommendation served as one PyTorch model.

    >>> import silverrec
    >>> snap = silverrec.load("snapshots/v1")      # verifies, registers the ops, loads the program

`import silverrec` is light: the public names below load their module on first use (PEP 562), so
importing a kernel (`silverrec.kernels`) or the error types never imports the predictor. Loading a
snapshot imports `silverrec.kernels` (which registers `torch.ops.silverrec.*`) before any program
is deserialised.
"""

__version__ = "0.1.0"

# first: OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP, unless the user set it (silverrec/threads.py).
# Every silverrec module runs this file before its own, so no silverrec import can load torch earlier.
from silverrec import threads as _threads  # noqa: F401, I001

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "load": "silverrec.serving.loader",
    "Snapshot": "silverrec.serving.predictor",
    "SearchResult": "silverrec.serving.predictor",
    "FORMAT_VERSION": "silverrec.snapshot",
    "SilverrecError": "silverrec.errors",
    "PoolError": "silverrec.errors",
    "QueryError": "silverrec.errors",
    "SnapshotError": "silverrec.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'silverrec' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
