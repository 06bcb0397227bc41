"""`Candidates`: what the retrieval stage of `RecModel` hands to the ranking stages, and the names
of the retrieval sources.

Every field is indexed [b, c]: request b's candidate c. A field that a configuration's sources do
not produce has width 0 (one slice, no tensor filled per call): a pure-ANN search maps its rows to
item ids itself (`ids`) and may return no `rows`; only a decode fills `log_prob`; only a union of
two sources fills `found_by`. `RetrievalStage.given` makes the candidates of the `rank` entry point
(`rows_only`, or with the next-item transitions' P).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

SOURCES = ("ann", "generative")  # retrieval sources, in the column order of the request's `sources` flags
SOURCE_ANN, SOURCE_GENERATIVE = 0, 1  # columns of `sources` bool [B, 2]
FOUND_ANN, FOUND_GENERATIVE = 1, 2  # bits of `found_by`


class Candidates(NamedTuple):
    """rows int64 [B, C] canonical rows (-1 = none); found_by int64 [B, C] FOUND_* bits (0 at padding);
    log_prob float32 [B, C] the decoder's summed log-prob (-inf = none); scores float32 [B, C] the
    source's own score: the ranking score of a source that ranks alone, or the next-item
    transitions' P(row | the newest history item) (retrieval/transitions.py); ids int64 [B, C] item ids (a source that
    maps rows to ids itself). Width 0 where not produced (module docstring)."""

    rows: Tensor
    found_by: Tensor
    log_prob: Tensor
    scores: Tensor
    ids: Tensor


def rows_only(rows: Tensor) -> Candidates:
    """Candidates that are given rows int64 [B, C] and nothing else (`RecModel.rank`)."""
    none = rows[:, :0]
    return Candidates(rows, none, none.float(), none.float(), none)


class RetrievalStage(nn.Module):
    """The base of every retrieval stage of `RecModel` (its `sources`): the forward finds candidates
    (silverrec/retrieval/sources.py's signature); `given` says what the stage knows of rows given by the
    request (the `rank` entry point): nothing here, the next-item transitions' P where it has them
    (retrieval/transitions.py)."""

    def given(self, values: Tensor, lengths: Tensor, rows: Tensor) -> Candidates:
        """The request's user features (values int64 [nnz], lengths int32 [F * B], as the user tower
        reads them) and given rows int64 [B, C] (-1 = none) -> their Candidates."""
        return rows_only(rows)
