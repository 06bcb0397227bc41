"""A recommendation snapshot served from a GPU against the same snapshot on the CPU, through the
public API: `silverrec.load(path, device=...).recommend(requests, k)` (CPU tensors in and out).

    python3 benchmarks/recommend_device.py --snapshot DIR --logs interactions.parquet [--device cuda]

Systems, alternated call by call in one process (benchmarks/common.py `alternate`, wall clock: the
API returns CPU tensors, so each call ends synchronised):
  cpu           load(path)                       the CPU path (the process's threads)
  cuda graphed  load(path, device="cuda")        what `silverrec serve --device cuda` runs: the
                                                 forward replayed from a CUDA graph per request shape
  cuda eager    the same program, no graphs      (GraphedForward bypassed)
Request mixes per batch size: "repeat" sends the same batch every call (its shape is captured once
and replayed); "varied" cycles through 8 batches of different users, whose history lengths differ,
so shapes change from call to call (what a server sees: mostly eager until shapes recur).
Requests are users' own histories (the last 50 items of each user in the logs). Results:
benchmarks/results/recommend_cuda.json (recommend_cuda_dry_run.json under SILVERREC_CUDA_DRY_RUN=1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Panel, alternate, plot_only, print_table, replot, save_plot, write_results  # noqa: E402
from cuda_common import cuda_info, require_device  # noqa: E402  (imports the checkout: repo_import)

import silverrec  # noqa: E402
import silverrec.serving.device as device_path  # noqa: E402
from silverrec.serving.device import OnDevice  # noqa: E402


def user_histories(logs: Path, history: int = 50) -> list[list[int]]:
    """Each user's last `history` item ids by time, users in id order."""
    t = pq.read_table(logs, columns=["user_id", "item_id", "timestamp"])
    users, items, ts = (t.column(c).to_numpy() for c in ("user_id", "item_id", "timestamp"))
    order = np.lexsort((ts, users))
    users, items = users[order], items[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    return [items[a:b][-history:].tolist() for a, b in zip(starts, np.r_[starts[1:], len(users)])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshot", required=True)
    ap.add_argument("--logs", required=True, help="interactions.parquet: the requests' histories")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeat", type=int, default=60)
    args = ap.parse_args()
    dev = require_device(args.device)
    histories = user_histories(Path(args.logs))
    cpu = silverrec.load(args.snapshot)
    device_path.MOVE_CPU = dev.type == "cpu"  # the dry run: the device path forced on the CPU
    graphed = silverrec.load(args.snapshot, device=dev)
    eager = silverrec.load(args.snapshot, device=dev)
    eager.module = OnDevice(eager.module.module.module, dev)  # OnDevice(GraphedForward(program)) -> OnDevice(program)
    systems = {"cpu": cpu, "cuda graphed": graphed, "cuda eager": eager}
    rows = []
    for batch in args.batches:
        batches = [[{"history": h} for h in histories[i * batch:(i + 1) * batch]] for i in range(8)]
        want = cpu.recommend(batches[0], k=args.k)
        for name, snap in systems.items():  # same items on every system (scores within float noise)
            got = snap.recommend(batches[0], k=args.k)
            same = float((got.item_ids == want.item_ids).float().mean())
            assert same >= 0.99, f"{name}: {same:.3f} of the items agree with the CPU's at batch {batch}"
        for mix in ("repeat", "varied"):
            calls = {}
            for name, snap in systems.items():
                state = {"i": 0}

                def call(snap=snap, state=state, mix=mix):
                    reqs = batches[0] if mix == "repeat" else batches[state["i"] % len(batches)]
                    state["i"] += 1
                    snap.recommend(reqs, k=args.k)
                calls[name] = call
            stats = alternate(list(calls.values()), repeat=args.repeat, warmup=3)
            for name, s in zip(calls, stats):
                rows.append({"batch": batch, "requests": mix, "system": name, "median_ms": round(s["median_ms"], 3),
                             "p80_ms": round(s["p80_ms"], 3), "vs_cpu": round(1 / s["paired_ratio_median"], 2)})
    print_table(rows, ["batch", "requests", "system", "median_ms", "p80_ms", "vs_cpu"])
    name = "recommend_cuda" if torch.cuda.is_available() else "recommend_cuda_dry_run"
    path = write_results(name, {"snapshot": str(args.snapshot), "k": args.k, "repeat": args.repeat,
                                "device": cuda_info(), "cpu_threads": torch.get_num_threads(),
                                "note": "vs_cpu: speed-up over the CPU path, paired per round"}, rows)
    replot(path.stem, plot)


def plot(payload: dict, path: Path) -> None:
    """Per request mix: recommend latency per batch on the CPU, on CUDA replayed from graphs and on CUDA eagerly."""
    rows, panels = payload["rows"], []
    for mix in dict.fromkeys(r["requests"] for r in rows):
        mine = [r for r in rows if r["requests"] == mix]
        panels.append(Panel(f"requests: {mix} (same batch every call)" if mix == "repeat" else f"requests: {mix} (8 batches in turn)",
                            "batch", "ms per recommend call (median)",
                            {s: ([f"batch {r['batch']}" for r in mine if r["system"] == s], [r["median_ms"] for r in mine if r["system"] == s])
                             for s in dict.fromkeys(r["system"] for r in mine)}, kind="bar", logy=True))
    gpu = payload["config"].get("device", {}).get("gpu", "CUDA")
    save_plot(path, panels, f"a recommendation snapshot on {gpu} vs its CPU ({payload['config'].get('cpu_threads')} threads), "
                            f"k {payload['config']['k']}")


if __name__ == "__main__" and not plot_only(plot, "recommend_cuda"):
    main()
