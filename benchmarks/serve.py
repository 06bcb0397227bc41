"""Load test of `silverrec serve` with a C load generator (wrk), beside the in-process ceiling of the
same requests, with Ray Serve as the peer.

    make bench-serve                                 # installs wrk and Ray Serve (.venv/ray) when missing
    .venv/bin/python benchmarks/serve.py [--quick] [--no-ray] [--workloads recommend,search] [--seconds S]

Workloads (one snapshot each; the requests rotate over a fixed set of bodies):
    recommend   POST /v1/recommend on the MovieLens snapshot of `make demo` (out/demo/snapshot, built
                when missing): {"user_id": U, "k": 10} for the 610 users in turn.
    search      POST /v1/search on a filtered pool of 1,000,000 x 64 items (100,000 with --quick;
                generated and published once under out/bench_serve): one query row, k 10, and one of
                six filters of different selectivity.
Systems, each its own server process(es) on loopback, the same snapshot:
    silverrec       `silverrec serve` with its defaults (batching; --workers: its default for this machine)
    silverrec 1p /  the same with --workers 1 and --workers <cores>: one process against one per core
    silverrec Np
    unbatched       the defaults with --max-batch 1
    ray             Ray Serve, one replica, @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.002)
                    around the same snapshot (its own venv, .venv/ray: `make bench-serve` builds it)
    in-process      snap.recommend / snap.search on the same requests at batch 1, 16 and 64 in this
                    process, no HTTP: the ceiling a server can approach (its batch-B throughput is drawn
                    at concurrency B)
Load: wrk (C, one thread) in a closed loop, C connections each sending its next request when answered,
at concurrency 1, 4, 16 and 64 for --seconds per point (after a warm-up), in two rounds of half
each with the systems' order reversed between rounds: a point's throughput is over both rounds, its
p50 their mean, its p99 the worse round's, and the rounds' spread is the run's noise. Latency
percentiles are wrk's. The in-process ceiling is measured in turn with the silverrec servers, in
each round of the levels 1, 16 and 64 (batch = concurrency; the servers idle meanwhile), so that it
and they meet the same load of a shared machine; the targets compare with that (its rounds' mean),
and it is measured before and after the servers too (their mean, recorded beside). Then, on the default server: 10 reloads (alternating two copies of the snapshot) under load
at concurrency 16, counting every answer's status, and a fuzz of bodies (mutated, truncated and
random) counting 5xx. The load generator, the server and (for Ray) its raylet share this machine's
cores; the 1-minute load average is recorded at each point.

Targets (written to the JSON's "targets", each met or not with its numbers):
    c 1 p50 <= in-process batch-1 time + 1.0 ms;
    c 64 throughput >= 0.6 x the in-process batch-64 throughput, with p99 <= 100 ms;
    batched >= unbatched and >= Ray Serve throughput at every concurrency;
    0 failed good requests over 10 reloads under load; no 5xx in the fuzz.
Writes benchmarks/results/serve.json (serve_quick.json) and serve.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import silverrec  # noqa: F401  (first: its OpenMP wait policy, as `silverrec serve` runs)

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, Panel, machine_info, plot_only, print_table, replot, save_plot  # noqa: E402
from silverrec.errors import SilverrecError  # noqa: E402
from silverrec.serving.loadgen import free_port, post, stop_server, write_bodies, wrk  # noqa: E402
from silverrec.serving.loadgen import start_server as start_server_process  # noqa: E402

WORK = ROOT / "out" / "bench_serve"
DEMO = ROOT / "out" / "demo" / "snapshot"
RAY_PYTHON = ROOT / ".venv" / "ray" / "bin" / "python"
TOKEN = "bench-token"
K = 10
LEVELS = (1, 4, 16, 64)
ROUNDS = 2  # each load point: this many rounds of seconds / ROUNDS, the systems' order reversed each round
BATCHES = (1, 16, 64)
SEARCH_DIM = 64
SEARCH_FEATURES = {"country": 10, "genre": 20, "lang": 100}  # name -> values (genre zipf-distributed)
SEARCH_FILTERS = [  # from ~50% of the pool down to ~1%
    "NOT lang IN (l0, l1, l2)",
    "country IN (c1, c2, c3, c4, c5)",
    "genre IN (g2, g3) OR country = c4",
    "country = c1 AND NOT genre = g1",
    "lang IN (l1, l2, l3, l4, l5) AND NOT country = c0",
    "genre = g5 AND country IN (c1, c2)",
]
# ------------------------------------------------------------------------------------ workloads

class Workload:
    """A snapshot, its route and its request bodies (and how to call the same requests in-process)."""

    def __init__(self, name: str, snapshot: Path, route: str, bodies: list[dict]):
        self.name, self.snapshot, self.route, self.bodies = name, snapshot, route, bodies

    def inprocess(self, snap, batch: list[dict]):
        if self.route == "/v1/recommend":
            return snap.recommend([{"user_id": b["user_id"]} for b in batch], k=K)
        queries = np.asarray([b["queries"][0] for b in batch], dtype=np.float32)
        return snap.search(queries, K, filter=[b["filter"] for b in batch])


def recommend_workload() -> Workload:
    if not (DEMO / "manifest.json").is_file():
        print(f"{DEMO} missing: running the demo (make demo) to build it", flush=True)
        subprocess.run([sys.executable, "-m", "silverrec.publish.demo", "--no-table"], cwd=ROOT, check=True)
    snap = silverrec.load(DEMO)
    users = snap.rec_handler().users["user_ids"].tolist()
    return Workload("recommend", DEMO, "/v1/recommend", [{"user_id": int(u), "k": K} for u in users])


def search_workload(n: int) -> Workload:
    """A filtered pool of n x 64 items (a Gaussian mixture, three categorical features), published once."""
    from silverrec.publish.filtered_ivf import publish_index
    from silverrec.publish.pool import read_pool, write_pool

    path = WORK / f"search_{n}"
    if not (path / "manifest.json").is_file():
        print(f"publishing a filtered pool of {n:,} items into {path} (once)", flush=True)
        WORK.mkdir(parents=True, exist_ok=True)
        x = mixture(n, 0)
        rng = np.random.default_rng(0)
        card = SEARCH_FEATURES
        features = {"country": [f"c{i}" for i in rng.integers(0, card["country"], n)],
                    "genre": [f"g{i}" for i in (rng.zipf(2.0, n) - 1) % card["genre"]],
                    "lang": [f"l{i}" for i in rng.integers(0, card["lang"], n)]}
        pool = WORK / f"search_{n}.parquet"
        write_pool(pool, np.arange(n, dtype=np.int64) * 7 + 3, x, features)
        del x, features
        publish_index(read_pool(pool), path, overwrite=True, release_embeddings=True)
        pool.unlink()
    queries = mixture(1024, 1)
    bodies = [{"queries": [[round(float(v), 5) for v in q]], "k": K, "filter": SEARCH_FILTERS[i % len(SEARCH_FILTERS)]}
              for i, q in enumerate(queries)]
    return Workload("search", path, "/v1/search", bodies)


def mixture(n: int, seed: int) -> np.ndarray:
    """n points of a 256-centre Gaussian mixture in 64-d (the same centres for every seed)."""
    centres = np.random.default_rng(12345).standard_normal((256, SEARCH_DIM)).astype(np.float32)
    rng = np.random.default_rng(seed)
    return centres[rng.integers(0, 256, n)] + 0.7 * rng.standard_normal((n, SEARCH_DIM), dtype=np.float32)


def second_version(path: Path) -> Path:
    """A copy of the snapshot under another directory name: another version to reload to."""
    copy = WORK / f"{path.name}_v2"
    if not (copy / "manifest.json").is_file():
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(path, copy)
    return copy


def fuzz_bodies(w: Workload, n: int, seed: int = 0) -> list[bytes]:
    """Bodies a client should not send: mutated fields (wrong types, out of range, unknown users and
    ids, bad filters, extra keys, NaN, deadlines that are not positive numbers), truncated JSON and
    random bytes."""
    rng = random.Random(seed)
    junk = [None, True, -1, 0, 2 ** 70, 1.5, float("nan"), "x", "", [], {}, [[]], [None], {"a": 1}, "genre = = c1",
            "NOT", "(", "country IN ()", "é" * 8, [[0.1] * (SEARCH_DIM + 1)], [[0.1] * 3], 10 ** 6, -10 ** 6]
    keys = ["queries", "k", "filter", "nprobe", "max_probe", "mode", "deadline_ms", "user_id", "history", "features",
            "numeric", "exclude", "k0", "requests", "exclude_history", "colour"]
    out = []
    for i in range(n):
        body = dict(w.bodies[i % len(w.bodies)])
        kind = rng.random()
        if kind < 0.6:
            for _ in range(rng.randint(1, 3)):
                key, value = rng.choice(keys), rng.choice(junk)
                if key == "deadline_ms" and isinstance(value, (int, float)) and value > 0:
                    value = -value  # a positive deadline is a valid one, answered 504 once it passes
                body[key] = value
            out.append(json.dumps(body, allow_nan=True).encode())
        elif kind < 0.7:
            body.pop(rng.choice(list(body)))
            out.append(json.dumps(body).encode())
        elif kind < 0.85:
            text = json.dumps(body).encode()
            out.append(text[:rng.randint(0, max(0, len(text) - 1))])
        else:
            out.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))))
    return out


# ------------------------------------------------------------------------------------ in-process

def ceiling(w: Workload, seconds: float) -> list[dict]:
    """snap.recommend / snap.search on the workload's requests at batch 1, 16, 64: time per batch."""
    snap = silverrec.load(w.snapshot)
    rows = [time_batches(w, snap, b, seconds) for b in BATCHES]
    del snap
    return rows


def time_batches(w: Workload, snap, b: int, seconds: float) -> dict:
    """The workload's requests in batches of b for `seconds` (after 3 to warm up): median time per batch
    and requests per second."""
    batches = [[w.bodies[(i * b + j) % len(w.bodies)] for j in range(b)] for i in range(max(8, 1024 // b))]
    for batch in batches[:3]:
        w.inprocess(snap, batch)
    times, t_end, i = [], time.perf_counter() + seconds, 0
    while time.perf_counter() < t_end or len(times) < 5:
        t = time.perf_counter()
        w.inprocess(snap, batches[i % len(batches)])
        times.append(time.perf_counter() - t)
        i += 1
    ms = statistics.median(times) * 1000
    row = {"workload": w.name, "system": "in-process", "batch": b, "median_ms": ms,
           "throughput": b / (sum(times) / len(times)), "calls": len(times), "load_1min": os.getloadavg()[0]}
    print(f"{w.name:9s} in-process batch {b:3d}: {ms:8.3f} ms median, {row['throughput']:8.1f} req/s", flush=True)
    return row


# ------------------------------------------------------------------------------------ servers

def start_server(system: dict, w: Workload) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, SILVERREC_QUIET="1", SILVERREC_ADMIN_TOKEN=TOKEN, PYTHONPATH=str(ROOT))
    if system["kind"] == "ray":
        cmd = [str(RAY_PYTHON), str(Path(__file__)), "--ray-server", str(w.snapshot), "--route", w.route,
               "--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "silverrec", "serve", str(w.snapshot), "--port", str(port), *system["args"]]
    proc = start_server_process(cmd, port, w.route, json.dumps(w.bodies[0]).encode(), env, name=system["name"])
    return proc, port


# ------------------------------------------------------------------------------------ runs

def systems(args) -> list[dict]:
    from silverrec.serving.batcher import cores
    from silverrec.serving.processes import default_processes

    n, default = cores(), default_processes()
    out = [{"name": "silverrec", "kind": "silverrec", "args": [], "processes": default}]
    for p in sorted({1, n} - {default}):
        out.append({"name": f"silverrec {p}p", "kind": "silverrec", "args": ["--workers", str(p)], "processes": p})
    out.append({"name": "unbatched", "kind": "silverrec", "args": ["--max-batch", "1"], "processes": default})
    if not args.no_ray:
        out.append({"name": "ray", "kind": "ray", "args": []})
    return out


def run_workload(w: Workload, args, extra: dict) -> list[dict]:
    """The in-process ceiling (before and after the rest), every system at every level: the silverrec servers all started at
    once and taken in turn at each level (the order reversed from level to level, so that a shared
    machine's load falls on all alike), Ray Serve alone after them; reloads and the fuzz last."""
    seconds = args.seconds or (3 if args.quick else 10)
    before = ceiling(w, 1.0 if args.quick else 2.5)
    good = write_bodies(WORK / f"{w.name}.bodies", [json.dumps(b).encode() for b in w.bodies])
    rows, running, inproc = [], {}, {}
    snap = silverrec.load(w.snapshot)
    try:
        for group in ([s for s in systems(args) if s["kind"] == "silverrec"], [s for s in systems(args) if s["kind"] == "ray"]):
            for system in group:
                if system["kind"] == "ray" and not RAY_PYTHON.exists():
                    extra[f"{w.name} ray"] = f"skipped: {RAY_PYTHON} missing (make bench-serve installs Ray Serve there)"
                    continue
                try:
                    running[system["name"]] = start_server(system, w)
                except SilverrecError as e:
                    extra[f"{w.name} {system['name']}"] = f"failed to start: {e}"
                    print(extra[f"{w.name} {system['name']}"], flush=True)
            names = [s["name"] for s in group if s["name"] in running]
            for name in names:
                wrk(running[name][1], w.route, good, 16, 2)  # warm-up
            taken = names + (["in-process"] if snap is not None and "silverrec" in names else [])
            for i, c in enumerate(LEVELS):
                per = {name: [] for name in names}
                for k in range(ROUNDS):  # A B C then C B A: a shared machine's load falls on all alike
                    for name in (taken if (i * ROUNDS + k) % 2 == 0 else taken[::-1]):
                        if name == "in-process":  # the ceiling, in turn with the servers (they are idle)
                            if c in BATCHES:
                                inproc.setdefault(c, []).append(time_batches(w, snap, c, seconds / ROUNDS))
                            continue
                        r = wrk(running[name][1], w.route, good, c, seconds / ROUNDS)
                        r.update({"workload": w.name, "system": name, "concurrency": c, "load": "closed round",
                                  "round": k, "load_1min": os.getloadavg()[0]})
                        rows.append(r)
                        per[name].append(r)
                for name in names:
                    r = combine(per[name])
                    rows.append(r)
                    print(f"{w.name:9s} {name:14s} c={c:3d} {r['throughput']:8.1f} req/s  p50 {r['p50_ms']:7.2f}  "
                          f"p99 {r['p99_ms']:7.2f} ms  errors {r['errors']}  rounds {r['round_throughputs']}  "
                          f"load {r['load_1min']:.1f}", flush=True)
            if "silverrec" in names:
                port = running["silverrec"][1]
                rows.append(reloads_under_load(w, port, good, max(6.0, seconds)))
                rows.append(fuzz(w, port, seconds))
            for name in names:
                stop_server(running.pop(name)[0])
    finally:
        for proc, _ in running.values():
            stop_server(proc)
    del snap
    after = ceiling(w, 1.0 if args.quick else 2.5)  # again after the servers: the machine's drift over the run
    for a, b in zip(before, after):
        rows.append({**a, "load": "before and after", "median_ms": (a["median_ms"] + b["median_ms"]) / 2,
                     "throughput": (a["throughput"] + b["throughput"]) / 2, "calls": a["calls"] + b["calls"],
                     "round_throughputs": [round(a["throughput"], 1), round(b["throughput"], 1)],
                     "round_median_ms": [a["median_ms"], b["median_ms"]], "load_1min": (a["load_1min"] + b["load_1min"]) / 2})
    for b, rounds in inproc.items():  # over its rounds as a server's point: calls over all, median the rounds' mean
        calls = sum(r["calls"] for r in rounds)
        rows.append({**rounds[0], "load": "in turn", "calls": calls,
                     "median_ms": statistics.mean(r["median_ms"] for r in rounds),
                     "throughput": statistics.mean(r["throughput"] for r in rounds),
                     "round_throughputs": [round(r["throughput"], 1) for r in rounds],
                     "round_median_ms": [r["median_ms"] for r in rounds],
                     "load_1min": statistics.mean(r["load_1min"] for r in rounds)})
    return rows


def ceiling_rows(rows: list[dict], wl: str) -> dict:
    """The workload's in-process ceiling per batch size: measured in turn with the servers where it was,
    else before and after them."""
    inproc = [r for r in rows if r["workload"] == wl and r["system"] == "in-process"]
    turn = {r["batch"]: r for r in inproc if r.get("load") == "in turn"}
    return turn or {r["batch"]: r for r in inproc}


def combine(rounds: list[dict]) -> dict:
    """A system's rounds at one level as one point: throughput over all rounds, p50 the rounds' mean,
    p99 the worst round's, and each round's throughput (their spread is the run's noise)."""
    first = rounds[0]
    requests = sum(r["requests"] for r in rounds)
    tps = [r["throughput"] for r in rounds]
    return {"workload": first["workload"], "system": first["system"], "concurrency": first["concurrency"],
            "load": "closed", "requests": requests, "throughput": requests / sum(r["duration_us"] / 1e6 for r in rounds),
            "p50_ms": statistics.mean(r["p50_ms"] for r in rounds), "p99_ms": max(r["p99_ms"] for r in rounds),
            "errors": sum(r["errors"] for r in rounds), "round_throughputs": [round(t, 1) for t in tps],
            "spread": (max(tps) - min(tps)) / statistics.mean(tps) if statistics.mean(tps) else 0.0,
            "load_1min": statistics.mean(r["load_1min"] for r in rounds)}


def reloads_under_load(w: Workload, port: int, good: Path, seconds: float) -> dict:
    """10 reloads, alternating a copy of the snapshot and the snapshot, while wrk sends at concurrency 16."""
    v2, answers = second_version(w.snapshot), []

    def reload_ten():
        for i in range(10):
            time.sleep(seconds / 12)
            target = v2 if i % 2 == 0 else w.snapshot
            t0 = time.perf_counter()
            status, body = post(port, "/v1/admin/reload", json.dumps({"path": str(target)}).encode(),
                                {"Authorization": f"Bearer {TOKEN}"})
            answers.append({"status": status, "seconds": time.perf_counter() - t0,
                            "version": json.loads(body).get("version")})

    t = threading.Thread(target=reload_ten)
    t.start()
    r = wrk(port, w.route, good, 16, seconds, count=True)
    t.join()
    r.update({"workload": w.name, "system": "silverrec", "concurrency": 16, "load": "10 reloads", "reloads": answers,
              "failed_good": r["errors"], "load_1min": os.getloadavg()[0]})
    print(f"{w.name:9s} 10 reloads under load: {r['requests']} requests, failed {r['failed_good']}, statuses "
          f"{r['statuses']}, versions {r['versions']}, reload statuses {[a['status'] for a in answers]}", flush=True)
    return r


def fuzz(w: Workload, port: int, seconds: float) -> dict:
    bodies = write_bodies(WORK / f"{w.name}.fuzz", fuzz_bodies(w, 2000))
    r = wrk(port, w.route, bodies, 16, min(seconds, 5), count=True)
    r.update({"workload": w.name, "system": "silverrec", "concurrency": 16, "load": "fuzz",
              "status_5xx": sum(n for s, n in r["statuses"].items() if s.startswith("5")), "load_1min": os.getloadavg()[0]})
    print(f"{w.name:9s} fuzz: {r['requests']} requests, statuses {r['statuses']}, 5xx {r['status_5xx']}", flush=True)
    return r


def targets(rows: list[dict]) -> list[dict]:
    """Each target per workload: met or not, with the numbers it compares."""
    out = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        def closed(system, c):
            return next((r for r in rows if r["workload"] == wl and r["system"] == system and r.get("load") == "closed"
                         and r["concurrency"] == c), None)

        inproc = ceiling_rows(rows, wl)
        c1, c64 = closed("silverrec", 1), closed("silverrec", 64)
        if c1 and 1 in inproc:
            limit = inproc[1]["median_ms"] + 1.0
            out.append({"workload": wl, "target": "c 1 p50 <= in-process batch-1 time + 1.0 ms", "met": c1["p50_ms"] <= limit,
                        "value": c1["p50_ms"], "limit": limit})
        if c64 and 64 in inproc:
            limit = 0.6 * inproc[64]["throughput"]
            out.append({"workload": wl, "target": "c 64 throughput >= 0.6x in-process batch 64", "met": c64["throughput"] >= limit,
                        "value": c64["throughput"], "limit": limit, "ratio": c64["throughput"] / inproc[64]["throughput"]})
            out.append({"workload": wl, "target": "c 64 p99 <= 100 ms", "met": c64["p99_ms"] <= 100, "value": c64["p99_ms"],
                        "limit": 100.0})
        for peer in ("unbatched", "ray"):
            pairs = [(c, closed("silverrec", c), closed(peer, c)) for c in LEVELS]
            pairs = [(c, a, b) for c, a, b in pairs if a and b]
            if pairs:
                out.append({"workload": wl, "target": f"batched >= {peer} throughput at every concurrency",
                            "met": all(a["throughput"] >= b["throughput"] for _, a, b in pairs),
                            "ratios": {str(c): a["throughput"] / b["throughput"] for c, a, b in pairs}})
        rel = next((r for r in rows if r["workload"] == wl and r.get("load") == "10 reloads"), None)
        if rel:
            ok = sum(a["status"] == 200 for a in rel["reloads"])
            out.append({"workload": wl, "target": "0 failed good requests over 10 reloads under load",
                        "met": rel["failed_good"] == 0 and ok == 10, "value": rel["failed_good"], "reloads_ok": ok,
                        "requests": rel["requests"]})
        fz = next((r for r in rows if r["workload"] == wl and r.get("load") == "fuzz"), None)
        if fz:
            out.append({"workload": wl, "target": "no 5xx in a fuzz of bodies", "met": fz["status_5xx"] == 0,
                        "value": fz["status_5xx"], "requests": fz["requests"]})
    return out


def run(args) -> None:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is missing: `make bench-serve` installs it (apt-get install -y wrk)")
    WORK.mkdir(parents=True, exist_ok=True)
    rows, extra = [], {}
    n = 100_000 if args.quick else 1_000_000
    for name in args.workloads.split(","):
        w = recommend_workload() if name == "recommend" else search_workload(n)
        rows += run_workload(w, args, extra)
    report(rows, extra, args, n)


def report(rows: list[dict], extra: dict, args, n: int) -> None:
    from silverrec.serving.processes import default_processes

    met = targets(rows)
    payload = {"benchmark": "serve", "machine": {**machine_info(), "loadavg_at_end": os.getloadavg()},
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "config": {"quick": args.quick, "seconds_per_point": args.seconds or (3 if args.quick else 10),
                          "levels": LEVELS, "batches": BATCHES, "k": K, "search_items": n, "search_filters": SEARCH_FILTERS,
                          "default_processes": default_processes(), "load_generator": "wrk -t1 (closed loop)",
                          "ray": "one replica, @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.002)",
                          "command": "python benchmarks/serve.py" + (" --quick" if args.quick else "")},
               "targets": met, "notes": extra, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    name = "serve_quick" if args.quick else "serve"
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2))
    print_table([r for r in rows if r.get("load") == "closed"],
                ["workload", "system", "concurrency", "throughput", "p50_ms", "p99_ms", "errors", "load_1min"])
    print_table([r for r in rows if r["system"] == "in-process"], ["workload", "load", "batch", "median_ms", "throughput"])
    for t in met:
        print(("MET     " if t["met"] else "NOT MET ") + f"{t['workload']}: {t['target']}: "
              + json.dumps({k: v for k, v in t.items() if k not in ("workload", "target", "met")}))
    replot(name, plot)


def plot(payload: dict, path: Path) -> None:
    """Per workload: throughput and p99 latency against concurrency for every system, the in-process
    batch-B throughput at concurrency B."""
    panels = []
    rows = payload["rows"]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        thr, p99 = {}, {}
        for system in dict.fromkeys(r["system"] for r in rows if r["workload"] == wl):
            if system == "in-process":
                pts = sorted((b, r["throughput"], r["median_ms"]) for b, r in ceiling_rows(rows, wl).items())
                thr["in-process (batch = c)"] = ([p[0] for p in pts], [p[1] for p in pts])
                continue
            pts = sorted((r["concurrency"], r["throughput"], r["p99_ms"]) for r in rows
                         if r["workload"] == wl and r["system"] == system and r.get("load") == "closed")
            if pts:
                thr[system] = ([p[0] for p in pts], [p[1] for p in pts])
                p99[system] = ([p[0] for p in pts], [p[2] for p in pts])
        panels += [Panel(f"{wl}: throughput", "concurrency (wrk connections)", "requests / s", thr, logx=True, logy=True),
                   Panel(f"{wl}: p99 latency", "concurrency (wrk connections)", "p99, ms", p99, logx=True, logy=True,
                         ref=100.0, ref_label="100 ms")]
    m = payload["machine"]
    loads = [r["load_1min"] for r in rows if "load_1min" in r]
    shared = f", 1-min load {min(loads):.0f}-{max(loads):.0f} (shared)" if loads else ""
    save_plot(path, panels, f"silverrec serve under wrk, loopback, {m.get('cores')} cores ({m.get('cpu')}){shared}, "
                            f"{payload['created'][:10]}")


# ------------------------------------------------------------------------------------ Ray Serve

def ray_main(path: str, route: str, port: int) -> None:
    """Ray Serve with @serve.batch around the same snapshot (run under .venv/ray/bin/python)."""
    import signal

    import numpy as np
    import ray
    from ray import serve
    from starlette.requests import Request

    import silverrec

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    @serve.deployment(max_ongoing_requests=256)
    class Model:
        def __init__(self, p: str):
            self.snap = silverrec.load(p)

        @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.002)
        async def batch(self, bodies: list[dict]) -> list[dict]:
            if route == "/v1/recommend":
                res = self.snap.recommend([{"user_id": b["user_id"]} for b in bodies], k=max(b.get("k", K) for b in bodies))
                return [res.rows(i, i + 1, b.get("k", K)).to_json() for i, b in enumerate(bodies)]
            q = np.asarray([b["queries"][0] for b in bodies], dtype=np.float32)
            res = self.snap.search(q, max(b.get("k", K) for b in bodies), filter=[b.get("filter") for b in bodies])
            return [{"item_ids": res.item_ids[i:i + 1, :b.get("k", K)].tolist(),
                     "scores": res.scores[i:i + 1, :b.get("k", K)].tolist()} for i, b in enumerate(bodies)]

        async def __call__(self, request: Request) -> dict:
            return await self.batch(await request.json())

    def shutdown(*_):
        serve.shutdown()
        ray.shutdown()
        sys.exit(0)

    signal.signal(signal.SIGTERM, shutdown)
    serve.run(Model.bind(path), route_prefix=route)
    while True:
        time.sleep(3600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 s per point, a 100k-item search pool")
    p.add_argument("--seconds", type=float, default=None, help="seconds per load point (default 10, quick 3)")
    p.add_argument("--workloads", default="recommend,search")
    p.add_argument("--no-ray", dest="no_ray", action="store_true")
    p.add_argument("--ray-server", dest="ray_server", default=None, help=argparse.SUPPRESS)
    p.add_argument("--route", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ray_server:
        ray_main(args.ray_server, args.route, args.port)
        return
    os.environ.setdefault("SILVERREC_QUIET", "1")
    run(args)


if __name__ == "__main__" and not plot_only(plot, "serve"):
    main()
