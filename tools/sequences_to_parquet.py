"""Convert a public leave-one-out sequence file (`user item` lines, each user's lines in time order, as
the SASRec reproductions ship them) into silverrec's generic input files (publish/logs.py).

    python tools/sequences_to_parquet.py SASRec/data/Video.txt data/video_games

Writes OUT/interactions.parquet (user_id, item_id int64; timestamp int64 = the line's position in
its user's sequence, 0 first: the files hold no times, only the order) and OUT/items.parquet
(item_id: every item that occurs, ascending; no features). A user's lines must be contiguous, ids
positive integers; anything else stops the conversion naming the line. Nothing is written unless the
whole file converts (both files go to temporary names first).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def read_sequences(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(user ids, item ids) int64 [E] in file order; ValueError naming the first bad line."""
    users, items = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"{path} line {n}: expected 'user item' (two positive integers), got {line.strip()!r}")
            users.append(int(parts[0]))
            items.append(int(parts[1]))
    if not users:
        raise ValueError(f"{path} holds no interactions")
    return np.asarray(users, dtype=np.int64), np.asarray(items, dtype=np.int64)


def positions(users: np.ndarray, path: Path) -> np.ndarray:
    """int64 [E]: each line's position within its user's run; a user whose lines are not contiguous
    is an error (its order across runs would be unknown)."""
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    run_users = users[starts]
    if np.unique(run_users).size != run_users.size:
        dup = run_users[np.flatnonzero(np.bincount(np.unique(run_users, return_inverse=True)[1]) > 1)[0]]
        line = int(starts[np.flatnonzero(run_users == dup)[1]]) + 1
        raise ValueError(f"{path} line {line}: user {int(dup)}'s lines are not contiguous")
    lengths = np.diff(np.r_[starts, users.size])
    return np.arange(users.size) - np.repeat(starts, lengths)


def convert(src: Path, out: Path) -> tuple[Path, Path]:
    users, items = read_sequences(src)
    ts = positions(users, src)
    out.mkdir(parents=True, exist_ok=True)
    inter, pool = out / "interactions.parquet", out / "items.parquet"
    tmp_inter, tmp_pool = inter.with_suffix(".parquet.tmp"), pool.with_suffix(".parquet.tmp")
    pq.write_table(pa.table({"user_id": pa.array(users), "item_id": pa.array(items), "timestamp": pa.array(ts)}), tmp_inter)
    pq.write_table(pa.table({"item_id": pa.array(np.unique(items))}), tmp_pool)
    tmp_inter.replace(inter)
    tmp_pool.replace(pool)
    return inter, pool


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="sequence file: 'user item' lines")
    p.add_argument("out", type=Path, help="output folder (interactions.parquet, items.parquet)")
    a = p.parse_args(argv)
    try:
        inter, pool = convert(a.src, a.out)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t = pq.read_table(inter)
    print(f"wrote {inter} ({t.num_rows:,} interactions, {len(set(t.column('user_id').to_pylist())):,} users) "
          f"and {pool} ({pq.read_metadata(pool).num_rows:,} items)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
