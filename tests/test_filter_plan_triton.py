"""The CUDA filter_plan (the fused search's probe and plan kernels, kernels/search_triton.py, under TRITON_INTERPRET=1,
conftest) makes exactly the C++ op's and filter_plan_torch's decisions.

Route, probes and bitmask are compared bit for bit on batches that hit every route (posting lists,
probed, probed and widened past nprobe, whole pool by either switch), modes 0/1/2, a program that
matches nothing, one that matches everything, and centroid score ties (integer-valued centroids
and queries, duplicated centroids).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from silverrec.kernels.constants import MODE_AUTO, MODE_PROBED, NO_LISTS, OP_FALSE, OP_TRUE, ROUTE_PROBED
from silverrec.kernels.filter_plan import checked_args, filter_plan_torch
from silverrec.kernels.ivf_scan import bitmask_words
from tests.test_cpu_scan import _programs
from tests.reference_kernels import cpp_and_reference as _both_paths

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's numpy: target = inf
from silverrec.kernels.filter_plan import filter_plan_cuda  # noqa: E402

SIZES = [90, 0, 130, 1, 64, 70, 45, 200, 33, 77, 150, 12]  # an empty and a one-row cluster
R, D = 9, 6
LISTS = [  # posting-list selections: none (whole pool), 10 rows, 540 rows (over every limit), an empty superset
    [NO_LISTS, -1, -1], [0, 4, -1], [1, 3, 2], [-1, -1, -1],
]
LAYOUT = [  # (mode, lists) per query of the batch; queries 0 and 1 match nothing / everything
    (0, 0), (0, 0), (0, 0), (0, 2), (0, 0), (0, 2), (0, 1), (0, 3), (1, 1), (1, 0), (2, 2), (2, 1),
]
BATCH = len(LAYOUT)


def planning_case(b: int, seed: int):
    """A synthetic index and batch: ((queries, centroids, off, bits, ops, rows, lists, post_sizes, mode), num_items)."""
    g = torch.Generator().manual_seed(seed)
    off = torch.zeros(len(SIZES) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(torch.tensor(SIZES), 0)
    n = int(off[-1])
    centroids = torch.randint(-2, 3, (len(SIZES), D), generator=g).float()
    centroids[[2, 5, 9]] = 5.0  # three equal best centroids for a query of ones: the lower cluster first
    queries = torch.randint(-2, 3, (b, D), generator=g).float()  # integer scores: many ties
    # sparse bank rows (AND of a few is selective) so targets are sometimes out of reach
    bits = torch.randint(-(2**63), 2**63 - 1, (R, (n + 63) // 64), generator=g)
    bits &= torch.randint(-(2**63), 2**63 - 1, bits.shape, generator=g)
    ops, rows = _programs(b, 7, 2, R, g)
    post_sizes = torch.tensor([3, 40, 0, 500, 7, 0])  # V = 5 lists + the trailing 0
    lists = torch.full((b, 3), -1, dtype=torch.int64)
    lists[:, 0] = NO_LISTS
    mode = torch.zeros(b, dtype=torch.int64)
    if b > 1:
        assert b == len(LAYOUT)
        ops[:2], rows[:2] = 0, 0
        ops[0, 0] = OP_FALSE  # matches nothing
        ops[1, 0] = OP_TRUE  # matches everything
        queries[1] = 1.0
        for i, (m, kind) in enumerate(LAYOUT):
            mode[i] = m
            lists[i] = torch.tensor(LISTS[kind])
    return (queries, centroids, off, bits, ops, rows, lists, post_sizes, mode), n


def index_tensors(off, centroids, bits, post_sizes, n, g=None):
    """The filtered index list the ops take (kernels/constants.py FILTERED_IVF_TENSORS) around a planning case's
    tensors: codes, ranges, item ids and posting rows made up (random with a generator, else zeros: the plan
    reads none of them)."""
    post_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(post_sizes[:-1], 0)])
    if g is None:
        return [torch.zeros(n, D, dtype=torch.int8), torch.ones(D), torch.zeros(D), off, centroids,
                torch.arange(n, dtype=torch.int32), bits, torch.zeros(int(post_offsets[-1]), dtype=torch.int32),
                post_offsets, post_sizes]
    codes = torch.randint(-128, 128, (n, D), dtype=torch.int8, generator=g)
    dim_scale, dim_offset = torch.rand(D, generator=g) * 0.1 + 0.01, torch.randn(D, generator=g) * 0.1
    row_to_item = (torch.randperm(n, generator=g) * 3 + 7).to(torch.int32)
    post_rows = torch.cat([torch.sort(torch.randperm(n, generator=g)[: int(s)]).values for s in post_sizes[:-1]]).to(torch.int32)
    return [codes, dim_scale, dim_offset, off, centroids, row_to_item, bits, post_rows, post_offsets, post_sizes]


def plan_inputs(case, n, k, nprobe, max_probe, match_factor, ratio, limit, residual=False):
    """silverrec::filter_plan's arguments for a planning case (the verify programs: the Bloom ones)."""
    queries, centroids, off, bits, ops, rows, lists, post_sizes, mode = case
    params = [bitmask_words(off), int(residual), match_factor, n, limit]
    return (queries, index_tensors(off, centroids, bits, post_sizes, n), params, ratio, [ops, rows, ops, rows, lists],
            mode, k, nprobe, max_probe)


PARAMS = [  # k, nprobe, max_probe, match_factor, exact_cost_ratio, posting_limit
    (5, 1, 6, 2, 4.0, 100),  # small targets: probed, widened by a few
    (40, 2, 12, 4, 1.5, 20),  # large targets: widened to all, whole pool by the target
    (3, 3, 3, 1, 0.05, 0),  # the cost switch sends probed queries to the whole pool; posting only for empty lists
    (10, 1, 8, 1, 1e9, 1000),  # never too costly
]


@pytest.mark.parametrize("params, b", [(p, BATCH) for p in PARAMS] + [(PARAMS[0], 1)])
def test_triton_plan_equals_cpu_and_torch(params, b):
    k, nprobe, max_probe, match_factor, ratio, limit = params
    case, n = planning_case(b, seed=b * 31 + k)
    inputs = plan_inputs(case, n, k, nprobe, max_probe, match_factor, ratio, limit)
    args = checked_args(*inputs)
    want = filter_plan_torch(*args)
    for got in _both_paths(lambda: torch.ops.silverrec.filter_plan(*inputs)):
        for g_, w in zip(got, want):
            assert torch.equal(g_, w)
    got = filter_plan_cuda(*inputs)
    for name, g_, w in zip(("probes", "bitmask", "route"), got, want):
        assert g_.dtype == w.dtype and torch.equal(g_, w), name


@pytest.mark.parametrize("max_probe", [24, 60])
def test_many_probes_with_tied_centroids_equal_torch(max_probe):
    """More candidate centroids than the insertion path keeps (plan.cpp kInsertMax): the C++ selection
    by sort keys gives the torch plan's centroids in its order, ties (integer scores, duplicate and
    zero-score centroids, -0.0 among them) to the lower centroid, with and without a filter."""
    g = torch.Generator().manual_seed(max_probe)
    C = 60
    sizes = torch.randint(0, 40, (C,), generator=g)
    off = torch.zeros(C + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(sizes, 0)
    n = int(off[-1])
    centroids = torch.randint(-2, 3, (C, D), generator=g).float()
    centroids[[7, 19, 40]] = centroids[3].clone()
    centroids[11] = -0.0
    queries = torch.randint(-2, 3, (3, D), generator=g).float()
    bits = torch.randint(-(2**63), 2**63 - 1, (R, (n + 63) // 64), generator=g)
    lists = torch.full((3, 3), -1, dtype=torch.int64)
    lists[:, 0] = NO_LISTS
    post_sizes = torch.tensor([3, 40, 0, 500, 7, 0])
    mode = torch.zeros(3, dtype=torch.int64)
    for filtered in (False, True):
        ops, rows = _programs(3, 7, 2, R, g)
        if not filtered:  # every query matches everything (TRUE programs)
            ops, rows = torch.zeros_like(ops), torch.zeros_like(rows)
            ops[:, 0] = OP_TRUE
            mode[:] = MODE_PROBED  # the plan's unmasked branch keeps nprobe centroids
        inputs = plan_inputs((queries, centroids, off, bits, ops, rows, lists, post_sizes, mode), n, 10, 20, max_probe, 2,
                             1e9, 100)
        want = filter_plan_torch(*checked_args(*inputs))
        for got in _both_paths(lambda: torch.ops.silverrec.filter_plan(*inputs)):
            assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])  # probes, route
            if filtered:
                assert torch.equal(got[1], want[1])  # the bitmask (none needed unfiltered)


def test_cases_hit_every_route():
    """The batches above exercise what they claim (guards the test against a fixture that drifts)."""
    routes, widened, tie_order = set(), False, False
    for k, nprobe, max_probe, match_factor, ratio, limit in PARAMS:
        case, n = planning_case(BATCH, seed=BATCH * 31 + k)
        probes, _, route = filter_plan_torch(*checked_args(*plan_inputs(case, n, k, nprobe, max_probe, match_factor,
                                                                        ratio, limit)))
        routes |= set(route.tolist())
        widened |= bool((((probes >= 0).sum(dim=1) > nprobe) & (case[8] == MODE_AUTO)).any())
        if route[1] == ROUTE_PROBED and nprobe >= 2:  # ties in order: cluster 2 before its duplicates 5 and 9
            assert probes[1, :2].tolist() == [2, 5]
            tie_order = True
    assert routes == {0, 1, 2} and widened and tie_order



def test_cost_switch_rounds_like_plan_cpp():
    """est_total = total x (num_items / cand_rows) with one float32 division on every path: here 22 x fl(13 / 22)
    = 12.999999 < 13 scanned rows, so the whole pool (`13 / t` in torch is reciprocal(t) x 13 = 13.000001: probed)."""
    off = torch.tensor([0, 13, 22])
    centroids = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    queries = torch.tensor([[1.0, 0.0]])  # cluster 0 first: 13 rows scanned at nprobe 1
    bits = torch.full((1, 1), -1, dtype=torch.int64)
    ops, rows = torch.tensor([[OP_TRUE]]), torch.zeros(1, 1, 1, dtype=torch.int64)  # all 22 rows match
    lists, post_sizes, mode = torch.tensor([[NO_LISTS]]), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    # k x match_factor = 5 <= 13: one probe reaches the target
    inputs = plan_inputs((queries, centroids, off, bits, ops, rows, lists, post_sizes, mode), 13, 5, 1, 2, 1, 1.0, 0)
    est = np.float32(22) * (np.float32(13) / np.float32(22))
    assert est < 13 < np.float32(22) * (np.float32(1) / np.float32(22) * np.float32(13))
    args = checked_args(*inputs)
    for _, _, route in (filter_plan_torch(*args), filter_plan_cuda(*inputs), *_both_paths(lambda: torch.ops.silverrec.filter_plan(*inputs))):
        assert route.tolist() == [1]


def search_case(seed: int):
    """filtered_ivf_search's tensors for the planning batch: (queries, index list with codes, folded ranges, item ids
    and posting lists, program list with verify programs stricter than the Bloom ones (program AND one more bank
    row: the verify step drops rows), mode), and num_items."""
    (queries, centroids, off, bits, ops, rows, lists, post_sizes, mode), n = planning_case(BATCH, seed)
    g = torch.Generator().manual_seed(seed)
    index = index_tensors(off, centroids, bits, post_sizes, n, g)
    b, length, width = rows.shape
    vops = torch.cat([ops, torch.tensor([[1, 2]]).expand(b, 2)], dim=1)  # ... PUSH AND
    extra = torch.zeros(b, 2, width, dtype=torch.int64)
    extra[:, 0] = torch.randint(0, R, (b, 1), generator=g)
    vrows = torch.cat([rows, extra], dim=1)
    return (queries, index, [ops, rows, vops, vrows, lists], mode), n


def search_inputs(case, n, k, nprobe, max_probe, match_factor, ratio, limit, residual, margin):
    """silverrec::filtered_ivf_search's arguments for a search case."""
    queries, index, program, mode = case
    params = [bitmask_words(index[3]), int(residual), match_factor, n, limit]
    return (queries, index, params, ratio, program, mode, k, nprobe, max_probe, *margin)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rescore", [False, True])
def test_search_of_triton_kernels_equals_cpu_op(residual, rescore):
    """The composition of the ops' CUDA kernels (filtered_ivf_search_cuda's path beyond the fused kernels' sizes,
    every step a Triton launcher) on CPU tensors == the C++ op,
    bit for bit, on one batch holding posting, probed and whole-pool queries, k above the matches, -1 probes;
    with residual codes too (every route adds the per-(query, cluster) term); with the float re-score (the
    exact routes' few passing rows all re-scored: filtered_topk for EXACT_FLOAT_ROWS + 1 rows on the device,
    ranked without the int8 scan by the C++ op; scores up to float32 summation order)."""
    from silverrec.kernels.filtered_ivf_search import compose_search, cuda_steps
    from silverrec.kernels.rescore_rows import RESCORE_MAX_K, rescore_margin

    k, nprobe, max_probe, match_factor, ratio, limit = PARAMS[0]
    case, n = search_case(seed=BATCH * 31 + k)
    margin = (rescore_margin(k), RESCORE_MAX_K) if rescore else (0, 0)
    inputs = search_inputs(case, n, k, nprobe, max_probe, match_factor, ratio, limit, residual, margin)
    probes, _, route = filter_plan_torch(*checked_args(*inputs[:9]))
    assert set(route.tolist()) == {0, 1, 2} and bool((probes[route == ROUTE_PROBED] < 0).any())
    want_s, want_i = torch.ops.silverrec.filtered_ivf_search(*inputs)
    assert bool((want_i < 0).any())  # k above the matches somewhere: padding
    got_s, got_i = compose_search(cuda_steps(), *inputs)
    assert torch.equal(got_i, want_i)
    if residual or rescore:  # the CUDA exact route shifts by every cluster's term, the CPU by the ones it visits
        torch.testing.assert_close(got_s, want_s)  # (cluster_bias); the re-score's sums differ in order
    else:
        assert torch.equal(got_s, want_s)


_COMPILE = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from silverrec.kernels import bloom_filter_triton as bf, ivf_scan_triton as iv, verify_topk_triton as vt

I64, I32 = "*i64", "i32"
kernels = {
    "verify_pass": (vt._verify_pass_kernel, [I64] * 4 + ["*i8", "*i32", I64] + [I32] * 5, {"BLOCK": 128}),
    "verify_place": (vt._verify_place_kernel, ["*fp32", I64, "*i8", "*i32", "*fp32", I64] + [I32] * 3,
                     {"BLOCK": 128, "BLOCK_T": 64}),
    "bloom_filter": (bf._bloom_filter_kernel, [I64] * 6 + [I32] * 5, {"BLOCK_W": 16}),
    "range_count": (bf._range_count_kernel, [I64] * 4 + [I32], {"BLOCK_W": 16}),
    "ivf_scan": (iv._ivf_scan_keys_kernel, ["*i8", "*i8"] + [I64] * 4 + [I32] * 11,
                 {"HAS_MASK": True, "BLOCK_N": 64, "BLOCK_D": 32}),  # int8 tl.dot: K >= 32 on NVIDIA
}
for name, (fn, types, consts) in kernels.items():
    names = fn.arg_names
    sig = dict(zip(names, types + ["constexpr"] * len(consts)))
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(name, " ".join(sorted(set(re.findall(r"(?:div|sqrt|fma)\.[a-z.]*f32", ptx)))))
"""


def test_kernels_compile_for_h100():
    """The interpreter runs any Python; this compiles the composition's kernels (bloom_filter_counts', verify_topk's,
    the masked ivf_scan; filtered_topk's: tests/test_filtered_topk_triton.py; the fused search's and its plan:
    tests/test_search_triton.py) to sm_90 PTX (no GPU needed: Triton's own ptxas)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {name: ops for name, _, ops in (line.partition(" ") for line in out.stdout.splitlines())}
    assert set(lines) == {"bloom_filter", "range_count", "verify_pass", "verify_place", "ivf_scan"}


@contextlib.contextmanager
def recorded_ops():
    """Yield a list collecting, in order, (aten op name, output shapes) of every tensor op run outside Triton
    launches, and ("triton", []) per launch: what a CUDA path issues, recorded on CPU tensors under
    TRITON_INTERPRET=1 (the interpreter's own copies inside a launch are not the CUDA path's)."""
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list = []
    inside = [False]
    launch = interpreter.GridExecutor.__call__

    def kernel(self, *args, **kwargs):
        ops.append(("triton", []))
        inside[0] = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            inside[0] = False

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not inside[0]:
                outs = out if isinstance(out, (tuple, list)) else [out]
                ops.append((func.overloadpacket.__name__, [tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)]))
            return out

    interpreter.GridExecutor.__call__ = kernel
    try:
        with Record():
            yield ops
    finally:
        interpreter.GridExecutor.__call__ = launch


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rescore", [False, True])
def test_cuda_search_has_no_host_sync_and_no_pool_sized_buffer(residual, rescore):
    """Every tensor op that the composition of the ops' CUDA kernels (the path beyond the fused kernels' sizes) runs
    outside the Triton kernels: none reads a value back to
    the host (`_local_scalar_dense`: .item(), int(), bool()), and none makes a per-query buffer over the pool
    ([B, N] scores or masks, [B, W] bank words, [B, 64 W] bits); with the float re-score too (whether an exact
    route's passing rows all fit is decided on the device)."""
    from silverrec.kernels.filtered_ivf_search import compose_search, cuda_steps
    from silverrec.kernels.rescore_rows import RESCORE_MAX_K, rescore_margin

    k, nprobe, max_probe, match_factor, ratio, limit = PARAMS[0]
    case, n = search_case(seed=BATCH * 31 + k)
    words = case[1][6].shape[1]  # the bank's
    margin = (rescore_margin(k), RESCORE_MAX_K) if rescore else (0, 0)
    inputs = search_inputs(case, n, k, nprobe, max_probe, match_factor, ratio, limit, residual, margin)
    with recorded_ops() as ops:
        compose_search(cuda_steps(), *inputs)
    assert len(ops) > 20 and ("triton", []) in ops and not [op for op, _ in ops if op == "_local_scalar_dense"]
    pool_sized = {n, words, 64 * words}
    assert not [(op, s) for op, shapes in ops for s in shapes if len(s) >= 2 and s[0] == BATCH and pool_sized & set(s[1:])]
