"""silverrec-predictor (C++, predictor/) against the Python predictor on the MovieLens recommendation snapshot.

    .venv/bin/python benchmarks/predictor.py                 # about 4 minutes
    .venv/bin/python benchmarks/predictor.py --seconds 3     # shorter runs
    .venv/bin/python benchmarks/predictor.py --plot-only     # redraw results/predictor.png

The snapshot: out/demo/snapshot (`make demo`: MovieLens ml-latest-small, two-tower + MoL OverArch + value model),
its TorchScript program in both predictors. Requests: the snapshot's stored users (`user_id`, users.npz), k = 10,
one user per body (batch 1) or 16 (`requests`).

In-process: Python's `snap.recommend(users, k=10)` (its public API, dicts in, tensors out) called from 1 or 2
threads of this process, against `silverrec-predictor --bench-seconds` (the same bodies answered in its own process
by 1 or 2 threads: JSON parse, validation, encoding, forward, JSON answer). Both run every forward on one intra-op
thread (what the Python predictor's threads="auto" picks up to batch 16; `--threads 1` for the C++ program).
HTTP: `silverrec serve` (its default: one server process per core) and `silverrec-predictor --http` (one process),
the same batching (max batch 32, max wait 5 ms, torch's default threads), loaded by wrk (keep-alive, closed
loop) at concurrency 1, 2 and 16, alternated server by server for each setting. Latency percentiles are wrk's; throughput counts answered bodies and users.
Client and servers share the machine's cores. Writes benchmarks/results/predictor.json and predictor.png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import Panel, plot_only, print_table, save_plot, write_results  # noqa: E402
from benchmarks.serve import free_port  # noqa: E402

BINARY = Path(sys.executable).parent / "silverrec-predictor"
SNAPSHOT = ROOT / "out" / "demo" / "snapshot"
K = 10
BATCHES = (1, 16)
CALLERS = (1, 2)
CONCURRENCY = (1, 2, 16)
WRK_SCRIPT = """
local bodies = {}
for line in io.lines(os.getenv("BODIES")) do bodies[#bodies + 1] = line end
local i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format("POST", nil, {["Content-Type"] = "application/json"}, bodies[i])
end
"""


def user_bodies(snapshot: Path, batch: int, n: int = 64) -> list[dict]:
    with np.load(snapshot / "users.npz") as f:
        users = [int(u) for u in f["user_ids"]]
    rng = np.random.default_rng(0)
    picks = rng.choice(users, size=(n, batch))
    if batch == 1:
        return [{"user_id": int(p[0]), "k": K} for p in picks]
    return [{"requests": [{"user_id": int(u)} for u in p], "k": K} for p in picks]


def summary(times_ms: list[float], seconds: float) -> dict:
    t = np.sort(np.asarray(times_ms))
    return {"calls": int(t.size), "p50_ms": float(np.quantile(t, 0.5)), "p99_ms": float(np.quantile(t, 0.99)),
            "per_s": t.size / seconds}


# ------------------------------------------------------------------------------------------------ in-process
def python_in_process(snap, bodies: list[dict], callers: int, seconds: float) -> dict:
    users = [b["requests"] if "requests" in b else [{"user_id": b["user_id"]}] for b in bodies]
    for u in users[:4]:
        snap.recommend(u, k=K)  # warm
    times: list[list[float]] = [[] for _ in range(callers)]
    stop = time.perf_counter() + seconds

    def caller(c: int):
        i = c
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            snap.recommend(users[i % len(users)], k=K)
            times[c].append((time.perf_counter() - t0) * 1e3)
            i += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=caller, args=(c,)) for c in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summary([x for ts in times for x in ts], time.perf_counter() - start)


def cpp_in_process(snapshot: Path, bodies: list[dict], callers: int, seconds: float) -> dict:
    text = "".join(json.dumps(b) + "\n" for b in bodies)
    out = subprocess.run([str(BINARY), str(snapshot), "--route", "recommend", "--threads", "1", "--bench-seconds",
                          str(seconds), "--bench-threads", str(callers)], input=text, capture_output=True, text=True,
                         check=True, timeout=600)
    return json.loads(out.stdout)


# ------------------------------------------------------------------------------------------------ HTTP
def start(kind: str, snapshot: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    if kind == "python":
        cmd = [sys.executable, "-m", "silverrec", "serve", str(snapshot), "--port", str(port), "--max-batch", "32",
               "--max-wait-ms", "5"]  # its default processes: one per core
    else:
        cmd = [str(BINARY), str(snapshot), "--http", str(port), "--max-batch", "32", "--max-wait-ms", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(ROOT),
                            env=dict(os.environ, SILVERREC_QUIET="1"))
    for _ in range(2400):  # a server process per core loads its own copy of the snapshot
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return proc, port
        except OSError:
            time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"{kind} server did not start")


def wrk(port: int, bodies_file: Path, script: Path, concurrency: int, seconds: float) -> dict:
    out = subprocess.run(["wrk", "-t", str(min(concurrency, 2)), "-c", str(concurrency), "-d", f"{max(1, round(seconds))}s",
                          "--latency", "-s", str(script), f"http://127.0.0.1:{port}/v1/recommend"],
                         capture_output=True, text=True, check=True, env=dict(os.environ, BODIES=str(bodies_file)),
                         timeout=seconds + 60)
    text = out.stdout

    def ms(label: str) -> float:
        m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    requests = int(re.search(r"(\d+) requests in", text).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    return {"p50_ms": ms("50"), "p99_ms": ms("99"), "per_s": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),
            "calls": requests, "errors": int(errors.group(1)) if errors else 0}


# ------------------------------------------------------------------------------------------------ run
def run(args) -> None:
    import torch

    import silverrec

    if not BINARY.is_file():
        raise SystemExit(f"{BINARY} is not built: run `make setup` (it needs CMake and a C++ compiler)")
    snapshot = Path(args.snapshot)
    if not (snapshot / "manifest.json").is_file():
        raise SystemExit(f"{snapshot} is not a snapshot: run `make demo` first (or pass --snapshot)")
    torch.set_num_threads(1)  # the in-process part: one intra-op thread per forward, as threads="auto" at batch <= 16
    snap = silverrec.load(snapshot, backend="torchscript")
    rows = []
    for batch in BATCHES:
        bodies = user_bodies(snapshot, batch)
        for callers in CALLERS:
            for system in ("cpp", "python"):
                s = (cpp_in_process(snapshot, bodies, callers, args.seconds) if system == "cpp"
                     else python_in_process(snap, bodies, callers, args.seconds))
                rows.append({"part": "in_process", "system": system, "batch": batch, "callers": callers,
                             "p50_ms": round(s["p50_ms"], 3), "p99_ms": round(s["p99_ms"], 3),
                             "bodies_per_s": round(s["per_s"], 1), "users_per_s": round(s["per_s"] * batch, 1),
                             "load_1min": round(os.getloadavg()[0], 2)})
                print_table(rows[-1:], list(rows[-1]))
    del snap
    torch.set_num_threads(os.cpu_count() or 1)
    servers = {}
    work = Path(tempfile.mkdtemp(prefix="bench_predictor_"))
    script = work / "post.lua"
    script.write_text(WRK_SCRIPT)
    try:
        for kind in ("cpp", "python"):
            servers[kind] = start(kind, snapshot)
        for batch in BATCHES:
            bodies_file = work / f"bodies_{batch}.jsonl"
            bodies_file.write_text("".join(json.dumps(b) + "\n" for b in user_bodies(snapshot, batch)))
            for c in CONCURRENCY:
                for system in ("cpp", "python"):
                    wrk(servers[system][1], bodies_file, script, c, 1)  # warm
                    s = wrk(servers[system][1], bodies_file, script, c, args.seconds)
                    rows.append({"part": "http", "system": system, "batch": batch, "concurrency": c,
                                 "p50_ms": round(s["p50_ms"], 3), "p99_ms": round(s["p99_ms"], 3),
                                 "bodies_per_s": round(s["per_s"], 1), "users_per_s": round(s["per_s"] * batch, 1),
                                 "errors": s["errors"], "load_1min": round(os.getloadavg()[0], 2)})
                    print_table(rows[-1:], list(rows[-1]))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
        shutil.rmtree(work, ignore_errors=True)
    ratios = {}
    for part, key in (("in_process", "callers"), ("http", "concurrency")):
        for r in rows:
            if r["part"] == part and r["system"] == "cpp":
                py = next(x for x in rows if x["part"] == part and x["system"] == "python" and x["batch"] == r["batch"]
                          and x[key] == r[key])
                ratios[f"{part}_b{r['batch']}_{key[0]}{r[key]}"] = {
                    "throughput_cpp_over_python": round(r["bodies_per_s"] / py["bodies_per_s"], 2),
                    "p50_python_over_cpp": round(py["p50_ms"] / r["p50_ms"], 2),
                    "p99_python_over_cpp": round(py["p99_ms"] / r["p99_ms"], 2)}
    print(json.dumps(ratios, indent=1))
    path = write_results("predictor", {"snapshot": str(snapshot.relative_to(ROOT)) if snapshot.is_relative_to(ROOT)
                                       else str(snapshot), "k": K, "seconds": args.seconds,
                                       "http": {"max_batch": 32, "max_wait_ms": 5, "python_processes": "serve's default (one per core)"},
                                       "ratios": ratios}, rows)
    plot(json.loads(path.read_text()), path.with_suffix(".png"))


def plot(payload: dict, path: Path) -> None:
    rows = payload["rows"]
    label = {"cpp": "silverrec-predictor (C++)", "python": "Python predictor"}
    panels = []
    for batch in BATCHES:
        inproc = {label[s]: ([f"{c} caller{'s' if c > 1 else ''}" for c in CALLERS],
                             [next(r["p50_ms"] for r in rows if r["part"] == "in_process" and r["system"] == s
                                   and r["batch"] == batch and r["callers"] == c) for c in CALLERS]) for s in label}
        panels.append(Panel(f"in-process recommend, batch {batch}: p50", "callers", "ms per call", inproc, kind="bar"))
    for batch in BATCHES:
        http = {label[s]: (list(CONCURRENCY), [next(r["users_per_s"] for r in rows if r["part"] == "http" and
                                                    r["system"] == s and r["batch"] == batch and r["concurrency"] == c)
                                               for c in CONCURRENCY]) for s in label}
        panels.append(Panel(f"HTTP /v1/recommend, {batch} user(s) a body: throughput", "concurrency (wrk connections)",
                            "users / s", http, logx=True))
    m = payload.get("machine", {})
    save_plot(path, panels, title=f"silverrec-predictor vs the Python predictor, MovieLens snapshot "
                                  f"({m.get('cores')} cores, torch {m.get('torch')}, {payload.get('created', '')[:10]})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--snapshot", default=str(SNAPSHOT))
    p.add_argument("--seconds", type=float, default=6.0, help="per measurement (default 6)")
    run(p.parse_args())


if __name__ == "__main__" and not plot_only(plot, "predictor"):
    main()
