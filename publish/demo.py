"""`make demo`: publish a snapshot from the bundled MovieLens data and query it from a fresh process.

1. PureSVD factorisation of the 100,836 ratings -> a 32-d embedding per movie (9,742 movies) and
   per user (610 users).
2. The candidate pool: movie id, embedding, genres (multi-valued) and decade as categorical features
   -> out/demo/movielens_pool.parquet.
3. `silverrec publish` -> out/demo/snapshot-<kind> (atomic, checksummed).
4. `silverrec query` in a fresh process with three users' embeddings as queries; the answers are
   printed with titles next to what the user rated highest.
5. The same users with an attribute filter evaluated inside the model (Bloom signatures on the
   probed clusters, exact NOT): `--filter "genre = Comedy AND NOT decade = '1990s'"`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from silverrec.publish.movielens import factorise, load_movies, load_ratings
from silverrec.publish.pool import write_pool

DEMO_USERS = (1, 42, 414)
DEMO_FILTER = "genre = Comedy AND NOT decade = '1990s'"


def _cli(*args: str) -> str:
    """Run the silverrec CLI in a fresh Python process (as a user would) and return its stdout."""
    proc = subprocess.run([sys.executable, "-m", "silverrec.publish.cli", *args], capture_output=True, text=True)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"silverrec {args[0]} failed with exit code {proc.returncode}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/demo", help="working directory for the pool and snapshots")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--exact", action="store_true", help="publish the exact int8 index instead of the default")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    movies, ratings = load_movies(), load_ratings()
    fact = factorise(dim=32, ratings=ratings, movie_ids=movies.movie_ids)
    print(f"1. factorised {len(ratings.ratings):,} ratings of {len(fact.user_ids)} users "
          f"into {fact.item_factors.shape[1]}-d embeddings ({time.perf_counter() - t0:.1f}s)")

    pool_path = out / "movielens_pool.parquet"
    write_pool(pool_path, movies.movie_ids, fact.item_factors,
               {"genre": movies.genres, "decade": movies.decade})
    print(f"2. wrote the candidate pool: {len(movies.movie_ids):,} movies, features genre, decade -> {pool_path}")

    snap = out / ("snapshot-exact" if args.exact else "snapshot")
    if snap.exists():
        shutil.rmtree(snap)
    publish_args = ["publish", "--pool", str(pool_path), "--out", str(snap)] + (["--exact"] if args.exact else [])
    _cli(*publish_args)
    print(f"3. published {snap}:")
    print("   " + _cli("inspect", str(snap)).replace("\n", "\n   ").rstrip())

    rows = [int(np.flatnonzero(fact.user_ids == u)[0]) for u in DEMO_USERS]
    q_path = out / "queries.npy"
    np.save(q_path, fact.user_factors[rows].astype(np.float32))
    answer = json.loads(_cli("query", str(snap), "--queries", str(q_path), "--k", str(args.k), "--json"))
    print(f"4. answered {len(rows)} queries in a fresh process (silverrec query {snap} --queries {q_path} --k {args.k}):")
    info = {int(m): (t, g, d) for m, t, g, d in zip(movies.movie_ids, movies.titles, movies.genres, movies.decade)}
    _show(answer, ratings, info)
    if not args.exact:
        answer = json.loads(_cli("query", str(snap), "--queries", str(q_path), "--k", str(args.k),
                                 "--filter", DEMO_FILTER, "--json"))
        print(f'\n5. the same users, filtered in-model: --filter "{DEMO_FILTER}"')
        _show(answer, ratings, info)
        for ids in answer["item_ids"]:
            for item in ids:
                _, genres, decade = info[item]
                assert "Comedy" in genres and decade != "1990s", f"filter violated by movie {item}"
        print("\n   every filtered answer checked against movies.csv: all are comedies from outside the 1990s")
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f}s")
    return 0


def _show(answer: dict, ratings, info: dict) -> None:
    """Print each demo user's highest-rated movies and the answer, with titles and features."""
    for user, ids, scores in zip(DEMO_USERS, answer["item_ids"], answer["scores"]):
        mine = ratings.user_ids == user
        liked = ratings.movie_ids[mine][np.argsort(-ratings.ratings[mine], kind="stable")[:3]]
        print(f"\n   user {user} rated highest: " + "; ".join(info[int(m)][0] for m in liked))
        for rank, (item, score) in enumerate(zip(ids, scores), 1):
            title, genres, decade = info[item]
            print(f"     {rank:>2}. {title[:55]:<55} {decade:<6} {'|'.join(genres)[:40]:<40} {score:.3f}")


if __name__ == "__main__":
    sys.exit(main())
