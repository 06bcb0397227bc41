"""Posting lists: publish-side lists, compile-side superset choice, and the posting route of the search."""

import numpy as np
import pytest
import torch

from silverrec.filtering.filter_lang import parse
from silverrec.filtering.filter_program import FilterPlan, compile_lists, compile_request, posting_lists
from silverrec.kernels.constants import NO_LISTS, ROUTE_POSTING, ROUTE_PROBED, ROUTE_WHOLE_POOL
from silverrec.retrieval.filtered_ivf import MODE_AUTO, MODE_PROBED, MODE_UNPROBED, FilteredIVFIndex
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.publish.filtered_ivf import build_filtered_ivf, pool_rows
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.postings import build_postings
from tests.test_filter_ivf import _exact_filtered, _pool

FILTERS = [
    "rare = r7",
    "rare IN (r7, r8, r9) AND country = c1",
    "country = c3 AND (rare = r1 OR tag = t4)",  # tag is frequent: no superset from the OR
    "(rare = r1 OR rare = r2) AND NOT lang = l3",
    "rare IN (r5, nowhere) AND tag = t9",
    "rare = nowhere",  # matches nothing: an empty superset
    "NOT rare = r7",
    "country = c0",
    None,
]


@pytest.fixture(scope="module")
def built():
    pool, rng = _pool(seed=1)
    module, manifest = build_filtered_ivf(pool, IVFConfig(nlist=100, seed=0))
    plan = FilterPlan.from_config(manifest["filter"])
    fwd = ForwardIndex.from_lists(pool.features).permute(pool_rows(pool, module.row_to_item))
    queries = torch.from_numpy(pool.embeddings[rng.integers(0, len(pool.item_ids), len(FILTERS))])
    return module, manifest, plan, fwd, queries


def test_lists_hold_exactly_the_rows_of_their_token(built):
    module, manifest, _, fwd, _ = built
    limit = manifest["filter"]["postings"]["limit"]
    off, rows = module.post_offsets, module.post_rows
    for f, meta in manifest["filter"]["features"].items():
        for v, (lid, count) in enumerate(zip(meta["postings"], meta["counts"])):
            want = fwd.term_mask(f, [meta["values"][v]]).nonzero().reshape(-1)
            assert count == want.numel()
            assert (lid >= 0) == (count <= limit), (f, v)
            if lid >= 0:
                assert torch.equal(rows[off[lid] : off[lid + 1]].long(), want), (f, v)  # ascending rows


def test_compiled_lists_are_a_superset_of_the_exact_answer(built):
    module, _, plan, fwd, _ = built
    lists = compile_lists(FILTERS, plan)
    assert lists[FILTERS.index(None), 0] == NO_LISTS
    assert lists[FILTERS.index("NOT rare = r7"), 0] == NO_LISTS
    assert lists[FILTERS.index("country = c0"), 0] == NO_LISTS  # 30% of the pool: no list
    assert lists[FILTERS.index("rare = nowhere")].tolist() == [-1] * lists.shape[1]  # empty superset
    for b, f in enumerate(FILTERS):
        if lists[b, 0] == NO_LISTS:
            continue
        union = torch.zeros(module.num_items, dtype=torch.bool)
        for lid in lists[b][lists[b] >= 0].tolist():
            union[module.post_rows[module.post_offsets[lid] : module.post_offsets[lid + 1]].long()] = True
        exact = fwd.evaluate(f)
        assert not (exact & ~union).any(), f
        assert int(union.sum()) <= posting_lists(parse(f), plan)[1]


def test_and_takes_the_cheapest_child(built):
    _, _, plan, _, _ = built
    a = posting_lists(parse("rare = r7 AND rare IN (r1, r2, r3)"), plan)
    assert a == posting_lists(parse("rare = r7"), plan)
    assert posting_lists(parse("country = c1 OR rare = r7"), plan) is None


def test_posting_route_equals_whole_pool_route(built):
    """Same answers from the posting lists and from filtering the whole pool (posting_limit 0)."""
    module, _, plan, fwd, queries = built
    whole = FilteredIVFIndex.from_ivf(module, module.bits, post_rows=module.post_rows, post_offsets=module.post_offsets, posting_limit=0)
    inputs = compile_request(FILTERS, plan)
    modes = torch.full((len(FILTERS),), MODE_UNPROBED)
    with torch.inference_mode():
        _, _, route = module.plan_probes(queries, list(inputs), modes, 20, 4, 16)
        s1, i1 = module(queries, 20, 4, *inputs, 16, modes)
        s2, i2 = whole(queries, 20, 4, *inputs, 16, modes)
    has_lists = inputs[4][:, 0] != NO_LISTS
    assert torch.equal(route == ROUTE_POSTING, has_lists)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(s1, s2)
    truth = _exact_filtered(module, fwd, queries, FILTERS, 20)
    for b in range(len(FILTERS)):  # exact: every feature here has value-code planes except tag
        if "tag" not in (FILTERS[b] or ""):
            assert [i for i in i1[b].tolist() if i >= 0] == truth[b], FILTERS[b]


def test_probed_mode_never_takes_the_posting_route(built):
    module, _, plan, _, queries = built
    inputs = compile_request(FILTERS, plan)
    for mode, want_posting in ((MODE_PROBED, False), (MODE_AUTO, True)):
        modes = torch.full((len(FILTERS),), mode)
        with torch.inference_mode():
            _, _, route = module.plan_probes(queries, list(inputs), modes, 20, 4, 16)
        assert bool((route == ROUTE_POSTING).any()) == want_posting


def test_build_postings_respects_the_limit():
    fwd = ForwardIndex.from_lists({"g": [["a"], ["a", "b"], ["c"], ["a"]], "h": [["x"], [], ["x"], ["y"]]})
    rows, off, meta = build_postings(fwd, limit=2)
    assert meta["g"] == {"postings": [-1, 0, 1], "counts": [3, 1, 1]}
    assert meta["h"] == {"postings": [2, 3], "counts": [2, 1]}
    assert off.tolist() == [0, 1, 2, 4, 5]
    assert rows.tolist() == [1, 2, 0, 2, 3]
    assert rows.dtype == torch.int32 and np.all(np.diff(off.numpy()) >= 0)


@pytest.mark.parametrize("k, nprobe, max_probe", [(20, 4, 16), (100, 1, 100), (5, 8, 8)])
def test_filter_plan_cpu_equals_torch(built, k, nprobe, max_probe):
    """The fused C++ routing makes exactly the torch reference's decisions (all modes, all routes)."""
    from tests.reference_kernels import cpp_and_reference as _both_paths

    module, _, plan, _, queries = built
    filters = FILTERS * 3
    q = queries.repeat(3, 1) + 0.1 * torch.randn(len(filters), queries.shape[1], generator=torch.Generator().manual_seed(k))
    inputs = compile_request(filters, plan)
    modes = torch.arange(len(filters)) % 3
    (p1, m1, r1), (p2, m2, r2) = _both_paths(lambda: module.plan_probes(q, list(inputs), modes, k, nprobe, max_probe))
    assert torch.equal(r1, r2) and torch.equal(p1, p2) and torch.equal(m1, m2)
    assert set(r1.tolist()) == {ROUTE_PROBED, ROUTE_WHOLE_POOL, ROUTE_POSTING}


@pytest.mark.parametrize("nprobe, max_probe", [(4, 16), (3, 3), (6, 90)])  # insertion / selection of the candidates
def test_filter_plan_of_unfiltered_probed_queries_equals_torch(built, nprobe, max_probe):
    """A batch of probed queries without a filter: the C++ plan selects only the nprobe best
    centroids (no counts, no mask), the same probes as the reference's first nprobe of max_probe."""
    from tests.reference_kernels import cpp_and_reference as _both_paths

    module, _, plan, _, queries = built
    max_probe = min(max_probe, module.nlist)
    q = queries.repeat(4, 1) + 0.1 * torch.randn(4 * len(queries), queries.shape[1], generator=torch.Generator().manual_seed(5))
    inputs = compile_request([None] * len(q), plan)
    modes = torch.full((len(q),), MODE_PROBED)
    (p1, _, r1), (p2, _, r2) = _both_paths(lambda: module.plan_probes(q, list(inputs), modes, 20, nprobe, max_probe))
    assert torch.equal(r1, r2) and torch.equal(p1, p2)
    assert bool((p1[:, :nprobe] >= 0).all()) and bool((p1[:, nprobe:] == -1).all())
    best = torch.topk(q @ module.centroids.T, nprobe, dim=1).indices  # independent: the nprobe nearest centroids
    assert [set(a) for a in p1[:, :nprobe].tolist()] == [set(b) for b in best.tolist()]


@pytest.mark.parametrize("per", [2, 3])
def test_one_program_per_request_of_several_queries(built, per):
    """Programs given once per request of `per` consecutive queries (a request's task queries) ==
    the same programs repeated per query, through the C++ op and the composition alike."""
    from silverrec.kernels.filtered_ivf_search import filtered_ivf_search_torch
    from tests.reference_kernels import cpp_and_reference as _both_paths

    module, _, plan, _, queries = built
    filters = FILTERS
    q = queries.repeat_interleave(per, 0) + 0.1 * torch.randn(len(filters) * per, queries.shape[1],
                                                               generator=torch.Generator().manual_seed(per))
    inputs = compile_request(filters, plan)
    modes = torch.arange(len(filters)) % 3
    repeated = [x.repeat_interleave(per, 0) for x in inputs]
    args = module.filtered_search_args(q, list(inputs), modes, 20, 4, 16)
    with torch.inference_mode():
        want = module.filtered_search(q, repeated, modes.repeat_interleave(per, 0), 20, 4, 16)
        got = torch.ops.silverrec.filtered_ivf_search(*args)
        composed, composed_torch = _both_paths(lambda: filtered_ivf_search_torch(*args))
    for other in (got, composed, composed_torch):
        assert torch.equal(want[1], other[1]) and torch.equal(want[0], other[0])
    assert (want[1] >= 0).any()


@pytest.mark.parametrize("k, nprobe, max_probe", [(20, 4, 16), (7, 2, 2), (150, 8, 40)])
def test_fused_search_equals_the_composition_of_its_ops(built, k, nprobe, max_probe):
    """silverrec::filtered_ivf_search on CPU (one C++ call) == the composition of the per-step ops
    (with their C++ kernels, and with the reference kernels in their place), bit for bit, over all modes and routes."""
    from silverrec.kernels.filtered_ivf_search import filtered_ivf_search_torch
    from tests.reference_kernels import cpp_and_reference as _both_paths

    module, _, plan, _, queries = built
    filters = FILTERS * 3
    q = queries.repeat(3, 1) + 0.1 * torch.randn(len(filters), queries.shape[1], generator=torch.Generator().manual_seed(k))
    inputs = compile_request(filters, plan)
    modes = torch.arange(len(filters)) % 3
    args = module.filtered_search_args(q, list(inputs), modes, k, nprobe, max_probe)
    with torch.inference_mode():
        fused = module(q, k, nprobe, *inputs, max_probe, modes)
        composed, composed_torch = _both_paths(lambda: filtered_ivf_search_torch(*args))
    for other in (composed, composed_torch):
        assert torch.equal(fused[1], other[1])
        assert torch.equal(fused[0], other[0])
    assert (fused[1] >= 0).any()
