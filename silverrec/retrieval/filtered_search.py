"""Predictor side of filtered search: validate options, compile filters (the "plan"), one forward call.

    >>> snap = silverrec.load("snapshots/v1")                    # a pure-ANN snapshot
    >>> snap.search(queries, k=100, filter="genre = Drama AND NOT decade = 1990s")
    >>> snap.search(queries, k=100, filter=["genre = Drama", None], nprobe=16, mode="probed")

Options: `filter` (one string for every query row, or one string / None per row), `nprobe`
(clusters to probe), or instead `target_recall` (the recall@k wanted, in (0, 1]: the nprobe the
snapshot's calibration curve maps it to), `max_probe` (candidate clusters the search may widen to;
default `default_max_probe`, at least nprobe), `mode` ("auto" | "probed" | "unprobed", or one per row).

Without `nprobe`, the probe depth is the publisher's (`probe_depth`): the calibrated default (the
smallest nprobe whose recall@100 reached the publish target on the pool, publish/calibrate.py) or the
target recall's nprobe, deepened for a k beyond the calibration's and for a filter passing a share d
of the pool by max(1, k / (100 d)) ** probe_exponent: a filter's k nearest matches are about the
pool's k / d nearest items, which need a deeper probe (exponent calibrated at publish on filters of
the pool's own values). A given `nprobe` is used as it is.
An "auto" query whose filter is estimated (from the manifest's value counts) to pass few enough
items goes unprobed here (`whole_pool_by_estimate`): its filter runs over the whole pool, on the
values' bit planes, and the passing rows are scanned exactly, with no centroid scored.
Only the manifest is read to compile filters (`FilterPlan`), never the model's tensors.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from silverrec.errors import QueryError
from silverrec.filtering.filter_program import FilterPlan, compile_estimates, compile_request, normalize_filters
from silverrec.kernels.constants import MODE_AUTO, MODE_PROBED, MODE_UNPROBED
from silverrec.retrieval.filtered_ivf import MODES


def filter_plan(snap) -> FilterPlan:
    """The snapshot's FilterPlan, built once from its manifest and cached on the snapshot."""
    plan = getattr(snap, "_filter_plan", None)
    if plan is None:
        cfg = snap.config.get("filter")
        if cfg is None:
            raise QueryError(f"snapshot {snap.path} has no filter index (its pool had no categorical features)")
        if "postings" not in cfg:
            raise QueryError(f"snapshot {snap.path} has no posting-list section: re-publish it")
        plan = FilterPlan.from_config(cfg)
        snap._filter_plan = plan
    return plan


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise QueryError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def _modes(mode: Union[str, Sequence[str]], batch: int) -> np.ndarray:
    """The search mode of each query row, int64 [batch] (filtered_ivf.MODES); named errors."""
    if isinstance(mode, str):
        if mode not in MODES:
            raise QueryError(f"unknown search mode {mode!r}: use one of {sorted(MODES)}")
        return np.full(batch, MODES[mode], dtype=np.int64)
    names = list(mode)
    if len(names) != batch:
        raise QueryError(f"got {len(names)} modes for {batch} query rows")
    bad = [m for m in names if m not in MODES]
    if bad:
        raise QueryError(f"unknown search mode {bad[0]!r}: use one of {sorted(MODES)}")
    return np.asarray([MODES[m] for m in names], dtype=np.int64)


def whole_pool_by_estimate(estimates, k: int, nprobe, num_items: int, nlist: int, match_factor: int,
                           exact_cost_ratio: float):
    """bool per query (nprobe: an int, or one per query): the estimated matches m (`compile_estimates`,
    from the manifest's counts) are few enough that filtering the whole pool and scanning its m passing
    rows costs no more than the probed search, which scans at least nprobe clusters and as many as it
    takes to collect target = k x match_factor / sqrt(m / N) matches: about max(nprobe x N / nlist,
    target x N / m) rows. Whole pool iff m x exact_cost_ratio <= that. The same switch filter_plan applies with the
    candidates' counts (silverrec/retrieval/filtered_ivf.py, steps 4-5), decided here before any
    centroid is scored or cluster filtered."""
    m = np.maximum(np.asarray(estimates, dtype=np.float64), 1e-9)
    target = k * match_factor / np.sqrt(m / num_items)
    probed_rows = np.maximum(np.asarray(nprobe, dtype=np.float64) * max(1, num_items // nlist), target * num_items / m)
    return m * exact_cost_ratio <= probed_rows


def nprobe_for_recall(curve: Sequence[dict], target: float, nlist: int) -> int:
    """The nprobe a target recall maps to through a calibration curve (points {"nprobe", "recall"}
    sorted by nprobe, recall non-decreasing up to noise; publish/calibrate.py): the smallest measured
    nprobe reaching it, or between two measured points the nprobe interpolated linearly in
    log(nprobe) (rounded up); past the curve's best recall, the nprobe of that best."""
    pts = sorted(curve, key=lambda c: c["nprobe"])
    prev = None
    for c in pts:
        if c["recall"] >= target:
            if prev is None or prev["recall"] >= c["recall"]:
                return min(nlist, int(c["nprobe"]))
            t = (target - prev["recall"]) / (c["recall"] - prev["recall"])
            p = math.exp(math.log(prev["nprobe"]) + t * (math.log(c["nprobe"]) - math.log(prev["nprobe"])))
            return min(nlist, max(int(prev["nprobe"]) + 1, min(int(c["nprobe"]), math.ceil(p - 1e-9))))
        prev = c
    return min(nlist, int(max(pts, key=lambda c: (c["recall"], -c["nprobe"]))["nprobe"]))


def probe_depth(cfg: dict, k: int, density: Union[float, np.ndarray] = 1.0,
                target_recall: Optional[float] = None) -> np.ndarray:
    """int64 [B] (or [] for a scalar density): the clusters a query row probes when its request names no
    nprobe (module docstring). cfg: the manifest's config; density: the share of the pool each row's
    filter passes (estimated, 1 = no filter); target_recall: map it through cfg["calibration"]["curve"]
    instead of taking cfg["default_nprobe"]. Snapshots published before calibration have exponent 0."""
    nlist = int(cfg["nlist"])
    if target_recall is None:
        base = int(cfg["default_nprobe"])
    else:
        if isinstance(target_recall, bool) or not isinstance(target_recall, (int, float)) \
                or not 0.0 < float(target_recall) <= 1.0:
            raise QueryError(f"target_recall must be a number in (0, 1], got {target_recall!r}")
        curve = (cfg.get("calibration") or {}).get("curve")
        if not curve:
            raise QueryError("this snapshot has no calibration curve to map target_recall through "
                             "(published before calibration): give nprobe, or re-publish it")
        base = nprobe_for_recall(curve, float(target_recall), nlist)
    search = cfg.get("search", {})
    exponent, k_cal = float(search.get("probe_exponent", 0.0)), int(search.get("probe_k", 100))
    d = np.clip(np.asarray(density, dtype=np.float64), 1e-12, 1.0)
    scale = np.maximum(1.0, k / (k_cal * d)) ** exponent
    return np.minimum(nlist, np.ceil(base * scale - 1e-9)).astype(np.int64)


def default_max_probe(cfg: dict, depth: int) -> int:
    """The widest probe a filtered search may widen to when the request names none: max_probe_factor x
    its probe depth (calibrated at publish), or the manifest's default_max_probe in snapshots without
    one; at most nlist."""
    factor = cfg["search"].get("max_probe_factor")
    wide = int(cfg["search"]["default_max_probe"]) if factor is None else math.ceil(float(factor) * depth)
    return min(int(cfg["nlist"]), wide)


def search_index(
    snap,
    queries: torch.Tensor,
    k: int,
    nprobe: Optional[int] = None,
    filter: Union[str, Sequence[Optional[str]], None] = None,  # noqa: A002  (the request field's name)
    max_probe: Optional[int] = None,
    mode: Union[str, Sequence[str]] = "auto",
    target_recall: Optional[float] = None,
    **options: Any,
):
    """A pure-ANN snapshot's search (the root module with a query tower): (scores float32 [B, k],
    item_ids int64 [B, k])."""
    if options:
        raise QueryError(f"unknown search options {sorted(options)}: search takes filter, nprobe, target_recall, "
                         "max_probe, mode")
    cfg = snap.config
    nlist = int(cfg["nlist"])
    batch = queries.shape[0]
    if nprobe is not None:
        if target_recall is not None:
            raise QueryError("give nprobe or target_recall, not both")
        nprobe = _check_int("nprobe", nprobe, 1, nlist)
    filters = normalize_filters(filter, batch)
    plan = filter_plan(snap)
    # the [B] route decisions of a repeated request (same filter strings, mode, k, nprobe or target,
    # max_probe) come from the plan's batch LRU: ~40 us of Python and numpy per call otherwise
    key = None
    if filters is None or all(f is None or isinstance(f, str) for f in filters):
        key = ("modes", None if filters is None else tuple(filters), mode if isinstance(mode, str) else tuple(mode),
               batch, k, nprobe, target_recall, max_probe)
        hit = plan.cached_batch(key)
        if hit is not None:
            filters, modes, depth, max_probe = hit
            return _forward(snap, queries, filters, plan, modes, k, depth, max_probe)
    if filters is None:  # unfiltered request: plain IVF semantics, exactly nprobe clusters
        depth = nprobe if nprobe is not None else int(probe_depth(cfg, k, 1.0, target_recall))
        filters, modes, max_probe = [None] * batch, np.full(batch, MODE_PROBED, dtype=np.int64), depth
    else:  # (numpy, not torch, for these [B] decisions: each torch op here cost a few us per call)
        modes = _modes(mode, batch)
        auto = modes == MODE_AUTO
        estimates = compile_estimates(filters, plan) if plan.num_items and auto.any() else None
        if nprobe is not None:
            depths = np.full(batch, nprobe, dtype=np.int64)
        else:  # each row's calibrated depth for its filter's estimated share of the pool (auto rows)
            share = np.ones(batch) if estimates is None else np.where(auto, estimates / plan.num_items, 1.0)
            depths = probe_depth(cfg, k, share, target_recall)
        if estimates is not None:  # selective filters: whole pool, no probing
            whole = whole_pool_by_estimate(estimates, k, depths, plan.num_items, nlist,
                                           int(cfg["search"]["match_factor"]), float(cfg["search"]["exact_cost_ratio"]))
            modes = np.where(auto & whole, MODE_UNPROBED, modes)
        probing = modes != MODE_UNPROBED  # the batch probes as deep as its deepest probing row
        depth = int(depths[probing].max()) if probing.any() else int(depths.min())
        if nprobe is None and max_probe is not None:  # a given widest probe bounds the calibrated depth
            depth = min(depth, max(1, max_probe))
        if max_probe is None:
            max_probe = max(depth, default_max_probe(cfg, depth))
        max_probe = _check_int("max_probe", max_probe, depth, nlist)
    modes = torch.from_numpy(modes)
    scores_ids = _forward(snap, queries, filters, plan, modes, k, depth, max_probe)
    if key is not None:  # after the forward: a request that failed to compile is not cached
        plan.cache_batch(key, (filters, modes, depth, max_probe))
    return scores_ids


def _forward(snap, queries: torch.Tensor, filters: list, plan, modes: torch.Tensor, k: int, nprobe: int,
             max_probe: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pure-ANN program on one request batch: (scores float32 [B, k], item_ids int64 [B, k]).
    `modes` int64 [B] is only read (a cached request's tensor is reused)."""
    values, lengths, none, ann = _NO_USER_FEATURES
    B = queries.shape[0]
    item_ids, scores = snap.module(values, lengths, queries, none.expand(B, 1), *compile_request(filters, plan), modes,
                                   none.expand(B, 1), ann.expand(B, 2), k, k, nprobe, max_probe)[:2]
    return scores, item_ids


# a query-tower model reads no KJT, excludes nothing and has no history: the same constant inputs
# every call (rows -1: exclusions and history; the ANN source on)
_NO_USER_FEATURES = (torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int32),
                     torch.full((1, 1), -1, dtype=torch.int64), torch.ones(1, 2, dtype=torch.bool))
