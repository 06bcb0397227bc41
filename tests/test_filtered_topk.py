"""silverrec::verify_topk and silverrec::filtered_topk against brute force.

The reference evaluates each program over the whole pool with the independent stack machine
(`bloom_filter_reference`), intersects with the union of the posting lists, and ranks every
allowed row by its exact int8 dot product (ties: lower row). The ops' C++ kernels must return exactly
that.
"""

from __future__ import annotations

import pytest
import torch

from silverrec.kernels.library import host
from silverrec.kernels.bloom_filter import bloom_filter_reference
from silverrec.kernels.common import EMPTY_KEY, quantize_queries
from silverrec.kernels.constants import NO_LISTS
from tests.test_cpu_scan import _programs


def _bank(r, n, g):
    return torch.randint(-(2**63), 2**63 - 1, (r, (n + 63) // 64), generator=g)


def _allowed(bank, ops, rows, n):
    """bool [B, n]: each program over the whole pool (independent stack machine)."""
    b = ops.shape[0]
    words = bloom_filter_reference(bank, ops, rows, torch.zeros(b, 1, dtype=torch.int64), bank.shape[1])[:, 0]
    bits = (words[:, :, None] >> torch.arange(64)) & 1
    return bits.reshape(b, -1)[:, :n].bool()


def _allowed_from(bank, ops, rows, n, sel, lists, active):
    """bool [B, n]: each active query's program over the whole pool (sel[b, 0] == NO_LISTS) or over the
    union of its posting lists sel[b] (-1 = unused slot)."""
    allowed = _allowed(bank, ops, rows, n)
    for i in range(ops.shape[0]):
        if sel[i, 0] != NO_LISTS:
            cand = torch.zeros(n, dtype=torch.bool)
            for l in sel[i][sel[i] >= 0].tolist():
                cand[lists[l].long()] = True
            allowed[i] &= cand
    return allowed & active[:, None]


def _postings(n, v, g):
    """v random ascending posting lists over [0, n) (some empty, overlapping)."""
    lists = []
    for i in range(v):
        size = int(torch.randint(0, n // 4 + 1, (1,), generator=g)) if i % 5 else 0
        lists.append(torch.sort(torch.randperm(n, generator=g)[:size]).values)
    off = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
    return torch.cat(lists).to(torch.int32), off, lists


def _expected(queries, codes, allowed, k, scale, offset, row_bias=None, shift=None):
    """Brute force: (scores float32 [B, k], rows int64 [B, k]) of the allowed rows by int8 dot (+ row_bias
    int64 [B, N] and, on the scores, + shift float32 [B]: residual codes), ties to the lower row."""
    qc, qs = quantize_queries(queries)
    s = qc.to(torch.int64) @ codes.to(torch.int64).t()
    if row_bias is not None:
        s = s + row_bias
    rows = torch.arange(codes.shape[0])
    keys = torch.where(allowed, s * (1 << 32) + ((1 << 32) - 1 - rows), torch.full_like(s, EMPTY_KEY))
    keys = keys.sort(dim=1, descending=True).values[:, :k]
    if keys.shape[1] < k:
        keys = torch.cat([keys, torch.full((keys.shape[0], k - keys.shape[1]), EMPTY_KEY)], dim=1)
    valid = keys != EMPTY_KEY
    r = torch.where(valid, (1 << 32) - 1 - (keys & ((1 << 32) - 1)), torch.full_like(keys, -1))
    sc = (keys >> 32).float() * (scale * qs)[:, None] + (offset * queries.sum(1))[:, None]
    if shift is not None:
        sc = sc + shift[:, None]
    return torch.where(valid, sc, torch.full_like(sc, float("-inf"))), r


@pytest.mark.parametrize("n, d, b, k", [(1000, 16, 5, 10), (4099, 64, 17, 300), (70_000, 32, 3, 50), (300, 8, 2, 400)])
def test_filtered_topk_equals_brute_force(n, d, b, k):
    g = torch.Generator().manual_seed(n + b)
    codes = torch.randint(-3, 4, (n, d), dtype=torch.int8, generator=g)  # many score ties
    queries = torch.randn(b, d, generator=g)
    scale, offset = torch.tensor(0.05), torch.tensor(-0.2)
    bank = _bank(11, n, g)
    ops, prow = _programs(b, 7, 3, 11, g)
    post_rows, post_off, lists = _postings(n, 9, g)
    sel = torch.full((b, 3), -1, dtype=torch.int64)
    for i in range(b):
        if i % 3 == 0:
            sel[i, 0] = NO_LISTS  # whole pool
        else:
            ids = torch.randperm(9, generator=g)[: 1 + i % 3]
            sel[i, : len(ids)] = ids
    active = torch.ones(b, dtype=torch.bool)
    active[-1] = b < 3
    allowed = _allowed_from(bank, ops, prow, n, sel, lists, active)
    want_s, want_r = _expected(queries, codes, allowed, k, scale, offset)

    got_s, got_r = torch.ops.silverrec.filtered_topk(queries, codes, scale, offset, bank, [ops, prow],
                                                     [post_rows, post_off, sel], active, k, n, [])
    assert torch.equal(got_r, want_r)
    assert torch.allclose(got_s, want_s, rtol=1e-6, atol=1e-6)


def test_filtered_topk_groups_identical_filters():
    """One filter for the whole batch (the common request): evaluated once, every query answered."""
    g = torch.Generator().manual_seed(3)
    n, d, b = 20_000, 32, 16
    codes = torch.randint(-128, 128, (n, d), dtype=torch.int8, generator=g)
    queries = torch.randn(b, d, generator=g)
    bank = _bank(5, n, g)
    ops = torch.tensor([[1, 1, 2]] * b)
    prow = torch.tensor([[[0, 1], [~2, 3], [0, 0]]] * b)
    post_rows, post_off, lists = _postings(n, 4, g)
    sel = torch.tensor([[1, 2]] * b)
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    active = torch.ones(b, dtype=torch.bool)
    allowed = _allowed(bank, ops, prow, n)
    cand = torch.zeros(n, dtype=torch.bool)
    cand[lists[1].long()] = cand[lists[2].long()] = True
    want = _expected(queries, codes, allowed & cand, 40, one, zero)
    got = torch.ops.silverrec.filtered_topk(queries, codes, one, zero, bank, [ops, prow], [post_rows, post_off, sel], active, 40, n, [])
    assert torch.equal(got[1], want[1])


def test_one_whole_pool_filter_split_between_threads_equals_brute_force(team_mode):
    """A batch sharing one whole-pool filter over a pool of 4,700 words (threads.h kMinSliceWords, spinning
    workers: the words are split between the threads, a slice each, and the passing rows joined in order)
    and enough candidates that the merge runs on both threads: equal to brute force, ties to the lower row
    (and so with the sleeping workers' thresholds, on one thread)."""
    g = torch.Generator().manual_seed(11)
    n, d, b, k = 300_000, 8, 16, 700
    codes = torch.randint(-3, 4, (n, d), dtype=torch.int8, generator=g)  # many score ties
    queries = torch.randn(b, d, generator=g)
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    bank = _bank(4, n, g)
    ops = torch.tensor([[1, 1, 2]] * b)  # PUSH (rows 0 & 1), PUSH (~2 & 3), AND: 1/16 of the pool passes
    prow = torch.tensor([[[0, 1], [~2, 3], [0, 0]]] * b)
    sel = torch.full((b, 1), NO_LISTS, dtype=torch.int64)
    active = torch.ones(b, dtype=torch.bool)
    allowed = _allowed(bank, ops, prow, n)
    assert n // 20 < int(allowed[0].sum()) < n // 12
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # (on a one-core machine too: the op must split)
    try:
        want = _expected(queries, codes, allowed, k, one, zero)
        got = torch.ops.silverrec.filtered_topk(queries, codes, one, zero, bank, [ops, prow],
                                                [torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), sel],
                                                active, k, n, [])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_one_posting_list_group_split_between_threads_equals_brute_force(team_mode):
    """One filter's posting list of 8,192 rows (threads.h kMinSliceWords: split into a slice per thread):
    its first half dense (4,096 consecutive rows: the program runs over their words' range, filter_scan.cpp
    kDenseListWords), its second half sparse (one row every 300 over 19k words: each row gathers its own
    word); the passing rows, joined in order, ranked: equal to brute force."""
    g = torch.Generator().manual_seed(12)
    first, step = 100_000, 300
    rows = torch.cat([torch.arange(4096), first + step * torch.arange(4096)]).to(torch.int32)
    n, d, b, k = int(rows[-1]) + 1000, 4, 2, 3000
    codes = torch.randint(-3, 4, (n, d), dtype=torch.int8, generator=g)  # many score ties
    queries = torch.randn(b, d, generator=g)
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    bank = _bank(4, n, g)
    ops = torch.tensor([[1, 1, 3]] * b)  # PUSH (rows 0 & 1), PUSH (~2), OR: 5/8 of the rows pass
    prow = torch.tensor([[[0, 1], [~2, ~2], [0, 0]]] * b)
    post_rows, post_off = rows, torch.tensor([0, len(rows)])
    sel = torch.tensor([[0]] * b)
    active = torch.ones(b, dtype=torch.bool)
    cand = torch.zeros(n, dtype=torch.bool)
    cand[rows.long()] = True
    allowed = _allowed(bank, ops, prow, n) & cand
    assert 4096 < int(allowed[0].sum()) < 6000  # rows pass and fail in both halves
    assert 1000 < int(allowed[0, first:].sum()) < 3000
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # (on a one-core machine too: the op must split)
    try:
        want = _expected(queries, codes, allowed, k, one, zero)
        got = torch.ops.silverrec.filtered_topk(queries, codes, one, zero, bank, [ops, prow], [post_rows, post_off, sel],
                                                active, k, n, [])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_filtered_topk_rejects_bad_list_ids():
    g = torch.Generator().manual_seed(0)
    n = 500
    codes = torch.zeros(n, 4, dtype=torch.int8)
    bank = _bank(3, n, g)
    post_rows, post_off, _ = _postings(n, 3, g)
    ops, prow = torch.tensor([[1]]), torch.tensor([[[0]]])
    with pytest.raises(ValueError, match="posting list id 7"):
        torch.ops.silverrec.filtered_topk(torch.randn(1, 4), codes, torch.tensor(1.0), torch.tensor(0.0), bank, [ops, prow],
                                          [post_rows, post_off, torch.tensor([[7]])], torch.tensor([True]), 5, n, [])


@pytest.mark.parametrize("b, k2, k", [(1, 1, 1), (6, 50, 20), (4, 700, 600), (3, 10, 25)])
def test_verify_topk_keeps_first_passing(b, k2, k):
    g = torch.Generator().manual_seed(b * k2)
    n = 3000
    bank = _bank(7, n, g)
    ops, prow = _programs(b, 6, 2, 7, g)
    rows_in = torch.stack([torch.randperm(n, generator=g)[:k2] for _ in range(b)])
    rows_in[0, k2 // 2 :] = -1  # padding tail
    scores_in = torch.sort(torch.randn(b, k2, generator=g), dim=1, descending=True).values
    allowed = _allowed(bank, ops, prow, n)
    want_s = torch.full((b, k), float("-inf"))
    want_r = torch.full((b, k), -1, dtype=torch.int64)
    for i in range(b):
        kept = [j for j in range(k2) if rows_in[i, j] >= 0 and allowed[i, rows_in[i, j]]][:k]
        want_r[i, : len(kept)] = rows_in[i, kept]
        want_s[i, : len(kept)] = scores_in[i, kept]
    got_s, got_r = torch.ops.silverrec.verify_topk(bank, ops, prow, scores_in, rows_in, k)
    assert torch.equal(got_r, want_r)
    assert torch.equal(got_s, want_s)



def test_cpu_quantize_queries_is_bit_identical_to_torch():
    from silverrec.kernels import common

    g = torch.Generator().manual_seed(1)
    q = torch.cat([torch.randn(7, 33, generator=g) * 10, torch.zeros(1, 33), torch.full((1, 33), 0.5)])
    q[0, :5] = torch.tensor([127.0, -127.0, 63.5, -0.5, 1.5]) / 127.0 * q[0].abs().max()  # halfway cases
    (c1, s1), (c2, s2) = host().quantize_queries(q), common.quantize_queries(q)
    assert torch.equal(c1, c2) and torch.equal(s1, s2)
