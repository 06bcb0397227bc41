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

import torch
from torch import Tensor, nn

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.bloom_filter)
from silverrec.candidates import Candidates
from silverrec.kernels.candidate_rows import exclude_rows
from silverrec.retrieval.sources import AnnSource


class TransitionSource(nn.Module):
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
        self.register_buffer("next_rows", next_rows)
        self.register_buffer("next_prob", torch.where(next_rows >= 0, next_prob, torch.zeros_like(next_prob)))

    def forward(self, user: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor, vops: Tensor, vrows: Tensor,
                lists: Tensor, mode: Tensor, history: Tensor, sources: Tensor, k: int, k0: int, nprobe: int,
                max_probe: int) -> Candidates:
        """-> Candidates: rows int64 [B, K1 + M] (the ANN's, then the chain's not found by it; -1 = none)
        and scores float32 [B, K1 + M], P(row | the newest history row), 0 for a row the chain does not
        list and at padding."""
        ann = self.ann(user, exclude, ops, rows, vops, vrows, lists, mode, history, sources, k, k0, nprobe,
                       max_probe).rows  # [B, K1]
        last = history[:, -1]
        at = last.clamp_min(0)
        nxt = torch.where((last >= 0)[:, None], self.next_rows[at], torch.full_like(self.next_rows[at], -1))  # [B, M]
        prob = torch.where(nxt >= 0, self.next_prob[at], torch.zeros_like(self.next_prob[at]))
        # P of each ANN row: the chain's probability where it lists the row (each next row once)
        ann_prob = ((ann[:, :, None] == nxt[:, None, :]) & (nxt >= 0)[:, None, :]).to(prob.dtype) @ prob[:, :, None]
        # the chain's own rows: passing the request's filter (one bank word per row), not excluded, not found
        words = torch.ops.silverrec.bloom_filter(self.ann.index.bits, vops, vrows,
                                                 torch.where(nxt >= 0, nxt >> 6, torch.full_like(nxt, -1)), 1)[:, :, 0]
        passing = ((words >> (nxt & 63)) & 1) != 0
        found = ((nxt[:, :, None] == ann[:, None, :]) & (ann >= 0)[:, None, :]).any(dim=2)
        keep = passing & ~found & (exclude_rows(nxt, exclude, self.num_items) >= 0)
        nxt = torch.where(keep, nxt, torch.full_like(nxt, -1))
        cand = torch.cat([ann, nxt], dim=1)
        scores = torch.cat([ann_prob[:, :, 0], torch.where(keep, prob, torch.zeros_like(prob))], dim=1)
        none = cand[:, :0]
        return Candidates(cand, none, none.float(), scores, none)
