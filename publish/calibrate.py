"""Calibration at publish: the probe depth that reaches a target recall on the pool being published.

A fixed default probe (about nlist / 16, at most 128 clusters) gives recall@100 0.99 on one pool and
0.88 on another (a noisy, long-tailed one); the publisher holds the pool, so it measures instead:

1. Queries (`calibration_queries`): CALIBRATION_QUERIES items of the pool drawn at random, each plus
   Gaussian noise of NOISE_SHARE x the pool's per-dimension standard deviation (near the pool's data
   but not on an item, whose nearest neighbour would be itself), or the user's own queries
   (`silverrec publish --calibration-queries Q.npy`: user-tower outputs, for instance).
2. Truth (`prepare`, before the layout may consume the float pool): their exact top-k in float32 over
   the pool, unfiltered, and for filters sampled from the pool's own feature values at several
   selectivities (`sample_filters`), the exact top-k of the matching items.
3. Curve (`calibrate`): the snapshot's own search (`EagerSearch`: the root module and the predictor's
   request path, eager) at nprobe on a geometric grid, recall@k and the time per batch of 16 at each
   point, until the recall passes CURVE_TOP; then the smallest nprobe reaching the target, bisected
   between grid points. That nprobe becomes the manifest's `default_nprobe`; the curve is recorded
   (`calibration` in the manifest, printed by `silverrec inspect`) and maps a request's
   `target_recall` to an nprobe (`nprobe_for_recall`).
4. Filtered search (`calibrate_filters`): see its docstring.

Bounded cost: every search runs on the pool's own index, batch 16; the deepest probe scanned is the
first grid point past CURVE_TOP. The stage is timed in the manifest's build report.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from silverrec.errors import PoolError
from silverrec.filtering.filter_lang import And, Not, Term, to_string
from silverrec.filtering.forward_index import ForwardIndex

TARGET_RECALL = 0.95  # publish's default target: recall@CALIBRATION_K of the default search
CALIBRATION_K = 100
CALIBRATION_QUERIES = 512
NOISE_SHARE = 0.25  # calibration query = item + N(0, (NOISE_SHARE x the pool's per-dimension std)^2)
CURVE_TOP = 0.995  # the curve is measured up to the first nprobe past this recall (or nlist)
GRID_STEP = 2.0  # nprobe grid: 1, 2, 4, ... (then bisection between the two points around the target)
PLATEAU = 0.002  # the curve stops once a grid step gains less recall than this (past the target)
BATCH = 16  # queries per search call, as a served batch
TIMING_CALLS = 3  # timed calls per curve point (median)
FILTER_VALUES = 8  # values per term of a sampled filter (a request's IN list, not a thousand-value one)
EXACT_BLOCK = 1 << 25  # scores (queries x pool rows) per exact matmul: 128 MiB


def calibration_queries(embeddings: np.ndarray, n: int = CALIBRATION_QUERIES, seed: int = 0) -> np.ndarray:
    """n queries float32 [n, D] near the pool's data: random items plus Gaussian noise of NOISE_SHARE x
    the pool's per-dimension standard deviation (of a sample of at most 64k rows)."""
    rng = np.random.default_rng(seed)
    size = embeddings.shape[0]
    rows = np.sort(rng.choice(size, size=min(n, size), replace=False))
    sample = embeddings[np.sort(rng.choice(size, size=min(size, 1 << 16), replace=False))].astype(np.float64)
    std = sample.std(axis=0)
    noise = rng.standard_normal((rows.size, embeddings.shape[1])) * (NOISE_SHARE * std)
    return (embeddings[rows].astype(np.float64) + noise).astype(np.float32)


def exact_top(embeddings: np.ndarray, queries: torch.Tensor, k: int, allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exact float32 top-k pool rows by inner product: embeddings float32 [N, D] (pool order), queries
    float32 [Q, D], allowed bool [N] or None -> int64 [Q, k], best first, -1 past the allowed rows.
    Blocks of at most EXACT_BLOCK scores (queries x rows)."""
    q = queries.float()
    n = embeddings.shape[0]
    rows_per = min(n, EXACT_BLOCK)
    queries_per = max(1, EXACT_BLOCK // rows_per)
    out = []
    for qs in range(0, q.shape[0], queries_per):
        qb = q[qs : qs + queries_per]
        best_s = torch.full((qb.shape[0], 0), float("-inf"))
        best_r = torch.full((qb.shape[0], 0), -1, dtype=torch.int64)
        for start in range(0, n, rows_per):
            s = qb @ torch.from_numpy(embeddings[start : start + rows_per]).float().T
            if allowed is not None:
                s.masked_fill_(~allowed[start : start + s.shape[1]], float("-inf"))
            top_s, top_r = torch.topk(s, min(k, s.shape[1]), dim=1)
            best_s, best_r = torch.cat([best_s, top_s], 1), torch.cat([best_r, top_r + start], 1)
            best_s, top = torch.topk(best_s, min(k, best_s.shape[1]), dim=1)
            best_r = best_r.gather(1, top)
        if best_s.shape[1] < k:  # fewer rows than k
            pad = k - best_s.shape[1]
            best_s = torch.cat([best_s, torch.full((qb.shape[0], pad), float("-inf"))], 1)
            best_r = torch.cat([best_r, torch.full((qb.shape[0], pad), -1, dtype=torch.int64)], 1)
        out.append(torch.where(best_s > float("-inf"), best_r, -1))
    return torch.cat(out)


def recall(found: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean over queries of |found & truth| / |truth| (ids; -1 in truth = fewer matches than k, not counted)."""
    hits = ((found[:, :, None] == truth[:, None, :]) & (truth[:, None, :] >= 0)).any(1).sum(1)
    size = (truth >= 0).sum(1)
    keep = size > 0
    return float((hits[keep].double() / size[keep].double()).mean()) if bool(keep.any()) else 1.0


@dataclass
class FilterSample:
    """A filter of the pool's own values: its string, the share of the pool it passes, the calibration
    queries it is asked with (indices into `Truth.queries`) and their exact top-k item ids [Qf, k]."""

    text: str
    selectivity: float
    queries: torch.Tensor
    truth: torch.Tensor


@dataclass
class Truth:
    """What `calibrate` measures against, computed while the float pool exists: queries float32 [Q, D],
    the item ids int64 [Q, k] of their exact top-k, and the sampled filters'."""

    queries: torch.Tensor
    truth: torch.Tensor
    k: int
    source: str  # "pool" (items + noise) or "user" (given queries)
    filters: list[FilterSample] = field(default_factory=list)


def prepare(embeddings: np.ndarray, item_ids: np.ndarray, k: int = CALIBRATION_K,
            queries: Optional[np.ndarray] = None, fwd: Optional[ForwardIndex] = None, seed: int = 0,
            selectivities: Sequence[float] = (), filter_queries: int = 64) -> Truth:
    """The calibration truth for a pool: embeddings float32 [N, D] and item_ids int64 [N] in pool order;
    queries float32 [Q, D] (None: `calibration_queries`); fwd: the pool's forward index in pool order
    (None: no filters), from which `sample_filters` draws one filter per selectivity, each asked with
    `filter_queries` of the queries."""
    n, d = embeddings.shape
    k = min(k, n)
    if queries is None:
        q, source = calibration_queries(embeddings, seed=seed), "pool"
    else:
        q, source = np.asarray(queries), "user"
        if q.ndim != 2 or q.shape[1] != d or q.shape[0] < 1:
            raise PoolError(f"calibration queries must be float [Q, {d}] with Q >= 1, got shape {tuple(q.shape)}")
        if not np.isfinite(q).all():
            raise PoolError("calibration queries contain NaN or Inf")
    qt = torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32))
    ids = torch.from_numpy(np.asarray(item_ids, dtype=np.int64))

    def to_ids(rows: torch.Tensor) -> torch.Tensor:
        return torch.where(rows >= 0, ids[rows.clamp_min(0)], -1)

    truth = Truth(qt, to_ids(exact_top(embeddings, qt, k)), k, source)
    if fwd is not None and selectivities:
        g = torch.Generator().manual_seed(seed)
        for text, mask in sample_filters(fwd, selectivities, seed):
            pick = torch.randperm(qt.shape[0], generator=g)[:filter_queries].sort().values
            truth.filters.append(FilterSample(text, float(mask.double().mean()), pick,
                                              to_ids(exact_top(embeddings, qt[pick], k, mask))))
    return truth


def sample_filters(fwd: ForwardIndex, selectivities: Sequence[float], seed: int = 0,
                   candidates: int = 192) -> list[tuple[str, torch.Tensor]]:
    """Filters built from the pool's own feature values, one per reachable selectivity: random
    candidates (a feature's values in random order, as many as reach a random share of the pool, at
    most FILTER_VALUES; the complement of such a set; or the AND of two such sets of different
    features), their exact masks,
    and for each wanted selectivity the candidate closest to it in log scale (within a factor of 2).
    -> [(filter string, bool [N] mask in fwd's row order)], in the order of `selectivities`, fewer
    where none is close."""
    rng = np.random.default_rng(seed)
    counts = _value_counts(fwd)
    n = fwd.size
    feats = [f for f in fwd.features if counts[f].sum() > 0]
    if not feats:
        return []

    def value_set(f: str, share: float):
        vocab, c = fwd.vocabs[fwd.features.index(f)], counts[f]
        order = rng.permutation(len(vocab))
        order = order[c[order] > 0]
        total = np.cumsum(c[order])
        j = min(FILTER_VALUES, int(np.searchsorted(total, share * n)) + 1)
        return Term(f, tuple(vocab[i] for i in order[:j]))

    found: list[tuple[str, torch.Tensor, float]] = []
    for _ in range(candidates):
        share = float(10 ** rng.uniform(-4.5, 0))
        f = feats[rng.integers(len(feats))]
        kind = rng.integers(3 if len(feats) > 1 else 2)
        if kind == 0:
            node = value_set(f, share)
        elif kind == 1:
            node = Not(value_set(f, 1.0 - share))
        else:  # f's share a >= share, the other feature's share / a: about `share` when independent
            g = [h for h in feats if h != f][rng.integers(len(feats) - 1)]
            a = float(10 ** rng.uniform(math.log10(share), 0))
            node = And((value_set(f, a), value_set(g, share / a)))
        mask = fwd.evaluate(node)
        frac = float(mask.double().mean())
        if frac > 0:
            found.append((to_string(node), mask, frac))
    out = []
    for s in selectivities:
        best = min(found, key=lambda c: abs(math.log(c[2] / s)))
        if abs(math.log(best[2] / s)) <= math.log(2.0):
            out.append((best[0], best[1]))
    return out


def _value_counts(fwd: ForwardIndex) -> dict[str, np.ndarray]:
    """Items holding each value, per feature (vocabulary order)."""
    tokens = np.bincount(fwd.token_ids.numpy().astype(np.int64), minlength=int(fwd.feature_base[-1] + len(fwd.vocabs[-1])))
    return {f: tokens[fwd.feature_base[i] : fwd.feature_base[i] + len(fwd.vocabs[i])] for i, f in enumerate(fwd.features)}


class EagerSearch:
    """The snapshot's search before it is written: the root module, eager, behind the predictor's own
    request path (silverrec/retrieval/filtered_search.py `search_index`) over the manifest config
    being built, so that calibration measures what a loaded snapshot will answer."""

    def __init__(self, model: torch.nn.Module, config: dict[str, Any]):
        self.module = model
        self.config = config
        self.path = "(snapshot being published)"

    def reconfigure(self) -> None:
        """Forget what the request path cached from the config (call after changing a default)."""
        self._filter_plan = None

    def search(self, queries: torch.Tensor, k: int, **options: Any) -> torch.Tensor:
        """item ids int64 [B, k] (-1 = none) for queries float32 [B, D]."""
        from silverrec.retrieval.filtered_search import search_index

        with torch.inference_mode():
            return search_index(self, queries, k, **options)[1]


def measure(search: Callable[..., torch.Tensor], queries: torch.Tensor, truth: torch.Tensor, k: int,
            **options: Any) -> tuple[float, float]:
    """(recall@k of `search` over the queries in batches of BATCH, median ms per batch)."""
    found, ms = [], []
    for start in range(0, queries.shape[0], BATCH):
        t0 = time.perf_counter()
        found.append(search(queries[start : start + BATCH], k, **options))
        ms.append((time.perf_counter() - t0) * 1e3)
    return recall(torch.cat(found), truth), float(np.median(ms))


def probe_curve(search: Callable[..., torch.Tensor], queries: torch.Tensor, truth: torch.Tensor, k: int, nlist: int,
                target: float, **options: Any) -> tuple[list[dict], int]:
    """recall@k and ms per batch at nprobe 1, 2, 4, ... (GRID_STEP) until the recall passes max(CURVE_TOP,
    target) or stops growing (less than PLATEAU over a step) or nprobe reaches nlist; then the
    smallest nprobe reaching `target`, bisected between the grid points around it to within 1/8.
    -> (points sorted by nprobe: {"nprobe", "recall", "ms"}, that nprobe; the last point's when the
    target is out of reach)."""
    points: dict[int, dict] = {}

    def at(p: int) -> float:
        if p not in points:
            r, ms = measure(search, queries, truth, k, nprobe=p, **options)
            points[p] = {"nprobe": p, "recall": round(r, 5), "ms": round(ms, 3)}
        return points[p]["recall"]

    p, last = 1, -1.0
    while True:
        r = at(p)
        if r >= max(CURVE_TOP, target) or p >= nlist or (r - last < PLATEAU and r >= target):
            break
        last, p = r, min(nlist, int(math.ceil(p * GRID_STEP)))
    reached = [q for q in sorted(points) if points[q]["recall"] >= target]
    if not reached:
        return [points[q] for q in sorted(points)], max(points)
    hi = reached[0]
    lo = max([q for q in points if q < hi], default=0)
    while hi - lo > max(1, lo // 8):
        mid = (lo + hi) // 2
        if at(mid) >= target:
            hi = mid
        else:
            lo = mid
    return [points[q] for q in sorted(points)], hi


@dataclass
class CalibrationConfig:
    """What publish calibrates to: recall@k `target_recall` of the default search, measured with
    `queries` (float [Q, D], the user's) or None (`calibration_queries`, from the pool)."""

    target_recall: float = TARGET_RECALL
    k: int = CALIBRATION_K
    queries: Optional[np.ndarray] = None
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.target_recall, bool) or not 0.0 < float(self.target_recall) <= 1.0:
            raise PoolError(f"target recall must be in (0, 1], got {self.target_recall!r}")
        if isinstance(self.k, bool) or int(self.k) < 1:
            raise PoolError(f"calibration k must be a positive int, got {self.k!r}")


def calibrate(search: EagerSearch, truth: Truth, target: float = TARGET_RECALL) -> dict[str, Any]:
    """Measure and set the snapshot's defaults: search.config (the manifest config being built) gets
    `default_nprobe` (the smallest nprobe reaching `target` on the unfiltered queries, `probe_curve`),
    search.probe_exponent / max_probe_factor / probe_k (`widening`) and a default_max_probe of at least
    the new nprobe; and its "calibration" section, which it returns."""
    t0 = time.perf_counter()
    cfg = search.config
    nlist = int(cfg["nlist"])
    curve, nprobe = probe_curve(search.search, truth.queries, truth.truth, truth.k, nlist, target)
    cfg["default_nprobe"] = int(nprobe)
    cfg["search"]["default_max_probe"] = max(int(nprobe), int(cfg["search"].get("default_max_probe", 0)))
    cfg["search"]["probe_k"] = int(truth.k)
    search.reconfigure()
    exponent, factor, filters = widening(search, truth, target)
    cfg["search"]["probe_exponent"], cfg["search"]["max_probe_factor"] = exponent, factor
    search.reconfigure()
    reached = max(c["recall"] for c in curve) >= target
    cfg["calibration"] = {"target_recall": float(target), "k": int(truth.k), "queries": int(truth.queries.shape[0]),
                          "source": truth.source, "default_nprobe": int(nprobe), "reached": bool(reached),
                          "curve": curve, "probe_exponent": exponent, "max_probe_factor": factor, "filters": filters,
                          "seconds": round(time.perf_counter() - t0, 3)}
    return cfg["calibration"]


EXPONENTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5)  # probe_exponent candidates, tried in order
MAX_PROBE_FACTORS = (1.5, 2.0, 4.0, 8.0)  # max_probe_factor candidates, tried in order for each exponent


def widening(search: EagerSearch, truth: Truth, target: float) -> tuple[float, float, list[dict]]:
    """The filtered search's defaults: the first (probe_exponent, max_probe_factor) of EXPONENTS x
    MAX_PROBE_FACTORS (exponent first, then factor, ascending) with which every sampled filter's default
    search reaches `target`. The exponent deepens the probe of a filter of estimated share d by
    max(1, k / (k_cal x d)) ** exponent (`probe_depth`); the factor bounds how far past that depth the
    in-op widening may look (`default_max_probe`: the filter is evaluated on that many candidate
    clusters, most of a broad filter's cost). The broadest filters are measured first (they fail
    first). The last pair when none reaches. -> (exponent, factor, per filter {"filter",
    "selectivity", "recall", "ms"} at that pair, filter strings cut at 120 characters)."""
    cfg = search.config["search"]
    filters = sorted(truth.filters, key=lambda f: -f.selectivity)
    rows: list[dict] = []
    for exponent in EXPONENTS:
        for factor in MAX_PROBE_FACTORS:
            cfg["probe_exponent"], cfg["max_probe_factor"] = exponent, factor
            search.reconfigure()
            rows = []
            for f in filters:
                r, ms = measure(search.search, truth.queries[f.queries], f.truth, truth.k, filter=f.text)
                rows.append({"filter": f.text if len(f.text) <= 120 else f.text[:117] + "...",
                             "selectivity": round(f.selectivity, 6), "recall": round(r, 5), "ms": round(ms, 3)})
                if r < target:
                    break
            else:
                return exponent, factor, rows[::-1]
    return EXPONENTS[-1], MAX_PROBE_FACTORS[-1], rows[::-1]
