"""How much of the first-order Markov chain's signal a trained user tower's ranking lacks (MovieLens).

    .venv/bin/python benchmarks/markov_blend.py --checkpoints SEQ_SEED0.ckpt SEQ_SEED1.ckpt ... --seeds 0 1 ...

For each checkpoint (trained by `silverrec train` / benchmarks/quality.py on the seed's split: the
timestamp ties shuffled with that seed) every eval user's test-stage history is scored over the whole
pool in two ways: the two-tower's softmax over the pool, p(j) = softmax(<u, v_j> / temperature), and
p(j) + w * P(j | the last item), P the first-order Markov chain of publish/baselines.py fitted on the
same histories, for w in WEIGHTS (w = 0: the tower alone). NDCG@10 / HR@10 / HR@100 under the
protocol (full ranking, history masked), mean and spread over the checkpoints. A tower that already
ranks the last item's usual successors first gains nothing from the chain; the gain measures what
its list misses. Writes results/markov_blend.json and .png.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from silverrec.publish.baselines import Markov
from silverrec.publish.evaluate import evaluate_scores, mean_and_spread
from silverrec.publish.logs import leave_one_out, read_logs
from silverrec.publish.movielens import write_logs
from silverrec.publish.train import load_checkpoint, rebuild_user_tower
from silverrec.publish.two_tower import user_embeddings
from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Panel, plot_only, print_table, save_plot, write_results  # noqa: E402

WEIGHTS = (0.0, 0.1, 0.3, 1.0, 3.0)
METRICS = ("NDCG@10", "HR@10", "HR@100")


def blend_metrics(ckpt: dict, seed: int, logs_dir: Path) -> dict[float, dict[str, float]]:
    """w -> test metrics of the tower's softmax + w * P(j | last item), on seed's split."""
    inter, items = write_logs(logs_dir)
    split = leave_one_out(read_logs(inter, items, seed=seed))
    encoder = FeatureEncoder(UserFeatureSpec.from_json(ckpt["spec"]), ckpt["item_features"])
    with torch.no_grad():
        u = user_embeddings(rebuild_user_tower(ckpt), encoder, split.logs, split.eval_users,
                            split.histories(split.eval_users, "test"))[:, 0]  # task 0
    emb, temperature = ckpt["item_embeddings"], float(ckpt["config"]["temperature"])
    at = {int(x): i for i, x in enumerate(split.eval_users)}
    chain = Markov(split, "test")

    def score_fn(w: float):
        def score(users, histories):
            tower = torch.softmax((u[[at[int(x)] for x in users]] @ emb.T).double() / temperature, dim=1)
            return tower + w * chain.probabilities(histories) if w else tower
        return score

    return {w: evaluate_scores(score_fn(w), split, "test") for w in WEIGHTS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoints", nargs="+", required=True, help="one checkpoint per seed")
    p.add_argument("--seeds", type=int, nargs="+", required=True, help="the seed each checkpoint was trained with")
    p.add_argument("--name", default="markov_blend")
    args = p.parse_args(argv)
    if len(args.checkpoints) != len(args.seeds):
        p.error(f"{len(args.checkpoints)} checkpoints but {len(args.seeds)} seeds: give one seed per checkpoint")
    work = Path(tempfile.mkdtemp(prefix="silverrec-blend-"))
    ckpts = [load_checkpoint(c) for c in args.checkpoints]
    per_seed = [blend_metrics(c, s, work) for c, s in zip(ckpts, args.seeds)]
    kinds = {c.get("user_tower_kind", "bag") for c in ckpts}
    rows = []
    for w in WEIGHTS:
        stats = mean_and_spread([{k: m[w][k] for k in METRICS} for m in per_seed])
        rows.append({"weight": w, **{f"{k}_mean": stats[k][0] for k in METRICS}, **{f"{k}_std": stats[k][1] for k in METRICS},
                     "per_seed": [{k: m[w][k] for k in METRICS} for m in per_seed]})
    print_table(rows, ["weight", *[f"{k}_{s}" for k in METRICS for s in ("mean", "std")]])
    write_results(args.name, {"checkpoints": args.checkpoints, "seeds": args.seeds, "user_towers": sorted(kinds),
                              "weights": list(WEIGHTS), "data": "movielens", "stage": "test"}, rows)
    plot({"config": {"seeds": args.seeds, "user_towers": sorted(kinds)}, "rows": rows},
         Path(__file__).resolve().parent / "results" / f"{args.name}.png")
    return 0


def plot(payload: dict, path: Path) -> None:
    rows = payload["rows"]
    w = [r["weight"] for r in rows]
    panels = [Panel(f"{k}, mean +- std over seeds {payload['config']['seeds']}", "Markov weight w", k,
                    {"tower softmax + w * P(j | last item)": (w, [r[f'{k}_mean'] for r in rows], [r[f'{k}_std'] for r in rows])})
              for k in METRICS]
    save_plot(path, panels, f"MovieLens, {'/'.join(payload['config']['user_towers'])} user tower blended with the Markov chain")


if __name__ == "__main__" and not plot_only(plot, "markov_blend"):
    sys.exit(main())
