"""The ANN retrieval stages of `RecModel`: the filtered int8 IVF search as a source of candidates.

Every retrieval stage has one signature (RecModel.forward hands each the same arguments):

    forward(user float32 [B, T, D], exclude int64 [B, E], ops, rows, vops, vrows, lists (the filled
            filter programs), mode int64 [B], history int64 [B, H], sources bool [B, 2], k, k0,
            nprobe, max_probe) -> Candidates (silverrec/candidates.py)

- `AnnSearch`, a pure-ANN snapshot's (no cache): the search ranks, k results per query (with
  `rescore` and k + overfetch <= RESCORE_MAX_K its top rows re-scored with the float query inside
  the op); excluded rows dropped when `overfetch` > 0. Without exclusions nothing needs the rows:
  the search maps straight to item ids (`filtered_search(..., item_ids=True)`) and `rows` is [B, 0]
  (no second pass over [B, k] rows at large k).
- `AnnSource`, a recommendation model's: T query rows per request through the search (k0 +
  overfetch rows each), then the cache/merge step (one op, silverrec::candidate_rows): the excluded
  rows dropped, each task's best k0 by its exact re-score kept, the tasks merged (union or
  intersection, rank by rank, at most K1) -> rows [B, K1].

The search returns rows of the canonical (cluster-major) row space; an identity row map would
cost a second random lookup per result row (4 MB per 1M items, out of cache in a cold call).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.*)
from silverrec.candidates import Candidates, RetrievalStage
from silverrec.kernels.candidate_rows import exclude_rows
from silverrec.kernels.rescore_rows import RESCORE_MAX_K, rescore_margin
from silverrec.ranking.cache import EmbeddingCache
from silverrec.retrieval.filtered_ivf import FilteredIVFIndex
from silverrec.retrieval.item_ids import rows_to_items

# the prefix of the index's tensors in a pure-ANN program's state (tensors.pt): RecModel.sources is
# the AnnSearch, whose `index` holds them
INDEX_TENSORS = "sources.index."


class AnnSearch(RetrievalStage):
    """The pure-ANN retrieval (module docstring).

    Args:
        index: the filtered int8 IVF over the pool.
        overfetch: rows searched beyond k so that exclusions leave k (0: no exclusions, ids direct).
        rescore: re-score the scan's top k + `rescore_margin(k)` rows with the float query.
    """

    __constants__ = ["rescore"]

    def __init__(self, index: FilteredIVFIndex, overfetch: int, rescore: bool):
        super().__init__()
        self.index = index
        self.overfetch = int(overfetch)
        self.rescore = bool(rescore)
        self.rescore_max_k = RESCORE_MAX_K  # an attribute: TorchScript reads no module globals

    def forward(self, user: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor, vops: Tensor, vrows: Tensor,
                lists: Tensor, mode: Tensor, history: Tensor, sources: Tensor, k: int, k0: int, nprobe: int,
                max_probe: int) -> Candidates:
        """-> Candidates with scores float32 [B, k] (-inf = none), ids int64 [B, k] (-1 = none) and rows
        int64 [B, k] ([B, 0] without exclusions); user float32 [B, 1, D]."""
        idx = self.index
        direct = self.overfetch == 0
        scores, found = idx.filtered_search(
            user[:, 0], [ops, rows, vops, vrows, lists], mode, k + self.overfetch, nprobe, max_probe,
            rescore_margin(k + self.overfetch) if self.rescore else 0, self.rescore_max_k, item_ids=direct,
        )
        none = found[:, :0]
        if direct:
            return Candidates(none, none, scores[:, :0], scores, found)
        found = exclude_rows(found, exclude, idx.num_items)
        scores, top = torch.topk(torch.where(found >= 0, scores, float("-inf")), k, dim=1)
        found = found.gather(1, top)
        return Candidates(found, none, scores[:, :0], scores, rows_to_items(idx.row_to_item, found))


class AnnSource(RetrievalStage):
    """A recommendation model's ANN source (module docstring).

    Args:
        index: the filtered int8 IVF over the pool; cache: the embedding cache in the same row order
            (the exact re-score); tasks: T; intersection: merge the tasks' lists by intersection
            (else union); overfetch: rows searched per task beyond k0, a constant (not the request's
            exclusion count) so that no answer depends on the other requests of its batch;
            candidates: K1, the most candidates kept per request (0 = T * k0).
    """

    def __init__(self, index: FilteredIVFIndex, cache: EmbeddingCache, tasks: int, intersection: bool,
                 overfetch: int, candidates: int):
        super().__init__()
        if cache.num_items != index.num_items:
            raise ValueError(f"cache holds {cache.num_items} rows, the index {index.num_items}")
        self.index = index
        self.cache = cache
        self.tasks = int(tasks)
        self.intersection = bool(intersection)
        self.overfetch = int(overfetch)
        self.candidates = int(candidates)

    def forward(self, user: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor, vops: Tensor, vrows: Tensor,
                lists: Tensor, mode: Tensor, history: Tensor, sources: Tensor, k: int, k0: int, nprobe: int,
                max_probe: int) -> Candidates:
        """-> Candidates with rows int64 [B, K1] (K1 = `candidates`, or T*k0), -1 = none."""
        T = self.tasks
        q = user.reshape(-1, user.shape[-1])  # request b's task t at row b*T + t: the op repeats its program T times
        idx = self.index
        _, found = idx.filtered_search(q, [ops, rows, vops, vrows, lists], mode, k0 + self.overfetch, nprobe, max_probe,
                                       item_ids=False)
        # per task: the excluded rows dropped, the best k0 by exact re-score kept, the tasks merged (one op)
        cand = torch.ops.silverrec.candidate_rows(q, found, exclude, self.cache.emb, k0,
                                                  self.candidates if self.candidates > 0 else T * k0,
                                                  self.intersection)
        none = cand[:, :0]
        return Candidates(cand, none, none.float(), none.float(), none)
