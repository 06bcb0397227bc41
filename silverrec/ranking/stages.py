"""The ranking stages of `RecModel`, between its retrieval stage and its top-k stage.

    task scores = overarch stage(user float32 [B, T, D], Candidates)  -> float32 [B, C, T]
    value       = value stage(task scores, Candidates)                  -> float32 [B, C]

OverArch stages, by configuration (silverrec/compose.py picks one):
    ExactScores   no OverArch: the embedding cache's exact re-score of each task (-inf at padding)
    RowOverArch   an OverArch that reads the cache's rows itself (`score_rows`; MoL: one op)
    PairOverArch  any other OverArch: the cache's rows gathered, then `score` (pointwise or list-wise)
    SourceScores  no cache: the source's own ranking score is the one task score (a pure-ANN
                  search, the decode alone)
Value stages:
    ValueStage    the value model formula over the task scores and the cached item features
    FirstTask     task 0's score
    SourceValue   no cache: the source's own score (no op)
    TransitionValue  another value stage + w * P(row | the newest history item), the next-item
                  transitions' probability (retrieval/transitions.py)
Every stage of a model with a cache sets -inf at padding (row -1): an OverArch's padded scores are
finite, and the top-k stage takes the value's order.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from silverrec.candidates import Candidates
from silverrec.ranking.cache import EmbeddingCache


class ExactScores(nn.Module):
    """Task scores = <user[b, t], emb[row]> (float32 arithmetic on the cache's bf16 values), -inf at padding."""

    def __init__(self, cache: EmbeddingCache):
        super().__init__()
        self.cache = cache

    def forward(self, user: Tensor, cand: Candidates) -> Tensor:
        return self.cache.rescore(user, cand.rows)


class RowOverArch(nn.Module):
    """An OverArch with `score_rows(user, rows, emb, ranker)` (MoLOverArch: silverrec::mol_score) over
    the cache's embeddings and its item side (`ranker`, computed once per item at compose)."""

    def __init__(self, cache: EmbeddingCache, overarch: nn.Module):
        super().__init__()
        self.cache = cache
        self.overarch = overarch

    def forward(self, user: Tensor, cand: Candidates) -> Tensor:
        return self.overarch.score_rows(user, cand.rows, self.cache.emb, self.cache.ranker)


class PairOverArch(nn.Module):
    """An OverArch's `score(user, cand, item side, valid)` on the gathered cached rows."""

    def __init__(self, cache: EmbeddingCache, overarch: nn.Module):
        super().__init__()
        self.cache = cache
        self.overarch = overarch

    def forward(self, user: Tensor, cand: Candidates) -> Tensor:
        rows = cand.rows
        return self.overarch.score(user, self.cache.embeddings(rows), self.cache.item_sides(rows), rows >= 0)


class SourceScores(nn.Module):
    """The retrieval source ranked: its scores float32 [B, C] as the one task's [B, C, 1]."""

    def forward(self, user: Tensor, cand: Candidates) -> Tensor:
        return cand.scores.unsqueeze(2)


class ValueStage(nn.Module):
    """The value model (ranking/value_model.py) over the task scores and the cached item features;
    -inf at padding (its value there is meaningless, possibly NaN)."""

    def __init__(self, value_model: nn.Module, cache: EmbeddingCache):
        super().__init__()
        self.value_model = value_model
        self.cache = cache

    def forward(self, task_scores: Tensor, cand: Candidates) -> Tensor:
        rows = cand.rows
        value = self.value_model(task_scores, self.cache.features(rows))
        return torch.where(rows >= 0, value, float("-inf"))


class FirstTask(nn.Module):
    """Task 0's score as the value, -inf at padding rows (an OverArch's padded scores are finite)."""

    def forward(self, task_scores: Tensor, cand: Candidates) -> Tensor:
        return torch.where(cand.rows >= 0, task_scores[:, :, 0], float("-inf"))


class SourceValue(nn.Module):
    """No cache: the source's own score is the value (-inf where it found nothing), as it is the one
    task score (`SourceScores`)."""

    def forward(self, task_scores: Tensor, cand: Candidates) -> Tensor:
        return cand.scores


class TransitionValue(nn.Module):
    """value + weight * P(row | the newest history item): a value stage (ValueStage or FirstTask) plus
    the next-item transitions' probability, which `TransitionSource` hands over as `cand.scores`
    (float32 [B, C], 0 where the chain lists no such step), in `forward` and in `rank` (its `given`).
    The weight is chosen on the validation items at publish (publish/transitions.py)."""

    def __init__(self, value: nn.Module, weight: float):
        super().__init__()
        self.value = value
        self.weight = float(weight)

    def forward(self, task_scores: Tensor, cand: Candidates) -> Tensor:
        return self.value(task_scores, cand) + self.weight * cand.scores  # -inf at padding stays -inf
