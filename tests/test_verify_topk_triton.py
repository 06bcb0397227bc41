"""The Triton verify_topk (TRITON_INTERPRET=1, conftest) equals the C++ op and the per-entry reference.

Reference: each program over the whole pool by the independent stack machine (`_allowed`), then
the first k entries of each ranked list whose row is allowed, in input order.
"""

from __future__ import annotations

import pytest
import torch

from silverrec.kernels.constants import OP_FALSE, OP_TRUE
from tests.test_cpu_scan import _programs
from tests.test_filtered_topk import _allowed, _bank

pytest.importorskip("triton")
from silverrec.kernels.verify_topk_triton import verify_topk_triton  # noqa: E402


def first_passing(scores_in, rows_in, allowed, k):
    """(float32 [B, k], int64 [B, k]): per query, the allowed entries in input order, first k, padded."""
    out_s = torch.full((rows_in.shape[0], k), float("-inf"))
    out_r = torch.full((rows_in.shape[0], k), -1, dtype=torch.int64)
    for b in range(rows_in.shape[0]):
        keep = [i for i, r in enumerate(rows_in[b].tolist()) if r >= 0 and bool(allowed[b, r])][:k]
        out_s[b, : len(keep)] = scores_in[b, keep]
        out_r[b, : len(keep)] = rows_in[b, keep]
    return out_s, out_r


@pytest.mark.parametrize(
    "b, k2, k, block",
    [
        (1, 1, 1, 16),  # one entry
        (6, 50, 20, 16),  # several tiles, most queries stop early
        (4, 300, 120, 32),  # k close to the passing entries
        (3, 10, 25, 16),  # fewer entries than k: padding
        (5, 70, 8, 128),  # one tile holds everything (the CUDA tile)
    ],
)
def test_triton_verify_equals_cpu_and_reference(b, k2, k, block):
    g = torch.Generator().manual_seed(b * 1000 + k2)
    n = 1000  # not a multiple of 64: rows up to 1023 still have bank bits
    bank = _bank(7, n, g)
    ops, prog = _programs(b, 6, 2, 7, g)
    if b >= 3:
        ops[1], prog[1] = 0, 0
        ops[1, 0] = OP_FALSE  # nothing passes
        ops[2], prog[2] = 0, 0
        ops[2, 0] = OP_TRUE  # every real row passes
    rows_in = torch.stack([torch.randint(0, 64 * bank.shape[1], (k2,), generator=g) for _ in range(b)])
    rows_in[0, k2 // 2 :] = -1  # padding tail
    if k2 > 4:
        rows_in[-1, 1::4] = -1  # padding inside the list
    scores_in = torch.sort(torch.randint(-5, 5, (b, k2), generator=g).float(), dim=1, descending=True).values  # ties
    want = first_passing(scores_in, rows_in, _allowed(bank, ops, prog, 64 * bank.shape[1]), k)
    got = verify_topk_triton(bank, ops, prog, scores_in, rows_in, k, block=block)
    cpu = torch.ops.silverrec.verify_topk(bank, ops, prog, scores_in, rows_in, k)
    for s, r in (got, cpu):
        assert torch.equal(r, want[1])
        assert torch.equal(s, want[0])


def test_rows_past_the_bank_never_pass():
    """A row beyond the bank's words reads no bits (the torch path's rule; the C++ op rejects it)."""
    bank = torch.full((2, 3), -1, dtype=torch.int64)  # every row of the bank passes a TRUE-ish program
    ops = torch.tensor([[1, 4, 4]])  # PUSH row 0, NOT, NOT: bits of row 0
    prog = torch.zeros(1, 3, 1, dtype=torch.int64)
    rows_in = torch.tensor([[191, 192, 5000, 0]])
    scores, rows = verify_topk_triton(bank, ops, prog, torch.tensor([[4.0, 3.0, 2.0, 1.0]]), rows_in, 3)
    assert rows.tolist() == [[191, 0, -1]] and scores.tolist() == [[4.0, 1.0, float("-inf")]]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_tiles_continue_until_k_passed(k):
    """Exactly 2 passing entries in the first tile of 16: later tiles start their slots after them."""
    bank = torch.tensor([[0x5555555555555555]])  # even rows pass PUSH row 0
    ops, prog = torch.tensor([[1]]), torch.zeros(1, 1, 1, dtype=torch.int64)
    rows_in = torch.tensor([[1, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 8, 27] + [29] * 16 + [30, 31, 32]])
    scores_in = -torch.arange(rows_in.shape[1], dtype=torch.float32)[None, :]
    scores, rows = verify_topk_triton(bank, ops, prog, scores_in, rows_in, k, block=16)
    want = [4, 8, 30, 32][:k]
    assert rows.tolist() == [want] and scores.tolist() == [[-float(rows_in[0].tolist().index(r)) for r in want]]
