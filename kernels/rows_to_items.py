"""`silverrec::rows_to_items`: internal index rows -> external item ids, the last step of every search.

    ids = torch.ops.silverrec.rows_to_items(row_to_item, rows)
    # row_to_item int32 / int64 [N] (retrieval/item_ids.py compact_item_ids), rows int64 (any shape,
    # -1 = no result) -> ids int64, same shape, -1 where rows is -1

A row >= N is an IndexError. CPU: one C++ pass (kernels/csrc/ops.cpp, registered with the
dispatcher when the extension loads); the torch formula below (clamp, index, cast, where: four
kernels and three temporaries) is the reference, the CUDA path and the fallback without the
extension. At k = 4096 and batch 16 the four kernels cost about a third of a selective filtered
search (benchmarks/filter.py), so the map is one op.
"""

from __future__ import annotations

import torch


def rows_to_items_torch(row_to_item: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The reference (device-generic): row_to_item[rows] as int64, -1 kept."""
    ids = row_to_item[rows.clamp_min(0)].to(torch.int64)
    return torch.where(rows >= 0, ids, torch.full_like(ids, -1))


# Defined before kernels/filtered_ivf_search.py loads the C++ extension, which registers the CPU kernel.
torch.library.define("silverrec::rows_to_items", "(Tensor row_to_item, Tensor rows) -> Tensor")
torch.library.impl("silverrec::rows_to_items", "CUDA", rows_to_items_torch)


def register_cpu_fallback() -> None:
    """CPU kernel when the extension is not built (kernels/filtered_ivf_search.py calls this)."""
    torch.library.impl("silverrec::rows_to_items", "CPU", rows_to_items_torch)


@torch.library.register_fake("silverrec::rows_to_items")
def _(row_to_item, rows):
    return rows.new_empty(rows.shape, dtype=torch.int64)
