"""`QueryTower`: the user tower of a pure-ANN snapshot, whose caller computed the user already.

A snapshot published from a pool of item embeddings (`silverrec publish --pool`) is the same root
module as a recommendation snapshot (`RecModel`) without ranking stages: its "user" is the query
embedding the request carries in its dense tensor, one task. The KJT inputs are accepted and
ignored, so both configurations share one forward signature, one exporter and one predictor.
"""

from __future__ import annotations

from torch import Tensor, nn


class QueryTower(nn.Module):
    """(values int64 [nnz], lengths int32 [*], dense float32 [B, D]) -> float32 [B, 1, D]: the query
    embeddings as the single task's user embedding."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = int(dim)

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor) -> Tensor:
        return dense.unsqueeze(1)
