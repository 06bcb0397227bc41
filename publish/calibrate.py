"""Calibration at publish: the probe depth (and the filtered widening) that reach a target recall on
the pool being published.

A fixed default probe (about nlist / 16, at most 128 clusters) gives recall@100 0.99 on one pool and
0.88 on another (a noisy, long-tailed one); the publisher holds the pool, so it measures instead:

1. Queries (`calibration_queries`): CALIBRATION_QUERIES items of the pool drawn at random, each plus
   Gaussian noise of NOISE_SHARE x the pool's per-dimension standard deviation (near the pool's data
   but not on an item, whose nearest neighbour would be itself), or the user's own queries
   (`silverrec publish --calibration-queries Q.npy`: user-tower outputs, for instance).
2. Truth (`prepare`, before the layout may consume the float pool): their exact top-k in float32 over
   the pool, and for filters sampled from the pool's own feature values at FILTER_SELECTIVITIES
   (`sample_filters`), the exact top-k of the matching items, all in one pass over the pool.
3. Curve (`probe_curve`): the snapshot's own search (`EagerSearch`: the root module behind the
   predictor's request path, eager) at nprobe 1, 2, 4, ..., recall@k and the time per batch of 16 at
   each point; the smallest nprobe reaching the target becomes the manifest's `default_nprobe`, and
   the curve (`calibration` in the manifest, printed by `silverrec inspect`) maps a request's
   `target_recall` to an nprobe (silverrec/retrieval/filtered_search.py `nprobe_for_recall`).
4. Filtered search (`widening`): the probe exponent and the max-probe factor with which every sampled
   filter reaches the target in the default (auto) search.

The cost is one float pass over the pool for the truth, and searches at the probe depths the curve
visits (its tail with fewer queries); both stages are timed in the manifest's build report.
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
from silverrec.retrieval.filtered_search import nprobe_for_recall

TARGET_RECALL = 0.95  # publish's default target: recall@CALIBRATION_K of the default search
CALIBRATION_K = 100
CALIBRATION_QUERIES = 384
CURVE_TAIL_QUERIES = 128  # queries measured past the default (the curve's tail, for target_recall)
NOISE_SHARE = 0.25  # calibration query = item + N(0, (NOISE_SHARE x the pool's per-dimension std)^2)
GRID_STEP = 2.0  # nprobe grid: 1, 2, 4, ... (then the bracket around the target, `probe_curve`)
PLATEAU = 0.002  # the curve's tail stops once a step gains less recall than this
BATCH = 16  # queries per search call, as a served batch
FILTER_SELECTIVITIES = (1e-4, 1e-3, 1e-2, 0.05, 0.2, 0.5, 0.8)  # shares of the pool the sampled filters pass
FILTER_QUERIES = 64  # calibration queries each sampled filter is asked with
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


def exact_top(embeddings: np.ndarray, queries: torch.Tensor, k: int,
              filters: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Exact float32 top-k pool rows by inner product, in one pass over the pool: embeddings float32
    [N, D] (pool order), queries float32 [Q, D]; filters: (query indices int64 [Qf], allowed bool [N])
    -> (int64 [Q, k] of every query, and per filter int64 [Qf, k] among its allowed rows), best first,
    -1 past the allowed rows. The pool is read once, EXACT_BLOCK scores at a time (all queries against
    a block of rows: each row is read once, whatever Q)."""
    q = queries.float()
    n = embeddings.shape[0]
    rows_per = max(1024, EXACT_BLOCK // max(1, q.shape[0]))
    parts = [(None, None)] + list(filters)
    best = [(torch.full((q.shape[0] if i is None else i.numel(), 0), float("-inf")),
             torch.zeros((q.shape[0] if i is None else i.numel(), 0), dtype=torch.int64)) for i, _ in parts]
    for start in range(0, n, rows_per):
        s_all = q @ torch.from_numpy(embeddings[start : start + rows_per]).float().T
        for j, (pick, allowed) in enumerate(parts):
            s = s_all if pick is None else s_all[pick].masked_fill_(~allowed[start : start + s_all.shape[1]], float("-inf"))
            top_s, top_r = torch.topk(s, min(k, s.shape[1]), dim=1)
            cand_s, cand_r = torch.cat([best[j][0], top_s], 1), torch.cat([best[j][1], top_r + start], 1)
            keep_s, keep = torch.topk(cand_s, min(k, cand_s.shape[1]), dim=1)
            best[j] = (keep_s, cand_r.gather(1, keep))
    out = []
    for s, r in best:
        if s.shape[1] < k:  # fewer rows than k
            pad = k - s.shape[1]
            s = torch.cat([s, torch.full((s.shape[0], pad), float("-inf"))], 1)
            r = torch.cat([r, torch.full((r.shape[0], pad), -1, dtype=torch.int64)], 1)
        out.append(torch.where(s > float("-inf"), r, -1))
    return out[0], out[1:]


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
            selectivities: Sequence[float] = (), filter_queries: int = FILTER_QUERIES) -> Truth:
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

    sampled = sample_filters(fwd, selectivities, seed) if fwd is not None and selectivities else []
    g = torch.Generator().manual_seed(seed)
    picks = [torch.randperm(qt.shape[0], generator=g)[:filter_queries].sort().values for _ in sampled]
    top, filtered = exact_top(embeddings, qt, k, [(pick, mask) for pick, (_, mask) in zip(picks, sampled)])
    return Truth(qt, to_ids(top), k, source,
                 [FilterSample(text, float(mask.double().mean()), pick, to_ids(rows))
                  for (text, mask), pick, rows in zip(sampled, picks, filtered)])


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
    """The recall curve of `search` over nprobe and the smallest nprobe reaching `target`:

    1. nprobe 1, 2, 4, ... (GRID_STEP) with every query, up to the first point reaching the target;
    2. between that point and the one before: their geometric mean, then the nprobe that the measured
       points interpolate for the target (`nprobe_for_recall`), both measured; the default is the
       smallest measured nprobe reaching the target (the interpolation, or the next point up);
    3. past it, with the first CURVE_TAIL_QUERIES queries (for `target_recall` requests): doubling
       until the recall passes half-way from the target to 1, or gains less than PLATEAU, or nlist.

    -> (points sorted by nprobe: {"nprobe", "recall", "ms" (median per batch), "queries"}, the default
    nprobe; the best point's when the target is out of reach)."""
    points: dict[int, dict] = {}

    def at(p: int, n: int = queries.shape[0]) -> float:
        if p not in points:
            r, ms = measure(search, queries[:n], truth[:n], k, nprobe=p, **options)
            points[p] = {"nprobe": p, "recall": round(r, 5), "ms": round(ms, 3), "queries": int(min(n, queries.shape[0]))}
        return points[p]["recall"]

    p, lo = 1, 0
    while at(p) < target and p < nlist:
        lo, p = p, min(nlist, int(math.ceil(p * GRID_STEP)))
    if points[p]["recall"] < target:
        best = max(points.values(), key=lambda c: (c["recall"], -c["nprobe"]))
        return [points[q] for q in sorted(points)], int(best["nprobe"])
    if lo:
        mid = int(round(math.sqrt(lo * p)))
        if lo < mid < p:
            at(mid)
        at(nprobe_for_recall(list(points.values()), target, nlist))
    default = min(q for q, c in points.items() if c["recall"] >= target)
    tail, last = max(points), points[max(points)]["recall"]
    while tail < nlist and last < (1.0 + target) / 2:
        tail = min(nlist, int(math.ceil(tail * GRID_STEP)))
        r = at(tail, CURVE_TAIL_QUERIES)
        if r - last < PLATEAU:
            break
        last = r
    return [points[q] for q in sorted(points)], default


@dataclass(frozen=True)
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


EXPONENTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5)  # probe_exponent candidates, ascending
MAX_PROBE_FACTORS = (1.25, 1.5, 2.0, 4.0, 8.0)  # max_probe_factor candidates, ascending
FIRST_FACTOR = 2.0  # the factor the exponent is searched with


def widening(search: EagerSearch, truth: Truth, target: float) -> tuple[float, float, list[dict]]:
    """The filtered search's defaults, (probe_exponent, max_probe_factor): the exponent deepens the probe
    of a filter of estimated share d by max(1, k / (k_cal x d)) ** exponent (`probe_depth`: its k nearest
    matches are about the pool's k / d nearest items); the factor bounds how far past that depth the
    in-op widening may look (`default_max_probe`: the filter is evaluated on that many candidate
    clusters, most of a broad filter's cost). The smallest of EXPONENTS with which every sampled
    filter's default search reaches `target` at FIRST_FACTOR, then the smallest factor that still does
    at that exponent (larger factors when none did at FIRST_FACTOR); the largest pair when nothing
    reaches. Each trial measures the broadest filters first and stops at the first miss. -> (exponent,
    factor, per filter {"filter", "selectivity", "recall", "ms"} at the pair, strings cut at 120
    characters, most selective first)."""
    cfg = search.config["search"]
    filters = sorted(truth.filters, key=lambda f: -f.selectivity)
    tried: dict[tuple[float, float], list[dict]] = {}

    def reaches(exponent: float, factor: float) -> bool:
        cfg["probe_exponent"], cfg["max_probe_factor"] = exponent, factor
        search.reconfigure()
        rows = tried.setdefault((exponent, factor), [])
        for f in filters:
            r, ms = measure(search.search, truth.queries[f.queries], f.truth, truth.k, filter=f.text)
            rows.append({"filter": f.text if len(f.text) <= 120 else f.text[:117] + "...",
                         "selectivity": round(f.selectivity, 6), "recall": round(r, 5), "ms": round(ms, 3)})
            if r < target:
                return False
        return True

    exponent = next((e for e in EXPONENTS if reaches(e, FIRST_FACTOR)), None)
    if exponent is None:  # wider widening at the deepest exponent
        exponent = EXPONENTS[-1]
        factor = next((f for f in MAX_PROBE_FACTORS if f > FIRST_FACTOR and reaches(exponent, f)), MAX_PROBE_FACTORS[-1])
    else:
        factor = next((f for f in MAX_PROBE_FACTORS if f >= FIRST_FACTOR or reaches(exponent, f)), FIRST_FACTOR)
    cfg["probe_exponent"], cfg["max_probe_factor"] = exponent, factor
    return exponent, factor, tried[(exponent, factor)][::-1]
