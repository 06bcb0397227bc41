"""Full-ranking evaluation of the leave-one-out split: tie-aware ranks, HR@K and NDCG@K.

The protocol (docs/architecture.md, "Evaluation"): every pool row is scored, the user's known items (its history
at that stage) are masked, and the held-out target is ranked among the rest. Ties are counted at
the expected rank, ``greater + (equal - 1) / 2`` (trap 2): a target scored 0 among 999 other zeros
lands at 499.5, not at 0 as an optimistic ``argsort`` would put it.

HR@K = mean(rank < K); NDCG@K = mean(1 / log2(rank + 2) if rank < K else 0), with the 0-based float
expected rank (one relevant item, so the ideal DCG is 1).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from silverrec.publish.logs import Split

KS_HR = (10, 50, 100)
KS_NDCG = (10, 100)

# score_fn(user indices int64 [b], histories: pool rows per user) -> scores float [b, N]
ScoreFn = Callable[[np.ndarray, list], "torch.Tensor | np.ndarray"]


def _known_mask(known: list[np.ndarray], batch: int, n: int, device) -> torch.Tensor:
    """bool [B, N]: True at every known (masked) pool row."""
    if len(known) != batch:
        raise ValueError(f"known has {len(known)} rows, scores have {batch}")
    mask = torch.zeros(batch, n, dtype=torch.bool, device=device)
    lengths = [len(k) for k in known]
    if sum(lengths):
        cols = torch.from_numpy(np.concatenate([np.asarray(k, dtype=np.int64).reshape(-1) for k in known]))
        lo, hi = int(cols.min()), int(cols.max())
        if lo < 0 or hi >= n:
            raise ValueError(f"known holds pool row {lo if lo < 0 else hi}, outside [0, {n})")
        rows = torch.repeat_interleave(torch.arange(batch), torch.tensor(lengths))
        mask[rows.to(device), cols.to(device)] = True
    return mask


def target_ranks(scores: torch.Tensor, targets: torch.Tensor, known: list[np.ndarray] | None = None) -> torch.Tensor:
    """0-based expected rank of each target among the unmasked pool rows.

    Args:
        scores: float [B, N], a score for every pool row (higher = better).
        targets: int64 [B], the held-out pool row per query.
        known: per query, pool rows to mask (treated as scored -inf and left out of the count);
            the target itself is never masked, even when it appears in ``known``.

    Returns:
        float64 [B]: ``#(unmasked rows scored > target) + (#(unmasked rows scored == target) - 1) / 2``
        where the second count includes the target itself.

    Raises:
        ValueError: wrong shapes, a target or known row outside [0, N), NaN scores.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, N], got shape {tuple(scores.shape)}")
    s = scores.detach()
    b, n = s.shape
    t = torch.as_tensor(targets, dtype=torch.int64, device=s.device).reshape(-1)
    if t.shape[0] != b:
        raise ValueError(f"targets has {t.shape[0]} entries, scores have {b} rows")
    if b and (int(t.min()) < 0 or int(t.max()) >= n):
        raise ValueError(f"targets must be pool rows in [0, {n}), got {int(t.min())}..{int(t.max())}")
    nan = torch.isnan(s).any(dim=1)
    if bool(nan.any()):
        raise ValueError(f"scores row {int(nan.nonzero()[0, 0])} contains NaN")
    if known is None:
        keep = torch.ones(b, n, dtype=torch.bool, device=s.device)
    else:
        keep = ~_known_mask(known, b, n, s.device)
    keep[torch.arange(b, device=s.device), t] = True
    ts = s.gather(1, t[:, None])  # [B, 1]
    greater = ((s > ts) & keep).sum(dim=1)
    equal = ((s == ts) & keep).sum(dim=1)  # >= 1: the target itself
    return greater.double() + (equal.double() - 1.0) / 2.0


def ranks_from_topk(
    topk_rows: torch.Tensor, targets: torch.Tensor, known: list[np.ndarray] | None = None
) -> torch.Tensor:
    """Ranks for a model that returns only a top-K list (its order is taken as given, no ties).

    Args:
        topk_rows: int64 [B, K] pool rows, best first; -1 = padding.
        targets: int64 [B] pool rows.
        known: optional per-query pool rows to drop from the list before counting (for a model that
            did not exclude the history itself); the target is never dropped.

    Returns:
        float64 [B]: 0-based position of the target among the kept entries, ``inf`` when absent.
    """
    if topk_rows.dim() != 2:
        raise ValueError(f"topk_rows must be [B, K], got shape {tuple(topk_rows.shape)}")
    rows = topk_rows.detach().to(torch.int64).cpu()
    b = rows.shape[0]
    t = torch.as_tensor(targets, dtype=torch.int64).reshape(-1).cpu()
    if t.shape[0] != b:
        raise ValueError(f"targets has {t.shape[0]} entries, topk_rows has {b} rows")
    hit = rows == t[:, None]  # padding (-1) never equals a target (>= 0)
    keep = rows >= 0
    if known is not None:
        if len(known) != b:
            raise ValueError(f"known has {len(known)} rows, topk_rows has {b}")
        dropped = torch.zeros_like(hit)
        for r, k in enumerate(known):
            dropped[r] = torch.from_numpy(np.isin(rows[r].numpy(), np.asarray(k, dtype=np.int64)))
        keep &= ~(dropped & ~hit)
    before = torch.cumsum(keep.to(torch.int64), dim=1) - 1  # position among kept entries
    first = hit.to(torch.int64).argmax(dim=1)  # first hit (argmax returns the first maximum)
    pos = before.gather(1, first[:, None]).squeeze(1).double()
    return torch.where(hit.any(dim=1), pos, torch.full_like(pos, math.inf))


def metrics_from_ranks(ranks: torch.Tensor) -> dict[str, float]:
    """{"HR@10", "HR@50", "HR@100", "NDCG@10", "NDCG@100"} from 0-based float ranks [B] (inf = miss)."""
    r = torch.as_tensor(ranks).double().reshape(-1)
    if r.numel() == 0:
        raise ValueError("no ranks to average")
    if bool(torch.isnan(r).any()):
        raise ValueError("ranks contain NaN")
    out = {f"HR@{k}": float((r < k).double().mean()) for k in KS_HR}
    for k in KS_NDCG:
        gain = torch.where(r < k, 1.0 / torch.log2(r.clamp_max(k) + 2.0), torch.zeros_like(r))
        out[f"NDCG@{k}"] = float(gain.mean())
    return out


def evaluate_ranks(score_fn: ScoreFn, split: Split, stage: str = "test", batch: int = 256,
                   sample: np.ndarray | None = None) -> torch.Tensor:
    """Tie-aware rank float64 [U'] of each eval user's target (``split.eval_users`` order).

    ``score_fn(user_indices int64 np [b], histories list[np.ndarray]) -> float [b, N]`` scores every
    pool row for a batch of eval users given their histories at ``stage``; known items are masked
    here. ``sample``: positions into ``split.eval_users``, to rank only those users' targets (in that
    order). Keep the ranks of each seed to report a mean and spread (:func:`mean_and_spread`).
    """
    users = split.eval_users
    targets = split.targets(stage)
    if sample is not None:
        users, targets = users[sample], targets[sample]
    n = split.logs.num_items
    out = []
    for start in range(0, len(users), batch):
        u = users[start : start + batch]
        hist = split.histories(u, stage)
        scores = torch.as_tensor(score_fn(u, hist))
        if scores.shape != (len(u), n):
            raise ValueError(f"score_fn returned shape {tuple(scores.shape)}, expected ({len(u)}, {n})")
        known = [np.unique(h) for h in hist]
        out.append(target_ranks(scores, torch.from_numpy(targets[start : start + batch]), known).cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def evaluate_scores(score_fn: ScoreFn, split: Split, stage: str = "test", batch: int = 256,
                    sample: np.ndarray | None = None) -> dict[str, float]:
    """Metrics of :func:`evaluate_ranks` plus ``"users"`` (the number of eval users)."""
    ranks = evaluate_ranks(score_fn, split, stage, batch, sample)
    return {**metrics_from_ranks(ranks), "users": float(ranks.numel())}


def mean_and_spread(runs: list[dict[str, float]]) -> dict[str, tuple[float, float]]:
    """Per metric (mean, sample standard deviation) over runs, e.g. 3 seeds (std 0 for one run)."""
    if not runs:
        raise ValueError("no runs")
    out = {}
    for key in runs[0]:
        v = np.array([r[key] for r in runs], dtype=np.float64)
        out[key] = (float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0)
    return out
