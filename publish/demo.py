"""`make demo`: the recommendation model on the bundled MovieLens, from logs to ranked items.

1. Convert MovieLens ml-latest-small into the generic input files (interactions.parquet with a
   `rating` label, items.parquet with genre and decade features) -> out/demo/logs/.
2. `silverrec train --config out/demo/train.toml`: the two-tower model (the sequential user tower,
   which measured ahead of the pooled one on MovieLens; two tasks: "interacted" and "liked" =
   rating >= 4), early-stopped on the validation items, and the OverArch rankers (MLP,
   mixture-of-logits, list-wise).
   A second run reuses the checkpoint when the logs and the config are unchanged.
3. `silverrec publish --config out/demo/publish.toml`: one snapshot (user tower, int8 IVF, Bloom
   filter bank, embedding cache, OverArch, value model, next-item transitions with their window,
   decay and weight chosen on the validation items) -> out/demo/snapshot.
4. `silverrec recommend` in a fresh process for a few users, with titles, then the same users with a
   filter evaluated in-model, every answer checked against movies.csv.
5. The quality table (leave-one-out, full ranking, history masked): popularity, PureSVD, EASE,
   two-tower exact, IVF, IVF + re-score, + OverArch MLP, + MoL, multi-task + value model, + next-item
   transitions (the published list).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from silverrec.publish.movielens import load_movies, write_logs

DEMO_USERS = (1, 42, 414)
DEMO_FILTER = "genre = Comedy AND NOT decade = '1990s'"

TRAIN_TOML = """\
# silverrec train --config train.toml: generic logs in, checkpoint out
interactions = "logs/interactions.parquet"
items = "logs/items.parquet"
dim = 64
history_len = 50
recent_len = 5
user_tower = "sequence"   # a causal transformer over the history: above the pooled "bag" tower on MovieLens (docs/recommendation.md)
minutes = {minutes}            # two-tower budget: a cap, as validation NDCG@10 stops it earlier
batch = 64
valid_every = 80       # steps between early-stopping evaluations
patience = 4           # evaluations without a better one before it stops
overarch_minutes = {overarch_minutes}   # per OverArch kind
overarch = ["mlp", "mol", "listwise"]
k0 = 200
seed = {seed}

[[tasks]]
name = "interacted"

[[tasks]]
name = "liked"
label = "rating"
min = 4.0
"""

PUBLISH_TOML = """\
# silverrec publish --config publish.toml --out snapshot
checkpoint = "model.ckpt"
overarch = "mol"
merge = "union"
k0 = 200
candidates = 256       # ranked per request: the 2 tasks' lists rank by rank (their union: mean 245, p90 279)
quantize = "auto"      # int8 user-tower tables where their top-100 agrees with fp32's
transitions = 100      # the newest history item's 100 likeliest next items join the candidates (value + w * P;
                       # the chain's window and decay and w chosen on the validation items)

[value_model]          # the final score: a formula over the task scores (and item features)
weights = {{ interacted = 1.0, liked = 0.5 }}
"""


def _cli(*args: str, progress: bool = False) -> str:
    """Run the silverrec CLI in a fresh Python process (as a user would) and return its stdout;
    `progress`: its stderr (progress bars) goes to this terminal as it runs."""
    proc = subprocess.run([sys.executable, "-m", "silverrec", *args], stdout=subprocess.PIPE,
                          stderr=None if progress else subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr or "")
        raise SystemExit(f"silverrec {args[0]} failed with exit code {proc.returncode}")
    return proc.stdout


def _fingerprint(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/demo", help="working directory")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--minutes", type=float, default=12.0, help="two-tower training budget (a cap: early stopping ends it)")
    p.add_argument("--overarch-minutes", dest="overarch_minutes", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--retrain", action="store_true", help="train even when a matching checkpoint exists")
    p.add_argument("--no-table", dest="table", action="store_false", help="skip the quality table")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    inter, items = write_logs(out / "logs")
    print(f"1. wrote the generic input files: {inter} (user_id, item_id, timestamp, rating), {items} (genre, decade)", flush=True)

    train_toml, publish_toml = out / "train.toml", out / "publish.toml"
    train_toml.write_text(TRAIN_TOML.format(minutes=args.minutes, overarch_minutes=args.overarch_minutes, seed=args.seed))
    publish_toml.write_text(PUBLISH_TOML.format())
    ckpt, stamp = out / "model.ckpt", out / "model.ckpt.fingerprint"
    fp = _fingerprint(inter, items, train_toml)
    if not args.retrain and ckpt.is_file() and stamp.is_file() and stamp.read_text() == fp:
        print(f"2. reusing {ckpt} (same logs and config; --retrain to train again)")
    else:
        t = time.perf_counter()
        print(f"2. training the two-tower model (at most {args.minutes:g} minutes, early-stopped) and the OverArch "
              "rankers ...", flush=True)
        _cli("train", "--config", str(train_toml), "--out", str(ckpt), progress=True)
        stamp.write_text(fp)
        print(f"2. trained the two-tower model and the OverArch rankers -> {ckpt} ({time.perf_counter() - t:.0f}s)")

    snap = out / "snapshot"
    t = time.perf_counter()
    _cli("publish", "--config", str(publish_toml), "--out", str(snap), "--overwrite")
    manifest = json.loads((snap / "manifest.json").read_text())
    cfg = manifest["config"]
    q = cfg["quantization_user_tower"]
    print(f"3. published {snap} ({time.perf_counter() - t:.0f}s): {manifest['item_count']:,} items, "
          f"{cfg['bytes_per_item']['total']:.0f} bytes/item, user tower tables {q['tables']} "
          f"(int8 top-100 overlap {q.get('int8_top100_overlap', float('nan')):.3f}), OverArch {cfg['spec']['overarch']}, "
          f"value model {cfg['spec']['value_model']}")

    movies = load_movies()
    info = {int(m): (t, g, d) for m, t, g, d in zip(movies.movie_ids, movies.titles, movies.genres, movies.decade)}
    users = np.load(snap / "users.npz")
    for filt in (None, DEMO_FILTER):
        head = "4. recommendations" if filt is None else f'\n5. the same users, filtered in-model: --filter "{filt}"'
        users_arg = ",".join(map(str, DEMO_USERS))
        print(f"{head} (silverrec recommend {snap} --user {users_arg} --k {args.k}, in a fresh process):")
        extra = ["--filter", filt] if filt else []
        answer = json.loads(_cli("recommend", str(snap), "--user", users_arg, "--k", str(args.k), "--json", *extra))
        for b, user in enumerate(DEMO_USERS):
            i = int(np.searchsorted(users["user_ids"], user))
            hist = users["item_ids"][users["offsets"][i]:users["offsets"][i + 1]]
            print(f"\n   user {user}, {len(hist)} movies seen, the last three: " + "; ".join(info[int(m)][0] for m in hist[-3:]))
            for rank, (item, score) in enumerate(zip(answer["item_ids"][b], answer["scores"][b]), 1):
                title, genres, decade = info[item]
                print(f"     {rank:>2}. {title[:52]:<52} {decade:<6} {'|'.join(genres)[:38]:<38} {score:7.3f}")
                assert item not in set(hist.tolist()), f"movie {item} of user {user}'s history was recommended"
                if filt:
                    assert "Comedy" in genres and decade != "1990s", f"filter violated by movie {item}"
        if filt:
            print("\n   every filtered answer checked against movies.csv: all comedies from outside the 1990s")

    if args.table:
        from silverrec.publish.logs import leave_one_out, read_logs
        from silverrec.publish.quality import format_table, quality_table
        from silverrec.publish.rec import PublishConfig, build_rec_model
        from silverrec.publish.train import load_checkpoint

        import os

        os.environ["SILVERREC_QUIET"] = "1"  # the in-process build below repeats step 3's progress output
        t = time.perf_counter()
        ck = load_checkpoint(ckpt)
        split = leave_one_out(read_logs(inter, items, seed=args.seed))
        built = build_rec_model(PublishConfig.from_toml(publish_toml), ck)
        rows = quality_table(ck, built, split, log=lambda msg: None)
        print(f"\n6. quality on MovieLens ml-latest-small: leave-one-out, {len(split.eval_users)} test users, "
              f"full ranking over {split.logs.item_ids.shape[0]:,} items, history masked, seed {args.seed} "
              f"({time.perf_counter() - t:.0f}s)\n")
        print("   " + format_table(rows).replace("\n", "\n   "))
        (out / "quality.json").write_text(json.dumps(rows, indent=2))
    print(f"\ndemo finished in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
