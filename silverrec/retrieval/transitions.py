"""Next-item transitions: a first-order chain on the newest history item, a retrieval source beside the ANN.

    request -> AnnSource (filtered int8 IVF + cache/merge)          -> ANN rows [B, K1]
            -> the newest history row i -> next_rows[i], its M likeliest next rows, with P(row | i)
               (those the request's filter passes and `exclude` does not list; rows the ANN found
               are not repeated)                                      -> [B, M]
            -> the union, rows [B, K1 + M], each with P(row | i) (0 where the chain lists no such step)
    the value stage then ranks by value + w * P (ranking/stages.py `TransitionValue`)

P(j | i) = C[i, j] / sum_j C[i, j], C counting the consecutive pairs (i, j) of the snapshot's stored
histories (publish/transitions.py builds the tables and chooses w on the validation items).

Why a table in the model: in interaction logs the newest item carries much of the signal, and much of
it is item-specific (a sequel, an accessory, the next film of a marathon). A user tower answers
with one D-dimensional vector per task, whose dot products with the pool form a rank-D score; the
sparse transition matrix is not low-rank, and the chain's successors of the last item are often not
among the vector's nearest items. The table is exact and costs M rows per request.

The request's newest history row arrives in `history` int64 [B, H] (its last column; -1 = no
history), the tensor a hybrid's decode reads; the predictor fills its last column for a snapshot with
transitions (serving/recommend.py, predictor/service.cpp). The filter is the request's verify
program (filter_program.compile_request: exact on features with value planes, a Bloom superset
otherwise) evaluated by `silverrec::bloom_filter` on the one word of the bank that holds each next
row: M words per request, whatever the pool's size. No host synchronisation.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor, nn

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.bloom_filter)
from silverrec.candidates import Candidates, RetrievalStage
from silverrec.retrieval.sources import AnnSource


class TransitionSource(RetrievalStage):
    """The ANN source's candidates and the newest history item's likeliest next items (module docstring).

    Args:
        ann: the recommendation model's ANN source.
        next_rows: int64 [N, M] canonical rows, the M likeliest next rows of each row by P, -1 = none.
        next_prob: float32 [N, M] P(next_rows[i, m] | i), 0 where next_rows is -1.
    """

    def __init__(self, ann: AnnSource, next_rows: Tensor, next_prob: Tensor):
        super().__init__()
        n = ann.index.num_items
        if next_rows.dtype != torch.int64 or next_rows.dim() != 2 or next_rows.shape[0] != n:
            raise ValueError(f"next_rows must be int64 [{n}, M] (one row per pool row), got {next_rows.dtype} "
                             f"{tuple(next_rows.shape)}")
        if next_prob.dtype != torch.float32 or next_prob.shape != next_rows.shape:
            raise ValueError(f"next_prob must be float32 {tuple(next_rows.shape)}, got {next_prob.dtype} "
                             f"{tuple(next_prob.shape)}")
        if bool(((next_rows < -1) | (next_rows >= n)).any()):
            raise ValueError(f"next_rows holds a row outside [-1, {n})")
        self.ann = ann
        self.num_items = int(n)
        # row N: the successors of "no history" (none), so that one gather serves every request; next_prob's
        # column M: 0, the P of "no successor" (float32 [N + 1, M + 1])
        self.register_buffer("next_rows", torch.cat([next_rows, torch.full_like(next_rows[:1], -1)]))
        prob = torch.where(next_rows >= 0, next_prob, torch.zeros_like(next_prob))
        prob = torch.cat([prob, torch.zeros_like(prob[:1])])
        self.register_buffer("next_prob", torch.cat([prob, torch.zeros_like(prob[:, :1])], dim=1))

    def successors(self, last: Tensor) -> Tuple[Tensor, Tensor]:
        """The newest history rows int64 [B] (-1 = no history) -> their successors int64 [B, M] (-1 =
        none) and P float32 [B, M + 1] (column M: 0, the P of "no successor")."""
        at = torch.where(last >= 0, last, torch.full_like(last, self.num_items))
        return self.next_rows[at], self.next_prob[at]

    def slots(self, nxt: Tensor, rows: Tensor) -> Tensor:
        """Each of rows int64 [B, C] among the successors nxt int64 [B, M] -> its slot int64 [B, C] in
        nxt, M where it is none of them (or -1). A sorted search, O((C + M) log M)."""
        M = nxt.shape[1]
        srt, order = torch.sort(nxt, dim=1)
        pos = torch.searchsorted(srt, rows).clamp_max(M - 1)
        hit = (srt.gather(1, pos) == rows) & (rows >= 0)
        return torch.where(hit, order.gather(1, pos), torch.full_like(pos, M))

    def given(self, values: Tensor, lengths: Tensor, rows: Tensor) -> Candidates:
        """The `rank` entry point's rows int64 [B, C] with P(row | the newest history row) as scores
        float32 [B, C]. The newest row is the last of the user features' first key, `hist_item` (the
        history's pool rows, oldest first: retrieval/user_tower.py; none: no history), the row the
        predictors hand `forward` in `history`."""
        B = rows.shape[0]
        n = lengths[:B].to(torch.int64)
        padded = torch.cat([torch.full((1,), -1, dtype=values.dtype, device=values.device), values])  # 0: no history
        last = torch.where(n > 0, padded[torch.cumsum(n, 0)], torch.full_like(n, -1))
        nxt, prob_or_none = self.successors(last)
        scores = prob_or_none.gather(1, self.slots(nxt, rows))
        none = rows[:, :0]
        return Candidates(rows, none, none.float(), scores, none)

    def forward(self, user: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor, vops: Tensor, vrows: Tensor,
                lists: Tensor, mode: Tensor, history: Tensor, sources: Tensor, k: int, k0: int, nprobe: int,
                max_probe: int) -> Candidates:
        """-> Candidates: rows int64 [B, K1 + M] (the ANN's, then the chain's not found by it; -1 = none)
        and scores float32 [B, K1 + M], P(row | the newest history row), 0 for a row the chain does not
        list and at padding. Membership (successor or ANN row, excluded) is a sorted search, O((K1 + M + E)
        log), not K1 x M."""
        ann = self.ann(user, exclude, ops, rows, vops, vrows, lists, mode, history, sources, k, k0, nprobe,
                       max_probe).rows  # [B, K1]
        nxt, prob_or_none = self.successors(history[:, -1])
        M = nxt.shape[1]
        prob = prob_or_none[:, :M]
        slot = self.slots(nxt, ann)
        ann_prob = prob_or_none.gather(1, slot)
        found = torch.zeros(nxt.shape[0], M + 1, dtype=torch.bool, device=nxt.device).scatter(
            1, slot, torch.ones_like(slot, dtype=torch.bool))[:, :M]
        # the successors: passing the request's filter (one bank word each; row -1's word -1 is an empty
        # window), not excluded, not found by the ANN
        words = torch.ops.silverrec.bloom_filter(self.ann.index.bits, vops, vrows, nxt >> 6, 1)[:, :, 0]
        banned = torch.sort(exclude, dim=1).values  # (a sorted search: a dense [B, N] table cost 4x more)
        excluded = banned.gather(1, torch.searchsorted(banned, nxt).clamp_max(banned.shape[1] - 1)) == nxt
        keep = (((words >> (nxt & 63)) & 1) != 0) & ~found & ~excluded
        cand = torch.cat([ann, torch.where(keep, nxt, torch.full_like(nxt, -1))], dim=1)
        scores = torch.cat([ann_prob, torch.where(keep, prob, torch.zeros_like(prob))], dim=1)
        none = cand[:, :0]
        return Candidates(cand, none, none.float(), scores, none)
