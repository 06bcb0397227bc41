"""`silverrec tune DIR`: which (batch workers, intra-op threads) serve a snapshot best at each concurrency.

    $ silverrec tune snapshots/v1 --seconds 1          # writes snapshots/v1.tune.json
    $ silverrec serve snapshots/v1                      # reads it (or --tune FILE)

For every setting (batch workers = batches computed at once, threads = torch intra-op threads per batch) and every
concurrency level (closed loop: that many clients, each sending its next request when the last is
answered) the snapshot is driven through the server's batcher (`Batcher` over `Served`, as the app
wires them) in this process, with real request validation and forward calls but no HTTP (the HTTP cost is the same for every setting and
would only add noise on a 2-core machine). Measured: throughput (requests/s) and p50/p99 latency.
The best setting per level: among the settings within 5% of the level's best throughput, the one
with the lowest p99.
`serve` applies the row of the largest measured concurrency <= the requests in flight.

Bounded: settings x levels x `seconds` (default 4 x 4 x 1 s, plus a short warm-up each).

The table is for one server process: with `silverrec serve --workers N` (N processes) every process
applies it to its own requests in flight, so tune on a machine with the cores one process gets.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from silverrec.errors import SilverrecError
from silverrec.serving.schemas import request_models
from silverrec.serving.batcher import Batcher
from silverrec.serving.served import Served, load_served, run_group

LEVELS = (1, 4, 16, 64)


class TunePolicy:
    """`silverrec tune`'s table: for each concurrency level, the best (batch workers, threads).

    `policy(in_flight)` picks the row of the largest measured concurrency <= in_flight (the smallest
    row below that)."""

    def __init__(self, rows: list[dict[str, Any]]):
        if not rows:
            raise SilverrecError("tune file has no 'best' rows")
        self.rows = sorted(rows, key=lambda r: r["concurrency"])
        self.max_workers = max(int(r["batch_workers"]) for r in self.rows)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TunePolicy":
        try:
            data = json.loads(Path(path).read_text())
            rows = [{"concurrency": int(r["concurrency"]), "batch_workers": int(r["batch_workers"]),
                     "threads": int(r["threads"])} for r in data["best"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SilverrecError(f"cannot read tune file {path}: {type(e).__name__}: {e}") from None
        return cls(rows)

    def __call__(self, in_flight: int) -> tuple[int, int]:
        row = self.rows[0]
        for r in self.rows:
            if r["concurrency"] <= in_flight:
                row = r
        return row["batch_workers"], row["threads"]


def default_tune_path(snapshot: str | os.PathLike) -> Path:
    """DIR.tune.json beside the snapshot DIR: written by `silverrec tune`, read by `silverrec serve`."""
    p = Path(snapshot).resolve()
    return p.with_name(p.name + ".tune.json")


def sample_bodies(served, n: int, seed: int = 0) -> list[Any]:
    """n valid one-row request bodies for the served snapshot (search: random queries; rec: histories)."""
    models = request_models()
    SearchBody, RecommendBody = models.SearchBody, models.RecommendBody
    rng = np.random.default_rng(seed)
    if served.answers == "search":
        q = rng.standard_normal((n, int(served.snap.config["dim"]))).astype(np.float32)
        return [SearchBody(queries=[row.tolist()], k=10) for row in q]
    if served.answers == "recommend":
        ids = served.handler.row_to_item
        return [RecommendBody(history=[int(x) for x in rng.choice(ids, 10)], k=10) for _ in range(n)]
    raise SilverrecError(f"cannot tune a {served.kind!r} snapshot")


async def closed_loop(served: Served, batcher: Batcher, bodies: list[Any], prepare: str, concurrency: int,
                      seconds: float) -> dict[str, float]:
    """`concurrency` clients, each sending the next request when the last is answered, for `seconds`."""
    lat: list[float] = []
    stop = time.perf_counter() + seconds

    async def client(c: int):
        i = c
        while time.perf_counter() < stop:
            body = bodies[i % len(bodies)]
            i += concurrency
            t0 = time.perf_counter()
            key, payload = getattr(served, prepare)(body)
            await batcher.submit(key, payload)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    wall = time.perf_counter() - t0
    ms = np.asarray(lat) * 1000
    return {"requests": len(lat), "throughput": len(lat) / wall, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99))}


def tune(snapshot: str | os.PathLike, out: Optional[str | os.PathLike] = None, seconds: float = 1.0,
         workers: tuple[int, ...] = (1, 2), threads: tuple[int, ...] = (1, 2), levels: tuple[int, ...] = LEVELS,
         max_batch: int = 64, max_wait_ms: float = 0.0, log=print) -> dict[str, Any]:
    """Measure every (batch workers `workers`, threads) at every concurrency level; write and return the table."""
    served = load_served(snapshot)
    prepare = "prepare_search" if served.answers == "search" else "prepare_recommend"
    bodies = sample_bodies(served, 512)
    results = []

    async def run_setting(w: int, t: int):
        batcher = Batcher(run_group, max_batch=max_batch, max_wait_ms=max_wait_ms, workers=w, threads=t)
        torch.set_num_threads(t)
        await batcher.start()
        try:
            await closed_loop(served, batcher, bodies, prepare, max(levels), min(0.3, seconds))  # warm-up
            for c in levels:
                row = {"batch_workers": w, "threads": t, "concurrency": c,
                       **await closed_loop(served, batcher, bodies, prepare, c, seconds)}
                results.append(row)
                log(f"tune: batch workers {w} threads {t} concurrency {c:3d}: {row['throughput']:8.1f} req/s, "
                    f"p50 {row['p50_ms']:7.2f} ms, p99 {row['p99_ms']:7.2f} ms")
        finally:
            await batcher.stop()

    default_threads = torch.get_num_threads()
    try:
        for w in workers:
            for t in threads:
                asyncio.run(run_setting(w, t))
    finally:
        torch.set_num_threads(default_threads)
    best = []
    for c in levels:
        rows = [r for r in results if r["concurrency"] == c]
        top = max(r["throughput"] for r in rows)
        near = [r for r in rows if r["throughput"] >= 0.95 * top]
        pick = min(near, key=lambda r: r["p99_ms"])
        best.append({k: pick[k] for k in ("concurrency", "batch_workers", "threads", "throughput", "p99_ms")})
    table = {"snapshot": str(Path(snapshot).resolve()), "version": served.version, "kind": served.kind,
             "seconds": seconds, "max_batch": max_batch, "max_wait_ms": max_wait_ms, "cpu_count": os.cpu_count(),
             "torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": results,
             "best": best}
    out = Path(out) if out else default_tune_path(snapshot)
    out.write_text(json.dumps(table, indent=2))
    log(f"tune: wrote {out}")
    return table
