"""`silverrec.load(path, device="cpu")` against the predictor as it was before the device argument
(a Snapshot around `load_exported(...).module()`: the old load's exact result), and the device
path forced on the CPU (OnDevice around the moved program: the wrapper's own cost), on one small
pure-ANN snapshot: snap.search medians, the sides alternated call by call.

    .venv/bin/python benchmarks/load_device.py [--quick]   # -> benchmarks/results/load_device_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import silverrec
import silverrec.serving.device as device_path
from silverrec.publish.filtered_ivf import publish_index
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool
from silverrec.serving.predictor import Snapshot
from silverrec.snapshot import load_exported, read_manifest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Panel, plot_only, replot, save_plot  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "load_device_cpu.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n, calls = (5000, 50) if args.quick else (20000, 300)
    torch.set_num_threads(1)
    g = np.random.default_rng(0)
    pool = Pool(np.arange(n, dtype=np.int64), g.normal(size=(n, 64)).astype(np.float32))
    with tempfile.TemporaryDirectory() as tmp:
        path = publish_index(pool, Path(tmp) / "s", config=IVFConfig(nlist=64, seed=0), torchscript=False)
        root = Path(path)
        manifest = read_manifest(root)
        sides = {"before (Snapshot of load_exported().module())":
                 Snapshot(root, manifest, load_exported(root, manifest).module(), "export"),
                 "load(device='cpu')": silverrec.load(path, backend="export", device="cpu")}
        device_path.MOVE_CPU = True
        sides["device path forced on CPU (OnDevice)"] = silverrec.load(path, backend="export", device="cpu")
        device_path.MOVE_CPU = False
        rows = []
        for batch in (1, 16):
            q = torch.from_numpy(g.normal(size=(batch, 64)).astype(np.float32))
            want = None
            times = {name: [] for name in sides}
            for _ in range(calls):
                for name, snap in sides.items():
                    t = time.perf_counter()
                    res = snap.search(q, 10, nprobe=8)
                    times[name].append(time.perf_counter() - t)
                    want = res.item_ids if want is None else want
                    assert torch.equal(res.item_ids, want)
            med = {name: float(np.median(v)) * 1e6 for name, v in times.items()}
            base = next(iter(med.values()))
            rows.append({"batch": batch, "median_us": med, "ratio_to_before": {k: v / base for k, v in med.items()}})
            print(batch, {k: f"{v:.1f} us ({v / base:.3f}x)" for k, v in med.items()})
    result = {"n": n, "dim": 64, "nlist": 64, "nprobe": 8, "k": 10, "calls": calls, "threads": 1,
              "loadavg": os.getloadavg(), "rows": rows}
    OUT.write_text(json.dumps(result, indent=2))
    print(f"wrote {OUT}")
    replot(OUT.stem, plot)


def plot(payload: dict, path: Path) -> None:
    """snap.search median per load path and batch."""
    rows = payload["rows"]
    names = list(rows[0]["median_us"])
    series = {name: ([f"batch {r['batch']}" for r in rows], [r["median_us"][name] for r in rows]) for name in names}
    save_plot(path, [Panel(f"{payload['n']:,} x {payload['dim']}, nprobe {payload['nprobe']}, k {payload['k']}, "
                           f"{payload['threads']} thread", "batch", "us per search (median)", series, kind="bar")],
              "silverrec.load(device='cpu') paths on the CPU")


if __name__ == "__main__" and not plot_only(plot, "load_device_cpu"):
    main()
