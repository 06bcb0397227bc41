"""`RecModel`: the recommendation model as one root module, one forward call per request batch.

    request (KJT of user features, dense, filter program, rows to exclude, k)
      -> user tower (TorchRec EBC + MLP)                      -> T query rows [B*T, D]
      -> filtered int8 IVF search (K0 + overfetch rows per task) -> rows [B*T, K0 + overfetch]
      -> drop excluded rows; embedding cache: exact re-score, each task's best K0;
         merge tasks (union or intersection, rank by rank, at most K1)
         (one op, silverrec::candidate_rows)                 -> rows [B, C = K1 or T*K0]
      -> OverArch (MLP | mixture-of-logits | list-wise; its item side cached) -> task scores [B, C, T]
      -> value model (compiled formula)                       -> value [B, C]
      -> top-k rows -> item ids

A pure-ANN snapshot (`silverrec publish --pool`) is the same module without ranking stages: its
user tower is `QueryTower` (the request's dense tensor is the query embedding, one task) and it
has no embedding cache, so the search ranks the rows: with `rescore` (publish's default) and
k <= 256 the search op re-scores its top k + k/16 + 4 rows with the float query on the same int8
codes (kernels/rescore_rows.py), otherwise the scan's int8 scores rank them (`search_rows`); an
exact index is the configuration with one cluster (nlist 1).

Every stage passes **rows** of one canonical row space (the IVF's cluster-major order); item ids
appear only at the end (`row_to_item`). The search returns rows because it is handed an empty map
(`rows_as_ids`) where it would map rows to ids (except a pure-ANN search without exclusions or
re-score: no stage after it needs rows, so it is handed `row_to_item`). An identity table would
cost a second random lookup per result row (4 MB per 1M items, out of cache in a cold call).
Without an OverArch the task scores are the exact re-scores; without a value model the final
score is task 0's.

`rank` is the early-stage ranking entry point: score given rows for a user (cache + OverArch +
value model), no retrieval and no item tower.

No host synchronisation in either entry point (the request's tensors are built by the
predictor, `silverrec/serving/recommend.py`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.*)
from silverrec.retrieval.filtered_ivf import FilteredIVFIndex
from silverrec.ranking.cache import EmbeddingCache
from silverrec.kernels.candidate_rows import exclude_rows
from silverrec.kernels.rescore_rows import RESCORE_MAX_K, rescore_margin
from silverrec.retrieval.item_ids import rows_to_items
from silverrec.filtering.template import FilterTemplate

MERGES = ("union", "intersection")


class RecModel(nn.Module):
    """The root module of a recommendation snapshot (see the module docstring).

    Args:
        user_tower: (values, lengths, dense) -> float32 [B, T, D] (silverrec.retrieval.user_tower.UserTower).
        index: FilteredIVFIndex over the item embeddings (rows cluster-major).
        cache: EmbeddingCache in the same row order, or None (retrieval only: the search op's
            int8 scores rank the rows; one task, no OverArch, no value model).
        overarch: (user [B,T,D], cand [B,C,D], feats [B,C,F]) -> [B,C,T], or None.
        value_model: (task scores [B,C,T], feats [B,C,F]) -> [B,C], or None.
        merge: "union" or "intersection" of the tasks' candidates.
        overfetch: rows searched per task beyond k0, a constant (not the request's exclusion count)
            so that no answer depends on the other requests of its batch.
        candidates: K1, the most candidates the ranking stage scores per request (kernels/candidate_rows.py `merge_tasks`:
            the tasks' lists rank by rank); 0 = all T*k0 slots.
        template: a FilterTemplate (silverrec/filtering/template.py) filled from the request's user
            features and ANDed with its filter programs, or None.
        rescore: retrieval only (no cache): rank the scan's top k + `rescore_margin(k)` rows by the
            float query on their int8 codes (kernels/rescore_rows.py) instead of the int8 scores, for
            k <= RESCORE_MAX_K.
    """

    # constants to TorchScript, so that it compiles only the stages a configuration has
    __constants__ = ["has_cache", "has_overarch", "rows_overarch", "has_value_model", "rescore"]

    def __init__(self, user_tower: nn.Module, index: FilteredIVFIndex, cache: Optional[EmbeddingCache],
                 overarch: Optional[nn.Module] = None, value_model: Optional[nn.Module] = None,
                 tasks: int = 1, merge: str = "union", overfetch: int = 256, candidates: int = 0,
                 template: Optional[FilterTemplate] = None, rescore: bool = False):
        super().__init__()
        if merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
        self.has_cache = cache is not None
        if cache is None:  # retrieval only; a one-row placeholder keeps the module's attributes typed
            if overarch is not None or value_model is not None or tasks != 1:
                raise ValueError("a model without an embedding cache has one task and no OverArch or value model")
            cache = EmbeddingCache(torch.zeros(1, index.codes.shape[1]))
        if rescore and self.has_cache:
            raise ValueError("rescore is for a model without an embedding cache (the cache re-scores exactly)")
        self.rescore = bool(rescore)
        self.rescore_max_k = RESCORE_MAX_K  # an attribute: TorchScript reads no module globals
        if self.has_cache and cache.num_items != index.num_items:
            raise ValueError(f"cache holds {cache.num_items} rows, the index {index.num_items}")
        self.user_tower = user_tower
        self.index = index
        # the OverArch's item side, computed once per item and kept by row beside the embeddings
        self.cache = cache.with_ranker(overarch.item_side) if overarch is not None else cache
        self.has_overarch = overarch is not None
        # an OverArch with `score_rows` scores cached rows in one op (MoLOverArch: silverrec::mol_score)
        self.rows_overarch = overarch is not None and hasattr(overarch, "score_rows")
        self.overarch = overarch if overarch is not None else nn.Identity()
        self.has_value_model = value_model is not None
        self.value_model = value_model if value_model is not None else nn.Identity()
        self.tasks = int(tasks)
        self.intersection = merge == "intersection"
        self.overfetch = int(overfetch)  # extra rows per task searched so that exclusions leave k0
        self.candidates = int(candidates)  # K1 (0 = T*k0)
        # handed to the search as its row -> item map: zero-length = return the rows themselves
        self.register_buffer("rows_as_ids", torch.zeros(0, dtype=torch.int32))
        self.filter_template = template if template is not None else FilterTemplate.empty()

    def search_rows(self, user: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor, vops: Tensor, vrows: Tensor,
                    lists: Tensor, mode: Tensor, k: int, nprobe: int, max_probe: int) -> Tuple[Tensor, Tensor, Tensor]:
        """Retrieval alone (no cache): user float32 [B, 1, D] -> (scores float32 [B, k], -inf =
        none; item ids int64 [B, k], -1 = none; rows int64 [B, k], -1 = none), excluded rows dropped
        when `overfetch` > 0; with `rescore` and k + overfetch <= RESCORE_MAX_K, the search's top rows
        re-scored with the float query (inside the op). Without exclusions nothing needs the rows:
        the search maps straight to item ids (`row_to_item` where it is otherwise handed
        `rows_as_ids`) and rows is [B, 0]: no second pass over [B, k] rows at large k (the public
        search at k 4096, 241 matches x 16 queries: 250 -> 184 us)."""
        idx = self.index
        direct = self.overfetch == 0
        scores, found = idx.filtered_search(
            user[:, 0], [ops, rows, vops, vrows, lists], mode, k + self.overfetch, nprobe, max_probe,
            rescore_margin(k + self.overfetch) if self.rescore else 0, self.rescore_max_k, item_ids=direct,
        )
        if direct:
            return scores, found, found[:, :0]
        found = exclude_rows(found, exclude, idx.num_items)
        scores, top = torch.topk(torch.where(found >= 0, scores, float("-inf")), k, dim=1)
        found = found.gather(1, top)
        return scores, rows_to_items(idx.row_to_item, found), found

    def rank_rows(self, user: Tensor, rows: Tensor) -> Tuple[Tensor, Tensor]:
        """user float32 [B, T, D], rows int64 [B, C] (-1 = none) -> (value float32 [B, C] with -inf
        at padding, task scores float32 [B, C, T])."""
        if self.rows_overarch:  # an OverArch that reads the cache's rows itself (MoL: one op)
            scores = self.overarch.score_rows(user, rows, self.cache.emb, self.cache.ranker)
            feats = self.cache.features(rows)
        elif self.has_overarch:  # the OverArch scores the pairs: no exact re-score to compute
            emb, feats, ranker = self.cache.lookup(rows)
            scores = self.overarch.score(user, emb, ranker, rows >= 0)
        else:
            emb, feats, ranker, scores = self.cache(user, rows)
        if self.has_value_model:
            value = self.value_model(scores, feats)
        else:
            value = scores[:, :, 0]
        return torch.where(rows >= 0, value, float("-inf")), scores

    def retrieve(self, user: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor, vops: Tensor, vrows: Tensor,
                 lists: Tensor, mode: Tensor, k0: int, nprobe: int, max_probe: int) -> Tensor:
        """T query rows per request through the filtered IVF search (k0 + overfetch rows each), the excluded
        rows dropped, each task's best k0 by its exact re-score kept, the tasks merged -> int64
        [B, K1] rows (K1 = `candidates`, or T*k0), -1 = none."""
        T = self.tasks
        q = user.reshape(-1, user.shape[-1])  # request b's task t at row b*T + t: the op repeats its program T times
        idx = self.index
        _, found = idx.filtered_search(q, [ops, rows, vops, vrows, lists], mode, k0 + self.overfetch, nprobe, max_probe,
                                       item_ids=False)
        # per task: the excluded rows dropped, the best k0 by exact re-score kept, the tasks merged (one op)
        return torch.ops.silverrec.candidate_rows(q, found, exclude, self.cache.emb, k0,
                                                  self.candidates if self.candidates > 0 else T * k0,
                                                  self.intersection)

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor,
                vops: Tensor, vrows: Tensor, lists: Tensor, mode: Tensor, k: int, k0: int, nprobe: int,
                max_probe: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """One request batch.

        Args:
            values int64 [nnz], lengths int32 [F*B], dense float32 [B, Fd]: the user features (a KJT).
            exclude int64 [B, E]: rows never to return, any order, -1 = none (E >= 1).
            ops, rows, vops, vrows, lists: the B filter programs (filter_program.compile_request).
            mode int64 [B]: filter search mode per request (filtered_ivf.MODES).
            k <= C results (C = `candidates`, or T*k0); k0 candidates per task; 1 <= nprobe <= max_probe <= nlist.
        Returns:
            item_ids int64 [B, k] (-1 = none), scores float32 [B, k] (the value, -inf = none),
            task scores float32 [B, k, T], rows int64 [B, k] (canonical rows, -1 = none; a pure-ANN
            configuration without exclusions returns [B, 0]: `search_rows`).
        """
        user, ops, rows, vops, vrows, lists = self.request(values, lengths, dense, ops, rows, vops, vrows, lists)
        if not self.has_cache:  # retrieval only (a pure-ANN snapshot): k results straight from the search
            top_scores, ids, top_rows = self.search_rows(user, exclude, ops, rows, vops, vrows, lists, mode, k,
                                                         nprobe, max_probe)
            return ids, top_scores, top_scores.unsqueeze(2), top_rows
        cand = self.retrieve(user, exclude, ops, rows, vops, vrows, lists, mode, k0, nprobe, max_probe)
        value, task_scores = self.rank_rows(user, cand)
        ids, top_scores, tasks_out, top_rows, _ = self.best(cand, value, task_scores, k)
        return ids, top_scores, tasks_out, top_rows

    def request(self, values: Tensor, lengths: Tensor, dense: Tensor, ops: Tensor, rows: Tensor, vops: Tensor,
                vrows: Tensor, lists: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The first stage of every forward: (user embeddings float32 [B, T, D], the request's filter
        programs with the snapshot's filter template filled in and ANDed: ops, rows, vops, vrows, lists)."""
        ops, rows, vops, vrows, lists = self.filter_template(values, lengths, ops, rows, vops, vrows, lists,
                                                             self.index.post_sizes)
        return self.user_tower(values, lengths, dense), ops, rows, vops, vrows, lists

    def best(self, cand: Tensor, value: Tensor, task_scores: Tensor, k: int
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The last stage: the k best candidates int64 [B, C] by value float32 [B, C] -> (item ids int64
        [B, k], value [B, k], task scores [B, k, T], rows [B, k], their positions in `cand` [B, k]);
        -1 / -inf where fewer than k candidates have a value."""
        top_scores, top = torch.topk(value, k, dim=1)
        top_rows = torch.where(top_scores > float("-inf"), cand.gather(1, top), -1)
        tasks_out = task_scores.gather(1, top[:, :, None].expand(-1, -1, task_scores.shape[2]))
        return rows_to_items(self.index.row_to_item, top_rows), top_scores, tasks_out, top_rows, top

    @torch.jit.export
    def rank(self, values: Tensor, lengths: Tensor, dense: Tensor, rows: Tensor) -> Tuple[Tensor, Tensor]:
        """Early-stage ranking: rows int64 [B, C] (-1 = none) -> (value float32 [B, C], task scores
        float32 [B, C, T]) from the cached embeddings, the OverArch and the value model."""
        return self.rank_rows(self.user_tower(values, lengths, dense), rows)


class RankEntry(nn.Module):
    """`RecModel.rank` as a forward, for torch.export (which exports one method per program)."""

    def __init__(self, model: RecModel):
        super().__init__()
        self.model = model

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor, rows: Tensor) -> Tuple[Tensor, Tensor]:
        return self.model.rank(values, lengths, dense, rows)
