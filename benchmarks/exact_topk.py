"""Exact top-k: silverrec's int8 exact index (the IVF with one cluster, as a snapshot with nlist 1 serves it:
`silverrec::ivf_search`) vs faiss IndexScalarQuantizer SQ8 (the like-for-like 8-bit flat peer) vs
faiss.IndexFlatIP (float) vs torch.topk(q @ x.T).

Same items, same queries, one process. 1M x 128 items (a Gaussian mixture, so neighbourhoods are
not uniform noise), batch 16, k in {100, 1024, 10000}. The systems are timed in alternation,
call by call (A B C D, then D C B A, ...), the same number of calls each, so the load of this
shared machine falls on all alike. Reports median latency per batch (p20/p80),
the ratio of each reference to silverrec (> 1 means silverrec is faster), recall@k of the int8
answer against the float answer, and memory of each index.

    .venv/bin/python benchmarks/exact_topk.py [--n 1000000] [--quick]
    python3 benchmarks/exact_topk.py --device cuda [--quick]     # on a GPU: results/exact_topk_cuda.json

--device cuda: silverrec's exact index on CUDA tensors (the ivf_scan Triton kernel) vs Faiss GPU flat
(GpuIndexFlatIP, k <= 2048) when faiss has GPU support, else torch.topk(q @ x.T) on the GPU as the
floor; CUDA-event times alternated call by call; recall@k of the int8 answer against the float one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Panel, alternate, plot_only, print_table, replot, save_plot, write_results  # noqa: E402
from cuda_common import attempt, cuda_alternate, cuda_info, faiss_gpu, require_device  # noqa: E402

import silverrec.kernels  # noqa: E402,F401  (registers torch.ops.silverrec.*)
from silverrec.publish.quantize import quantize_global  # noqa: E402
from silverrec.retrieval.ivf_index import Int8IVFIndex  # noqa: E402


def gaussian_mixture(n: int, d: int, clusters: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((clusters, d)).astype(np.float32)
    labels = rng.integers(0, clusters, n)
    return centers[labels] + 0.5 * rng.standard_normal((n, d)).astype(np.float32)


def exact_index(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Int8IVFIndex:
    """The exact index over int8 codes [N, D] (item ~= scale * code + offset): one cluster, which every query
    probes (k results of `index(q, k, 1)` are the exact int8 top k)."""
    n, d = codes.shape
    return Int8IVFIndex(codes.cpu(), scale.cpu(), offset.cpu(), torch.tensor([0, n]), torch.zeros(1, d), torch.arange(n))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ks", default="100,1024,10000")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--quick", action="store_true", help="100k items, fewer repeats")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = p.parse_args()
    if args.quick:
        args.n = 100_000
    if args.device != "cpu":
        return run_cuda(args, require_device(args.device))
    import faiss

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    x = gaussian_mixture(args.n, args.d, 1000, seed=0)
    q = gaussian_mixture(args.batch, args.d, 1000, seed=1)
    xt, qt = torch.from_numpy(x), torch.from_numpy(q)
    codes, scale, offset = quantize_global(xt)
    index = exact_index(codes, scale, offset)
    flat = faiss.IndexFlatIP(args.d)
    flat.add(x)
    sq8 = faiss.IndexScalarQuantizer(args.d, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    sq8.train(x)
    sq8.add(x)

    rows = []
    for k in [int(v) for v in args.ks.split(",")]:
        def ours():
            return index(qt, k, 1)

        def faiss_flat():
            return flat.search(q, k)

        def torch_topk():
            return torch.topk(qt @ xt.T, k, dim=1)

        _, ours_rows = ours()
        _, faiss_ids = faiss_flat()
        recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(ours_rows.numpy(), faiss_ids)])
        def faiss_sq8():
            return sq8.search(q, k)

        sides = {"silverrec_int8": ours, "faiss_sq8_flat": faiss_sq8, "faiss_flat_ip": faiss_flat, "torch_topk_float": torch_topk}
        timings = dict(zip(sides, alternate(list(sides.values()), 3 if args.quick else 7)))
        base = timings["silverrec_int8"]["median_ms"]
        for name, t in timings.items():
            rows.append({
                "k": k, "system": name, "median_ms": t["median_ms"], "p20_ms": t["p20_ms"], "p80_ms": t["p80_ms"],
                "ratio_vs_silverrec": t["median_ms"] / base,
                "recall_vs_float": recall if name == "silverrec_int8" else 1.0,
            })
    memory = {"silverrec_int8_bytes": codes.numel(), "faiss_sq8_bytes": int(sq8.sa_code_size()) * args.n,
              "faiss_flat_bytes": x.nbytes, "torch_float_bytes": x.nbytes}
    print(f"\nexact top-k, {args.n:,} x {args.d} items, batch {args.batch}, {args.threads} threads "
          f"(ratio = system latency / silverrec latency; > 1: silverrec faster)")
    print_table(rows, ["k", "system", "median_ms", "p20_ms", "p80_ms", "ratio_vs_silverrec", "recall_vs_float"])
    print(f"memory: int8 codes {memory['silverrec_int8_bytes'] / 2**20:.0f} MiB, "
          f"float {memory['faiss_flat_bytes'] / 2**20:.0f} MiB")
    replot(write_results("exact_topk" + ("_quick" if args.quick else ""), vars(args) | memory, rows).stem, plot)
    return 0


def run_cuda(args, dev: torch.device) -> int:
    """The --device cuda benchmark (module docstring); writes exact_topk_cuda[_quick].json."""
    x = gaussian_mixture(args.n, args.d, 1000, seed=0)
    q = gaussian_mixture(args.batch, args.d, 1000, seed=1)
    xt, qt = torch.from_numpy(x).to(dev), torch.from_numpy(q).to(dev)
    codes, scale, offset = quantize_global(xt)
    index = exact_index(codes, scale, offset).to(dev)
    fg = faiss_gpu()
    if fg is not None:
        res = fg.StandardGpuResources()
        flat = fg.GpuIndexFlatIP(res, args.d)
        flat.add(x)
    rows = []
    for k in [int(v) for v in args.ks.split(",")]:
        sides = {"silverrec_int8": lambda: index(qt, k, 1),
                 "torch_topk_float": lambda: torch.topk(qt @ xt.T, k, dim=1)}
        if fg is not None and k <= 2048:  # Faiss GPU's k-selection limit
            sides["faiss_gpu_flat_ip"] = lambda: flat.search(q, k)
        found, error = attempt(lambda: sides["silverrec_int8"]()[1].cpu().numpy())
        if error:
            rows.append({"k": k, "system": "silverrec_int8", "error": error})
            print(f"k={k}: silverrec failed: {error}")
            continue
        truth = sides["torch_topk_float"]().indices.cpu().numpy()
        recall = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(found, truth)]))
        timings = cuda_alternate(sides, 10 if args.quick else 50)
        base = timings["silverrec_int8"]["median_ms"]
        for name, t in timings.items():
            rows.append({"k": k, "system": name, **t, "ratio_vs_silverrec": t["median_ms"] / base,
                         "recall_vs_float": recall if name == "silverrec_int8" else 1.0})
    print(f"\nexact top-k on {cuda_info()['gpu']}, {args.n:,} x {args.d} items, batch {args.batch} "
          f"(ratio = system latency / silverrec latency; > 1: silverrec faster)")
    print_table(rows, ["k", "system", "median_ms", "p20_ms", "p80_ms", "ratio_vs_silverrec", "recall_vs_float", "error"])
    path = write_results("exact_topk_cuda" + ("_quick" if args.quick else "") + ("_dry_run" if dev.type == "cpu" else ""),
                         vars(args) | {"gpu": cuda_info(), "reference": "faiss GPU flat" if fg else "torch.topk(q @ x.T) (no faiss GPU)"},
                         rows)
    replot(path.stem, plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """Median latency per batch of every system at each k (recall of the int8 answer in the legend)."""
    rows = [r for r in payload["rows"] if "median_ms" in r]
    recall = {r["k"]: r["recall_vs_float"] for r in rows if r["system"] == "silverrec_int8"}
    series = {}
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        series[system] = ([f"k {r['k']}" for r in mine], [r["median_ms"] for r in mine])
    c = payload["config"]
    where = c["gpu"]["gpu"] if "gpu" in c else f"CPU, {c.get('threads')} threads"
    save_plot(path, [Panel(f"recall@k of the int8 answer vs float: {', '.join(f'{v:.3f}' for v in recall.values())}",
                           "k", "latency per batch, ms (median)", series, kind="bar", logy=True)],
              f"exact top-k, {c['n']:,} x {c['d']}, batch {c['batch']}, {where}")


if __name__ == "__main__" and not plot_only(plot, "exact_topk"):
    sys.exit(main())
