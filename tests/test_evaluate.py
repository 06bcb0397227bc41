"""Evaluation metrics (publish/evaluate.py) and baselines (publish/baselines.py).

References: a brute-force Python rank loop, hand-computed HR/NDCG, and straightforward numpy
EASE / PureSVD on the full item matrix built directly from the generated histories.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from silverrec.publish import baselines
from silverrec.publish.evaluate import (
    evaluate_ranks,
    evaluate_scores,
    mean_and_spread,
    metrics_from_ranks,
    ranks_from_topk,
    target_ranks,
)
from silverrec.publish.logs import leave_one_out, logs_from_arrays, read_logs
from silverrec.publish.movielens import write_logs


def _brute_rank(scores: list[float], target: int, known: set[int]) -> float:
    greater = equal = 0
    for j, s in enumerate(scores):
        if j in known and j != target:
            continue
        if s > scores[target]:
            greater += 1
        elif s == scores[target] and j != target:
            equal += 1
    return greater + equal / 2


def test_target_ranks_against_brute_force():
    rng = np.random.default_rng(1)
    b, n = 19, 111
    scores = torch.from_numpy(rng.integers(0, 6, size=(b, n)).astype(np.float32))  # many ties
    targets = torch.from_numpy(rng.integers(0, n, size=b))
    known = [rng.choice(n, size=rng.integers(0, 40), replace=False) for _ in range(b)]
    known[3] = np.r_[known[3], targets[3].item()]  # a target inside its known set stays ranked
    got = target_ranks(scores, targets, known)
    assert got.dtype == torch.float64
    for r in range(b):
        assert got[r].item() == _brute_rank(scores[r].tolist(), int(targets[r]), set(known[r].tolist()))
    no_mask = target_ranks(scores, targets, None)
    for r in range(b):
        assert no_mask[r].item() == _brute_rank(scores[r].tolist(), int(targets[r]), set())


def test_ties_count_at_the_expected_rank():
    scores = torch.zeros(1, 1000)
    assert target_ranks(scores, torch.tensor([5]), None).item() == 499.5  # not 0
    known = [np.r_[np.arange(100, 200)]]  # 100 masked zeros -> 899 other zeros remain
    assert target_ranks(scores, torch.tensor([5]), known).item() == 449.5
    scores[0, 7] = 1.0
    assert target_ranks(scores, torch.tensor([5]), known).item() == 450.0  # one strictly greater


def test_known_items_are_masked_but_never_the_target():
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    assert target_ranks(scores, torch.tensor([3]), None).item() == 3.0
    assert target_ranks(scores, torch.tensor([3]), [np.array([0, 1])]).item() == 1.0
    assert target_ranks(scores, torch.tensor([3]), [np.array([0, 1, 3])]).item() == 1.0
    # a target scored -inf ties only with unmasked -inf rows, not with the masked ones
    scores = torch.tensor([[-math.inf, -math.inf, -math.inf, 1.0]])
    assert target_ranks(scores, torch.tensor([0]), [np.array([1])]).item() == 1.5


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="NaN"):
        target_ranks(torch.tensor([[0.0, math.nan]]), torch.tensor([0]), None)
    with pytest.raises(ValueError, match="targets"):
        target_ranks(torch.zeros(2, 3), torch.tensor([0, 3]), None)
    with pytest.raises(ValueError, match="known"):
        target_ranks(torch.zeros(1, 3), torch.tensor([0]), [np.array([5])])


def test_metrics_by_hand():
    ranks = torch.tensor([0.0, 9.5, 10.0, 49.0, 99.5, math.inf])
    m = metrics_from_ranks(ranks)
    assert list(m) == ["HR@10", "HR@50", "HR@100", "NDCG@10", "NDCG@100"]
    assert m["HR@10"] == pytest.approx(2 / 6)
    assert m["HR@50"] == pytest.approx(4 / 6)
    assert m["HR@100"] == pytest.approx(5 / 6)
    assert m["NDCG@10"] == pytest.approx((1 + 1 / math.log2(11.5)) / 6)
    ndcg100 = 1 + 1 / math.log2(11.5) + 1 / math.log2(12) + 1 / math.log2(51) + 1 / math.log2(101.5)
    assert m["NDCG@100"] == pytest.approx(ndcg100 / 6)


def test_ranks_from_topk_matches_target_ranks_on_a_full_ranking():
    rng = np.random.default_rng(2)
    b, n = 13, 300
    scores = torch.from_numpy(np.stack([rng.permutation(n) for _ in range(b)]).astype(np.float32))  # no ties
    targets = torch.from_numpy(rng.integers(0, n, size=b))
    known = [rng.choice(n, size=30, replace=False) for _ in range(b)]
    full = torch.argsort(scores, dim=1, descending=True)
    torch.testing.assert_close(ranks_from_topk(full, targets), target_ranks(scores, targets, None))
    torch.testing.assert_close(ranks_from_topk(full, targets, known), target_ranks(scores, targets, known))
    # truncated and padded: absent targets are inf
    top = torch.cat([full[:, :20], torch.full((b, 5), -1)], dim=1)
    expected = target_ranks(scores, targets, None)
    expected = torch.where(expected < 20, expected, torch.full_like(expected, math.inf))
    torch.testing.assert_close(ranks_from_topk(top, targets), expected)


def _toy_split(n_users=40, n_items=60, per_user=(3, 12), seed=0):
    """Logs with distinct timestamps: (split, {user index: item pool rows in time order})."""
    rng = np.random.default_rng(seed)
    users, items, times, seqs = [], [], [], {}
    for u in range(n_users):
        seq = rng.choice(n_items - 5, size=rng.integers(*per_user), replace=False)  # last 5 items unused
        seqs[u] = seq.tolist()
        users += [u] * len(seq)
        items += seq.tolist()
        times += list(range(len(seq)))
    logs = logs_from_arrays(np.arange(n_items), {}, users, items, times)
    return leave_one_out(logs), seqs


def test_evaluate_scores_oracle_and_constant():
    split, seqs = _toy_split()
    n = split.logs.num_items

    def oracle(users, hist):
        s = torch.zeros(len(users), n)
        pos = np.searchsorted(split.eval_users, users)
        s[torch.arange(len(users)), torch.from_numpy(split.test_items[pos])] = 1.0
        return s

    m = evaluate_scores(oracle, split, "test", batch=7)
    assert m["HR@10"] == 1.0 and m["NDCG@100"] == 1.0 and m["users"] == len(seqs)

    ranks = evaluate_ranks(lambda users, hist: np.zeros((len(users), n), np.float32), split, "valid", batch=7)
    for e, u in enumerate(split.eval_users):
        known = set(seqs[u][:-2]) - {seqs[u][-2]}
        assert ranks[e].item() == (n - len(known) - 1) / 2

    with pytest.raises(ValueError, match="shape"):
        evaluate_scores(lambda users, hist: torch.zeros(len(users), n - 1), split)

    spread = mean_and_spread([{"HR@10": 0.1}, {"HR@10": 0.2}, {"HR@10": 0.3}])
    assert spread["HR@10"][0] == pytest.approx(0.2) and spread["HR@10"][1] == pytest.approx(0.1)


def _numpy_matrix(seqs, stage, n_items):
    """Binary user x item matrix of every user's history at the stage, from the raw sequences."""
    X = np.zeros((len(seqs), n_items))
    for u, seq in seqs.items():
        hist = seq if len(seq) < 3 else seq[:-2] if stage == "valid" else seq[:-1]
        X[u, hist] = 1.0
    return X


def _numpy_ease(X, lam):
    P = np.linalg.inv(X.T @ X + lam * np.eye(X.shape[1]))
    B = np.eye(X.shape[1]) - P / np.diag(P)
    np.fill_diagonal(B, 0.0)
    return X @ B


def _numpy_svd(X, dim):
    _, _, vt = np.linalg.svd(X, full_matrices=False)
    V = vt[:dim].T
    return X @ V @ V.T


def _model_scores(score_fn, split, stage):
    users = np.arange(split.logs.num_users)
    return score_fn(users, split.histories(users, stage)).double().numpy()


@pytest.mark.parametrize("n_users", [25, 120])  # fewer users than items (dual form) and more (primal)
def test_ease_and_pure_svd_against_numpy(n_users):
    n_items = 60
    split, seqs = _toy_split(n_users=n_users, n_items=n_items, seed=n_users)
    for stage in ("valid", "test"):
        X = _numpy_matrix(seqs, stage, n_items)
        active = X.sum(axis=0) > 0
        assert not active[-5:].any()
        for lam in (3.0, 50.0):
            got = _model_scores(baselines.ease(split, stage, lam=lam), split, stage)
            np.testing.assert_allclose(got[:, active], _numpy_ease(X, lam)[:, active], rtol=2e-4, atol=2e-5)
            assert np.isneginf(got[:, ~active]).all()
        for dim in (4, 9):
            got = _model_scores(baselines.pure_svd(split, stage, dim=dim), split, stage)
            np.testing.assert_allclose(got[:, active], _numpy_svd(X, dim)[:, active], rtol=2e-4, atol=2e-5)
            assert np.isneginf(got[:, ~active]).all()
        pop = _model_scores(baselines.popularity(split, stage), split, stage)
        np.testing.assert_array_equal(pop, np.broadcast_to(X.sum(axis=0), pop.shape))


@pytest.mark.parametrize("n_users", [25, 120])
def test_sparse_ease_and_pure_svd_against_numpy(n_users):
    """The large-logs path (sparse float32 X, Cholesky per lam, randomised SVD) on the same toy logs;
    the SVD keeps 50 of the ~55 active items' factors, so its randomised range is the whole space."""
    n_items = 60
    split, seqs = _toy_split(n_users=n_users, n_items=n_items, seed=n_users)
    for stage in ("valid", "test"):
        X = _numpy_matrix(seqs, stage, n_items)
        active = X.sum(axis=0) > 0
        model = baselines.EASE(split, stage, sparse=True)
        for lam in (3.0, 50.0):
            got = _model_scores(model.score_fn(lam), split, stage)
            np.testing.assert_allclose(got[:, active], _numpy_ease(X, lam)[:, active], rtol=1e-3, atol=1e-4)
            assert np.isneginf(got[:, ~active]).all()
        got = _model_scores(baselines.PureSVD(split, stage, max_dim=50, sparse=True).score_fn(50), split, stage)
        np.testing.assert_allclose(got[:, active], _numpy_svd(X, 50)[:, active], rtol=1e-3, atol=1e-3)


def test_markov_against_counted_transitions():
    split, seqs = _toy_split(n_users=50, n_items=30, seed=4)
    n = split.logs.num_items
    for stage in ("valid", "test"):
        counts: dict[int, dict[int, int]] = {}
        pop = np.zeros(n)
        for u, seq in seqs.items():
            hist = seq if len(seq) < 3 else seq[:-2] if stage == "valid" else seq[:-1]
            pop[hist] += 1
            for a, b in zip(hist[:-1], hist[1:]):
                counts.setdefault(a, {}).setdefault(b, 0)
                counts[a][b] += 1
        users = np.arange(split.logs.num_users)
        hists = split.histories(users, stage)
        got = baselines.markov(split, stage)(users, hists).numpy()
        for b, h in enumerate(hists):
            want = baselines.POPULARITY_TIE * pop / pop.max()
            row = counts.get(int(h[-1]), {}) if len(h) else {}
            for j, c in row.items():
                want[j] += c / sum(row.values())
            np.testing.assert_allclose(got[b], want, rtol=1e-12, atol=1e-15)


def test_run_baselines_picks_on_validation():
    split, _ = _toy_split(n_users=30)
    out = baselines.run_baselines(split, dims=(2, 4), lams=(1.0, 10.0), weights=(0.0, 1.0, 5.0))
    assert set(out) == {"popularity", "PureSVD", "EASE", "Markov", "Markov + EASE"}
    w, lam = out["Markov + EASE"]["weight"], out["Markov + EASE"]["lam"]
    assert w in (0.0, 1.0, 5.0) and lam == out["EASE"]["lam"]
    blend = baselines.markov_ease(baselines.EASE(split, "valid"), baselines.Markov(split, "valid"), lam, w)
    assert out["Markov + EASE"]["valid_NDCG@100"] == pytest.approx(evaluate_scores(blend, split, "valid")["NDCG@100"])
    for other in (0.0, 1.0, 5.0):
        fn = baselines.markov_ease(baselines.EASE(split, "valid"), baselines.Markov(split, "valid"), lam, other)
        assert evaluate_scores(fn, split, "valid")["NDCG@100"] <= out["Markov + EASE"]["valid_NDCG@100"] + 1e-12
    assert out["PureSVD"]["dim"] in (2, 4) and out["EASE"]["lam"] in (1.0, 10.0)
    for name in ("PureSVD", "EASE"):
        key = "dim" if name == "PureSVD" else "lam"
        best = out[name][key]
        fn = (baselines.pure_svd(split, "valid", dim=int(best)) if name == "PureSVD"
              else baselines.ease(split, "valid", lam=best))
        assert out[name]["valid_NDCG@100"] == pytest.approx(evaluate_scores(fn, split, "valid")["NDCG@100"])


def test_run_baselines_measures_the_ones_asked_for():
    split, _ = _toy_split(n_users=30)
    full = baselines.run_baselines(split, dims=(2, 4), lams=(1.0, 10.0), weights=(0.0, 1.0))
    some = baselines.run_baselines(split, dims=(2, 4), lams=(1.0, 10.0), weights=(0.0, 1.0),
                                   only=("popularity", "PureSVD", "Markov"))
    assert list(some) == ["popularity", "PureSVD", "Markov"]
    for name, row in some.items():
        assert {k: v for k, v in row.items() if k != "seconds"} == {k: v for k, v in full[name].items() if k != "seconds"}
    with pytest.raises(ValueError, match="measure EASE too"):
        baselines.run_baselines(split, only=("Markov + EASE",))
    with pytest.raises(ValueError, match="unknown baseline 'SASRec'"):
        baselines.run_baselines(split, only=("SASRec",))


def test_movielens_popularity_and_ease(tmp_path):
    inter, items = write_logs(tmp_path)
    assert pq.read_schema(items).names == ["item_id", "genre", "decade"]
    split = leave_one_out(read_logs(inter, items, seed=0))
    assert split.logs.num_users == 610 and split.logs.labels["rating"].shape == (100836,)
    pop = evaluate_scores(baselines.popularity(split, "test"), split, "test")
    ease = evaluate_scores(baselines.ease(split, "test", lam=200.0), split, "test")
    assert 0.02 < pop["HR@10"] < 0.10
    assert ease["HR@10"] > pop["HR@10"] and ease["NDCG@100"] > pop["NDCG@100"] + 0.02
