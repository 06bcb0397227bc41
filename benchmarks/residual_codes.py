"""Where the unfiltered recall plateau against Faiss IVF-SQ8 comes from: direct vs residual int8 codes.

    .venv/bin/python benchmarks/residual_codes.py [--n 1000000] [--queries 512]

On benchmarks/ann.py's 1M x 128 Gaussian mixture (its k-means, its queries), the IVF top-100 of
every query at nprobe 8 and 16, scored exactly (float queries, no scan kernel) against four item
representations: silverrec's codes (per-dimension int8 ranges over the items, `quantize_per_dim`),
the same codes scored with silverrec's int8 query (`quantize_queries`: what the scan computes),
residual codes (per-dimension int8 ranges over item - its centroid, as Faiss's
IndexIVFScalarQuantizer encodes by default: `by_residual`), and the float items. Recall@100 against
float brute force. Writes benchmarks/results/residual_codes.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ann import gmm  # noqa: E402
from common import Panel, plot_only, replot, save_plot, write_results  # noqa: E402

from silverrec.kernels.common import quantize_queries  # noqa: E402
from silverrec.publish.kmeans import default_nlist, kmeans  # noqa: E402
from silverrec.publish.quantize import quantize_per_dim  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=512)
    args = p.parse_args()
    torch.set_num_threads(2)
    n, d, Q = args.n, 128, args.queries
    x, q = gmm(n, d, max(10, n // 1000), Q)  # benchmarks/ann.py's data (seed 0)
    km = kmeans(x, default_nlist(n), niter=6, seed=0, max_points_per_centroid=32, seed_points_per_centroid=8)
    assign, cent = km.assignment.long(), km.centroids
    truth = torch.cat([torch.topk(q[i:i + 64] @ x.t(), 100, dim=1).indices for i in range(0, Q, 64)]).numpy()
    codes, scale, offset = quantize_per_dim(x)
    rcodes, rscale, roffset = quantize_per_dim(x - cent[assign])
    qc, qs = quantize_queries((q * scale).contiguous())
    reps = {"direct int8 codes (silverrec), float query": lambda b, rows: (codes[rows].float() * scale + offset) @ q[b],
            "direct int8 codes, int8 query (the scan)": lambda b, rows: (codes[rows].float() @ qc[b].float()) * qs[b] + q[b] @ offset,
            "residual int8 codes (Faiss IVF-SQ8's by_residual), float query":
                lambda b, rows: (cent[assign[rows]] + rcodes[rows].float() * rscale + roffset) @ q[b],
            "float items": lambda b, rows: x[rows] @ q[b]}
    order = torch.argsort(assign)
    starts = torch.searchsorted(assign[order], torch.arange(cent.shape[0] + 1))
    rows_out = [{"range_width_mean": {"direct": float((scale * 255).mean()), "residual": float((rscale * 255).mean())}}]
    for nprobe in (8, 16):
        probes = torch.topk(q @ cent.t(), nprobe, dim=1).indices
        cands = [torch.cat([order[starts[c]:starts[c + 1]] for c in probes[b].tolist()]) for b in range(Q)]
        row = {"nprobe": nprobe}
        for name, score in reps.items():
            found = [c[torch.topk(score(b, c), min(100, c.numel())).indices].numpy() for b, c in enumerate(cands)]
            row[name] = round(float(np.mean([np.intersect1d(f, t).size / 100 for f, t in zip(found, truth)])), 5)
        rows_out.append(row)
        print(row, flush=True)
    replot(write_results("residual_codes", vars(args), rows_out).stem, plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """Recall@100 of the IVF top-100 per item representation, at each nprobe."""
    rows = [r for r in payload["rows"] if "nprobe" in r]
    reps = [k for k in rows[0] if k != "nprobe"]
    save_plot(path, [Panel("recall@100 against float brute force", "nprobe", "recall@100",
                           {rep: ([f"nprobe {r['nprobe']}" for r in rows], [r[rep] for r in rows]) for rep in reps}, kind="bar")],
              f"direct vs residual int8 codes, {payload['config']['n']:,} x 128 Gaussian mixture")


if __name__ == "__main__" and not plot_only(plot, "residual_codes"):
    raise SystemExit(main())
