"""One loaded snapshot version as the server sees it: requests validated into (GroupKey, payload),
groups of them run in one forward call, each answer encoded as JSON bytes in the batch.

Every request is validated on its own, on the version current when it arrives, before it joins a
batch (so in-flight requests finish on the version they were validated on after a reload). The
batcher (serving/batcher.py) groups jobs by `GroupKey`: the version and every option that must be
equal for requests to share one forward call. A recommendation request is checked for its options
on arrival; its users (ids, histories, features, filter) are checked by the batch's one request
encoding, and when that refuses the batch, each request is encoded alone to find the ones at
fault: they get their own error, the others their answers, so a bad request never disturbs its
batch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from silverrec.errors import QueryError, SnapshotError, check_k, check_queries
from silverrec.filtering.filter_program import compile_request, normalize_filters
from silverrec.retrieval.filtered_ivf import MODES
from silverrec.retrieval.filtered_search import _modes, filter_plan, probe_depth
from silverrec.serving.loader import load
from silverrec.serving.recommend import DEFAULT_EXCLUDE_LIMIT, MAX_RANK_ITEMS, RecRequest

MAX_QUERY_ROWS = 1024  # rows per search request, users per recommend request
USER_FIELDS = ("user_id", "history", "features", "numeric", "filter", "exclude")


class GroupKey(NamedTuple):
    """What requests must share to run in one forward call; unused options stay None."""

    served: "Served"  # the version the requests were validated on
    op: str  # "search", "rec" (every snapshot but a pure-ANN index) or "rank"
    nprobe: Optional[int] = None  # search: None = the snapshot's calibrated depth (probe_depth)
    max_probe: Optional[int] = None  # search: the request's, for a filtered request
    k: Optional[int] = None  # filtered search: the widening step reads k (match_factor * k)
    k0: Optional[int] = None
    mode: Optional[str] = None
    exclude_history: Optional[bool] = None
    alone: Optional[object] = None  # a fresh object(): the request runs in a group of its own
    target_recall: Optional[float] = None  # search: instead of nprobe
    filtered: bool = False  # search: the requests carry filters


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



def answers(kind: str, config: dict[str, Any]) -> str:
    """What a snapshot answers: "search" (a pure-ANN index: the root module with a query tower) or
    "recommend" (every other configuration); "" = nothing servable."""
    if kind == "rec":
        return "search" if config.get("spec", {}).get("tower") == "query" else "recommend"
    return ""


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
    def prepare_search(self, body) -> tuple[GroupKey, dict]:
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
        nprobe, target = body.nprobe, body.target_recall
        if nprobe is not None:
            if target is not None:
                raise QueryError("give nprobe or target_recall, not both")
            nprobe = _check_int("nprobe", nprobe, 1, nlist)
        else:  # the calibrated depth, computed per batch by snap.search; a bad target is refused here
            probe_depth(cfg, k, 1.0, target)
        filters = normalize_filters(body.filter, B)
        if filters is None:  # unfiltered: max_probe and mode unused, as in snap.search
            return GroupKey(self, "search", nprobe, target_recall=target), {"queries": queries, "k": k}
        _modes("auto" if body.mode is None else body.mode, B)  # validates names and count
        max_probe = body.max_probe
        if max_probe is not None:
            max_probe = _check_int("max_probe", max_probe, nprobe or 1, nlist)
        plan = filter_plan(self.template)
        for b, f in enumerate(filters):  # syntax errors (with position) and unknown features, per row
            if f is not None:
                compile_request([f], plan)
        # the widening step reads k (match_factor * k), so only equal k share a forward
        mode_names = [body.mode] * B if isinstance(body.mode, str) or body.mode is None else list(body.mode)
        mode_names = ["auto" if m is None else m for m in mode_names]
        return GroupKey(self, "search", nprobe, max_probe, k, target_recall=target, filtered=True), {
            "queries": queries, "k": k, "filters": filters, "modes": mode_names}

    def run_search(self, key: GroupKey, payloads: list[dict]) -> list[dict]:
        queries = torch.cat([p["queries"] for p in payloads]) if len(payloads) > 1 else payloads[0]["queries"]
        k = max(p["k"] for p in payloads)  # the largest request's k; the others take their prefix
        options: dict[str, Any] = {"nprobe": key.nprobe, "target_recall": key.target_recall}
        if key.filtered:
            options["max_probe"] = key.max_probe
            options["filter"] = [f for p in payloads for f in p["filters"]]
            options["mode"] = [m for p in payloads for m in p["modes"]]
        res = self.snap.search(queries, k, **options)
        return self._answers(res, [(p["queries"].shape[0], p["k"]) for p in payloads])

    def _answer(self, result) -> bytes:
        """One request's answer: its result's fields and the version, as JSON bytes."""
        return encode_json({**result.to_json(arrays=True), "version": self.version})

    def _answers(self, result, parts: list[tuple[int, int]]) -> list[bytes]:
        """The answers of a batch's requests, each (rows, k) of `parts` in turn: the batch's result
        turned to numpy arrays once, each request's rows and first k columns cut from them."""
        whole, out, start = result.to_json(arrays=True), [], 0
        for n, k in parts:
            out.append(encode_json({**_cut(whole, start, start + n, k), "version": self.version}))
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

    def prepare_recommend(self, body) -> tuple[GroupKey, dict]:
        users = self._user_requests(body)
        if self.answers != "recommend":
            raise QueryError("this snapshot is a pure-ANN index: it answers /v1/search, not /v1/recommend")
        h, cfg = self.handler, self.handler.config
        n = len(h.row_to_item)
        k = _check_int("k", body.k, 1, n)
        k0 = max(k, int(cfg["default_k0"]) if body.k0 is None else _check_int("k0", body.k0, 1, n))
        nprobe, max_probe = h.probes(body.nprobe, body.max_probe, body.target_recall, k0)
        if body.mode not in MODES:
            raise QueryError(f"unknown search mode {body.mode!r}: use one of {sorted(MODES)}")
        exclude_history = True if body.exclude_history is None else body.exclude_history
        requests = [RecRequest(**{f: v for f, v in u.items() if v is not None}) for u in users]
        key = GroupKey(self, "rec", nprobe, max_probe, k0=k0, mode=body.mode, exclude_history=exclude_history)
        return key, {"requests": requests, "k": k}

    def request_error(self, key: GroupKey, payload: dict) -> Optional[QueryError]:
        """The error that refuses a recommendation payload's users when encoded alone (ids, histories,
        features, filter; named "request" or "request b" as its body holds one or several), or None."""
        h = self.handler
        requests, limit = payload["requests"], int(h.config.get("exclude_limit", DEFAULT_EXCLUDE_LIMIT))
        for b, r in enumerate(requests):
            try:
                h.encode([r], key.exclude_history, limit)
                if r.filter is not None:
                    compile_request([r.filter], h.plan)
            except QueryError as e:
                where = f"request {b}" if len(requests) > 1 else "request"
                return QueryError(str(e).replace("request 0", where, 1))
        return None

    def run_recommend(self, key: GroupKey, payloads: list[dict]) -> list:
        k = max(p["k"] for p in payloads)
        # threads=None: the server's own setting (ServeConfig.threads, silverrec tune's table, applied by the
        # batcher) governs; the handler's per-call "auto" would override a tuned table and, with several
        # workers, race on the process-global torch.set_num_threads.
        try:
            res = self.handler.recommend([r for p in payloads for r in p["requests"]], k=k, k0=key.k0,
                                         nprobe=key.nprobe, max_probe=key.max_probe, mode=key.mode,
                                         exclude_history=key.exclude_history, threads=None)
        except QueryError:
            # the batch's encoding refused a request: each alone names the ones at fault; the rest run
            errors = [self.request_error(key, p) for p in payloads]
            if not any(errors):
                raise  # none refused alone: the batcher re-runs each payload by itself
            good = [p for p, e in zip(payloads, errors) if e is None]
            answers = iter(self.run_recommend(key, good) if good else [])
            return [e if e is not None else next(answers) for e in errors]
        return self._answers(res, [(len(p["requests"]), p["k"]) for p in payloads])

    # -------------------------------------------------------------- rank
    def prepare_rank(self, body) -> tuple[GroupKey, dict]:
        if self.answers != "recommend" or not self.handler.model_spec.ranks:
            raise QueryError("only a recommendation model with a user tower (silverrec publish --config) ranks "
                             "items for a user")
        r = RecRequest(**{f: getattr(body, f) for f in USER_FIELDS if getattr(body, f) is not None})
        if not 1 <= len(body.items) <= MAX_RANK_ITEMS:
            raise QueryError(f"rank takes 1 to {MAX_RANK_ITEMS} item ids, got {len(body.items)}")
        self.handler.rows(body.items, "items")
        self.handler.encode([r], exclude_history=False, exclude_limit=max(1, len(r.exclude)))
        return GroupKey(self, "rank", alone=object()), {"request": r, "items": body.items}

    def run_rank(self, key: GroupKey, payloads: list[dict]) -> list[bytes]:
        return [self._answer(self.snap.rank(p["request"], p["items"])) for p in payloads]

    # -------------------------------------------------------------- dispatch + verification
    def run(self, key: GroupKey, payloads: list[dict]) -> list:
        """One group's forward call -> one answer per payload, in order: its JSON bytes, or the
        QueryError that refuses it alone (the batcher's run_group)."""
        if key.op == "search":
            return self.run_search(key, payloads)
        if key.op == "rec":
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
        else:
            raise SnapshotError(f"snapshot kind {self.kind!r} cannot be served")


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) <= hi:
        raise QueryError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return int(value)


def _cut(value, start: int, stop: int, k: int):
    """Rows start..stop-1 and their first k columns of an answer's field: a numpy array [B, K] (as a
    C-contiguous copy where the cut is not one), a dict of such fields, or a list of rows of lists."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value[start:stop, :k])
    if isinstance(value, dict):
        return {name: _cut(v, start, stop, k) for name, v in value.items()}
    return [row[:k] for row in value[start:stop]]


def encode_json(content: dict) -> bytes:
    """An answer's JSON bytes (orjson: numpy arrays as nested lists, NaN and +-Inf as null)."""
    import orjson

    return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def run_group(key: GroupKey, payloads: list[dict]) -> list:
    """The batcher's run_group: the group's forward call on the version its requests were validated on."""
    return key.served.run(key, payloads)


def load_served(path: str | os.PathLike, device: str = "cpu", streams: int = 1) -> Served:
    """Load (onto `device`, its calls on `streams` CUDA streams), verify (checksums) and smoke-test a snapshot
    for serving."""
    served = Served(load(path, device=device, streams=streams))
    served.smoke()
    return served

