"""`RecModel`: the recommendation model as one root module, one forward call per request batch.

    request (KJT of user features, dense, filter program, rows to exclude, k)
      -> user tower (TorchRec EBC + MLP)                      -> T query rows [B*T, D]
      -> filtered int8 IVF search (K0 + overfetch rows per task) -> rows [B*T, K0 + overfetch]
      -> drop excluded rows; embedding cache: exact re-score, each task's best K0
      -> merge tasks (union or intersection, rank by rank, at most K1) -> rows [B, C = K1 or T*K0]
      -> OverArch (MLP | mixture-of-logits | list-wise; its item side cached) -> task scores [B, C, T]
      -> value model (compiled formula)                       -> value [B, C]
      -> top-k rows -> item ids

A pure-ANN snapshot (`silverrec publish --pool`) is the same module without ranking stages: its
user tower is `QueryTower` (the request's dense tensor is the query embedding, one task) and it
has no embedding cache, so the search op's int8 scores rank the rows (`search_rows`); an exact
index is the configuration with one cluster (nlist 1).

Every stage passes **rows** of one canonical row space (the IVF's cluster-major order); item ids
appear only at the end (`row_to_item`). The search returns rows because it is handed the identity
map (`row_ids`) where it would map rows to ids. Without an OverArch the task scores are the exact
re-scores; without a value model the final score is task 0's.

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
from silverrec.retrieval.item_ids import rows_to_items
from silverrec.filtering.template import FilterTemplate

MERGES = ("union", "intersection")
# pools of at most this many rows merge and exclude through [B, N + 1] tables (merge_tasks, exclude_rows)
DENSE_MAX_ROWS = 1 << 16


def merge_tasks(rows: Tensor, intersection: bool, limit: int, num_rows: int = -1,
                dense_max_rows: int = DENSE_MAX_ROWS) -> Tensor:
    """Each task's candidate rows, best first, int64 [B, T, K] (-1 = none; no task lists a row twice)
    -> one list per request int64 [B, limit]: the tasks' rows taken rank by rank (every task's
    first row, then every task's second, ...), each row once (union) or only the rows every task
    holds (intersection), the first `limit` of them; -1 pads.

    Rank-by-rank order caps the list without comparing scores across tasks (their scales differ):
    with `limit` >= T*K it is the whole union. All static shapes. A pool of `num_rows` <=
    `dense_max_rows` rows: a [B, N + 1] table holds each row's first position (scatter-min; and
    its count, for the intersection), and a running count of the kept entries places them
    (TorchScript, 1 thread, T 2, K 200: 0.089 vs 0.108 ms at B 1; 0.28 vs 0.42 ms at B 16 when the
    allocator reuses the table's memory, about the sort's time when a fresh table page-faults).
    Otherwise (or `num_rows` -1): a stable sort finds each row's first occurrence and a top-k of
    positions compacts the kept rows to the front (the list is padded by `limit` empty slots
    first, so any limit works whatever K is). `num_rows` is the snapshot's constant: the choice is
    fixed at publish.
    """
    B, T, K = rows.shape
    if 0 <= num_rows <= dense_max_rows:
        order = rows.transpose(1, 2).reshape(B, K * T)  # rank-major
        m = order.shape[1]
        col = order + 1  # row -1 -> column 0
        pos = torch.arange(m, device=rows.device).expand(B, m)
        first = torch.full((B, num_rows + 1), m, dtype=order.dtype, device=rows.device).scatter_reduce(
            1, col, pos, "amin")
        keep = (first.gather(1, col) == pos) & (order >= 0)
        if intersection and T > 1:
            count = torch.zeros(B, num_rows + 1, dtype=order.dtype, device=rows.device).scatter_add(
                1, col, torch.ones_like(order))
            keep = keep & (count.gather(1, col) == T)
        slot = torch.cumsum(keep.to(order.dtype), dim=1) - 1  # where each kept entry goes
        slot = torch.where(keep & (slot < limit), slot, torch.full_like(slot, limit))  # the rest: a spare column
        out = torch.full((B, limit + 1), -1, dtype=order.dtype, device=rows.device).scatter(1, slot, order)
        return out[:, :limit]
    empty = torch.full((B, limit), -1, dtype=rows.dtype, device=rows.device)
    order = torch.cat([rows.transpose(1, 2).reshape(B, K * T), empty], dim=1)
    srt, perm = torch.sort(order, dim=1, stable=True)
    first = torch.cat([torch.ones_like(srt[:, :1], dtype=torch.bool), srt[:, 1:] != srt[:, :-1]], dim=1)
    keep = first & (srt >= 0)
    if intersection and T > 1:  # a row's first copy is kept when the T-1 next entries repeat it
        shifted = torch.cat([srt[:, T - 1:], torch.full_like(srt[:, : T - 1], -1)], dim=1)
        keep = keep & (shifted == srt)
    kept = torch.zeros_like(keep).scatter(1, perm, keep)  # back in rank-major order
    pos = torch.arange(order.shape[1], device=rows.device).expand(B, -1)
    front = torch.topk(torch.where(kept, pos, pos + order.shape[1]), limit, dim=1, largest=False).indices
    return torch.where(kept.gather(1, front), order.gather(1, front), torch.full_like(front, -1))


def exclude_rows(rows: Tensor, exclude: Tensor, num_rows: int, dense_max_rows: int = DENSE_MAX_ROWS) -> Tensor:
    """rows int64 [B, M] (-1 = none), exclude int64 [B, E >= 1] sorted ascending, -1 padded (first)
    -> rows with every excluded row set to -1.

    A pool of at most `dense_max_rows` rows: one bool table [B, N + 1] per batch (column 0 is
    row -1), the exclusions scattered in, the rows gathered (MovieLens, B 16, M 912, E 500, 1 thread:
    about 0.1 ms against 0.8 ms for the search below). A larger pool: one 1-D search over every
    request's exclusions: row b's values are shifted by b * (N + 2) so that the flattened
    exclusions stay sorted (a batched searchsorted would guard the batch size). `num_rows` is the
    snapshot's constant, so the choice is fixed at publish (no shape guard).
    """
    if num_rows <= dense_max_rows:
        table = torch.zeros(rows.shape[0], num_rows + 1, dtype=torch.bool, device=rows.device)
        table.scatter_(1, exclude + 1, torch.ones_like(exclude, dtype=torch.bool))
        hit = table.gather(1, rows + 1)
        return torch.where(hit | (rows < 0), torch.full_like(rows, -1), rows)
    base = torch.arange(rows.shape[0], device=rows.device)[:, None] * (num_rows + 2)
    ex = (exclude + 1 + base).reshape(-1)
    q = rows + 1 + base
    pos = torch.searchsorted(ex, q.reshape(-1)).clamp_max(ex.shape[0] - 1)
    hit = ex[pos].reshape(q.shape) == q
    return torch.where(hit | (rows < 0), torch.full_like(rows, -1), rows)


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
        candidates: K1, the most candidates the ranking stage scores per request (`merge_tasks`:
            the tasks' lists rank by rank); 0 = all T*k0 slots.
        template: a FilterTemplate (silverrec/filtering/template.py) filled from the request's user
            features and ANDed with its filter programs, or None.
    """

    # constants to TorchScript, so that it compiles only the stages a configuration has
    __constants__ = ["has_cache", "has_overarch", "has_value_model"]

    def __init__(self, user_tower: nn.Module, index: FilteredIVFIndex, cache: Optional[EmbeddingCache],
                 overarch: Optional[nn.Module] = None, value_model: Optional[nn.Module] = None,
                 tasks: int = 1, merge: str = "union", overfetch: int = 256, candidates: int = 0,
                 template: Optional[FilterTemplate] = None):
        super().__init__()
        if merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
        self.has_cache = cache is not None
        if cache is None:  # retrieval only; a one-row placeholder keeps the module's attributes typed
            if overarch is not None or value_model is not None or tasks != 1:
                raise ValueError("a model without an embedding cache has one task and no OverArch or value model")
            cache = EmbeddingCache(torch.zeros(1, index.codes.shape[1]))
        if self.has_cache and cache.num_items != index.num_items:
            raise ValueError(f"cache holds {cache.num_items} rows, the index {index.num_items}")
        self.user_tower = user_tower
        self.index = index
        # the OverArch's item side, computed once per item and kept by row beside the embeddings
        self.cache = cache.with_ranker(overarch.item_side) if overarch is not None else cache
        self.has_overarch = overarch is not None
        self.overarch = overarch if overarch is not None else nn.Identity()
        self.has_value_model = value_model is not None
        self.value_model = value_model if value_model is not None else nn.Identity()
        self.tasks = int(tasks)
        self.intersection = merge == "intersection"
        self.overfetch = int(overfetch)  # extra rows per task searched so that exclusions leave k0
        self.candidates = int(candidates)  # K1 (0 = T*k0)
        self.register_buffer("row_ids", torch.arange(index.num_items, dtype=torch.int32))
        self.filter_template = template if template is not None else FilterTemplate.empty()

    def search_rows(self, user: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor, vops: Tensor, vrows: Tensor,
                    lists: Tensor, mode: Tensor, k: int, nprobe: int, max_probe: int) -> Tuple[Tensor, Tensor]:
        """Retrieval alone (no cache): user float32 [B, 1, D] -> (int8 scores float32 [B, k], -inf =
        none; rows int64 [B, k], -1 = none), excluded rows dropped when `overfetch` > 0."""
        idx = self.index
        scores, found = torch.ops.silverrec.filtered_ivf_search(
            user[:, 0], idx.codes, idx.dim_scale, idx.dim_offset, idx.cluster_offsets, idx.centroids, self.row_ids,
            idx.bits, idx.post_rows, idx.post_offsets, idx.post_sizes, ops, rows, vops, vrows, lists, mode,
            k + self.overfetch, nprobe, max_probe, idx.window_words, idx.match_factor, idx.avg_cluster,
            idx.num_items, idx.exact_cost_ratio, idx.posting_limit,
        )
        if self.overfetch > 0:
            found = exclude_rows(found, exclude, idx.num_items)
            scores, top = torch.topk(torch.where(found >= 0, scores, float("-inf")), k, dim=1)
            found = found.gather(1, top)
        return scores, found

    def rank_rows(self, user: Tensor, rows: Tensor) -> Tuple[Tensor, Tensor]:
        """user float32 [B, T, D], rows int64 [B, C] (-1 = none) -> (value float32 [B, C] with -inf
        at padding, task scores float32 [B, C, T])."""
        if self.has_overarch:  # the OverArch scores the pairs: no exact re-score to compute
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
        q = user.reshape(-1, user.shape[-1])
        reps = [ops, rows, vops, vrows, lists, mode]
        ops, rows, vops, vrows, lists, mode = [x.repeat_interleave(T, dim=0) for x in reps]
        idx = self.index
        _, found = torch.ops.silverrec.filtered_ivf_search(
            q, idx.codes, idx.dim_scale, idx.dim_offset, idx.cluster_offsets, idx.centroids, self.row_ids,
            idx.bits, idx.post_rows, idx.post_offsets, idx.post_sizes, ops, rows, vops, vrows, lists, mode,
            k0 + self.overfetch, nprobe, max_probe, idx.window_words, idx.match_factor, idx.avg_cluster,
            idx.num_items, idx.exact_cost_ratio, idx.posting_limit,
        )
        # per task: drop the excluded rows, keep the best k0 by exact re-score, then merge the tasks
        K = found.shape[1]
        flat = exclude_rows(found.reshape(-1, T * K), exclude, idx.num_items)  # [B, T*K], task-major
        emb = self.cache.embeddings(flat).reshape(-1, K, user.shape[-1])  # [B*T, K, D]
        # task t's rows by task t only: [B*T, 1, D] x [B*T, D, K] (the row-vector form: as [B*T, K, D] x
        # [B*T, D, 1] the batched matmul took 7x longer, 1.03 vs 0.15 ms at B 16, K 456, 1 thread)
        own = torch.bmm(q.unsqueeze(1), emb.transpose(1, 2)).reshape(-1, T, K)  # [B, T, K]
        own = torch.where(flat.reshape(-1, T, K) >= 0, own, float("-inf"))
        top = torch.topk(own, k0, dim=2)  # [B, T, k0]
        rows_t = flat.reshape(-1, T, K).gather(2, top.indices)
        rows_t = torch.where(top.values > float("-inf"), rows_t, torch.full_like(rows_t, -1))
        return merge_tasks(rows_t, self.intersection, self.candidates if self.candidates > 0 else T * k0,
                           idx.num_items)

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor, exclude: Tensor, ops: Tensor, rows: Tensor,
                vops: Tensor, vrows: Tensor, lists: Tensor, mode: Tensor, k: int, k0: int, nprobe: int,
                max_probe: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """One request batch.

        Args:
            values int64 [nnz], lengths int32 [F*B], dense float32 [B, Fd]: the user features (a KJT).
            exclude int64 [B, E]: rows never to return, sorted ascending, padded with -1 (E >= 1).
            ops, rows, vops, vrows, lists: the B filter programs (filter_program.compile_request).
            mode int64 [B]: filter search mode per request (filtered_ivf.MODES).
            k <= C results (C = `candidates`, or T*k0); k0 candidates per task; 1 <= nprobe <= max_probe <= nlist.
        Returns:
            item_ids int64 [B, k] (-1 = none), scores float32 [B, k] (the value, -inf = none),
            task scores float32 [B, k, T], rows int64 [B, k] (canonical rows, -1 = none).
        """
        user, ops, rows, vops, vrows, lists = self.request(values, lengths, dense, ops, rows, vops, vrows, lists)
        if not self.has_cache:  # retrieval only (a pure-ANN snapshot): k results straight from the search
            top_scores, top_rows = self.search_rows(user, exclude, ops, rows, vops, vrows, lists, mode, k, nprobe,
                                                    max_probe)
            return rows_to_items(self.index.row_to_item, top_rows), top_scores, top_scores.unsqueeze(2), top_rows
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
