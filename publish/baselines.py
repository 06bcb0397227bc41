"""Non-neural baselines for the leave-one-out protocol: popularity, PureSVD and EASE.

Each ``baseline(split, stage, ...)`` fits on every user's history at ``stage`` (the train part for
"valid", train + valid for "test"; train-only users included) and returns a score function for
:func:`silverrec.publish.evaluate.evaluate_scores`. :func:`run_baselines` applies the protocol:
hyper-parameters chosen on validation, test figures from the refit on train + valid.

PureSVD and EASE work on the binary user x item matrix X restricted to the "active" items, those
that occur in some history: the others have no evidence and score ``-inf`` (below every active
item; a cold target is then ranked at its tie-aware expected place among the cold items, as
popularity's zero counts do). X is dense float64 [U, n_active], which suits logs up to ~1e8 cells
(MovieLens small: 610 x ~9k). Both use whichever Gram matrix is smaller, X X^T [U, U] or
X^T X [n, n], so they are exact and take well under a second on MovieLens small.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from silverrec.publish.evaluate import ScoreFn, evaluate_scores
from silverrec.publish.logs import Split

SVD_DIMS = (16, 32, 64, 128)
EASE_LAMBDAS = (50.0, 200.0, 500.0, 1000.0)


class _Interactions:
    """Binary history matrix of a stage over its active items, and the batch encoder."""

    def __init__(self, split: Split, stage: str):
        offsets, rows = split.history_csr(stage)
        self.num_items = split.logs.num_items
        self.active = np.unique(rows)  # int64 [n] pool rows with >= 1 history interaction
        self.col = np.full(self.num_items, -1, dtype=np.int64)  # pool row -> column, -1 = inactive
        self.col[self.active] = np.arange(len(self.active))
        users = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        self.X = torch.zeros(len(offsets) - 1, len(self.active), dtype=torch.float64)  # [U, n]
        self.X[torch.from_numpy(users), torch.from_numpy(self.col[rows])] = 1.0

    def encode(self, histories: list[np.ndarray]) -> torch.Tensor:
        """float64 [b, n]: 1 where the history holds the active item (inactive ones are dropped)."""
        x = torch.zeros(len(histories), len(self.active), dtype=torch.float64)
        for i, h in enumerate(histories):
            c = self.col[np.asarray(h, dtype=np.int64)]
            x[i, torch.from_numpy(c[c >= 0])] = 1.0
        return x

    def expand(self, scores: torch.Tensor) -> torch.Tensor:
        """float32 [b, N] from active-item scores [b, n]; inactive pool rows get -inf."""
        out = torch.full((scores.shape[0], self.num_items), -torch.inf, dtype=torch.float32)
        out[:, torch.from_numpy(self.active)] = scores.float()
        return out


def popularity(split: Split, stage: str) -> ScoreFn:
    """Every user gets the item interaction counts of all histories at ``stage`` (float32 [N])."""
    _, rows = split.history_csr(stage)
    counts = torch.from_numpy(np.bincount(rows, minlength=split.logs.num_items).astype(np.float32))

    def score(users: np.ndarray, histories: list[np.ndarray]) -> torch.Tensor:
        return counts.expand(len(users), -1)

    return score


class PureSVD:
    """PureSVD (Cremonesi, Koren, Turrin, RecSys 2010): score = x_u V_d V_d^T.

    V_d: the top-d right singular vectors of the binary history matrix X, computed once from the
    smaller Gram matrix (float64 eigh), so every d of a grid is a slice of the same factors.
    """

    def __init__(self, split: Split, stage: str, max_dim: int = max(SVD_DIMS)):
        self.data = _Interactions(split, stage)
        X = self.data.X
        u_count, n = X.shape
        if u_count < n:
            evals, evecs = torch.linalg.eigh(X @ X.T)  # ascending, [U]
            evals, evecs = evals.flip(0)[:max_dim], evecs.flip(1)[:, :max_dim]
            keep = evals > evals[0].clamp_min(1e-300) * 1e-10  # drop null directions (rank < dim)
            s = evals[keep].sqrt()
            self.V = (X.T @ evecs[:, keep]) / s  # [n, d]: right singular vectors
        else:
            evals, evecs = torch.linalg.eigh(X.T @ X)  # [n]
            evals, evecs = evals.flip(0)[:max_dim], evecs.flip(1)[:, :max_dim]
            keep = evals > evals[0].clamp_min(1e-300) * 1e-10
            self.V = evecs[:, keep]

    def score_fn(self, dim: int) -> ScoreFn:
        V = self.V[:, :dim]

        def score(users: np.ndarray, histories: list[np.ndarray]) -> torch.Tensor:
            x = self.data.encode(histories)
            return self.data.expand((x @ V) @ V.T)

        return score


def pure_svd(split: Split, stage: str, dim: int = 64) -> ScoreFn:
    """PureSVD score function with ``dim`` factors, fit on the histories at ``stage``."""
    return PureSVD(split, stage, max_dim=dim).score_fn(dim)


class EASE:
    """EASE (Steck, WWW 2019): B = I - P / diag(P), P = (X^T X + lam I)^-1, so diag(B) = 0; score = x_u B.

    With fewer users than active items, P comes from the Woodbury identity
    P = (I - X^T (X X^T + lam I)^-1 X) / lam, and ``x B = x - (x P) / diag(P)`` is applied without
    forming the n x n matrix: an eigendecomposition of X X^T [U, U] serves every lam of a grid.
    Otherwise the primal n x n inverse is formed. Both in float64.
    """

    def __init__(self, split: Split, stage: str):
        self.data = _Interactions(split, stage)
        X = self.data.X
        self.dual = X.shape[0] < X.shape[1]
        gram = X @ X.T if self.dual else X.T @ X
        self.evals, self.evecs = torch.linalg.eigh(gram)

    def score_fn(self, lam: float) -> ScoreFn:
        if lam <= 0:
            raise ValueError(f"EASE lam must be positive, got {lam}")
        X, Q, ev = self.data.X, self.evecs, self.evals
        inv = (Q / (ev + lam)) @ Q.T  # (gram + lam I)^-1
        if self.dual:
            MX = inv @ X  # [U, n]
            diag = (1.0 - (MX * X).sum(dim=0)) / lam  # diag(P) [n]

            def apply(x: torch.Tensor) -> torch.Tensor:
                xP = (x - (x @ X.T) @ MX) / lam
                return x - xP / diag
        else:
            B = -inv / torch.diagonal(inv)
            B.fill_diagonal_(0.0)

            def apply(x: torch.Tensor) -> torch.Tensor:
                return x @ B

        def score(users: np.ndarray, histories: list[np.ndarray]) -> torch.Tensor:
            return self.data.expand(apply(self.data.encode(histories)))

        return score


def ease(split: Split, stage: str, lam: float = 200.0) -> ScoreFn:
    """EASE score function with L2 weight ``lam``, fit on the histories at ``stage``."""
    return EASE(split, stage).score_fn(lam)


def run_baselines(
    split: Split,
    *,
    dims: tuple[int, ...] = SVD_DIMS,
    lams: tuple[float, ...] = EASE_LAMBDAS,
    select: str = "NDCG@100",
    batch: int = 256,
) -> dict[str, dict[str, float]]:
    """Test metrics of popularity, PureSVD and EASE under the protocol.

    PureSVD's ``dim`` and EASE's ``lam`` maximise ``select`` on the validation stage (fit on the
    train parts); the test figures come from the refit on train + valid with that value.

    Returns:
        name -> test metrics (HR@K, NDCG@K, "users") plus the chosen hyper-parameter ("dim"/"lam"),
        its validation score (``"valid_" + select``) and "seconds" (validation grid + test).
    """
    out = {}
    t0 = time.perf_counter()
    out["popularity"] = evaluate_scores(popularity(split, "test"), split, "test", batch)
    out["popularity"]["seconds"] = time.perf_counter() - t0

    for name, model, grid, key in (("PureSVD", PureSVD, dims, "dim"), ("EASE", EASE, lams, "lam")):
        t0 = time.perf_counter()
        fitted = model(split, "valid", max(grid)) if model is PureSVD else model(split, "valid")
        valid = {v: evaluate_scores(fitted.score_fn(v), split, "valid", batch)[select] for v in grid}
        best = max(grid, key=lambda v: valid[v])  # first of equal values
        refit = model(split, "test", best) if model is PureSVD else model(split, "test")
        out[name] = evaluate_scores(refit.score_fn(best), split, "test", batch)
        out[name].update({key: float(best), f"valid_{select}": valid[best], "seconds": time.perf_counter() - t0})
    return out


if __name__ == "__main__":  # python -m silverrec.publish.baselines INTERACTIONS ITEMS [USERS]
    import argparse
    import json

    from silverrec.publish.logs import leave_one_out, read_logs

    p = argparse.ArgumentParser(description="popularity / PureSVD / EASE on leave-one-out logs")
    p.add_argument("interactions")
    p.add_argument("items")
    p.add_argument("users", nargs="?")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(json.dumps(run_baselines(leave_one_out(read_logs(a.interactions, a.items, a.users, seed=a.seed))), indent=1))
