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
4. Depth for more neighbours and for filters (`k_exponent`, `widening`): the exponent by which the
   probe deepens for k' > k or a filter's share d of the pool (`probe_depth`: max(1, k' / (k d)) **
   exponent), from where recall@4k puts it up to where every sampled filter reaches the target in the
   default (auto) search, and how far past that depth the filtered search may widen.

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
CALIBRATION_QUERIES = 192
CURVE_TAIL_QUERIES = 128  # queries measured past the default (the curve's tail, for target_recall)
NOISE_SHARE = 0.5  # calibration query = item + N(0, (NOISE_SHARE x the pool's per-dimension std)^2)
GRID_STEP = 2.0  # nprobe grid: 1, 2, 4, ... (then the bracket around the target, `probe_curve`)
BRACKET_STEPS = 2  # interpolations measured between the grid points around the target
BRACKET_CLOSE = 0.97  # ... unless within 3% of the smallest measured nprobe reaching it
PLATEAU = 0.002  # the curve's tail stops once a step gains less recall than this
BATCH = 16  # queries per search call, as a served batch
FILTER_SELECTIVITIES = (1e-4, 1e-3, 1e-2, 0.05, 0.2, 0.5, 0.8)  # shares of the pool the sampled filters pass
FILTER_QUERIES = CALIBRATION_QUERIES  # calibration queries each sampled filter is asked with
FILTER_VALUES = 8  # values per term of a sampled filter (a request's IN list, not a thousand-value one)
EXACT_BLOCK = 1 << 25  # scores (queries x pool rows) per exact matmul: 128 MiB
BROAD, BROAD_SPARE = 0.25, 4  # `exact_top`: filters passing >= BROAD of the pool, from the top BROAD_SPARE x k
WIDE, WIDE_QUERIES = 4, 96  # `k_exponent` measures the probe depth for WIDE x k neighbours on this many queries


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
              filters: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), wide: int = 0
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Exact float32 top-k pool rows by inner product: embeddings float32 [N, D] (pool order), queries
    float32 [Q, D]; filters: (query indices int64 [Qf], allowed bool [N]) -> (int64 [Q, max(k, wide)]
    of every query, and per filter int64 [Qf, k] among its allowed rows), best first, -1 past the
    allowed rows.

    One pass over the pool, EXACT_BLOCK scores at a time (all queries against a block of rows: each
    row is read once, whatever Q). A filter passing at least BROAD of the pool is answered from the
    queries' unfiltered top BROAD_SPARE x k: exactly, since every row outside it scores below all rows
    inside, when at least k of them pass (about BROAD x BROAD_SPARE x k = k expected); a query with
    fewer, and every narrower filter, is ranked on its allowed rows."""
    broad = [bool(allowed.double().mean() >= BROAD) for _, allowed in filters]
    spare = max(k, wide, min(embeddings.shape[0], BROAD_SPARE * k) if any(broad) else k)
    narrow = [(pick, allowed) for (pick, allowed), b in zip(filters, broad) if not b]
    top, narrow_top = _exact_pass(embeddings, queries, spare, k, narrow)
    out, it = [], iter(narrow_top)
    for (pick, allowed), b in zip(filters, broad):
        if not b:
            out.append(next(it))
            continue
        cand = top[pick]
        ok = allowed[cand.clamp_min(0)] & (cand >= 0)
        order = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices[:, :k]  # passing rows first, in rank order
        rows = torch.where(ok.gather(1, order), cand.gather(1, order), -1)
        short = (ok.sum(1) < k).nonzero().reshape(-1)
        if short.numel():  # too few passing rows among the spare: rank those queries on the allowed rows
            rows[short] = _exact_pass(embeddings, queries[pick[short]], 0, k, [(torch.arange(short.numel()), allowed)])[1][0]
        out.append(rows)
    return top[:, : max(k, wide)], out


def _exact_pass(embeddings: np.ndarray, queries: torch.Tensor, k_all: int, k: int,
                filters: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`exact_top`'s pass: the top k_all of every query (k_all 0: none, an empty [Q, 0]) and the top k of
    each filter's queries among its allowed rows, -1 padded."""
    q = queries.float()
    n = embeddings.shape[0]
    rows_per = max(1024, EXACT_BLOCK // max(1, q.shape[0]))
    parts = ([(None, None, k_all)] if k_all else []) + [(pick, allowed, k) for pick, allowed in filters]
    best = [(torch.full((q.shape[0] if pick is None else pick.numel(), 0), float("-inf")),
             torch.zeros((q.shape[0] if pick is None else pick.numel(), 0), dtype=torch.int64)) for pick, _, _ in parts]
    for start in range(0, n, rows_per):
        x = torch.from_numpy(embeddings[start : start + rows_per]).float()
        s_all = q @ x.T if k_all else None
        for j, (pick, allowed, kk) in enumerate(parts):
            if pick is None:
                s, rows = s_all, None
            else:  # the filter's queries against its allowed rows of the block
                rows = allowed[start : start + x.shape[0]].nonzero().reshape(-1)
                s = q.index_select(0, pick) @ x.index_select(0, rows).T
            top_s, top_r = torch.topk(s, min(kk, s.shape[1]), dim=1)
            top_r = (top_r if rows is None else rows[top_r]) + start
            cand_s, cand_r = torch.cat([best[j][0], top_s], 1), torch.cat([best[j][1], top_r], 1)
            keep_s, keep = torch.topk(cand_s, min(kk, cand_s.shape[1]), dim=1)
            best[j] = (keep_s, cand_r.gather(1, keep))
    out = []
    for (s, r), (_, _, kk) in zip(best, parts):
        if s.shape[1] < kk:  # fewer rows than k
            pad = kk - s.shape[1]
            s = torch.cat([s, torch.full((s.shape[0], pad), float("-inf"))], 1)
            r = torch.cat([r, torch.full((r.shape[0], pad), -1, dtype=torch.int64)], 1)
        out.append(torch.where(s > float("-inf"), r, -1))
    if not k_all:
        return torch.zeros(q.shape[0], 0, dtype=torch.int64), out
    return out[0], out[1:]


def query_recalls(found: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """float64 [Q']: |found & truth| / |truth| per query (ids; -1 in truth = fewer matches than k, not
    counted; queries without any match left out)."""
    hits = ((found[:, :, None] == truth[:, None, :]) & (truth[:, None, :] >= 0)).any(1).sum(1)
    size = (truth >= 0).sum(1)
    keep = size > 0
    return hits[keep].double() / size[keep].double()


def recall(found: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean `query_recalls` (1 when no query has a match)."""
    per = query_recalls(found, truth)
    return float(per.mean()) if per.numel() else 1.0


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
    the item ids int64 [Q, k] of their exact top-k and [Q, WIDE x k] of their exact top WIDE x k (for
    `k_exponent`), and the sampled filters'."""

    queries: torch.Tensor
    truth: torch.Tensor
    k: int
    source: str  # "pool" (items + noise) or "user" (given queries)
    filters: list[FilterSample] = field(default_factory=list)
    wide: Optional[torch.Tensor] = None


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
    top, filtered = exact_top(embeddings, qt, k, [(pick, mask) for pick, (_, mask) in zip(picks, sampled)],
                              wide=min(n, WIDE * k))
    return Truth(qt, to_ids(top[:, :k]), k, source,
                 [FilterSample(text, float(mask.double().mean()), pick, to_ids(rows))
                  for (text, mask), pick, rows in zip(sampled, picks, filtered)], to_ids(top))


def sample_filters(fwd: ForwardIndex, selectivities: Sequence[float], seed: int = 0,
                   candidates: int = 256) -> list[tuple[str, torch.Tensor]]:
    """Filters built from the pool's own feature values, one per reachable selectivity. Random
    candidates: a feature's values in random order, as many as reach a random share of the pool (at
    most FILTER_VALUES); the complement of such a set; or the AND of two such sets of different
    features. Each has a share estimated from the value counts (independent features); for each wanted
    selectivity the candidates nearest in log scale are evaluated exactly, nearest first, and the first
    within a factor of 2 of it is taken. -> [(filter string, bool [N] mask in fwd's row order)], in the
    order of `selectivities`, fewer where none is close."""
    rng = np.random.default_rng(seed)
    counts = _value_counts(fwd)
    n = fwd.size
    feats = [f for f in fwd.features if counts[f].sum() > 0]
    if not feats:
        return []

    def value_set(f: str, share: float) -> tuple[Term, float]:
        vocab, c = fwd.vocabs[fwd.features.index(f)], counts[f]
        order = rng.permutation(len(vocab))
        order = order[c[order] > 0]
        j = min(FILTER_VALUES, int(np.searchsorted(np.cumsum(c[order]), share * n)) + 1)
        return Term(f, tuple(vocab[i] for i in order[:j])), min(1.0, float(c[order[:j]].sum()) / n)

    found: list[tuple[object, float]] = []
    for _ in range(candidates):
        share = float(10 ** rng.uniform(-4.5, 0))
        f = feats[rng.integers(len(feats))]
        kind = rng.integers(3 if len(feats) > 1 else 2)
        if kind == 0:
            found.append(value_set(f, share))
        elif kind == 1:
            term, est = value_set(f, 1.0 - share)
            found.append((Not(term), 1.0 - est))
        else:  # f's share a >= share, the other feature's share / a: about `share` when independent
            g = [h for h in feats if h != f][rng.integers(len(feats) - 1)]
            a = float(10 ** rng.uniform(math.log10(share), 0))
            (ta, ea), (tb, eb) = value_set(f, a), value_set(g, share / a)
            found.append((And((ta, tb)), ea * eb))
    found = [(node, est) for node, est in found if est > 0]
    out = []
    for want in selectivities:
        for node, est in sorted(found, key=lambda c: abs(math.log(c[1] / want)))[:4]:
            mask = fwd.evaluate(node)
            share = float(mask.double().mean())
            if share > 0 and abs(math.log(share / want)) <= math.log(2.0):
                out.append((to_string(node), mask))
                break
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
            **options: Any) -> tuple[float, float, float]:
    """(recall@k of `search` over the queries in batches of BATCH, median ms per batch, the recall's
    standard error: the per-query recalls' standard deviation / sqrt(queries))."""
    found, ms = [], []
    for start in range(0, queries.shape[0], BATCH):
        t0 = time.perf_counter()
        found.append(search(queries[start : start + BATCH], k, **options))
        ms.append((time.perf_counter() - t0) * 1e3)
    per = query_recalls(torch.cat(found), truth)
    se = float(per.std() / math.sqrt(per.numel())) if per.numel() > 1 else 0.0
    return (float(per.mean()) if per.numel() else 1.0), float(np.median(ms)), se


class Sweep:
    """One search setting's recall over nprobe, each nprobe measured once (`measure`): the points
    {"nprobe", "recall", "se", "ms", "queries"}. An nprobe *reaches* a target when its recall does by z
    standard errors (recall - z se >= target; z = 1 by default: the default must hold on other queries
    than these)."""

    def __init__(self, search: Callable[..., torch.Tensor], queries: torch.Tensor, truth: torch.Tensor, k: int,
                 z: float = 1.0, **options: Any):
        self.search, self.queries, self.truth, self.k, self.z, self.options = search, queries, truth, k, z, options
        self.points: dict[int, dict] = {}

    def at(self, p: int, n: Optional[int] = None) -> float:
        """recall - z se at nprobe p, over the first n queries (None: all)."""
        if p not in self.points:
            n = self.queries.shape[0] if n is None else min(n, self.queries.shape[0])
            r, ms, se = measure(self.search, self.queries[:n], self.truth[:n], self.k, nprobe=p, **self.options)
            self.points[p] = {"nprobe": p, "recall": round(r, 5), "se": round(se, 5), "ms": round(ms, 3), "queries": n}
        return self.points[p]["recall"] - self.z * self.points[p]["se"]

    def climb(self, p: int, step: float, target: float, nlist: int) -> Optional[int]:
        """nprobe p, p x step, ... up to the first that reaches `target` (None: not even nlist), then up to
        BRACKET_STEPS nprobes interpolated between the points around it (`nprobe_for_recall` on the
        lower bounds, linear in log nprobe: at or above the true one where the curve is concave),
        measured. -> the smallest measured nprobe reaching the target."""
        while self.at(p) < target and p < nlist:
            p = min(nlist, int(math.ceil(p * step)))
        if self.at(p) < target:
            return None
        for _ in range(BRACKET_STEPS if len(self.points) > 1 else 0):
            lower = [{"nprobe": c["nprobe"], "recall": c["recall"] - self.z * c["se"]} for c in self.points.values()]
            guess = nprobe_for_recall(lower, target, nlist)
            best = min(q for q in self.points if self.at(q) >= target)
            if guess in self.points or guess >= best * BRACKET_CLOSE:  # measured, or too close to matter
                break
            self.at(guess)
        return min(q for q in self.points if self.at(q) >= target)

    def curve(self) -> list[dict]:
        return [self.points[q] for q in sorted(self.points)]


def probe_curve(search: Callable[..., torch.Tensor], queries: torch.Tensor, truth: torch.Tensor, k: int, nlist: int,
                target: float, **options: Any) -> tuple[list[dict], int]:
    """The recall curve of `search` over nprobe and the smallest nprobe reaching `target` (`Sweep`):
    nprobe 1, 2, 4, ... (GRID_STEP) with every query up to the first that reaches it, then the
    interpolations between it and the point before (`Sweep.climb`); past the default, with the first
    CURVE_TAIL_QUERIES queries (for `target_recall` requests), doubling until the recall passes half-way
    from the target to 1, or gains less than PLATEAU, or nlist.
    -> (points sorted by nprobe: {"nprobe", "recall", "se", "ms" (median per batch), "queries"}, the
    default nprobe; the best point's when the target is out of reach)."""
    sweep = Sweep(search, queries, truth, k, **options)
    default = sweep.climb(1, GRID_STEP, target, nlist)
    if default is None:
        best = max(sweep.points.values(), key=lambda c: (c["recall"], -c["nprobe"]))
        return sweep.curve(), int(best["nprobe"])
    tail = max(sweep.points)
    last = sweep.points[tail]["recall"]
    while tail < nlist and last < (1.0 + target) / 2:
        tail = min(nlist, int(math.ceil(tail * GRID_STEP)))
        sweep.at(tail, CURVE_TAIL_QUERIES)
        if sweep.points[tail]["recall"] - last < PLATEAU:
            break
        last = sweep.points[tail]["recall"]
    return sweep.curve(), default


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
    start, wide_points = k_exponent(search, truth, int(nprobe), target, nlist)
    exponent, factor, filters = widening(search, truth, target, start)
    cfg["search"]["probe_exponent"], cfg["search"]["max_probe_factor"] = exponent, factor
    search.reconfigure()
    reached = max(c["recall"] for c in curve) >= target
    cfg["calibration"] = {"target_recall": float(target), "k": int(truth.k), "queries": int(truth.queries.shape[0]),
                          "source": truth.source, "default_nprobe": int(nprobe), "reached": bool(reached),
                          "curve": curve, "probe_exponent": exponent, "max_probe_factor": factor,
                          "k_exponent": start, "wide_curve": wide_points, "filters": filters,
                          "seconds": round(time.perf_counter() - t0, 3)}
    return cfg["calibration"]


EXPONENT_STEP, MAX_EXPONENT = 0.25, 1.5  # `widening` raises the exponent by this step, up to this
MAX_PROBE_FACTORS = (1.25, 4.0)  # max_probe_factor candidates, ascending


def k_exponent(search: EagerSearch, truth: Truth, nprobe: int, target: float, nlist: int) -> tuple[float, list[dict]]:
    """How fast the probe must deepen with the neighbours wanted: the smallest nprobe P' whose
    recall@(WIDE x k) reaches `target` on the first WIDE_QUERIES queries (`Sweep.climb` from P by
    sqrt(2)) against the calibrated nprobe P at k: log(P' / P) / log(WIDE), rounded up to 0.05, at least 0. A filter passing a share d
    of the pool asks for the pool's k / d nearest items, so this is where `widening` starts.
    -> (exponent, the points measured at k' = WIDE x k)."""
    kw = 0 if truth.wide is None else int(truth.wide.shape[1])
    if kw <= truth.k:
        return 0.0, []
    n = WIDE_QUERIES
    sweep = Sweep(search.search, truth.queries[:n], truth.wide[:n], kw)
    wide_p = sweep.climb(nprobe, math.sqrt(2.0), target, nlist) or nlist
    exponent = max(0.0, math.ceil(20 * math.log(wide_p / nprobe) / math.log(kw / truth.k) - 1e-9) / 20)
    return min(MAX_EXPONENT, exponent), sweep.curve()


def widening(search: EagerSearch, truth: Truth, target: float, start: float = 0.0) -> tuple[float, float, list[dict]]:
    """The filtered search's defaults, (probe_exponent, max_probe_factor): the exponent deepens the probe
    of a filter of estimated share d by max(1, k / (k_cal x d)) ** exponent (`probe_depth`: its k nearest
    matches are about the pool's k / d nearest items); the factor bounds how far past that depth the
    in-op widening may look (`default_max_probe`: the filter is evaluated on that many candidate
    clusters, most of a broad filter's cost). From exponent `start` (`k_exponent`) up in steps of
    EXPONENT_STEP, for each the factors of MAX_PROBE_FACTORS in order, the first pair with which every
    sampled filter's default search reaches `target` (by one standard error, as `Sweep`); the last pair
    when none does. Each trial measures the broadest filters first and stops at the first miss. -> (exponent, factor, per filter {"filter", "selectivity", "recall", "se", "ms"}
    at the pair, strings cut at 120 characters, most selective first)."""
    cfg = search.config["search"]
    filters = sorted(truth.filters, key=lambda f: -f.selectivity)
    rows: list[dict] = []
    exponents = [start + EXPONENT_STEP * i for i in range(int((MAX_EXPONENT - start) / EXPONENT_STEP + 1e-9) + 1)]
    for exponent in exponents or [start]:
        for factor in MAX_PROBE_FACTORS:
            cfg["probe_exponent"], cfg["max_probe_factor"] = exponent, factor
            search.reconfigure()
            rows = []
            for f in filters:
                r, ms, se = measure(search.search, truth.queries[f.queries], f.truth, truth.k, filter=f.text)
                rows.append({"filter": f.text if len(f.text) <= 120 else f.text[:117] + "...",
                             "selectivity": round(f.selectivity, 6), "recall": round(r, 5), "se": round(se, 5),
                             "ms": round(ms, 3)})
                if r - se < target:
                    break
            else:
                return exponent, factor, rows[::-1]
    return cfg["probe_exponent"], cfg["max_probe_factor"], rows[::-1]


@torch.no_grad()
def choose_nprobe(index, users: torch.Tensor, cache_emb: torch.Tensor, k0: int, min_recall: float) -> tuple[int, dict]:
    """A recommendation model's probe default (publish/rec.py, byo.py): the smallest nprobe of nlist/16,
    /8, /4, /2, nlist whose IVF top-k0 (`Int8IVFIndex.scan` of its probe) holds `min_recall` of the exact
    top-k0 over the cache embeddings float [N, D] (rows in the index's order) for the sampled user
    embeddings `users` float [U, D]. -> (nprobe, the manifest's "calibration" section: the points
    measured as its curve, through which a request's `target_recall` maps to an nprobe)."""
    t0 = time.perf_counter()
    nlist = index.nlist
    k0 = min(k0, index.num_items)
    truth = index.row_to_item[(users @ cache_emb.T).topk(k0, dim=1).indices].to(torch.int64)
    sweep = Sweep(lambda q, k, nprobe: index.scan(q, index.probe(q, nprobe), k)[1], users, truth, k0, z=0.0)
    chosen = nlist
    for p in sorted({max(1, nlist // d) for d in (16, 8, 4, 2, 1)}):
        if sweep.at(p) >= min_recall:
            chosen = p
            break
    curve = sweep.curve()
    return chosen, {"target_recall": float(min_recall), "k": int(k0), "queries": int(users.shape[0]),
                    "source": "user tower", "default_nprobe": int(chosen),
                    "reached": bool(max(c["recall"] for c in curve) >= min_recall), "curve": curve,
                    "seconds": round(time.perf_counter() - t0, 3)}
