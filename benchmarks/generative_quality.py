"""Semantic-ID decoder vs the item-token reference (one token per item, full softmax), equal budgets.

    python benchmarks/generative_quality.py [--minutes 2 | --steps 400] [--seeds 0 1 2]
        [--two-tower out/demo/model.ckpt | --embeddings svd] [--levels 1] [--codes 256] [--beam 100]
        [--disambiguation popular|nearest]
        [--save DIR]

Both are the same `RecDecoder` (publish/train_generative.py), trained for the same budget on the
same leave-one-out split of MovieLens ml-latest-small converted to generic logs
(`movielens.write_logs`): the semantic-ID model on residual k-means codes (default 1 level x 256
+ the item's popularity rank in its cluster) of the two-tower item tower's embeddings (a `silverrec
train` checkpoint, default out/demo/model.ckpt), the reference with one token per item
(`embeddings = "items"`).
Metrics: HR@10 and NDCG@10 of the test items (stage "test": trained on train + validation items),
history items excluded in the decode; the reference's decode of beam 10 is the exact top 10 of its
full softmax over items (full ranking), the semantic-ID model's is the top 10 of a beam of `--beam`.
Budget: `--minutes` (wall clock each) or `--steps` (the same optimiser steps for both; on a shared
machine the step count of a wall-clock budget follows the load, so equal steps is the fair, repeatable
comparison; each row records its training seconds and seconds per step, and the summary the ratio
of the two models' seconds per step, run back to back per seed). `--save DIR` keeps each seed's
semantic-ID checkpoint (DIR/generative_seed{S}.ckpt).

    python benchmarks/generative_quality.py --hybrid DIR --two-tower 'tt_seed{seed}.ckpt' [--seeds 0 1 2]
        [--validation 'ttv_seed{seed}.ckpt' 'DIRV/generative_seed{seed}.ckpt']

measures the hybrid instead (target: hybrid NDCG@10 >= the better of ANN only and generative
only): per seed, benchmarks/recommend.py's `sources_quality` (one hybrid RecModel asked for each
source per request) over that seed's two-tower checkpoint and DIR/generative_seed{S}.ckpt, on the
seed's split; mean and std over seeds -> benchmarks/results/generative_quality_hybrid.json. With
`--validation` (the same two trainings at stage "valid") publish chooses the fusion on the
validation split (publish/fusion.py); each row records the choice and its validation figures.

Popularity is the same list for every user (history excluded). Mean and sample std over seeds
(each seed: the timestamp tie-break of the logs, the initialisation and the batches).

Target: semantic-ID HR@10 >= 0.9 x the item-token decoder's at equal training minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Panel, plot_only, print_table, replot, save_plot, write_results  # noqa: E402

from silverrec.publish import movielens  # noqa: E402
from silverrec.publish.evaluate import mean_and_spread  # noqa: E402
from silverrec.publish.train_generative import ITEM_TOKENS, TrainConfig, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=2.0, help="training budget of each model (default 2)")
    p.add_argument("--steps", type=int, default=None, help="train each model for exactly this many steps instead")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--two-tower", dest="two_tower", default=str(ROOT / "out/demo/model.ckpt"),
                   help="silverrec train checkpoint whose item embeddings give the semantic IDs; '{seed}' in the "
                   "path is replaced by each seed (a tower trained on the same split: the seed also breaks the "
                   "logs' timestamp ties, so another seed's tower may have trained on this split's test items)")
    p.add_argument("--embeddings", default=None, help="semantic-ID source instead of --two-tower (e.g. svd)")
    p.add_argument("--levels", type=int, default=1, help="residual k-means levels of the semantic IDs")
    p.add_argument("--codes", type=int, default=256, help="codes per level")
    p.add_argument("--disambiguation", default="popular", choices=["nearest", "popular"],
                   help="order of the items sharing a code path in the last level")
    p.add_argument("--beam", type=int, default=100, help="beam width of the semantic-ID decode (top 10 of it)")
    p.add_argument("--save", default=None, help="directory for each seed's semantic-ID checkpoint")
    p.add_argument("--reference", default=None, metavar="JSON",
                   help="take the item-token rows from this earlier result (same --steps and seeds; item-token "
                   "training is deterministic for a seed and step count) instead of training them again")
    p.add_argument("--hybrid", default=None, metavar="DIR", help="measure the hybrid with DIR/generative_seed{S}.ckpt")
    p.add_argument("--validation", nargs=2, default=None, metavar=("TWO_TOWER", "GENERATIVE"),
                   help="with --hybrid: stage-'valid' checkpoints ('{seed}' replaced) the fusion is chosen with")
    p.add_argument("--logs", default="/tmp/silverrec_movielens_logs", help="where to write the converted logs")
    p.add_argument("--name", default="generative_quality")
    args = p.parse_args(argv)
    os.environ.setdefault("SILVERREC_QUIET", "1")
    towers = [args.two_tower.replace("{seed}", str(seed)) for seed in args.seeds]
    if args.embeddings is None and not all(Path(t).is_file() for t in towers):
        sys.exit(f"no two-tower checkpoint at {[t for t in towers if not Path(t).is_file()]}: run `python -m silverrec.publish.demo` or "
                 f"`silverrec train --config train.toml --out CKPT` and pass --two-tower CKPT")
    inter, items = movielens.write_logs(args.logs)
    if args.hybrid:
        return hybrid_main(args, towers)
    models = {"semantic IDs": args.embeddings or str(args.two_tower), "item tokens": ITEM_TOKENS}
    budget = {"minutes": 1e6, "max_steps": args.steps} if args.steps else {"minutes": args.minutes}
    rows, runs = [], {name: [] for name in [*models, "popularity"]}
    reference = reference_rows(args) if args.reference else {}
    for seed in args.seeds:
        models["semantic IDs"] = (args.embeddings or args.two_tower).replace("{seed}", str(seed))
        for name, source in models.items():  # alternated per seed: both see the same machine load
            if name == "item tokens" and seed in reference:
                rows.append(reference[seed])
                runs[name].append({k: v for k, v in reference[seed].items() if "@" in k})
                continue
            cfg = TrainConfig(interactions=str(inter), items=str(items), embeddings=source, seed=seed, **budget,
                              levels=args.levels, codes=args.codes, disambiguation=args.disambiguation, eval_beam=args.beam if source != ITEM_TOKENS else 10)
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            out = Path(args.save) / f"generative_seed{seed}.ckpt" if args.save and source != ITEM_TOKENS else None
            _, sids, metrics = train(cfg, out)
            row = {"model": name, "seed": seed, "steps": metrics.steps, "train_s": round(metrics.train_seconds, 1),
                   "s_per_step": round(metrics.train_seconds / max(metrics.steps, 1), 3),
                   "heldout_loss": round(metrics.heldout_loss, 4), **metrics.model, "vocab": sids.vocab_size,
                   "levels": sids.level_sizes if len(sids.level_sizes) > 1 else [len(sids.item_ids)],
                   "wall_s": round(time.perf_counter() - t0, 1), "load_avg_1m": round(load, 2)}
            rows.append(row)
            runs[name].append(metrics.model)
            print_table([row], ["model", "seed", "steps", "s_per_step", "HR@10", "NDCG@10", "heldout_loss", "load_avg_1m"])
        runs["popularity"].append(metrics.popularity)
    summary = {name: mean_and_spread(r) for name, r in runs.items()}
    table = [{"model": name, **{k: f"{m:.4f} +- {s:.4f}" for k, (m, s) in v.items()}} for name, v in summary.items()]
    what = f"{args.steps} steps" if args.steps else f"{args.minutes:g} min"
    print(f"\nmean +- std over seeds {args.seeds}, {what} of training each")
    print_table(table, ["model", "HR@10", "NDCG@10"])
    ratio = summary["semantic IDs"]["HR@10"][0] / max(summary["item tokens"]["HR@10"][0], 1e-12)
    per_step = [s["s_per_step"] / t["s_per_step"] for s, t in zip(rows[0::2], rows[1::2])]  # same seed, back to back
    verdict = (f"semantic-ID HR@10 / item-token HR@10 = {ratio:.3f} at {what} (target >= 0.9: "
               f"{'met' if ratio >= 0.9 else 'NOT met'}); seconds per step semantic / item-token per seed "
               f"{[round(r, 2) for r in per_step]}")
    print(verdict)
    config = {"minutes": None if args.steps else args.minutes, "steps": args.steps, "seeds": args.seeds,
              "semantic_ids": args.embeddings or args.two_tower, "beam": args.beam,
              "train_config": {k: v for k, v in asdict(cfg).items() if k not in ("interactions", "items", "embeddings", "seed")},
              "protocol": "leave-one-out, stage test, HR@10/NDCG@10 of the decode's top 10, history excluded in-decode"}
    write_results(args.name, config, rows + [{"summary": {k: {m: list(v) for m, v in s.items()} for k, s in summary.items()},
                                             "hr10_ratio": ratio, "seconds_per_step_ratio": per_step,
                                             "verdict": verdict}])
    replot(args.name, plot)
    return 0


def reference_rows(args) -> dict[int, dict]:
    """Item-token rows per seed of an earlier result (--reference), checked to match --steps and --seeds."""
    import json

    data = json.loads(Path(args.reference).read_text())
    if data["config"].get("steps") != args.steps or args.steps is None:
        sys.exit(f"--reference {args.reference} ran {data['config'].get('steps')} steps, not --steps {args.steps}")
    rows = {r["seed"]: r | {"from": args.reference} for r in data["rows"] if r.get("model") == "item tokens"}
    if set(args.seeds) - set(rows):
        sys.exit(f"--reference {args.reference} has no item-token row for seeds {sorted(set(args.seeds) - set(rows))}")
    return rows


def hybrid_main(args, towers: list[str]) -> int:
    """HR / NDCG of ANN only, generative only and hybrid per seed (benchmarks/recommend.py
    `sources_quality`), mean and std over seeds, and the verdict on NDCG@10 (hybrid >= the better source)."""
    from recommend import sources_quality

    rows, runs = [], {name: [] for name in ("ann", "generative", "hybrid")}
    for seed, tower in zip(args.seeds, towers):
        gen = Path(args.hybrid) / f"generative_seed{seed}.ckpt"
        load, t0 = os.getloadavg()[0], time.perf_counter()
        print(f"seed {seed}: {tower} + {gen}", flush=True)
        validation = None if args.validation is None else tuple(Path(v.replace("{seed}", str(seed))) for v in args.validation)
        quality = sources_quality(Path(tower), gen, Path(args.logs), seed, validation=validation)
        fusion, test_grid = quality.pop("fusion"), quality.pop("test_grid")
        print(f"  fusion: w {fusion['weight']}, priority {fusion['priority']} (chosen on {fusion['chosen_on']}"
              + (f": validation NDCG@10 hybrid {fusion['validation']['hybrid']['NDCG@10']:.4f}, ann "
                 f"{fusion['validation']['ann']['NDCG@10']:.4f}, generative {fusion['validation']['generative']['NDCG@10']:.4f})"
                 if "validation" in fusion else ")"), flush=True)
        for name, r in runs.items():
            r.append({k: quality[name][k] for k in ("HR@10", "NDCG@10", "HR@100")})
        rows.append({"seed": seed, "two_tower": tower, "generative": str(gen), **quality, "fusion": fusion,
                     "test_grid": test_grid,
                     "wall_s": round(time.perf_counter() - t0, 1), "load_avg_1m": round(load, 2)})
    summary = {name: mean_and_spread(r) for name, r in runs.items()}
    print_table([{"source": n, **{k: f"{m:.4f} +- {s:.4f}" for k, (m, s) in v.items()}} for n, v in summary.items()],
                ["source", "HR@10", "NDCG@10", "HR@100"])
    best = max(summary["ann"]["NDCG@10"][0], summary["generative"]["NDCG@10"][0])
    hybrid = summary["hybrid"]["NDCG@10"][0]
    verdict = (f"hybrid NDCG@10 {hybrid:.4f} vs the better source {best:.4f} (mean of seeds {args.seeds}): "
               f"target hybrid >= better source {'met' if hybrid >= best else 'NOT met'}")
    per_seed = [r["hybrid"]["NDCG@10"] >= max(r["ann"]["NDCG@10"], r["generative"]["NDCG@10"]) for r in rows]
    verdict += f"; per seed hybrid >= better source: {per_seed}"
    print(verdict)
    pooled = pooled_choice(rows) if args.validation else None
    if pooled:
        print(pooled["verdict"])
    config = {"seeds": args.seeds, "two_tower": args.two_tower, "generative": args.hybrid, "validation": args.validation,
              "protocol": "benchmarks/recommend.py sources_quality: leave-one-out stage test on each seed's split, "
                          "610 users, full ranking, known items excluded, one hybrid RecModel asked per request for "
                          "ANN only / generative only / both"}
    path = write_results(args.name if args.name != "generative_quality" else "generative_quality_hybrid", config,
                         rows + [{"summary": {k: {m: list(v) for m, v in s.items()} for k, s in summary.items()},
                                  "verdict": verdict, "pooled_validation_choice": pooled}])
    replot(path.stem, plot)
    return 0


def pooled_choice(rows: list[dict]) -> dict:
    """The one fusion with the best validation NDCG@10 averaged over the seeds (each seed's publish-time
    grid), and its test figures from each seed's test grid: one choice from 3 x 610 validation users
    instead of one per 610."""
    key = lambda g: (g["weight"], g["priority"])
    grids = [{key(g): g for g in r["fusion"]["grid"]} for r in rows]
    tests = [{key(g): g for g in r["test_grid"]} for r in rows]
    best = max(grids[0], key=lambda k: (np.mean([g[k]["hybrid"]["NDCG@10"] for g in grids]), -list(grids[0]).index(k)))
    test = {src: mean_and_spread([t[best][src] for t in tests]) for src in ("ann", "generative", "hybrid")}
    better = max(test["ann"]["NDCG@10"][0], test["generative"]["NDCG@10"][0])
    verdict = (f"fusion chosen on the validation NDCG@10 pooled over seeds: w {best[0]}, priority {best[1]}; test "
               f"NDCG@10 hybrid {test['hybrid']['NDCG@10'][0]:.4f} vs ANN only {test['ann']['NDCG@10'][0]:.4f}, "
               f"generative only {test['generative']['NDCG@10'][0]:.4f}: target "
               f"{'met' if test['hybrid']['NDCG@10'][0] >= better else 'NOT met'}")
    return {"weight": best[0], "priority": best[1], "validation_mean": {
                src: float(np.mean([g[best][src]["NDCG@10"] for g in grids])) for src in ("ann", "generative", "hybrid")},
            "test": {src: {m: list(v) for m, v in t.items()} for src, t in test.items()}, "verdict": verdict}


def plot(payload: dict, path: Path) -> None:
    """Mean and sample std over seeds of each model's (or source's) HR@K / NDCG@K, test split."""
    summary = next(r["summary"] for r in payload["rows"] if "summary" in r)
    panels = []
    for family in ("HR", "NDCG"):
        series = {}
        for model, metrics in summary.items():
            names = [m for m in metrics if m.startswith(family + "@")]
            series[model] = (names, [metrics[m][0] for m in names], [metrics[m][1] for m in names])
        panels.append(Panel(f"{family}@K, mean +- std over seeds {payload['config'].get('seeds')}", "metric", family,
                            series, kind="bar"))
    c = payload["config"]
    budget = f"{c['steps']} steps" if c.get("steps") else (f"{c['minutes']:g} min" if c.get("minutes") else "")
    what = "hybrid vs its sources" if "generative" in summary and "hybrid" in summary else f"decoders at equal {budget}"
    save_plot(path, panels, f"MovieLens leave-one-out, {what}")


if __name__ == "__main__" and not plot_only(plot, "generative_quality"):
    sys.exit(main())
