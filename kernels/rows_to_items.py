"""`silverrec::rows_to_items`: internal index rows -> external item ids, the last step of every search.

    ids = torch.ops.silverrec.rows_to_items(row_to_item, rows)
    # row_to_item int32 / int64 [N] (retrieval/item_ids.py compact_item_ids), rows int64 (any shape,
    # -1 = no result) -> ids int64, same shape, -1 where rows is -1

A row >= N is an IndexError. CPU: one C++ pass (kernels/csrc/ops.cpp); the torch formula below
(clamp, index, cast, where: four kernels and three temporaries) is the CUDA kernel and the tests'
reference. At k = 4096 and batch 16 the four kernels cost about a third of a selective filtered
search (benchmarks/filter.py), so the map is one op.
"""

from __future__ import annotations

import torch


def rows_to_items_torch(row_to_item: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The reference (device-generic): row_to_item[rows] as int64, -1 kept."""
    ids = row_to_item[rows.clamp_min(0)].to(torch.int64)
    return torch.where(rows >= 0, ids, torch.full_like(ids, -1))


torch.library.register_kernel("silverrec::rows_to_items", "cuda", rows_to_items_torch)
