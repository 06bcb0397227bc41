"""The Triton filtered_topk kernel under TRITON_INTERPRET=1 (conftest) on CPU tensors.

Its keys must equal the CPU op's (C++ path and the torch path `filtered_keys_torch`) bit for bit,
and its rows / scores the exact filtered brute force of tests/test_filtered_topk.py (whole-pool
stack machine, posting-list union, int64 dot products, ties to the lower row). A small MIN_SLACK
forces the radix select through all its digits; few-valued codes make many score ties.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from silverrec.kernels.constants import OP_FALSE, OP_TRUE
from silverrec.kernels.common import quantize_queries, split_keys
from silverrec.kernels.constants import NO_LISTS
from silverrec.kernels.filtered_topk import filtered_keys_torch, filtered_topk_cuda
from tests.helpers import compile_in_clean_process
from tests.test_cpu_scan import _programs
from tests.test_filtered_topk import _allowed, _bank, _expected, _postings

triton = pytest.importorskip("triton")
from silverrec.kernels import filtered_topk_triton as ftt  # noqa: E402

SCALE, OFFSET = torch.tensor(0.05), torch.tensor(-0.2)


def _case(n, d, b, code_max, seed, n_lists=6, slots=3):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-code_max, code_max + 1, (n, d), dtype=torch.int8, generator=g)
    queries = torch.randn(b, d, generator=g)
    bank = _bank(11, n, g)
    ops, prow = _programs(b, 7, 3, 11, g)  # PUSH / NOT / AND / OR
    post_rows, post_off, lists = _postings(n, n_lists, g)
    sel = torch.full((b, slots), -1, dtype=torch.int64)
    sel[:, 0] = NO_LISTS
    return dict(queries=queries, codes=codes, bank=bank, ops=ops, prow=prow, post_rows=post_rows, post_off=post_off, sel=sel,
                active=torch.ones(b, dtype=torch.bool), lists=lists)


def _brute(c, k):
    """Expected (scores, rows) by brute force over the whole pool."""
    n = c["codes"].shape[0]
    allowed = _allowed(c["bank"], c["ops"], c["prow"], n)
    for i in range(c["sel"].shape[0]):
        if c["sel"][i, 0] != NO_LISTS:
            cand = torch.zeros(n, dtype=torch.bool)
            for lid in c["sel"][i][c["sel"][i] >= 0].tolist():
                cand[c["lists"][lid].long()] = True
            allowed[i] &= cand
    return _expected(c["queries"], c["codes"], allowed & c["active"][:, None], k, SCALE, OFFSET)


def _args(c):
    return c["bank"], c["ops"], c["prow"], c["post_rows"], c["post_off"], c["sel"], c["active"]


def _check(c, k, splits=1):
    """Triton keys == torch-path keys; rows / scores == brute force."""
    n = c["codes"].shape[0]
    qc, qs = quantize_queries(c["queries"])
    keys = ftt.filtered_keys_triton(qc, c["codes"], *_args(c), k, n, splits=splits)
    assert torch.equal(keys, filtered_keys_torch(qc, c["codes"], *_args(c), k)[0])
    want_s, want_r = _brute(c, k)
    int_scores, rows = split_keys(keys)
    assert torch.equal(rows, want_r)
    got_s = torch.where(rows >= 0, int_scores.float() * (SCALE * qs)[:, None] + (OFFSET * c["queries"].sum(1))[:, None], float("-inf"))
    assert torch.allclose(got_s, want_s, rtol=1e-6, atol=1e-6)
    return rows


@pytest.mark.parametrize(
    "n, d, b, k, code_max, slack",
    [
        (333, 20, 2, 1, 127, 1),  # k = 1, ragged N, every radix digit
        (333, 20, 3, 40, 2, 1),  # score ties at the k-th row, every digit
        (333, 20, 2, 40, 127, 256),  # resolved after the first digit
        (150, 150, 2, 200, 127, 256),  # k above the passing rows; D over one 128-wide tile
    ],
)
def test_whole_pool_programs(n, d, b, k, code_max, slack, monkeypatch):
    monkeypatch.setattr(ftt, "MIN_SLACK", slack)
    c = _case(n, d, b, code_max, seed=n + d + k)
    _check(c, k)


def test_constant_programs_nothing_and_everything_passes():
    c = _case(130, 24, 2, 1, seed=5)  # codes in {-1, 0, 1}: many ties
    c["ops"] = torch.tensor([[OP_FALSE, 0], [OP_TRUE, 0]])
    c["prow"] = torch.zeros(2, 2, 1, dtype=torch.int64)
    rows = _check(c, 200)
    assert (rows[0] == -1).all() and (rows[1, :130] >= 0).all() and (rows[1, 130:] == -1).all()


@pytest.mark.parametrize("k, slack", [(1, 256), (25, 1), (200, 256)])
def test_posting_lists(k, slack, monkeypatch):
    """Overlapping lists, a list named twice, empty lists (ids 0 and 5), -1 slots, unused queries' slots."""
    monkeypatch.setattr(ftt, "MIN_SLACK", slack)
    c = _case(300, 33, 4, 3, seed=11)
    c["sel"] = torch.tensor([[1, 2, 3], [4, 4, -1], [0, -1, 2], [-1, 5, 3]])
    assert any(len(c["lists"][i]) == 0 for i in (0, 5))
    _check(c, k)


def test_mixed_routes_and_inactive_queries_equal_cpu_op():
    """The CUDA registration's function, on CPU tensors: identical to the CPU op (C++), bit for bit."""
    c = _case(200, 40, 6, 4, seed=3)
    c["sel"] = torch.tensor([[NO_LISTS, 7, 7], [1, 3, -1], [NO_LISTS, -1, -1], [2, 4, 1], [-1, -1, -1], [3, -1, -1]])
    c["active"] = torch.tensor([True, True, False, True, True, False])
    args = (c["queries"], c["codes"], SCALE, OFFSET, c["bank"], [c["ops"], c["prow"]], [c["post_rows"], c["post_off"], c["sel"]],
            c["active"], 30, 200, [])
    got_s, got_r = filtered_topk_cuda(*args)
    want_s, want_r = torch.ops.silverrec.filtered_topk(*args)
    assert torch.equal(got_r, want_r) and torch.equal(got_s, want_s)
    assert torch.equal(got_r, _brute(c, 30)[1])
    assert (got_r[[2, 4, 5]] == -1).all() and (got_r[[0, 1]] >= 0).any(dim=1).all()


def test_no_posting_lists_at_all():
    """V = 0 lists, E = 0 rows: the posting route finds nothing; the whole pool (2 words, ragged) still answers."""
    c = _case(70, 16, 3, 127, seed=4)
    c["post_rows"], c["post_off"] = torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    c["sel"] = torch.tensor([[NO_LISTS, -1], [-1, -1], [NO_LISTS, -1]])
    c["ops"] = torch.tensor([[OP_TRUE], [OP_TRUE], [OP_TRUE]])
    c["prow"] = torch.zeros(3, 1, 1, dtype=torch.int64)
    rows = _check(c, 80)
    assert (rows[[0, 2], :70] >= 0).all() and (rows[1] == -1).all()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("silverrec::filtered_topk", "CUDA")


class _Allocations(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns (kernel launches: see `_quiet_launches`)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


class _quiet_launches:
    """The kernel with the dispatch mode off while it runs: the interpreter copies the arguments'
    storages to and from host arrays (aten copy_ / set_), which a GPU launch does not do."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)

        return launch


def test_no_device_buffer_proportional_to_n(monkeypatch):
    """Every tensor the launcher creates has the same shape at N and at 4 N (none is [B, N] or [B, N / 64])."""
    monkeypatch.setattr(ftt, "_filtered_scan_kernel", _quiet_launches(ftt._filtered_scan_kernel))
    seen = []
    for n in (64 * 40, 64 * 160):
        c = _case(n, 16, 3, 127, seed=2, n_lists=3)
        c["ops"] = torch.tensor([[OP_FALSE, 0]] * 3)  # nothing passes: the whole pool is walked, nothing scored
        c["prow"] = torch.zeros(3, 2, 1, dtype=torch.int64)
        c["sel"][1] = torch.tensor([0, 1, 2])  # one posting-route query
        qc, _ = quantize_queries(c["queries"])
        with _Allocations() as rec:
            keys = ftt.filtered_keys_triton(qc, c["codes"], *_args(c), 10, 64, splits=2)
        assert (split_keys(keys)[1] == -1).all()
        shapes = sorted({s for _, s in rec.shapes})
        assert all(n not in s and n // 64 not in s for s in shapes), shapes
        seen.append(shapes)
    assert seen[0] == seen[1]
    assert ftt.workspace_shapes(3, 2, 10, 2)["scratch"] in seen[0]


_COMPILE_SM90 = """
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from silverrec.kernels.filtered_topk_triton import _filtered_scan_kernel

sig = {name: '*i8' for name in ('q_ptr', 'x_ptr')}
sig.update({name: '*i64' for name in ('bits_ptr', 'ops_ptr', 'prog_ptr', 'post_off_ptr', 'lists_ptr', 'ncand_ptr',
                                      'prefix_ptr', 'vmin_ptr', 'buf_ptr', 'scratch_ptr')})
sig.update({name: '*i32' for name in ('post_rows_ptr', 'hist_ptr', 'count_ptr')})
sig.update({name: 'i32' for name in 'D W L T T2 V CAP SPLITS SOFF RB shift_hi shift NO_LISTS'.split()})
sig['RMASK'] = 'i64'
for compact in (False, True):
    const = dict(COMPACT=compact, NITER=12, NBINS=1 << 16, BLOCK=64, BLOCK_D=32)
    src = ASTSource(fn=_filtered_scan_kernel, signature={**sig, **{k: 'constexpr' for k in const}}, constexprs=const)
    assert 'ld.global' in compile(src, target=GPUTarget('cuda', 90, 32)).asm['ptx']
print('compiled')
"""


def test_kernel_compiles_for_sm90():
    """The interpreter does not type-check like the compiler: compile both passes for an H100 (PTX and
    cubin with triton's own ptxas; no GPU needed), in a process without TRITON_INTERPRET."""
    compile_in_clean_process(_COMPILE_SM90)
