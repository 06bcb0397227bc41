"""Predictor side of filtered search: validate options, compile filters (the "plan"), one forward call.

    >>> snap = silverrec.load("snapshots/v1")                    # a pure-ANN snapshot
    >>> snap.search(queries, k=100, filter="genre = Drama AND NOT decade = 1990s")
    >>> snap.search(queries, k=100, filter=["genre = Drama", None], nprobe=16, mode="probed")

Options: `filter` (one string for every query row, or one string / None per row), `nprobe`
(default the manifest's), `max_probe` (candidate clusters the search may widen to; default the
manifest's, at least nprobe), `mode` ("auto" | "probed" | "unprobed", or one per row).
An "auto" query whose filter is estimated (from the manifest's value counts) to pass few enough
items goes unprobed here (`whole_pool_by_estimate`): its filter runs over the whole pool, on the
values' bit planes, and the passing rows are scanned exactly, with no centroid scored.
Only the manifest is read to compile filters (`FilterPlan`), never the model's tensors.
"""

from __future__ import annotations

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


def whole_pool_by_estimate(estimates, k: int, nprobe: int, num_items: int, nlist: int, match_factor: int,
                           exact_cost_ratio: float):
    """bool per query: the estimated matches m (`compile_estimates`, from the manifest's counts) are
    few enough that filtering the whole pool and scanning its m passing rows costs no more than the
    probed search, which scans at least nprobe clusters and as many as it takes to collect
    target = k x match_factor / sqrt(m / N) matches: about max(nprobe x N / nlist, target x N / m)
    rows. Whole pool iff m x exact_cost_ratio <= that. The same switch filter_plan applies with the
    candidates' counts (silverrec/retrieval/filtered_ivf.py, steps 4-5), decided here before any
    centroid is scored or cluster filtered."""
    m = np.maximum(np.asarray(estimates, dtype=np.float64), 1e-9)
    target = k * match_factor / np.sqrt(m / num_items)
    probed_rows = np.maximum(float(nprobe * max(1, num_items // nlist)), target * num_items / m)
    return m * exact_cost_ratio <= probed_rows


def search_index(
    snap,
    queries: torch.Tensor,
    k: int,
    nprobe: Optional[int] = None,
    filter: Union[str, Sequence[Optional[str]], None] = None,  # noqa: A002  (the request field's name)
    max_probe: Optional[int] = None,
    mode: Union[str, Sequence[str]] = "auto",
    **options: Any,
):
    """A pure-ANN snapshot's search (the root module with a query tower): (scores float32 [B, k],
    item_ids int64 [B, k])."""
    if options:
        raise QueryError(f"unknown search options {sorted(options)}: search takes filter, nprobe, max_probe, mode")
    cfg = snap.config
    nlist = int(cfg["nlist"])
    batch = queries.shape[0]
    nprobe = _check_int("nprobe", int(cfg["default_nprobe"]) if nprobe is None else nprobe, 1, nlist)
    filters = normalize_filters(filter, batch)
    plan = filter_plan(snap)
    # the [B] route decisions of a repeated request (same filter strings, mode, k, nprobe,
    # max_probe) come from the plan's batch LRU: ~40 us of Python and numpy per call otherwise
    key = None
    if filters is None or all(f is None or isinstance(f, str) for f in filters):
        key = ("modes", None if filters is None else tuple(filters), mode if isinstance(mode, str) else tuple(mode),
               batch, k, nprobe, max_probe)
        hit = plan.cached_batch(key)
        if hit is not None:
            filters, modes, max_probe = hit
            return _forward(snap, queries, filters, plan, modes, k, nprobe, max_probe)
    if filters is None:  # unfiltered request: plain IVF semantics, exactly nprobe clusters
        filters, modes, max_probe = [None] * batch, np.full(batch, MODE_PROBED, dtype=np.int64), nprobe
    else:  # (numpy, not torch, for these [B] decisions: each torch op here cost a few us per call)
        modes = _modes(mode, batch)
        if max_probe is None:
            max_probe = max(nprobe, min(nlist, int(cfg["search"]["default_max_probe"])))
        max_probe = _check_int("max_probe", max_probe, nprobe, nlist)
        if plan.num_items and (modes == MODE_AUTO).any():  # selective filters: whole pool, no probing
            whole = whole_pool_by_estimate(compile_estimates(filters, plan), k, nprobe, plan.num_items, nlist,
                                           int(cfg["search"]["match_factor"]), float(cfg["search"]["exact_cost_ratio"]))
            modes = np.where((modes == MODE_AUTO) & whole, MODE_UNPROBED, modes)
    modes = torch.from_numpy(modes)
    scores_ids = _forward(snap, queries, filters, plan, modes, k, nprobe, max_probe)
    if key is not None:  # after the forward: a request that failed to compile is not cached
        plan.cache_batch(key, (filters, modes, max_probe))
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
