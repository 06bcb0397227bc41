"""The kernels' interfaces: narrow op schemas and the search ops' argument layouts (kernels/ at the bottom of
the imports: tests/test_layering.py).

- No `torch.library` schema of silverrec takes more than 12 arguments: an index travels as a tensor list
  and an int list with named positions (kernels/constants.py), not as a row of positional arguments.
- The retrieval stage builds the search ops' lists in the orders the constants name (the C++ kernel reads
  them by those positions: a list built in another order would search the wrong tensors).
"""

import torch

import silverrec.kernels  # noqa: F401  (registers the ops)
from silverrec.kernels.constants import FILTERED_IVF_PARAMS, FILTERED_IVF_TENSORS, IVF_PARAMS, IVF_TENSORS
from silverrec.retrieval.filtered_ivf import FilteredIVFIndex
from silverrec.retrieval.ivf_index import Int8IVFIndex

MAX_ARGUMENTS = 12


def test_no_silverrec_op_takes_more_than_twelve_arguments():
    schemas = {s.name: len(s.arguments) for s in torch._C._jit_get_all_schemas() if s.name.startswith("silverrec::")}
    assert {"silverrec::ivf_search", "silverrec::filtered_ivf_search", "silverrec::filter_plan",
            "silverrec::filtered_topk", "silverrec::mol_score"} <= set(schemas)
    wide = {name: n for name, n in schemas.items() if n > MAX_ARGUMENTS}
    assert not wide, f"op schemas over {MAX_ARGUMENTS} arguments: {wide}"


def _index(n=300, d=8, nlist=5) -> FilteredIVFIndex:
    g = torch.Generator().manual_seed(0)
    off = torch.linspace(0, n, nlist + 1).long()
    ivf = Int8IVFIndex(torch.randint(-100, 100, (n, d), dtype=torch.int8, generator=g), torch.rand(d) + 0.1,
                       torch.zeros(d), off, torch.randn(nlist, d, generator=g), torch.arange(n) * 3)
    bits = torch.zeros(2, (n + 63) // 64, dtype=torch.int64)
    return FilteredIVFIndex.from_ivf(ivf, bits, post_rows=torch.arange(4, dtype=torch.int32),
                                     post_offsets=torch.tensor([0, 4]), posting_limit=9)


def test_the_search_lists_follow_the_named_layouts():
    index = _index()
    for got, names in ((index.index_tensors(), IVF_TENSORS), (index.filtered_index_tensors(), FILTERED_IVF_TENSORS)):
        assert len(got) == len(names) and all(t is getattr(index, name) for t, name in zip(got, names))
    assert index.ivf_params == [int(getattr(index, name)) for name in IVF_PARAMS]
    assert index.filtered_params == [int(getattr(index, name)) for name in FILTERED_IVF_PARAMS]
    rows_map = index.filtered_index_tensors(item_ids=False)[FILTERED_IVF_TENSORS.index("row_to_item")]
    assert rows_map.numel() == 0  # the ops return rows

