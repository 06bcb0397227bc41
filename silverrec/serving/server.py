"""`silverrec serve DIR`: the HTTP app (serving/app.py) on a bound socket, in the foreground until
SIGINT/SIGTERM (in-flight requests are answered first) or in a background thread (tests, benchmarks).

    $ silverrec serve snapshots/v1 --port 8080
    $ curl -s localhost:8080/v1/search -d '{"queries": [[0.1, 0.2, ...]], "k": 10}'
    {"item_ids": [[...]], "scores": [[...]], "version": "v1@3f9c2a1b7d0e"}

A non-loopback address is refused without an admin token (serving/reload.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from silverrec.errors import SilverrecError
from silverrec.serving.app import ServeConfig, create_app
from silverrec.serving.reload import TOKEN_ENV
from silverrec.serving.served import Served


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Running:
    """A server running in a background thread on a bound socket (tests, benchmarks, tune)."""

    def __init__(self, app, sock: socket.socket, server):
        self.app, self.sock, self.server = app, sock, server
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.thread: Optional[threading.Thread] = None

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)


def bind(host: str, port: int, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A TCP socket bound to (host, port), listening unless `listen=False`; `reuse_port`: SO_REUSEPORT,
    so that several processes bind the same port and the kernel spreads connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only then (without it,
    # Nagle's algorithm holds back the second part of a response written in two parts until the
    # client acknowledges the first, and the client delays that ACK by its delayed-ACK timer)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SilverrecError(f"cannot bind {host}:{port}: {e}") from None
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def check_bind(config: ServeConfig) -> None:
    if not is_loopback(config.host) and not config.admin_token:
        raise SilverrecError(f"refusing to bind non-loopback address {config.host} without an admin token: "
                             f"set ${TOKEN_ENV} or pass --admin-token-file")


def uvicorn_server(app, log_level: str = "warning"):
    """uvicorn serving `app` (serving/app.py's Gate) on uvloop's event loop, with the connection
    protocol of serving/http.py (the answering routes' plain requests taken on the connection)."""
    import signal

    import uvicorn

    from silverrec.serving.http import protocol_for

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # graceful shutdown, then exit 0 (uvicorn would re-raise the signal after draining)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    cfg = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=30,
                         backlog=2048, proxy_headers=False, server_header=False, http=protocol_for(app))
    return _Server(cfg)


def run_loop(main) -> None:
    """Run the coroutine `main` on uvloop (libuv's event loop, in C; the HTTP parser is httptools, also
    in C): less of the server's CPU time per request than asyncio's loop (docs/benchmarks.md)."""
    import uvloop

    uvloop.run(main)


def start_in_thread(path: str | os.PathLike, config: Optional[ServeConfig] = None, served: Optional[Served] = None,
                    timeout: float = 60.0, loader: Optional[Callable[[Path], Served]] = None) -> Running:
    """Start a server on (config.host, config.port; 0 = ephemeral) in a daemon thread; wait until ready."""
    config = config or ServeConfig(port=0)
    check_bind(config)
    app = create_app(path, config, served, loader)
    sock = bind(config.host, config.port)
    server = uvicorn_server(app)
    run = Running(app, sock, server)
    server.install_signal_handlers = lambda: None  # noqa: E731  (not the main thread)
    run.thread = threading.Thread(target=lambda: run_loop(server.serve(sockets=[sock])), daemon=True,
                                  name="silverrec-serve")
    run.thread.start()
    t0 = time.monotonic()
    while not server.started:
        if not run.thread.is_alive() or time.monotonic() - t0 > timeout:
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    return run


def serve(path: str | os.PathLike, config: ServeConfig, served: Optional[Served] = None,
          loader: Optional[Callable[[Path], Served]] = None) -> int:
    """Run in the foreground until SIGINT/SIGTERM; in-flight requests finish before exit.
    `served` / `loader`: as create_app (the sharded launcher passes the distributed runtime's).
    One process: several (config.processes) run through serving/processes.py."""
    check_bind(config)
    app = create_app(path, config, served, loader)
    sock = bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    srv = app.server.current
    print(banner({"kind": srv.kind, "version": srv.version, "backend": srv.snap.backend}, config, host, port),
          file=sys.stderr, flush=True)
    server = uvicorn_server(app, log_level=os.environ.get("SILVERREC_LOG_LEVEL", "warning"))
    run_loop(server.serve(sockets=[sock]))
    print("silverrec: stopped (in-flight requests answered)", file=sys.stderr, flush=True)
    return 0


def banner(served: dict, config: ServeConfig, host: str, port: int) -> str:
    """The line a started server prints: what it serves, where, and its settings."""
    workers, threads = config.compute()
    processes = f"{config.processes} processes, " if config.processes > 1 else ""
    return (f"silverrec: serving {served['kind']} snapshot {served['version']} ({served['backend']}, {config.device}) "
            f"on http://{host}:{port} ({processes}max batch {config.max_batch}, max wait {config.max_wait_ms:g} ms, "
            f"batch workers {workers}, threads {threads}{', tune ' + config.tune_file if config.tune_file else ''})")
