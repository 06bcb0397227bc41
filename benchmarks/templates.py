"""Filter template benchmark: a forward whose filter is a template filled in the model from the
user's features, against the same filter sent as a request string (compiled on the host per
request), on MovieLens ml-latest-small.

    .venv/bin/python benchmarks/templates.py            # trains ~1 min (cached in out/bench_templates)
    .venv/bin/python benchmarks/templates.py --quick    # fixed 150 training steps, fewer repeats

Data: the bundled MovieLens as generic logs (publish/movielens.py), plus a users.parquet with one
categorical user feature, `fav_genre`: the genre each user rated most often (ties: first in
sorted order). One checkpoint, two snapshots published from it: `template` with
`filter_template = "genre = $user.fav_genre AND NOT item_id IN $history"` and `plain` without.
Requests: real users (their stored history, excluded from the answer) with their `fav_genre`;
the `plain` side also sends the filter string `genre = <fav_genre>` (its history is excluded by the
request's default `exclude_history`). Batches rotate through every user so that no batch of
filter strings repeats (each string is still an LRU hit after its first use, as in a server).

Timing: `snap.recommend(batch, k=10)`, both snapshots loaded with the same backend (TorchScript,
then torch.export), 10 warm-up calls per side, then the two sides alternating call by call
(benchmarks/common.py `alternate`), batch 1 / 16 / 64; `ratio` =
string median / template median (> 1: the template is faster). `agree` = share of top-10 lists
that are identical on both sides. Then each side's own extra work alone (`fill_rows`): the
template's fill (its module scripted) against compile_request of the batch's strings.
Writes benchmarks/results/templates.json (templates_quick.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("SILVERREC_QUIET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

import silverrec  # noqa: E402
from common import Panel, alternate, plot_only, print_table, replot, save_plot, write_results  # noqa: E402
from silverrec.publish.movielens import write_logs  # noqa: E402
from silverrec.publish.rec import PublishConfig, publish_rec  # noqa: E402
from silverrec.publish.train import TrainConfig, train  # noqa: E402

TEMPLATE = "genre = $user.fav_genre AND NOT item_id IN $history"
TRAIN_TOML = """\
interactions = "logs/interactions.parquet"
items = "logs/items.parquet"
users = "logs/users.parquet"
user_tower = "bag"
dim = 64
minutes = {minutes}
overarch = ["mlp"]
overarch_minutes = 0.2
k0 = 200
seed = 0

[[tasks]]
name = "interacted"
"""


def favourite_genres(inter: Path, items: Path, out: Path) -> dict[int, str]:
    """users.parquet with `fav_genre` (the user's most frequent genre); returns user id -> genre."""
    it = pq.read_table(items).to_pydict()
    genres = dict(zip(it["item_id"], it["genre"]))
    ev = pq.read_table(inter, columns=["user_id", "item_id"]).to_pydict()
    counts: dict[int, Counter] = {}
    for u, i in zip(ev["user_id"], ev["item_id"]):
        counts.setdefault(int(u), Counter()).update(g for g in genres[i] if g != "(no genres listed)")
    fav = {u: sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[0][0] for u, c in counts.items() if c}
    users = sorted(fav)
    pq.write_table(pa.table({"user_id": pa.array(users, pa.int64()),
                             "fav_genre": pa.array([fav[u] for u in users], pa.string())}), out)
    return fav


def fill_rows(snap, reqs: dict, users: list, repeat: int) -> list[dict]:
    """The two sides' own extra work, alternated call by call: the template's fill (its module
    scripted, on the request tensors the predictor built) against compile_request of the same
    batch's filter strings (per-string LRU hits after the first use; batches rotate, so the
    batch-level LRU misses as in a server)."""
    from silverrec.filtering.filter_program import FilterPlan, compile_request
    from silverrec.filtering.template import compile_template
    from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec

    plan = FilterPlan.from_config(snap.config["filter"])
    spec = UserFeatureSpec.from_json(snap.config["user_features"])
    module = torch.jit.script(compile_template(TEMPLATE, plan, spec))
    csr = {f: (np.zeros(spec.num_items + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)) for f in spec.item_vocabs}
    enc = FeatureEncoder.from_arrays(spec, csr)
    out = []
    for batch in (1, 16, 64):
        starts = [(i * batch) % max(1, len(users) - batch) for i in range(repeat)]
        inputs = []
        for i in starts:
            feats = [r["features"] for r in reqs["template"][i:i + batch]]
            values, lengths, _ = enc.encode([np.arange(20)] * len(feats), feats)
            inputs.append((values, lengths, [r["filter"] for r in reqs["plain"][i:i + batch]]))
        at = {"fill": 0, "compile": 0}

        def fill() -> None:
            values, lengths, filters = inputs[at["fill"] % len(inputs)]
            at["fill"] += 1
            module(values, lengths, *compile_request([None] * len(filters), plan))

        def compile_strings() -> None:
            compile_request(inputs[at["compile"] % len(inputs)][2], plan)
            at["compile"] += 1

        t_fill, t_comp = alternate([fill, compile_strings], repeat, warmup=5)
        f, c = t_fill["median_ms"] * 1e3, t_comp["median_ms"] * 1e3
        out.append({"part": "fill vs compile", "batch": batch, "fill_us": f, "compile_us": c, "ratio": c / f,
                    "load_average": os.getloadavg()[0]})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="out/bench_templates")
    p.add_argument("--repeat", type=int, default=None, help="timed calls per side and batch size")
    args = p.parse_args(argv)
    out = Path(args.out)
    inter, items = write_logs(out / "logs")
    fav = favourite_genres(inter, items, out / "logs" / "users.parquet")
    ckpt = out / ("model_quick.ckpt" if args.quick else "model.ckpt")
    if not ckpt.is_file():
        toml = out / "train.toml"
        toml.write_text(TRAIN_TOML.format(minutes=0.3 if args.quick else 1.0))
        train(TrainConfig.from_toml(toml), ckpt, max_steps=150 if args.quick else None)
    dirs = {}
    for name, template in (("template", TEMPLATE), ("plain", None)):
        t = time.perf_counter()
        cfg = PublishConfig(checkpoint=str(ckpt), overarch="mlp", k0=200, candidates=256, filter_template=template)
        dirs[name] = publish_rec(cfg, out / f"snap_{name}", overwrite=True)
        print(f"published {name} in {time.perf_counter() - t:.0f}s")

    users = sorted(fav)
    reqs = {"template": [{"user_id": u, "features": {"fav_genre": fav[u]}} for u in users],
            "plain": [{"user_id": u, "features": {"fav_genre": fav[u]}, "filter": f"genre = '{fav[u]}'"} for u in users]}
    repeat = args.repeat or (15 if args.quick else 41)
    rows, agreement = [], {}
    for backend, batch in [(b, n) for b in ("torchscript", "export") for n in (1, 16, 64)]:
        if batch == 1:  # both sides on the same backend (publish prefers the one it measured faster)
            snaps = {name: silverrec.load(d, backend=backend) for name, d in dirs.items()}
            agreement[backend] = float(np.mean([
                torch.equal(a, b) for i in range(0, len(users), 64)
                for a, b in zip(snaps["template"].recommend(reqs["template"][i:i + 64], k=10).item_ids,
                                snaps["plain"].recommend(reqs["plain"][i:i + 64], k=10).item_ids)]))
            print(f"{backend}: identical top-10 lists on both sides for {agreement[backend]:.3f} of {len(users)} users")
        starts = {"template": 0, "plain": 0}

        def call(side: str) -> None:
            i = starts[side]
            starts[side] = (i + batch) % max(1, len(users) - batch)
            snaps[side].recommend(reqs[side][i:i + batch], k=10)

        tpl, plain = alternate([lambda: call("template"), lambda: call("plain")], repeat, warmup=10)
        row = {"backend": backend, "batch": batch, "template_ms": tpl["median_ms"], "template_p20_ms": tpl["p20_ms"],
               "template_p80_ms": tpl["p80_ms"], "plain_ms": plain["median_ms"], "plain_p20_ms": plain["p20_ms"],
               "plain_p80_ms": plain["p80_ms"], "ratio": plain["median_ms"] / tpl["median_ms"],
               "paired_ratio": plain["paired_ratio_median"], "load_average": plain["load_1min"]}
        rows.append(row)
    fill = fill_rows(snaps["template"], reqs, users, repeat * 5)
    print_table(fill, ["batch", "fill_us", "compile_us", "ratio", "load_average"])
    print_table(rows, ["backend", "batch", "template_ms", "plain_ms", "ratio", "paired_ratio", "load_average"])
    config = {"template": TEMPLATE, "string": "genre = '<fav_genre>'", "users": len(users), "repeat": repeat,
              "k": 10, "identical_top10": agreement,
              "checkpoint": str(ckpt), "quick": args.quick}
    replot(write_results("templates_quick" if args.quick else "templates", config, rows + fill).stem, plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """Per backend: the string filter's time over the template's per batch (paired per round; 1 = no
    difference), and the in-model fill against the request-time compile of the string."""
    rows = [r for r in payload["rows"] if "backend" in r]
    fill = [r for r in payload["rows"] if r.get("part") == "fill vs compile"]
    panels = [Panel("string-filter time / template time (median of per-round ratios)", "batch", "ratio",
                    {b: ([f"batch {r['batch']}" for r in rows if r["backend"] == b], [r["paired_ratio"] for r in rows if r["backend"] == b])
                     for b in dict.fromkeys(r["backend"] for r in rows)}, kind="bar", ref=1.0)]
    if fill:
        cats = [f"batch {r['batch']}" for r in fill]
        panels.append(Panel("the template's fill vs the string's compile", "batch", "us per batch (median)",
                            {"template fill (in the forward)": (cats, [r["fill_us"] for r in fill]),
                             "string compile (predictor)": (cats, [r["compile_us"] for r in fill])}, kind="bar", logy=True))
    save_plot(path, panels, f"filter template vs the same filter as a request string (MovieLens, k {payload['config']['k']})")


if __name__ == "__main__" and not plot_only(plot, "templates"):
    sys.exit(main())
