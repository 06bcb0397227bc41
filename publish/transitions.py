"""The next-item transitions of a recommendation snapshot at publish (silverrec/retrieval/transitions.py).

    publish.toml:  transitions = 100            # M successors per item (0 = none)
                   transition_weight = "auto"   # or a number w >= 0
                   transition_window = "auto"   # or a number of steps (1: the first-order chain)
                   transition_decay = "auto"    # or a number in (0, 1]

`transition_tables`: the chain of the snapshot's stored histories (publish/rec.py
`stored_histories`: every user's history at its training stage, the held-out test items absent): C[i, j] sums
decay^(d - 1) over every time j follows i by d <= window steps within a history (window 1: the
consecutive pairs, the first-order Markov chain), P(j | i) = C[i, j] / sum_j C[i, j], and each item
keeps its M likeliest successors (ties: the more popular successor first, then the lower row).

`choose`: the table (window, decay) and w in value + w * P, chosen on the validation items: each
stored history's newest item is held out (its target), the chain is fitted on the histories
without it, and one request per user (a seeded sample of at most VALID_USERS) asks the snapshot
with those tables, as served, for every candidate it ranks at w = 0: their values. The candidates
do not depend on w (the ANN's and the newest item's successors), so the top 100 at w is the top
100 of value + w * P over them, computed here for each w of the grid (GRID times the values' spread:
the mean gap between a request's best value and its 100th at w = 0): one forward per table, not
one per w. The best NDCG@10 wins; the first of equals (w = 0 before any other, so a chain that does
not help is switched off; the shorter window, the stronger decay). The tables tried are
`tables_tried`: WINDOWS x DECAYS (transition_window / transition_decay "auto"; a given value
narrows them), a window from the first-order chain to 20 steps and a decay from halving to none,
the range the screens in docs/recommendation.md spanned; the choice within it is the validation
items' alone. Each table's best w, the chosen table's whole grid and the choice go to the manifest
(`transitions`).

The towers' own validation figures are optimistic where their training saw the validation items (the
OverArch and the bag tower train on them; the sequential tower does not), so the chosen w errs low.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from silverrec.publish.evaluate import metrics_from_ranks, ranks_from_topk

GRID = (0.0, 1 / 8, 1 / 4, 1 / 2, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0, 4096.0)  # w / the values' spread
WINDOWS = (1, 2, 3, 5, 10, 20)  # transition_window = "auto": the windows tried (1: the first-order chain)
DECAYS = (0.5, 0.8, 1.0)  # transition_decay = "auto": the decays tried (window 1 has no decay: 1.0)
VALID_USERS = 4096
METRIC = "NDCG@10"
K_EVAL = 100


def tables_tried(window: Any = "auto", decay: Any = "auto") -> list[tuple[int, float]]:
    """(window, decay) of each validation table: WINDOWS x DECAYS, narrowed by a given window and/or
    decay; window 1 weighs no later step, so it is one table (with the last decay)."""
    windows = WINDOWS if window == "auto" else (int(window),)
    decays = DECAYS if decay == "auto" else (float(decay),)
    return [(w, d) for w in windows for d in decays if w > 1 or d == decays[-1]]


def chain(offsets: np.ndarray, rows: np.ndarray, num_rows: int, window: int = 1,
          decay: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chain of histories (CSR: offsets int64 [U + 1], rows int64 [nnz], oldest first) over
    `num_rows` rows -> (src, dst int64 [pairs], P(dst | src) float64 [pairs]), one entry per distinct
    pair, sorted by (src, dst). A pair (i, j) is j at d <= `window` steps after i within one history,
    weighing decay^(d - 1); P(j | i) = C[i, j] / sum_j C[i, j] over those weights. window 1: the
    first-order Markov chain (consecutive pairs, each counting 1)."""
    offsets, rows = np.asarray(offsets, dtype=np.int64), np.asarray(rows, dtype=np.int64)
    owner = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    keys, weights = [], []
    for d in range(1, window + 1):
        same = owner[:-d] == owner[d:]  # (rows[e], rows[e + d]) within one history
        keys.append(rows[:-d][same] * num_rows + rows[d:][same])
        weights.append(np.full(int(same.sum()), float(decay) ** (d - 1)))
    keys, inverse = np.unique(np.concatenate(keys), return_inverse=True)
    counts = np.bincount(inverse.reshape(-1), weights=np.concatenate(weights), minlength=len(keys))
    src, dst = keys // num_rows, keys % num_rows
    return src, dst, counts / np.bincount(src, weights=counts, minlength=num_rows)[src]


def transition_tables(offsets: np.ndarray, rows: np.ndarray, num_rows: int, m: int, window: int = 1,
                      decay: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain of histories (as `chain`) -> (next_rows int64 [num_rows, m], -1 = none; next_prob
    float32 [num_rows, m], 0 = none): each row's m likeliest successors (module docstring)."""
    if m < 1:
        raise ValueError(f"transitions must be >= 1, got {m}")
    if window < 1 or not 0 < decay <= 1:
        raise ValueError(f"transition_window must be >= 1 and transition_decay in (0, 1], got {window}, {decay}")
    src, dst, prob = chain(offsets, rows, num_rows, window, decay)
    pop = np.bincount(np.asarray(rows, dtype=np.int64), minlength=num_rows)
    order = np.lexsort((dst, -pop[dst], -prob, src))  # by source, then P, popularity, row
    src, dst, prob = src[order], dst[order], prob[order]
    start = np.searchsorted(src, np.arange(num_rows))
    rank = np.arange(len(src)) - start[src]
    keep = rank < m
    next_rows = np.full((num_rows, m), -1, dtype=np.int64)
    next_prob = np.zeros((num_rows, m), dtype=np.float32)
    next_rows[src[keep], rank[keep]] = dst[keep]
    next_prob[src[keep], rank[keep]] = prob[keep]
    return torch.from_numpy(next_rows), torch.from_numpy(next_prob)


def validation_histories(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each history without its newest item -> (offsets, rows) of those histories and targets int64
    [U] (the newest row; -1 for a history of fewer than 2 items, which has no validation request)."""
    lengths = np.diff(offsets)
    keep = np.ones(len(rows), dtype=bool)
    keep[offsets[1:][lengths > 0] - 1] = False
    short = np.maximum(lengths - 1, 0)
    out = np.zeros(len(offsets), dtype=np.int64)
    np.cumsum(short, out=out[1:])
    targets = np.where(lengths >= 2, rows[np.maximum(offsets[1:] - 1, 0)], -1)
    return out, rows[keep], targets


def validation_users(offsets: np.ndarray, targets: np.ndarray, seed: int) -> np.ndarray:
    """int64 [U'] the validation requests' users: a seeded sample of at most VALID_USERS of those with a
    held-out item and a history before it, ascending."""
    users = np.flatnonzero((targets >= 0) & (np.diff(offsets) >= 1))
    return np.sort(np.random.default_rng(seed).permutation(users)[:VALID_USERS])


def candidate_values(handler: Any, row_to_item: np.ndarray, offsets: np.ndarray, rows: np.ndarray,
                     users: np.ndarray, tables: tuple[torch.Tensor, torch.Tensor],
                     batch: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every candidate the snapshot (`handler`, at w = 0) ranks for each user's validation request
    served at k = K_EVAL (its whole history excluded; `every_candidate`): (item ids int64 [U, C], -1 =
    none; values float32 [U, C], -inf = none; P(item | the newest history row) float32 [U, C] from
    `tables`, (next_rows int64 [N, M], next_prob float32 [N, M]), 0 where they list no such step)."""
    next_rows, next_prob = tables
    item_of = torch.from_numpy(row_to_item.astype(np.int64))
    ids, values, probs = [], [], []
    for s in range(0, len(users), batch):
        hists = [rows[offsets[u]:offsets[u + 1]] for u in users[s:s + batch]]
        res = handler.recommend([{"history": row_to_item[h]} for h in hists], k=K_EVAL, every_candidate=True,
                                exclude_limit=max(len(np.unique(h)) for h in hists))
        last = torch.from_numpy(np.array([h[-1] for h in hists], dtype=np.int64))
        succ = next_rows[last]  # [b, M] rows, -1 = none: as item ids, -2 = none (the answer's padding is -1)
        succ_ids = torch.where(succ >= 0, item_of[succ.clamp_min(0)], torch.full_like(succ, -2))
        hit = succ_ids[:, None, :] == res.item_ids[:, :, None]  # [b, C, M]
        probs.append((hit.float() * next_prob[last][:, None, :]).sum(2))
        ids.append(res.item_ids)
        values.append(res.scores)
    return torch.cat(ids), torch.cat(values), torch.cat(probs)


def weight_grid(ids: torch.Tensor, value: torch.Tensor, prob: torch.Tensor,
                target_ids: torch.Tensor) -> tuple[list[dict[str, Any]], float]:
    """The validation figures of value + w * P's top K_EVAL (`candidate_values`' outputs; target_ids
    int64 [U]) for each w of GRID times the values' spread -> (one row per w, the spread)."""
    real = value > float("-inf")
    last = (real[:, :K_EVAL].sum(1, keepdim=True) - 1).clamp_min(0)  # each request's 100th value, or its last
    gap = (value[:, 0] - value.gather(1, last)[:, 0])[real[:, 0]]
    spread = float(gap.mean()) if gap.numel() and float(gap.mean()) > 0 else 1.0
    rows = []
    for g in GRID:
        w = g * spread
        key = value + torch.tensor(w, dtype=torch.float32) * prob  # as the value stage adds it (float32)
        top = torch.topk(key, min(K_EVAL, key.shape[1]), dim=1)
        top_ids = torch.where(top.values > float("-inf"), ids.gather(1, top.indices), -1)
        m = metrics_from_ranks(ranks_from_topk(top_ids, target_ids))
        rows.append({"weight": round(w, 6), **{k: round(m[k], 5) for k in ("HR@10", METRIC, "HR@100")}})
    return rows, spread


def best_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of the best METRIC, the first of equals."""
    return max(rows, key=lambda r: (r[METRIC], -rows.index(r)))


def choose(handler_with: Callable[[tuple[torch.Tensor, torch.Tensor]], Any], row_to_item: np.ndarray,
           offsets: np.ndarray, rows: np.ndarray, m: int, seed: int, window: Any = "auto",
           decay: Any = "auto") -> dict[str, Any]:
    """The table and the weight (module docstring) -> the manifest's choice: window, decay, weight,
    its figures, each table's best and the chosen table's grid. `handler_with(tables)`: a predictor
    over the snapshot with those validation tables at w = 0; (offsets, rows) the stored histories
    (canonical rows, oldest first); m successors per item."""
    v_offsets, v_rows, targets = validation_histories(offsets, rows)
    users = validation_users(v_offsets, targets, seed)
    tried = tables_tried(window, decay)
    if len(users) == 0:
        w, d = tried[0]
        return {"window": w, "decay": d, "weight": 0.0, "chosen_on": "no validation items"}
    target_ids = torch.from_numpy(row_to_item[targets[users]].astype(np.int64))
    n = len(row_to_item)
    results = []
    for w, d in tried:
        tables = transition_tables(v_offsets, v_rows, n, m, w, d)
        grid, spread = weight_grid(*candidate_values(handler_with(tables), row_to_item, v_offsets, v_rows, users, tables),
                                   target_ids)
        results.append({"window": w, "decay": d, "value_spread": round(spread, 6), "grid": grid, **best_of(grid)})
    chosen = best_of(results)
    return {**{k: chosen[k] for k in ("window", "decay", "weight", "HR@10", METRIC, "HR@100", "value_spread")},
            "chosen_on": "validation", "users": int(len(users)), "grid": chosen["grid"],
            "tables": [{k: r[k] for k in ("window", "decay", "weight", METRIC)} for r in results]}
