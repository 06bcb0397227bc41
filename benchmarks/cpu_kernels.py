"""CPU scan kernels (kernels/csrc/dot.h) against Faiss 8-bit peers, in one process.

    exact    the exact index (one cluster: silverrec::ivf_search)   vs faiss IndexScalarQuantizer SQ8 (flat)
    ivf      centroid top-nprobe + torch.ops.silverrec.ivf_scan   vs faiss IndexIVFScalarQuantizer SQ8
             (same centroids, same nprobe, no residual encoding on either side)

1M x 96 items (a Gaussian mixture), k 100, batch 1 and 16, the same number of threads on both
sides. Sides alternate call by call (A B, then B A, ...) so the load of a shared machine falls on
both alike; the load average is recorded with every run. `--ext PATH` loads another build of the
extension (e.g. the previous one, for a before / after on the same data); `--tag` names the run,
and rows of other tags already in the results file are kept. `ours_ids_sha1` hashes silverrec's
answer: equal across builds means bit-identical results.

    .venv/bin/python benchmarks/cpu_kernels.py [--n 1000000] [--ext PATH --tag before] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Panel, alternate, machine_info, plot_only, print_table, replot, save_plot  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=96)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--nprobe", type=int, default=32)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--ext", default=None, help="path of another build of libsilverrec_ops.so")
    p.add_argument("--tag", default="current")
    p.add_argument("--quick", action="store_true", help="100k items, 3 reps")
    args = p.parse_args()
    if args.quick:
        args.n, args.reps = 100_000, 3
    if args.ext:  # kernels/library.py loads this build instead of the package's
        os.environ["SILVERREC_OPS_PATH"] = args.ext
    import faiss
    from exact_topk import exact_index, gaussian_mixture

    import silverrec.kernels  # noqa: F401  (loads the operator library)
    from silverrec.publish.quantize import quantize_global

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    load_before = os.getloadavg()

    x = gaussian_mixture(args.n, args.d, 1000, seed=0)
    xt = torch.from_numpy(x)
    codes, scale, offset = quantize_global(xt)
    exact = exact_index(codes, scale, offset)
    sq8 = faiss.IndexScalarQuantizer(args.d, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    sq8.train(x)
    sq8.add(x)
    # IVF: faiss k-means centroids shared by both sides; silverrec's codes sorted by cluster
    coarse = faiss.IndexFlatIP(args.d)
    ivf = faiss.IndexIVFScalarQuantizer(coarse, args.d, args.nlist, faiss.ScalarQuantizer.QT_8bit,
                                        faiss.METRIC_INNER_PRODUCT, False)
    ivf.train(x)
    ivf.add(x)
    ivf.nprobe = args.nprobe
    centroids = torch.from_numpy(coarse.reconstruct_n(0, args.nlist))
    _, assign = coarse.search(x, 1)
    order = torch.from_numpy(np.argsort(assign[:, 0], kind="stable"))
    ivf_codes = codes[order].contiguous()
    counts = torch.bincount(torch.from_numpy(assign[:, 0]), minlength=args.nlist)
    cluster_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])

    rows = []
    for b in [int(v) for v in args.batches.split(",")]:
        q = gaussian_mixture(b, args.d, 1000, seed=1)
        qt = torch.from_numpy(q)

        def ours_exact():
            return exact(qt, args.k, 1)

        def faiss_exact():
            return sq8.search(q, args.k)

        def ours_ivf():
            probes = (qt @ centroids.T).topk(args.nprobe, dim=1).indices
            return torch.ops.silverrec.ivf_scan(qt, ivf_codes, scale, offset, cluster_offsets, probes, args.k)

        def faiss_ivf():
            return ivf.search(q, args.k)

        for workload, ours, theirs, peer in (("exact", ours_exact, faiss_exact, "faiss_sq8_flat"),
                                             ("ivf", ours_ivf, faiss_ivf, "faiss_ivf_sq8")):
            ids = ours()[1].numpy()
            ref = theirs()[1]
            overlap = float(np.mean([len(set(a) & set(bb)) / args.k for a, bb in zip(ids, ref)])) if workload == "exact" else None
            t = dict(zip(("silverrec", peer), alternate([ours, theirs], args.reps)))
            rows.append({
                "tag": args.tag, "threads": args.threads, "workload": workload, "batch": b, "ours_ms": t["silverrec"]["median_ms"],
                "ours_p20_ms": t["silverrec"]["p20_ms"], "ours_p80_ms": t["silverrec"]["p80_ms"],
                "peer": peer, "peer_ms": t[peer]["median_ms"], "peer_p20_ms": t[peer]["p20_ms"],
                "peer_p80_ms": t[peer]["p80_ms"], "peer_over_ours": t[peer]["median_ms"] / t["silverrec"]["median_ms"],
                "top_k_overlap_with_peer": overlap,
                "ours_ids_sha1": hashlib.sha1(ids.tobytes()).hexdigest()[:12],
            })
            print(rows[-1], flush=True)
    load_after = os.getloadavg()
    for r in rows:
        r["loadavg_1m_before_after"] = [round(load_before[0], 2), round(load_after[0], 2)]
    print(f"\n{args.tag}: {args.n:,} x {args.d}, k {args.k}, nprobe {args.nprobe}/{args.nlist}, {args.threads} threads, "
          f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} (peer_over_ours > 1: silverrec faster)")
    print_table(rows, ["workload", "batch", "ours_ms", "ours_p20_ms", "ours_p80_ms", "peer", "peer_ms", "peer_over_ours"])

    name = "cpu_kernels" + ("_quick" if args.quick else "")
    path = RESULTS / f"{name}.json"
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    config = {k: v for k, v in vars(args).items() if k not in ("ext", "tag", "threads")}  # threads: per row
    payload = {"benchmark": name, "machine": machine_info() | {"cpu_flags_avx512": "avx512f" in open("/proc/cpuinfo").read()},
               "config": config, "rows": [r for r in old if r.get("tag") != args.tag] + rows}
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    replot(name, plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """Per build (tag): the Faiss peer's latency over silverrec's for each workload and batch (> 1: silverrec faster)."""
    rows = payload["rows"]
    series = {}
    for workload, batch in dict.fromkeys((r["workload"], r["batch"]) for r in rows):
        mine = [r for r in rows if r["workload"] == workload and r["batch"] == batch]
        series[f"{workload}, batch {batch}"] = ([f"{r['tag']} ({r['threads']} thr)" for r in mine], [r["peer_over_ours"] for r in mine])
    c = payload["config"]
    save_plot(path, [Panel("Faiss SQ8 time / silverrec time (> 1: silverrec faster)", "build", "peer / silverrec",
                           series, kind="barh", ref=1.0)],
              f"CPU scan kernels vs Faiss SQ8, {c['n']:,} x {c['d']}, k {c['k']}, ivf nprobe {c['nprobe']}/{c['nlist']}",
              height=6, width=8)


if __name__ == "__main__" and not plot_only(plot, "cpu_kernels"):
    sys.exit(main())
