"""`ExactInt8Index`: exact top-k by inner product over int8 item codes, as an nn.Module."""

import torch
from torch import nn

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.*)


class ExactInt8Index(nn.Module):
    """Brute-force int8 inner-product search; the whole pool is one int8 matrix.

    Buffers:
        codes: int8 [N, D] item codes, item ~= scale * code + offset.
        scale, offset: float32 [] global quantisation parameters.
        row_to_item: int32 or int64 [N] external item id of each row (see `compact_item_ids`).

    Example:
        >>> index = ExactInt8Index(codes, scale, offset, row_to_item)
        >>> scores, item_ids = index(queries, 100)   # [B, 100] each
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, row_to_item: torch.Tensor):
        super().__init__()
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(torch.float32).reshape(()))
        self.register_buffer("offset", offset.to(torch.float32).reshape(()))
        self.register_buffer("row_to_item", compact_item_ids(row_to_item))

    def forward(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """queries float [B, D], k <= N -> (scores float32 [B, k], item_ids int64 [B, k])."""
        scores, rows = torch.ops.silverrec.int8_topk(queries, self.codes, self.scale, self.offset, k)
        return scores, rows_to_items(self.row_to_item, rows)


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
    """Map internal rows int64 [B, k] to external item ids int64; row -1 (padding) stays -1."""
    ids = row_to_item[rows.clamp_min(0)].to(torch.int64)
    return torch.where(rows >= 0, ids, torch.full_like(ids, -1))
