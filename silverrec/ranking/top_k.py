"""The last stage of `RecModel`: the k best candidates and what the predictor returns of them.

    top-k stage(user float32 [B, T, D], Candidates, value float32 [B, C], task scores [B, C, T], k)
        -> item_ids int64 [B, k] (-1 = none), scores float32 [B, k] (-inf = none), task scores
           float32 [B, k, T], rows int64 [B, k] (canonical, -1 = none), found_by int64 [B, k]
           (FOUND_* bits, 0 = none), source scores float32 [B, k, 2] (per source, -inf = not found)

By configuration (silverrec/compose.py picks one):
    TopK       one source with a cache: the k best by value; found_by [B, 0] and source scores
               [B, 0, 2] (one source found every candidate)
    FusedTopK  the union of two sources: ranked by `fuse_sources` (value + w x the decode's
               log-prob, the source priority's rows first); found_by, and source scores = the exact
               re-score of task 0 (ANN) and the decoder's log-prob
    Ranked     a source that ranked alone (the pure-ANN search; the decode alone): its first k,
               in its order (the decode keeps its beam order, ties included); a pure-ANN search
               gives found_by [B, 0] and source scores [B, 0, 2], the decode found_by
               FOUND_GENERATIVE and its log-prob
Width-0 outputs cost nothing per call; the predictor reports them as absent. Item ids come from
`silverrec::rows_to_items` (registered by silverrec.kernels, which the retrieval stages import:
ranking/ imports nothing of retrieval/ or kernels/).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor, nn

from silverrec.candidates import FOUND_ANN, FOUND_GENERATIVE, Candidates
from silverrec.ranking.cache import EmbeddingCache
from silverrec.spec import PRIORITIES

Answer = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def best(rows: Tensor, key: Tensor, task_scores: Tensor, k: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The k best candidates rows int64 [B, C] by key float32 [B, C] -> (key [B, k], rows [B, k],
    task scores [B, k, T], their positions in `rows` [B, k]); -1 / -inf where fewer than k
    candidates have a key above -inf."""
    top_key, top = torch.topk(key, k, dim=1)
    top_rows = torch.where(top_key > float("-inf"), rows.gather(1, top), -1)
    tasks = task_scores.gather(1, top[:, :, None].expand(-1, -1, task_scores.shape[2]))
    return top_key, top_rows, tasks, top


class TopK(nn.Module):
    """The k best candidates by value (module docstring); row_to_item int64 [N] maps canonical rows to ids."""

    def __init__(self, row_to_item: Tensor):
        super().__init__()
        self.register_buffer("row_to_item", row_to_item)

    def forward(self, user: Tensor, cand: Candidates, value: Tensor,
                task_scores: Tensor, k: int) -> Answer:
        top_scores, top_rows, tasks, _ = best(cand.rows, value, task_scores, k)
        return (torch.ops.silverrec.rows_to_items(self.row_to_item, top_rows), top_scores, tasks, top_rows, top_rows[:, :0],
                top_scores[:, :0, None].expand(-1, -1, 2))


class FusedTopK(nn.Module):
    """The union of two sources ranked (module docstring).

    Args:
        cache: the embedding cache (task 0's exact re-score of the results, for the ANN's source score);
        row_to_item: int64 [N]; weight: w in value + w * (the decode's log-prob) (0: the value alone);
        priority: which candidates rank first, one of `PRIORITIES` (see `fuse_sources`).
    Buffer: tiers float32 [4], the priority's tier of each found_by value.
    """

    def __init__(self, cache: EmbeddingCache, row_to_item: Tensor, weight: float, priority: str):
        super().__init__()
        self.cache = cache
        self.register_buffer("row_to_item", row_to_item)
        self.weight = float(weight)
        self.register_buffer("tiers", priority_tiers(priority))

    def forward(self, user: Tensor, cand: Candidates, value: Tensor,
                task_scores: Tensor, k: int) -> Answer:
        rows, found_by, log_prob = cand.rows, cand.found_by, cand.log_prob
        score, key = fuse_sources(value, log_prob, found_by, self.weight, self.tiers)
        _, top_rows, tasks, top = best(rows, key, task_scores, k)
        found = top_rows >= 0
        top_scores = torch.where(found, score.gather(1, top), float("-inf"))
        by = torch.where(found, found_by.gather(1, top), torch.zeros_like(top))
        # (a literal bit: TorchScript does not read module globals; FOUND_ANN names it)
        ann_score = (self.cache.embeddings(top_rows) * user[:, :1, :]).sum(dim=2)  # task 0's exact re-score
        ann_score = torch.where((by & 1) != 0, ann_score, float("-inf"))
        gen_score = torch.where(found, log_prob.gather(1, top), float("-inf"))  # the log-prob ranked with
        return (torch.ops.silverrec.rows_to_items(self.row_to_item, top_rows), top_scores, tasks, top_rows, by,
                torch.stack([ann_score, gen_score], dim=2))


class Ranked(nn.Module):
    """A source that ranked alone: its first k (module docstring). `decode`: the source is the
    decode (found_by and its log-prob reported), else a pure-ANN search (nothing more to report)."""

    __constants__ = ["decode"]

    def __init__(self, decode: bool):
        super().__init__()
        self.decode = bool(decode)

    def forward(self, user: Tensor, cand: Candidates, value: Tensor, task_scores: Tensor, k: int) -> Answer:
        if self.decode:
            log_prob = cand.log_prob[:, :k]
            sources = torch.stack([torch.full_like(log_prob, float("-inf")), log_prob], dim=2)
            return cand.ids[:, :k], value[:, :k], task_scores[:, :k], cand.rows[:, :k], cand.found_by[:, :k], sources
        # the search returned k: no slicing; found_by [B, 0], source scores [B, 0, 2]
        return cand.ids, value, task_scores, cand.rows, cand.found_by, cand.log_prob.unsqueeze(2).expand(-1, -1, 2)


def fuse_sources(value: Tensor, log_prob: Tensor, found_by: Tensor, weight: float, tiers: Tensor
                 ) -> Tuple[Tensor, Tensor]:
    """The union's ranking: value float32 [B, C] (-inf at padding), the decoder's log-prob float32
    [B, C] (exact, or an upper bound for a row neither the beam found nor the last step extended;
    -inf where the request's decode is switched off), found_by int64 [B, C] (FOUND_* bits), the
    log-prob's weight w and the source priority's tiers float32 [4] (by found_by, `PRIORITIES`) ->

        score float32 [B, C] = value + w * log-prob (a -inf log-prob adds nothing: the ANN alone);
        key float32 [B, C]: the order of the top-k, score + tier * (the request's score range + 1):
            every row of a higher tier before every row of a lower one, by score within a tier.

    Priority "generative" (the decode's rows first) ranks the top-k as the decode alone does, and
    "ann" (the ANN's rows first) at w = 0 as the ANN alone does (by value), so a grid over (w,
    priority) on the validation split (publish/fusion.py) cannot choose a fusion worse there than
    the better source; "both" puts the rows both sources found first. Without the log-prob term the
    OverArch, trained on the ANN's candidates, ranks the union as it ranks the ANN's list
    (MovieLens: hybrid = ANN only). The log-prob of an ANN row is exact for the rows whose prefix the
    decode's last step extends (spec.extra_prefixes): with a bound in their place (the decode's
    lowest beam log-prob) no fusion beat the better source on MovieLens.
    """
    score = value + weight * torch.where(log_prob > float("-inf"), log_prob, torch.zeros_like(log_prob))
    real = score > float("-inf")
    hi = torch.where(real, score, torch.full_like(score, float("-inf"))).amax(dim=1, keepdim=True)
    lo = torch.where(real, score, torch.full_like(score, float("inf"))).amin(dim=1, keepdim=True)
    span = torch.where(real.any(dim=1, keepdim=True), hi - lo + 1.0, torch.ones_like(hi))
    return score, score + tiers[found_by] * span


def priority_tiers(priority: str) -> Tensor:
    """A source priority (`PRIORITIES`) -> its tier per found_by value 0..3, float32 [4]."""
    if priority not in PRIORITIES:
        raise ValueError(f"source priority must be one of {PRIORITIES}, got {priority!r}")
    first = {"none": 0, "ann": FOUND_ANN, "generative": FOUND_GENERATIVE, "both": FOUND_ANN | FOUND_GENERATIVE}[priority]
    return torch.tensor([float(first != 0 and (f & first) == first) for f in range(4)])
