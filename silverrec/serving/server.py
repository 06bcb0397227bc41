"""`silverrec serve DIR`: a snapshot behind HTTP, with server-side batching, deadlines, backpressure,
metrics and load-before-swap reloads.

    $ silverrec serve snapshots/v1 --port 8080 --max-batch 32 --max-wait-ms 5
    $ curl -s localhost:8080/v1/search -d '{"queries": [[0.1, 0.2, ...]], "k": 10}'
    {"item_ids": [[...]], "scores": [[...]], "version": "v1@3f9c2a1b7d0e"}

Routes (the OpenAPI schema is at /openapi.json, the interactive page at /docs):
    POST /v1/search      pure-ANN snapshots (published from a pool): {"queries": [[...]], "k", "filter", "nprobe", "max_probe", "mode"}
    POST /v1/recommend   kind rec: one user (user_id | history, features, numeric, filter, exclude) or
                         {"requests": [...]}, with k, k0, nprobe, max_probe, mode, exclude_history;
                         kind generative: {"history": [...]} or {"requests": [{"history": [...]}, ...]}, k
    POST /v1/rank        kind rec: one user and {"items": [ids]}
    GET  /healthz /readyz /v1/model /metrics;  POST /v1/admin/reload (token)

Every answer names the snapshot version that computed it ("version"). Status codes: 400 malformed
JSON or an invalid request (QueryError: wrong dimension, k out of range, unknown feature, filter
syntax error with its position, ...), 413 body too large, 422 body of the wrong shape or types,
503 queue full (Retry-After) or shutting down, 504 deadline passed (header X-Deadline-Ms or body
"deadline_ms", a budget in milliseconds from arrival). Each request is validated on its own before
it joins a batch, so a bad request never disturbs its batch.
"""


import asyncio
import contextlib
import functools
import hashlib
import hmac
import ipaddress
import json
import math
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from silverrec.errors import QueryError, SilverrecError, SnapshotError, check_k, check_queries
from silverrec.serving.batcher import Batcher, DeadlineExceeded, QueueFull, ShuttingDown

TOKEN_ENV = "SILVERREC_ADMIN_TOKEN"
MAX_QUERY_ROWS = 1024  # rows per search request


@dataclass
class ServeConfig:
    """Server settings (the `silverrec serve` flags)."""

    host: str = "127.0.0.1"
    port: int = 8080
    max_batch: int = 32  # requests per batch
    max_wait_ms: float = 5.0  # a batch closes when its oldest request has waited this long
    max_queue: int = 1024  # queued requests before 503
    workers: int = 1  # batches computed at once
    threads: Optional[int] = None  # torch intra-op threads (None: torch's default)
    max_body_bytes: int = 4 << 20
    deadline_ms: Optional[float] = None  # default per-request deadline
    admin_token: Optional[str] = None
    tune_file: Optional[str] = None  # silverrec tune's table: workers x threads per concurrency
    device: str = "cpu"  # where the snapshot's program runs ("cuda", "cuda:N"; silverrec.load's device)

    def __post_init__(self):
        for name in ("max_batch", "max_queue", "workers", "max_body_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise SilverrecError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.max_wait_ms < 0:
            raise SilverrecError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.threads is not None and self.threads < 1:
            raise SilverrecError(f"threads must be >= 1, got {self.threads}")


def snapshot_version(snap) -> str:
    """The manifest's `version` if it records one, `<directory name>@<version id prefix>` for a sharded
    snapshot (the id every shard carries), else `<directory name>@<manifest sha256 prefix>`."""
    version = snap.manifest.get("version")
    if version:
        return str(version)
    if snap.manifest.get("kind") == "sharded" and snap.manifest["config"].get("version"):
        return f"{Path(snap.path).name}@{str(snap.manifest['config']['version'])[:12]}"
    digest = hashlib.sha256(json.dumps(snap.manifest, sort_keys=True).encode()).hexdigest()[:12]
    return f"{Path(snap.path).name}@{digest}"


def read_token(token_file: Optional[str] = None) -> Optional[str]:
    """Admin token: the file's first line if given, else $SILVERREC_ADMIN_TOKEN; None if neither."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise SilverrecError(f"cannot read admin token file {token_file}: {e}") from None
        if not token:
            raise SilverrecError(f"admin token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ----------------------------------------------------------------------------------- tune policy

class TunePolicy:
    """`silverrec tune`'s table: for each concurrency level, the best (workers, threads).

    `policy(in_flight)` picks the row of the largest measured concurrency <= in_flight (the smallest
    row below that)."""

    def __init__(self, rows: list[dict[str, Any]]):
        if not rows:
            raise SilverrecError("tune file has no 'best' rows")
        self.rows = sorted(rows, key=lambda r: r["concurrency"])
        self.max_workers = max(int(r["workers"]) for r in self.rows)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TunePolicy":
        try:
            data = json.loads(Path(path).read_text())
            rows = [{"concurrency": int(r["concurrency"]), "workers": int(r["workers"]), "threads": int(r["threads"])}
                    for r in data["best"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SilverrecError(f"cannot read tune file {path}: {type(e).__name__}: {e}") from None
        return cls(rows)

    def __call__(self, in_flight: int) -> tuple[int, int]:
        row = self.rows[0]
        for r in self.rows:
            if r["concurrency"] <= in_flight:
                row = r
        return row["workers"], row["threads"]


# ----------------------------------------------------------------------------------- request models

def _models():
    """Pydantic request models (built lazily so importing this module needs no pydantic)."""
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

    Value = Union[StrictStr, StrictInt]

    class SearchBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        queries: list[list[StrictFloat]] = Field(description="float query rows [B, D]")
        k: StrictInt = 10
        filter: Union[StrictStr, list[Optional[StrictStr]], None] = Field(
            None, description="one filter string for every row, or one string (or null) per row")
        nprobe: Optional[StrictInt] = None
        max_probe: Optional[StrictInt] = None
        mode: Union[StrictStr, list[StrictStr], None] = None
        deadline_ms: Optional[float] = Field(None, gt=0, description="budget in ms from arrival; 504 after")

    class UserBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        user_id: Optional[StrictInt] = None
        history: Optional[list[StrictInt]] = None
        features: dict[str, Union[Value, list[Value]]] = Field(default_factory=dict)
        numeric: dict[str, StrictFloat] = Field(default_factory=dict)
        filter: Optional[StrictStr] = None
        exclude: list[StrictInt] = Field(default_factory=list)

    class RecommendBody(UserBody):
        requests: Optional[list[UserBody]] = Field(None, description="several users (else the top-level user fields)")
        k: StrictInt = 10
        k0: Optional[StrictInt] = None
        nprobe: Optional[StrictInt] = None
        max_probe: Optional[StrictInt] = None
        mode: StrictStr = "auto"
        exclude_history: Optional[StrictBool] = None
        deadline_ms: Optional[float] = Field(None, gt=0)

    class RankBody(UserBody):
        items: list[StrictInt] = Field(description="item ids to score, in the order of the answer")
        deadline_ms: Optional[float] = Field(None, gt=0)

    class ReloadBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        path: Optional[StrictStr] = Field(None, description="snapshot directory (default: reload the served path)")

    return SearchBody, UserBody, RecommendBody, RankBody, ReloadBody


USER_FIELDS = ("user_id", "history", "features", "numeric", "filter", "exclude")


# ----------------------------------------------------------------------------------- served model

def answers(kind: str, config: dict[str, Any]) -> str:
    """What a snapshot answers: "search" (a pure-ANN index: the root module with a query tower),
    "recommend" (a recommendation model) or "generative"; "" = nothing servable."""
    if kind == "rec":
        return "search" if config.get("spec", {}).get("tower") == "query" else "recommend"
    return "generative" if kind == "generative" else ""


class Served:
    """One loaded snapshot version: validates requests into (group key, payload) and runs groups.

    `snap` is a predictor.Snapshot, a sharded.ShardedSnapshot (one process) or a
    distributed.RuntimeView (rank 0 of a sharded deployment): anything with path, manifest, config,
    kind, backend and search(). A sharded one names a `template` shard whose config (nlist, probe
    defaults) and filter vocabulary are the global ones, for validating requests."""

    def __init__(self, snap):
        self.snap = snap
        self.template = getattr(snap, "template", snap)
        self.version = snapshot_version(snap)
        self.kind = snap.kind
        self.answers = answers(snap.kind, self.template.config)
        if self.answers == "recommend":
            self.handler = snap.rec_handler()

    # -------------------------------------------------------------- search
    def prepare_search(self, body) -> tuple[tuple, dict]:
        snap, cfg = self.snap, self.template.config
        if self.answers != "search":
            raise QueryError("this snapshot is not a pure-ANN index: it does not answer /v1/search (use /v1/recommend)")
        if not body.queries:
            raise QueryError("queries must hold at least one row")
        if len(body.queries) > MAX_QUERY_ROWS:
            raise QueryError(f"{len(body.queries)} query rows exceed the limit of {MAX_QUERY_ROWS} per request")
        dim = int(cfg["dim"])
        bad = next((i for i, row in enumerate(body.queries) if len(row) != dim), None)
        if bad is not None:
            raise QueryError(f"query row {bad} has {len(body.queries[bad])} values, the index holds {dim}-d items")
        queries = check_queries(torch.tensor(body.queries, dtype=torch.float32), dim)
        k = check_k(body.k, snap.manifest["item_count"])
        B = queries.shape[0]
        nlist = int(cfg["nlist"])
        nprobe = _check_int("nprobe", int(cfg["default_nprobe"]) if body.nprobe is None else body.nprobe, 1, nlist)
        from silverrec.filtering.filter_program import compile_request, normalize_filters
        from silverrec.retrieval.filtered_search import _modes, filter_plan

        filters = normalize_filters(body.filter, B)
        if filters is None:  # unfiltered rows: plain IVF semantics, exactly nprobe clusters
            if body.max_probe is not None or body.mode is not None:
                pass  # accepted and unused, as snap.search does
            return (self, "search", nprobe, None), {"queries": queries, "k": k}
        modes = _modes("auto" if body.mode is None else body.mode, B)  # validates names and count
        max_probe = body.max_probe
        if max_probe is None:
            max_probe = max(nprobe, min(nlist, int(cfg["search"]["default_max_probe"])))
        max_probe = _check_int("max_probe", max_probe, nprobe, nlist)
        plan = filter_plan(self.template)
        for b, f in enumerate(filters):  # syntax errors (with position) and unknown features, per row
            if f is not None:
                compile_request([f], plan)
        # the widening step reads k (match_factor * k), so only equal k share a forward
        mode_names = [body.mode] * B if isinstance(body.mode, str) or body.mode is None else list(body.mode)
        mode_names = ["auto" if m is None else m for m in mode_names]
        del modes
        return (self, "search", nprobe, max_probe, k), {"queries": queries, "k": k, "filters": filters,
                                                         "modes": mode_names}

    def run_search(self, key: tuple, payloads: list[dict]) -> list[dict]:
        queries = torch.cat([p["queries"] for p in payloads]) if len(payloads) > 1 else payloads[0]["queries"]
        k = max(p["k"] for p in payloads)  # the largest request's k; the others take their prefix
        options: dict[str, Any] = {"nprobe": key[2]}
        if key[3] is not None:
            options["max_probe"] = key[3]
            options["filter"] = [f for p in payloads for f in p["filters"]]
            options["mode"] = [m for p in payloads for m in p["modes"]]
        res = self.snap.search(queries, k, **options)
        out, start = [], 0
        for p in payloads:
            n = p["queries"].shape[0]
            out.append({"item_ids": res.item_ids[start:start + n, :p["k"]].tolist(),
                        "scores": _clean(res.scores[start:start + n, :p["k"]].tolist())})
            start += n
        return out

    # -------------------------------------------------------------- recommend
    def _user_requests(self, body) -> list[dict]:
        top = {f: getattr(body, f) for f in USER_FIELDS}
        if body.requests is not None:
            given = [f for f in USER_FIELDS if f in body.model_fields_set]
            if given:
                raise QueryError(f"give either 'requests' or the top-level user fields, not both (got {given})")
            users = [{f: getattr(r, f) for f in USER_FIELDS} for r in body.requests]
            if not users:
                raise QueryError("requests must hold at least one request")
            if len(users) > MAX_QUERY_ROWS:
                raise QueryError(f"{len(users)} requests exceed the limit of {MAX_QUERY_ROWS} per call")
            return users
        return [top]

    def prepare_recommend(self, body) -> tuple[tuple, dict]:
        users = self._user_requests(body)
        if self.answers == "generative":
            return self._prepare_generative(body, users)
        if self.answers != "recommend":
            raise QueryError("this snapshot is a pure-ANN index: it answers /v1/search, not /v1/recommend")
        from silverrec.filtering.filter_program import compile_request
        from silverrec.retrieval.filtered_ivf import MODES
        from silverrec.serving.recommend import DEFAULT_EXCLUDE_LIMIT, RecRequest

        h, cfg = self.handler, self.handler.config
        n, nlist = len(h.row_to_item), int(cfg["nlist"])
        k = _check_int("k", body.k, 1, n)
        k0 = max(k, int(cfg["default_k0"]) if body.k0 is None else _check_int("k0", body.k0, 1, n))
        nprobe = _check_int("nprobe", int(cfg["default_nprobe"]) if body.nprobe is None else body.nprobe, 1, nlist)
        max_probe = _check_int("max_probe", max(nprobe, int(cfg["search"]["default_max_probe"]))
                               if body.max_probe is None else body.max_probe, nprobe, nlist)
        if body.mode not in MODES:
            raise QueryError(f"unknown search mode {body.mode!r}: use one of {sorted(MODES)}")
        exclude_history = True if body.exclude_history is None else body.exclude_history
        limit = int(cfg.get("exclude_limit", DEFAULT_EXCLUDE_LIMIT))
        requests = []
        for b, u in enumerate(users):
            r = RecRequest(**{f: v for f, v in u.items() if v is not None})
            where = f"request {b}" if len(users) > 1 else "request"
            try:
                h.encode([r], exclude_history, limit)  # ids, user, features: named errors, per request
                if r.filter is not None:
                    compile_request([r.filter], h.plan)
            except QueryError as e:
                raise QueryError(str(e).replace("request 0", where, 1)) from None
            requests.append(r)
        key = (self, "rec", k0, nprobe, max_probe, body.mode, exclude_history)
        return key, {"requests": requests, "k": k}

    def _prepare_generative(self, body, users: list[dict]) -> tuple[tuple, dict]:
        from silverrec.serving.predictor import history_tokens

        beams = int(self.snap.config.get("beam_width", 0)) or None
        k = _check_int("k", body.k, 1, beams or self.snap.manifest["item_count"])
        extra = [f for u in users for f in USER_FIELDS if f != "history" and u[f] not in (None, {}, [])]
        if extra:
            raise QueryError(f"a generative snapshot reads only 'history', got {sorted(set(extra))}")
        histories = []
        for b, u in enumerate(users):
            if u["history"] is None:
                raise QueryError(f"request {b}: a generative snapshot needs a history (item ids, oldest first)")
            histories.append(list(u["history"]))
        ids, tokens, order = self.snap._generative_items()
        history_tokens(histories, ids[order], tokens[order], int(self.snap.config["max_history_items"]))
        key = (self, "gen", bool(body.exclude_history))
        return key, {"histories": histories, "k": k}

    def run_recommend(self, key: tuple, payloads: list[dict]) -> list[dict]:
        if key[1] == "gen":
            res = self.snap.recommend([h for p in payloads for h in p["histories"]], exclude_history=key[2])
            out, start = [], 0
            for p in payloads:
                n = len(p["histories"])
                out.append({"item_ids": res.item_ids[start:start + n, :p["k"]].tolist(),
                            "scores": _clean(res.scores[start:start + n, :p["k"]].tolist())})
                start += n
            return out
        _, _, k0, nprobe, max_probe, mode, exclude_history = key
        k = max(p["k"] for p in payloads)
        # threads=None: the server's own setting (ServeConfig.threads, silverrec tune's table, applied by the
        # batcher) governs; the handler's per-call "auto" would override a tuned table and, with several
        # workers, race on the process-global torch.set_num_threads.
        res = self.handler.recommend([r for p in payloads for r in p["requests"]], k=k, k0=k0, nprobe=nprobe,
                                     max_probe=max_probe, mode=mode, exclude_history=exclude_history, threads=None)
        out, start = [], 0
        for p in payloads:
            n, kk = len(p["requests"]), p["k"]
            part = type(res)(res.item_ids[start:start + n, :kk], res.scores[start:start + n, :kk],
                             res.task_scores[start:start + n, :kk], res.tasks)
            out.append(part.to_json())
            start += n
        return out

    # -------------------------------------------------------------- rank
    def prepare_rank(self, body) -> tuple[tuple, dict]:
        if self.answers != "recommend":
            raise QueryError("only a recommendation model (silverrec publish --config) ranks items for a user")
        from silverrec.serving.recommend import MAX_RANK_ITEMS, RecRequest

        r = RecRequest(**{f: getattr(body, f) for f in USER_FIELDS if getattr(body, f) is not None})
        if not 1 <= len(body.items) <= MAX_RANK_ITEMS:
            raise QueryError(f"rank takes 1 to {MAX_RANK_ITEMS} item ids, got {len(body.items)}")
        self.handler.rows(body.items, "items")
        self.handler.encode([r], exclude_history=False, exclude_limit=max(1, len(r.exclude)))
        return (self, "rank", object()), {"request": r, "items": body.items}  # ranked alone

    def run_rank(self, key: tuple, payloads: list[dict]) -> list[dict]:
        return [self.snap.rank(p["request"], p["items"]).to_json() for p in payloads]

    # -------------------------------------------------------------- dispatch + verification
    def run(self, key: tuple, payloads: list[dict]) -> list[dict]:
        op = key[1]
        if op == "search":
            return self.run_search(key, payloads)
        if op in ("rec", "gen"):
            return self.run_recommend(key, payloads)
        return self.run_rank(key, payloads)

    def smoke(self) -> None:
        """One tiny request through the program: a snapshot that loads but cannot answer is refused."""
        if self.answers == "search":
            res = self.snap.search(torch.full((1, int(self.snap.config["dim"])), 0.1), 1)
            if tuple(res.item_ids.shape) != (1, 1):
                raise SnapshotError(f"search answered shape {tuple(res.item_ids.shape)}, expected (1, 1)")
        elif self.answers == "recommend":
            first = int(self.handler.row_to_item[0])
            res = self.handler.recommend([{"history": [first]}], k=1)
            if tuple(res.item_ids.shape) != (1, 1):
                raise SnapshotError(f"recommend answered shape {tuple(res.item_ids.shape)}, expected (1, 1)")
        elif self.answers == "generative":
            self.snap.recommend([[int(self.snap.generative_item_ids()[0])]])
        else:
            raise SnapshotError(f"snapshot kind {self.kind!r} cannot be served")


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) <= hi:
        raise QueryError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return int(value)


def _clean(rows: list[list[float]]) -> list[list[Optional[float]]]:
    return [[s if math.isfinite(s) else None for s in row] for row in rows]


def load_served(path: str | os.PathLike, device: str = "cpu") -> Served:
    """Load (onto `device`), verify (checksums) and smoke-test a snapshot for serving."""
    import silverrec

    served = Served(silverrec.load(path, device=device))
    served.smoke()
    return served


# ----------------------------------------------------------------------------------- metrics

class Metrics:
    """Prometheus metrics of one app (own registry, so several apps can live in one process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("silverrec_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram("silverrec_request_latency_seconds", "request latency by route", ["route"],
                                 buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5),
                                 registry=self.registry)
        self.batch = Histogram("silverrec_batch_requests", "requests per batch",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.queue = Gauge("silverrec_queue_depth", "requests waiting for a batch", registry=self.registry)
        self.in_flight = Gauge("silverrec_in_flight", "requests admitted and not yet answered", registry=self.registry)
        self.rejections = Counter("silverrec_rejections", "requests refused or dropped", ["reason"],
                                  registry=self.registry)
        self.reloads = Counter("silverrec_reloads", "reload attempts by result", ["result"], registry=self.registry)
        self.info = Gauge("silverrec_snapshot_info", "the served snapshot (value 1)", ["version", "kind"],
                          registry=self.registry)


# ----------------------------------------------------------------------------------- ASGI gate

class BodyTooLarge(Exception):
    pass


class Gate:
    """Pure ASGI middleware: body-size limit (413) and per-route request count / latency metrics."""

    def __init__(self, app, server: "Server"):
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server, start = self.server, time.perf_counter()
        route = scope["path"] if scope["path"] in server.routes else "other"
        status = [500]
        limit = server.config.max_body_bytes

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        try:
            if length is not None and int(length) > limit:
                raise BodyTooLarge()
            seen = [0]

            async def receive_wrapper():
                message = await receive()
                if message["type"] == "http.request":
                    seen[0] += len(message.get("body", b""))
                    if seen[0] > limit:
                        raise BodyTooLarge()
                return message

            await self.app(scope, receive_wrapper, send_wrapper)
        except BodyTooLarge:
            body = json.dumps({"detail": f"request body exceeds {limit} bytes", "version": server.version}).encode()
            status[0] = 413
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
        finally:
            server.metrics.requests.labels(route, str(status[0])).inc()
            server.metrics.latency.labels(route).observe(time.perf_counter() - start)


# ----------------------------------------------------------------------------------- the app

class Server:
    """State of one serving app: the served version, the batcher, metrics, reloads."""

    def __init__(self, path: str | os.PathLike, config: ServeConfig, served: Optional[Served] = None,
                 loader: Optional[Callable[[Path], Served]] = None):
        self.path = Path(path)
        self.config = config
        # path -> a verified, smoke-tested Served (reloads)
        self.loader = loader or functools.partial(load_served, device=config.device)
        self.current = served if served is not None else self.loader(self.path)
        self.metrics = Metrics()
        self.metrics.info.labels(self.current.version, self.current.kind).set(1)
        self.policy = TunePolicy.from_file(config.tune_file) if config.tune_file else None
        self.batcher = Batcher(self._run_group, max_batch=config.max_batch, max_wait_ms=config.max_wait_ms,
                               max_queue=config.max_queue, workers=config.workers, threads=config.threads,
                               policy=self.policy, on_batch=self.metrics.batch.observe)
        self.ready = False
        self._reload_lock = asyncio.Lock()
        self._reload_pool = None
        self.routes = {"/v1/search", "/v1/recommend", "/v1/rank", "/healthz", "/readyz", "/v1/model", "/metrics",
                       "/v1/admin/reload"}

    @property
    def version(self) -> str:
        return self.current.version

    def _run_group(self, key, payloads):
        return key[0].run(key, payloads)  # key[0]: the Served version the requests were validated on

    async def start(self) -> None:
        import concurrent.futures

        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        await self.batcher.start(max_workers=self.policy.max_workers if self.policy else None)
        self._reload_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="silverrec-reload")
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        await self.batcher.stop()
        if self._reload_pool is not None:
            self._reload_pool.shutdown(wait=True)

    async def reload(self, path: Optional[str]) -> dict:
        """Load and verify the new snapshot off the event loop, then switch; the old one keeps
        serving if anything fails. In-flight requests finish on the version they were validated on."""
        target = Path(path) if path else self.path
        async with self._reload_lock:
            old = self.current
            loop = asyncio.get_running_loop()
            try:
                new = await loop.run_in_executor(self._reload_pool, self.loader, target)
            except Exception as e:  # noqa: BLE001  (any failure refuses the snapshot)
                self.metrics.reloads.labels("refused").inc()
                raise SnapshotError(f"snapshot {target} refused, still serving {old.version}: "
                                    f"{type(e).__name__}: {e}") from None
            self.current, self.path = new, target
            self.metrics.info.clear()
            self.metrics.info.labels(new.version, new.kind).set(1)
            self.metrics.reloads.labels("ok").inc()
            return {"version": new.version, "previous": old.version, "kind": new.kind, "path": str(target)}

    async def submit(self, request, body, prepare: str):
        """Validate on the current version, queue, await; -> JSONResponse."""
        served = self.current
        arrived = time.monotonic()
        deadline_ms = _deadline_ms(request, getattr(body, "deadline_ms", None), self.config.deadline_ms)
        try:
            key, payload = getattr(served, prepare)(body)
        except QueryError as e:
            return _error(400, str(e), served.version)
        deadline = arrived + deadline_ms / 1000.0 if deadline_ms is not None else None
        self.metrics.in_flight.inc()
        try:
            result = await self.batcher.submit(key, payload, deadline)
        except QueueFull as e:
            self.metrics.rejections.labels("queue_full").inc()
            return _error(503, f"overloaded: {e}; retry later", served.version, {"Retry-After": "1"})
        except ShuttingDown as e:
            self.metrics.rejections.labels("shutting_down").inc()
            return _error(503, str(e), served.version, {"Retry-After": "1"})
        except DeadlineExceeded as e:
            self.metrics.rejections.labels("deadline").inc()
            return _error(504, f"deadline of {deadline_ms:g} ms exceeded: {e}", served.version)
        except QueryError as e:
            return _error(400, str(e), served.version)
        except Exception as e:  # noqa: BLE001  (errors that name their status: a sharded rank gone -> 503)
            status = getattr(e, "http_status", None)
            if status is None:
                raise
            self.metrics.rejections.labels("unavailable").inc()
            return _error(int(status), str(e), served.version, {"Retry-After": "1"})
        finally:
            self.metrics.in_flight.dec()
            self.metrics.queue.set(self.batcher.queue_depth)
        result["version"] = served.version
        return _json(result, served.version)


def _deadline_ms(request, body_value: Optional[float], default: Optional[float]) -> Optional[float]:
    header = request.headers.get("x-deadline-ms")
    if header is not None:
        try:
            value = float(header)
        except ValueError:
            raise QueryError(f"X-Deadline-Ms must be a number of milliseconds, got {header!r}") from None
        if not value > 0 or not math.isfinite(value):
            raise QueryError(f"X-Deadline-Ms must be a positive number of milliseconds, got {header!r}")
        return value
    return body_value if body_value is not None else default


def _json(content: dict, version: str, status: int = 200, headers: Optional[dict] = None):
    from starlette.responses import Response

    h = {"x-silverrec-version": version}
    if headers:
        h.update(headers)
    return Response(json.dumps(content, allow_nan=False), status_code=status, media_type="application/json",
                    headers=h)


def _error(status: int, message: str, version: str, headers: Optional[dict] = None):
    return _json({"detail": message, "version": version}, version, status, headers)


def create_app(path: str | os.PathLike, config: Optional[ServeConfig] = None, served: Optional[Served] = None,
               loader: Optional[Callable[[Path], Served]] = None):
    """The FastAPI app serving the snapshot at `path` (loaded and smoke-tested now, unless `served`
    is given). `loader(path) -> Served` loads for reloads (default `load_served`)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError

    config = config or ServeConfig()
    server = Server(path, config, served, loader)
    SearchBody, UserBody, RecommendBody, RankBody, ReloadBody = _models()

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
            return _error(400, f"malformed JSON at position {pos}: {ctx.get('error', e.get('msg'))}", server.version)
        parts = []
        for e in errors[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ())[1:]) or "body"
            parts.append(f"{loc}: {e.get('msg')}")
        more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
        return _error(422, "invalid request: " + "; ".join(parts) + more, server.version)

    @app.exception_handler(QueryError)
    async def _query_error(request: Request, exc: QueryError):
        return _error(400, str(exc), server.version)

    @app.post("/v1/search", summary="top-k items for each query row (pure-ANN snapshots, published from a pool)")
    async def search(body: SearchBody, request: Request):
        return await server.submit(request, body, "prepare_search")

    @app.post("/v1/recommend", summary="top-k items for users (rec / generative snapshots)")
    async def recommend(body: RecommendBody, request: Request):
        return await server.submit(request, body, "prepare_recommend")

    @app.post("/v1/rank", summary="scores of given items for one user (rec snapshots)")
    async def rank(body: RankBody, request: Request):
        return await server.submit(request, body, "prepare_rank")

    @app.get("/healthz")
    async def healthz():
        return _json({"status": "ok", "version": server.version}, server.version)

    @app.get("/readyz")
    async def readyz():
        if not server.ready:
            return _error(503, "not ready (starting or shutting down)", server.version)
        gone = getattr(server.current.snap, "unavailable", None)  # a sharded runtime whose rank is gone
        if gone:
            return _error(503, f"not ready: {gone}", server.version)
        return _json({"status": "ready", "version": server.version}, server.version)

    @app.get("/v1/model")
    async def model():
        cur = server.current
        return _json({"version": cur.version, "kind": cur.kind, "path": str(cur.snap.path),
                      "backend": cur.snap.backend, "manifest": cur.snap.manifest,
                      "serving": {k: v for k, v in asdict(config).items() if k != "admin_token"}}, cur.version)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import Response

        server.metrics.queue.set(server.batcher.queue_depth)
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/admin/reload", summary="load, verify and switch to a snapshot (token required)")
    async def reload(request: Request, body: Optional[ReloadBody] = None):
        if not config.admin_token:
            return _error(403, f"reload is disabled: start the server with ${TOKEN_ENV} or --admin-token-file",
                          server.version)
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-admin-token", "")
        if not hmac.compare_digest(given.encode(), config.admin_token.encode()):
            return _error(401, "reload needs the admin token (Authorization: Bearer TOKEN)", server.version)
        try:
            out = await server.reload(body.path if body is not None else None)
        except SnapshotError as e:
            return _error(409, str(e), server.version)
        return _json(out, out["version"])

    return Gate(app, server)


def _package_version() -> str:
    from silverrec import __version__

    return __version__


# ----------------------------------------------------------------------------------- running

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


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only then (without it,
    # Nagle + delayed ACK add ~40 ms to every response that is written in two parts)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SilverrecError(f"cannot bind {host}:{port}: {e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def check_bind(config: ServeConfig) -> None:
    if not is_loopback(config.host) and not config.admin_token:
        raise SilverrecError(f"refusing to bind non-loopback address {config.host} without an admin token: "
                             f"set ${TOKEN_ENV} or pass --admin-token-file")


def _uvicorn_server(app, log_level: str = "warning"):
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # graceful shutdown, then exit 0 (uvicorn would re-raise the signal after draining)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    cfg = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=30,
                         backlog=2048)
    return _Server(cfg)


def start_in_thread(path: str | os.PathLike, config: Optional[ServeConfig] = None, served: Optional[Served] = None,
                    timeout: float = 60.0, loader: Optional[Callable[[Path], Served]] = None) -> Running:
    """Start a server on (config.host, config.port; 0 = ephemeral) in a daemon thread; wait until ready."""
    config = config or ServeConfig(port=0)
    check_bind(config)
    app = create_app(path, config, served, loader)
    sock = bind(config.host, config.port)
    server = _uvicorn_server(app)
    run = Running(app, sock, server)
    server.install_signal_handlers = lambda: None  # noqa: E731  (not the main thread)
    run.thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True,
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
    `served` / `loader`: as create_app (the sharded launcher passes the distributed runtime's)."""
    check_bind(config)
    app = create_app(path, config, served, loader)
    sock = bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    srv = app.server.current
    print(f"silverrec: serving {srv.kind} snapshot {srv.version} ({srv.snap.backend}, {config.device}) on http://{host}:{port} "
          f"(max batch {config.max_batch}, max wait {config.max_wait_ms:g} ms, workers {config.workers}, "
          f"threads {config.threads or torch.get_num_threads()}{', tune ' + config.tune_file if config.tune_file else ''})",
          file=sys.stderr, flush=True)
    server = _uvicorn_server(app, log_level=os.environ.get("SILVERREC_LOG_LEVEL", "warning"))
    asyncio.run(server.serve(sockets=[sock]))
    print("silverrec: stopped (in-flight requests answered)", file=sys.stderr, flush=True)
    return 0
