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

Timing: `snap.recommend(batch, k=10)` on each snapshot's preferred backend, the two sides
alternating call by call (benchmarks/common.py `measure` per call), batch 1 / 16 / 64; `ratio` =
string median / template median (> 1: the template is faster). `agree` = share of top-10 lists
that are identical on both sides. Writes benchmarks/results/templates.json (templates_quick.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from common import measure, print_table, write_results  # noqa: E402
from silverrec.publish.movielens import write_logs  # noqa: E402
from silverrec.publish.rec import PublishConfig, publish_rec  # noqa: E402
from silverrec.publish.train import TrainConfig, train  # noqa: E402

TEMPLATE = "genre = $user.fav_genre AND NOT item_id IN $history"
TRAIN_TOML = """\
interactions = "logs/interactions.parquet"
items = "logs/items.parquet"
users = "logs/users.parquet"
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
    snaps = {}
    for name, template in (("template", TEMPLATE), ("plain", None)):
        t = time.perf_counter()
        cfg = PublishConfig(checkpoint=str(ckpt), overarch="mlp", k0=200, candidates=256, filter_template=template)
        d = publish_rec(cfg, out / f"snap_{name}", overwrite=True)
        snaps[name] = silverrec.load(d)
        print(f"published {name} in {time.perf_counter() - t:.0f}s (backend {snaps[name].backend})")

    users = sorted(fav)
    reqs = {"template": [{"user_id": u, "features": {"fav_genre": fav[u]}} for u in users],
            "plain": [{"user_id": u, "features": {"fav_genre": fav[u]}, "filter": f"genre = '{fav[u]}'"} for u in users]}
    agree = np.mean([torch.equal(a, b) for i in range(0, len(users), 64)
                     for a, b in zip(snaps["template"].recommend(reqs["template"][i:i + 64], k=10).item_ids,
                                     snaps["plain"].recommend(reqs["plain"][i:i + 64], k=10).item_ids)])
    print(f"identical top-10 lists: {agree:.3f} of {len(users)} users")
    repeat = args.repeat or (15 if args.quick else 41)
    rows = []
    for batch in (1, 16, 64):
        starts = {"template": 0, "plain": 0}
        times: dict[str, list[float]] = {"template": [], "plain": []}

        def call(side: str) -> None:
            i = starts[side]
            starts[side] = (i + batch) % max(1, len(users) - batch)
            snaps[side].recommend(reqs[side][i:i + batch], k=10)

        for side in ("template", "plain"):  # warm-up, then the sides alternate call by call
            for _ in range(3):
                call(side)
        order = ("template", "plain")
        for r in range(repeat):
            for side in (order if r % 2 == 0 else order[::-1]):
                times[side].append(measure(lambda: call(side), repeat=1, warmup=0)["median_ms"])
        row = {"batch": batch}
        for side in order:
            ts = sorted(times[side])
            row[f"{side}_ms"] = statistics.median(ts)
            row[f"{side}_p20_ms"] = ts[len(ts) // 5]
            row[f"{side}_p80_ms"] = ts[(4 * len(ts)) // 5]
        row["ratio"] = row["plain_ms"] / row["template_ms"]
        row["paired_ratio"] = statistics.median(p / t for t, p in zip(times["template"], times["plain"]))
        row["load_average"] = os.getloadavg()[0]
        rows.append(row)
    print_table(rows, ["batch", "template_ms", "plain_ms", "ratio", "paired_ratio", "load_average"])
    config = {"template": TEMPLATE, "string": "genre = '<fav_genre>'", "users": len(users), "repeat": repeat,
              "k": 10, "backend": snaps["template"].backend, "identical_top10": float(agree),
              "checkpoint": str(ckpt), "quick": args.quick}
    write_results("templates_quick" if args.quick else "templates", config, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
