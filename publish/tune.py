"""`silverrec tune DIR`: which (workers, intra-op threads) serve a snapshot best at each concurrency.

    $ silverrec tune snapshots/v1 --seconds 1          # writes snapshots/v1.tune.json
    $ silverrec serve snapshots/v1                      # reads it (or --tune FILE)

For every setting (workers = batches computed at once, threads = torch intra-op threads) and every
concurrency level (closed loop: that many clients, each sending its next request when the last is
answered) the snapshot is driven through the server's own batcher in this process, with real
request validation and forward calls but no HTTP (the HTTP cost is the same for every setting and
would only add noise on a 2-core machine). Measured: throughput (requests/s) and p50/p99 latency.
The best setting per level: among the settings within 5% of the level's best throughput, the one
with the lowest p99.
`serve` applies the row of the largest measured concurrency <= the requests in flight.

Bounded: settings x levels x `seconds` (default 4 x 4 x 1 s, plus a short warm-up each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from silverrec.errors import SilverrecError

LEVELS = (1, 4, 16, 64)


def default_tune_path(snapshot: str | os.PathLike) -> Path:
    p = Path(snapshot).resolve()
    return p.with_name(p.name + ".tune.json")


def sample_bodies(served, n: int, seed: int = 0) -> list[Any]:
    """n valid one-row request bodies for the served snapshot (search: random queries; rec: histories)."""
    from silverrec.serving.server import _models

    SearchBody, _, RecommendBody, _, _ = _models()
    rng = np.random.default_rng(seed)
    if served.answers == "search":
        q = rng.standard_normal((n, int(served.snap.config["dim"]))).astype(np.float32)
        return [SearchBody(queries=[row.tolist()], k=10) for row in q]
    if served.answers == "recommend":
        ids = served.handler.row_to_item
        return [RecommendBody(history=[int(x) for x in rng.choice(ids, 10)], k=10) for _ in range(n)]
    if served.answers == "generative":
        ids = served.snap.generative_item_ids()
        return [RecommendBody(history=[int(x) for x in rng.choice(ids, 5)], k=10) for _ in range(n)]
    raise SilverrecError(f"cannot tune a {served.kind!r} snapshot")


async def closed_loop(server, bodies: list[Any], prepare: str, concurrency: int, seconds: float) -> dict[str, float]:
    """`concurrency` clients, each sending the next request when the last is answered, for `seconds`."""
    lat: list[float] = []
    stop = time.perf_counter() + seconds

    async def client(c: int):
        i = c
        while time.perf_counter() < stop:
            body = bodies[i % len(bodies)]
            i += concurrency
            t0 = time.perf_counter()
            key, payload = getattr(server.current, prepare)(body)
            await server.batcher.submit(key, payload)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    wall = time.perf_counter() - t0
    ms = np.asarray(lat) * 1000
    return {"requests": len(lat), "throughput": len(lat) / wall, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99))}


def tune(snapshot: str | os.PathLike, out: Optional[str | os.PathLike] = None, seconds: float = 1.0,
         workers: tuple[int, ...] = (1, 2), threads: tuple[int, ...] = (1, 2), levels: tuple[int, ...] = LEVELS,
         max_batch: int = 32, max_wait_ms: float = 2.0, log=print) -> dict[str, Any]:
    """Measure every (workers, threads) at every concurrency level; write and return the table."""
    from silverrec.serving.server import ServeConfig, Server, load_served

    served = load_served(snapshot)
    prepare = "prepare_search" if served.answers == "search" else "prepare_recommend"
    bodies = sample_bodies(served, 512)
    results = []

    async def run_setting(w: int, t: int):
        server = Server(snapshot, ServeConfig(port=0, max_batch=max_batch, max_wait_ms=max_wait_ms, workers=w,
                                              threads=t), served)
        await server.start()
        try:
            await closed_loop(server, bodies, prepare, max(levels), min(0.3, seconds))  # warm-up
            for c in levels:
                row = {"workers": w, "threads": t, "concurrency": c,
                       **await closed_loop(server, bodies, prepare, c, seconds)}
                results.append(row)
                log(f"tune: workers {w} threads {t} concurrency {c:3d}: {row['throughput']:8.1f} req/s, "
                    f"p50 {row['p50_ms']:7.2f} ms, p99 {row['p99_ms']:7.2f} ms")
        finally:
            await server.stop()

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
        best.append({k: pick[k] for k in ("concurrency", "workers", "threads", "throughput", "p99_ms")})
    table = {"snapshot": str(Path(snapshot).resolve()), "version": served.version, "kind": served.kind,
             "seconds": seconds, "max_batch": max_batch, "max_wait_ms": max_wait_ms, "cpu_count": os.cpu_count(),
             "torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": results,
             "best": best}
    out = Path(out) if out else default_tune_path(snapshot)
    out.write_text(json.dumps(table, indent=2))
    log(f"tune: wrote {out}")
    return table


# ----------------------------------------------------------------------------------- CLI

def _serve(args: argparse.Namespace) -> int:
    from silverrec.serving.server import ServeConfig, read_token, serve

    tune_file = args.tune
    if tune_file is None and args.workers is None and args.threads is None:
        sibling = default_tune_path(args.snapshot)
        tune_file = str(sibling) if sibling.is_file() else None
    config = ServeConfig(host=args.host, port=args.port, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                         max_queue=args.max_queue, workers=args.workers or 1, threads=args.threads,
                         max_body_bytes=args.max_body_bytes, deadline_ms=args.deadline_ms,
                         admin_token=read_token(args.admin_token_file), tune_file=tune_file, device=args.device)
    if args.sharded:  # torchrun (RANK / WORLD_SIZE / MASTER_ADDR) or --rank / --world-size / --init-method
        from silverrec.serving.distributed import serve_http

        return serve_http(args.snapshot, config, rank=args.rank, world_size=args.world_size,
                          init_method=args.init_method, timeout_s=args.shard_timeout)
    return serve(args.snapshot, config)


def _tune(args: argparse.Namespace) -> int:
    levels = tuple(int(x) for x in args.concurrency.split(","))
    if not levels or min(levels) < 1:
        raise SilverrecError(f"--concurrency must list positive ints, got {args.concurrency!r}")
    tune(args.snapshot, args.out, seconds=args.seconds, levels=levels, max_batch=args.max_batch,
         max_wait_ms=args.max_wait_ms, log=lambda s: print(s, file=sys.stderr))
    return 0


def add_serve_parsers(sub) -> None:
    """The `serve` and `tune` subcommands (publish/cli.py)."""
    s = sub.add_parser("serve", help="serve a snapshot over HTTP (batching, deadlines, metrics, hot reload)")
    s.add_argument("snapshot")
    s.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs an admin token)")
    s.add_argument("--port", type=int, default=8080, help="0 = an ephemeral port (printed)")
    s.add_argument("--max-batch", dest="max_batch", type=int, default=32, help="requests per batch (default 32)")
    s.add_argument("--max-wait-ms", dest="max_wait_ms", type=float, default=5.0,
                   help="a batch closes when its oldest request waited this long (default 5)")
    s.add_argument("--max-queue", dest="max_queue", type=int, default=1024, help="queued requests before 503 (default 1024)")
    s.add_argument("--workers", type=int, default=None, help="batches computed at once (default 1, or the tune file)")
    s.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default torch's, or the tune file)")
    s.add_argument("--tune", default=None, help="silverrec tune's file (default DIR.tune.json if it exists)")
    s.add_argument("--device", default="cpu", help="where the program runs: cpu (default), cuda, cuda:N")
    s.add_argument("--max-body-bytes", dest="max_body_bytes", type=int, default=4 << 20, help="413 above (default 4 MiB)")
    s.add_argument("--deadline-ms", dest="deadline_ms", type=float, default=None,
                   help="default per-request deadline (X-Deadline-Ms or body deadline_ms override it)")
    s.add_argument("--admin-token-file", dest="admin_token_file", default=None,
                   help="file holding the reload token (else $SILVERREC_ADMIN_TOKEN)")
    s.add_argument("--sharded", action="store_true",
                   help="serve a sharded snapshot across torch.distributed ranks (launch with torchrun "
                        "--nproc-per-node N -m silverrec serve DIR --sharded): rank 0 serves HTTP")
    s.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)), help="--sharded: this rank (default $RANK)")
    s.add_argument("--world-size", dest="world_size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                   help="--sharded: number of ranks (default $WORLD_SIZE)")
    s.add_argument("--init-method", dest="init_method", default="env://",
                   help="--sharded: rendezvous (default env://, as torchrun sets; or tcp://HOST:PORT)")
    s.add_argument("--shard-timeout", dest="shard_timeout", type=float, default=5.0,
                   help="--sharded: seconds before a request waiting on a dead or stalled rank fails with 503 (default 5)")
    s.set_defaults(func=_serve)

    t = sub.add_parser("tune", help="measure workers x intra-op threads per concurrency; write the file serve reads")
    t.add_argument("snapshot")
    t.add_argument("--out", default=None, help="output JSON (default DIR.tune.json)")
    t.add_argument("--seconds", type=float, default=1.0, help="per setting and concurrency level (default 1)")
    t.add_argument("--concurrency", default=",".join(map(str, LEVELS)), help="levels, e.g. 1,4,16,64")
    t.add_argument("--max-batch", dest="max_batch", type=int, default=32)
    t.add_argument("--max-wait-ms", dest="max_wait_ms", type=float, default=2.0)
    t.set_defaults(func=_tune)
