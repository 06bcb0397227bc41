"""The `--device cuda` side of the benchmarks: the device check, a CUDA-event timer that alternates
the systems call by call, peak device memory, the GPU references and the run's machine record.

    from cuda_common import attempt, cuda_alternate, cuda_info, faiss_gpu, peak_bytes, require_device

On a CPU-only machine `require_device("cuda")` exits with a message, unless SILVERREC_CUDA_DRY_RUN=1:
then it returns the CPU device and the `--device cuda` code path runs on CPU tensors (wall-clock
timer, no memory figures), a check of the script itself before a GPU run, not a measurement.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import quantiles  # noqa: E402

# silverrec from the checkout alone on a GPU machine without an install (tools/repo_import.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import repo_import  # noqa: E402

repo_import.install()


def require_device(device: str) -> torch.device:
    """torch.device(device); SystemExit with a clear message for a CUDA device on a machine without one."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available() and os.environ.get("SILVERREC_CUDA_DRY_RUN") == "1":
        return torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: no CUDA device on this machine (torch {torch.__version__}: "
                         "torch.cuda.is_available() is False). Run it on a GPU machine (docs/gpu.md); "
                         "the CPU benchmark is the default, --device cpu.")
    if dev.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda, got {device!r}")
    return dev


def cuda_alternate(fns: dict[str, Callable[[], Any]], repeat: int, warmup: int = 3) -> dict[str, dict[str, float]]:
    """Milliseconds per call of each system by CUDA events (host launch gaps included: the stream
    idles while the host launches), alternated call by call (A B C, then C B A, ...), the device
    idle before each call; `warmup` rounds excluded. -> per system: median / p20 / p80 / runs and
    `paired_ratio_median` (median over rounds of its time / the first system's time)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeat):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(_time_ms(fns[name]))
    first = times[names[0]]
    return {n: quantiles(t) | {"paired_ratio_median": statistics.median(b / a for a, b in zip(first, t))}
            for n, t in times.items()}


def _time_ms(fn: Callable[[], Any]) -> float:
    if not torch.cuda.is_available():  # the dry run
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def peak_bytes(fn: Callable[[], Any]) -> int | None:
    """Peak device memory allocated during `fn()` above what was allocated before it (None: dry run)."""
    if not torch.cuda.is_available():
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def faiss_gpu():
    """The faiss module when it has GPU indexes and sees a GPU, else None (the torch floor is used)."""
    try:
        import faiss
    except ImportError:
        return None
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() < 1:
        return None
    return faiss


def attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(fn(), None), or (None, "Type: message") when it raises: one failing point of a one-shot GPU
    run is recorded in its row instead of losing the whole run."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001  (recorded, not hidden)
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def cuda_info() -> dict[str, Any]:
    """The device and the versions that ran (with each result file)."""
    if not torch.cuda.is_available():
        return {"gpu": None, "dry_run": "SILVERREC_CUDA_DRY_RUN=1: CPU tensors, not a measurement", "torch": torch.__version__}
    props = torch.cuda.get_device_properties(0)
    info = {"gpu": props.name, "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "capability": ".".join(map(str, torch.cuda.get_device_capability())),
            "cuda": torch.version.cuda, "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    fg = faiss_gpu()
    info["faiss_gpu"] = fg.__version__ if fg else None
    return info
