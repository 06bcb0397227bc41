"""The Triton int8 top-k kernel, run by Triton's interpreter on CPU tensors, equals the reference."""

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "conftest sets TRITON_INTERPRET=1 before triton loads"
triton = pytest.importorskip("triton")

from silverrec.kernels.common import make_keys  # noqa: E402
from silverrec.kernels.int8_topk import _int8_topk_impl, int8_topk_reference  # noqa: E402
from silverrec.kernels.int8_topk_triton import score_keys_triton, topk_keys_triton  # noqa: E402


@pytest.mark.parametrize("b,c,d", [(1, 1, 1), (5, 300, 40), (17, 129, 130)])
def test_score_keys_bit_exact(b, c, d):
    q = torch.randint(-127, 128, (b, d), dtype=torch.int8)
    x = torch.randint(-128, 128, (c, d), dtype=torch.int8)
    keys = score_keys_triton(q, x, row_base=11)
    ref = make_keys(q.long() @ x.long().T, torch.arange(11, 11 + c)[None, :])
    assert torch.equal(keys, ref)


@pytest.mark.parametrize("k", [1, 33, 400])
def test_topk_equals_reference(k):
    codes = torch.randint(-3, 4, (400, 24), dtype=torch.int8)  # many ties
    queries = torch.randn(3, 24)
    scores, rows = _int8_topk_impl(queries, codes, torch.tensor(0.1), torch.tensor(0.0), k,
                                   lambda qc, c, kk: topk_keys_triton(qc, c, kk, chunk=128))
    _, ref_rows = int8_topk_reference(queries, codes, k)
    assert torch.equal(rows, ref_rows)
    cpu_scores, _ = torch.ops.silverrec.int8_topk(queries, codes, torch.tensor(0.1), torch.tensor(0.0), k)
    assert torch.equal(scores, cpu_scores)
