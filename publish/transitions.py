"""The next-item transitions of a recommendation snapshot at publish (silverrec/retrieval/transitions.py).

    publish.toml:  transitions = 100            # M successors per item (0 = none)
                   transition_weight = "auto"   # or a number w >= 0
                   transition_window = "auto"   # or a number of steps (1: the first-order chain)
                   transition_decay = 0.8

`transition_tables`: the chain of the snapshot's stored histories (publish/rec.py
`stored_histories`: every user's history at its training stage, the held-out test items absent): C[i, j] sums
decay^(d - 1) over every time j follows i by d <= window steps within a history (window 1: the
consecutive pairs, the first-order Markov chain), P(j | i) = C[i, j] / sum_j C[i, j], and each item
keeps its M likeliest successors (ties: the more popular successor first, then the lower row).

`choose_weight`: w in value + w * P, chosen on the validation items: each stored history's newest
item is held out (its target), the chain is fitted on the histories without it, and one request per
user (a seeded sample of at most VALID_USERS) asks the snapshot with those tables for its top 100,
as served, once per w of the grid: GRID times the values' spread (the mean gap between a request's
best value and its 100th at w = 0). The best NDCG@10 wins (the first of equals: w = 0 before any
other, so a chain that does not help is switched off). With transition_window = "auto" each window
of WINDOWS gets its own validation tables and grid, and the best NDCG@10 picks the window too (the
first of equals: the shorter). The grid, each w's figures and the choice go to the manifest
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
WINDOWS = (1, 3, 10)  # transition_window = "auto": the windows tried (1: the first-order chain)
VALID_USERS = 4096
METRIC = "NDCG@10"
K_EVAL = 100


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


def choose_weight(handler_with: Callable[[float], Any], row_to_item: np.ndarray, offsets: np.ndarray,
                  rows: np.ndarray, targets: np.ndarray, seed: int, batch: int = 64) -> dict[str, Any]:
    """The weight (module docstring). `handler_with(w)`: a predictor over the snapshot with the
    validation tables and weight w; (offsets, rows) the validation histories (canonical rows),
    targets int64 [U] their held-out rows (-1 = none)."""
    users = np.flatnonzero((targets >= 0) & (np.diff(offsets) >= 1))
    if len(users) == 0:
        return {"weight": 0.0, "chosen_on": "no validation items"}
    users = np.sort(np.random.default_rng(seed).permutation(users)[:VALID_USERS])
    target_ids = torch.from_numpy(row_to_item[targets[users]].astype(np.int64))

    def run(w: float) -> tuple[dict[str, float], torch.Tensor]:
        handler, ids, scores = handler_with(w), [], []
        for s in range(0, len(users), batch):
            hists = [rows[offsets[u]:offsets[u + 1]] for u in users[s:s + batch]]
            res = handler.recommend([{"history": row_to_item[h]} for h in hists], k=K_EVAL,
                                    exclude_limit=max(len(np.unique(h)) for h in hists))
            ids.append(res.item_ids)
            scores.append(res.scores)
        m = metrics_from_ranks(ranks_from_topk(torch.cat(ids), target_ids))
        return {"weight": round(w, 6), **{k: round(m[k], 5) for k in ("HR@10", METRIC, "HR@100")}}, torch.cat(scores)

    first, value = run(0.0)
    real = value > float("-inf")
    last = (real.sum(1, keepdim=True) - 1).clamp_min(0)  # each request's 100th value, or its last
    gap = (value[:, 0] - value.gather(1, last)[:, 0])[real[:, 0]]
    spread = float(gap.mean()) if gap.numel() and float(gap.mean()) > 0 else 1.0
    grid = [first] + [run(g * spread)[0] for g in GRID[1:]]
    best = max(grid, key=lambda r: (r[METRIC], -grid.index(r)))
    return {"weight": best["weight"], METRIC: best[METRIC], "chosen_on": "validation", "users": int(len(users)),
            "value_spread": round(spread, 6), "grid": grid}
