"""Non-neural baselines for the leave-one-out protocol: popularity, PureSVD, EASE, a first-order
Markov chain on the last item, and the Markov chain blended with EASE.

Each ``baseline(split, stage, ...)`` fits on every user's history at ``stage`` (the train part for
"valid", train + valid for "test"; train-only users included) and returns a score function for
:func:`silverrec.publish.evaluate.evaluate_scores`. :func:`run_baselines` applies the protocol:
hyper-parameters chosen on validation, test figures from the refit on train + valid.

PureSVD and EASE work on the binary user x item matrix X restricted to the "active" items, those
that occur in some history: the others have no evidence and score ``-inf`` (below every active
item; a cold target is then ranked at its tie-aware expected place among the cold items, as
popularity's zero counts do). Up to DENSE_CELLS cells (MovieLens small: 610 x ~9k) X is dense
float64 and both use whichever Gram matrix is smaller, X X^T [U, U] or X^T X [n, n], so they are
exact and take well under a second. Larger logs (the Amazon Video Games sequences: 31k x 24k) keep X
sparse and work in float32: EASE factors X^T X + lam I (Cholesky) once per lam and scores a batch as
a sparse product, PureSVD takes randomised factors (`torch.svd_lowrank`).

The Markov chain scores P(j | the history's last item) from the counts of consecutive pairs in the
histories, with popularity breaking its ties (an unseen transition, or no history); the blend adds
w * P(j | last) to EASE's score, with w chosen on validation.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from silverrec.publish.evaluate import ScoreFn, evaluate_scores
from silverrec.publish.logs import Split
from silverrec.publish.transitions import chain

SVD_DIMS = (16, 32, 64, 128)
EASE_LAMBDAS = (50.0, 200.0, 500.0, 1000.0)
BLEND_WEIGHTS = (0.0, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)  # Markov + EASE: w in EASE + w * P(j | last)
DENSE_CELLS = 50_000_000  # a history matrix up to this many cells is dense float64 (exact); beyond, sparse float32
BASELINES = ("popularity", "PureSVD", "EASE", "Markov", "Markov + EASE")
POPULARITY_TIE = 1e-9  # the Markov chain's popularity tie-break: below any transition probability's gaps


class _Interactions:
    """Binary history matrix of a stage over its active items, and the batch encoder; `sparse`
    (default: beyond DENSE_CELLS cells) keeps X as a sparse float32 matrix instead of dense float64."""

    def __init__(self, split: Split, stage: str, sparse: bool | None = None):
        offsets, rows = split.history_csr(stage)
        self.num_items = split.logs.num_items
        self.active = np.unique(rows)  # int64 [n] pool rows with >= 1 history interaction
        self.col = np.full(self.num_items, -1, dtype=np.int64)  # pool row -> column, -1 = inactive
        self.col[self.active] = np.arange(len(self.active))
        users = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        shape = (len(offsets) - 1, len(self.active))
        self.sparse = shape[0] * shape[1] > DENSE_CELLS if sparse is None else bool(sparse)
        self.dtype = torch.float32 if self.sparse else torch.float64
        if self.sparse:  # duplicates (a repeated item) coalesce to one
            ind = torch.from_numpy(np.unique(np.stack([users, self.col[rows]]), axis=1))
            self.X = torch.sparse_coo_tensor(ind, torch.ones(ind.shape[1]), shape, check_invariants=False).coalesce()
        else:
            self.X = torch.zeros(shape, dtype=torch.float64)  # [U, n]
            self.X[torch.from_numpy(users), torch.from_numpy(self.col[rows])] = 1.0

    def encode(self, histories: list[np.ndarray]) -> torch.Tensor:
        """[b, n]: 1 where the history holds the active item (inactive ones are dropped); sparse
        float32 for a sparse X, else dense float64."""
        cols = [np.unique(c[c >= 0]) for c in (self.col[np.asarray(h, dtype=np.int64)] for h in histories)]
        owner = np.repeat(np.arange(len(cols)), [c.size for c in cols])
        flat = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
        if self.sparse:
            ind = torch.from_numpy(np.stack([owner, flat]).astype(np.int64))
            shape = (len(histories), len(self.active))
            return torch.sparse_coo_tensor(ind, torch.ones(ind.shape[1]), shape, check_invariants=False)
        x = torch.zeros(len(histories), len(self.active), dtype=torch.float64)
        x[torch.from_numpy(owner), torch.from_numpy(flat)] = 1.0
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

    def __init__(self, split: Split, stage: str, max_dim: int = max(SVD_DIMS), sparse: bool | None = None):
        self.data = _Interactions(split, stage, sparse)
        X = self.data.X
        u_count, n = X.shape
        if self.data.sparse:  # randomised SVD of the sparse matrix (seeded: the same factors every run)
            with torch.random.fork_rng():
                torch.manual_seed(0)
                _, s, v = torch.svd_lowrank(X, q=min(max_dim + 10, u_count, n), niter=6)
            self.V = v[:, :max_dim][:, s[:max_dim] > s[0].clamp_min(1e-30) * 1e-5]
        elif u_count < n:
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

    def __init__(self, split: Split, stage: str, sparse: bool | None = None):
        self.data = _Interactions(split, stage, sparse)
        X = self.data.X
        if self.data.sparse:  # the item Gram matrix, factored per lam (`score_fn`)
            self.dual = False
            with warnings.catch_warnings():  # torch calls its sparse CSR product "beta"
                warnings.simplefilter("ignore", UserWarning)
                self.gram = torch.sparse.mm(X.t().coalesce(), X).to_dense()
            return
        self.dual = X.shape[0] < X.shape[1]
        gram = X @ X.T if self.dual else X.T @ X
        self.evals, self.evecs = torch.linalg.eigh(gram)

    def weights(self, lam: float) -> torch.Tensor:
        """The sparse path's B float32 [n, n] (diagonal 0) for one lam, from a Cholesky factor of
        X^T X + lam I (one n x n matrix beside the Gram matrix, overwritten in place)."""
        a = self.gram.clone()
        a.diagonal().add_(lam)
        factor = torch.linalg.cholesky(a)
        del a
        B = torch.cholesky_inverse(factor)  # P
        del factor
        B.div_(-torch.diagonal(B).clone())
        B.fill_diagonal_(0.0)
        return B

    def score_fn(self, lam: float) -> ScoreFn:
        if lam <= 0:
            raise ValueError(f"EASE lam must be positive, got {lam}")
        if self.data.sparse:
            if getattr(self, "_lam", None) != lam:  # the last lam's B is kept (a blend grid reuses it)
                self._B = None
                self._lam, self._B = lam, self.weights(lam)
            B = self._B

            def score_sparse(users: np.ndarray, histories: list[np.ndarray]) -> torch.Tensor:
                return self.data.expand(torch.sparse.mm(self.data.encode(histories), B))

            return score_sparse
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


class Markov:
    """First-order Markov chain on the last item: P(j | i) = C[i, j] / sum_j C[i, j], C counting the
    consecutive pairs (i, j) of every history at ``stage``. A history's scores are P(j | its last
    item) plus POPULARITY_TIE * pop(j) / max pop (popularity breaks the ties of unseen transitions;
    an empty history gets popularity alone). Transitions are kept sparse (CSR by source item)."""

    def __init__(self, split: Split, stage: str):
        offsets, rows = split.history_csr(stage)
        n = split.logs.num_items
        self.num_items = n
        src, self.dst, self.prob = chain(offsets, rows, n)  # float64 P [pairs], sorted by (src, dst)
        self.indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(src, minlength=n), out=self.indptr[1:])
        pop = np.bincount(rows, minlength=n).astype(np.float64)
        self.tie = torch.from_numpy(POPULARITY_TIE * pop / max(pop.max(), 1.0))

    def probabilities(self, histories: list[np.ndarray]) -> torch.Tensor:
        """float64 [b, N]: P(j | the last item) per history (zero rows for empty histories)."""
        out = torch.zeros(len(histories), self.num_items, dtype=torch.float64)
        for b, h in enumerate(histories):
            if len(h):
                lo, hi = self.indptr[h[-1]], self.indptr[h[-1] + 1]
                out[b, torch.from_numpy(self.dst[lo:hi])] = torch.from_numpy(self.prob[lo:hi])
        return out

    def score_fn(self) -> ScoreFn:
        def score(users: np.ndarray, histories: list[np.ndarray]) -> torch.Tensor:
            return self.probabilities(histories) + self.tie

        return score


def markov(split: Split, stage: str) -> ScoreFn:
    """First-order Markov score function, fit on the histories at ``stage``."""
    return Markov(split, stage).score_fn()


def markov_ease(ease_model: EASE, chain: Markov, lam: float, weight: float) -> ScoreFn:
    """EASE's score (lam) + weight * P(j | last item) (inactive items stay -inf)."""
    base = ease_model.score_fn(lam)

    def score(users: np.ndarray, histories: list[np.ndarray]) -> torch.Tensor:
        return base(users, histories).double() + weight * chain.probabilities(histories)

    return score


def run_baselines(
    split: Split,
    *,
    dims: tuple[int, ...] = SVD_DIMS,
    lams: tuple[float, ...] = EASE_LAMBDAS,
    weights: tuple[float, ...] = BLEND_WEIGHTS,
    select: str = "NDCG@100",
    batch: int = 256,
    valid_users: int = 4096,
    log=lambda msg: None,
    only: tuple[str, ...] = BASELINES,
) -> dict[str, dict[str, float]]:
    """Test metrics of popularity, PureSVD, EASE, Markov and Markov + EASE (or those of them in `only`)
    under the protocol.

    PureSVD's ``dim``, EASE's ``lam`` and the blend's ``weight`` (with EASE's chosen lam) maximise
    ``select`` on the validation stage (fit on the train parts; scored on at most ``valid_users`` eval
    users, a sample seeded with 0 where there are more); the test figures come from the refit on
    train + valid with those values, over every eval user.

    Returns:
        name -> test metrics (HR@K, NDCG@K, "users") plus the chosen hyper-parameter ("dim" / "lam" /
        "weight"), its validation score (``"valid_" + select``) and "seconds" (validation grid + test).
    """
    unknown = sorted(set(only) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown baseline {unknown[0]!r}: use some of {BASELINES}")
    if "Markov + EASE" in only and "EASE" not in only:
        raise ValueError("Markov + EASE blends with EASE's chosen lam: measure EASE too")
    out = {}
    t0 = time.perf_counter()
    if "popularity" in only:
        out["popularity"] = evaluate_scores(popularity(split, "test"), split, "test", batch)
        out["popularity"]["seconds"] = time.perf_counter() - t0
        log("popularity")
    fitted: dict[str, dict[str, object]] = {}
    sample = None
    if len(split.eval_users) > valid_users:
        sample = np.sort(np.random.default_rng(0).permutation(len(split.eval_users))[:valid_users])
    for name, model, grid, key in (("PureSVD", PureSVD, dims, "dim"), ("EASE", EASE, lams, "lam")):
        if name not in only:
            continue
        t0 = time.perf_counter()
        valid_model = model(split, "valid", max(grid)) if model is PureSVD else model(split, "valid")
        valid = {v: evaluate_scores(valid_model.score_fn(v), split, "valid", batch, sample)[select] for v in grid}
        best = max(grid, key=lambda v: valid[v])  # first of equal values
        test_model = model(split, "test", best) if model is PureSVD else model(split, "test")
        out[name] = evaluate_scores(test_model.score_fn(best), split, "test", batch)
        out[name].update({key: float(best), f"valid_{select}": valid[best], "seconds": time.perf_counter() - t0})
        fitted[name] = {"valid": valid_model, "test": test_model}
        log(name)
    if "Markov" not in only and "Markov + EASE" not in only:
        return out
    t0 = time.perf_counter()
    chains = {stage: Markov(split, stage) for stage in ("valid", "test")}
    if "Markov" in only:
        out["Markov"] = evaluate_scores(chains["test"].score_fn(), split, "test", batch)
        out["Markov"]["seconds"] = time.perf_counter() - t0
        log("Markov")
    if "Markov + EASE" not in only:
        return out
    t0 = time.perf_counter()
    lam = out["EASE"]["lam"]
    valid = {w: evaluate_scores(markov_ease(fitted["EASE"]["valid"], chains["valid"], lam, w), split, "valid", batch,
                                sample)[select] for w in weights}
    best = max(weights, key=lambda w: valid[w])
    out["Markov + EASE"] = evaluate_scores(markov_ease(fitted["EASE"]["test"], chains["test"], lam, best), split, "test", batch)
    out["Markov + EASE"].update({"weight": float(best), "lam": lam, f"valid_{select}": valid[best],
                                 "seconds": time.perf_counter() - t0})
    log("Markov + EASE")
    return out


if __name__ == "__main__":  # python -m silverrec.publish.baselines INTERACTIONS ITEMS [USERS]
    import argparse
    import json

    from silverrec.publish.logs import leave_one_out, read_logs

    p = argparse.ArgumentParser(description="popularity / PureSVD / EASE / Markov / Markov + EASE on leave-one-out logs")
    p.add_argument("interactions")
    p.add_argument("items")
    p.add_argument("users", nargs="?")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="+", default=list(BASELINES), choices=BASELINES,
                   help="some of the baselines (EASE's dense Cholesky factors cost O(items^3) per lam)")
    p.add_argument("--lams", type=float, nargs="+", default=list(EASE_LAMBDAS),
                   help="EASE's L2 grid, chosen on validation (two factorisations per lam: valid and test fit)")
    a = p.parse_args()
    print(json.dumps(run_baselines(leave_one_out(read_logs(a.interactions, a.items, a.users, seed=a.seed)),
                                   only=tuple(a.only), lams=tuple(a.lams)), indent=1))
