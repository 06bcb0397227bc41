"""Request shapes padded to buckets (silverrec/serving/buckets.py) on the device path forced on the CPU
(MOVE_CPU; graphs "captured" by capture_eager, counted like CUDA graphs): the padded forward answers
exactly like the plain CPU path (search and recommend, every batch size, filters, k cut back), a varied
stream after the warm-up replays, and concurrent calls on a StreamPool each get the answer to their own
request. The same on CUDA: tests/gpu/test_snapshots_cuda.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import silverrec
import silverrec.serving.device as device_path
from silverrec.serving.buckets import Buckets, BucketedForward, ceil_pow, k_bucket, pad_features
from silverrec.serving.device import StreamPool, graph_counts
from silverrec.publish.filtered_ivf import publish_index
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool

from .helpers import load_ann
from .rec_fixtures import rec_setup


def test_bucket_series():
    assert [ceil_pow(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert [ceil_pow(n, 4, 64) for n in (0, 64, 65, 300, 1025)] == [64, 64, 256, 1024, 4096]
    assert [k_bucket(k) for k in (1, 3, 7, 10, 11, 21, 100, 101, 999, 1000, 1024)] == \
        [1, 5, 10, 10, 20, 50, 100, 200, 1000, 1000, 2000]


def test_jagged_padding_keeps_nnz_equal_to_the_lengths():
    """Three keys of three rows (the longest row: 6 values) -> five rows of 8 values each but the last: the new rows
    empty but the last, whose first key holds the surplus."""
    lengths = torch.tensor([2, 0, 1, 1, 1, 1, 3, 0, 2], dtype=torch.int32)  # key-major [F=3, B=3]
    values = torch.arange(1, 12)
    dense = torch.ones(3, 2)
    v, ln, d = pad_features(values, lengths, dense, 5, 4)
    grid = ln.reshape(3, 5)
    assert v.shape[0] == int(ln.sum()) == 4 * 8  # key 0's 3 values, the padding row's 21 zeros, keys 1 and 2
    assert torch.equal(v[:3], values[:3]) and not v[3:24].any() and torch.equal(v[24:], values[3:])
    assert torch.equal(grid[:, :3], lengths.reshape(3, 3)) and grid[:, 3].tolist() == [0, 0, 0]
    assert grid[:, 4].tolist() == [32 - 11, 0, 0] and torch.equal(d[:3], dense) and not d[3:].any()


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A pure-ANN snapshot of 2000 bigann10k vectors with a country feature."""
    base, queries = load_ann("bigann10k")
    base, queries = base[:2000], queries[:40]
    g = np.random.default_rng(0)
    pool = Pool(np.arange(len(base), dtype=np.int64) * 3, base, {"country": [[f"c{v}"] for v in g.integers(0, 5, len(base))]})
    path = publish_index(pool, tmp_path_factory.mktemp("idx") / "s", config=IVFConfig(nlist=16, seed=0))
    return path, torch.from_numpy(queries)


def _moved(path, monkeypatch, **options):
    monkeypatch.setattr(device_path, "MOVE_CPU", True)
    return silverrec.load(path, device="cpu", **options)


def test_search_padded_answers_like_the_cpu_path(index, monkeypatch):
    """Batch sizes 1-7 padded to 1 / 2 / 4 / 8 rows, k 7 and 13 padded to 10 and 20 and cut back, filters padded
    to the program buckets: the item ids and scores of the unpadded CPU forward at the padded k, cut back (a
    filtered search widens its probes with k); unfiltered, those of the request's own k too."""
    path, queries = index
    plain = silverrec.load(path, device="cpu")
    moved = _moved(path, monkeypatch, buckets={"warm_batches": ()})
    assert isinstance(moved.module, BucketedForward)
    filters = ["country = c1", None, "country IN (c2, c3)", "NOT country = c4", "country = c0 OR country = c2"]
    for B, k, options in ((1, 7, {}), (3, 13, {"nprobe": 4}), (5, 7, {"filter": [filters[i] for i in range(5)]}),
                          (7, 20, {"filter": "country = c4", "mode": "probed"}), (6, 13, {"filter": "country = c3"})):
        want = plain.search(queries[:B], k_bucket(k), **options)
        got = moved.search(queries[:B], k, **options)
        assert got.item_ids.shape == (B, k) and torch.equal(got.item_ids, want.item_ids[:, :k]), (B, k, options)
        assert torch.equal(got.scores, want.scores[:, :k]) and (want.item_ids >= 0).any()
        if "filter" not in options:
            assert torch.equal(got.item_ids, plain.search(queries[:B], k, **options).item_ids)
    shapes = {(s[2][0], s[-4]) for s in moved.module.shapes}  # (rows, k) of the padded calls
    assert shapes == {(1, 10), (4, 20), (8, 10), (8, 20)}


def test_varied_search_stream_replays_after_warm_up(index, monkeypatch):
    """Warm-up at load captures batches 1-16 at k 10 and 100, unfiltered and filtered; then searches of random
    batch sizes, k among the warm ones, random filters. The calibrated probe depth follows each batch's filters,
    padded to powers of two: the first 60 calls add at most a few shapes (depth buckets the warm-up's one filter
    did not reach), and the next 60 replay every call."""
    path, queries = index
    moved = _moved(path, monkeypatch, buckets={"warm_batches": (1, 2, 4, 8, 16), "warm_ks": (100,)})
    warm = graph_counts(moved.module)
    assert warm["captures"] == warm["calls"] == 20 and warm["replays"] == 0
    g = np.random.default_rng(1)
    filters = [None, "country = c1", "country IN (c2, c3)", "NOT country = c4"]

    def stream():
        for _ in range(60):
            B = int(g.integers(1, 17))
            f = [filters[i] for i in g.integers(0, len(filters), B)]
            moved.search(queries[:B], int(g.choice([10, 100])), filter=f)

    stream()
    first = graph_counts(moved.module)
    assert first["calls"] - warm["calls"] == 60 and first["captures"] - warm["captures"] <= 8, first
    stream()
    second = graph_counts(moved.module)
    assert second["calls"] - first["calls"] == 60 and second["replays"] - first["replays"] == 60, second


def test_without_buckets_shapes_are_captured_on_their_second_call(index, monkeypatch):
    path, queries = index
    moved = _moved(path, monkeypatch, buckets=False)
    for B in (3, 3, 5):
        moved.search(queries[:B], 10)
    assert graph_counts(moved.module) == {"calls": 3, "captures": 1, "replays": 0, "eager": 2}


def test_bad_bucket_settings_are_named(index, monkeypatch):
    path, _ = index
    with pytest.raises(ValueError, match=r"unknown bucket settings \['warm'\]"):
        _moved(path, monkeypatch, buckets={"warm": ()})
    with pytest.raises(ValueError, match="streams must be >= 1, got 0"):
        _moved(path, monkeypatch, streams=0)


def test_concurrent_calls_on_a_stream_pool_get_their_own_answers(index, monkeypatch):
    """Three lanes, six threads each searching its own queries: every answer is its own request's."""
    path, queries = index
    moved = _moved(path, monkeypatch, streams=3, buckets={"warm_batches": ()})
    assert len(moved.module.module.lanes) == 3 and isinstance(moved.module.module, StreamPool)
    plain = silverrec.load(path, device="cpu")
    want = {t: plain.search(queries[4 * t:4 * t + 3], 10).item_ids for t in range(6)}
    wrong = []

    def worker(t):
        for _ in range(5):
            got = moved.search(queries[4 * t:4 * t + 3], 10).item_ids
            if not torch.equal(got, want[t]):
                wrong.append(t)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not wrong
    assert graph_counts(moved.module)["calls"] == 30


def test_recommend_padded_answers_like_the_cpu_path(tmp_path_factory, monkeypatch):
    """The recommendation model: batches of 1 / 3 / 6 users with histories of 1-30 items, exclusions, filters and
    k 7 (padded to 10, at most k0): the same items as the unpadded CPU forward, scores and task scores up to float
    summation order; a second pass over the same batch sizes replays."""
    setup = rec_setup(tmp_path_factory)
    plain = silverrec.load(setup.snap_dir, device="cpu")
    moved = _moved(setup.snap_dir, monkeypatch, buckets={"warm_batches": ()})
    ids = plain.rec_handler().row_to_item
    g = np.random.default_rng(2)
    batches = []
    for B in (1, 3, 6):
        batches.append([{"history": [int(x) for x in g.choice(ids, int(g.integers(1, 31)), replace=False)],
                         "exclude": [int(ids[b])] if b % 2 else [],
                         "filter": "cat = c1" if b % 3 == 1 else None} for b in range(B)])
    for _ in range(2):
        for requests in batches:
            want = plain.recommend(requests, k=7)
            got = moved.recommend(requests, k=7)
            assert torch.equal(got.item_ids, want.item_ids) and got.item_ids.shape == (len(requests), 7)
            torch.testing.assert_close(got.scores, want.scores)  # a padded batch's matmuls may sum in another order
            torch.testing.assert_close(got.task_scores, want.task_scores)
    counts = graph_counts(moved.module)
    assert counts["calls"] == 6 and counts["captures"] == 3 and counts["replays"] == 3


@pytest.mark.parametrize("backend", ["export", "torchscript"])
def test_rank_padded_scores_like_the_cpu_path(tmp_path_factory, monkeypatch, backend):
    """Early-stage ranking of 5 and 20 items (padded to 16 and 32, row 0 repeated) for a user of 12 history items:
    the CPU path's scores in the given order; a second call of the same bucket replays."""
    setup = rec_setup(tmp_path_factory)
    plain = silverrec.load(setup.snap_dir, backend=backend, device="cpu")
    moved = _moved(setup.snap_dir, monkeypatch, backend=backend, buckets={"warm_batches": ()})
    ids = plain.rec_handler().row_to_item
    user = {"history": [int(x) for x in ids[3:15]]}
    for items in ([int(x) for x in ids[40:45]], [int(x) for x in ids[100:120]], [int(x) for x in ids[50:53]]):
        want, got = plain.rank(user, items), moved.rank(user, items)
        assert torch.equal(got.item_ids, want.item_ids) and got.scores.shape == (1, len(items))
        torch.testing.assert_close(got.scores, want.scores)
        torch.testing.assert_close(got.task_scores, want.task_scores)
    rank = moved.rec_handler().rank_module()
    assert {s[-1][1] for s in rank.shapes} == {16, 32} and graph_counts(rank)["replays"] == 1


def test_decode_only_snapshot_padded_answers_like_the_cpu_path(tmp_path, monkeypatch):
    """A generative (decode-only) snapshot: histories of 0-11 items (the decoder reads the newest 6), batches of 1,
    3 and 5 padded to 2, 5 and 9 rows, the history to its bucket (at most the decoder's 6): the CPU path's items."""
    from silverrec.publish.generative import publish_generative
    from silverrec.publish.semantic_ids import build_semantic_ids

    from .reference_beam_search import random_decoder

    g = np.random.default_rng(0)
    x = (g.normal(size=(12, 10))[g.integers(0, 12, 240)] * 3 + g.normal(size=(240, 10))).astype(np.float32)
    ids = g.permutation(np.arange(1000, 5000))[:240].astype(np.int64)
    sids = build_semantic_ids(x, ids, levels=2, codes=8, seed=0, niter=5)
    dec = random_decoder(sids.level_sizes, dim=32, n_layers=2, max_seq_len=64, seed=1)
    path = publish_generative(dec, sids, tmp_path / "gen", beam_width=16, top_k=5, max_history=6, weights="fp32")
    plain = silverrec.load(path, device="cpu")
    moved = _moved(path, monkeypatch, buckets={"warm_batches": ()})
    histories = [[int(i) for i in g.choice(ids, n, replace=False)] for n in (0, 1, 3, 6, 11)]
    for B in (1, 3, 5):
        requests = [{"history": h} for h in histories[:B]]
        want = plain.recommend(requests, k=7, exclude_history=False)
        got = moved.recommend(requests, k=7, exclude_history=False)
        assert torch.equal(got.item_ids, want.item_ids) and (want.item_ids >= 0).any()
        torch.testing.assert_close(got.scores, want.scores)
    assert {s[2][0] for s in moved.module.shapes} == {2, 5, 9}
