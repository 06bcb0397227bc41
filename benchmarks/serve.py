"""Load test of `silverrec serve` on loopback, against what users would run instead.

    .venv/bin/python benchmarks/serve.py            # about 4 minutes; make bench-serve adds Ray Serve
    .venv/bin/python benchmarks/serve.py --quick    # about 1 minute

Servers (each its own process, the same snapshot: an exact int8 index of 50,000 x 64 items):
    batched     silverrec serve, max batch 32, max wait 2 ms
    unbatched   silverrec serve, max batch 1 (same stack, batching off)
    plain       a plain FastAPI endpoint calling snap.search per request (sync def, threadpool)
    ray         Ray Serve, @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002) around the same
                snapshot (needs ray: `make bench-serve` installs it into .venv/ray)

Load (this process, raw HTTP/1.1 keep-alive on asyncio, one 1-row k=10 query per request):
    closed loop at concurrency 1, 4, 16, 32, 64 (C clients, each sends when answered);
    open loop at 70% of the batched server's peak: Poisson vs uniform arrivals at the same rate;
    a run with 10% bad requests (wrong dimension, k = 0, malformed JSON, NaN) at concurrency 32;
    a run with 10 reloads (alternating two snapshot versions) under concurrency-16 load.
Latency is measured from the intended send time (open loop: the scheduled arrival), so client-side
queueing counts. Client and server share this machine's cores: every server pays the same client.
Writes benchmarks/results/serve.json and serve.png.
"""


import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, Panel, machine_info, plot_only, print_table, replot, save_plot  # noqa: E402

WORK = ROOT / "out" / "bench_serve"
N_ITEMS, DIM, K = 50_000, 64, 10
TOKEN = "bench-token"
RAY_PYTHON = ROOT / ".venv" / "ray" / "bin" / "python"


# ------------------------------------------------------------------------------------ snapshots

def snapshots() -> tuple[Path, Path]:
    """Two versions of the exact snapshot (built once, cached under out/bench_serve)."""
    from silverrec.publish.filtered_ivf import publish_index
    from silverrec.publish.pool import read_pool, write_pool

    WORK.mkdir(parents=True, exist_ok=True)
    out = []
    for name in ("v1", "v2"):
        path = WORK / name
        if not (path / "manifest.json").is_file():
            rng = np.random.default_rng(0)
            emb = rng.standard_normal((N_ITEMS, DIM)).astype(np.float32)
            pool = WORK / "pool.parquet"
            if not pool.is_file():
                write_pool(pool, np.arange(N_ITEMS, dtype=np.int64) * 3 + 1, emb)
            publish_index(read_pool(pool), path, exact=True, torchscript=False, overwrite=True)
        out.append(path)
    return out[0], out[1]


# ------------------------------------------------------------------------------------ servers

def plain_app(path: str):
    """What a user writes first: FastAPI, one snap.search per request, no batching."""
    import torch
    from fastapi import FastAPI
    from pydantic import BaseModel

    import silverrec

    snap = silverrec.load(path)
    app = FastAPI()

    class Body(BaseModel):
        queries: list[list[float]]
        k: int = 10

    @app.post("/v1/search")
    def search(body: Body):
        res = snap.search(torch.tensor(body.queries, dtype=torch.float32), body.k)
        return {"item_ids": res.item_ids.tolist(), "scores": res.scores.tolist()}

    return app


def ray_main(path: str, port: int) -> None:
    """Ray Serve with @serve.batch around the same snapshot (run under .venv/ray/bin/python)."""
    import ray
    import torch
    from ray import serve
    from starlette.requests import Request

    import silverrec

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    @serve.deployment(max_ongoing_requests=256)
    class Search:
        def __init__(self, p: str):
            self.snap = silverrec.load(p)

        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)
        async def batch(self, bodies: list[dict]) -> list[dict]:
            q = torch.tensor([row for b in bodies for row in b["queries"]], dtype=torch.float32)
            res = self.snap.search(q, max(b.get("k", 10) for b in bodies))
            out, start = [], 0
            for b in bodies:
                n = len(b["queries"])
                out.append({"item_ids": res.item_ids[start:start + n, :b.get("k", 10)].tolist(),
                            "scores": res.scores[start:start + n, :b.get("k", 10)].tolist()})
                start += n
            return out

        async def __call__(self, request: Request) -> dict:
            return await self.batch(await request.json())

    import signal

    def shutdown(*_):
        serve.shutdown()
        ray.shutdown()  # the raylet and GCS this driver started end with it
        sys.exit(0)

    signal.signal(signal.SIGTERM, shutdown)
    serve.run(Search.bind(path), route_prefix="/v1/search")
    print(f"READY {port}", flush=True)
    while True:
        time.sleep(3600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(kind: str, path: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, SILVERREC_QUIET="1", SILVERREC_ADMIN_TOKEN=TOKEN, PYTHONPATH=str(ROOT))
    py = sys.executable
    if kind == "batched":
        cmd = [py, "-m", "silverrec", "serve", str(path), "--port", str(port), "--max-batch", "32",
               "--max-wait-ms", "2", "--workers", "1"]
    elif kind == "unbatched":
        cmd = [py, "-m", "silverrec", "serve", str(path), "--port", str(port), "--max-batch", "1",
               "--max-wait-ms", "0", "--workers", "1"]
    elif kind == "plain":
        cmd = [py, "-c", "import sys, uvicorn; sys.path.insert(0, sys.argv[3]); from benchmarks.serve import plain_app; "
               "uvicorn.run(plain_app(sys.argv[1]), host='127.0.0.1', port=int(sys.argv[2]), log_level='warning')",
               str(path), str(port), str(ROOT)]
    elif kind == "ray":
        cmd = [str(RAY_PYTHON), str(Path(__file__)), "--ray-server", str(path), "--port", str(port)]
    else:
        raise ValueError(kind)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(ROOT))
    t0 = time.time()
    while time.time() - t0 < 180:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited with {proc.returncode}")
        try:
            status, _ = asyncio.run(one_request(port, b'{"queries": [[' + b",".join([b"0.1"] * DIM) + b']], "k": 1}'))
            if status == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{kind} server did not answer within 180 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


# ------------------------------------------------------------------------------------ HTTP client

class Conn:
    """One keep-alive HTTP/1.1 connection (raw asyncio streams: a cheap client)."""

    def __init__(self, port: int):
        self.port = port
        self.reader = self.writer = None

    async def request(self, body: bytes, path: str = "/v1/search", headers: str = "") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n{headers}\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        hdrs = {ln.split(":", 1)[0].lower(): ln.split(":", 1)[1].strip() for ln in lines[1:] if ":" in ln}
        if "content-length" in hdrs:
            data = await self.reader.readexactly(int(hdrs["content-length"]))
        elif hdrs.get("transfer-encoding") == "chunked":
            data = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                data += await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            data = await self.reader.read()
        if hdrs.get("connection") == "close":
            self.close()
        return status, data

    def close(self):
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def one_request(port: int, body: bytes) -> tuple[int, bytes]:
    c = Conn(port)
    try:
        return await c.request(body)
    finally:
        c.close()


def bodies(n: int = 512, seed: int = 0) -> list[bytes]:
    q = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return [json.dumps({"queries": [[round(float(x), 5) for x in row]], "k": K}).encode() for row in q]


def bad_bodies() -> list[bytes]:
    good = [0.1] * DIM
    return [json.dumps({"queries": [good[:-1]], "k": K}).encode(), json.dumps({"queries": [good], "k": 0}).encode(),
            b'{"queries": [[0.1, 0.2', ('{"queries": [[NaN' + ", 0.1" * (DIM - 1) + ']], "k": 10}').encode()]


def summary(lat: list[float], statuses: list[int], wall: float) -> dict:
    ms = np.asarray(lat) * 1000 if lat else np.zeros(1)
    ok = sum(s == 200 for s in statuses)
    return {"requests": len(statuses), "ok": ok, "throughput": ok / wall,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "p999_ms": float(np.percentile(ms, 99.9)), "status_counts": {str(s): statuses.count(s) for s in set(statuses)}}


async def closed_loop(port: int, concurrency: int, seconds: float, data: list[bytes],
                      bad: list[bytes] | None = None, bad_rate: float = 0.0, during=None) -> dict:
    lat, statuses, good_fail, kinds = [], [], [0], []
    stop = time.perf_counter() + seconds
    rng = random.Random(concurrency)

    async def client(c: int):
        conn, i = Conn(port), c
        while time.perf_counter() < stop:
            is_bad = bad is not None and rng.random() < bad_rate
            body = rng.choice(bad) if is_bad else data[i % len(data)]
            i += concurrency
            t0 = time.perf_counter()
            try:
                status, _ = await conn.request(body)
            except (OSError, asyncio.IncompleteReadError):
                conn.close()
                status = 599
            if not is_bad:
                lat.append(time.perf_counter() - t0)
                if status != 200:
                    good_fail[0] += 1
            statuses.append(status)
            kinds.append(is_bad)
        conn.close()

    t0 = time.perf_counter()
    tasks = [client(c) for c in range(concurrency)]
    if during is not None:
        tasks.append(during())
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    out = summary(lat, [s for s, b in zip(statuses, kinds) if not b], wall)
    out["concurrency"] = concurrency
    if bad is not None:
        bad_statuses = [s for s, b in zip(statuses, kinds) if b]
        out["bad_requests"] = len(bad_statuses)
        out["bad_status_counts"] = {str(s): bad_statuses.count(s) for s in set(bad_statuses)}
        out["failed_good"] = good_fail[0]
        out["status_500"] = sum(s >= 500 for s in statuses)
    return out


async def open_loop(port: int, rate: float, seconds: float, data: list[bytes], poisson: bool, seed: int = 0) -> dict:
    """Requests arrive at `rate`/s (exponential or constant gaps), each on a free keep-alive connection."""
    rng = np.random.default_rng(seed)
    n = int(rate * seconds)
    gaps = rng.exponential(1.0 / rate, n) if poisson else np.full(n, 1.0 / rate)
    arrivals = np.cumsum(gaps)
    pool: list[Conn] = [Conn(port) for _ in range(64)]  # connected on first use, then kept alive
    lat, statuses = [], []

    async def fire(i: int, at: float):
        conn = pool.pop() if pool else Conn(port)
        try:
            status, _ = await conn.request(data[i % len(data)])
        except (OSError, asyncio.IncompleteReadError):
            conn.close()
            status = 599
        lat.append(time.perf_counter() - at)
        statuses.append(status)
        pool.append(conn)

    t0 = time.perf_counter()
    tasks = []
    for i, a in enumerate(arrivals):
        delay = t0 + a - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(fire(i, t0 + a)))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    for c in pool:
        c.close()
    out = summary(lat, statuses, wall)
    out.update({"rate": rate, "arrivals": "poisson" if poisson else "uniform"})
    return out


# ------------------------------------------------------------------------------------ runs

def run(args) -> None:
    v1, v2 = snapshots()
    levels = (1, 4, 16, 32, 64)
    seconds = 1.0 if args.quick else 2.5
    data, rows, extra = bodies(), [], {}
    kinds = ["batched", "unbatched", "plain"]
    if not args.no_ray:
        if RAY_PYTHON.exists():
            kinds.append("ray")
        else:
            extra["ray"] = f"skipped: {RAY_PYTHON} missing (make bench-serve installs ray there)"
    for kind in kinds:
        try:
            proc, port = start_server(kind, v1)
        except RuntimeError as e:
            extra[kind] = f"failed to start: {e}"
            print(extra[kind])
            continue
        try:
            asyncio.run(closed_loop(port, 16, 0.5, data))  # warm-up
            for c in levels:
                r = asyncio.run(closed_loop(port, c, seconds, data))
                r.update({"server": kind, "load": "closed"})
                rows.append(r)
                print(f"{kind:9s} c={c:3d} {r['throughput']:8.1f} req/s p50 {r['p50_ms']:7.2f} p99 {r['p99_ms']:7.2f} "
                      f"p99.9 {r['p999_ms']:7.2f} ms {r['status_counts']}", flush=True)
            if kind == "batched":
                # peak: the best closed-loop throughput at concurrency <= 32 (64 clients oversubscribe
                # this 2-core machine's client as much as the server)
                peak = max(r["throughput"] for r in rows if r["server"] == "batched" and r["concurrency"] <= 32)
                rate = 0.7 * peak
                for poisson in (False, True):
                    r = asyncio.run(open_loop(port, rate, 3.0 if args.quick else 6.0, data, poisson))
                    r.update({"server": kind, "load": "open"})
                    rows.append(r)
                    print(f"{kind:9s} open {r['arrivals']:8s} {rate:7.1f}/s: p50 {r['p50_ms']:7.2f} p99 {r['p99_ms']:7.2f} "
                          f"p99.9 {r['p999_ms']:7.2f} ms", flush=True)
                r = asyncio.run(closed_loop(port, 32, seconds * 2, data, bad_bodies(), 0.10))
                r.update({"server": kind, "load": "closed+10%bad"})
                rows.append(r)
                print(f"{kind:9s} 10% bad: good failed {r['failed_good']}, 5xx {r['status_500']}, bad statuses "
                      f"{r['bad_status_counts']}", flush=True)
                reloads = []

                async def reload_ten():
                    conn = Conn(port)
                    for i in range(10):
                        await asyncio.sleep(0.3)
                        target = v2 if i % 2 == 0 else v1
                        t0 = time.perf_counter()
                        status, body = await conn.request(json.dumps({"path": str(target)}).encode(), "/v1/admin/reload",
                                                          f"Authorization: Bearer {TOKEN}\r\n")
                        reloads.append({"status": status, "seconds": time.perf_counter() - t0,
                                        "version": json.loads(body).get("version")})
                    conn.close()

                r = asyncio.run(closed_loop(port, 16, 10 * 0.3 + 4.0 if not args.quick else 5.0, data, during=reload_ten))
                r.update({"server": kind, "load": "closed+10 reloads", "reloads": reloads,
                          "failed_good": r["requests"] - r["ok"]})
                rows.append(r)
                print(f"{kind:9s} 10 reloads: {r['requests']} requests, failed {r['failed_good']}, reload statuses "
                      f"{[x['status'] for x in reloads]}", flush=True)
        finally:
            stop_server(proc)
    report(rows, extra, args)


def report(rows: list[dict], extra: dict, args) -> None:
    def at(server, c):
        return next((r for r in rows if r["server"] == server and r["load"] == "closed" and r["concurrency"] == c), None)

    summary_ = {}
    b32, u32, p32, r32 = at("batched", 32), at("unbatched", 32), at("plain", 32), at("ray", 32)
    if b32 and u32:
        summary_["c32_throughput_batched_over_unbatched"] = b32["throughput"] / u32["throughput"]
        summary_["c32_p99_batched_over_unbatched"] = b32["p99_ms"] / u32["p99_ms"]
    if b32 and p32:
        summary_["c32_throughput_batched_over_plain"] = b32["throughput"] / p32["throughput"]
        summary_["c32_p99_batched_over_plain"] = b32["p99_ms"] / p32["p99_ms"]
    if b32 and r32:
        summary_["c32_throughput_batched_over_ray"] = b32["throughput"] / r32["throughput"]
        summary_["c32_p99_batched_over_ray"] = b32["p99_ms"] / r32["p99_ms"]
    op = {r["arrivals"]: r for r in rows if r["load"] == "open"}
    if len(op) == 2:
        summary_["open_loop_rate"] = op["poisson"]["rate"]
        summary_["poisson_p99_over_uniform_p99"] = op["poisson"]["p99_ms"] / op["uniform"]["p99_ms"]
    for load in ("closed+10%bad", "closed+10 reloads"):
        r = next((r for r in rows if r["load"] == load), None)
        if r:
            summary_[load.replace("closed+", "").replace(" ", "_").replace("%", "pct") + "_failed_good"] = r["failed_good"]
            summary_[load.replace("closed+", "").replace(" ", "_").replace("%", "pct") + "_5xx"] = sum(
                v for s, v in r["status_counts"].items() if s.startswith("5")) + r.get("status_500", 0)
    payload = {"benchmark": "serve", "machine": {**machine_info(), "loadavg_at_end": os.getloadavg()}, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "config": {"items": N_ITEMS, "dim": DIM, "k": K, "snapshot": "exact", "quick": args.quick,
                          "batched": "max batch 32, max wait 2 ms, 1 worker", "ray": "@serve.batch(32, 2 ms)",
                          "command": "python benchmarks/serve.py" + (" --quick" if args.quick else "")},
               "summary": summary_, "notes": extra, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    name = "serve_quick" if args.quick else "serve"
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2))
    print_table([r for r in rows if r["load"] == "closed"], ["server", "concurrency", "throughput", "p50_ms", "p99_ms", "p999_ms"])
    print(json.dumps(summary_, indent=2))
    replot(name, plot)
    print(f"wrote {RESULTS / (name + '.json')} and {name}.png")


def plot(payload: dict, path: Path) -> None:
    """Closed loop per server: throughput against concurrency, and p99 latency against throughput."""
    rows, thr, p99 = payload["rows"], {}, {}
    for server in dict.fromkeys(r["server"] for r in payload["rows"]):
        pts = sorted((r["concurrency"], r["throughput"], r["p99_ms"]) for r in rows if r["server"] == server and r["load"] == "closed")
        if pts:
            c, t, p = zip(*pts)
            thr[server], p99[server] = (c, t), (t, p)
    c = payload["config"]
    save_plot(path, [Panel("throughput", "concurrency (closed loop)", "requests / s", thr, logx=True),
                     Panel("p99 vs throughput (c = 1..64)", "requests / s", "p99 latency, ms", p99, logy=True)],
              f"silverrec serve, {c['snapshot']} {c['items']} x {c['dim']}, 1-row k={c['k']} requests, loopback, "
              f"{payload['machine'].get('cores')} cores")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-ray", dest="no_ray", action="store_true")
    p.add_argument("--ray-server", dest="ray_server", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ray_server:
        ray_main(args.ray_server, args.port)
        return
    os.environ.setdefault("SILVERREC_QUIET", "1")
    run(args)


if __name__ == "__main__" and not plot_only(plot, "serve"):
    main()
