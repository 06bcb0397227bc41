"""`ExactInt8Index`: exact top-k by inner product over int8 item codes, as an nn.Module."""

import torch
from torch import nn

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.*)


class ExactInt8Index(nn.Module):
    """Brute-force int8 inner-product search; the whole pool is one int8 matrix.

    Buffers:
        codes: int8 [N, D] item codes, item ~= scale * code + offset.
        scale, offset: float32 [] global quantisation parameters.
        row_to_item: int64 [N] external item id of each row.

    Example:
        >>> index = ExactInt8Index(codes, scale, offset, row_to_item)
        >>> scores, item_ids = index(queries, 100)   # [B, 100] each
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, row_to_item: torch.Tensor):
        super().__init__()
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(torch.float32).reshape(()))
        self.register_buffer("offset", offset.to(torch.float32).reshape(()))
        self.register_buffer("row_to_item", row_to_item.to(torch.int64).contiguous())

    def forward(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """queries float [B, D], k <= N -> (scores float32 [B, k], item_ids int64 [B, k])."""
        scores, rows = torch.ops.silverrec.int8_topk(queries, self.codes, self.scale, self.offset, k)
        return scores, rows_to_items(self.row_to_item, rows)


def rows_to_items(row_to_item: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Map internal rows int64 [B, k] to external item ids; row -1 (padding) stays -1."""
    ids = row_to_item[rows.clamp_min(0)]
    return torch.where(rows >= 0, ids, torch.full_like(ids, -1))
