"""Quality of the recommendation model on a leave-one-out data set, mean and spread over seeds.

    .venv/bin/python benchmarks/quality.py [--data movielens | video_games] [--towers sequence bag]
        [--seeds 0 1 2] [--steps N] [--overarch-steps 150] [--overarch mlp mol listwise] [--set KEY=VALUE ...]
        [--no-peers] [--exact-only] [--transitions M] [--name NAME] [--keep DIR [--reuse]]
    .venv/bin/python benchmarks/quality.py --data D --merge A_TOWER.json B_TOWER.json --name NAME [--peers-file F]

Data sets: "movielens" (the bundled ml-latest-small: tasks "interacted" and "liked" = rating >= 4,
value model 1.0 * interacted + 0.5 * liked) and "video_games" (the Amazon Video Games sequences,
data/video_games/SOURCE.md: one task, no value model; its files are converted locally).
For each seed: the logs' timestamp ties are shuffled with that seed (so the held-out items differ),
the peers (publish/baselines.py) are measured once per distinct split (a log without ties, as the
Video Games sequences, gives every seed the same split: its peers are measured once), and each
of the `--towers` is trained with that seed (two-tower with that user tower + the --overarch
rankers, default MLP, MoL and list-wise; `silverrec.publish.train`), composed as it would be published (MoL OverArch, the data set's value
model), and every row of `publish.quality.quality_table` is measured under the leave-one-out
protocol (test stage, full ranking, history masked). The published composition has next-item
transitions (`--transitions`, default 100 per item, weight chosen on the validation items:
publish/transitions.py); the table measures it with and without them. Writes benchmarks/results/quality_<data>_<tower>.json
(and .png) after every seed, with each seed's rows and the mean / sample standard deviation per row
and metric, and prints the table of means.

Steps: the bag tower trains a fixed 1,500 steps (or --steps); the sequential tower at most --steps
(default 3,000; `--set steps=N` for it alone), stopping early on the validation split
(publish/train_sequence.py).

Seeds can run side by side as separate processes (`--seeds 1 2 --no-peers --name B` beside the run of
seed 0); `--merge` joins their results into one, the runs without peers taking the peers' rows of a
seed with the same split (checked on the data).
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
from silverrec.publish.baselines import run_baselines
from silverrec.publish.quality import quality_table, two_tower_exact
from silverrec.publish.rec import PublishConfig, build_rec_model
from silverrec.publish.train import TaskSpec, TrainConfig, train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Panel, plot_only, save_plot  # noqa: E402

VALUE_MODEL = {"weights": {"interacted": 1.0, "liked": 0.5}}
DATA = Path(__file__).resolve().parents[1] / "data"
STEPS = {"bag": 1500, "sequence": 3000}


def data_set(name: str, work: Path) -> tuple[Path, Path, list[TaskSpec], dict | None]:
    """(interactions, items, tasks, value model) of a data set by name."""
    if name == "movielens":
        inter, items = write_logs(work)
        return inter, items, [TaskSpec("interacted"), TaskSpec("liked", "rating", 4.0)], VALUE_MODEL
    inter, items = DATA / name / "interactions.parquet", DATA / name / "items.parquet"
    if not inter.is_file():
        raise SystemExit(f"{inter} is missing: see {DATA / name / 'SOURCE.md'} for how to obtain and convert it")
    return inter, items, [TaskSpec("interacted")], None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="movielens", help="movielens, or a folder name under data/ (video_games)")
    p.add_argument("--towers", nargs="+", default=["sequence", "bag"], choices=["sequence", "bag"],
                   help="the user towers, each trained and measured per seed (the peers once per seed)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="two-tower steps (fixed, so load does not change the model; "
                   "the sequential tower's most, it stops early): default 1,500 bag, 3,000 sequence")
    p.add_argument("--overarch-steps", dest="overarch_steps", type=int, default=150)
    p.add_argument("--overarch", nargs="+", default=["mlp", "mol", "listwise"], choices=["mlp", "mol", "listwise"],
                   help="the OverArch rankers trained and measured (the published list uses MoL)")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="TrainConfig overrides for the sequential tower, e.g. steps=500 batch=128 sequence.layers=2 "
                   "(values as TOML)")
    p.add_argument("--name", default=None, help="results name prefix (default quality_<data>): <name>_<tower>.json")
    p.add_argument("--keep", default=None, metavar="DIR", help="write each seed's checkpoint into DIR "
                   "(<tower>_seed<S>.ckpt) instead of a temporary folder")
    p.add_argument("--transitions", type=int, default=100, help="next-item transitions per item in the published "
                   "composition (0 = none; publish.toml's `transitions`)")
    p.add_argument("--transition-window", dest="transition_window", type=int, default=None,
                   help="publish.toml's transition_window (default: PublishConfig's)")
    p.add_argument("--transition-decay", dest="transition_decay", type=float, default=None,
                   help="publish.toml's transition_decay (default: PublishConfig's)")
    p.add_argument("--reuse", action="store_true", help="with --keep: a checkpoint already in DIR, trained with the "
                   "same configuration (checked), is measured again instead of retrained")
    p.add_argument("--exact-only", dest="exact_only", action="store_true",
                   help="the two-tower exact row alone (no OverArch, no published composition): the towers compared "
                   "where the whole table costs too much")
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="the towers alone (a run beside one that measures the peers; --merge adds theirs)")
    p.add_argument("--merge", nargs="+", default=None, metavar="RESULT.json",
                   help="write <name>_<tower>.json from the runs of these results (one tower, parts of one "
                   "configuration run side by side, e.g. seed 0 and seeds 1 2), then stop")
    p.add_argument("--peers-file", dest="peers_file", default=None, metavar="BASELINES.json",
                   help="with --merge: the peers' rows for runs without them (`python -m silverrec.publish.baselines "
                   "... > BASELINES.json`, seed 0)")
    args = p.parse_args(argv)
    name = args.name or f"quality_{args.data}"
    if args.merge:
        return merge(args.merge, name, args.peers_file)
    work = Path(tempfile.mkdtemp(prefix="silverrec-quality-"))
    inter, items, tasks, value_model = data_set(args.data, work)
    overrides = parse_overrides(args.overrides)
    command = "benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv)
    runs: dict[str, list] = {tower: [] for tower in args.towers}
    chain_args = {f"transition_{k}": getattr(args, f"transition_{k}") for k in ("window", "decay")
                  if getattr(args, f"transition_{k}") is not None}
    peers_of: dict[str, dict] = {}  # split fingerprint -> the peers' rows (measured once per distinct split)
    for seed in args.seeds:
        split = leave_one_out(read_logs(inter, items, seed=seed))
        key = split_fingerprint(split)
        if not args.peers:
            peers_of[key] = {}
        if key not in peers_of:
            peers_of[key] = run_baselines(split, log=lambda n: print(f"[silverrec] quality: {n} (seed {seed})",
                                                                     file=sys.stderr))
        peers = peers_of[key]
        for tower in args.towers:
            t0 = time.perf_counter()
            own = overrides if tower == "sequence" else {}
            steps = own.get("steps", args.steps or STEPS[tower])
            cfg = TrainConfig(**{"interactions": str(inter), "items": str(items), "overarch_steps": args.overarch_steps,
                                 "seed": seed, "overarch": [] if args.exact_only else list(args.overarch), "tasks": tasks,
                                 "user_tower": tower, **own, "steps": steps})
            ckpt_path = (Path(args.keep) if args.keep else work) / f"{tower}_seed{seed}.ckpt"
            if args.reuse and ckpt_path.is_file():
                ckpt = reused(ckpt_path, cfg)
            else:
                ckpt = train(cfg, ckpt_path, quiet_eval=True)
            if args.exact_only:
                rows = {**peers, "two-tower exact": two_tower_exact(ckpt, split)}
            else:
                built = build_rec_model(PublishConfig(checkpoint=str(ckpt_path), overarch="mol", value_model=value_model,
                                                      seed=seed, transitions=args.transitions, **chain_args), ckpt)
                rows = {**peers, **quality_table(ckpt, built, split, baselines=False)}
            run = {"seed": seed, "rows": rows, "seconds": round(time.perf_counter() - t0, 1), "training": ckpt["stats"]}
            if not args.exact_only and "transitions" in built.manifest:
                run["transitions"] = built.manifest["transitions"]  # the weight's choice on the validation items
            runs[tower].append(run)
            config = {"user_tower": tower, "steps": steps, "overarch_steps": args.overarch_steps, "seeds": args.seeds,
                      "value_model": value_model, "overarch": "mol", "overarch_trained": args.overarch,
                      "distinct_splits": len(peers_of), "exact_only": args.exact_only, "overrides": own,
                      "transitions": args.transitions, **chain_args}
            write(RESULTS / f"{name}_{tower}.json", runs[tower], args.data, command, config)  # after every seed
    return 0


def reused(path: Path, cfg: TrainConfig) -> dict:
    """The checkpoint at `path`, refused unless it was trained with `cfg` (the input paths aside)."""
    from dataclasses import asdict

    from silverrec.publish.train import load_checkpoint

    ckpt = load_checkpoint(path)
    unused = PATH_KEYS + (("minutes",) if cfg.steps else ())  # fixed steps: the time cap never applied
    want = {k: v for k, v in json.loads(json.dumps(asdict(cfg), default=str)).items() if k not in unused}
    have = {k: v for k, v in json.loads(json.dumps(ckpt["config"], default=str)).items() if k not in unused}
    if want != have:
        diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        raise SystemExit(f"{path} was trained with another configuration ({', '.join(diff)} differ): drop --reuse")
    return ckpt


PATH_KEYS = ("interactions", "items", "users")
PEERS = ("popularity", "PureSVD", "EASE", "Markov", "Markov + EASE")


def merge(paths: list[str], name: str, peers_file: str | None = None) -> int:
    """One result from the runs of several (the same data, tower and configuration, other seeds). A
    run measured with --no-peers takes the peers' rows of a run that has them, or those of
    `peers_file` (the JSON `python -m silverrec.publish.baselines` prints, seed 0's split), where the
    two seeds give the same split (checked on the data)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    keys = ("user_tower", "steps", "overarch_steps", "value_model", "overarch", "exact_only", "overrides", "transitions",
            "transition_window", "transition_decay")
    for q in parts[1:]:
        if q["data"] != parts[0]["data"] or any(q["config"].get(k) != parts[0]["config"].get(k) for k in keys):
            raise SystemExit(f"cannot merge: {paths[0]} and another differ in data or {keys}")
    data = parts[0]["data"]
    runs = sorted((r for q in parts for r in q["runs"]), key=lambda r: r["seed"])
    donor = next(({"seed": r["seed"], "rows": {k: r["rows"][k] for k in PEERS}} for r in runs
                  if all(k in r["rows"] for k in PEERS)), None)
    if donor is None and peers_file:
        donor = {"seed": 0, "rows": json.loads(Path(peers_file).read_text())}
    inter, items = data_set(data, Path(tempfile.mkdtemp(prefix="silverrec-quality-")))[:2]
    for r in runs:
        if not any(k in r["rows"] for k in PEERS):
            if donor is None or split_fingerprint(leave_one_out(read_logs(inter, items, seed=r["seed"]))) != \
                    split_fingerprint(leave_one_out(read_logs(inter, items, seed=donor["seed"]))):
                raise SystemExit(f"seed {r['seed']} has no peers' rows and no run with the same split has them")
            r["rows"] = {**{k: v for k, v in donor["rows"].items() if k in PEERS}, **r["rows"]}
            r["peers_from_seed"] = donor["seed"]
    config = parts[0]["config"] | {"seeds": [r["seed"] for r in runs], "merged_from": [q["command"] for q in parts]}
    if peers_file:
        config["peers_file"] = Path(peers_file).name
    write(RESULTS / f"{name}_{config['user_tower']}.json", runs, data, " + ".join(q["command"] for q in parts), config)
    return 0


def split_fingerprint(split) -> str:
    """A digest of the ordered interactions and the held-out items: seeds whose tie shuffles give the
    same split (a log without timestamp ties) share one measurement of the peers."""
    import hashlib

    h = hashlib.sha256(split.logs.items.tobytes() + split.logs.offsets.tobytes() + split.eval_users.tobytes())
    for stage in ("valid", "test"):
        h.update(split.targets(stage).tobytes())
    return h.hexdigest()


def write(out: Path, runs: list[dict], data: str, command: str, config: dict) -> None:
    """The runs so far, their mean and spread per row and metric: JSON, plot, and the table printed."""
    names = list(runs[0]["rows"])
    summary = {}
    for name in names:
        metrics = [{k: v for k, v in r["rows"][name].items() if k.startswith(("HR", "NDCG"))} for r in runs]
        summary[name] = {k: {"mean": m, "std": s} for k, (m, s) in mean_and_spread(metrics).items()}
    result = {
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "protocol": "leave-one-out by time, test stage, full ranking, history masked",
        "data": data, "command": command, "config": config | {"seeds_done": [r["seed"] for r in runs]},
        "summary": summary, "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    cols = ["HR@10", "HR@50", "HR@100", "NDCG@10", "NDCG@100"]
    print(f"\n{config['user_tower']} tower, {data}")
    print(f"{'model (mean ± std over ' + str(len(runs)) + ' seeds)':<40}" + "".join(f"{c:>16}" for c in cols))
    for name in names:
        print(f"{name:<40}" + "".join(f"{summary[name][c]['mean']:>9.4f} ±{summary[name][c]['std']:.4f}" for c in cols))
    final = [n for n in names if n.startswith("multi-task")] or [n for n in names if n == "+ MoL"]
    if final:
        exact = summary["two-tower exact"]
        print(f"final NDCG@10 / two-tower exact: {summary[final[0]]['NDCG@10']['mean'] / exact['NDCG@10']['mean']:.2f}x; "
              f"IVF + re-score HR@100 / exact: {summary['IVF + re-score']['HR@100']['mean'] / exact['HR@100']['mean']:.3f}")
    print(f"wrote {out}", flush=True)
    plot(result, out.with_suffix(".png"))


def plot(payload: dict, path: Path) -> None:
    """HR@K and NDCG@K of every row of the quality table (mean +- sample std over seeds)."""
    summary = payload["summary"]
    panels = []
    for family in ("HR", "NDCG"):
        metrics = [m for m in next(iter(summary.values())) if m.startswith(family + "@")]
        panels.append(Panel(f"{family}@K, mean +- std over seeds {payload['config']['seeds']}", "model", family,
                            {m: (list(summary), [summary[s][m]["mean"] for s in summary], [summary[s][m]["std"] for s in summary])
                             for m in metrics}, kind="barh"))
    title = {"movielens": "MovieLens ml-latest-small"}.get(payload.get("data", "movielens"), payload.get("data"))
    tower = payload["config"].get("user_tower", "bag")
    save_plot(path, panels, f"{title}, {tower} user tower, leave-one-out, full ranking over every item", height=5.5)


def parse_overrides(items: list[str]) -> dict:
    """KEY=VALUE strings (values in TOML syntax; "sequence.KEY" goes into the [sequence] table) -> a dict."""
    import tomllib

    out: dict = {}
    for item in items:
        key, _, value = item.partition("=")
        parsed = tomllib.loads(f"v = {value}")["v"] if value else None
        if key.startswith("sequence."):
            out.setdefault("sequence", {})[key.split(".", 1)[1]] = parsed
        else:
            out[key] = parsed
    return out


if __name__ == "__main__" and not plot_only(plot, "quality"):
    sys.exit(main())
