"""silverrec::int8_topk against an independent integer reference and float brute force."""

import pytest
import torch

from silverrec.kernels.common import quantize_queries
from silverrec.kernels.int8_topk import int8_topk_reference, topk_keys_cpu
from silverrec.kernels.common import split_keys
from silverrec.publish.quantize import quantize_global
from tests.helpers import inner_product_topk, load_ann, recall


def _op(queries, codes, k, scale=0.5, offset=0.25):
    return torch.ops.silverrec.int8_topk(queries, codes, torch.tensor(scale), torch.tensor(offset), k)


@pytest.mark.parametrize("n,d,b", [(1, 8, 1), (257, 13, 5), (5000, 64, 19), (70000, 24, 3)])
@pytest.mark.parametrize("k_frac", [0.0, 0.1, 1.0])
def test_matches_integer_reference(n, d, b, k_frac):
    codes = torch.randint(-128, 128, (n, d), dtype=torch.int8)
    queries = torch.randn(b, d)
    k = max(1, int(n * k_frac))
    scores, rows = _op(queries, codes, k)
    ref_scores, ref_rows = int8_topk_reference(queries, codes, k)
    assert torch.equal(rows, ref_rows)
    assert scores.shape == (b, k) and scores.dtype == torch.float32
    assert bool((scores[:, :-1] >= scores[:, 1:]).all())


def test_ties_break_by_lower_row_across_chunks():
    # Few distinct values -> massive ties; a small chunk forces the threshold/merge path.
    codes = torch.randint(-1, 2, (3000, 4), dtype=torch.int8)
    queries = torch.randn(6, 4)
    qcodes, _ = quantize_queries(queries)
    for k in (1, 7, 500, 3000):
        keys = topk_keys_cpu(qcodes, codes, k, chunk=256)
        int_scores, rows = split_keys(keys)
        ref_scores, ref_rows = int8_topk_reference(queries, codes, k)
        assert torch.equal(rows, ref_rows), k
        assert torch.equal(int_scores, ref_scores), k


def test_scores_are_dequantised_inner_products():
    emb = torch.randn(2000, 32)
    codes, scale, offset = quantize_global(emb)
    queries = torch.randn(4, 32)
    scores, rows = torch.ops.silverrec.int8_topk(queries, codes, scale, offset, 10)
    exact = (queries[:, None, :] * emb[rows]).sum(-1)
    # int8 on both sides: error bounded by the quantisation steps.
    assert torch.allclose(scores, exact, atol=0.05 * exact.abs().max().item())


@pytest.mark.parametrize("name,floor", [("bigann10k", 0.97), ("fmnistsmall", 0.97)])
def test_recall_vs_float_brute_force_on_real_vectors(name, floor):
    """Global int8 quantisation of real vectors keeps recall@100 >= floor.

    SIFT values are small integers (exact after affine int8 mapping up to rounding of the scale);
    Fashion-MNIST pixels 0..255 map to 256 levels, so both keep nearly all neighbours; the floor
    leaves room only for near-ties at the boundary.
    """
    base, queries = load_ann(name)
    queries = queries[:100]
    truth = inner_product_topk(base, queries, 100)
    codes, scale, offset = quantize_global(torch.from_numpy(base))
    _, rows = torch.ops.silverrec.int8_topk(torch.from_numpy(queries), codes, scale, offset, 100)
    r = recall(rows.numpy(), truth)
    assert r >= floor, f"{name}: recall@100 {r:.4f} < {floor}"


def test_bad_arguments():
    codes = torch.zeros(10, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="k must be in"):
        _op(torch.randn(2, 4), codes, 11)
    with pytest.raises(ValueError, match="k must be in"):
        _op(torch.randn(2, 4), codes, 0)
    with pytest.raises(ValueError, match="queries must be"):
        _op(torch.randn(2, 5), codes, 3)
    with pytest.raises(ValueError, match="codes must be int8"):
        _op(torch.randn(2, 4), codes.float(), 3)


def test_export_keeps_one_opaque_node():
    from torch.export import Dim

    from silverrec.retrieval.item_ids import rows_to_items
    from silverrec.snapshot import export_program

    class ExactTopK(torch.nn.Module):  # the op over one int8 matrix, ids mapped at the end
        def __init__(self):
            super().__init__()
            self.register_buffer("codes", torch.randint(-128, 128, (100, 8), dtype=torch.int8))
            self.register_buffer("row_to_item", torch.arange(100) * 10)

        def forward(self, queries, k: int):
            scores, rows = torch.ops.silverrec.int8_topk(queries, self.codes, torch.tensor(0.1), torch.tensor(0.0), k)
            return scores, rows_to_items(self.row_to_item, rows)

    index = ExactTopK()
    ep = export_program(index, (torch.randn(2, 8), 3),
                        {"queries": {0: Dim("b", min=1, max=64)}, "k": Dim.DYNAMIC})
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum("silverrec.int8_topk" in t for t in targets) == 1
    for b, k in ((5, 1), (1, 17), (1, 1)):
        q = torch.randn(b, 8)
        s1, i1 = ep.module()(q, k)
        s2, i2 = index(q, k)
        assert torch.equal(i1, i2) and torch.equal(s1, s2)
    assert bool((i1 % 10 == 0).all())
