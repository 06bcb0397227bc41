"""The row -> item id map of an index: stored compactly, applied once at the end of a search."""

import numpy as np
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


class ItemRows:
    """Item id -> canonical row, on the host (numpy): the predictor's lookup of the ids a request sends.

    Compact ids (all >= 0, the largest below max(16 N, 2**20)) get a dense table (int32, one slot per
    id up to the largest, plus a -1 sentinel): a lookup is one clip and one gather, an order of magnitude
    faster than the binary search. Other ids: a binary search
    over the sorted ids.
    """

    def __init__(self, row_to_item) -> None:
        ids = np.asarray(row_to_item, dtype=np.int64)
        self.table = None
        if ids.size and ids.min() >= 0 and ids.max() < max(16 * ids.size, 1 << 20):
            self.table = np.full(int(ids.max()) + 2, -1, dtype=np.int32)  # the last slot: the sentinel
            self.table[ids] = np.arange(ids.size, dtype=np.int32)
        else:  # the binary search's arrays
            self.order = np.argsort(ids, kind="stable")
            self.sorted_ids = ids[self.order]
        self.torch_table = None if self.table is None else torch.from_numpy(self.table)  # the C++ lookup's view

    def rows_or_minus_one(self, item_ids):
        """Item ids int64 [n] -> rows int64 [n], -1 where an id is not in the pool."""
        if self.table is not None:  # an id < 0 clips to -1 and one above the largest to the last slot: the sentinel
            return self.table[item_ids.clip(-1, len(self.table) - 1)].astype(np.int64)
        if not len(self.sorted_ids):  # an empty pool
            return np.full(len(item_ids), -1, dtype=np.int64)
        pos = np.searchsorted(self.sorted_ids, item_ids).clip(0, len(self.sorted_ids) - 1)
        return np.where(self.sorted_ids[pos] == item_ids, self.order[pos], -1).astype(np.int64)
