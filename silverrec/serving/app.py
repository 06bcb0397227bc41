"""The HTTP app of `silverrec serve DIR`: its routes, the server state behind them (the served version,
the batcher, metrics, reloads) and the ASGI gate in front (body limit, per-route metrics).

    $ silverrec serve snapshots/v1 --port 8080
    $ curl -s localhost:8080/v1/search -d '{"queries": [[0.1, 0.2, ...]], "k": 10}'
    {"item_ids": [[...]], "scores": [[...]], "version": "v1@3f9c2a1b7d0e"}

Routes (the OpenAPI schema is at /openapi.json, the interactive page at /docs):
    POST /v1/search      pure-ANN snapshots (published from a pool): {"queries": [[...]], "k", "filter", "nprobe", "max_probe", "mode"}
    POST /v1/recommend   every other snapshot: one user (user_id | history, features, numeric, filter,
                         exclude) or {"requests": [...]}, with k, k0, nprobe, max_probe, mode, exclude_history
    POST /v1/rank        a model with a user tower: one user and {"items": [ids]}
    GET  /healthz /readyz /v1/model (+ the answering process's id) /metrics;  POST /v1/admin/reload (token)

Every answer names the snapshot version that computed it ("version"). Status codes: 400 malformed
JSON or an invalid request (QueryError: wrong dimension, k out of range, unknown feature, filter
syntax error with its position, ...), 413 body too large, 422 body of the wrong shape or types,
503 queue full (Retry-After) or shutting down, 504 deadline passed (header X-Deadline-Ms or body
"deadline_ms", a budget in milliseconds from arrival). Each request is validated on its own before
it joins a batch, so a bad request never disturbs its batch.

The request path: `Gate`, a plain ASGI app, answers POST /v1/search, /v1/recommend and /v1/rank
itself (body read, JSON parsed with orjson, the route's pydantic model, the batcher, the answer's
bytes encoded in the batch's worker thread); any body it cannot take as it stands (malformed JSON,
a body of the wrong shape, another content type) goes on to the FastAPI app, which answers every
error exactly as it always has. The other routes, /docs and /openapi.json are FastAPI's. Before
the ASGI layers, the connection itself (serving/http.py) answers the plain requests of the answering
routes the same way (`Gate.parse`, then `Server.submit`), without a scope or messages.
"""

import asyncio
import contextlib
import functools
import gc
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

from silverrec.errors import QueryError, SilverrecError, SnapshotError
from silverrec.serving.batcher import Batcher, DeadlineExceeded, QueueFull, ShuttingDown, process_compute
from silverrec.serving.metrics import Metrics
from silverrec.serving.reload import Reloader, admin_refusal
from silverrec.serving.schemas import request_models
from silverrec.serving.served import Served, encode_json, load_served, run_group
from silverrec.serving.tune import TunePolicy


@dataclass
class ServeConfig:
    """Server settings (the `silverrec serve` flags)."""

    host: str = "127.0.0.1"
    port: int = 8080
    max_batch: int = 64  # requests per batch
    max_wait_ms: float = 0.0  # beside a busy batch worker, a free one may hold a short queue this long (batcher.py)
    max_queue: int = 1024  # queued requests before 503
    processes: int = 1  # server processes sharing the port (serving/server.py; `silverrec serve --workers`)
    batch_workers: Optional[int] = None  # batches computed at once per process (None: one per two cores of its share)
    threads: Optional[int] = None  # torch intra-op threads per batch (None: the cores left per batch worker)
    max_body_bytes: int = 4 << 20
    deadline_ms: Optional[float] = None  # default per-request deadline
    admin_token: Optional[str] = None
    tune_file: Optional[str] = None  # silverrec tune's table: batch workers x threads per concurrency
    device: str = "cpu"  # where the snapshot's program runs ("cuda", "cuda:N"; silverrec.load's device)

    def __post_init__(self):
        for name in ("max_batch", "max_queue", "processes", "max_body_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise SilverrecError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.max_wait_ms < 0:
            raise SilverrecError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        for name in ("batch_workers", "threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise SilverrecError(f"{name} must be a positive int, got {value!r}")

    def compute(self) -> tuple[int, int]:
        """(batch workers, threads per batch) of one process (batcher.process_compute)."""
        return process_compute(self.processes, self.batch_workers, self.threads)


class Reply(NamedTuple):
    """An answer: status, JSON body bytes, extra headers (the version header is always added)."""

    status: int
    body: bytes
    version: str
    headers: Optional[dict] = None


class Server:
    """State of one serving app: the served version (`reloads.current`), the batcher, metrics."""

    def __init__(self, path: str | os.PathLike, config: ServeConfig, served: Optional[Served] = None,
                 loader: Optional[Callable[[Path], Served]] = None, coordinator=None):
        self.config = config
        self.metrics = Metrics()
        # loader: path -> a verified, smoke-tested Served (start-up unless `served` is given, and reloads);
        # coordinator: reloads run across the server's processes (serving/processes.py)
        self.policy = TunePolicy.from_file(config.tune_file) if config.tune_file else None
        workers, self.threads = config.compute()
        # on a device, a CUDA stream per batch computed at once (the batch workers, or tune's most)
        streams = max(workers, self.policy.max_workers if self.policy else 1)
        self.reloads = Reloader(path, loader or functools.partial(load_served, device=config.device, streams=streams),
                                self.metrics, served, coordinator)
        self.batcher = Batcher(run_group, max_batch=config.max_batch, max_wait_ms=config.max_wait_ms,
                               max_queue=config.max_queue, workers=workers, threads=self.threads,
                               policy=self.policy, on_batch=self.metrics.batch.observe)
        self.metrics.watch(self.batcher)
        self._sampling = None
        self.ready = False
        self.routes = {"/v1/search", "/v1/recommend", "/v1/rank", "/healthz", "/readyz", "/v1/model", "/metrics",
                       "/v1/admin/reload"}

    @property
    def current(self) -> Served:
        """The version new requests are validated on."""
        return self.reloads.current

    @property
    def version(self) -> str:
        return self.current.version

    async def start(self) -> None:
        torch.set_num_threads(self.threads)
        # every object alive now (the snapshot's, torch's, the libraries': hundreds of thousands) out of the
        # cyclic collector's reach, so that its full collections walk only what serving allocates, not a
        # pause that every request in flight waits behind
        gc.collect()
        gc.freeze()
        await self.batcher.start(max_workers=self.policy.max_workers if self.policy else None)
        self.reloads.start()
        if self.metrics.multiprocess:
            self._sampling = asyncio.get_running_loop().create_task(self.metrics.sample())
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        if self._sampling is not None:
            self._sampling.cancel()
        await self.batcher.stop()
        self.reloads.stop()
        gc.unfreeze()  # the collector sees them again for the interpreter's own teardown

    async def submit(self, header_deadline: Optional[str], body, prepare: str) -> Reply:
        """Validate on the current version, queue, await -> Reply (the answer's bytes come encoded
        from the batch). `header_deadline`: the X-Deadline-Ms header, if sent."""
        served = self.current
        arrived = time.monotonic()
        try:
            deadline_ms = _deadline_ms(header_deadline, getattr(body, "deadline_ms", None), self.config.deadline_ms)
            key, payload = getattr(served, prepare)(body)
        except QueryError as e:
            return _error(400, str(e), served.version)
        deadline = arrived + deadline_ms / 1000.0 if deadline_ms is not None else None
        try:
            return Reply(200, await self.batcher.submit(key, payload, deadline), served.version)
        except QueueFull as e:
            self.metrics.rejected["queue_full"].inc()
            return _error(503, f"overloaded: {e}; retry later", served.version, {"Retry-After": "1"})
        except ShuttingDown as e:
            self.metrics.rejected["shutting_down"].inc()
            return _error(503, str(e), served.version, {"Retry-After": "1"})
        except DeadlineExceeded as e:
            self.metrics.rejected["deadline"].inc()
            return _error(504, f"deadline of {deadline_ms:g} ms exceeded: {e}", served.version)
        except QueryError as e:
            return _error(400, str(e), served.version)
        except Exception as e:  # noqa: BLE001  (errors that name their status: a sharded rank gone -> 503)
            status = getattr(e, "http_status", None)
            if status is None:
                raise
            self.metrics.rejected["unavailable"].inc()
            return _error(int(status), str(e), served.version, {"Retry-After": "1"})


def _deadline_ms(header: Optional[str], body_value: Optional[float], default: Optional[float]) -> Optional[float]:
    if header is not None:
        try:
            value = float(header)
        except ValueError:
            raise QueryError(f"X-Deadline-Ms must be a number of milliseconds, got {header!r}") from None
        if not value > 0 or not math.isfinite(value):
            raise QueryError(f"X-Deadline-Ms must be a positive number of milliseconds, got {header!r}")
        return value
    return body_value if body_value is not None else default


def _error(status: int, message: str, version: str, headers: Optional[dict] = None) -> Reply:
    return Reply(status, encode_json({"detail": message, "version": version}), version, headers)


def _response(reply: Reply):
    """A Reply as a starlette Response (the FastAPI routes)."""
    from starlette.responses import Response

    return Response(reply.body, status_code=reply.status, media_type="application/json",
                    headers={"x-silverrec-version": reply.version, **(reply.headers or {})})


def _json(content: dict, version: str, status: int = 200):
    return _response(Reply(status, json.dumps(content, allow_nan=False).encode(), version))


def create_app(path: str | os.PathLike, config: Optional[ServeConfig] = None, served: Optional[Served] = None,
               loader: Optional[Callable[[Path], Served]] = None, coordinator=None):
    """The app serving the snapshot at `path` (loaded and smoke-tested now, unless `served` is given).
    `loader(path) -> Served` loads for reloads (default `load_served`); `coordinator`: see Reloader."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError

    config = config or ServeConfig()
    server = Server(path, config, served, loader, coordinator)
    SearchBody, UserBody, RecommendBody, RankBody, ReloadBody = request_models()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    app = FastAPI(title="silverrec", version=_package_version(), lifespan=lifespan,
                  description="Recommendation serving as one PyTorch model. Every answer names its snapshot version.")
    app.state.server = server

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            e = next(e for e in errors if e.get("type") == "json_invalid")
            ctx = e.get("ctx", {})
            pos = e.get("loc", ("body", "?"))[-1]
            return _response(_error(400, f"malformed JSON at position {pos}: {ctx.get('error', e.get('msg'))}",
                                    server.version))
        parts = []
        for e in errors[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ())[1:]) or "body"
            parts.append(f"{loc}: {e.get('msg')}")
        more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
        return _response(_error(422, "invalid request: " + "; ".join(parts) + more, server.version))

    @app.exception_handler(QueryError)
    async def _query_error(request: Request, exc: QueryError):
        return _response(_error(400, str(exc), server.version))

    @app.post("/v1/search", summary="top-k items for each query row (pure-ANN snapshots, published from a pool)")
    async def search(body: SearchBody, request: Request):
        return _response(await server.submit(request.headers.get("x-deadline-ms"), body, "prepare_search"))

    @app.post("/v1/recommend", summary="top-k items for users (every snapshot but a pure-ANN index)")
    async def recommend(body: RecommendBody, request: Request):
        return _response(await server.submit(request.headers.get("x-deadline-ms"), body, "prepare_recommend"))

    @app.post("/v1/rank", summary="scores of given items for one user (rec snapshots)")
    async def rank(body: RankBody, request: Request):
        return _response(await server.submit(request.headers.get("x-deadline-ms"), body, "prepare_rank"))

    @app.get("/healthz")
    async def healthz():
        return _json({"status": "ok", "version": server.version}, server.version)

    @app.get("/readyz")
    async def readyz():
        if not server.ready:
            return _response(_error(503, "not ready (starting or shutting down)", server.version))
        gone = getattr(server.current.snap, "unavailable", None)  # a sharded runtime whose rank is gone
        if gone:
            return _response(_error(503, f"not ready: {gone}", server.version))
        return _json({"status": "ready", "version": server.version}, server.version)

    @app.get("/v1/model")
    async def model():
        cur = server.current
        return _json({"version": cur.version, "kind": cur.kind, "path": str(cur.snap.path),
                      "backend": cur.snap.backend, "manifest": cur.snap.manifest, "process": os.getpid(),
                      "serving": {k: v for k, v in asdict(config).items() if k != "admin_token"}}, cur.version)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        from starlette.responses import Response

        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/admin/reload", summary="load, verify and switch to a snapshot (token required)")
    async def reload(request: Request, body: Optional[ReloadBody] = None):
        refused = admin_refusal(request.headers, config.admin_token)
        if refused is not None:
            return _response(_error(*refused, server.version))
        try:
            out = await server.reloads.reload(body.path if body is not None else None)
        except SnapshotError as e:
            return _response(_error(409, str(e), server.version))
        return _json(out, out["version"])

    return Gate(app, server, request_models())


def _package_version() -> str:
    from silverrec import __version__

    return __version__


class BodyTooLarge(Exception):
    pass


JSON_TYPES = (b"application/json", b"application/json; charset=utf-8")
_REPLY_HEADERS = [(b"content-type", b"application/json")]


class Gate:
    """Pure ASGI app in front of FastAPI: the body-size limit (413), per-route request count and
    latency, and the request path of the answering routes (module docstring)."""

    json_types = JSON_TYPES

    def __init__(self, app, server: "Server", models):
        self.app = app
        self.server = server
        self.answering = {"/v1/search": (models.SearchBody, "prepare_search"),
                          "/v1/recommend": (models.RecommendBody, "prepare_recommend"),
                          "/v1/rank": (models.RankBody, "prepare_rank")}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server, start = self.server, time.perf_counter()
        path = scope["path"]
        route = path if path in server.routes else "other"
        status = [500]
        limit = server.config.max_body_bytes

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            length = _header(scope, b"content-length")
            if length is not None and int(length) > limit:
                raise BodyTooLarge()
            answering = self.answering.get(path) if scope["method"] == "POST" else None
            if answering is None:
                await self.app(scope, _limited(receive, limit), send_wrapper)
                return
            body = await _read_body(receive, limit)
            reply = await self._answer(scope, body, *answering)
            if reply is None:  # not a body this path takes as it stands: FastAPI names the problem
                await self.app(scope, _replay(body, receive), send_wrapper)
                return
            status[0] = reply.status
            headers = _REPLY_HEADERS + [(b"x-silverrec-version", reply.version.encode())]
            if reply.headers:
                headers += [(k.lower().encode(), str(v).encode()) for k, v in reply.headers.items()]
            await send({"type": "http.response.start", "status": reply.status, "headers": headers})
            await send({"type": "http.response.body", "body": reply.body})
        except BodyTooLarge:
            body = json.dumps({"detail": f"request body exceeds {limit} bytes", "version": server.version}).encode()
            status[0] = 413
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
        finally:
            server.metrics.observe(route, status[0], time.perf_counter() - start)

    async def _answer(self, scope, body: bytes, model, prepare: str) -> Optional[Reply]:
        """The answer to a JSON body that parses and fits the route's model (`parse`); None for any
        other body (FastAPI then answers as it always has: json.loads, the model, its error)."""
        if _header(scope, b"content-type") not in JSON_TYPES:
            return None
        parsed = self.parse(scope["path"], body)
        if parsed is None:
            return None
        deadline = _header(scope, b"x-deadline-ms")
        return await self.server.submit(None if deadline is None else deadline.decode("latin-1"), parsed, prepare)

    def parse(self, path: str, body: bytes):
        """The body of a request to an answering route as its pydantic model, when it parses (orjson)
        to a JSON object that fits the model; None for any other body."""
        import orjson
        from pydantic import ValidationError

        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict):
            return None
        try:
            return self.answering[path][0].model_validate(data)
        except ValidationError:
            return None


def _header(scope, name: bytes) -> Optional[bytes]:
    """The first value of a request header (name in lower case), None if absent."""
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


async def _read_body(receive, limit: int) -> bytes:
    """The whole request body; BodyTooLarge past `limit` bytes."""
    parts, seen = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return b""
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            raise BodyTooLarge()
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def _limited(receive, limit: int):
    """`receive` that raises BodyTooLarge once more than `limit` body bytes arrived."""
    seen = [0]

    async def receive_limited():
        message = await receive()
        if message["type"] == "http.request":
            seen[0] += len(message.get("body", b""))
            if seen[0] > limit:
                raise BodyTooLarge()
        return message

    return receive_limited


def _replay(body: bytes, receive):
    """`receive` that hands over an already read body once, then waits on the connection."""
    sent = [False]

    async def receive_again():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again
