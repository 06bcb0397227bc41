"""Shared benchmark harness: one timer, machine/version info, table printing, JSON results, plots.

    from common import alternate, machine_info, measure, print_table, write_results   (benchmarks/ on sys.path)
    from common import Panel, plot_only, save_plot

Every benchmark that compares systems draws its results with `save_plot` into a PNG beside its JSON
(results/NAME.png), from the JSON payload alone, so that `python benchmarks/X.py --plot-only [NAME ...]`
redraws the plots of earlier runs without running anything (`plot_only`; tools/plot_results.py does
it for every results file).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

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


@dataclass
class Panel:
    """One chart of a figure.

    series: label -> (x values, y values) or (x values, y values, yerr) with yerr as matplotlib's
    `errorbar` takes it (one list: symmetric; [below, above]: distances from the value).
    kind: "line" (numeric x), "bar" (x are category names: one bar per series in each category) or
    "barh" (the same, horizontal: for long category names).
    ref: y of a dashed reference line (e.g. 1.0 where a ratio means "as fast as the peer").
    """

    title: str
    xlabel: str
    ylabel: str
    series: dict[str, tuple]
    kind: str = "line"
    logx: bool = False
    logy: bool = False
    ref: Optional[float] = None
    ref_label: str = ""


def save_plot(path: Path, panels: Sequence[Panel], title: str = "", height: float = 4.3, width: float = 5.6) -> Path:
    """Draw `panels` (up to 4 a row, each `width` x `height` inches) into the PNG `path` (matplotlib,
    Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(panels), 4)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _draw(ax, panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def _draw(ax, panel: Panel) -> None:
    from matplotlib.ticker import NullFormatter

    if panel.kind not in ("line", "bar", "barh"):
        raise ValueError(f"Panel.kind must be line, bar or barh, got {panel.kind!r}")
    # scales first: setting a scale resets the ticks that the bar kinds set below
    if panel.kind == "barh":  # the values run along x
        ax.set_xscale("log" if panel.logy else "linear")
        ax.set(xlabel=panel.ylabel, ylabel=panel.xlabel)
    else:
        ax.set_xscale("log" if panel.logx else "linear")
        ax.set_yscale("log" if panel.logy else "linear")
        ax.set(xlabel=panel.xlabel, ylabel=panel.ylabel)
    if panel.kind == "line":
        for label, (x, y, *err) in panel.series.items():
            ax.errorbar(list(x), list(y), yerr=err[0] if err else None, marker="o", ms=4, capsize=3, label=label)
    else:
        cats = list(dict.fromkeys(c for x, *_ in panel.series.values() for c in x))
        width = 0.8 / max(1, len(panel.series))
        for i, (label, (x, y, *err)) in enumerate(panel.series.items()):
            pos = [cats.index(c) - 0.4 + width * (i + 0.5) for c in x]
            if panel.kind == "bar":
                ax.bar(pos, list(y), width, yerr=err[0] if err else None, capsize=3, label=label)
            else:
                ax.barh(pos, list(y), width, xerr=err[0] if err else None, capsize=3, label=label)
        if panel.kind == "bar":
            ax.set_xticks(range(len(cats)), [str(c) for c in cats],
                          rotation=30 if max(len(str(c)) for c in cats) > 8 else 0, ha="right", fontsize=8)
        else:
            ax.set_yticks(range(len(cats)), [str(c) for c in cats], fontsize=7)
            ax.invert_yaxis()
    if panel.ref is not None:
        (ax.axvline if panel.kind == "barh" else ax.axhline)(panel.ref, color="grey", ls="--", lw=1,
                                                             label=panel.ref_label or None)
    for axis in (ax.xaxis, ax.yaxis):  # a log axis: labels at the decades only
        axis.set_minor_formatter(NullFormatter())
    ax.set_title(panel.title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if panel.series or panel.ref_label:
        ax.legend(fontsize=7)


def replot(name: str, plot: Callable[[dict, Path], Any]) -> Path:
    """Redraw results/NAME.png from results/NAME.json with the benchmark's `plot(payload, path)`."""
    src = RESULTS / f"{name}.json"
    if not src.exists():
        raise SystemExit(f"--plot-only: {src} does not exist (run the benchmark first)")
    path = RESULTS / f"{name}.png"
    plot(json.loads(src.read_text()), path)
    return path


def plot_only(plot: Callable[[dict, Path], Any], default: str, argv: Optional[Sequence[str]] = None) -> bool:
    """`--plot-only [NAME ...]` among the arguments: redraw each results/NAME.png (default: `default`)
    from its JSON without running the benchmark, and return True; otherwise return False.

        if __name__ == "__main__" and not plot_only(plot, "ann"):
            sys.exit(main())
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--plot-only" not in argv:
        return False
    for name in argv[argv.index("--plot-only") + 1:] or [default]:
        replot(name, plot)
    return True
