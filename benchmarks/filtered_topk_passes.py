"""How many scans the CUDA filtered_topk kernel needs: its radix select replayed on CPU.

The Triton kernel (kernels/filtered_topk_triton.py) scans a query's passing rows once per radix
pass in which the query is unresolved, plus once to compact; each scan re-reads the rows' codes,
so the number of scans is its cost multiplier on a GPU. This script computes the exact int8
scores of a 1M x 96 Gaussian mixture (benchmarks/filter.py's data, per-dimension int8 codes as
published, queries folded and quantised as the filtered search does), draws a random filter of
each selectivity, and runs the kernel's own selection step (`_select_digit`, with the histograms
made here by bincount) until every query is resolved. No GPU, no timing: counts only.

    .venv/bin/python benchmarks/filtered_topk_passes.py            # 1M x 96, batch 16, k 100 / 4096
    .venv/bin/python benchmarks/filtered_topk_passes.py --n 200000

Writes benchmarks/results/filtered_topk_passes.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("SILVERREC_QUIET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Panel, plot_only, print_table, replot, save_plot, write_results  # noqa: E402
from filter import gaussian_mixture  # noqa: E402  (the filter benchmark's pool)

from silverrec.kernels.common import quantize_queries  # noqa: E402
from silverrec.kernels import filtered_topk_triton as ftt  # noqa: E402
from silverrec.publish.quantize import quantize_per_dim  # noqa: E402


def replay(scores: torch.Tensor, passing: torch.Tensor, k: int, soff: int) -> dict:
    """The kernel's radix select on int scores int64 [B, N] of the rows `passing` bool [B, N];
    soff = 127 * 128 * D, the kernel's static bound on |score|."""
    b, n = scores.shape
    d_bits = ftt.DIGIT
    rb = max(n - 1, 1).bit_length()
    total_bits = (2 * soff).bit_length() + rb
    v = ((scores + soff) << rb) | ((1 << rb) - 1 - torch.arange(n))
    cap = k + max(k, ftt.MIN_SLACK)
    prefix = torch.zeros(b, dtype=torch.int64)
    n_above = torch.zeros_like(prefix)
    vmin = torch.full_like(prefix, torch.iinfo(torch.int64).max)
    done = passing.sum(1) == 0
    scans = torch.ones(b, dtype=torch.int64)  # the compaction
    shift_hi, passes = total_bits, 0
    while shift_hi > 0:
        shift = max(shift_hi - d_bits, 0)
        hist = torch.zeros(b, 1 << d_bits, dtype=torch.int32)
        for i in range(b):
            if not done[i]:
                sel = passing[i] & ((v[i] >> shift_hi) == prefix[i])
                digit = (v[i][sel] >> shift) - (prefix[i] << (shift_hi - shift))
                hist[i] = torch.bincount(digit, minlength=1 << d_bits).to(torch.int32)
        scans += (~done).long()
        prefix, n_above, done, vmin = ftt._select_digit(hist, k, cap, shift_hi - shift, shift, prefix, n_above, done, vmin)
        shift_hi, passes = shift, passes + 1
    compacted = (passing & (v >= vmin[:, None])).sum(1)
    # the replay selects exactly the top k: check against a full sort
    keys = torch.where(passing, v, torch.full_like(v, -1))
    want = keys.topk(k, dim=1).values
    got = torch.where(passing & (v >= vmin[:, None]), v, torch.full_like(v, -1)).topk(k, dim=1).values
    assert torch.equal(got, want), "radix replay disagrees with the full sort"
    return {"static_passes": passes, "scans_mean": scans.float().mean().item(), "scans_max": int(scans.max()),
            "compacted_mean": compacted.float().mean().item(), "compacted_max": int(compacted.max()), "cap": cap}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=96)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ks", type=int, nargs="+", default=[100, 4096])
    p.add_argument("--selectivity", type=float, nargs="+", default=[1.0, 0.1, 0.01, 0.001])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    x = torch.from_numpy(gaussian_mixture(args.n, args.d, rng))
    codes, dim_scale, _ = quantize_per_dim(x)
    q = x[torch.from_numpy(rng.integers(0, args.n, args.batch))] + 0.4 * torch.from_numpy(rng.normal(size=(args.batch, args.d)).astype(np.float32))
    qcodes, _ = quantize_queries(q * dim_scale)  # the fold of filtered_ivf_search
    scores = (qcodes.float() @ codes.float().t()).round().to(torch.int64)  # exact: |products| sum < 2**24
    rows = []
    for sel in args.selectivity:
        passing = torch.from_numpy(rng.random((args.batch, args.n)) < sel)
        for k in args.ks:
            r = replay(scores, passing, k, 127 * 128 * args.d)
            rows.append({"n": args.n, "d": args.d, "batch": args.batch, "k": k, "selectivity": sel,
                         "passing_mean": passing.sum(1).float().mean().item(), **r})
            print_table(rows[-1:], list(rows[-1].keys()))
    write_results("filtered_topk_passes", vars(args), rows)
    replot("filtered_topk_passes", plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """Scans of the passing rows per query (mean and most) and the static pass count, per selectivity and k."""
    rows, panels = payload["rows"], []
    for k in dict.fromkeys(r["k"] for r in rows):
        mine = [r for r in rows if r["k"] == k]
        cats = [f"{r['selectivity']:g}" for r in mine]
        panels.append(Panel(f"k {k}", "share of the rows passing the filter", "scans of the passing rows",
                            {"mean per query": (cats, [r["scans_mean"] for r in mine]),
                             "most for a query": (cats, [r["scans_max"] for r in mine]),
                             "static passes": (cats, [r["static_passes"] for r in mine])}, kind="bar"))
    c = payload["config"]
    save_plot(path, panels, f"the CUDA filtered top-k's radix select replayed on CPU, {c['n']:,} x {c['d']}, batch {c['batch']}")


if __name__ == "__main__" and not plot_only(plot, "filtered_topk_passes"):
    sys.exit(main())
