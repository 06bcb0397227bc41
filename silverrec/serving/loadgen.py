"""Drive a running server with wrk, a load generator in C (Debian's `wrk` package), in a closed loop:
`silverrec tune` measures one server process against several with it, benchmarks/serve.py the server
against the in-process ceiling and its peers.

    >>> bodies = write_bodies(Path("bodies.hex"), [b'{"user_id": 1, "k": 10}', ...])
    >>> wrk(8080, "/v1/recommend", bodies, concurrency=16, seconds=10)
    {"requests": ..., "throughput": ..., "p50_ms": ..., "p99_ms": ..., "errors": ..., "statuses": {...}, ...}

wrk runs one thread with `concurrency` connections, each sending its next request when the last is
answered; every connection rotates through the bodies (one hex-encoded body per line of the file)
from a random start. Latency percentiles are wrk's. With count=True the answers' statuses and
x-silverrec-version headers are counted too (slower: a Lua call per answer).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from silverrec.errors import SilverrecError

WRK_SCRIPT = r"""
local path, route = os.getenv("SILVERREC_BODIES"), os.getenv("SILVERREC_ROUTE")
local count_statuses = os.getenv("SILVERREC_COUNT") == "1"
local reqs = {}
for line in io.lines(path) do
  local body = line:gsub("..", function(cc) return string.char(tonumber(cc, 16)) end)
  reqs[#reqs + 1] = wrk.format("POST", route, {["Content-Type"] = "application/json"}, body)
end
local threads = {}
function setup(thread) table.insert(threads, thread) end
local i = 0
counts = {}
versions = {}
function init(args) i = math.random(#reqs) end
function request()
  i = i % #reqs + 1
  return reqs[i]
end
if count_statuses then
  function response(status, headers, body)
    counts[status] = (counts[status] or 0) + 1
    local v = headers["x-silverrec-version"]
    if v then versions[v] = (versions[v] or 0) + 1 end
  end
end
local function encode(t)
  local parts = {}
  for k, v in pairs(t) do parts[#parts + 1] = string.format("%q: %d", tostring(k), v) end
  return "{" .. table.concat(parts, ", ") .. "}"
end
function done(summary, latency, requests)
  local c, v = {}, {}
  for _, t in ipairs(threads) do
    for k, n in pairs(t:get("counts") or {}) do c[k] = (c[k] or 0) + n end
    for k, n in pairs(t:get("versions") or {}) do v[k] = (v[k] or 0) + n end
  end
  local e = summary.errors
  io.write(string.format('WRK_JSON {"requests": %d, "duration_us": %d, "connect_errors": %d, "read_errors": %d, ' ..
    '"write_errors": %d, "timeouts": %d, "non_2xx": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, "p999_us": %d, ' ..
    '"mean_us": %.1f, "max_us": %d, "statuses": %s, "versions": %s}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
    latency.mean, latency.max, encode(c), encode(v)))
end
"""


def available() -> bool:
    """Whether wrk is on PATH."""
    return shutil.which("wrk") is not None


def write_bodies(path: Path, bodies: list[bytes]) -> Path:
    """The request bodies as wrk's script reads them: one hex-encoded body per line."""
    path.write_text("\n".join(b.hex() for b in bodies) + "\n")
    return path


def wrk(port: int, route: str, bodies: Path, concurrency: int, seconds: float, count: bool = False,
        host: str = "127.0.0.1") -> dict:
    """POST the bodies to http://host:port/route for `seconds` (whole seconds, at least 1) from
    `concurrency` connections -> wrk's counts and latencies (ms), throughput (requests/s), errors."""
    if not available():
        raise SilverrecError("wrk is not on PATH (Debian: apt-get install wrk)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_SCRIPT)
    env = dict(os.environ, SILVERREC_BODIES=str(bodies), SILVERREC_ROUTE=route, SILVERREC_COUNT="1" if count else "0")
    try:
        out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
                              "-s", f.name, f"http://{host}:{port}"], env=env, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRK_JSON ")), None)
    if out.returncode != 0 or line is None:
        raise SilverrecError(f"wrk failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()[-500:]}")
    r = json.loads(line[len("WRK_JSON "):])
    r["throughput"] = r["requests"] / (r["duration_us"] / 1e6)
    for p in ("p50", "p90", "p99", "p999", "mean", "max"):
        r[f"{p}_ms"] = r.pop(f"{p}_us") / 1000
    r["errors"] = r["connect_errors"] + r["read_errors"] + r["write_errors"] + r["timeouts"] + r["non_2xx"]
    return r


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a server started next)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def post(port: int, route: str, body: bytes, headers: dict | None = None, timeout: float = 120.0,
         host: str = "127.0.0.1") -> tuple[int, bytes]:
    """One JSON POST -> (status, body)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{host}:{port}{route}", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_server(cmd: list[str], port: int, route: str, body: bytes, env: dict | None = None,
                 timeout: float = 300.0, name: str = "server") -> subprocess.Popen:
    """Run `cmd` (a server that listens on `port`) in its own process group; return once `body` POSTed
    to `route` answers 200. The server's stderr is kept for the error if it exits first."""
    import time

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SilverrecError(f"{name} exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if post(port, route, body, timeout=30)[0] == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise SilverrecError(f"{name} did not answer within {timeout:g} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its processes, or Ray's raylet with it), SIGKILL after 90 s."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
