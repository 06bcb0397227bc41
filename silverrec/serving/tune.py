"""`silverrec tune DIR`: the largest batch, how many server processes, and which (batch workers,
intra-op threads, batch window) in each, serve a snapshot best; on a device (--device cuda) one process
whose batch workers are CUDA streams, each with its own graphs and buffers.

    $ silverrec tune snapshots/v1 --seconds 1          # writes snapshots/v1.tune.json
    $ silverrec serve snapshots/v1                      # reads it (or --tune FILE)

Largest batch (`serve --max-batch`): first, in this process at one thread, the same sample requests
are computed in forward calls of b requests for b = 1, 2, 4, ... up to `max_batch` (the sizes in
turn, the order reversed every round, the median per size over the rounds) -> CPU ms per request at
each size (measure_batches). Under
load the batcher forms batches of every size up to its limit (whatever has queued), so a limit
pays only if no size up to it costs more per request than a request alone: kept is the cheapest
size per request among the sizes up to the first that costs more than one alone (1 when batching
does not pay: every size above 1 dearer per request than one alone). serve applies it unless --max-batch is given. The sizes between two
measured powers of two are taken to cost as those around them.

Processes (`serve --workers N`): `silverrec serve DIR --workers N` is started for every N of
`processes` (default 1 and one per core) and driven over HTTP by wrk (serving/loadgen.py) at every
concurrency level, the process counts taken in turn at each level (the order reversed from level to
level, so that a shared machine's load falls on all alike). The HTTP, JSON and scheduling work is what
more processes spread over the cores, so only a load test through the server can choose them. Kept:
the count with the highest throughput relative to each level's best, averaged over the levels (the
fewer processes on a tie); serve starts that many when --workers is not given. Without wrk on PATH
the processes are not measured and serve keeps its default (one per two cores).

Batch workers x threads, per process: for every setting (batch workers = batches computed at once,
threads = torch intra-op threads per batch; by default 1 and the cores of one process's share) and
every concurrency level (closed loop: that many clients, each sending its next request when the last
is answered) the snapshot is driven through the server's batcher (`Batcher` over `Served`, as the app
wires them) in this process, with real request validation and forward calls but no HTTP (the HTTP
cost is the same for every setting and would only add noise on a 2-core machine). Measured:
throughput (requests/s) and p50/p99 latency. The best setting per level: among the settings within
5% of the level's best throughput, the one with the lowest p99. `serve` applies the row of the
largest measured concurrency <= the requests in flight, in each of its processes. The batch window
(`serve --max-wait-ms`, how long a free batch worker beside a busy one may hold a short queue) acts
only with more than one batch worker and a largest batch above 1: then each such setting is
measured with no window and with the time of one request alone, and the window with the highest
throughput relative to each level's best over those settings, averaged over the levels, is kept
(none on a tie); else none.

Bounded: batch sizes x `seconds`, then process counts x levels x `seconds` (at least 1 s each, wrk's
unit) plus a start per count, then settings (x 2 windows) x levels x `seconds`, plus a short warm-up
each.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from silverrec.errors import SilverrecError
from silverrec.serving import loadgen
from silverrec.serving.batcher import Batcher, cores, process_compute
from silverrec.serving.schemas import request_models
from silverrec.serving.served import Served, load_served, run_group

LEVELS = (1, 4, 16, 64)
MIN_ROUNDS = 3  # rounds of the batch sizes, at least, for a median per size


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


def tuned(path: Optional[str | os.PathLike], name: str) -> Optional[int | float]:
    """A server setting `silverrec tune` chose, None if it chose none (or there is no file): "processes"
    or "max_batch" (positive ints), "max_wait_ms" (a number >= 0)."""
    if path is None:
        return None
    try:
        value = json.loads(Path(path).read_text()).get(name)
    except (OSError, ValueError, AttributeError) as e:
        raise SilverrecError(f"cannot read tune file {path}: {type(e).__name__}: {e}") from None
    if value is None:
        return None
    if name == "max_wait_ms":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            raise SilverrecError(f"tune file {path}: max_wait_ms must be a number >= 0, got {value!r}")
    elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SilverrecError(f"tune file {path}: {name} must be a positive int, got {value!r}")
    return value


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


def request_bodies(served, requests: list[dict]) -> list[Any]:
    """The given request bodies (dicts, the JSON of the route the snapshot answers) as the route's models."""
    models = request_models()
    model = models.SearchBody if served.answers == "search" else models.RecommendBody
    try:
        return [model.model_validate(r) for r in requests]
    except ValueError as e:
        raise SilverrecError(f"tune's sample requests do not fit the route's body: {e}") from None


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


def measure_processes(snapshot: str | os.PathLike, counts: tuple[int, ...], levels: tuple[int, ...], seconds: float,
                      route: str, bodies: list[bytes], max_batch: int = 64, max_wait_ms: float = 0.0,
                      log=print) -> list[dict[str, Any]]:
    """`silverrec serve DIR --workers N` for each N in `counts`, driven by wrk at each level -> one row
    per (N, level): throughput, p50 / p99 ms, errors. Every server runs throughout, taken in turn."""
    env = {k: v for k, v in os.environ.items() if k != "SILVERREC_ADMIN_TOKEN"}
    servers, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="silverrec-tune-") as tmp:
        hexed = loadgen.write_bodies(Path(tmp) / "bodies.hex", bodies)
        try:
            for n in counts:
                port = loadgen.free_port()
                workers, threads = process_compute(n)  # serve's own default per process, not a tune file
                cmd = [sys.executable, "-m", "silverrec", "serve", str(snapshot), "--port", str(port), "--workers", str(n),
                       "--batch-workers", str(workers), "--threads", str(threads), "--max-batch", str(max_batch),
                       "--max-wait-ms", str(max_wait_ms)]
                servers[n] = (loadgen.start_server(cmd, port, route, bodies[0], env, name=f"serve --workers {n}"), port)
                loadgen.wrk(port, route, hexed, max(levels), 1)  # warm-up
            for i, c in enumerate(levels):
                for n in (counts if i % 2 == 0 else counts[::-1]):
                    r = loadgen.wrk(servers[n][1], route, hexed, c, seconds)
                    rows.append({"processes": n, "concurrency": c, "throughput": r["throughput"], "p50_ms": r["p50_ms"],
                                 "p99_ms": r["p99_ms"], "errors": r["errors"]})
                    log(f"tune: processes {n} concurrency {c:3d}: {r['throughput']:8.1f} req/s, p50 {r['p50_ms']:7.2f} ms, "
                        f"p99 {r['p99_ms']:7.2f} ms (wrk, HTTP)")
        finally:
            for proc, _ in servers.values():
                loadgen.stop_server(proc)
    return rows


def best_on_average(rows: list[dict[str, Any]], name: str):
    """The value of `name` (e.g. "processes") whose throughput relative to each concurrency level's best,
    averaged over the levels, is highest; the smallest value on a tie. `rows`: one per (value, level)
    with "concurrency" and "throughput" (several per pair: the best of them counts)."""
    top: dict[tuple, float] = {}
    for r in rows:
        pair = (r[name], r["concurrency"])
        top[pair] = max(top.get(pair, 0.0), r["throughput"])
    best: dict[int, float] = {}
    for (_, c), t in top.items():
        best[c] = max(best.get(c, 0.0), t)
    score: dict[Any, list[float]] = {}
    for (value, c), t in top.items():
        score.setdefault(value, []).append(t / best[c] if best[c] else 0.0)
    return max(sorted(score), key=lambda v: sum(score[v]) / len(score[v]))


def batch_sizes(largest: int) -> tuple[int, ...]:
    """The batch sizes tune times: 1, 2, 4, ... below `largest`, then `largest`."""
    if largest < 1:
        raise SilverrecError(f"max_batch must be >= 1, got {largest}")
    sizes, b = [], 1
    while b < largest:
        sizes.append(b)
        b *= 2
    return tuple(sizes + [largest])


def measure_batches(served: Served, bodies: list[Any], prepare: str, sizes: tuple[int, ...], seconds: float,
                    log=print) -> list[dict[str, Any]]:
    """The CPU time per request of the batcher's forward call (run_group) at each batch size in `sizes`,
    in this process at the caller's torch threads. Every round, every size computes the same
    max(sizes) sample requests (of the samples' most common group, the same options; taken in turn
    from round to round) in consecutive batches of that size, the sizes in turn and their order
    reversed every round; at least MIN_ROUNDS rounds and `seconds` per size. -> one row per size:
    {"batch", "ms_per_request" (the median over the rounds), "rounds"}. The same requests at every
    size, since a request's cost depends on it (a filter's selectivity); CPU time, not wall time,
    since on a shared machine the other jobs take wall time at random."""
    prepared = [getattr(served, prepare)(body) for body in bodies]
    groups: dict[Any, list[Any]] = {}
    for key, payload in prepared:
        groups.setdefault(key, []).append(payload)
    key, pool = max(groups.items(), key=lambda kv: len(kv[1]))
    n = max(sizes)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    run_group(key, pool[:n])  # warm-up
    stop, rounds = time.perf_counter() + seconds * len(sizes), 0
    while rounds < MIN_ROUNDS or time.perf_counter() < stop:
        requests = [pool[(rounds * n + i) % len(pool)] for i in range(n)]
        for b in (sizes if rounds % 2 == 0 else sizes[::-1]):
            t0 = time.process_time()
            for start in range(0, n, b):
                run_group(key, requests[start:start + b])
            times[b].append((time.process_time() - t0) * 1000 / n)
        rounds += 1
    rows = [{"batch": b, "ms_per_request": float(np.median(times[b])), "rounds": rounds} for b in sizes]
    for r in rows:
        log(f"tune: batch {r['batch']:3d}: {r['ms_per_request']:7.3f} ms CPU per request (median of {rounds} rounds)")
    return rows


def choose_max_batch(rows: list[dict[str, Any]]) -> int:
    """The largest batch for the server: the size with the lowest ms per request among the sizes up to
    the first that costs more per request than a request alone (under load the batcher forms every
    size up to its limit); the smaller on a tie; 1 when no size above 1 is cheaper than one alone.
    `rows`: measure_batches' rows, one of them batch 1."""
    rows = sorted(rows, key=lambda r: r["batch"])
    if not rows or rows[0]["batch"] != 1:
        raise SilverrecError("choosing a batch size needs the cost of a request alone (batch 1)")
    alone = rows[0]["ms_per_request"]
    paying = []
    for r in rows:
        if r["ms_per_request"] > alone:
            break
        paying.append(r)
    return min(paying, key=lambda r: (r["ms_per_request"], r["batch"]))["batch"]


def tune(snapshot: str | os.PathLike, out: Optional[str | os.PathLike] = None, seconds: float = 1.0,
         workers: Optional[tuple[int, ...]] = None, threads: Optional[tuple[int, ...]] = None,
         levels: tuple[int, ...] = LEVELS, max_batch: int = 64, max_wait_ms: Optional[float] = None,
         processes: Optional[tuple[int, ...]] = None, requests: Optional[list[dict]] = None,
         device: str = "cpu", log=print) -> dict[str, Any]:
    """Choose the largest batch (the sizes up to `max_batch` timed in-process), then measure the server
    process counts `processes` over HTTP (default 1 and one per core, when wrk is on PATH; () skips),
    then every (batch workers `workers`, threads) in-process (default 1 and the cores of one process's
    share, each), with the batch window (`max_wait_ms`; None: measured where it acts), at every
    concurrency level; write and return the table. `requests`: sample request bodies (the JSON of the
    route the snapshot answers) standing for the served traffic; default: generated ones.

    On a device one process owns it and each batch worker runs its batches on its own CUDA stream (the
    snapshot is loaded with max(workers) streams, silverrec/serving/device.py StreamPool), so the batch
    workers chosen per level are that load's stream count; default workers there: 1, 2, 4."""
    gpu = device != "cpu"
    if gpu:
        processes, workers = (1,), workers or (1, 2, 4)
    served = load_served(snapshot, device=device, streams=max(workers) if gpu else 1)
    prepare = "prepare_search" if served.answers == "search" else "prepare_recommend"
    bodies = request_bodies(served, requests) if requests else sample_bodies(served, 512)
    default_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch_rows = measure_batches(served, bodies, prepare, batch_sizes(max_batch), min(seconds, 1.0), log)
    finally:
        torch.set_num_threads(default_threads)
    chosen_batch = choose_max_batch(batch_rows)
    log(f"tune: largest batch {chosen_batch} (serve --max-batch {chosen_batch})")
    process_rows, chosen, skipped = [], None, None
    if processes is None:
        processes = tuple(sorted({1, cores()}))
        if not loadgen.available():
            processes, skipped = (), "wrk is not on PATH (Debian: apt-get install wrk)"
            log(f"tune: server processes not measured: {skipped}; serve keeps its default")
    if len(processes) == 1:  # one count asked for: the batch workers are tuned for its share, nothing to compare
        chosen = processes[0]
    elif processes:
        route = "/v1/search" if served.answers == "search" else "/v1/recommend"
        raw = [b.model_dump_json(exclude_unset=True).encode() for b in bodies]
        process_rows = measure_processes(snapshot, tuple(processes), levels, seconds, route, raw, chosen_batch,
                                         max_wait_ms or 0.0, log)
        chosen = best_on_average(process_rows, "processes")
        log(f"tune: {chosen} server process{'es' if chosen > 1 else ''} (serve --workers {chosen})")
    share = max(1, cores() // (chosen or 1))
    workers = workers or tuple(sorted({1, share}))
    threads = threads or tuple(sorted({1, share}))
    if max_wait_ms is not None:
        windows = (float(max_wait_ms),)
    elif chosen_batch > 1 and max(workers) > 1:  # the window acts: a free worker beside a busy one
        windows = tuple(sorted({0.0, round(batch_rows[0]["ms_per_request"], 3)}))
    else:
        windows = (0.0,)
    results = []

    async def run_setting(w: int, t: int, window: float):
        batcher = Batcher(run_group, max_batch=chosen_batch, max_wait_ms=window, workers=w, threads=t)
        torch.set_num_threads(t)
        await batcher.start()
        try:
            await closed_loop(served, batcher, bodies, prepare, max(levels), min(0.3, seconds))  # warm-up
            for c in levels:
                row = {"batch_workers": w, "threads": t, "max_wait_ms": window, "concurrency": c,
                       **await closed_loop(served, batcher, bodies, prepare, c, seconds)}
                results.append(row)
                log(f"tune: batch workers {w} threads {t} window {window:g} ms concurrency {c:3d}: "
                    f"{row['throughput']:8.1f} req/s, p50 {row['p50_ms']:7.2f} ms, p99 {row['p99_ms']:7.2f} ms")
        finally:
            await batcher.stop()

    try:
        for w in workers:
            for t in threads:
                for window in windows:
                    if w > 1 or window == windows[0]:  # one worker never holds a queue: one window will do
                        asyncio.run(run_setting(w, t, window))
    finally:
        torch.set_num_threads(default_threads)
    # the windows compared where they act (more than one batch worker); one worker's rows stand for any
    acting = [r for r in results if r["batch_workers"] > 1]
    chosen_window = best_on_average(acting, "max_wait_ms") if len(windows) > 1 else windows[0]
    log(f"tune: batch window {chosen_window:g} ms (serve --max-wait-ms {chosen_window:g})")
    best = []
    for c in levels:
        rows = [r for r in results if r["concurrency"] == c and (r["max_wait_ms"] == chosen_window or
                                                                  r["batch_workers"] == 1)]
        top = max(r["throughput"] for r in rows)
        near = [r for r in rows if r["throughput"] >= 0.95 * top]
        pick = min(near, key=lambda r: r["p99_ms"])
        best.append({k: pick[k] for k in ("concurrency", "batch_workers", "threads", "throughput", "p99_ms")})
    table = {"snapshot": str(Path(snapshot).resolve()), "version": served.version, "kind": served.kind, "device": device,
             "seconds": seconds, "max_batch": chosen_batch, "max_wait_ms": chosen_window, "cpu_count": os.cpu_count(),
             "torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "processes": chosen, "batch_results": batch_rows, "process_results": process_rows, "results": results,
             "best": best}
    if skipped:
        table["processes_skipped"] = skipped
    out = Path(out) if out else default_tune_path(snapshot)
    out.write_text(json.dumps(table, indent=2))
    log(f"tune: wrote {out}")
    return table
