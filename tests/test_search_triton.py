"""The fused CUDA searches (kernels/search_triton.py, kernels/probe_triton.py) under TRITON_INTERPRET=1 against the
C++ ops: the same item ids bit for bit, scores within float32 summation order (the per-query constant <q,
dim_offset> and the float re-score are summed in the kernels' order), on batches that take every route
(probed, widened, whole pool, posting lists), k above the matches, residual codes, the float re-score with
an exact route passing few rows and one passing many, a request's task queries sharing its program, and the
plain search. The probe's candidates and the folded query's int8 codes are the CPU's, ties included.
"""

from __future__ import annotations

import pytest
import torch

from silverrec.kernels.common import centroid_scores, quantize_queries
from silverrec.kernels.constants import MODE_AUTO, MODE_PROBED, MODE_UNPROBED, NO_LISTS, OP_AND, OP_PUSH, OP_TRUE, ROUTE_POSTING, ROUTE_PROBED, ROUTE_WHOLE_POOL
from silverrec.kernels.filter_plan import checked_args, filter_plan_torch
from silverrec.kernels.ivf_scan import bitmask_words
from silverrec.kernels.rescore_rows import RESCORE_MAX_K, rescore_margin
from tests.test_filter_plan_triton import BATCH, PARAMS, recorded_ops, search_case, search_inputs

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's numpy: target = inf
from silverrec.kernels import search_triton  # noqa: E402
from silverrec.kernels.probe_triton import probe_triton  # noqa: E402


def _assert_same(got, want):
    """Item ids bit for bit; scores up to float32 summation order (-inf padding where the ids pad)."""
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


def _cpu(inputs):
    return torch.ops.silverrec.filtered_ivf_search(*inputs)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rescore", [False, True])
def test_fused_search_equals_cpu_op(residual, rescore):
    """One batch holding posting, probed (some widened) and whole-pool queries, k above the matches."""
    k, nprobe, max_probe, match_factor, ratio, limit = PARAMS[0]
    case, n = search_case(seed=BATCH * 31 + k)
    margin = (rescore_margin(k), RESCORE_MAX_K) if rescore else (0, 0)
    inputs = search_inputs(case, n, k, nprobe, max_probe, match_factor, ratio, limit, residual, margin)
    _, _, route = filter_plan_torch(*checked_args(*inputs[:9]))
    assert set(route.tolist()) == {ROUTE_PROBED, ROUTE_WHOLE_POOL, ROUTE_POSTING}
    want = _cpu(inputs)
    assert bool((want[1] < 0).any())  # k above the matches somewhere: padding
    _assert_same(search_triton.fused_filtered_search(*inputs), want)


@pytest.mark.parametrize("params", PARAMS[1:])
def test_fused_search_under_other_plans_equals_cpu_op(params):
    """Widened to every candidate, whole pool by the target or the cost switch, posting lists never too long."""
    k, nprobe, max_probe, match_factor, ratio, limit = params
    case, n = search_case(seed=BATCH * 31 + k)
    inputs = search_inputs(case, n, k, nprobe, max_probe, match_factor, ratio, limit, k % 2 == 0, (0, 0))
    _assert_same(search_triton.fused_filtered_search(*inputs), _cpu(inputs))


def _large_case(seed: int, residual: bool):
    """A pool of 3000 rows in 10 clusters of up to 600 (probed tiles of 64 rows, several per cluster), D = 12,
    and 6 queries: two whole-pool ones passing ~1500 rows (more than EXACT_FLOAT_ROWS) and ~300 (fewer), a
    posting-list query with ~500 positions (eight tiles), three probed ones (all rows; half of them)."""
    g = torch.Generator().manual_seed(seed)
    n, d, sizes = 3000, 12, [600, 100, 450, 0, 300, 250, 500, 200, 350, 250]
    off = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(torch.tensor(sizes), 0)
    words = (n + 63) // 64
    half = torch.tensor([int("55" * 8, 16)] * words, dtype=torch.int64)  # every other row
    tenth = torch.where(torch.rand(words, 64, generator=g) < 0.1, 1, 0)
    tenth = (tenth << torch.arange(64)).sum(1)
    bits = torch.stack([half, tenth, torch.full((words,), -1, dtype=torch.int64)])
    post_sizes = torch.tensor([500, 40, 0])
    post_offsets = torch.tensor([0, 500, 540])
    post_rows = torch.cat([torch.sort(torch.randperm(n, generator=g)[:500]).values,
                           torch.sort(torch.randperm(n, generator=g)[:40]).values]).to(torch.int32)
    index = [torch.randint(-128, 128, (n, d), dtype=torch.int8, generator=g), torch.rand(d, generator=g) * 0.1 + 0.01,
             torch.randn(d, generator=g) * 0.1, off, torch.randn(len(sizes), d, generator=g),
             (torch.randperm(n, generator=g) * 7 + 3).to(torch.int32), bits, post_rows, post_offsets, post_sizes]
    B, L = 6, 3
    ops = torch.zeros(B, L, dtype=torch.int64)
    rows = torch.zeros(B, L, 1, dtype=torch.int64)
    programs = [(OP_PUSH, 0), (OP_PUSH, 1), (OP_PUSH, 2), (OP_TRUE, 0), (OP_PUSH, 0), (OP_PUSH, 2)]
    for b, (op, r) in enumerate(programs):
        ops[b, 0], rows[b, 0, 0] = op, r
    vops, vrows = ops.clone(), rows.clone()
    vops[2, :3] = torch.tensor([OP_PUSH, OP_PUSH, OP_AND])  # the posting query verifies against `half` too
    vrows[2, 1, 0] = 0
    lists = torch.full((B, 2), -1, dtype=torch.int64)
    lists[:, 0] = NO_LISTS
    lists[2, 0] = 0
    mode = torch.tensor([MODE_UNPROBED, MODE_UNPROBED, MODE_AUTO, MODE_PROBED, MODE_PROBED, MODE_AUTO])
    queries = torch.randn(B, d, generator=g)
    params = [bitmask_words(off), int(residual), 4, n, 1000]
    return queries, index, params, [ops, rows, vops, vrows, lists], mode


@pytest.mark.parametrize("residual", [False, True])
def test_fused_search_over_many_rows_equals_cpu_op(residual):
    """Tiles past one per cluster, per word tile and per posting tile; an exact route over EXACT_FLOAT_ROWS rows
    (the int8 top k re-scored) beside one under it (all its rows re-scored; with the residual codes: the other
    pairings run in test_fused_search_equals_cpu_op, on fewer rows); few scan programs, so that their running
    top-k buffers are cut back many times, and many."""
    queries, index, params, program, mode = _large_case(7, residual)
    k = 20
    margin = (rescore_margin(k), RESCORE_MAX_K) if residual else (0, 0)
    inputs = (queries, index, params, 1e9, program, mode, k, 2, 6, *margin)
    _, _, route = filter_plan_torch(*checked_args(*inputs[:9]))
    assert route.tolist() == [ROUTE_WHOLE_POOL, ROUTE_WHOLE_POOL, ROUTE_POSTING, ROUTE_PROBED, ROUTE_PROBED,
                              ROUTE_PROBED]
    want = _cpu(inputs)
    for programs in (1, 8):
        search_triton.TARGET_PROGRAMS, saved = programs * queries.shape[0], search_triton.TARGET_PROGRAMS
        try:
            _assert_same(search_triton.fused_filtered_search(*inputs), want)
        finally:
            search_triton.TARGET_PROGRAMS = saved


def test_task_queries_share_their_request_program():
    """Two queries per request (a request's task heads, rows 2b and 2b + 1) with one program and mode each."""
    k, nprobe, max_probe, match_factor, ratio, limit = PARAMS[0]
    (queries, index, program, mode), n = search_case(seed=5)
    half = BATCH // 2
    program = [t[:half] for t in program]
    inputs = search_inputs((queries, index, program, mode[:half]), n, k, nprobe, max_probe, match_factor, ratio,
                           limit, False, (0, 0))
    _assert_same(search_triton.fused_filtered_search(*inputs), _cpu(inputs))


@pytest.mark.parametrize("residual, rescore", [(False, False), (True, True)])
def test_fused_plain_search_equals_cpu_op(residual, rescore):
    """silverrec::ivf_search: the probe's nprobe best clusters scanned, no filter."""
    queries, index, params, _, _ = _large_case(3, residual)
    k = 30
    inputs = (queries, index[:6], params[:2], k, 3, *((rescore_margin(k), RESCORE_MAX_K) if rescore else (0, 0)))
    want = torch.ops.silverrec.ivf_search(*inputs)
    _assert_same(search_triton.fused_ivf_search(*inputs), want)


@pytest.mark.parametrize("P", [1, 5, 24, 60])
def test_probe_selects_the_cpu_candidates_and_codes(P):
    """The best P of 300 centroids (tiles merged by the last program) in the reference's order, ties (integer
    scores, duplicated centroids, a -0.0 one) to the lower centroid; the folded query's int8 codes and scale
    bit for bit."""
    g = torch.Generator().manual_seed(P)
    C, D, B = 300, 7, 5
    centroids = torch.randint(-2, 3, (C, D), generator=g).float()
    centroids[[7, 19, 40, 299]] = centroids[3].clone()
    centroids[11] = -0.0
    queries = torch.randint(-2, 3, (B, D), generator=g).float()
    scale, offset = torch.rand(D, generator=g) + 0.5, torch.randn(D, generator=g)
    probe = probe_triton(queries, centroids, scale, offset, P, torch.zeros(B, dtype=torch.int32))
    want = torch.sort(centroid_scores(centroids, queries), dim=1, descending=True, stable=True).indices[:, :P]
    assert torch.equal(probe.cand, want)
    assert torch.equal(probe.scores, centroid_scores(centroids, queries))
    codes, qscale = quantize_queries(queries * scale)
    assert torch.equal(probe.qcodes, codes) and torch.equal(probe.qscale, qscale)
    torch.testing.assert_close(probe.constant, queries @ offset)


def test_sizes_beyond_the_kernels_run_the_composition(monkeypatch):
    """k past the scan programs' running top (MAX_KEYS, made small here so that the interpreter's composition
    stays quick): the op's CUDA path composes the ops' kernels."""
    from silverrec.kernels.filtered_ivf_search import filtered_ivf_search_cuda

    k = 20
    monkeypatch.setattr(search_triton, "MAX_KEYS", 16)
    case, n = search_case(seed=11)
    inputs = search_inputs(case, n, k, 1, 6, 2, 4.0, 100, False, (0, 0))
    assert search_triton.fused_filtered_search(*inputs) is None
    _assert_same(filtered_ivf_search_cuda(*inputs), _cpu(inputs))


def test_a_search_is_five_launches_a_plain_one_four():
    """Every device launch of the CUDA paths, recorded on CPU tensors: a memset and four kernels (the plain
    search: three), and nothing read back to the host."""
    from silverrec.kernels.filtered_ivf_search import filtered_ivf_search_cuda, ivf_search_cuda

    k, nprobe, max_probe, match_factor, ratio, limit = PARAMS[0]
    case, n = search_case(seed=BATCH * 31 + k)
    inputs = search_inputs(case, n, k, nprobe, max_probe, match_factor, ratio, limit, True, (rescore_margin(k), 256))
    for fn, args, want in ((filtered_ivf_search_cuda, inputs, 5), (ivf_search_cuda, (inputs[0], inputs[1][:6], inputs[2][:2], k, 2), 4)):
        with recorded_ops() as ops:
            fn(*args)
        names = [op for op, _ in ops]
        assert names.count("triton") == want - 1 and "_local_scalar_dense" not in names
        kernels = [op for op in names if op not in ("triton", "empty", "t", "slice", "select", "view", "expand",
                                                      "alias", "detach", "_to_copy", "lift_fresh")]
        assert kernels == ["zeros"], kernels  # the counters


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from silverrec.kernels import probe_triton as pt, search_triton as st

F32, I8, I32 = "*fp32", "*i8", "*i32"
kernels = {  # the types of the pointers that are not int64, and the constexprs of a filtered, re-scored search
    "probe": (pt._probe_kernel, dict(q_ptr=F32, cent_ptr=F32, scale_ptr=F32, offset_ptr=F32, qcode_ptr=I8,
              qscale_ptr=F32, const_ptr=F32, score_ptr=F32, counter_ptr=I32),
              dict(DB=128, BLOCK_C=128, SUB_C=64, PB=32, NTB=32)),
    "plan": (st._plan_kernel, dict(counter_ptr=I32, base="fp32", num_items_f="fp32", ratio="fp32"),
             dict(BLOCK_WORDS=16, BLOCK_T=16, PB=128)),
    "scan": (st._scan_kernel, dict(qcode_ptr=I8, codes_ptr=I8, qscale_ptr=F32, score_ptr=F32, post_rows_ptr=I32,
             fewcount_ptr=I32), dict(HAS_MASK=True, HAS_EXACT=True, RESIDUAL=True, FEW=True, KM=256, CAP=512, PB=128,
             TILE_N=64, TILE_W=64, BLOCK_D=128, BLOCK_T=16, NITER=12, CITER=12)),
    "finish": (st._finish_kernel, dict(fewcount_ptr=I32, qscale_ptr=F32, const_ptr=F32, score_ptr=F32, q_ptr=F32,
               codes_ptr=I8, dscale_ptr=F32, map_ptr=I32, fs_ptr=F32, out_s_ptr=F32),
               dict(KM=256, SB=16, LB=2048, KO=128, VERIFY=True, HAS_EXACT=True, FEW=True, RESCORE=True,
                    RESIDUAL=True, HAS_MAP=True, CITER=12)),
}
for name, (fn, types, consts) in kernels.items():
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "*i64" if n.endswith("_ptr") else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    print(name)
"""


def test_fused_kernels_compile_for_h100():
    """The interpreter runs any Python (and sorts with numpy): this compiles the four kernels as a filtered,
    re-scored search with residual codes launches them, to sm_90 PTX (Triton's own ptxas, no GPU)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["probe", "plan", "scan", "finish"]
