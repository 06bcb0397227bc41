"""Quality of the recommendation model on MovieLens ml-latest-small, mean and spread over seeds.

    .venv/bin/python benchmarks/quality.py [--seeds 0 1 2] [--steps 1500] [--overarch-steps 150]

For each seed: the logs' timestamp ties are shuffled with that seed (so the held-out items differ),
the model is trained with that seed (two-tower + MLP, MoL and list-wise OverArch,
`silverrec.publish.train`),
composed as it would be published (MoL OverArch, value model 1.0 * interacted + 0.5 * liked), and
every row of `publish.quality.quality_table` is measured under the leave-one-out protocol (test
stage, full ranking, history masked). Writes benchmarks/results/quality.json with each seed's rows
and the mean / sample standard deviation per row and metric, and prints the table of means.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from silverrec.publish.evaluate import mean_and_spread
from silverrec.publish.logs import leave_one_out, read_logs
from silverrec.publish.movielens import write_logs
from silverrec.publish.quality import quality_table
from silverrec.publish.rec import PublishConfig, build_rec_model
from silverrec.publish.train import TaskSpec, TrainConfig, train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Panel, plot_only, save_plot  # noqa: E402

VALUE_MODEL = {"weights": {"interacted": 1.0, "liked": 0.5}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=1500, help="two-tower steps (fixed, so load does not change the model)")
    p.add_argument("--overarch-steps", dest="overarch_steps", type=int, default=150)
    p.add_argument("--out", default=str(RESULTS / "quality.json"))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="silverrec-quality-"))
    inter, items = write_logs(work)
    runs = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        cfg = TrainConfig(interactions=str(inter), items=str(items), steps=args.steps,
                          overarch_steps=args.overarch_steps, seed=seed, overarch=["mlp", "mol", "listwise"],
                          tasks=[TaskSpec("interacted"), TaskSpec("liked", "rating", 4.0)])
        ckpt = train(cfg, work / f"seed{seed}.ckpt", quiet_eval=True)
        split = leave_one_out(read_logs(inter, items, seed=seed))
        built = build_rec_model(PublishConfig(checkpoint=str(work / f"seed{seed}.ckpt"), overarch="mol",
                                              value_model=VALUE_MODEL, seed=seed), ckpt)
        rows = quality_table(ckpt, built, split)
        runs.append({"seed": seed, "rows": rows, "seconds": round(time.perf_counter() - t0, 1),
                     "training": ckpt["stats"]})
    names = list(runs[0]["rows"])
    summary = {}
    for name in names:
        metrics = [{k: v for k, v in r["rows"][name].items() if k.startswith(("HR", "NDCG"))} for r in runs]
        summary[name] = {k: {"mean": m, "std": s} for k, (m, s) in mean_and_spread(metrics).items()}
    result = {
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "protocol": "leave-one-out by time, test stage (fit on train + validation), full ranking, history masked",
        "config": {"steps": args.steps, "overarch_steps": args.overarch_steps, "seeds": args.seeds,
                   "value_model": VALUE_MODEL, "overarch": "mol"},
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=float))
    cols = ["HR@10", "HR@50", "HR@100", "NDCG@10", "NDCG@100"]
    print(f"{'model (mean ± std over ' + str(len(runs)) + ' seeds)':<40}" + "".join(f"{c:>16}" for c in cols))
    for name in names:
        print(f"{name:<40}" + "".join(f"{summary[name][c]['mean']:>9.4f} ±{summary[name][c]['std']:.4f}" for c in cols))
    exact = summary["two-tower exact"]["NDCG@10"]["mean"]
    final = [n for n in names if n.startswith("multi-task")]
    if final:
        print(f"\nfinal NDCG@10 / two-tower exact: {summary[final[0]]['NDCG@10']['mean'] / exact:.2f}x; "
              f"IVF + re-score HR@100 / exact: {summary['IVF + re-score']['HR@100']['mean'] / summary['two-tower exact']['HR@100']['mean']:.3f}")
    print(f"wrote {args.out}")
    plot(result, Path(args.out).with_suffix(".png"))
    return 0


def plot(payload: dict, path: Path) -> None:
    """HR@K and NDCG@K of every row of the quality table (mean +- sample std over seeds)."""
    summary = payload["summary"]
    panels = []
    for family in ("HR", "NDCG"):
        metrics = [m for m in next(iter(summary.values())) if m.startswith(family + "@")]
        panels.append(Panel(f"{family}@K, mean +- std over seeds {payload['config']['seeds']}", "model", family,
                            {m: (list(summary), [summary[s][m]["mean"] for s in summary], [summary[s][m]["std"] for s in summary])
                             for m in metrics}, kind="barh"))
    save_plot(path, panels, "MovieLens ml-latest-small, leave-one-out, full ranking over every item", height=5.5)


if __name__ == "__main__" and not plot_only(plot, "quality"):
    sys.exit(main())
