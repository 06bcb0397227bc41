"""`RecModel`: every snapshot's root module, one forward call per request batch.

    request (KJT of user features, dense, filter programs, rows to exclude, history rows, source
    flags, k, k0, nprobe, max_probe)
      -> user tower                                        -> user embeddings [B, T, D]
      -> filter template (filled from the user's features, ANDed with the request's filters)
      -> retrieval sources (the filtered int8 IVF search + the cache/merge step; the beam decode;
         or their union)                                   -> Candidates (rows [B, C], ...)
      -> OverArch stage (MLP | mixture-of-logits | list-wise over the cache, the exact re-score, or
         the source's own score)                           -> task scores [B, C, T]
      -> value stage (compiled formula, or task 0)         -> value [B, C]
      -> top-k stage                                       -> item ids, scores, task scores, rows,
                                                              found_by, source scores

Each stage is a module with one signature for all its kinds (silverrec/retrieval/sources.py,
generative/source.py, ranking/stages.py, ranking/top_k.py); `silverrec.compose.compose(spec,
parts)` builds the stages a `ModelSpec` names and is the only place a RecModel is made. The
configurations (spec.py): a pure-ANN index (query tower, the search ranks), a recommendation
model (trained or a team's own tower, cache, OverArch, value model), a hybrid (ANN + decode), the
decode alone (no user embedding).

Every stage passes **rows** of one canonical row space (the IVF's cluster-major order; the trie's
for the decode alone); item ids appear only at the end (or straight from a pure-ANN search).

`rank` is the early-stage ranking entry point: score given rows for a user (OverArch and value
stages on those rows, and what the retrieval stage knows of them: the next-item transitions' P), no
retrieval and no item tower.

No host synchronisation in either entry point (the request's tensors are built by the predictor,
`silverrec/serving/recommend.py`).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor, nn



class RecModel(nn.Module):
    """The root module of a snapshot (module docstring). Made by `silverrec.compose.compose`.

    Args (the stages, each a module; compose.py names the kinds):
        user_tower: (values, lengths, dense) -> float32 [B, T, D].
        filter_template: (values, lengths, ops, rows, vops, vrows, lists) -> the filled programs.
        sources: the retrieval stage -> Candidates.
        overarch: (user, Candidates) -> task scores float32 [B, C, T].
        value_model: (task scores, Candidates) -> value float32 [B, C], -inf at padding.
        top_k: (user, Candidates, value, task scores, k) -> the answer.
        spec: the ModelSpec it was composed from (not part of the programs).
    """

    __jit_ignored_attributes__ = ["spec"]

    def __init__(self, user_tower: nn.Module, filter_template: nn.Module, sources: nn.Module, overarch: nn.Module,
                 value_model: nn.Module, top_k: nn.Module, spec):
        super().__init__()
        self.user_tower = user_tower
        self.filter_template = filter_template
        self.sources = sources
        self.overarch = overarch
        self.value_model = value_model
        self.top_k = top_k
        self.spec = spec

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor,
                vops: Tensor, vrows: Tensor, lists: Tensor, mode: Tensor, history: Tensor, sources: Tensor, k: int,
                k0: int, nprobe: int, max_probe: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """One request batch.

        Args:
            values int64 [nnz], lengths int32 [F*B], dense float32 [B, Fd]: the user features (a KJT;
                a pure-ANN index: dense is the query embedding).
            exclude int64 [B, E]: rows never to return, any order, -1 = none (E >= 1).
            ops, rows, vops, vrows, lists: the B filter programs (filter_program.compile_request).
            mode int64 [B]: filter search mode per request (filtered_ivf.MODES).
            history int64 [B, H]: the user's history as canonical rows, oldest first, left-padded with
                -1 (the decode's input; other models ignore it).
            sources bool [B, 2]: the retrieval sources each request uses (candidates.SOURCE_* columns).
            k results (at most the candidates ranked); k0 candidates per task; 1 <= nprobe <=
            max_probe <= nlist.
        Returns:
            item_ids int64 [B, k] (-1 = none), scores float32 [B, k] (-inf = none), task scores float32
            [B, k, T], rows int64 [B, k] (canonical, -1 = none; [B, 0] from a pure-ANN search that
            maps rows to ids itself), found_by int64 [B, k] and source scores float32 [B, k, 2] (a
            union or the decode; [B, 0] and [B, 0, 2] otherwise): ranking/top_k.py.
        """
        user = self.user_tower(values, lengths, dense)
        ops, rows, vops, vrows, lists = self.filter_template(values, lengths, ops, rows, vops, vrows, lists)
        cand = self.sources(user, exclude, ops, rows, vops, vrows, lists, mode, history, sources, k, k0, nprobe,
                            max_probe)
        task_scores = self.overarch(user, cand)
        value = self.value_model(task_scores, cand)
        return self.top_k(user, cand, value, task_scores, k)

    @torch.jit.export
    def rank(self, values: Tensor, lengths: Tensor, dense: Tensor, rows: Tensor) -> Tuple[Tensor, Tensor]:
        """Early-stage ranking: rows int64 [B, C] (-1 = none) -> (value float32 [B, C], task scores
        float32 [B, C, T]) from the OverArch and value stages (with next-item transitions: value + w P,
        as `forward` ranks them, P given the newest row of the history in the user features)."""
        user = self.user_tower(values, lengths, dense)
        cand = self.sources.given(values, lengths, rows)
        task_scores = self.overarch(user, cand)
        return self.value_model(task_scores, cand), task_scores


class RankEntry(nn.Module):
    """`RecModel.rank` as a forward, for torch.export (which exports one method per program)."""

    def __init__(self, model: RecModel):
        super().__init__()
        self.model = model

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor, rows: Tensor) -> Tuple[Tensor, Tensor]:
        return self.model.rank(values, lengths, dense, rows)
