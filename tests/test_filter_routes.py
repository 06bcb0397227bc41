"""Routing of the filtered search: conjunctions of frequent values on bit planes, the whole-pool
switch by estimated cardinality, checked against exact filtered brute force and against an
independent cost model (written here from the documented rules, with exact counts from the pool)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from silverrec.filtering.filter_lang import parse
from silverrec.filtering.filter_program import FilterPlan, compile_estimates, compile_request
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.publish.filtered_ivf import build_filtered_ivf, pool_rows, search_model
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool
from silverrec.kernels.constants import MODE_AUTO, MODE_UNPROBED, ROUTE_POSTING, ROUTE_PROBED, ROUTE_WHOLE_POOL
from silverrec.retrieval.filtered_search import search_index, whole_pool_by_estimate
from tests.test_filter_ivf import _exact_filtered_rescored, assert_same_ranking

N, D, NLIST = 20000, 24, 80
# frequent values only (every value > N / 32 items: no posting lists) plus one rare feature
CARD = {"country": 6, "lang": 8, "genre": 12}
CONJUNCTIONS = [
    "country = c1 AND lang = l2",  # ~2%
    "country = c1 AND lang = l2 AND genre = g3",  # ~0.17%
    "country IN (c0, c1) AND genre = g5 AND NOT lang = l0",
    "country = c2 AND lang IN (l1, l2, l3) AND genre IN (g1, g2)",
    "country = c4",  # ~17%: probed
    "NOT country = c4 AND lang IN (l1, l2, l3, l4)",  # ~42%
    "rare = r3 AND country = c1",  # a posting list
    "country = c0 AND lang = l1 AND genre = g2 AND country = c3",  # contradiction: nothing
]


@pytest.fixture(scope="module")
def built():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, D)).astype(np.float32) + rng.normal(size=(32, D)).astype(np.float32)[rng.integers(0, 32, N)]
    feats = {f: [[f"{f[0]}{v}"] for v in rng.integers(0, c, N)] for f, c in CARD.items()}
    feats["rare"] = [[f"r{v}"] for v in rng.integers(0, 3000, N)]
    pool = Pool(np.arange(N, dtype=np.int64) * 5 + 3, x, feats)
    module, manifest = build_filtered_ivf(pool, IVFConfig(nlist=NLIST, seed=0))
    module.eval()
    fwd = ForwardIndex.from_lists(pool.features).permute(pool_rows(pool, module.row_to_item))
    snap = SimpleNamespace(config=manifest, module=search_model(module), path="test")
    q = torch.from_numpy(x[rng.integers(0, N, len(CONJUNCTIONS))] + 0.2 * rng.normal(size=(len(CONJUNCTIONS), D)).astype(np.float32))
    return snap, module, manifest, FilterPlan.from_config(manifest["filter"]), fwd, q


def test_every_frequent_value_has_an_exact_plane(built):
    _, module, manifest, _, fwd, _ = built
    limit = manifest["filter"]["postings"]["limit"]
    for f, meta in manifest["filter"]["features"].items():
        for v, (row, count) in enumerate(zip(meta["planes"], meta["counts"])):
            assert (row >= 0) == (count > limit), (f, v)
            if row >= 0:
                bits = module.bits[row]
                got = ((bits[torch.arange(N) // 64] >> (torch.arange(N) % 64)) & 1).bool()
                assert torch.equal(got, fwd.term_mask(f, [meta["values"][v]])), (f, v)


@pytest.mark.parametrize("k", [1, 10, 100])
def test_conjunctions_equal_exact_filtered_brute_force(built, k):
    snap, module, _, _, fwd, q = built
    want = _exact_filtered_rescored(module, fwd, q, CONJUNCTIONS, k)
    for mode in ("auto", "unprobed"):
        with torch.inference_mode():
            got = search_index(snap, q, k, nprobe=4, filter=CONJUNCTIONS, mode=mode)[1]
        for b, f in enumerate(CONJUNCTIONS):
            if mode == "unprobed" or _route(built, k, 4)[b] != ROUTE_PROBED:  # exact routes: the same ranking
                assert_same_ranking(got[b].tolist(), want[b])
            else:  # probed: a subset of the filter's items
                assert set(got[b][got[b] >= 0].tolist()) <= set(module.row_to_item[fwd.evaluate(f)].tolist())


def _route(built, k, nprobe):
    """The planner's route per query (ROUTE_*): the predictor's mode choice, then filter_plan."""
    snap, module, manifest, plan, _, q = built
    cfg = manifest["search"]
    est = compile_estimates(CONJUNCTIONS, plan)
    whole = whole_pool_by_estimate(est, k, nprobe, N, NLIST, cfg["match_factor"], cfg["exact_cost_ratio"])
    modes = torch.where(torch.from_numpy(whole), MODE_UNPROBED, MODE_AUTO)
    max_probe = max(nprobe, min(NLIST, cfg["default_max_probe"]))
    return module.plan_probes(q, list(compile_request(CONJUNCTIONS, plan)), modes, k, nprobe, max_probe)[2].tolist()


def _cost_model_route(f, fwd, manifest, k, nprobe):
    """Independent model of the documented rules, with exact counts from the pool: "posting" when a
    conjunct is a rare value (its list, <= limit rows, bounds the filter); "whole" when the filter's
    matches m satisfy m x ratio <= the rows a probe would scan: nprobe clusters of N / nlist rows, or
    more to hold k x match_factor / sqrt(m / N) matches at the pool's density m / N; else "probe"."""
    limit = manifest["filter"]["postings"]["limit"]
    search = manifest["search"]
    node = parse(f)
    conj = node.children if type(node).__name__ == "And" else [node]
    rare = [c for c in conj if type(c).__name__ == "Term" and int(fwd.term_mask(c.feature, list(c.values)).sum()) <= limit]
    if rare:
        return "posting"
    m = int(fwd.evaluate(f).sum())
    return "whole" if m * search["exact_cost_ratio"] <= _probe_rows(m, search, k, nprobe) else "probe"


def _probe_rows(m, search, k, nprobe):
    density = max(m, 1e-9) / N
    return max(nprobe * (N // NLIST), k * search["match_factor"] / math.sqrt(density) / density)


def _boundary(manifest, k, nprobe):
    """The m at which m x ratio equals the probe's rows (the model's switch point), by bisection."""
    search = manifest["search"]
    lo, hi = 1.0, float(N)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * search["exact_cost_ratio"] <= _probe_rows(mid, search, k, nprobe) else (lo, mid)
    return lo


@pytest.mark.parametrize("k,nprobe", [(10, 4), (100, 8), (400, 2)])
def test_route_choice_matches_an_independent_cost_model(built, k, nprobe):
    _, _, manifest, plan, fwd, _ = built
    routes = _route(built, k, nprobe)
    boundary = _boundary(manifest, k, nprobe)
    for f, r in zip(CONJUNCTIONS, routes):
        want = _cost_model_route(f, fwd, manifest, k, nprobe)
        m = int(fwd.evaluate(f).sum())
        if want != "posting" and 0.7 * boundary < m < 1.4 * boundary:
            continue  # the estimate (independent features) may fall on either side of the boundary
        if want == "posting":
            assert r == ROUTE_POSTING, f
        elif want == "whole":
            assert r == ROUTE_WHOLE_POOL, (f, m, boundary)
        else:  # probed unless even the probe candidates hold too few matches (filter_plan's own switch)
            assert r == ROUTE_PROBED, (f, m, boundary)


def test_estimates_are_close_to_exact_counts_for_independent_features(built):
    _, _, _, plan, fwd, _ = built
    est = compile_estimates(CONJUNCTIONS, plan)
    for f, e in zip(CONJUNCTIONS, est):
        m = int(fwd.evaluate(f).sum())
        if "rare" in f or m == 0:
            continue
        assert 0.6 * m <= e <= 1.6 * m, (f, m, e)


@pytest.mark.parametrize("rescore", [False, True])
def test_one_filter_on_mixed_routes_answers_every_query(rescore):
    """Queries sharing a filter but routed differently in one batch (probed, whole pool): each whole-pool
    query answers as it does when the whole batch goes by the whole pool. The probed queries' identical
    program and lists once made one of them the whole-pool queries' representative, which the exact scan
    skips: those queries came back empty. C++ op, torch fallback and the Triton composition alike."""
    from silverrec.filtering.filter_program import FilterPlan, compile_request
    from silverrec.kernels.filtered_ivf_search import filtered_ivf_search_cuda, filtered_ivf_search_torch
    from silverrec.kernels.rescore_rows import RESCORE_MAX_K, rescore_margin
    from silverrec.publish.filtered_ivf import build_filtered_ivf
    from silverrec.publish.ivf import IVFConfig
    from silverrec.publish.pool import Pool
    from silverrec.retrieval.filtered_ivf import MODE_PROBED, MODE_UNPROBED
    from tests.reference_kernels import cpp_and_reference as _both_paths

    rng = np.random.default_rng(3)
    n, d = 3000, 16
    x = rng.normal(size=(n, d)).astype(np.float32)
    feats = {"shade": [[f"s{v}"] for v in rng.integers(0, 6, n)], "size": [[f"z{v}"] for v in rng.integers(0, 4, n)]}
    m, manifest = build_filtered_ivf(Pool(np.arange(n, dtype=np.int64), x, feats), IVFConfig(nlist=20))
    program = list(compile_request(["shade = s1 AND size = z2"] * 4, FilterPlan.from_config(manifest["filter"])))
    q = torch.from_numpy(rng.normal(size=(4, d)).astype(np.float32))
    k = 10
    margin = (rescore_margin(k), RESCORE_MAX_K) if rescore else (0, 0)

    def search(fn, modes):
        return fn(*m.filtered_search_args(q, program, torch.tensor(modes), k, 3, 9, *margin))

    whole = search(torch.ops.silverrec.filtered_ivf_search, [MODE_UNPROBED] * 4)
    assert (whole[1] >= 0).all()
    mixed = [MODE_PROBED, MODE_UNPROBED, MODE_PROBED, MODE_UNPROBED]
    for got in (*_both_paths(lambda: search(filtered_ivf_search_torch, mixed)), search(filtered_ivf_search_cuda, mixed),
                search(torch.ops.silverrec.filtered_ivf_search, mixed)):
        assert torch.equal(got[1][1::2], whole[1][1::2])
        torch.testing.assert_close(got[0][1::2], whole[0][1::2])
