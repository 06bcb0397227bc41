"""Device launches of each entry point's forward on CUDA, counted without a GPU; and the CUDA-graph replay
rate of a varied request stream through the padded shapes of silverrec/serving/buckets.py.

Launches: a snapshot's forward runs on CPU tensors under TRITON_INTERPRET=1 inside a recorder
(`recorded_ops`, tests/test_filter_plan_triton.py) that replaces every silverrec op by its CUDA
implementation (`cuda_kernel`): what that implementation issues is recorded, Triton launches and
tensor ops that run a device kernel (views, `empty` and host metadata excluded); every other tensor
op of the forward counts as one launch. The entry points, batch 16, k 100:
- search: a pure-ANN snapshot of the bigann10k vectors (10k x 128, real), unfiltered;
- filtered_search: the same snapshot, each query filtered on its MovieLens genres (row i carries
  movie i's genres) with a conjunction, mode auto;
- recommend: the MovieLens recommendation snapshot `--snapshot` (default: out/demo/snapshot, `make demo`).
Counts only, no timing: at batch 16 each launch costs several microseconds of launch and dispatch
on a GPU, so the count is the small-batch floor of an eager forward (a replayed graph is one launch).

Replay (`--replay`): the device path forced on the CPU (silverrec/serving/device.py MOVE_CPU, graphs
captured by `capture_eager`: the same keys and counters, no GPU), warmed up at load (the default
`Buckets`), then a varied stream on the search and recommend entry points: batch sizes 1-64, histories
of 1-200 random items, a random genre filter on about half the requests, k 10; replay rate =
replayed calls / calls after the warm-up.

    .venv/bin/python benchmarks/cuda_launches.py [--json] [--snapshot DIR]   # last line {"search": N, ...}
    .venv/bin/python benchmarks/cuda_launches.py --replay [--json] [--calls N]  # last line {"replay_rate": r, ...}

Writes benchmarks/results/cuda_launches.json (cuda_replay.json with --replay) and its plot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

if not any(a.startswith("cuda") for a in sys.argv):  # counting: Triton's interpreter (before triton is imported)
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("SILVERREC_QUIET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Panel, plot_only, print_table, replot, save_plot, write_results  # noqa: E402

import silverrec  # noqa: E402
from tests.helpers import load_ann  # noqa: E402
from tests.test_filter_plan_triton import recorded_ops  # noqa: E402

BATCH, K = 16, 100
TARGETS = {"search": 8, "filtered_search": 16, "recommend": 40}
NO_KERNEL = {"empty", "t", "slice", "select", "view", "unsqueeze", "expand", "alias", "detach", "transpose",
             "as_strided", "_local_scalar_dense", "lift_fresh", "reshape", "_unsafe_view", "squeeze", "permute",
             "unbind", "split", "split_with_sizes", "chunk", "narrow", "empty_like", "new_empty", "set_",
             "sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "is_same_size", "_reshape_alias",
             "unflatten", "flatten", "movedim", "diagonal", "_conj", "resolve_conj", "resolve_neg", "numpy_T",
             "view_as", "expand_as", "lift_fresh_copy", "to", "contiguous"}
MOVIES = Path(ROOT) / "data" / "movielens" / "movies.csv"


def cuda_kernel(name: str):
    """The Python CUDA implementation of the op silverrec::`name` (kernels/*.py), or None: the op then counts as
    one launch (its CUDA kernel is one, or it is not on the entry points counted here)."""
    from silverrec.kernels import (candidate_rows, centroid_probe, filter_plan, filtered_ivf_search, filtered_topk,
                                   ivf_scan, mol_score, rescore_rows, rows_to_items)

    return {"filtered_ivf_search": filtered_ivf_search.filtered_ivf_search_cuda,
            "ivf_search": filtered_ivf_search.ivf_search_cuda, "filter_plan": filter_plan.filter_plan_cuda,
            "verify_topk": filtered_topk.verify_topk_cuda, "filtered_topk": filtered_topk.filtered_topk_cuda,
            "ivf_scan": ivf_scan.ivf_scan_cuda, "centroid_candidates": centroid_probe.centroid_candidates_torch,
            "candidate_rows": candidate_rows.candidate_rows_torch, "mol_score": mol_score.mol_score_torch,
            "rescore_rows": rescore_rows.rescore_rows_torch,
            "rows_to_items": rows_to_items.rows_to_items_torch}.get(name)


@contextlib.contextmanager
def cuda_ops():
    """Every silverrec op called inside runs its CUDA implementation (on the CPU tensors it is given)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Substitute(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "silverrec":
                fn = cuda_kernel(func._opname)
                if fn is not None:
                    with Substitute():
                        return fn(*args, **kwargs)
            return func(*args, **kwargs)

    with Substitute():
        yield


def count(call) -> dict[str, int]:
    """call() with silverrec ops on their CUDA implementations: {'triton': launches, 'torch': kernel-running ops}."""
    with recorded_ops() as ops, cuda_ops():
        call()
    names = [op for op, _ in ops]
    kernels = Counter(op for op in names if op not in NO_KERNEL and op != "triton")
    return {"triton": names.count("triton"), "torch": sum(kernels.values()),
            "host_reads": names.count("_local_scalar_dense") + names.count("equal"),
            "ops": dict(kernels.most_common())}


class Recorded:
    """A snapshot's program whose calls are counted (`count`): only the forward, not the host work around it."""

    def __init__(self, module):
        self.module, self.counts = module, []

    def __getattr__(self, name):
        return getattr(self.__dict__["module"], name)

    def __call__(self, *args):
        out = []
        self.counts.append(count(lambda: out.append(self.module(*args))))
        return out[0]


def genres(n: int) -> list[list[str]]:
    """Item row i's genres: movie (i mod the catalogue)'s in data/movielens/movies.csv."""
    import csv

    with open(MOVIES, newline="", encoding="utf-8") as f:
        movies = [row["genres"].split("|") for row in csv.DictReader(f)]
    return [[g for g in movies[i % len(movies)] if g != "(no genres listed)"] for i in range(n)]


def ann_snapshot(out: Path) -> tuple[Path, np.ndarray]:
    """A pure-ANN snapshot of bigann10k with MovieLens genres -> (path, its queries float32 [Q, 128])."""
    from silverrec.publish.filtered_ivf import publish_index
    from silverrec.publish.ivf import IVFConfig
    from silverrec.publish.pool import Pool

    try:
        base, queries = load_ann("bigann10k")
    except FileNotFoundError:  # a GPU machine without ../shared/data: a Gaussian mixture of the same size
        g = np.random.default_rng(0)
        centers = g.normal(size=(100, 128)).astype(np.float32) * 20
        base = centers[g.integers(0, 100, 10000)] + g.normal(size=(10000, 128)).astype(np.float32) * 5
        queries = centers[g.integers(0, 100, 100)] + g.normal(size=(100, 128)).astype(np.float32) * 5
        print("bigann10k not found: a Gaussian mixture of 10k x 128 instead")
    pool = Pool(np.arange(len(base), dtype=np.int64), base, {"genre": genres(len(base))})
    return publish_index(pool, out, config=IVFConfig(nlist=64, seed=0)), queries


FILTERS = ["genre = Drama", "genre = Comedy AND NOT genre = Romance", "genre IN (Action, Thriller)",
           "genre = Animation AND genre = Children", "genre = Documentary", None]


def launch_rows(snapshot: Path | None, tmp: Path) -> list[dict]:
    path, queries = ann_snapshot(tmp / "ann")
    snap = silverrec.load(path)
    snap.module = rec = Recorded(snap.module)
    q = torch.from_numpy(queries[:BATCH])
    snap.search(q, K)
    snap.search(q, K, filter=[FILTERS[b % len(FILTERS)] for b in range(BATCH)])
    search, filtered = rec.counts
    rows = [{"entry": "search", **search}, {"entry": "filtered_search", **filtered}]
    if snapshot is not None:
        snap = silverrec.load(snapshot)
        handler = snap.rec_handler()
        handler.module = rec = Recorded(handler.module)
        ids = handler.row_to_item
        requests = [{"history": [int(i) for i in ids[b * 37 % len(ids):][:20]]} for b in range(BATCH)]
        snap.recommend(requests, k=min(K, int(snap.config.get("candidates") or K)))
        rows.append({"entry": "recommend", **rec.counts[0]})
    for row in rows:
        row["launches"] = row["triton"] + row["torch"]
        row["target"] = TARGETS[row["entry"]]
    return rows


GENRES = ["Drama", "Comedy", "Action", "Thriller", "Romance", "Adventure", "Crime", "Children"]


def random_filter(g) -> str | None:
    """None for about half the requests, else a conjunction, disjunction or negation of MovieLens genres."""
    a, b = g.choice(GENRES, 2, replace=False)
    return [None, None, None, f"genre = {a}", f"genre = {a} AND NOT genre = {b}", f"genre IN ({a}, {b})"][
        int(g.integers(0, 6))]


def replay_rows(snapshot: Path | None, tmp: Path, calls: int, device: str = "cpu",
                seed: int = 0) -> tuple[list[dict], dict]:
    """The varied stream on each entry point with the default buckets (warm-up at load): calls, captures and
    replays after the warm-up, the replay rate; on "cuda" also the wall time per call (p50 / p99). On "cpu"
    the device path is forced on the CPU (MOVE_CPU: the same padding, keys and counters, no graph)."""
    import time

    import silverrec.serving.device as device_path
    from silverrec.serving.device import graph_counts

    g = np.random.default_rng(seed)
    device_path.MOVE_CPU = device == "cpu"
    rows = []
    path, queries = ann_snapshot(tmp / "ann")
    # forced onto the CPU, the device path runs the exported program as a GPU without a CUDA AOTInductor
    # package would (the CPU package, which `auto` may prefer here, is not padded: it never meets a graph)
    backend = "export" if device == "cpu" else "auto"
    entries = [("search", silverrec.load(path, device=device, backend=backend))]
    if snapshot is not None:
        entries.append(("recommend", silverrec.load(snapshot, device=device, backend=backend)))
    for entry, snap in entries:
        warm = graph_counts(snap.module)
        times = []
        ids = snap.rec_handler().row_to_item if entry == "recommend" else None
        q = torch.from_numpy(queries)
        for _ in range(calls):
            B = int(g.integers(1, 65))
            if entry == "search":
                args = (q[g.integers(0, len(q), B)], 10)
                options = {"filter": [random_filter(g) for _ in range(B)]}
                call = snap.search
            else:
                args = ([{"history": [int(x) for x in g.choice(ids, int(g.integers(1, 201)), replace=False)],
                          "filter": random_filter(g)} for _ in range(B)],)
                options = {"k": 10}
                call = snap.recommend
            t = time.perf_counter()
            call(*args, **options)
            times.append((time.perf_counter() - t) * 1e3)
        after = graph_counts(snap.module)
        row = {"entry": entry, **{key: after[key] - warm[key] for key in after}, "warm_up_captures": warm["captures"],
               "shapes": len(snap.module.shapes), "device": device}
        row["replay_rate"] = row["replays"] / max(row["calls"], 1)
        if device != "cpu":
            row.update(p50_ms=float(np.percentile(times, 50)), p99_ms=float(np.percentile(times, 99)))
        rows.append(row)
    device_path.MOVE_CPU = False
    total = {key: sum(r[key] for r in rows) for key in ("calls", "captures", "replays", "eager")}
    return rows, {"replay_rate": total["replays"] / max(total["calls"], 1), **total,
                  **{f"{r['entry']}_replay_rate": r["replay_rate"] for r in rows}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the counts as one JSON line last")
    ap.add_argument("--replay", action="store_true", help="the replay rate of a varied request stream instead")
    ap.add_argument("--calls", type=int, default=300, help="--replay: requests per entry point")
    ap.add_argument("--no-save", dest="save", action="store_false", help="print only: write no results file (a check)")
    ap.add_argument("--device", default="cpu", help="--replay: cuda on a GPU (wall time per call too); cpu: the "
                    "device path forced on the CPU")
    ap.add_argument("--snapshot", type=Path, default=Path(ROOT) / "out" / "demo" / "snapshot",
                    help="the recommendation snapshot (make demo); missing: recommend is not counted")
    args = ap.parse_args(argv)
    snapshot = args.snapshot if (args.snapshot / "manifest.json").is_file() else None
    with tempfile.TemporaryDirectory() as tmp:
        if args.replay:
            rows, summary = replay_rows(snapshot, Path(tmp), args.calls, args.device)
            print_table(rows, ["entry", "calls", "captures", "replays", "eager", "replay_rate", "warm_up_captures",
                               "shapes", "p50_ms", "p99_ms"])
            name = "cuda_replay" if args.device == "cpu" else "cuda_replay_cuda"
            if args.save:
                path = write_results(name, {"calls": args.calls, "snapshot": str(snapshot), "device": args.device}, rows)
                replot(path.stem, plot_replay)
            last = summary
        else:
            rows = launch_rows(snapshot, Path(tmp))
            print_table(rows, ["entry", "triton", "torch", "launches", "target", "host_reads"])
            if args.save:
                path = write_results("cuda_launches", {"batch": BATCH, "k": K, "snapshot": str(snapshot)}, rows)
                replot(path.stem, plot)
            last = {row["entry"]: row["launches"] for row in rows}
    if args.json:
        print(json.dumps(last))


def plot(payload: dict, path: Path) -> None:
    """Launches per entry point against its target."""
    rows = payload["rows"]
    names = [r["entry"] for r in rows]
    series = {"Triton launches": (names, [r["triton"] for r in rows]),
              "other device ops": (names, [r["torch"] for r in rows]),
              "target": (names, [r["target"] for r in rows])}
    save_plot(path, [Panel(f"device launches per forward, batch {payload['config']['batch']}, k {payload['config']['k']}"
                           " (counted, not timed)", "entry point", "launches", series, kind="bar")],
              "CUDA launches per entry point", width=7)


def plot_replay(payload: dict, path: Path) -> None:
    """Replay rate per entry point over the varied stream."""
    rows = payload["rows"]
    names = [r["entry"] for r in rows]
    save_plot(path, [Panel("CUDA-graph replay rate over a varied request stream", "entry point", "replayed / calls",
                           {"replay rate": (names, [r["replay_rate"] for r in rows])}, kind="bar", ref=0.99,
                           ref_label="target 0.99")], "graph replay", width=6)


if __name__ == "__main__" and not plot_only(plot, "cuda_launches"):
    main()
