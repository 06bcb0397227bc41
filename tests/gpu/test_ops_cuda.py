"""Every silverrec op on CUDA tensors (its Triton kernel or CUDA composition) against the op on CPU:
integer outputs (rows, probes, routes, masks, keys, item ids) bit-exact, float outputs (scores,
attention) within device.FLOAT_TOL. The filtered search's ops and the decode's ops are replayed
with the real inputs of a CPU forward (device.RecordOps); the others get random inputs."""

import numpy as np
import pytest
import torch

from silverrec.filtering.filter_program import FilterPlan, compile_request
from silverrec.kernels.filtered_ivf_search import filtered_ivf_search_torch
from silverrec.kernels.constants import NO_LISTS
from silverrec.kernels.rescore_rows import RESCORE_MAX_K
from silverrec.publish.filtered_ivf import build_filtered_ivf
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.quantize import quantize_global
from silverrec.generative.generative import GenerativeRetrieval
from silverrec.generative.trie import ValidPathTrie
from silverrec.bitmask import pack_bits
from silverrec.serving.device import to_device

from ..reference_beam_search import random_decoder, random_histories, random_paths
from ..test_bloom_filter import _random_bank, _random_programs
from ..test_filter_ivf import _pool
from ..test_postings import FILTERS
from .device import RecordOps, assert_ranking_close, assert_same

SEARCH_OPS = {"filter_plan", "ivf_scan", "verify_topk", "filtered_topk", "rows_to_items", "filtered_ivf_search"}
RANKED = {"rescore_rows", "filtered_ivf_search"}  # re-scored in float32: compared as rankings
DECODE_OPS = {"staged_attention", "beam_topk"}


def _replay(calls, device, names):
    """Each recorded call of an op in `names` run on `device` == its CPU output; -> names seen."""
    seen = set()
    for func, args, kwargs, want in calls:
        name = func.__name__.split(".")[0]
        if name not in names:
            continue
        seen.add(name)
        assert_same(func(*to_device(args, device), **to_device(kwargs, device)), want, name)
    return seen


@pytest.fixture(scope="module", params=[True, False], ids=["residual", "direct"])
def search_calls(request):
    """The ops of the filtered search, recorded on CPU over every route (probed, whole pool, posting
    lists), for residual and direct codes: the fused op (the index's forward) and the composition of
    the per-step ops; then both again with the float re-score (k + margin rows scanned, re-scored to k),
    -> (calls without the re-score, calls with it)."""
    pool, rng = _pool(seed=1)
    module, manifest = build_filtered_ivf(pool, IVFConfig(nlist=100, seed=0, residual=request.param))
    assert module.residual == request.param
    plan = FilterPlan.from_config(manifest["filter"])
    filters = FILTERS * 2
    q = torch.from_numpy(pool.embeddings[rng.integers(0, len(pool.item_ids), len(filters))])
    inputs = compile_request(filters, plan)
    modes = torch.arange(len(filters)) % 3
    plain, rescored = RecordOps(), RecordOps()
    with torch.inference_mode():
        for k, nprobe, max_probe, margin in [(20, 4, 16, 0), (150, 8, 40, 0), (20, 4, 16, 8), (150, 8, 40, 16)]:
            args = module.filtered_search_args(q, list(inputs), modes, k, nprobe, max_probe, margin,
                                               RESCORE_MAX_K if margin else 0)
            with plain if margin == 0 else rescored:
                if margin == 0:
                    module(q, k, nprobe, *inputs, max_probe, modes)
                else:
                    torch.ops.silverrec.filtered_ivf_search(*args)
                filtered_ivf_search_torch(*args)
    return plain.calls, rescored.calls


def test_filtered_search_ops(search_calls, cuda):
    assert _replay(search_calls[0], cuda, SEARCH_OPS) == SEARCH_OPS


def test_rescored_search_ops(search_calls, cuda):
    """With the float re-score: the steps before it bit-exact, the re-scored rankings (float32 sums in
    another order on the device) equal up to ties within the tolerance."""
    calls = search_calls[1]
    exact = SEARCH_OPS - RANKED
    assert _replay(calls, cuda, exact) == exact
    ranked = [(func, args, kwargs, want) for func, args, kwargs, want in calls if func.__name__.split(".")[0] in RANKED]
    assert {func.__name__.split(".")[0] for func, *_ in ranked} == RANKED
    for func, args, kwargs, (want_scores, want_ids) in ranked:
        got_scores, got_ids = func(*to_device(args, cuda), **to_device(kwargs, cuda))
        assert_ranking_close(got_ids, got_scores, want_ids, want_scores)
        assert (want_ids >= 0).any()


def test_decode_ops(cuda):
    sizes = [8, 6, 5, 3]
    paths = random_paths(160, sizes, seed=1)
    trie = ValidPathTrie(paths, sizes)
    module = GenerativeRetrieval(random_decoder(sizes, seed=3), trie, torch.arange(trie.n_items), 24, 5).eval()
    hist = random_histories(paths, sizes, 4, 6, seed=4)
    bits = pack_bits(torch.rand(4, trie.n_items) < 0.5)
    recorder = RecordOps()
    with torch.inference_mode(), recorder:
        module(hist, bits)
    assert _replay(recorder.calls, cuda, DECODE_OPS) == DECODE_OPS


@pytest.mark.parametrize("k", [1, 100, 1000])
def test_exact_index_search(cuda, k):
    """The exact index (the IVF with one cluster: silverrec::ivf_search) on the device == the C++ op on CPU."""
    from silverrec.retrieval.ivf_index import Int8IVFIndex

    gen = torch.Generator().manual_seed(k)
    x = torch.randn(5000, 67, generator=gen)
    q = torch.randn(19, 67, generator=gen)
    codes, scale, offset = quantize_global(x)
    index = Int8IVFIndex(codes, scale, offset, torch.tensor([0, 5000]), torch.zeros(1, 67), torch.arange(5000))
    args = index.search_args(q, k, 1)
    assert_same(torch.ops.silverrec.ivf_search(*to_device(args, cuda)), torch.ops.silverrec.ivf_search(*args), "ivf_search")


@pytest.mark.parametrize("b, p, n", [(1, 1, 1), (19, 4, 3)])
def test_bloom_filter(cuda, b, p, n):
    gen = torch.Generator().manual_seed(b)
    bits = _random_bank(37, 23, gen)
    ops, rows = _random_programs(b, 12, 5, 37, gen)
    starts = torch.randint(-1, 23, (b, p), generator=gen)
    args = (bits, ops, rows, starts, n)
    assert_same(torch.ops.silverrec.bloom_filter(*to_device(args, cuda)), torch.ops.silverrec.bloom_filter(*args),
                "bloom_filter")


@pytest.mark.parametrize("residual", [False, True])
def test_filtered_topk_over_many_tiles_every_run(cuda, residual):
    """filtered_topk over 100k rows, many 64-row tiles per program, both routes (even queries the whole pool,
    odd ones two posting lists), direct and residual codes, five runs on the device == the CPU op every time.
    It passed on an H200 with the stack race of kernels/bloom_filter_triton.py too (that race showed in
    benchmarks/filter.py --device cuda; tests/test_bloom_filter.py checks the barriers in the compiled code)."""
    n, d, b = 100_000, 96, 16
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (n, d), dtype=torch.int8, generator=gen)
    queries = torch.randn(b, d, generator=gen)
    bank = _random_bank(11, (n + 63) // 64, gen)
    ops, prog_rows = _random_programs(b, 7, 3, 11, gen)
    lists = [torch.randperm(n, generator=gen)[:m].sort().values for m in (9000, 24000, 3000)]
    post_rows = torch.cat(lists).to(torch.int32)
    post_offsets = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
    sel = torch.full((b, 3), -1, dtype=torch.int64)
    sel[::2, 0] = NO_LISTS  # the whole pool
    sel[1::2, :2] = torch.tensor([0, 1])
    args = (queries, codes, torch.tensor(0.05), torch.tensor(-0.2), bank, [ops, prog_rows], [post_rows, post_offsets, sel],
            torch.ones(b, dtype=torch.bool), 100, n, [])
    if residual:  # 300 clusters of ragged sizes, the queries' own cluster terms
        gen = torch.Generator().manual_seed(6)
        cuts = torch.randint(0, n, (299,), generator=gen).sort().values
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.full((1,), n)])
        args = (*args[:-1], [offsets, torch.randn(300, d, generator=gen), queries])
    want = torch.ops.silverrec.filtered_topk(*args)
    assert int((want[1] >= 0).all(dim=1).sum()) >= 4  # programs passing more than k rows
    for _ in range(5):
        assert_same(torch.ops.silverrec.filtered_topk(*to_device(args, cuda)), want, "filtered_topk")


def test_bloom_filter_counts(cuda):
    gen = torch.Generator().manual_seed(7)
    bits = _random_bank(19, 12, gen)
    ops, rows = _random_programs(6, 10, 4, 19, gen)
    lo = torch.randint(0, 64 * 12 - 17, (6, 4), generator=gen)
    hi = (lo + torch.randint(-3, 64 * 5 + 40, (6, 4), generator=gen)).clamp(max=64 * 12 - 17)
    lo[1] = -1  # a query without windows
    args = (bits, ops, rows, lo, hi, 5)
    assert_same(torch.ops.silverrec.bloom_filter_counts(*to_device(args, cuda)),
                torch.ops.silverrec.bloom_filter_counts(*args), "bloom_filter_counts")


def test_merge_attention_states(cuda):
    gen = torch.Generator().manual_seed(0)
    v_a, v_b = torch.randn(2, 37, 4, 16, generator=gen)
    s_a, s_b = torch.randn(2, 37, 4, generator=gen)
    s_b[:5] = float("-inf")  # empty stages
    args = (v_a, s_a, v_b, s_b)
    assert_same(torch.ops.silverrec.merge_attention_states(*to_device(args, cuda)),
                torch.ops.silverrec.merge_attention_states(*args), "merge_attention_states")


def test_rows_to_items(cuda):
    row_to_item = torch.from_numpy(np.random.default_rng(0).permutation(1000).astype(np.int64) * 7 + 3)
    rows = torch.randint(-1, 1000, (9, 31))
    assert_same(torch.ops.silverrec.rows_to_items(row_to_item.to(cuda), rows.to(cuda)),
                torch.ops.silverrec.rows_to_items(row_to_item, rows), "rows_to_items")


def test_ivf_index_forward_is_captured(cuda):
    """Int8IVFIndex's forward on the device replays from a CUDA graph (its scan reads no cluster size
    from the device: `window_words`) and equals the CPU forward."""
    import copy

    from silverrec.publish.ivf import build_ivf
    from silverrec.serving.cuda_graphs import EAGER, GraphedForward, capture_cuda_graph, capture_eager

    pool, rng = _pool(seed=2)
    index, _ = build_ivf(pool, IVFConfig(nlist=50, seed=0))
    graphed = GraphedForward(copy.deepcopy(index).to(cuda), capture=capture_cuda_graph if cuda.type == "cuda" else capture_eager)
    q = torch.from_numpy(pool.embeddings[rng.integers(0, len(pool.item_ids), 8)])
    for queries in (q, q.flip(0) * 0.9, q.roll(1, 0) * 1.1):  # eager, capture, replay on new inputs
        want = index(queries, 30, 8)
        got = graphed(queries.to(cuda), 30, 8)
        assert_same(tuple(t.cpu() for t in got), want, "Int8IVFIndex.forward")
    assert graphed.captures == 1 and not any(e is EAGER for e in graphed.graphs.values())


def test_candidate_rows(cuda):
    """The retrieval tail on the device (the torch composition) == the C++ op on CPU (integer-valued
    queries and embeddings: every sum exact, so equal rows whatever the summation order)."""
    from ..test_candidate_rows import _case

    q, found, ex, emb = _case(3, 4, 2, 40, 16, 60, 9)
    for intersection in (False, True):
        args = (q, found, ex, emb, 20, 30, intersection)
        assert_same(torch.ops.silverrec.candidate_rows(*to_device(args, cuda)),
                    torch.ops.silverrec.candidate_rows(*args), "candidate_rows")


def test_mol_score(cuda):
    """The MoL pair scores on the device (gather + mol_pair_scores) == the C++ op on CPU."""
    from ..test_mol_score import _args, _setup

    arch, user, rows, emb, ranker = _setup(2, 3, 40, 2, 32, 3, 50, dtype=torch.bfloat16)
    args = _args(arch, user, rows, emb, ranker)
    assert_same(torch.ops.silverrec.mol_score(*to_device(args, cuda)), torch.ops.silverrec.mol_score(*args), "mol_score")
