"""The C++ CPU kernels (libsilverrec_ops.so) equal plain references bit for bit.

Keys are compared, not scores: int64 sort keys `score * 2**32 + 2**32 - 1 - row` carry both the
int8 dot product and the tie order. Odd dimensions leave the 64-byte SIMD chunks (D = 1, 3, 13,
127, 130, 784) and the AVX2 16-byte steps (`test_simd_tails_and_extreme_codes`: D around multiples
of 16, codes -128 / 127 that would saturate int16 pair sums); batches 1, 3 and 19 leave the
16-query lanes; k runs from 1 past the number of allowed items (padding); codes in {-1, 0, 1} make
massive ties; segments of > 8192 rows are split across worker threads and merged. Every case is
checked against brute force (int64 dot products, full sort).
"""

import os

import pytest
import torch

from silverrec.kernels import library
from silverrec.kernels.bloom_filter import bloom_filter_counts_torch, bloom_filter_reference
from silverrec.kernels.constants import OP_AND, OP_NOT, OP_OR, OP_PUSH
from silverrec.kernels.common import EMPTY_KEY, dequantize_scores, quantize_queries
from silverrec.kernels.ivf_scan import bitmask_words, ivf_scan_reference
from tests.helpers import runs_cpp_kernel

ext = library.host()  # the package's build, or the one SILVERREC_OPS_PATH names (make test-portable)

DIMS = [1, 3, 13, 127, 128, 130, 784]


def test_the_build_under_test_is_loaded():
    """`make test-portable` runs the kernel tests on builds for other instruction sets (SILVERREC_OPS_PATH,
    SILVERREC_EXPECT_ISA): the build named is the one every op runs (the only operator library mapped into the
    process), and it was compiled for that set (its fallback paths, not the machine's native ones)."""
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if line.rstrip().endswith(library.LIBRARY_NAME)}
    assert len(mapped) == 1 and os.path.samefile(mapped.pop(), library.load())
    path = os.environ.get("SILVERREC_OPS_PATH")
    if path:
        assert os.path.samefile(library.load(), path)
    want = os.environ.get("SILVERREC_EXPECT_ISA")
    assert ext.isa() == want if want else ext.isa() in ("avx512-vnni", "avx512", "avx2", "sse")


def _codes(n, d, g, ties=False):
    lo, hi = (-1, 2) if ties else (-128, 128)
    return torch.randint(lo, hi, (n, d), dtype=torch.int8, generator=g)


def _qcodes(b, d, g, ties=False):
    if ties:
        return torch.randint(-1, 2, (b, d), dtype=torch.int8, generator=g)
    return quantize_queries(torch.randn(b, d, generator=g))[0]


def _brute_keys(qcodes, codes, k, allowed=None):
    """int64 [B, k] keys by brute force; allowed: bool [B, N] or None."""
    s = qcodes.to(torch.int64) @ codes.to(torch.int64).t()  # [B, N]
    rows = torch.arange(codes.shape[0])
    keys = s * (1 << 32) + ((1 << 32) - 1 - rows)
    if allowed is not None:
        keys = torch.where(allowed, keys, torch.full_like(keys, EMPTY_KEY))
    keys = keys.sort(dim=1, descending=True).values[:, :k]
    if keys.shape[1] < k:
        keys = torch.cat([keys, torch.full((keys.shape[0], k - keys.shape[1]), EMPTY_KEY)], dim=1)
    return keys


def _whole_pool_keys(qcodes, codes, k):
    """The exact scan of every row: an index of one cluster, which every query probes (an exact index's search)."""
    probes = torch.zeros(qcodes.shape[0], 1, dtype=torch.int64)
    return ext.ivf_scan_keys(qcodes, codes, torch.tensor([0, codes.shape[0]]), probes, None, k)


def _layout(n, nlist, g):
    """Random cluster offsets with empty clusters (first, one inside, last) and unaligned sizes."""
    cut = torch.sort(torch.randint(0, n + 1, (nlist - 1,), generator=g)).values
    off = torch.cat([torch.zeros(1, dtype=torch.int64), cut, torch.tensor([n])])
    off[1] = 0  # cluster 0 empty
    off[nlist // 2 + 1] = off[nlist // 2]
    off[nlist - 1] = n  # last cluster empty
    return off


def _probes(b, p, nlist, g):
    pr = torch.stack([torch.randperm(nlist, generator=g)[:p] for _ in range(b)])
    pr[0, -1] = -1
    if p > 2:
        pr[-1, 2] = pr[-1, 0]  # repeated cluster: scanned once, with the first slot's bitmask
        pr[min(1, b - 1), 1] = -1
    if b > 2:
        pr[1, :] = -1  # a query that probes nothing: all padding
    return pr


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("b", [1, 3, 16, 19])
def test_exact_topk_equals_torch(d, b):
    g = torch.Generator().manual_seed(d * 100 + b)
    n = 3000
    codes, q = _codes(n, d, g), _qcodes(b, d, g)
    for k in (1, 17, 1000, n, n + 5):  # n + 5: padding
        got = _whole_pool_keys(q, codes, k)
        assert torch.equal(got, _brute_keys(q, codes, k)), k


@pytest.mark.parametrize("b", [1, 5, 16])
def test_exact_ties_and_thread_split(b):
    """Massive ties in a pool of > 8192 rows (several pieces, merged across workers)."""
    g = torch.Generator().manual_seed(b)
    n, d = 20000, 7
    codes, q = _codes(n, d, g, ties=True), _qcodes(b, d, g, ties=True)
    for k in (1, 3, 100, 9000):
        assert torch.equal(_whole_pool_keys(q, codes, k), _brute_keys(q, codes, k)), k


# SIMD edge cases of kernels/csrc/dot.h: widths around the 16-byte (AVX2), 64-byte (AVX-512) steps and
# the compile-time widths (32, 64, 96, 128, 256); 203 rows (ragged 16-row tile and 64-row word at the end).
SIMD_DIMS = [1, 3, 13, 15, 16, 17, 31, 32, 33, 64, 95, 96, 97, 130, 256]


def _extreme(shape, g):
    """Codes in {-128, 127}: every int16 pair sum of u8 x s8 products would saturate."""
    return torch.where(torch.randint(0, 2, shape, generator=g) == 1, 127, -128).to(torch.int8)


@pytest.mark.parametrize("d", SIMD_DIMS)
@pytest.mark.parametrize("b", [1, 16])
@pytest.mark.parametrize("extreme", [False, True])
def test_simd_tails_and_extreme_codes(d, b, extreme):
    g = torch.Generator().manual_seed(1000 * d + b + extreme)
    n = 203
    if extreme:
        codes, q = _extreme((n, d), g), _extreme((b, d), g)
        codes[0], codes[n - 1], codes[n - 2] = -128, -128, 127  # the largest dots and the ragged last tile
        q[0] = -128
    else:
        codes, q = _codes(n, d, g), _qcodes(b, d, g)
    for k in (1, 5, 100, n, n + 9):  # n + 9: more than the candidates (padding)
        assert torch.equal(_whole_pool_keys(q, codes, k), _brute_keys(q, codes, k)), k
    off = torch.tensor([0, 0, 37, 64, 150, n])
    probes = torch.tensor([[1, 2, 3, 4]] * b)
    bitmask = torch.randint(-(2**63), 2**63 - 1, (b, 4, bitmask_words(off)), generator=g)
    sparse = bitmask.clone()
    for _ in range(2):
        sparse &= torch.randint(-(2**63), 2**63 - 1, bitmask.shape, generator=g)
    for mask in (None, bitmask, sparse):  # sparse: 1-3 rows of a 16-row tile scored one by one
        allowed = _ivf_allowed(off, probes, mask, n)
        for k in (1, 50, n + 9):
            got = ext.ivf_scan_keys(q, codes, off, probes, mask, k)
            assert torch.equal(got, _brute_keys(q, codes, k, allowed)), k


def _ivf_allowed(off, probes, bitmask, n):
    """bool [B, N]: rows of each query's probed clusters whose bit is set (first slot of a cluster wins)."""
    b_, p_ = probes.shape
    allowed = torch.zeros(b_, n, dtype=torch.bool)
    for b in range(b_):
        seen = set()
        for j, c in enumerate(probes[b].tolist()):
            if c < 0 or c in seen:
                continue
            seen.add(c)
            r = torch.arange(int(off[c]), int(off[c + 1]))
            ok = torch.ones_like(r, dtype=torch.bool)
            if bitmask is not None:
                ok = ((bitmask[b, j, (r >> 6) - (int(off[c]) >> 6)] >> (r & 63)) & 1).bool()
            allowed[b, r] = ok
    return allowed


def _ivf_case(n, d, nlist, b, p, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    codes, off = _codes(n, d, g, ties), _layout(n, nlist, g)
    return codes, off, _qcodes(b, d, g, ties), _probes(b, p, nlist, g), g


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("b", [1, 3, 16, 19])
@pytest.mark.parametrize("mask", [None, "random", "zeros", "ones", "sparse"])
def test_ivf_scan_equals_torch(d, b, mask):
    n, nlist, p = 2500, 23, 6
    codes, off, q, probes, g = _ivf_case(n, d, nlist, b, p, seed=d + 7 * b)
    wc = bitmask_words(off)
    bitmask = None
    if mask == "random":
        bitmask = torch.randint(-(2**63), 2**63 - 1, (b, p, wc), generator=g)
    elif mask == "zeros":
        bitmask = torch.zeros(b, p, wc, dtype=torch.int64)
    elif mask == "ones":
        bitmask = torch.full((b, p, wc), -1, dtype=torch.int64)
    elif mask == "sparse":  # ~1 bit in 64: mostly zero words, lone rows
        bitmask = torch.randint(-(2**63), 2**63 - 1, (b, p, wc), generator=g)
        for _ in range(5):
            bitmask &= torch.randint(-(2**63), 2**63 - 1, (b, p, wc), generator=g)
    allowed = _ivf_allowed(off, probes, bitmask, n)
    for k in (1, 10, 400, 5000):  # 5000 > probed items: padding
        got = ext.ivf_scan_keys(q, codes, off, probes, bitmask, k)
        assert torch.equal(got, _brute_keys(q, codes, k, allowed)), k


@pytest.mark.parametrize("b", [4, 16, 19, 40])
@pytest.mark.parametrize("with_mask", [False, True])
def test_ivf_shared_clusters_and_ties(b, with_mask):
    """Every query probes the same few clusters (16-query lanes), massive ties, big clusters split."""
    n, d, nlist, p = 30000, 5, 6, 4
    codes, off, q, _, g = _ivf_case(n, d, nlist, b, p, seed=b, ties=True)
    probes = torch.stack([torch.randperm(nlist, generator=g)[:p] for _ in range(b)])
    probes[0, 1] = -1
    bitmask = torch.randint(-(2**63), 2**63 - 1, (b, p, bitmask_words(off)), generator=g) if with_mask else None
    allowed = _ivf_allowed(off, probes, bitmask, n)
    for k in (1, 50, 3000):
        got = ext.ivf_scan_keys(q, codes, off, probes, bitmask, k)
        assert torch.equal(got, _brute_keys(q, codes, k, allowed)), k


def test_ivf_bad_values_raise_value_error():
    g = torch.Generator().manual_seed(0)
    codes, off = _codes(300, 8, g), _layout(300, 6, g)
    q = _qcodes(2, 8, g)
    with pytest.raises(ValueError, match="probes"):
        ext.ivf_scan_keys(q, codes, off, torch.tensor([[0, 6], [1, 2]]), None, 3)
    with pytest.raises(ValueError, match="cluster_offsets"):
        ext.ivf_scan_keys(q, codes, off - 1, torch.tensor([[0, 1], [1, 2]]), None, 3)
    with pytest.raises(ValueError, match="bitmask"):
        ext.ivf_scan_keys(q, codes, off, torch.tensor([[0, 1], [1, 2]]), torch.zeros(2, 2, 0, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="k must"):
        ext.ivf_scan_keys(q, codes, off, torch.tensor([[0, 1], [1, 2]]), None, 0)


def _programs(b, length, width, r, g):
    """Random well-formed postfix programs (PUSH / NOT / AND / OR), NOP padded."""
    ops = torch.zeros(b, length, dtype=torch.int64)
    for i in range(b):
        prog, depth = [], 0
        n = int(torch.randint(1, length + 1, (1,), generator=g))
        while len(prog) < n - depth + 1 or depth != 1:
            choices = [OP_PUSH] + ([OP_NOT] if depth else []) + ([OP_AND, OP_OR] if depth >= 2 else [])
            if len(prog) + depth - 1 >= length - 1 and depth >= 2:
                choices = [OP_AND, OP_OR]
            op = choices[int(torch.randint(len(choices), (1,), generator=g))]
            prog.append(op)
            depth += {OP_PUSH: 1, OP_NOT: 0, OP_AND: -1, OP_OR: -1}[op]
            if len(prog) >= length:
                break
        if depth != 1:
            prog = [OP_PUSH]
        ops[i, : len(prog)] = torch.tensor(prog)
    return ops, torch.randint(-r, r, (b, length, width), generator=g)


@pytest.mark.parametrize("b, p, n_words", [(1, 1, 1), (16, 8, 5), (3, 2, 700), (19, 300, 1)])
def test_bloom_filter_equals_the_stack_machine(b, p, n_words):
    g = torch.Generator().manual_seed(b + p + n_words)
    r, w = 29, 1000
    bits = torch.randint(-(2**63), 2**63 - 1, (r, w), generator=g)
    ops, rows = _programs(b, 9, 3, r, g)
    starts = torch.randint(-1, w, (b, p), generator=g)  # empty windows and windows past W
    got = torch.ops.silverrec.bloom_filter(bits, ops, rows, starts, n_words)
    assert torch.equal(got, bloom_filter_reference(bits, ops, rows, starts, n_words))


def test_ops_equal_their_references():
    """The registered ops' C++ kernels: ivf_scan against the per-query reference (rows bit for bit, scores
    dequantised from its integer scores), bloom_filter_counts against bloom_filter composed with range masks."""
    g = torch.Generator().manual_seed(5)
    n, d, nlist, b, p = 4000, 24, 17, 5, 4
    codes, off, _, probes, g = _ivf_case(n, d, nlist, b, p, seed=11)
    queries = torch.randn(b, d, generator=g)
    scale, offset = torch.tensor(0.02), torch.tensor(0.1)
    bitmask = torch.randint(-(2**63), 2**63 - 1, (b, p, bitmask_words(off)), generator=g)
    scores, rows = torch.ops.silverrec.ivf_scan(queries, codes, scale, offset, off, probes, 30, bitmask)
    int_scores, want_rows = ivf_scan_reference(queries, codes, off, probes, 30, bitmask)
    assert torch.equal(rows, want_rows)
    qscale = quantize_queries(queries)[1]
    assert torch.equal(scores, dequantize_scores(int_scores, qscale, queries.sum(dim=1), scale, offset, rows >= 0))
    bank = torch.randint(-(2**63), 2**63 - 1, (9, (n + 63) // 64), generator=g)
    f_ops = torch.tensor([[1, 1, 2], [1, 4, 0], [1, 1, 2], [6, 0, 0], [1, 1, 3]])
    f_rows = torch.randint(-9, 9, (b, 3, 2), generator=g)
    lo, hi = off[probes.clamp_min(0)], off[probes.clamp_min(0) + 1]
    lo = torch.where(probes >= 0, lo, torch.full_like(lo, -1))
    got = torch.ops.silverrec.bloom_filter_counts(bank, f_ops, f_rows, lo, hi, bitmask_words(off))
    want = bloom_filter_counts_torch(bank, f_ops, f_rows, lo, hi, bitmask_words(off))
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("map_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (16, 4096), (5,)])
def test_rows_to_items_equals_indexing(map_dtype, shape):
    """silverrec::rows_to_items (one C++ pass) == row_to_item[rows] in int64 with -1 kept (checked
    against plain Python indexing, and the torch reference the CUDA path runs)."""
    from silverrec.kernels.rows_to_items import rows_to_items_torch

    assert runs_cpp_kernel("rows_to_items"), "the operator library registers the C++ kernel"
    g = torch.Generator().manual_seed(11)
    n = 1000
    row_to_item = (torch.randperm(n, generator=g) * 7 + (2**40 if map_dtype == torch.int64 else 3)).to(map_dtype)
    rows = torch.randint(-1, n, shape, generator=g)
    got = torch.ops.silverrec.rows_to_items(row_to_item, rows)
    assert got.dtype == torch.int64 and got.shape == rows.shape
    want = [-1 if r < 0 else int(row_to_item[r]) for r in rows.reshape(-1).tolist()]
    assert got.reshape(-1).tolist() == want
    assert torch.equal(got, rows_to_items_torch(row_to_item, rows))
    assert torch.equal(torch.ops.silverrec.rows_to_items(row_to_item, rows.t() if rows.dim() == 2 else rows),
                       rows_to_items_torch(row_to_item, rows.t() if rows.dim() == 2 else rows))  # non-contiguous rows
    with pytest.raises(IndexError, match="out of range"):
        torch.ops.silverrec.rows_to_items(row_to_item, torch.tensor([[0, n]]))
