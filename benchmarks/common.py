"""Shared benchmark harness: one timer, machine/version info, table printing, JSON results.

    from common import alternate, machine_info, measure, print_table, write_results   (benchmarks/ on sys.path)
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def quantiles(times_ms: Sequence[float]) -> dict[str, float]:
    """Median / p20 / p80 (nearest rank) of wall times in ms, and the number of runs."""
    t = sorted(times_ms)

    def q(p: float) -> float:
        return t[min(len(t) - 1, int(round(p * (len(t) - 1))))]

    return {"median_ms": statistics.median(t), "p20_ms": q(0.2), "p80_ms": q(0.8), "runs": len(t)}


def measure(fn: Callable[[], Any], repeat: int = 7, warmup: int = 2, max_seconds: float = 30.0) -> dict[str, float]:
    """Median / p20 / p80 wall time in milliseconds; warm-up calls excluded."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
        if time.perf_counter() - start > max_seconds and len(times) >= 3:
            break
    return quantiles(times)


def alternate(fns: Sequence[Callable[[], Any]], repeat: int, warmup: int = 1) -> list[dict[str, float]]:
    """The functions timed in alternation, one call each per round (A B C, then C B A, ...), so that
    the load of a shared machine falls on all alike: `warmup` rounds excluded, then `repeat` rounds.

    Returns one dict per function: `quantiles` of its calls, `load_1min` (the 1-minute load average
    at the end) and `paired_ratio_median`, the median over the rounds of (its time / the first
    function's time in the same round).
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeat):
        for j in (range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))):
            t = time.perf_counter()
            fns[j]()
            times[j].append((time.perf_counter() - t) * 1e3)
    load = os.getloadavg()[0]
    return [quantiles(t) | {"load_1min": load, "paired_ratio_median": statistics.median(b / a for a, b in zip(times[0], t))}
            for t in times]


def machine_info() -> dict[str, Any]:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    try:
        import faiss

        info["faiss"] = faiss.__version__
    except ImportError:
        pass
    return info


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_results(name: str, config: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": machine_info(), "config": config, "rows": rows,
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    return path
