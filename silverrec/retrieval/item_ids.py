"""The row -> item id map of an index: stored compactly, applied once at the end of a search."""

import torch

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.rows_to_items)


def compact_item_ids(item_ids: torch.Tensor) -> torch.Tensor:
    """The row -> item id map as int32 when every id fits (half the memory of int64), else int64.

    For small embeddings the id map is a visible part of the index (at D=32, int64 ids are 25% of
    the int8 codes); responses are always int64.
    """
    ids = item_ids.to(torch.int64).contiguous()
    info = torch.iinfo(torch.int32)
    if ids.numel() == 0 or (int(ids.min()) >= info.min and int(ids.max()) <= info.max):
        return ids.to(torch.int32)
    return ids


def rows_to_items(row_to_item: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Map internal rows int64 [B, k] to external item ids int64; row -1 (padding) stays -1
    (`silverrec::rows_to_items`, kernels/rows_to_items.py: one pass on CPU)."""
    return torch.ops.silverrec.rows_to_items(row_to_item, rows)
