"""Incremental updates (`silverrec update`) against full publishes, on a 1M x 96 IVF pool.

    python benchmarks/update.py            # 1M items; --n for another size
    python benchmarks/update.py --compare-flat   # + flat vs two-level k-means on the final pool (slow)
    python benchmarks/update.py --drift 0 --name update_drift0   # updates from the pool's own distribution

1. Update time for 0.1%, 1% and 10% of the pool (half changed embeddings, a quarter new items, a
   quarter deleted), each applied to the same parent, against a full publish of the same pool.
2. Ten successive 1% updates whose new embeddings drift (a shift of +--drift per step on every
   dimension, default 0.3, so values leave the parent's ranges): recall@100 after each against brute force, and
   after the tenth against a full rebuild of the final pool at the same nprobe; the drift signals
   and where they advise a rebuild. On the final pool, both the updated snapshot and the rebuild at
   nprobe 8..128: recall@100, rows scanned per query (to compare at equal work) and recall on the
   drifted vs the other true neighbours. --compare-flat: the final pool's IVF built with flat and with
   two-level k-means (publish_scale.compare_flat: recall at equal nprobe, rows scanned, imbalance).
Writes benchmarks/results/update.json and update.png (--name NAME: NAME.json and NAME.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("SILVERREC_QUIET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Panel, plot_only, replot, save_plot, write_results  # noqa: E402
from publish_scale import compare_flat, mixture, queries, recall, truth  # noqa: E402

import silverrec  # noqa: E402
from silverrec.publish.filtered_ivf import publish_index  # noqa: E402
from silverrec.publish.pool import Pool  # noqa: E402
from silverrec.publish.update import update_snapshot  # noqa: E402
from silverrec.snapshot import read_tensors  # noqa: E402


def delta(rng, ids: np.ndarray, frac: float, dim: int, next_id: int, step: int, shift: float):
    m = max(4, int(round(frac * ids.size)))
    pick = rng.choice(ids.size, m // 2 + m // 4, replace=False)
    changed, deleted = ids[pick[: m // 2]], ids[pick[m // 2 :]]
    new = np.arange(next_id, next_id + m // 4, dtype=np.int64)
    up_ids = np.concatenate([changed, new])
    up_x = mixture(up_ids.size, dim, seed=1000 + step, shift=shift)
    return Pool(up_ids, up_x), deleted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--work", default="/tmp/silverrec_update")
    ap.add_argument("--nprobe", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--drift", type=float, default=0.3, help="shift of the upserted embeddings per step")
    ap.add_argument("--compare-flat", action="store_true", help="also flat vs two-level k-means on the final pool")
    ap.add_argument("--name", default="update", help="results name (benchmarks/results/NAME.json and NAME.png)")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rng = np.random.default_rng(0)
    x = mixture(args.n, args.dim)
    ids = np.arange(args.n, dtype=np.int64)
    rows = []

    t0 = time.perf_counter()
    v0 = publish_index(Pool(ids, x), work / "v0")
    full_s = time.perf_counter() - t0
    rows.append({"what": "full publish", "fraction": 1.0, "seconds": round(full_s, 2), "load_avg": [round(v, 2) for v in os.getloadavg()]})
    print(rows[-1], flush=True)
    for frac in (0.001, 0.01, 0.1):
        up, deleted = delta(rng, ids, frac, args.dim, args.n, 0, 0.0)
        t0 = time.perf_counter()
        out = update_snapshot(v0, work / f"u{frac}", upsert=up, delete=deleted)
        secs = time.perf_counter() - t0
        stages = json.loads((out / "manifest.json").read_text())["config"]["update"]["timings"]["stages"]
        rows.append({"what": "update", "fraction": frac, "seconds": round(secs, 2), "speedup_vs_full": round(full_s / secs, 1),
                     "stages": {s["name"]: s["seconds"] for s in stages}})
        print(rows[-1], flush=True)
        shutil.rmtree(out)

    # ten successive drifting 1% updates
    q = queries(args.dim)
    cur_ids, cur_x, cur_drifted = ids.copy(), x, np.zeros(args.n, dtype=bool)
    parent, next_id = v0, args.n
    for step in range(1, args.steps + 1):
        up, deleted = delta(rng, cur_ids, 0.01, args.dim, next_id, step, args.drift * step)
        next_id += up.size
        t0 = time.perf_counter()
        out = update_snapshot(parent, work / f"s{step}", upsert=up, delete=deleted)
        secs = time.perf_counter() - t0
        keep = ~np.isin(cur_ids, np.concatenate([up.item_ids, deleted]))
        cur_ids = np.concatenate([cur_ids[keep], up.item_ids])
        cur_x = np.concatenate([cur_x[keep], up.embeddings])
        cur_drifted = np.concatenate([cur_drifted[keep], np.full(up.size, args.drift > 0)])
        snap = silverrec.load(out)
        gt = cur_ids[truth(cur_x, q, 100)]
        r = recall(snap.search(torch.from_numpy(q), 100, nprobe=args.nprobe).item_ids.numpy(), gt)
        up_cfg = snap.config["update"]
        rows.append({"what": "successive 1% update", "step": step, "seconds": round(secs, 2), "recall@100": r,
                     "drift": up_cfg["drift"], "rebuild_advised": up_cfg["rebuild_advised"]})
        print({k: v for k, v in rows[-1].items() if k != "drift"}, flush=True)
        if parent != v0:
            shutil.rmtree(parent)
        parent = out
    t0 = time.perf_counter()
    rebuilt = publish_index(Pool(cur_ids, cur_x), work / "rebuilt")
    rebuild_s = time.perf_counter() - t0
    gt = cur_ids[truth(cur_x, q, 100)]
    r_full = recall(silverrec.load(rebuilt).search(torch.from_numpy(q), 100, nprobe=args.nprobe).item_ids.numpy(), gt)
    rows.append({"what": "full rebuild after the updates", "seconds": round(rebuild_s, 2), "recall@100": r_full,
                 "nprobe": args.nprobe, "gap_after_updates": round(r_full - rows[-1]["recall@100"], 4),
                 "load_avg": [round(v, 2) for v in os.getloadavg()]})
    print(rows[-1], flush=True)
    gt_rows = truth(cur_x, q, 100)
    for what, path in (("after the updates", parent), ("full rebuild", rebuilt)):
        rows += [{"what": f"final pool: {what}"} | r for r in recall_by_nprobe(path, q, cur_ids, gt_rows, cur_drifted, [8, 16, 32, 64, 128])]
        for r in rows[-5:]:
            print(r, flush=True)
    if args.compare_flat:
        rows += [{"what": "final pool, k-means method"} | r for r in compare_flat(cur_x, q, truth(cur_x, q, 100), [16, 32, 64])]
    replot(write_results(args.name, vars(args), rows).stem, plot)


def recall_by_nprobe(path: Path, q: np.ndarray, ids: np.ndarray, gt_rows: np.ndarray, drifted: np.ndarray, nprobes) -> list[dict]:
    """Recall@100 of snapshot `path` at each nprobe, with the rows a query scans there (the sizes of
    its probed clusters: recall can be read at equal work), and recall on the ground-truth
    neighbours that are drifted (upserted with a shift) and on the others.
    gt_rows int64 [Q, 100]: rows of `ids` / `drifted` (bool [N]) that are each query's true top 100."""
    snap = silverrec.load(path)
    t = read_tensors(Path(path), snap.manifest)
    centroids, off = t["sources.index.centroids"], t["sources.index.cluster_offsets"]
    sizes = (off[1:] - off[:-1]).double()
    order = (torch.from_numpy(q) @ centroids.t()).argsort(dim=1, descending=True)
    gt_ids, gt_drift = ids[gt_rows], drifted[gt_rows]
    out = []
    for p in nprobes:
        found = snap.search(torch.from_numpy(q), 100, nprobe=p).item_ids.numpy()
        hit = np.array([np.isin(g, f) for g, f in zip(gt_ids, found)])
        out.append({"nprobe": p, "recall@100": round(float(hit.mean()), 4), "scanned_rows": round(float(sizes[order[:, :p]].sum(1).mean()), 1),
                    "recall_on_drifted_neighbours": round(float(hit[gt_drift].mean()), 4) if gt_drift.any() else None,
                    "recall_on_other_neighbours": round(float(hit[~gt_drift].mean()), 4), "drifted_share_of_neighbours": round(float(gt_drift.mean()), 4)})
    return out


def plot(payload: dict, path: Path) -> None:
    """Seconds of each update against a full publish; recall@100 after each successive update against a
    full rebuild; the final pool's recall against the rows scanned, updated vs rebuilt."""
    rows = payload["rows"]
    ups = [r for r in rows if r["what"] == "update"]
    full = next(r for r in rows if r["what"] == "full publish")
    cats = ["full publish"] + [f"update {r['fraction']:.1%}" for r in ups]
    panels = [Panel(f"{payload['config']['n']:,} x {payload['config']['dim']} IVF: update vs full publish", "what", "seconds",
                    {"seconds": (cats, [full["seconds"]] + [r["seconds"] for r in ups])}, kind="bar")]
    steps = [r for r in rows if r["what"] == "successive 1% update"]
    rebuild = next((r for r in rows if r["what"] == "full rebuild after the updates"), None)
    if steps and rebuild:
        panels.append(Panel(f"recall@100 at nprobe {rebuild['nprobe']} after k successive 1% updates (drift "
                            f"{payload['config'].get('drift')})", "update step", "recall@100",
                            {"after k updates": ([r["step"] for r in steps], [r["recall@100"] for r in steps])},
                            ref=rebuild["recall@100"], ref_label="full rebuild of the final pool"))
    final = {what: [r for r in rows if r["what"] == f"final pool: {what}"] for what in ("after the updates", "full rebuild")}
    if all(final.values()):
        panels.append(Panel("final pool: recall@100 vs rows scanned per query", "rows scanned (mean)", "recall@100",
                            {w: ([r["scanned_rows"] for r in v], [r["recall@100"] for r in v]) for w, v in final.items()},
                            logx=True))
    save_plot(path, panels, "incremental updates: silverrec update vs a full publish")


if __name__ == "__main__" and not plot_only(plot, "update"):
    main()
