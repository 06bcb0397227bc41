"""Predictor side of a recommendation snapshot (kind "rec"): requests in, one forward call, items out.

    >>> snap = silverrec.load("snapshots/rec")
    >>> result = snap.recommend([{"user_id": 414}, {"history": [1, 260, 1196], "filter": "genre = Comedy"}], k=10)
    >>> result.item_ids, result.scores, result.task_scores      # [B, k], [B, k], [B, k, T]
    >>> snap.rank({"history": [1, 260]}, item_ids=[3, 5, 8])   # early-stage ranking of given items

A request (`RecRequest`, or a dict with the same keys) describes one user:
    user_id   a user of the snapshot's training logs (its stored history is used), or
    history   item ids the user interacted with, oldest first (the newest `history_len` feed the tower);
    features  categorical user features {name: value or [values]} (the tower's `user_<name>` keys);
    numeric   numeric user features {name: float};
    filter    a filter string over the item features (the filter language of filter_lang.py);
    exclude   item ids never to return.
With `exclude_history=True` (default) the user's history items are never returned either.
Host work per request: the request encoding (id -> row lookups, stored histories, exclusions, the KJT), one
call of the C++ encoder (kernels/csrc/request.h) that silverrec-predictor runs too; everything else is the forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from silverrec.errors import QueryError
from silverrec.filtering.filter_program import FilterPlan, compile_request
from silverrec.filtering.template import check_request_features
from silverrec.generative.source import request_tensors
from silverrec.spec import ModelSpec
from silverrec.kernels import library
from silverrec.retrieval.filtered_ivf import MODES
from silverrec.retrieval.filtered_search import probe_depth
from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec
from silverrec.serving.device import OnDevice, exported_module, rank_serving
from silverrec.threads import OMP_PASSIVE, num_threads

ITEMS_FILE = "items.npz"
USERS_FILE = "users.npz"
RANK_FILE = "rank.pt2"
MAX_RANK_ITEMS = 1 << 20
MAX_LISTWISE_RANK_ITEMS = 4096  # a list-wise OverArch attends over the whole list: quadratic in its length
DEFAULT_EXCLUDE_LIMIT = 4096  # exclusion slots per request (snapshots record their own)
# threads="auto": a batch of at most this many requests runs its forward on one thread. A forward of
# a small batch is ~300 small ops, and every op that OpenMP splits over 2 threads pays a join, and
# under OMP_WAIT_POLICY=PASSIVE (silverrec's default, silverrec/threads.py) a wake-up of the sleeping
# worker. Measured on the MovieLens snapshot, TorchScript, real users, alternated, quiet 2-core
# machine, 2-thread / 1-thread time at batch 1 / 2 / 4 / 8 / 16 / 32 / 64: PASSIVE 1.80, 1.48, 1.54,
# 1.25, 1.04, 0.88, 0.78; OpenMP's default (spinning workers) 1.01, 0.98, 0.88, 0.83, 0.78, 0.72,
# 0.65 (an earlier run beside another library's OpenMP pool: 1.13 at batch 1).
ONE_THREAD_MAX_BATCH = 16 if OMP_PASSIVE else 1


@dataclass
class RecRequest:
    """One user's request (see the module docstring)."""

    user_id: Optional[int] = None
    history: Optional[Sequence[int]] = None
    features: Mapping[str, Any] = field(default_factory=dict)
    numeric: Mapping[str, float] = field(default_factory=dict)
    filter: Optional[str] = None
    exclude: Sequence[int] = ()
    sources: Optional[Sequence[str]] = None  # of the snapshot's retrieval sources, those to use (default all)

    @classmethod
    def coerce(cls, r: Union["RecRequest", Mapping[str, Any]], where: Union[str, int]) -> "RecRequest":
        """A RecRequest from itself or a dict of its fields; `where`: the request's name in errors
        (an int b: "request b")."""
        if isinstance(r, RecRequest):
            return r
        if not isinstance(r, (dict, Mapping)):
            raise QueryError(f"{_where(where)} must be a RecRequest or a dict, got {type(r).__name__}")
        if not _REQUEST_FIELDS.issuperset(r):
            unknown = sorted(set(r) - _REQUEST_FIELDS)
            raise QueryError(f"{_where(where)}: unknown request field {unknown[0]!r} "
                             f"(fields: {', '.join(cls.__dataclass_fields__)})")
        return cls(**r)


_REQUEST_FIELDS = frozenset(RecRequest.__dataclass_fields__)


def _where(where: Union[str, int]) -> str:
    return f"request {where}" if isinstance(where, int) else where


@dataclass
class Recommendations:
    """item_ids int64 [B, k] (-1 = none), scores float32 [B, k] (the value model's, -inf = none),
    task_scores float32 [B, k, T] (per task, `tasks` names them)."""

    item_ids: torch.Tensor
    scores: torch.Tensor
    task_scores: torch.Tensor
    tasks: list[str]
    # snapshots with a decode (silverrec/generative/source.py): which sources found each item (bits
    # 1 = ann, 2 = generative) int64 [B, k], and their scores float32 [B, k, 2] (-inf = not found by
    # that source); None for a snapshot whose one source is the ANN
    found_by: Optional[torch.Tensor] = None
    source_scores: Optional[torch.Tensor] = None

    def to_json(self, arrays: bool = False) -> dict[str, Any]:
        """{"item_ids", "scores", "task_scores": {task: ...}, "sources" (hybrid)} as lists (non-finite
        scores as None); arrays=True: the numbers as C-contiguous numpy arrays, for an encoder that
        writes them (orjson; it writes non-finite as null)."""
        def clean(x):
            return [clean(v) for v in x] if isinstance(x, list) else (x if np.isfinite(x) else None)

        if arrays:
            def array(x):
                return np.ascontiguousarray(x.numpy())

            out = {"item_ids": array(self.item_ids), "scores": array(self.scores),
                   "task_scores": {t: array(self.task_scores[:, :, i]) for i, t in enumerate(self.tasks)}}
        else:
            out = {"item_ids": self.item_ids.tolist(), "scores": clean(self.scores.tolist()),
                   "task_scores": {t: clean(self.task_scores[:, :, i].tolist()) for i, t in enumerate(self.tasks)}}
        if self.found_by is not None:
            out["sources"] = [[[s for j, s in enumerate(("ann", "generative")) if f >> j & 1] for f in row]
                              for row in self.found_by.tolist()]
        return out

    def rows(self, start: int, stop: int, k: int) -> "Recommendations":
        """Requests start..stop-1, their first k items."""
        cut = (slice(start, stop), slice(0, k))
        return Recommendations(self.item_ids[cut], self.scores[cut], self.task_scores[cut], self.tasks,
                               None if self.found_by is None else self.found_by[cut],
                               None if self.source_scores is None else self.source_scores[cut])


def resolve_nprobe(cfg: dict, nprobe: Optional[int], target_recall: Optional[float], k0: int) -> int:
    """A recommend request's nprobe: its own, or the one its `target_recall` maps to through the
    snapshot's calibration curve (`probe_depth`), or the snapshot's default."""
    if nprobe is not None:
        if target_recall is not None:
            raise QueryError("give nprobe or target_recall, not both")
        return nprobe
    return int(cfg["default_nprobe"]) if target_recall is None else int(probe_depth(cfg, k0, 1.0, target_recall))


class RecHandler:
    """Everything the predictor needs beside the program: the request encoder, the filter plan, the
    rank program. Built once per loaded snapshot from its manifest and side files."""

    def __init__(self, config: Mapping[str, Any], module, row_to_item: np.ndarray,
                 item_csr: Mapping[str, tuple[np.ndarray, np.ndarray]], users: Optional[Mapping[str, np.ndarray]] = None,
                 rank_module=None):
        self.config = config
        self.module = module
        self.model_spec = ModelSpec.from_json(config["spec"])
        self.spec = UserFeatureSpec.from_json(config["user_features"])
        self.tasks = list(self.model_spec.tasks)
        self.row_to_item = np.asarray(row_to_item, dtype=np.int64)
        self.encoder = FeatureEncoder.from_arrays(self.spec, item_csr)  # the trainer's encoding (publish/quality.py)
        self.users = users
        self.native = rec_encoder(self.spec, self.row_to_item, self.encoder.item_csr, users)
        self._probed_modes: dict[int, torch.Tensor] = {}  # batch size -> its all-probed mode tensor
        self.plan = FilterPlan.from_config(config["filter"])
        self.template = config.get("filter_template")  # filled in the model from the user's features
        self._rank_module = rank_module  # a callable, or a function returning one (loaded lazily)

    @classmethod
    def from_snapshot(cls, snap) -> "RecHandler":
        cfg = snap.config
        with np.load(snap.path / ITEMS_FILE, allow_pickle=False) as f:
            row_to_item = f["row_to_item"]
            csr = {name: (f[f"offsets_{i}"], f[f"codes_{i}"]) for i, name in enumerate(cfg["item_feature_order"])}
        users = None
        if (snap.path / USERS_FILE).is_file():
            with np.load(snap.path / USERS_FILE, allow_pickle=False) as f:
                users = {k: f[k] for k in f.files}
        buckets, listwise = getattr(snap, "buckets", None), snap.spec.overarch == "listwise"
        if not snap.spec.ranks:  # no user tower: no ranking entry point (Snapshot.rank refuses)
            rank = None
        elif snap.backend == "torchscript":
            rank = snap.module.rank
            if isinstance(rank, OnDevice):  # the method of the moved module: graphed and padded like rank.pt2
                rank = rank_serving(rank.module, rank.device, buckets, listwise)
        else:
            def rank():
                serde_log = logging.getLogger("torch._export.serde.serialize")
                level = serde_log.level
                serde_log.setLevel(logging.ERROR)
                try:
                    return exported_module(torch.export.load(snap.path / RANK_FILE), snap.device, buckets, listwise)
                finally:
                    serde_log.setLevel(level)
            rank.lazy = True
        return cls(cfg, snap.module, row_to_item, csr, users, rank)

    def rows(self, item_ids: Sequence[int], where: str) -> np.ndarray:
        """Item ids -> canonical rows int64; QueryError naming the first unknown id."""
        ids = _int_list(item_ids, f"{where} must be a list of integer item ids")
        return _query_errors(self.native.rows, ids, where).numpy()

    def encode(self, requests: Sequence[RecRequest], exclude_history: bool, exclude_limit: int):
        """-> (values, lengths, dense, exclude int64 [B, E], -1 = none) (`encode_rows`, without the
        history rows)."""
        return self.encode_rows(requests, exclude_history, exclude_limit)[:4]

    def encode_rows(self, requests: Sequence[RecRequest], exclude_history: bool, exclude_limit: int):
        """-> (values, lengths, dense, exclude int64 [B, E] (-1 = none; in no particular order),
        each request's history as rows int64 in time order), by the C++ encoder (kernels/csrc/request.h:
        the one request encoding, which silverrec-predictor runs too; its errors are QueryErrors).

        A request's exclusions are its `exclude` ids, then its history, newest first, up to
        `exclude_limit` rows in all: with a longer history, its oldest items may be returned. E is
        the batch's largest count (at least 1): the padding never changes an answer (the search
        fetches k0 + the model's constant overfetch rows per task, whatever E is), and the exclusion
        stage's cost grows with E (a fixed E = exclude_limit = 4096 made it 6% of a batch-16 forward).
        """
        values, lengths, dense, exclude, rows, offsets = _query_errors(
            self.native.encode, *_flat_requests(requests), bool(exclude_history), int(exclude_limit))
        rows, off = rows.numpy(), offsets.tolist()
        return values, lengths, dense, exclude, [rows[off[b]:off[b + 1]] for b in range(len(requests))]

    def recommend(self, requests, k: int = 10, k0: Optional[int] = None, nprobe: Optional[int] = None,
                  max_probe: Optional[int] = None, mode: str = "auto", exclude_history: bool = True,
                  exclude_limit: Optional[int] = None, threads: Union[str, int, None] = "auto",
                  target_recall: Optional[float] = None, every_candidate: bool = False) -> Recommendations:
        """Top-k items per request, one forward call (module docstring). `target_recall` (instead of
        nprobe): the recall@k0 of the retrieval wanted, mapped to an nprobe through the curve publish
        measured (`calibration` in the manifest). `exclude_limit` (default:
        the snapshot's) is the number of exclusion slots every request gets (`encode`). `threads`:
        the forward's intra-op threads: "auto" (one thread for at most ONE_THREAD_MAX_BATCH
        requests, else the process's setting), an int, or None (the process's setting); the
        process's setting is restored after the call. `every_candidate` (a snapshot whose one source
        is the ANN): the list before its cut to k, every candidate the forward ranks for the request
        served at k, best first (publish ranks them again under other weights, publish/transitions.py)."""
        if not isinstance(requests, list) and isinstance(requests, (RecRequest, Mapping)):
            requests = [requests]
        requests = [RecRequest.coerce(r, b) for b, r in enumerate(requests)]
        if not requests:
            raise QueryError("recommend needs at least one request")
        cfg, spec = self.config, self.model_spec
        n, T = len(self.row_to_item), len(self.tasks)
        beams = int(cfg["generative"]["beam_width"]) if "generative" in spec.sources else 0
        ranked = (spec.candidates or n) + spec.transitions if "ann" in spec.sources else 0  # the ANN's + successors
        _check_int("k", k, 1, min(n, ranked + beams))  # at most the candidates ranked
        k0 = max(k, int(cfg["default_k0"]) if k0 is None else _check_int("k0", k0, 1, n))
        nprobe, max_probe = self.probes(nprobe, max_probe, target_recall, k0)
        if mode not in MODES:
            raise QueryError(f"unknown search mode {mode!r}: use one of {sorted(MODES)}")
        limit = int(cfg.get("exclude_limit", DEFAULT_EXCLUDE_LIMIT)) if exclude_limit is None else \
            _check_int("exclude_limit", exclude_limit, 1, n)
        if self.template:
            check_request_features(self.template, [dict(r.features) for r in requests])
            exclude_history = exclude_history or self.template["excludes_history"]
        values, lengths, dense, exclude, histories = self.encode_rows(requests, exclude_history, limit)
        filters = [r.filter for r in requests]
        if self.template or any(f is not None for f in filters):
            modes = torch.tensor([MODES["probed"] if f is None and not self.template else MODES[mode] for f in filters],
                                 dtype=torch.int64)
        else:  # nothing filters: every query probes (a constant per batch size; the forward only reads it)
            modes = self._probed_modes.get(len(filters))
            if modes is None:
                modes = torch.full((len(filters),), MODES["probed"], dtype=torch.int64)
                if len(self._probed_modes) < 64:
                    self._probed_modes[len(filters)] = modes
        history, flags = self._sources(requests, histories)
        if every_candidate:
            if spec.sources != ("ann",):
                raise QueryError("every_candidate needs a snapshot whose one source is 'ann'")
            k = min(n, (spec.candidates or T * k0) + spec.transitions)  # the ANN's candidates + the successors
        if threads == "auto":
            threads = 1 if len(requests) <= ONE_THREAD_MAX_BATCH else None
        elif threads is not None:
            threads = _check_int("threads", threads, 1, 1 << 10)
        with torch.inference_mode(), num_threads(threads):
            out = self.module(values, lengths, dense, exclude, *compile_request(filters, self.plan), modes, history,
                              flags, k, k0, nprobe, max_probe)
        tasks = out[2] if out[2].shape[2] == T else out[2][:, :, :T]
        found_by, source_scores = (out[4], out[5]) if out[4].shape[1] else (None, None)  # width 0: one source
        return Recommendations(out[0], out[1], tasks, self.tasks, found_by, source_scores)

    def probes(self, nprobe: Optional[int], max_probe: Optional[int], target_recall: Optional[float] = None,
               k0: int = 1) -> tuple[int, int]:
        """The request's (nprobe, max_probe), checked against the index (1, 1 without one: unread); nprobe
        its own, or its target_recall's for k0 candidates (`resolve_nprobe`), or the snapshot's default."""
        cfg = self.config
        if "ann" not in self.model_spec.sources:
            return 1, 1
        nlist = self.model_spec.nlist
        nprobe = _check_int("nprobe", resolve_nprobe(cfg, nprobe, target_recall, k0), 1, nlist)
        max_probe = _check_int("max_probe", max(nprobe, int(cfg["search"]["default_max_probe"])) if max_probe is None
                               else max_probe, nprobe, nlist)
        return nprobe, max_probe

    def _sources(self, requests: Sequence[RecRequest], histories: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode's inputs: each request's history as rows int64 [B, H] (-1 left padding) and the
        sources it uses bool [B, 2] (QueryError naming a source the snapshot lacks). A snapshot whose
        one source is the ANN reads neither (constants), unless it has next-item transitions: then
        history is each request's newest row, int64 [B, 1] (-1 = no history)."""
        available = self.model_spec.sources
        if "generative" in available:
            return request_tensors(histories, [r.sources for r in requests], available,
                                   self.config["generative"].get("max_items"))
        if any(r.sources is not None and list(r.sources) != ["ann"] for r in requests):
            raise QueryError("this snapshot has one retrieval source, 'ann' (publish with sources = ['ann', 'generative'])")
        B = len(requests)
        if self.model_spec.transitions:  # the next-item transitions read the newest history row
            last = torch.tensor([int(h[-1]) if len(h) else -1 for h in histories], dtype=torch.int64)
            return last[:, None], _ANN_ONLY.expand(B, 2)
        return _NO_HISTORY.expand(B, 1), _ANN_ONLY.expand(B, 2)

    def rank(self, request, item_ids: Sequence[int]) -> Recommendations:
        """Early-stage ranking: score `item_ids` (1 .. 2^20 of them) for one user; returned in the
        given order (scores [1, C], task scores [1, C, T])."""
        r = RecRequest.coerce(request, "request")
        rows = self.rows(item_ids, "items")
        kind = self.model_spec.overarch
        limit = MAX_LISTWISE_RANK_ITEMS if kind == "listwise" else MAX_RANK_ITEMS
        if not 1 <= rows.size <= limit:
            raise QueryError(f"rank takes 1 to {limit} item ids with this snapshot's OverArch ({kind}), got {rows.size}")
        values, lengths, dense, _ = self.encode([r], exclude_history=False, exclude_limit=max(1, len(r.exclude)))
        with torch.inference_mode():
            value, tasks = self.rank_module()(values, lengths, dense, torch.from_numpy(rows)[None])
        ids = torch.from_numpy(self.row_to_item[rows].astype(np.int64))[None]
        return Recommendations(ids, value, tasks, self.tasks)

    def rank_module(self):
        if getattr(self._rank_module, "lazy", False):
            self._rank_module = self._rank_module()
        return self._rank_module


# the decode's inputs of a snapshot without one: no history, the ANN on (expanded to the batch)
_NO_HISTORY = torch.full((1, 1), -1, dtype=torch.int64)
_ANN_ONLY = torch.ones(1, 2, dtype=torch.bool)


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) <= hi:
        raise QueryError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return int(value)


def rec_encoder(spec: UserFeatureSpec, row_to_item: np.ndarray, item_csr: Mapping[str, tuple[np.ndarray, np.ndarray]],
                users: Optional[Mapping[str, np.ndarray]]):
    """The C++ request encoder of a recommendation snapshot (torch.classes.silverrec_host.RecEncoder,
    kernels/csrc/request.h) from its tables: ids, the tower's item-feature CSRs, the stored users, the
    user vocabularies and numeric statistics."""
    library.load()

    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))

    csr = [item_csr[f] for f in spec.item_vocabs]
    none = torch.zeros(0, dtype=torch.int64)
    names = list(spec.user_vocabs)
    return torch.classes.silverrec_host.RecEncoder(
        t(row_to_item), [t(o) for o, _ in csr], [t(c) for _, c in csr], users is not None,
        *((t(users["user_ids"]), t(users["offsets"]), t(users["item_ids"])) if users is not None else (none, none, none)),
        names, [str(v) for g in names for v in spec.user_vocabs[g]], [len(spec.user_vocabs[g]) for g in names],
        list(spec.user_numeric), [float(m) for m, _ in spec.user_numeric.values()],
        [float(s) for _, s in spec.user_numeric.values()], int(spec.history_len), int(spec.recent_len))


def _query_errors(fn, *args):
    """fn(*args) with the C++ encoder's ValueError (a bad request) raised as QueryError, its message kept."""
    try:
        return fn(*args)
    except ValueError as e:
        raise QueryError(str(e)) from None


def _int_list(ids, message: str) -> list[int]:
    """A list of ints (numpy arrays and ints allowed) or QueryError(message)."""
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise QueryError(message)
        return ids.reshape(-1).tolist()
    if isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__iter__"):
        raise QueryError(message)
    out = list(ids)
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in out):
        raise QueryError(message)
    return [int(i) for i in out]


def _flat_requests(requests: Sequence[RecRequest]) -> tuple:
    """Requests -> the C++ encoder's flattened arguments (RecEncoder::encode_flat): user ids, which of
    user_id (1) / history (2) each gives, the ids (history then exclude per request) and their counts,
    the categorical features (keys per request, values per key, the values as text) and the numeric ones."""
    user_ids, given, ids, sizes = [], [], [], []
    keys, key_counts, values, value_counts, num_keys, num_values, num_counts = [], [], [], [], [], [], []
    for b, r in enumerate(requests):
        if r.user_id is not None and (isinstance(r.user_id, bool) or not isinstance(r.user_id, (int, np.integer))):
            raise QueryError(f"request {b}: user_id must be an int, got {r.user_id!r}")
        user_ids.append(0 if r.user_id is None else int(r.user_id))
        given.append((r.user_id is not None) | (r.history is not None) << 1)
        hist = [] if r.history is None else _int_list(r.history, f"request {b} history must be a list of integer item ids")
        excl = _int_list(r.exclude, f"request {b} exclude must be a list of integer item ids")
        ids += hist
        ids += excl
        sizes += [len(hist), len(excl)]
        feats = dict(r.features)
        key_counts.append(len(feats))
        for g, raw in feats.items():
            vals = [raw] if isinstance(raw, (str, int, np.integer)) else list(raw)
            keys.append(str(g))
            value_counts.append(len(vals))
            values += [str(v) for v in vals]
        nums = dict(r.numeric)
        num_counts.append(len(nums))
        for g, x in nums.items():
            num_keys.append(str(g))
            num_values.append(float(x))
    return (user_ids, given, ids, sizes, keys, key_counts, values, value_counts, num_keys, num_values, num_counts)
