"""The AOTInductor CPU package against the TorchScript and exported programs of the same snapshot, one process,
through the public API (`silverrec.load(path, backend=...)`), the backends alternated call by call:

1. the MovieLens recommendation snapshot (the demo's: two tasks, MoL OverArch, value model; trained here with
   fixed step counts, or `--checkpoint` from `silverrec train` with a "mol" OverArch): `snap.recommend` of real
   users' histories (excluded from the answer), k 10, unfiltered and with FILTER;
2. a pure-ANN snapshot of bigann10k (10,000 x 128, SILVERREC_ANN_DATA): `snap.search` of its queries, k 10.

Batch 1 and 16. Every backend must give the same items (scores within 1e-4: the package fuses the float steps
between the ops). Also the publisher's own choice (manifest config.backend: `preferred` and its timings at the
export example), which `load(backend="auto")` follows.

    .venv/bin/python benchmarks/aoti.py [--quick] [--checkpoint C.ckpt]   # -> benchmarks/results/aoti[_quick].json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("SILVERREC_QUIET", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `silverrec serve` runs (silverrec/threads.py)
os.environ["SILVERREC_AOTI"] = "1"  # the publishers compile the CPU package

import numpy as np  # noqa: E402
import torch  # noqa: E402

import silverrec  # noqa: E402
from silverrec.publish.filtered_ivf import publish_index  # noqa: E402
from silverrec.publish.ivf import IVFConfig  # noqa: E402
from silverrec.publish.movielens import write_logs  # noqa: E402
from silverrec.publish.pool import Pool  # noqa: E402
from silverrec.publish.rec import PublishConfig, publish_rec  # noqa: E402
from silverrec.publish.train import TrainConfig, load_checkpoint, train  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Panel, alternate, plot_only, print_table, replot, save_plot, write_results  # noqa: E402

BACKENDS = ("torchscript", "aoti", "export")  # the first is each ratio's base
BATCHES = (1, 16)
FILTER = "genre = Comedy AND NOT decade = '1990s'"
TASKS = [{"name": "interacted"}, {"name": "liked", "label": "rating", "min": 4.0}]
ANN_DATA = Path(os.environ.get("SILVERREC_ANN_DATA", Path(__file__).resolve().parents[2] / "shared" / "data" / "ann"))


def same_answers(results: dict, what: str) -> None:
    """Every backend's items equal the first's; scores within 1e-4."""
    (base_name, base), *others = results.items()
    for name, res in others:
        if not torch.equal(res.item_ids, base.item_ids):
            raise SystemExit(f"{what}: {name} answers other items than {base_name}")
        torch.testing.assert_close(res.scores, base.scores, atol=1e-4, rtol=1e-4)


def time_backends(kind: str, snaps: dict, calls: dict, repeat: int) -> list[dict]:
    """One row per (case, batch, backend): calls[(case, batch)] -> fn(snap) -> result, alternated."""
    rows = []
    for (case, batch), call in calls.items():
        same_answers({name: call(snap) for name, snap in snaps.items()}, f"{kind} {case} batch {batch}")
        stats = alternate([lambda s=snap: call(s) for snap in snaps.values()], repeat=repeat, warmup=2)
        for name, s in zip(snaps, stats):
            rows.append({"snapshot": kind, "case": case, "batch": batch, "backend": name,
                         "median_ms": s["median_ms"], "p20_ms": s["p20_ms"], "p80_ms": s["p80_ms"],
                         "vs_torchscript": round(s["paired_ratio_median"], 3), "load_1min": round(s["load_1min"], 2)})
    return rows


def rec_part(tmp: Path, checkpoint: str | None, quick: bool, repeat: int) -> tuple[list[dict], dict]:
    if checkpoint:
        ckpt_path = Path(checkpoint)
    else:
        inter, items = write_logs(tmp / "logs")
        ckpt_path = tmp / "model.ckpt"
        steps = (200, 50) if quick else (1500, 300)
        train(TrainConfig(interactions=str(inter), items=str(items), tasks=TASKS, overarch=["mol"], steps=steps[0],
                          overarch_steps=steps[1], user_tower="bag"), ckpt_path, quiet_eval=True)
    ckpt = load_checkpoint(ckpt_path)
    t = time.perf_counter()
    path = publish_rec(PublishConfig(checkpoint=str(ckpt_path), overarch="mol", k0=200, candidates=256,
                                     value_model={"weights": {"interacted": 1.0, "liked": 0.5}}), tmp / "rec")
    publish_s = time.perf_counter() - t
    snaps = {name: silverrec.load(path, backend=name) for name in BACKENDS}
    off, ids = ckpt["users"]["offsets"], ckpt["users"]["item_ids"]
    users = [ids[off[u]:off[u + 1]].tolist() for u in np.random.default_rng(0).permutation(len(off) - 1)
             if off[u + 1] > off[u]]
    calls = {}
    for case, options in (("unfiltered", {}), ("filtered", {"filter": FILTER})):
        for b in BATCHES:
            requests = [{"history": h, **options} for h in users[:b]]
            calls[(case, b)] = lambda snap, r=requests: snap.recommend(r, k=10)
    rows = time_backends("MovieLens rec", snaps, calls, repeat)
    return rows, {"publish_s": round(publish_s, 1), "manifest_backend": snaps["aoti"].config["backend"]}


def ann_part(tmp: Path, repeat: int) -> tuple[list[dict], dict]:
    base = np.load(ANN_DATA / "bigann10k" / "base.npy").astype(np.float32)
    queries = np.load(ANN_DATA / "bigann10k" / "queries.npy").astype(np.float32)
    t = time.perf_counter()
    path = publish_index(Pool(np.arange(len(base), dtype=np.int64), base), tmp / "ann",
                         config=IVFConfig(nlist=64, seed=0))
    publish_s = time.perf_counter() - t
    snaps = {name: silverrec.load(path, backend=name) for name in BACKENDS}
    calls = {("search k 10", b): (lambda snap, q=torch.from_numpy(queries[:b]): snap.search(q, 10)) for b in BATCHES}
    rows = time_backends("bigann10k ANN", snaps, calls, repeat)
    return rows, {"publish_s": round(publish_s, 1), "manifest_backend": snaps["aoti"].config["backend"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="short training, fewer rounds")
    ap.add_argument("--checkpoint", help="a MovieLens checkpoint from `silverrec train` with a 'mol' OverArch")
    args = ap.parse_args()
    repeat = 30 if args.quick else 200
    with tempfile.TemporaryDirectory(prefix="silverrec-aoti-") as tmp:
        rec_rows, rec_info = rec_part(Path(tmp), args.checkpoint, args.quick, repeat)
        ann_rows, ann_info = ann_part(Path(tmp), repeat)
    rows = rec_rows + ann_rows
    print_table(rows, ["snapshot", "case", "batch", "backend", "median_ms", "p20_ms", "p80_ms", "vs_torchscript"])
    for name, info in (("rec", rec_info), ("ann", ann_info)):
        print(name, "publish", info["publish_s"], "s; manifest config.backend:", info["manifest_backend"])
    config = {"rounds": repeat, "k": 10, "filter": FILTER, "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
              "rec": rec_info, "ann": ann_info,
              "note": "vs_torchscript: median over rounds of (backend time / TorchScript time in the same round)"}
    replot(write_results("aoti_quick" if args.quick else "aoti", config, rows).stem, plot)


def plot(payload: dict, path: Path) -> None:
    """Median ms per backend, one panel per snapshot and case, batches on x."""
    rows = payload["rows"]
    panels = []
    for kind, case in dict.fromkeys((r["snapshot"], r["case"]) for r in rows):
        mine = [r for r in rows if r["snapshot"] == kind and r["case"] == case]
        series = {b: ([f"batch {r['batch']}" for r in mine if r["backend"] == b],
                      [r["median_ms"] for r in mine if r["backend"] == b]) for b in BACKENDS}
        panels.append(Panel(f"{kind}: {case}", "batch", "ms per call (median)", series, kind="bar"))
    save_plot(path, panels, "AOTInductor package vs TorchScript vs torch.export (CPU)")


if __name__ == "__main__" and not plot_only(plot, "aoti"):
    main()
