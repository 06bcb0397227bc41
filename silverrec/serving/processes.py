"""`silverrec serve DIR --workers N`: N server processes on one port, and the parent that runs them.

Each process binds the port with SO_REUSEPORT (the kernel spreads new connections over them), loads
its own copy of the snapshot and runs its own app, batcher and event loop (serving/server.py), so
the HTTP, JSON and batch work of the requests runs on every core rather than under one
interpreter lock. The parent holds the port from before the first process starts (so port 0 picks
one port for all), waits until every process answers, prints one line, and then only supervises:

- Reload: POST /v1/admin/reload reaches one process, which hands it to the parent; the parent has
  every process load the snapshot (`Reloader.prepare`, beside the version it serves), and only when
  all have does it tell every one to switch (`commit`); one refusal leaves all on their old version
  (`abort`) and answers 409 with its reason. The answer comes when every process has switched.
- Stop: SIGTERM or SIGINT to the parent reaches every process as SIGTERM; each answers its requests
  in flight, then the parent exits 0.
- A process that exits on its own stops the others and the parent exits 1 (a service manager
  restarts the whole); a process that cannot load the snapshot at start stops all with exit 2.

GET /metrics, whichever process answers, adds up the metrics of every live process (each writes its
values to files in a folder the parent makes and removes; serving/metrics.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

from silverrec.errors import SilverrecError, SnapshotError
from silverrec.serving.app import ServeConfig, create_app
from silverrec.serving.batcher import cores
from silverrec.serving.metrics import MULTIPROC_ENV
from silverrec.serving.server import banner, bind, check_bind, run_loop, uvicorn_server


def default_processes() -> int:
    """`silverrec serve`'s default --workers: one server process per two cores (at least one), each with
    one batch worker whose forward runs on both (ServeConfig.compute): on two cores that measured ahead
    of a process per core at every concurrency but one (docs/benchmarks.md, serve.py)."""
    return max(1, cores() // 2)


def serve_processes(path: str | os.PathLike, config: ServeConfig) -> int:
    """Run `config.processes` server processes on (config.host, config.port) until SIGTERM / SIGINT
    (module docstring) -> exit code."""
    check_bind(config)
    # a plain bind first: it fails where anything listens on the port, even another server's processes
    # bound with SO_REUSEPORT, which the processes' own binds would join; then the port is held (port 0:
    # the one the plain bind picked) with SO_REUSEPORT until every process has bound it
    probe = bind(config.host, config.port, listen=False)
    port = probe.getsockname()[1]
    probe.close()
    reservation = bind(config.host, port, reuse_port=True, listen=False)
    host = reservation.getsockname()[0]
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: no torch state forked
    child_config = dataclasses.replace(config, port=port)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    metrics_dir = tempfile.mkdtemp(prefix="silverrec-metrics-")  # the processes' metric files (serving/metrics.py)
    environ = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = metrics_dir  # what the spawned processes inherit
    procs, conns = [], []
    try:
        for i in range(config.processes):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_process_main, args=(str(path), child_config, child_end),
                               name=f"silverrec-serve-{i}", daemon=False)
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        parent = _Parent(procs, conns, stop)
        ready = parent.wait_ready()
        if ready is None:
            return parent.code
        print(banner(ready, config, host, port), file=sys.stderr, flush=True)
        code = parent.supervise()
        if code == 0:
            print("silverrec: stopped (in-flight requests answered)", file=sys.stderr, flush=True)
        return code
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        reservation.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if environ is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = environ
        for s, handler in previous.items():
            signal.signal(s, handler)


class _Parent:
    """The parent's side of the pipes: readiness, reload coordination, supervision."""

    def __init__(self, procs: list, conns: list, stop: threading.Event):
        self.procs, self.conns, self.stop = procs, conns, stop
        self.requests: collections.deque = collections.deque()  # (conn, path) reloads asked while one runs
        self.code = 0

    def wait_ready(self) -> Optional[dict[str, Any]]:
        """Every process's ("ready", info) -> the first one's info; None (and self.code) if one failed."""
        info, waiting = None, set(range(len(self.conns)))
        while waiting:
            if self.stop.is_set():
                return None
            for i in list(waiting):
                if not self.conns[i].poll(0.05):
                    if not self.procs[i].is_alive() and not self.conns[i].poll():
                        print(f"silverrec: error: server process {i} exited with code {self.procs[i].exitcode} "
                              "while starting", file=sys.stderr, flush=True)
                        self.code = 2
                        return None
                    continue
                kind, value = self._recv(i)
                if kind == "failed":
                    print(f"silverrec: error: {value}", file=sys.stderr, flush=True)
                    self.code = 2
                    return None
                if kind == "ready":
                    info = info or value
                    waiting.discard(i)
        return info

    def supervise(self) -> int:
        """Until stop: reload requests in order; a process that exits on its own stops all (1)."""
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        while not self.stop.is_set():
            if self.requests:
                self._reload(*self.requests.popleft())
                continue
            ready = multiprocessing.connection.wait(list(sentinels) + self.conns, timeout=0.2)
            for r in ready:
                if r in sentinels:
                    i = sentinels[r]
                    print(f"silverrec: server process {i} exited with code {self.procs[i].exitcode}; stopping",
                          file=sys.stderr, flush=True)
                    return 1
                i = self.conns.index(r)
                kind, value = self._recv(i)
                if kind == "reload":
                    self.requests.append((i, value))
        return 0

    def _recv(self, i: int) -> tuple[str, Any]:
        try:
            return self.conns[i].recv()
        except (EOFError, OSError):
            return "gone", f"server process {i} exited"

    def _expect(self, i: int, kinds: tuple[str, ...]) -> tuple[str, Any]:
        """Process i's next message of one of `kinds`; reload requests that arrive meanwhile wait."""
        while True:
            kind, value = self._recv(i)
            if kind in kinds or kind == "gone":
                return kind, value
            if kind == "reload":
                self.requests.append((i, value))

    def _reload(self, asker: int, path: Optional[str]) -> None:
        """Prepare on every process, then commit on all or abort on all; answer the asking process."""
        for c in self.conns:
            c.send(("prepare", path))
        replies = [self._expect(i, ("prepared", "refused")) for i in range(len(self.conns))]
        refusal = next((value for kind, value in replies if kind != "prepared"), None)
        if refusal is not None:
            for c in self.conns:
                c.send(("abort", None))
            self.conns[asker].send(("refused", refusal))
            return
        for c in self.conns:
            c.send(("commit", None))
        answers = [self._expect(i, ("committed",)) for i in range(len(self.conns))]
        kind, answer = answers[asker]
        self.conns[asker].send(("reloaded", answer) if kind == "committed" else ("refused", answer))


def _process_main(path: str, config: ServeConfig, conn) -> None:
    """One server process (spawned): load, bind the shared port, serve; the pipe to the parent
    carries readiness, this process's reload requests and the parent's prepare / commit / abort."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent turns SIGINT into a SIGTERM for each process
    pipe = _Pipe(conn)
    try:
        app = create_app(path, config, coordinator=pipe.reload)
        sock = bind(config.host, config.port, reuse_port=True)
    except SilverrecError as e:
        pipe.send("failed", str(e))
        return
    server = uvicorn_server(app, log_level=os.environ.get("SILVERREC_LOG_LEVEL", "warning"))

    async def main():
        pipe.start(asyncio.get_running_loop(), app.server.reloads)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            srv = app.server.current
            pipe.send("ready", {"kind": srv.kind, "version": srv.version, "backend": srv.snap.backend})
        await task

    run_loop(main())


class _Pipe:
    """A server process's end of the pipe: sends (from the event loop and the control thread, one at a
    time) and the control thread that answers the parent."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()
        self.waiting: collections.deque = collections.deque()  # futures of this process's reload requests
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.asking: Optional[asyncio.Lock] = None

    def send(self, kind: str, value: Any) -> None:
        with self.lock:
            self.conn.send((kind, value))

    def start(self, loop: asyncio.AbstractEventLoop, reloads) -> None:
        self.loop, self.asking = loop, asyncio.Lock()
        threading.Thread(target=self._control, args=(reloads,), daemon=True, name="silverrec-control").start()

    async def reload(self, path: Optional[str]) -> dict[str, Any]:
        """The app's reload: asked of the parent, which runs it on every process (module docstring)."""
        async with self.asking:
            future = self.loop.create_future()
            self.waiting.append(future)
            self.send("reload", path)
            kind, value = await future
        if kind != "reloaded":
            raise SnapshotError(value)
        return value

    def _control(self, reloads) -> None:
        while True:
            try:
                kind, value = self.conn.recv()
            except (EOFError, OSError):  # the parent is gone: stop as on SIGTERM
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if kind == "prepare":
                try:
                    self.send("prepared", reloads.prepare(value))
                except SnapshotError as e:
                    self.send("refused", str(e))
            elif kind == "commit":
                self.send("committed", reloads.commit())
            elif kind == "abort":
                reloads.abort()
            elif kind in ("reloaded", "refused"):
                self.loop.call_soon_threadsafe(_resolve, self.waiting.popleft(), (kind, value))


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
