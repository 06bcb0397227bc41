"""Where the time of silverrec's GPU paths goes: torch.profiler over the public search path and the
exact int8 top-k, on a CUDA device.

    python3 benchmarks/profile_cuda.py [--quick]        # on a GPU: results/profile_cuda[_quick].json

For each case: wall time per call on the host, device (kernel) time per call, kernel launches per
call, and the ops that take the most host time and device time. Wall >> device time means the path
is bound by the host (dispatch, launches, synchronisation), not by the GPU's arithmetic. Cases: the
filtered search of benchmarks/filter.py's --device cuda index (200k x 96 with --quick, batch 16,
k = 100) unfiltered and with its most and least selective conjunctions, through `search_index`
(request compilation, estimates, one forward), eager and replayed from a CUDA graph
(`GraphedForward`); the exact int8 index (one cluster: `silverrec::ivf_search`) over 100k x 128, k = 100.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("SILVERREC_QUIET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from cuda_common import cuda_info, require_device  # noqa: E402
from common import Panel, plot_only, replot, save_plot  # noqa: E402

CALLS = 20


def _device_us(evt) -> float:
    return float(getattr(evt, "self_device_time_total", getattr(evt, "self_cuda_time_total", 0.0)))


def profile_case(name: str, fn, dev: torch.device, top: int = 12) -> dict:
    """fn() warmed, then CALLS calls timed by wall clock and under torch.profiler -> summary dict."""
    for _ in range(3):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / CALLS
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(CALLS):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if _device_us(e) > 0 and e.device_type.name == "CUDA"]
    device_ms = sum(_device_us(e) for e in kernels) / 1e3 / CALLS
    launches = sum(e.count for e in kernels) / CALLS
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    dev_top = sorted(kernels, key=_device_us, reverse=True)[:top]
    out = {
        "case": name, "wall_ms_per_call": wall_ms, "device_ms_per_call": device_ms, "kernel_launches_per_call": launches,
        "host_top": [{"op": e.key, "self_cpu_ms_per_call": e.self_cpu_time_total / 1e3 / CALLS, "calls_per_call": e.count / CALLS}
                     for e in host],
        "device_top": [{"kernel": e.key[:120], "ms_per_call": _device_us(e) / 1e3 / CALLS, "launches_per_call": e.count / CALLS}
                       for e in dev_top],
    }
    print(f"\n== {name}: wall {wall_ms:.3f} ms/call, device {device_ms:.3f} ms/call, {launches:.0f} kernel launches/call")
    print("  host (self CPU ms/call, calls/call):")
    for r in out["host_top"]:
        print(f"    {r['self_cpu_ms_per_call']:8.3f}  {r['calls_per_call']:6.1f}  {r['op']}")
    print("  device (ms/call, launches/call):")
    for r in out["device_top"]:
        print(f"    {r['ms_per_call']:8.3f}  {r['launches_per_call']:6.1f}  {r['kernel']}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="200k items (default 1M)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    dev = require_device(args.device)

    import filter as filter_bench  # benchmarks/filter.py: the --device cuda index
    from exact_topk import exact_index

    from silverrec.publish.quantize import quantize_global
    from silverrec.retrieval.filtered_search import search_index

    c = filter_bench.cuda_setup(args.quick, dev)
    cases = []
    with torch.inference_mode():
        cases.append(profile_case("search unfiltered, k=100, nprobe=16",
                                  lambda: search_index(c.snap, c.qt, 100, nprobe=16), dev))
        for f in (c.picked[0], c.picked[-1]):
            frac = float(c.masks[f].float().mean())
            cases.append(profile_case(f"search filtered {frac:.4%} [{f}], k=100, nprobe=16",
                                      lambda f=f: search_index(c.snap, c.qt, 100, nprobe=16, filter=f), dev))
        # the same calls with the forward replayed from a CUDA graph (GraphedForward, what load serves)
        cases.append(profile_case("graphed search unfiltered, k=100, nprobe=16",
                                  lambda: search_index(c.snap_graphed, c.qt, 100, nprobe=16), dev))
        f = c.picked[0]
        cases.append(profile_case(f"graphed search filtered [{f}], k=100, nprobe=16",
                                  lambda: search_index(c.snap_graphed, c.qt, 100, nprobe=16, filter=f), dev))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(100_000, 128, generator=gen)
        exact = exact_index(*quantize_global(x)).to(dev)
        q = torch.randn(16, 128, generator=gen).to(dev)
        cases.append(profile_case("exact index 100k x 128, batch 16, k=100", lambda: exact(q, 100, 1), dev))
    name = "profile_cuda" + ("_quick" if args.quick else "") + ("_dry_run" if dev.type == "cpu" else "")
    path = Path(__file__).resolve().parent / "results" / f"{name}.json"
    path.write_text(json.dumps({"gpu": cuda_info(), "n": c.n, "calls": CALLS, "cases": cases}, indent=1))
    print(f"wrote {path}")
    replot(name, plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """Per case: host wall time against device (kernel) time per call; the gap is host-bound work."""
    cases = payload["cases"]
    names = [f"{c['case']} ({c['kernel_launches_per_call']:.0f} launches)" for c in cases]
    series = {"wall time per call": (names, [c["wall_ms_per_call"] for c in cases]),
              "device (kernel) time per call": (names, [c["device_ms_per_call"] for c in cases])}
    save_plot(path, [Panel(f"{payload['n']:,} items, batch 16", "case", "ms per call", series, kind="barh", logy=True)],
              f"where the GPU paths' time goes, {payload['gpu'].get('gpu')}", height=5, width=9)


if __name__ == "__main__" and not plot_only(plot, "profile_cuda"):
    sys.exit(main())
