"""The filtered search's routing (`silverrec::filter_plan`) against a cost model written here from its documented
rules, on real data: MovieLens movies (item vectors from a factorisation of the ratings, the genre, decade and tag
features), filters from 0.1% to 45% of the movies and tags on posting lists.

The model (silverrec/retrieval/filtered_ivf.py steps 0-5, kernels/filter_plan.py), per query, in float64:
- posting lists: the request's lists hold at most posting_limit rows, and the mode is not "probed";
- else "unprobed" mode: the whole pool;
- else the max_probe nearest centroids by inner product, each with its rows' matches m_j (the filter's matches,
  counted here from the forward index); the candidates' density d = sum m_j / their rows; the target
  k x match_factor / sqrt(d) matches; the probes used: the shortest prefix whose cumulative matches reach the
  target, at least nprobe (exactly nprobe in "probed" mode), at most max_probe;
- "auto" mode goes to the whole pool when the candidates hold fewer matches than the target, or when the probes
  used hold more rows than the pool's estimated matches (sum m_j x N / candidate rows) x exact_cost_ratio.
A query whose decision sits within float rounding of a threshold (the op computes in float32) is not judged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from silverrec.filtering.filter_program import FilterPlan, compile_request
from silverrec.kernels.bloom_filter import bloom_filter_reference
from silverrec.kernels.constants import (MODE_AUTO, MODE_PROBED, MODE_UNPROBED, NO_CLUSTER, NO_LIST, NO_LISTS, ROUTE_POSTING,
                                         ROUTE_PROBED, ROUTE_WHOLE_POOL)
from silverrec.publish.filtered_ivf import build_filtered_ivf_forward
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.movielens import load_movies, load_ratings
from silverrec.publish.pool import Pool

FILTERS = [  # single values and conjunctions, ~45% of the movies down to a few dozen, and rare tags
    "genre = Drama", "genre = Comedy", "genre = Thriller", "decade = 1990s", "genre = Documentary",
    "genre = Drama AND decade = 1990s", "genre = Comedy AND genre = Romance", "genre = Horror AND decade = 1980s",
    "genre = Film-Noir", "genre = Western AND decade = 1960s", "genre = Action AND NOT decade = 2000s",
    "decade = 1930s", "tag = pixar", "tag = 'dark comedy'", "genre = Musical OR genre = Western",
]
RTOL = 1e-5  # decisions within this of a threshold: float32 and float64 may disagree


@pytest.fixture(scope="module")
def movielens():
    """(index, manifest, forward index in the index's row order, query vectors): 9,742 movies x 32 dims, 64
    clusters; a movie's vector its row of V S^1/2 in a rank-32 SVD of the (user-centred) rating matrix."""
    movies, ratings = load_movies(), load_ratings()
    col = {int(m): i for i, m in enumerate(movies.movie_ids)}
    users = {int(u): i for i, u in enumerate(np.unique(ratings.user_ids))}
    r = np.zeros((len(users), len(movies.movie_ids)), dtype=np.float32)
    r[[users[int(u)] for u in ratings.user_ids], [col[int(m)] for m in ratings.movie_ids]] = ratings.ratings
    rated = r != 0
    r[rated] -= (r.sum(1) / np.maximum(rated.sum(1), 1))[np.nonzero(rated)[0]]
    u, s, vt = np.linalg.svd(r, full_matrices=False)
    x = (vt[:32].T * np.sqrt(s[:32])).astype(np.float32)
    x += 1e-3 * np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)  # unrated movies: not all 0
    feats = {"genre": movies.genres, "decade": [[d] for d in movies.decade], "tag": movies.tags}
    module, manifest, fwd = build_filtered_ivf_forward(Pool(movies.movie_ids, x, feats), IVFConfig(nlist=64, seed=0))
    queries = torch.from_numpy(x[np.random.default_rng(1).choice(len(x), 24, replace=False)] * 1.5)
    return module, manifest, fwd, queries


def model_route(module, matches_by_row: np.ndarray, q: np.ndarray, list_rows: int, mode: int, k: int, nprobe: int,
                max_probe: int):
    """The cost model's (route, probes) for one query, or None when a decision is within RTOL of its threshold."""
    if list_rows <= module.posting_limit and mode != MODE_PROBED:
        return ROUTE_POSTING, []
    if mode == MODE_UNPROBED:
        return ROUTE_WHOLE_POOL, []
    off = module.cluster_offsets.numpy()
    score = module.centroids.double().numpy() @ q.astype(np.float64)
    order = np.argsort(-score, kind="stable")
    cand = order[:max_probe]
    rows = off[cand + 1] - off[cand]
    m = np.array([matches_by_row[off[c]:off[c + 1]].sum() for c in cand], dtype=np.float64)
    total, cand_rows = m.sum(), max(rows.sum(), 1)
    target = k * module.match_factor / np.sqrt(total / cand_rows) if total else np.inf
    cum = np.cumsum(m)
    need = int(np.sum(cum < target)) + 1
    use = nprobe if mode == MODE_PROBED else min(max(need, nprobe), max_probe)
    scanned = rows[:use].sum()
    budget = total * module.num_items / cand_rows * module.exact_cost_ratio
    # near ties: two centroids whose order decides the candidates, the prefix used or the probe reaching the target
    # (the op scores in float32), or a count within rounding of the target or the budget
    scale = np.abs(score).max()
    edges = [i for i in (max_probe, use, need) if i < len(order)]
    if any(score[order[i - 1]] - score[order[i]] < RTOL * scale for i in edges if i > 0):
        return None
    if np.any(np.abs(cum - target) <= RTOL * target) or (mode == MODE_AUTO and abs(scanned - budget) <= RTOL * budget):
        return None
    if mode == MODE_AUTO and (total < target or scanned > budget):
        return ROUTE_WHOLE_POOL, []
    return ROUTE_PROBED, sorted(cand[:use].tolist())


@pytest.mark.parametrize("k, nprobe, max_probe", [(10, 2, 16), (100, 4, 32), (50, 8, 64)])
def test_routes_follow_the_cost_model(movielens, k, nprobe, max_probe):
    module, manifest, fwd, queries = movielens
    plan = FilterPlan.from_config(manifest["filter"])
    b = len(queries)
    seen, judged = set(), 0
    for f in FILTERS:
        program = [t.expand(b, *t.shape[1:]).contiguous() for t in compile_request([f], plan)]
        exact = fwd.evaluate(f).numpy()
        words = module.bits.shape[1]
        bloom = bloom_filter_reference(module.bits, program[0][:1], program[1][:1], torch.zeros(1, 1, dtype=torch.int64),
                                       words)[0, 0]
        bloom_rows = ((bloom[torch.arange(module.num_items) // 64] >> (torch.arange(module.num_items) % 64)) & 1).bool()
        assert torch.equal(bloom_rows, torch.from_numpy(exact)), f"{f}: the Bloom program is not exact here"
        lists = program[4][0]
        list_rows = sum(int(module.post_offsets[i + 1] - module.post_offsets[i]) for i in lists.tolist() if i != NO_LIST) \
            if int(lists[0]) != NO_LISTS else module.num_items + 1
        for mode in (MODE_AUTO, MODE_PROBED, MODE_UNPROBED):
            with torch.inference_mode():
                probes, _, route = module.plan_probes(queries, program, torch.full((b,), mode), k, nprobe, max_probe)
            for i in range(b):
                want = model_route(module, exact, queries[i].numpy(), list_rows, mode, k, nprobe, max_probe)
                if want is None:
                    continue
                judged += 1
                got_probes = sorted(c for c in probes[i].tolist() if c != NO_CLUSTER)
                assert (int(route[i]), got_probes) == want, (f, mode, i)
                seen.add((mode, want[0]))
    assert judged > 0.95 * len(FILTERS) * 3 * b  # few decisions fall on a threshold
    # the batches exercise every route the model knows, and "auto" takes each of them
    assert {(MODE_AUTO, ROUTE_PROBED), (MODE_AUTO, ROUTE_WHOLE_POOL), (MODE_AUTO, ROUTE_POSTING)} <= seen
