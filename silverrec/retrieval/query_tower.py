"""The user towers of models whose caller computed the user already, or that need none.

`QueryTower`: a snapshot published from a pool of item embeddings (`silverrec publish --pool`) is
the same root module as a recommendation snapshot (`RecModel`) without ranking stages: its "user"
is the query embedding the request carries in its dense tensor, one task.
`NoTower`: the generative decode alone reads the user's history rows, no embedding.
The KJT inputs are accepted and ignored, so every configuration shares one forward signature, one
exporter and one predictor.
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


class NoTower(nn.Module):
    """(values, lengths, dense float32 [B, Fd]) -> float32 [B, 1, 0]: no user embedding (the decode
    alone ranks)."""

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor) -> Tensor:
        return dense[:, None, :0]
