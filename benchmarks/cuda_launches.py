"""Device launches of the filtered search's CUDA paths, counted without a GPU.

Each CUDA path is run on CPU tensors under TRITON_INTERPRET=1 inside `recorded_ops`
(tests/test_filter_plan_triton.py): every tensor op outside the Triton kernels and every Triton
launch is recorded. Launches = Triton launches + tensor ops that run a device kernel (views,
`empty` and host-side metadata ops excluded). At batch 16 each launch costs several microseconds
of launch and dispatch on a GPU, so the count is the small-batch floor of a path's latency.
Compared: the torch compositions that were the CUDA paths of filter_plan and verify_topk
(`filter_plan_torch`, `verify_topk_torch`) with their Triton kernels, and the whole filtered search
(`filtered_ivf_search_cuda`), step by step. Counts only, no timing.

    TRITON_INTERPRET=1 .venv/bin/python benchmarks/cuda_launches.py

Writes benchmarks/results/cuda_launches.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
os.environ.setdefault("SILVERREC_QUIET", "1")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Panel, plot_only, print_table, replot, save_plot, write_results  # noqa: E402

from silverrec.kernels.bloom_filter_triton import bloom_filter_counts_triton, bloom_filter_triton  # noqa: E402
from silverrec.kernels.filter_plan import checked_args, filter_plan_torch  # noqa: E402
from silverrec.kernels.filter_plan_triton import filter_plan_triton  # noqa: E402
from silverrec.kernels.filtered_ivf_search import SearchSteps, compose_search, cuda_steps, filtered_ivf_search_cuda  # noqa: E402
from silverrec.kernels.filtered_topk import verify_topk_torch  # noqa: E402
from silverrec.kernels.verify_topk_triton import verify_topk_triton  # noqa: E402
from tests.test_filter_plan_triton import BATCH, PARAMS, plan_inputs, planning_case, recorded_ops, search_case, search_inputs  # noqa: E402

NO_KERNEL = {"empty", "t", "slice", "select", "view", "unsqueeze", "expand", "alias", "detach", "transpose",
             "as_strided", "_local_scalar_dense", "lift_fresh", "reshape", "_unsafe_view", "squeeze"}


def launches(fn) -> dict[str, int]:
    """fn() recorded: {'triton': Triton launches, 'torch': tensor ops that run a kernel}."""
    with recorded_ops() as ops:
        fn()
    names = [op for op, _ in ops]
    return {"triton": names.count("triton"), "torch": sum(op not in NO_KERNEL and op != "triton" for op in names)}


def replaced(outer: dict[str, int], inner: dict[str, int]) -> dict[str, int]:
    """outer's counts with one of its ops (counted as 1 torch op on CPU) replaced by inner's launches."""
    return {"triton": outer["triton"] + inner["triton"], "torch": outer["torch"] - 1 + inner["torch"]}


def step_launches(inputs) -> dict[str, dict[str, int]]:
    """Launches of each step of filtered_ivf_search_cuda, in the order the composition calls them."""
    counts = {}

    def recorded(name, step):
        def run(*args):
            out = []
            counts[name] = launches(lambda: out.append(step(*args)))
            return out[0]
        return run

    steps = cuda_steps()
    compose_search(SearchSteps(*(recorded(name, step) for name, step in zip(SearchSteps._fields, steps))), *inputs)
    return counts


def main() -> None:
    k, nprobe, max_probe, match_factor, ratio, limit = PARAMS[0]
    plan_case, n = planning_case(BATCH, seed=BATCH * 31 + k)
    plan_args = checked_args(*plan_inputs(plan_case, n, k, nprobe, max_probe, match_factor, ratio, limit))
    bits, ops, prog, window_words = plan_args[1][6], plan_args[4][0], plan_args[4][1], plan_args[2][0]
    lo = torch.zeros(BATCH, max_probe, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    vk = 100
    scores = torch.sort(torch.randn(BATCH, vk + vk // 4 + 16, generator=g), dim=1, descending=True).values
    rows = torch.randint(0, n, scores.shape, generator=g)
    search_args = search_inputs(search_case(seed=BATCH * 31 + k)[0], n, k, nprobe, max_probe, match_factor, ratio, limit,
                                False, (0, 0))

    # before: the torch compositions, whose one bloom op ran its Triton kernels on CUDA
    old_plan = replaced(launches(lambda: filter_plan_torch(*plan_args)),
                        launches(lambda: bloom_filter_counts_triton(bits, ops, prog, lo, lo + 64, window_words)))
    old_verify = replaced(launches(lambda: verify_topk_torch(bits, ops, prog, scores, rows, vk)),
                          launches(lambda: bloom_filter_triton(bits, ops, prog, rows >> 6, 1)))
    table = [
        {"path": "filter_plan: filter_plan_torch (before)", **old_plan},
        {"path": "filter_plan: filter_plan_triton", **launches(lambda: filter_plan_triton(*plan_args))},
        {"path": "verify_topk: verify_topk_torch (before)", **old_verify},
        {"path": "verify_topk: verify_topk_triton", **launches(lambda: verify_topk_triton(bits, ops, prog, scores, rows, vk))},
        {"path": "filtered search: filtered_ivf_search_cuda", **launches(lambda: filtered_ivf_search_cuda(*search_args))},
    ]
    table += [{"path": f"  step {name}", **count} for name, count in step_launches(search_args).items()]
    for row in table:
        row["total"] = row["triton"] + row["torch"]
    print_table(table, ["path", "triton", "torch", "total"])
    path = write_results("cuda_launches", {"batch": BATCH, "k": k, "nprobe": nprobe, "max_probe": max_probe, "verify_k": vk,
                                           "case": "tests/test_filter_plan_triton.py planning_case / search_case"}, table)
    replot(path.stem, plot)


def plot(payload: dict, path: Path) -> None:
    """Launches per path: Triton kernels and other device ops, torch compositions beside the Triton paths."""
    rows = payload["rows"]
    paths = [r["path"].strip() for r in rows]
    series = {"Triton launches": (paths, [r["triton"] for r in rows]), "other device ops": (paths, [r["torch"] for r in rows])}
    save_plot(path, [Panel(f"device launches per call, batch {payload['config']['batch']} (counted, not timed)", "path",
                           "launches", series, kind="barh")], "the filtered search's CUDA paths", width=8)


if __name__ == "__main__" and not plot_only(plot, "cuda_launches"):
    main()
