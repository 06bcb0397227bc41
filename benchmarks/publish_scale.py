"""Publishing at catalogue scale: time and peak memory per stage of `silverrec publish`, and the
IVF recall of the two-level k-means against flat ("today's full") k-means at equal nprobe (and the
rows scanned at each nprobe, to compare at equal work).

    python benchmarks/publish_scale.py --n 1000000 --compare-flat     # recall: two-level vs flat
    python benchmarks/publish_scale.py --n 10000000                   # the 10M x 96 target (heavy)

Data: a Gaussian mixture (4096 components, unit noise) of --n x --dim float32, written to Parquet
in row groups; queries are 200 fresh draws; ground truth by float64 brute force inner product.
The publish runs as the CLI in a child process; its peak RSS is the child's ru_maxrss, its stages
come from the manifest's build_report.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Panel, machine_info, plot_only, replot, save_plot, write_results  # noqa: E402

COMPONENTS = 4096


def mixture(n: int, dim: int, seed: int = 0, start: int = 0, shift: float = 0.0):
    """Rows start..start+n of the mixture (deterministic per row block), float32 [n, dim]."""
    g = np.random.default_rng(1234)
    centers = (g.standard_normal((COMPONENTS, dim)) * 1.5).astype(np.float32)
    r = np.random.default_rng([seed, start])
    comp = r.integers(0, COMPONENTS, n)
    return centers[comp] + r.standard_normal((n, dim)).astype(np.float32) + np.float32(shift)


def write_mixture(path: Path, n: int, dim: int, block: int = 1 << 19) -> None:
    writer = None
    for start in range(0, n, block):
        m = min(block, n - start)
        x = mixture(m, dim, start=start)
        t = pa.table({"item_id": pa.array(np.arange(start, start + m, dtype=np.int64)),
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), dim)})
        writer = writer or pq.ParquetWriter(path, t.schema)
        writer.write_table(t, row_group_size=1 << 17)
    writer.close()


def queries(dim: int, nq: int = 200) -> np.ndarray:
    return mixture(nq, dim, seed=99)


def truth(x: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    out = np.empty((q.shape[0], k), dtype=np.int64)
    for s in range(0, q.shape[0], 50):
        sc = torch.from_numpy(q[s : s + 50]).double() @ torch.from_numpy(x).double().t() if x.shape[0] <= 2_000_000 else \
            torch.from_numpy(q[s : s + 50]) @ torch.from_numpy(x).t()
        out[s : s + 50] = torch.topk(sc, k, dim=1).indices.numpy()
    return out


def recall(found: np.ndarray, want: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(w)) / len(w) for f, w in zip(found.tolist(), want.tolist())]))


def compare_flat(x: np.ndarray, q: np.ndarray, gt: np.ndarray, nprobes, k: int = 100) -> list[dict]:
    """Recall@k of IVF built with two-level vs flat k-means, same nlist, seed and layout, at equal
    nprobe; with the rows each query scanned (the sizes of its probed clusters) and the cluster-size
    imbalance, so that recall can also be read at equal scanned rows."""
    from silverrec.publish.ivf import cluster_major_layout
    from silverrec.publish.kmeans import default_nlist, kmeans

    xt = torch.from_numpy(x)
    nlist = default_nlist(len(x))
    rows = []
    for method in ("two_level", "flat"):
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        km = kmeans(xt, nlist, seed=0, method=method)
        secs = time.perf_counter() - t0
        index = cluster_major_layout(xt, torch.arange(len(x)), km.centroids, km.assignment).eval()
        sizes = torch.bincount(km.assignment, minlength=nlist)
        imbalance = float(nlist * (sizes.double() ** 2).sum() / len(x) ** 2)
        probe_order = (torch.from_numpy(q) @ km.centroids.t()).argsort(dim=1, descending=True)
        for p in nprobes:
            with torch.no_grad():
                _, ids = index(torch.from_numpy(q), k, p)
            rows.append({"method": method, "kmeans_seconds": round(secs, 1), "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
                         "nprobe": p, "recall@100": recall(ids.numpy(), gt),
                         "scanned_rows": float(sizes[probe_order[:, :p]].sum(1).double().mean()),
                         "imbalance": round(imbalance, 4), "objective": km.stats[-1].objective})
            print(rows[-1], flush=True)
    return rows


def run_polling_rss(cmd: list[str], env: dict, every: float = 0.1) -> int:
    """Run `cmd`, polling its resident set (VmRSS) every `every` s -> the largest seen, in bytes."""
    proc = subprocess.Popen(cmd, env=env)
    peak = 0
    while proc.poll() is None:
        try:
            rss = next(line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))
            peak = max(peak, int(rss.split()[1]) * 1024)
        except (OSError, StopIteration):
            pass
        time.sleep(every)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return peak


def _read_x(pool: Path, n: int, dim: int) -> np.ndarray:
    return pq.read_table(pool).column("embedding").combine_chunks().flatten().to_numpy().reshape(n, dim)


def compare_only(args, pool: Path) -> None:
    x = _read_x(pool, args.n, args.dim)
    q = queries(args.dim)
    rows = compare_flat(x, q, truth(x, q, 100), args.nprobe)
    replot(write_results(f"publish_scale.recall_{args.n // 1000}k", vars(args), rows).stem, plot)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--work", default="/tmp/silverrec_scale")
    ap.add_argument("--compare-flat", action="store_true")
    ap.add_argument("--compare-only", action="store_true", help="only the k-means recall comparison (no CLI publish)")
    ap.add_argument("--nprobe", type=int, nargs="+", default=[16, 32, 64])
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    pool = work / f"pool_{args.n}x{args.dim}.parquet"
    if not pool.exists():
        t0 = time.perf_counter()
        write_mixture(pool, args.n, args.dim)
        print(f"wrote {pool} in {time.perf_counter() - t0:.0f}s", flush=True)
    out = work / f"snap_{args.n}"
    if args.compare_only:
        return compare_only(args, pool)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    polled = run_polling_rss([sys.executable, "-m", "silverrec", "publish", "--pool", str(pool), "--out", str(out)],
                             env=dict(os.environ, SILVERREC_QUIET="1"))
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    manifest = json.loads((out / "manifest.json").read_text())
    report = manifest["config"]["build_report"]
    # the stages' VmHWM resets also reset ru_maxrss, so the whole run's peak is the larger of the
    # polled RSS (which covers the pool read, before the first stage) and the per-stage peaks
    peak = max(polled, report["peak_rss_bytes"])
    float_bytes = args.n * args.dim * 4
    result = {"n": args.n, "dim": args.dim, "nlist": manifest["config"]["nlist"], "publish_wall_s": round(wall, 1),
              "publish_cpu_s": round(usage.ru_utime + usage.ru_stime, 1),  # both cores busy: wall >= cpu / 2
              "peak_rss_bytes": peak, "peak_over_float32_pool": round(peak / float_bytes, 3), "polled_peak_rss_bytes": polled,
              "load_avg_before": [round(v, 2) for v in load_before], "load_avg_after": [round(v, 2) for v in os.getloadavg()],
              "stages": report["stages"], "snapshot_files": {k: v["bytes"] for k, v in manifest["files"].items()}}
    print(json.dumps(result, indent=1), flush=True)
    rows = [result]
    if args.compare_flat:
        x = _read_x(pool, args.n, args.dim)
        q = queries(args.dim)
        gt = truth(x, q, 100)
        import silverrec

        snap = silverrec.load(out)
        for p in args.nprobe:
            res = snap.search(torch.from_numpy(q), 100, nprobe=p)
            rows.append({"method": "published (two_level)", "nprobe": p, "recall@100": recall(res.item_ids.numpy(), gt)})
        rows += compare_flat(x, q, gt, args.nprobe)
    name = "publish_scale" if args.n >= 10_000_000 else f"publish_scale.{args.n // 1000}k"
    replot(write_results(name, vars(args), rows).stem, plot)


def plot(payload: dict, path: Path) -> None:
    """The publish's seconds per stage (when the run published) and recall@100 against nprobe per
    k-means method (when it compared them)."""
    rows, panels = payload["rows"], []
    for r in (r for r in rows if "stages" in r):
        stages = [s for s in r["stages"] if s["seconds"] >= 0.5]
        panels.append(Panel(f"publish of {r['n']:,} x {r['dim']}: {r['publish_wall_s']:.0f} s wall, peak RSS "
                            f"{r['peak_rss_bytes'] / 2**30:.2f} GiB = {r['peak_over_float32_pool']:.2f}x the float32 pool",
                            "stage", "seconds", {"seconds": ([s["name"][:60] for s in stages], [s["seconds"] for s in stages])},
                            kind="barh"))
    methods = dict.fromkeys(r["method"] for r in rows if "method" in r)
    if methods:
        panels.append(Panel(f"IVF recall@100 by k-means method, {payload['config']['n']:,} x {payload['config']['dim']}",
                            "nprobe", "recall@100", {m: ([r["nprobe"] for r in rows if r.get("method") == m],
                                                         [r["recall@100"] for r in rows if r.get("method") == m]) for m in methods},
                            logx=True))
    save_plot(path, panels, "publishing at catalogue scale")


if __name__ == "__main__" and not plot_only(plot, "publish_scale"):
    main()
