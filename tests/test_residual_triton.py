"""Residual int8 codes in the Triton launchers, under TRITON_INTERPRET=1 (conftest) on CPU tensors.

A row r of cluster c scores <qcodes[b], codes[r]> + bias[b, c] (bias int32 [B, nlist] in
[BIAS_FLOOR, 0]); `scan_keys_triton` and `filtered_keys_triton` must rank with it and pack it into
the keys. Both are compared with `_reference`: per query the allowed rows, int64 dot + bias of the
row's cluster, sorted by score descending then lower row, the first k; the keys decoded to (score,
row) lists, EMPTY_KEY padding after them.
"""

from __future__ import annotations

import pytest
import torch

from silverrec.kernels.constants import OP_TRUE
from silverrec.kernels.common import BIAS_FLOOR, EMPTY_KEY, quantize_queries
from silverrec.kernels.constants import NO_LISTS
from tests.helpers import compile_in_clean_process
from tests.test_filtered_topk import _allowed

triton = pytest.importorskip("triton")
from silverrec.kernels import filtered_topk_triton as ftt  # noqa: E402
from silverrec.kernels.ivf_scan_triton import scan_keys_triton  # noqa: E402
from tests.test_filtered_topk_triton import _args, _case  # noqa: E402

FLOOR = BIAS_FLOOR  # the lowest bias


def _offsets(sizes):
    off = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0)
    return off


def _bias(b, nlist, g, spread=3000):
    """int32 [b, nlist]: few values (equal biases across clusters: ties), some 0 and some at FLOOR."""
    bias = -torch.randint(0, 4, (b, nlist), generator=g) * (spread // 3)
    bias[torch.rand(b, nlist, generator=g) < 0.2] = FLOOR
    bias[:, 0] = 0
    return bias.to(torch.int32)


def _reference(qcodes, codes, sizes, bias, allowed, k):
    """Per query: [(score, row)] of its k best allowed rows (allowed bool [B, N]), score = int64 dot +
    bias[b, cluster of the row] (sizes: the clusters' row counts, cluster-major), best first."""
    cluster = [c for c, size in enumerate(sizes) for _ in range(size)]
    dots = (qcodes.to(torch.int64) @ codes.to(torch.int64).t()).tolist()
    out = []
    for b in range(qcodes.shape[0]):
        scored = [(dots[b][r] + (int(bias[b, cluster[r]]) if bias is not None else 0), r)
                  for r in allowed[b].nonzero()[:, 0].tolist()]
        scored.sort(key=lambda sr: (-sr[0], sr[1]))
        out.append(scored[:k])
    return out


def _decoded(keys, k):
    """Per query: [(score, row)] of the non-EMPTY keys int64 [B, k] (which must come first)."""
    assert keys.shape[1] == k and keys.dtype == torch.int64
    out = []
    for row in keys.tolist():
        n = sum(key != EMPTY_KEY for key in row)
        assert all(key == EMPTY_KEY for key in row[n:])
        out.append([(key >> 32, (1 << 32) - 1 - (key & ((1 << 32) - 1))) for key in row[:n]])
    return out


# --- ivf_scan ---------------------------------------------------------------------------------


def _probed(off, probes, bitmask, n):
    """bool [B, N]: rows of the probed clusters (slots -1 skipped) whose bitmask bit is set."""
    allowed = torch.zeros(probes.shape[0], n, dtype=torch.bool)
    for b, slots in enumerate(probes.tolist()):
        for j, c in enumerate(slots):
            if c < 0:
                continue
            start, stop = int(off[c]), int(off[c + 1])
            for r in range(start, stop):
                if bitmask is None or (int(bitmask[b, j, (r >> 6) - (start >> 6)]) >> (r & 63)) & 1:
                    allowed[b, r] = True
    return allowed


@pytest.mark.parametrize(
    "sizes, d, b, p, k, group, code_max",
    [
        ([50, 0, 70, 1, 64, 30, 0, 20, 40, 25], 40, 3, 4, 10, 2, 127),  # empty + 1-row clusters, odd D
        ([50, 0, 70, 1, 64, 30, 0, 20, 40, 25], 40, 3, 10, 400, None, 127),  # every cluster, k above N
        ([0, 17, 130, 5, 0], 16, 2, 5, 60, 3, 1),  # codes in {-1, 0, 1}: score ties across clusters
    ],
)
@pytest.mark.parametrize("with_mask", [False, True])
def test_scan_keys_with_bias_equal_reference(sizes, d, b, p, k, group, code_max, with_mask):
    g = torch.Generator().manual_seed(len(sizes) * 10 + k + code_max)
    off = _offsets(sizes)
    n, nlist = int(off[-1]), len(sizes)
    codes = torch.randint(-code_max, code_max + 1, (n, d), dtype=torch.int8, generator=g)
    qcodes, _ = quantize_queries(torch.randn(b, d, generator=g))
    probes = torch.stack([torch.randperm(nlist, generator=g)[:p] for _ in range(b)])  # canonical: no repeats
    probes[0, -1] = -1
    probes[-1, 0] = -1
    words = max((int(off[c + 1]) - 1 >> 6) - (int(off[c]) >> 6) + 1 for c in range(nlist) if sizes[c])
    bitmask = torch.randint(-(2**62), 2**62, (b, p, words), generator=g) if with_mask else None
    bias = _bias(b, nlist, g, spread=3 if code_max == 1 else 3000)
    allowed = _probed(off, probes, bitmask, n)

    keys = scan_keys_triton(qcodes, codes, off, probes, k, bitmask, slot_group=group, bias=bias)
    assert _decoded(keys, k) == _reference(qcodes, codes, sizes, bias, allowed, k)
    # no bias: the old scan; an all-zero bias: the same keys
    plain = scan_keys_triton(qcodes, codes, off, probes, k, bitmask, slot_group=group)
    assert _decoded(plain, k) == _reference(qcodes, codes, sizes, None, allowed, k)
    zero = scan_keys_triton(qcodes, codes, off, probes, k, bitmask, slot_group=group, bias=torch.zeros_like(bias))
    assert torch.equal(zero, plain)


def test_scan_keys_bias_at_the_floor_ranks_last():
    """A cluster at bias BIAS_FLOOR comes after every row of a cluster at bias 0, whatever its dots."""
    g = torch.Generator().manual_seed(3)
    sizes = [40, 30]
    off = _offsets(sizes)
    codes = torch.randint(-128, 128, (70, 32), dtype=torch.int8, generator=g)
    qcodes, _ = quantize_queries(torch.randn(1, 32, generator=g))
    bias = torch.tensor([[FLOOR, 0]], dtype=torch.int32)
    keys = scan_keys_triton(qcodes, codes, off, torch.tensor([[0, 1]]), 80, None, bias=bias)
    got = _decoded(keys, 80)[0]
    assert [r >= 40 for _, r in got] == [True] * 30 + [False] * 40
    assert got == _reference(qcodes, codes, sizes, bias, torch.ones(1, 70, dtype=torch.bool), 80)[0]


# --- filtered_topk ----------------------------------------------------------------------------


def _filtered_allowed(c):
    """bool [B, N]: the program's rows, within the named lists for posting-route queries, active queries only."""
    n = c["codes"].shape[0]
    allowed = _allowed(c["bank"], c["ops"], c["prow"], n)
    for i, slots in enumerate(c["sel"].tolist()):
        if slots[0] != NO_LISTS:
            cand = torch.zeros(n, dtype=torch.bool)
            for lid in slots:
                if lid >= 0:
                    cand[c["lists"][lid].long()] = True
            allowed[i] &= cand
    return allowed & c["active"][:, None]


def _check_filtered(c, sizes, k, splits, seed):
    n = c["codes"].shape[0]
    assert sum(sizes) == n
    off = _offsets(sizes)
    g = torch.Generator().manual_seed(seed)
    bias = _bias(c["queries"].shape[0], len(sizes), g, spread=3 if c["codes"].abs().max() <= 2 else 3000)
    qc, _ = quantize_queries(c["queries"])
    allowed = _filtered_allowed(c)
    keys = ftt.filtered_keys_triton(qc, c["codes"], *_args(c), k, n, splits=splits, cluster_offsets=off, bias=bias)
    assert _decoded(keys, k) == _reference(qc, c["codes"], sizes, bias, allowed, k)
    plain = ftt.filtered_keys_triton(qc, c["codes"], *_args(c), k, n, splits=splits)
    assert _decoded(plain, k) == _reference(qc, c["codes"], sizes, None, allowed, k)
    zero = ftt.filtered_keys_triton(qc, c["codes"], *_args(c), k, n, splits=splits, cluster_offsets=off,
                                    bias=torch.zeros_like(bias))
    assert torch.equal(zero, plain)


RAGGED = [0, 50, 0, 70, 1, 64, 30, 0, 20, 72, 26, 0]  # 333 rows, empty clusters first, inside and last


@pytest.mark.parametrize(
    "k, code_max, slack, splits",
    [
        (1, 127, 1, 1),  # k = 1, every radix digit
        (40, 2, 1, 2),  # few-valued codes: score ties at the k-th row, every digit
        (400, 127, 256, 1),  # k above the passing rows
    ],
)
def test_filtered_whole_pool_with_bias_equals_reference(k, code_max, slack, splits, monkeypatch):
    monkeypatch.setattr(ftt, "MIN_SLACK", slack)
    c = _case(333, 20, 3, code_max, seed=k + code_max)
    _check_filtered(c, RAGGED, k, splits, seed=k)


@pytest.mark.parametrize("k, slack", [(1, 256), (25, 1), (200, 256)])
def test_filtered_posting_lists_with_bias_equal_reference(k, slack, monkeypatch):
    """Overlapping lists, a list named twice, empty lists, -1 slots; a whole-pool and an inactive query."""
    monkeypatch.setattr(ftt, "MIN_SLACK", slack)
    c = _case(300, 33, 6, 3, seed=11)
    c["sel"] = torch.tensor([[1, 2, 3], [4, 4, -1], [0, -1, 2], [-1, 5, 3], [NO_LISTS, -1, -1], [1, 2, -1]])
    c["active"] = torch.tensor([True, True, True, True, True, False])
    _check_filtered(c, [64, 0, 100, 1, 35, 0, 100], k, 2, seed=k)


def test_filtered_everything_passes_every_row_gets_its_cluster_bias():
    """A TRUE program and k = N: every row, each with its own cluster's bias (one cluster per row too)."""
    c = _case(130, 24, 2, 127, seed=5)
    c["ops"] = torch.tensor([[OP_TRUE], [OP_TRUE]])
    c["prow"] = torch.zeros(2, 1, 1, dtype=torch.int64)
    _check_filtered(c, [1] * 130, 130, 1, seed=2)


def test_value_bits_fit_63_bits_with_bias():
    """The radix select's (score + SOFF, row) value with the bias: 58 bits at 100M rows x 128 dims."""
    soff, rb, total = ftt.value_bits(128, 100_000_000, True)
    assert (soff, rb, total) == (127 * 128 * 128 - BIAS_FLOOR, 27, 58)
    assert ftt.value_bits(128, 100_000_000, False) == (127 * 128 * 128, 27, 49)  # as before
    assert ftt.value_bits(128, 1 << 32, True)[2] == 63  # the largest N the check lets through at D = 128
    lo, hi = -127 * 128 * 128 + FLOOR, 127 * 128 * 128  # every score + SOFF in [0, 2 ** (total - rb))
    assert lo + soff >= 0 and (hi + soff) < 1 << (total - rb)


_COMPILE_SM90 = """
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from silverrec.kernels import filtered_topk_triton as ftt, ivf_scan_triton as iv

sig = {name: '*i8' for name in ('q_ptr', 'x_ptr')}
sig.update({name: '*i64' for name in ('bits_ptr', 'ops_ptr', 'prog_ptr', 'post_off_ptr', 'lists_ptr', 'ncand_ptr',
                                      'prefix_ptr', 'vmin_ptr', 'buf_ptr', 'scratch_ptr', 'coff_ptr')})
sig.update({name: '*i32' for name in ('post_rows_ptr', 'hist_ptr', 'count_ptr', 'bias_ptr')})
sig.update({name: 'i32' for name in 'D W L T T2 V CAP SPLITS SOFF RB shift_hi shift NO_LISTS NLIST'.split()})
sig['RMASK'] = 'i64'
for compact in (False, True):
    const = dict(COMPACT=compact, NITER=12, NBINS=1 << 16, BLOCK=64, BLOCK_D=32, HAS_BIAS=True, CITER=9)
    src = ASTSource(fn=ftt._filtered_scan_bias_kernel, signature={**sig, **{k: 'constexpr' for k in const}}, constexprs=const)
    assert 'ld.global' in compile(src, target=GPUTarget('cuda', 90, 32)).asm['ptx']
fn = iv._ivf_scan_bias_keys_kernel
types = ['*i8', '*i8'] + ['*i64'] * 4 + ['i32'] * 11 + ['*i32', 'i32']
const = dict(HAS_MASK=True, HAS_BIAS=True, BLOCK_N=64, BLOCK_D=32)
src = ASTSource(fn=fn, signature={**dict(zip(fn.arg_names, types)), **{k: 'constexpr' for k in const}}, constexprs=const)
assert 'ld.global' in compile(src, target=GPUTarget('cuda', 90, 32)).asm['ptx']
print('compiled')
"""


def test_bias_kernels_compile_for_sm90():
    """The interpreter does not type-check like the compiler: compile both bias kernels for an H100
    (no GPU needed), in a process without TRITON_INTERPRET."""
    compile_in_clean_process(_COMPILE_SM90)
