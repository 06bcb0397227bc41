"""Calibration at publish (publish/calibrate.py) and the predictor's calibrated probe depth
(silverrec/retrieval/filtered_search.py probe_depth, target_recall), against references written here:
brute-force float top-k in numpy, filters evaluated on the pool's value lists by a plain evaluator,
recall computed from those, and the documented depth rule."""

import json
import math
import re

import numpy as np
import pytest
import torch

import silverrec
from silverrec.errors import PoolError, QueryError
from silverrec.filtering.filter_lang import And, Not, Or, Term, parse
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.publish.calibrate import (CalibrationConfig, calibration_queries, exact_top, prepare, recall,
                                         sample_filters)
from silverrec.publish.filtered_ivf import publish_index
from silverrec.publish.ivf import IVFConfig, build_ivf, constant_norm
from silverrec.publish.kmeans import kmeans
from silverrec.publish.pool import Pool
from silverrec.retrieval.filtered_search import nprobe_for_recall, probe_depth

N, D, NLIST, K = 6000, 16, 48, 20
FEATURES = {"colour": 5, "shape": 40}


def normalised_mixture(n: int, seed: int) -> np.ndarray:
    """Unit rows around 60 centres with per-centre spreads (clusters of different tightness)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(60, D))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    spread = np.exp(0.5 * rng.normal(size=60))
    c = rng.integers(0, 60, n)
    x = centres[c] + 0.25 * spread[c, None] * rng.normal(size=(n, D))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def world():
    rng = np.random.default_rng(3)
    x = normalised_mixture(N, 3)
    values = {f: rng.integers(0, c, N) for f, c in FEATURES.items()}
    feats = {f: [[f"{f[0]}{v}"] for v in vals] for f, vals in values.items()}
    return Pool(np.arange(N, dtype=np.int64) * 3 + 1, x, feats), values


@pytest.fixture(scope="module")
def snap(world, tmp_path_factory):
    pool, _ = world
    out = publish_index(Pool(pool.item_ids, pool.embeddings.copy(), pool.features), tmp_path_factory.mktemp("cal") / "s",
                        config=IVFConfig(nlist=NLIST, seed=0), torchscript=False,
                        calibration=CalibrationConfig(target_recall=0.9, k=K))
    return silverrec.load(out)


def brute_force(x: np.ndarray, q: np.ndarray, k: int, allowed: np.ndarray | None = None) -> list[set]:
    s = q.astype(np.float64) @ x.astype(np.float64).T
    if allowed is not None:
        s[:, ~allowed] = -np.inf
    out = []
    for row in s:
        top = np.argsort(-row, kind="stable")[:k]
        out.append({int(i) for i in top if np.isfinite(row[i])})
    return out


def plain_recall(found: np.ndarray, truth: list[set], ids: np.ndarray) -> float:
    return float(np.mean([len({int(i) for i in f if i >= 0} & {int(ids[t]) for t in tr}) / len(tr)
                          for f, tr in zip(found, truth) if tr]))


def evaluate(node, values: dict) -> np.ndarray:
    """A plain evaluator over single-valued integer columns (value string = feature initial + index)."""
    if isinstance(node, Term):
        wanted = {int(v[1:]) for v in node.values}
        return np.isin(values[node.feature], list(wanted))
    if isinstance(node, Not):
        return ~evaluate(node.child, values)
    parts = [evaluate(c, values) for c in node.children]
    return np.logical_and.reduce(parts) if isinstance(node, And) else np.logical_or.reduce(parts)


def test_exact_top_is_brute_force_with_and_without_a_mask():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 8)).astype(np.float32)
    q = torch.from_numpy(rng.normal(size=(5, 8)).astype(np.float32))
    allowed = np.zeros(3000, dtype=bool)
    allowed[rng.choice(3000, 4, replace=False)] = True  # fewer matches than k: -1 padding
    half = rng.random(3000) < 0.5
    import silverrec.publish.calibrate as calibrate

    for block in (calibrate.EXACT_BLOCK, 5000):  # one block of rows, and several (blocks of 1024 rows)
        calibrate.EXACT_BLOCK, saved = block, calibrate.EXACT_BLOCK
        try:
            got, (few, some) = exact_top(x, q, 7, [(torch.tensor([0, 3]), torch.from_numpy(allowed)),
                                                   (torch.tensor([1, 2, 4]), torch.from_numpy(half))])
        finally:
            calibrate.EXACT_BLOCK = saved
        s = q.numpy() @ x.T
        assert np.array_equal(got.numpy(), np.argsort(-s, axis=1, kind="stable")[:, :7])
        assert (few[:, 4:] == -1).all()
        assert all(set(r[:4].tolist()) == set(np.flatnonzero(allowed).tolist()) for r in few.numpy())
        masked = np.where(half, s[[1, 2, 4]], -np.inf)  # a broad filter: answered from the spare top rows
        assert np.array_equal(some.numpy(), np.argsort(-masked, axis=1, kind="stable")[:, :7])
    sparse = np.zeros(3000, dtype=bool)  # a broad share, but not among query 0's best rows: the fallback
    sparse[np.argsort(-s[0], kind="stable")[2000:]] = True
    _, (far,) = exact_top(x, q, 7, [(torch.tensor([0, 1]), torch.from_numpy(sparse))])
    assert np.array_equal(far.numpy(), np.argsort(-np.where(sparse, s[[0, 1]], -np.inf), axis=1, kind="stable")[:, :7])


def test_recall_counts_only_real_neighbours():
    truth = torch.tensor([[1, 2, 3, 4], [5, 6, -1, -1]])
    found = torch.tensor([[4, 9, 1, -1], [6, 7, 8, -1]])
    assert recall(found, truth) == pytest.approx((2 / 4 + 1 / 2) / 2)


def test_calibration_queries_are_noisy_pool_items():
    x = normalised_mixture(2000, 1)
    q = calibration_queries(x, 64, seed=5)
    assert q.shape == (64, D) and q.dtype == np.float32
    nearest = np.abs(q[:, None, :] - x[None, :, :]).sum(2).min(1)
    assert (nearest > 0).all()  # not the items themselves
    assert np.median(nearest) < np.median(np.abs(x[:64, None, :] - x[None, 64:128, :]).sum(2))  # but near one


def test_sample_filters_pass_about_the_wanted_share(world):
    pool, values = world
    fwd = ForwardIndex.from_lists(pool.features)
    wanted = (1e-3, 1e-2, 0.1, 0.5, 0.9)
    got = sample_filters(fwd, wanted, seed=1)
    assert len(got) >= 4
    for text, mask in got:
        ref = evaluate(parse(text), values)
        assert np.array_equal(mask.numpy(), ref), text
        share = ref.mean()
        assert min(abs(math.log(share / w)) for w in wanted) <= math.log(2.0), (text, share)


def test_recorded_curve_is_the_measured_recall_and_the_default_its_smallest_reaching_nprobe(world, snap):
    pool, _ = world
    cal = snap.config["calibration"]
    assert cal["source"] == "pool" and cal["k"] == K and cal["target_recall"] == 0.9
    q = calibration_queries(pool.embeddings, cal["queries"], seed=0)  # publish's queries (seed 0)
    truth = brute_force(pool.embeddings, q, K)
    for point in cal["curve"]:  # (the tail past the default over the first queries only)
        n = point["queries"]
        found = snap.search(q[:n], K, nprobe=point["nprobe"]).item_ids.numpy()
        per = [len({int(i) for i in f if i >= 0} & {int(pool.item_ids[t]) for t in tr}) / len(tr)
               for f, tr in zip(found, truth[:n])]
        assert np.mean(per) == pytest.approx(point["recall"], abs=1e-4)
        assert np.std(per, ddof=1) / np.sqrt(n) == pytest.approx(point["se"], abs=1e-4)
    p = snap.config["default_nprobe"]
    assert p == cal["default_nprobe"]
    lower = {c["nprobe"]: c["recall"] - c["se"] for c in cal["curve"] if c["queries"] == cal["queries"]}
    assert lower[p] >= 0.9  # reached by one standard error
    below = [n for n in lower if n < p]
    assert below and max(lower[n] for n in below) < 0.9  # and no smaller measured nprobe did


def test_default_search_reaches_the_target_on_held_out_queries(world, snap):
    pool, _ = world
    rng = np.random.default_rng(11)
    q = pool.embeddings[rng.choice(N, 256, replace=False)] + 0.05 * rng.normal(size=(256, D)).astype(np.float32)
    truth = brute_force(pool.embeddings, q, K)
    assert plain_recall(snap.search(q, K).item_ids.numpy(), truth, pool.item_ids) >= 0.9 - 0.03


def test_sampled_filters_recorded_recall_is_measured_at_the_calibrated_defaults(world, snap):
    pool, values = world
    cal = snap.config["calibration"]
    assert snap.config["search"]["probe_exponent"] == cal["probe_exponent"]
    assert snap.config["search"]["max_probe_factor"] == cal["max_probe_factor"]
    assert cal["filters"] and all(f["recall"] >= 0.9 for f in cal["filters"])
    q = calibration_queries(pool.embeddings, cal["queries"], seed=0)
    for f in cal["filters"]:
        allowed = evaluate(parse(f["filter"]), values)
        assert allowed.mean() == pytest.approx(f["selectivity"], abs=1e-6)
        truth = brute_force(pool.embeddings, q[:64], K, allowed)
        got = plain_recall(snap.search(q[:64], K, filter=f["filter"]).item_ids.numpy(), truth, pool.item_ids)
        assert got >= 0.9 - 0.05, f  # another draw of queries than publish's: about the target


def test_target_recall_maps_through_the_curve(snap):
    q = torch.from_numpy(normalised_mixture(32, 9))
    curve = snap.config["calibration"]["curve"]
    for target in (0.5, 0.8, 0.9, 0.97):
        p = nprobe_for_recall(curve, target, NLIST)
        assert torch.equal(snap.search(q, K, target_recall=target).item_ids, snap.search(q, K, nprobe=p).item_ids)
    with pytest.raises(QueryError, match="nprobe or target_recall"):
        snap.search(q, K, nprobe=3, target_recall=0.9)
    with pytest.raises(QueryError, match="target_recall must be"):
        snap.search(q, K, target_recall=1.5)


def test_nprobe_for_recall_interpolates_in_log_nprobe():
    curve = [{"nprobe": 1, "recall": 0.4}, {"nprobe": 4, "recall": 0.8}, {"nprobe": 16, "recall": 0.9}]
    assert nprobe_for_recall(curve, 0.3, 64) == 1
    assert nprobe_for_recall(curve, 0.8, 64) == 4
    assert nprobe_for_recall(curve, 0.85, 64) == 8  # half-way in log between 4 and 16
    assert nprobe_for_recall(curve, 0.6, 64) == 2
    assert nprobe_for_recall(curve, 0.99, 64) == 16  # past the best: the best


def test_probe_depth_rule():
    cfg = {"nlist": 100, "default_nprobe": 10, "search": {"probe_exponent": 0.5, "probe_k": 100}}
    assert probe_depth(cfg, 100, 1.0) == 10
    assert probe_depth(cfg, 50, 1.0) == 10  # never shallower than the default
    assert probe_depth(cfg, 400, 1.0) == 20
    assert list(probe_depth(cfg, 100, np.array([0.25, 1.0, 1e-6]))) == [20, 10, 100]  # capped at nlist
    old = {"nlist": 100, "default_nprobe": 10, "search": {}}  # a snapshot published before calibration
    assert probe_depth(old, 400, 0.01) == 10
    with pytest.raises(QueryError, match="no calibration curve"):
        probe_depth(old, 10, 1.0, target_recall=0.9)


def test_user_calibration_queries_and_bad_input(world):
    pool, _ = world
    q = pool.embeddings[:40] * 2.0
    truth = prepare(pool.embeddings, pool.item_ids, K, queries=q)
    assert truth.source == "user" and truth.queries.shape == (40, D)
    ref = brute_force(pool.embeddings, q, K)
    assert [set(pool.item_ids[list(r)].tolist()) for r in ref] == [set(t.tolist()) for t in truth.truth]
    with pytest.raises(PoolError, match="calibration queries must be float"):
        prepare(pool.embeddings, pool.item_ids, K, queries=np.zeros((3, D + 1), np.float32))
    with pytest.raises(PoolError, match="NaN"):
        prepare(pool.embeddings, pool.item_ids, K, queries=np.full((3, D), np.nan, np.float32))
    with pytest.raises(PoolError, match="target recall"):
        CalibrationConfig(target_recall=0.0)


def test_constant_norm_pools_cluster_spherically_and_probe_their_own_cluster_first():
    x = torch.from_numpy(normalised_mixture(4000, 2))
    assert constant_norm(x) and not constant_norm(x * torch.linspace(0.5, 1.5, 4000)[:, None])
    index, km = build_ivf(Pool(np.arange(4000, dtype=np.int64), x.numpy().copy()), IVFConfig(nlist=40, seed=0))
    assert km.spherical
    assert torch.allclose(km.centroids.norm(dim=1), torch.ones(40), atol=1e-5)
    # unit centroids: the probe's inner-product ranking puts every item's own (nearest) cluster first
    assert torch.equal((x @ km.centroids.T).argmax(1), km.assignment)
    mean = kmeans(x, 40, seed=0)
    assert ((x @ mean.centroids.T).argmax(1) != mean.assignment).any()  # mean centroids: not so
    two = kmeans(x, 40, seed=0, method="two_level", spherical=True)  # the two-level build normalises too
    assert torch.allclose(two.centroids.norm(dim=1), torch.ones(40), atol=1e-5)


def test_cli_publish_calibrates_inspect_prints_it_and_query_takes_a_target(world, tmp_path):
    from silverrec.publish.pool import write_pool
    from tests.helpers import run_cli

    pool, _ = world
    write_pool(tmp_path / "pool.parquet", pool.item_ids, pool.embeddings, {f: v for f, v in pool.features.items()})
    given = pool.embeddings[:50] + 0.01
    np.save(tmp_path / "cq.npy", given.astype(np.float32))
    run_cli("publish", "--pool", str(tmp_path / "pool.parquet"), "--out", str(tmp_path / "s"), "--nlist", str(NLIST),
            "--target-recall", "0.85", "--calibration-queries", str(tmp_path / "cq.npy"))
    snap = silverrec.load(tmp_path / "s")
    cal = snap.config["calibration"]
    assert cal["source"] == "user" and cal["queries"] == 50 and cal["target_recall"] == 0.85
    out = run_cli("inspect", str(tmp_path / "s")).stdout
    assert re.search(rf"calibration +recall@100 0.85 (NOT )?reached at nprobe {snap.config['default_nprobe']} of {NLIST}", out)
    assert f"{cal['curve'][0]['nprobe']}: {cal['curve'][0]['recall']:.3f}" in out and "filtered" in out
    np.save(tmp_path / "q.npy", pool.embeddings[100:104])
    got = json.loads(run_cli("query", str(tmp_path / "s"), "--queries", str(tmp_path / "q.npy"), "--k", "10",
                             "--target-recall", "0.8", "--json").stdout)
    assert got["item_ids"] == snap.search(pool.embeddings[100:104], 10, target_recall=0.8).item_ids.tolist()
    run_cli("publish", "--pool", str(tmp_path / "pool.parquet"), "--out", str(tmp_path / "plain"), "--nlist", str(NLIST),
            "--no-calibration")
    plain = silverrec.load(tmp_path / "plain")
    assert "calibration" not in plain.config and "probe_exponent" not in plain.config["search"]
    bad = run_cli("publish", "--pool", str(tmp_path / "pool.parquet"), "--out", str(tmp_path / "bad"), "--no-calibration",
                  "--target-recall", "0.9", check=False)
    assert bad.returncode == 2 and "--no-calibration takes neither" in bad.stderr and not (tmp_path / "bad").exists()


def test_recommendation_model_records_its_curve_and_maps_target_recall(tmp_path_factory):
    from tests.rec_fixtures import rec_setup

    rec = rec_setup(tmp_path_factory)
    snap = silverrec.load(rec.snap_dir)
    cal, nlist = snap.config["calibration"], int(snap.config["nlist"])
    assert cal["source"] == "user tower" and cal["k"] == snap.config["default_k0"]
    # the default: the first of nlist/16, /8, /4, /2, nlist whose measured recall reaches the target
    grid = sorted({max(1, nlist // d) for d in (16, 8, 4, 2, 1)})
    at = {c["nprobe"]: c["recall"] for c in cal["curve"]}
    assert [c["nprobe"] for c in cal["curve"]] == grid[:len(at)]
    first = next((p for p in grid if p in at and at[p] >= cal["target_recall"]), nlist)
    assert snap.config["default_nprobe"] == first
    users = [{"user_id": u} for u in rec.logs.user_ids[:6].tolist()]
    for target in (0.3, 0.9, 1.0):
        p = nprobe_for_recall(cal["curve"], target, nlist)
        assert snap.recommend(users, k=5, target_recall=target).item_ids.tolist() == \
            snap.recommend(users, k=5, nprobe=p).item_ids.tolist()
    with pytest.raises(QueryError, match="nprobe or target_recall"):
        snap.recommend(users, k=5, nprobe=1, target_recall=0.9)
