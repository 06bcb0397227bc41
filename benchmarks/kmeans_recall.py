"""Recall@100 at equal nprobe of silverrec's IVF index built with different k-means settings, beside
Faiss IVF-SQ8 with its own k-means (same nlist), and the k-means time each costs.

    .venv/bin/python benchmarks/kmeans_recall.py [--n 1000000] [--queries 1000] [--nprobes 16,64,128,256,512]
        [--variants 64:2,256:2] [--no-faiss]

On the noisy long-tailed pool of benchmarks/noisy_pool.py (held-out queries from the same mixture). A
variant `P:R` is publish's two-level k-means (`kmeans`, spherical as publish picks for this unit-norm
pool) trained on P points per cluster with R global refine steps; `flat` is flat Lloyd (256 points per
cluster). Each is laid out as publish lays it out (`cluster_major_layout`, direct codes as
`residual_helps` picks for this pool) and searched with the served op (`Int8IVFIndex.search`, default
re-score margin). Faiss: `index_factory("IVF<nlist>,SQ8", METRIC_INNER_PRODUCT)`, trained on all items.

Writes benchmarks/results/kmeans_recall.json (and .png).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("SILVERREC_QUIET", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Panel, plot_only, replot, save_plot, write_results  # noqa: E402
from noisy_pool import noisy_pool  # noqa: E402
from recall_gap import K, recall, served  # noqa: E402

from silverrec.kernels.rescore_rows import rescore_margin  # noqa: E402
from silverrec.publish.ivf import cluster_major_layout  # noqa: E402
from silverrec.publish.kmeans import default_nlist, kmeans  # noqa: E402
from silverrec.retrieval.filtered_ivf import FilteredIVFIndex  # noqa: E402


def build(x: torch.Tensor, nlist: int, variant: str) -> tuple[FilteredIVFIndex, float]:
    """Index built with k-means variant `P:R` or `flat` -> (index, k-means seconds)."""
    t0 = time.perf_counter()
    if variant == "flat":
        km = kmeans(x, nlist, method="flat", spherical=True)
    else:
        ppc, refine = (int(v) for v in variant.split(":"))
        km = kmeans(x, nlist, method="two_level", spherical=True, max_points_per_centroid=ppc, refine=refine)
    seconds = time.perf_counter() - t0
    ivf = cluster_major_layout(x, torch.arange(x.shape[0]), km.centroids, km.assignment, residual=False)
    return FilteredIVFIndex.from_ivf(ivf, torch.zeros(0, (x.shape[0] + 63) // 64, dtype=torch.int64)), seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--nprobes", default="16,64,128,256,512")
    p.add_argument("--variants", default="64:2,256:2")
    p.add_argument("--no-faiss", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--name", default="kmeans_recall")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    nprobes = [int(v) for v in args.nprobes.split(",")]
    pool = noisy_pool(args.n)
    xn, qn = pool.x, pool.queries(args.queries)
    x, q = torch.from_numpy(xn), torch.from_numpy(qn)
    n = x.shape[0]
    nlist = default_nlist(n)
    truth = torch.cat([torch.topk(q[i : i + 64] @ x.T, K, dim=1).indices for i in range(0, q.shape[0], 64)]).numpy()
    print(f"N={n} nlist={nlist} truth done", flush=True)
    rows = {pr: {"nprobe": pr} for pr in nprobes}
    seconds = {}
    for variant in args.variants.split(","):
        index, seconds[variant] = build(x, nlist, variant)
        sizes = index.cluster_offsets[1:] - index.cluster_offsets[:-1]
        for pr in nprobes:
            found = index.row_to_item.long()[torch.from_numpy(served(index, q, K, pr, rescore_margin(K)))].numpy()
            rows[pr][f"ours_{variant}"] = recall(found, truth)
            rows[pr][f"rows_scanned_ours_{variant}"] = float(sizes[index.probe(q, pr)].sum(1).double().mean())
        print(f"{variant}: k-means {seconds[variant]:.1f} s, recall "
              + " ".join(f"{pr}:{rows[pr][f'ours_{variant}']:.4f}" for pr in nprobes), flush=True)
        del index
    if not args.no_faiss:
        import faiss

        faiss.omp_set_num_threads(args.threads)
        own = faiss.index_factory(x.shape[1], f"IVF{nlist},SQ8", faiss.METRIC_INNER_PRODUCT)
        t0 = time.perf_counter()
        own.train(xn)
        seconds["faiss_sq8"] = time.perf_counter() - t0
        own.add(xn)
        for pr in nprobes:
            own.nprobe = pr
            rows[pr]["faiss_sq8"] = recall(own.search(qn, K)[1], truth)
        print(f"faiss: train {seconds['faiss_sq8']:.1f} s, recall "
              + " ".join(f"{pr}:{rows[pr]['faiss_sq8']:.4f}" for pr in nprobes), flush=True)
    write_results(args.name, vars(args) | {"nlist": nlist, "kmeans_seconds": seconds}, list(rows.values()))
    replot(args.name, plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """recall@100 by nprobe for each k-means variant and Faiss IVF-SQ8's own."""
    rows, cfg = payload["rows"], payload["config"]
    p = [r["nprobe"] for r in rows]
    secs = cfg["kmeans_seconds"]
    series = {}
    for key in rows[0]:
        if key.startswith("ours_") or key == "faiss_sq8":
            v = key[5:] if key.startswith("ours_") else None
            label = (f"Faiss IVF-SQ8, own k-means ({secs.get('faiss_sq8', 0):.0f} s)" if v is None else
                     f"silverrec, {'flat' if v == 'flat' else v.split(':')[0] + ' pts/cluster, refine ' + v.split(':')[1]}"
                     f" ({secs[v]:.0f} s)")
            series[label] = (p, [r[key] for r in rows])
    panels = [Panel(f"noisy pool {cfg['n']:,} x 96, nlist {cfg['nlist']}: recall@100 by nprobe", "nprobe",
                    "recall@100", series, logx=True)]
    if "faiss_sq8" in rows[0]:
        faiss = [r["faiss_sq8"] for r in rows]
        gap = {label: (xs, [a - b for a, b in zip(ys, faiss)]) for label, (xs, ys) in series.items()
               if not label.startswith("Faiss")}
        gap["target: -0.005"] = (p, [-0.005] * len(p))
        panels.append(Panel("recall@100 minus Faiss IVF-SQ8's at equal nprobe", "nprobe", "difference", gap, logx=True))
    save_plot(path, panels, "k-means settings against Faiss IVF-SQ8")


if __name__ == "__main__" and not plot_only(plot, "kmeans_recall"):
    raise SystemExit(main())
