"""Generative snapshots: publish -> load (fresh process) -> recommend; the predictor's history
mapping (checked against the independent reference beam search), bad input, bf16 vs fp32, CLI;
the training script's split, metrics and a tiny training run."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import silverrec
from silverrec.generative.decoder import BOS, PAD
from silverrec.errors import PoolError, QueryError
from silverrec.publish.generative import build_generative, publish_generative
from silverrec.publish.pool import write_pool
from silverrec.publish.semantic_ids import build_semantic_ids
from silverrec.publish.train_generative import (
    Split, TrainConfig, left_pad, popularity_metrics, ranking_metrics, save_checkpoint, split_sequences,
    train_decoder,
)

from .helpers import run_cli
from .reference_beam_search import random_decoder, reference_beam_search

MAX_HISTORY = 6
W = 16


def _embeddings(n=240, d=10, seed=0):
    g = np.random.default_rng(seed)
    x = g.normal(size=(12, d))[g.integers(0, 12, n)] * 3 + g.normal(size=(n, d))
    x[:4] = x[0]  # a forced collision: the disambiguation level is used
    ids = g.permutation(np.arange(1000, 5000))[:n].astype(np.int64)
    return x.astype(np.float32), ids


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Semantic IDs of a 240-item pool, a peaked random decoder, and its fp32 snapshot (via the CLI)."""
    root = tmp_path_factory.mktemp("gen")
    x, ids = _embeddings()
    sids = build_semantic_ids(x, ids, levels=2, codes=8, seed=0, niter=5)
    dec = random_decoder(sids.level_sizes, dim=32, n_layers=2, max_seq_len=64, seed=1)
    ckpt = save_checkpoint(root / "model.ckpt", dec, sids, TrainConfig(max_history=MAX_HISTORY), _empty_metrics())
    write_pool(root / "pool.parquet", ids[::-1], x[::-1])  # pool order differs from the checkpoint's
    snap_dir = root / "snap"
    run_cli("publish", "--generative", "--pool", str(root / "pool.parquet"), "--out", str(snap_dir),
            "--model", str(ckpt), "--beam-width", str(W), "--top-k", "5", "--weights", "fp32")
    return root, sids, dec, snap_dir


def _empty_metrics():
    from silverrec.publish.train_generative import Metrics

    return Metrics()


def _histories(ids, n=5, seed=0, lengths=(0, 1, 3, 6, 11)):
    g = np.random.default_rng(seed)
    return [g.choice(ids, size=lengths[i % len(lengths)], replace=False).tolist() for i in range(n)]


def _reference(dec, sids, histories, top_k=5, allowed=None):
    """Independent path: tokens built by hand from the paths, then the reference beam search."""
    tokens = {int(i): (p + np.asarray(sids.level_offsets)).tolist() for i, p in zip(sids.item_ids, sids.paths)}
    rows = [[BOS] + [t for item in h[-MAX_HISTORY:] for t in tokens[item]] for h in histories]
    T = max(2, max(len(r) for r in rows))
    hist = torch.tensor([[PAD] * (T - len(r)) + r for r in rows])
    return reference_beam_search(dec, hist, torch.from_numpy(sids.paths), torch.from_numpy(sids.item_ids),
                                 sids.level_sizes, W, top_k, allowed)


def test_manifest_describes_the_snapshot(setup):
    _, sids, dec, snap_dir = setup
    m = json.loads((snap_dir / "manifest.json").read_text())
    c = m["config"]
    assert m["kind"] == "generative" and m["item_count"] == len(sids.item_ids)
    assert c["level_sizes"] == sids.level_sizes and c["levels"] == 3
    assert c["level_offsets"] == sids.level_offsets and c["vocab_size"] == dec.vocab_size
    assert (c["beam_width"], c["top_k"], c["max_history_items"], c["weights_dtype"]) == (W, 5, MAX_HISTORY, "fp32")
    assert c["decoder"] == dec.config.to_dict()
    assert c["stats"]["max_items_per_path"] >= 4
    assert {"model.pt2", "model.ts", "items.npz"} <= set(m["files"])


def test_recommend_equals_reference_beam_search(setup):
    _, sids, dec, snap_dir = setup
    snap = silverrec.load(snap_dir)
    histories = _histories(sids.item_ids)
    got = snap.recommend(histories)
    ref_ids, ref_scores = _reference(dec, sids, histories)
    assert torch.equal(got.item_ids, ref_ids)
    torch.testing.assert_close(got.scores, ref_scores, atol=2e-5, rtol=2e-5)
    # every recommended item is a real pool item, once
    real = set(sids.item_ids.tolist())
    for row in got.item_ids.tolist():
        assert set(row) <= real and len(set(row)) == W


def test_filter_bitmask_prunes_during_decode(setup):
    _, sids, dec, snap_dir = setup
    snap = silverrec.load(snap_dir)
    rows = snap.generative_item_ids()
    allowed_rows = torch.rand(3, len(rows)) < torch.tensor([[0.03], [0.3], [1.0]])
    from silverrec.bitmask import pack_bits

    histories = _histories(sids.item_ids, n=3, seed=2)
    got = snap.recommend(histories, pack_bits(allowed_rows))
    pos = {int(i): r for r, i in enumerate(rows)}
    allowed = torch.tensor([[bool(allowed_rows[b, pos[int(i)]]) for i in sids.item_ids] for b in range(3)])
    ref_ids, _ = _reference(dec, sids, histories, allowed=allowed)
    assert torch.equal(got.item_ids, ref_ids)
    for b in range(3):
        ok = set(rows[allowed_rows[b].numpy()].tolist())
        assert set(got.item_ids[b][got.item_ids[b] >= 0].tolist()) <= ok
    assert int((got.item_ids[0] >= 0).sum()) == min(W, int(allowed_rows[0].sum()))
    with pytest.raises(QueryError, match="filter_bitmask must be int64"):
        snap.recommend(histories, pack_bits(allowed_rows)[:2])


def test_exclude_history_prunes_history_items(setup):
    _, sids, dec, snap_dir = setup
    snap = silverrec.load(snap_dir, backend="torchscript")
    histories = _histories(sids.item_ids, n=4, seed=8, lengths=(9, 0, 3, 12))
    got = snap.recommend(histories, exclude_history=True)
    allowed = torch.tensor([[int(i) not in set(h) for i in sids.item_ids] for h in histories])
    ref_ids, _ = _reference(dec, sids, histories, allowed=allowed)
    assert torch.equal(got.item_ids, ref_ids)
    for row, h in zip(got.item_ids.tolist(), histories):
        assert not set(row) & set(h)
    plain = snap.recommend(histories)
    assert any(set(row) & set(h) for row, h in zip(plain.item_ids.tolist(), histories))  # the option matters


_FRESH = textwrap.dedent(
    """
    import json, sys, silverrec
    out = {}
    for backend in ("export", "torchscript"):
        r = silverrec.load(sys.argv[1], backend=backend).recommend(json.loads(sys.argv[2]))
        out[backend] = {"ids": r.item_ids.tolist(), "scores": r.scores.tolist()}
    print(json.dumps(out))
    """
)


def test_fresh_process_equals_in_process(setup):
    _, sids, dec, snap_dir = setup
    histories = _histories(sids.item_ids, seed=3)
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(snap_dir), json.dumps(histories)],
                          capture_output=True, text=True, timeout=300, check=True)
    module = build_generative(dec, sids.subset(silverrec.load(snap_dir).generative_item_ids()), W, 5)
    ids, tokens, order = silverrec.load(snap_dir)._generative_items()
    from silverrec.serving.predictor import history_tokens

    with torch.no_grad():
        hist = history_tokens(histories, ids[order], tokens[order], MAX_HISTORY)
        ref_ids, ref_scores = module(hist, torch.full((len(histories), (len(ids) + 63) // 64), -1))
    for backend, out in json.loads(proc.stdout).items():
        assert out["ids"] == ref_ids.tolist(), backend
        torch.testing.assert_close(torch.tensor(out["scores"]), ref_scores)


def test_truncation_and_padding(setup):
    _, sids, _, snap_dir = setup
    snap = silverrec.load(snap_dir)
    long = _histories(sids.item_ids, n=1, lengths=(15,), seed=4)[0]
    a = snap.recommend([long])
    b = snap.recommend([long[-MAX_HISTORY:]])
    assert torch.equal(a.item_ids, b.item_ids)
    # a batch of different lengths (left padding) answers each row as if alone
    histories = _histories(sids.item_ids, seed=5)
    batch = snap.recommend(histories)
    for i, h in enumerate(histories):
        single = snap.recommend([h])
        assert torch.equal(batch.item_ids[i], single.item_ids[0])
        torch.testing.assert_close(batch.scores[i], single.scores[0], atol=1e-5, rtol=1e-5)


def test_unknown_history_item_is_named(setup, capsys):
    _, sids, _, snap_dir = setup
    snap = silverrec.load(snap_dir)
    unknown = int(sids.item_ids.max()) + 7
    with pytest.raises(QueryError, match=f"unknown history item id {unknown} in history 1"):
        snap.recommend([[int(sids.item_ids[0])], [int(sids.item_ids[1]), unknown]])
    with pytest.raises(QueryError, match="non-empty list"):
        snap.recommend([])
    from silverrec.publish.cli import main  # in-process CLI: exit code 2 and the message on stderr

    for argv, message in [
        (["--history", f"{int(sids.item_ids[0])},{unknown}", "--k", "3"], f"unknown history item id {unknown}"),
        (["--history", "12,abc", "--k", "3"], "'abc' is not an integer"),
        (["--history", "", "--k", str(W + 1)], "beam_width"),
        (["--k", "3"], "needs --history"),
    ]:
        assert main(["query", str(snap_dir), *argv]) == 2
        assert message in capsys.readouterr().err


def test_cli_query_matches_api(setup, tmp_path):
    _, sids, _, snap_dir = setup
    histories = _histories(sids.item_ids, n=3, seed=6)
    (tmp_path / "h.txt").write_text("\n".join(",".join(map(str, h)) for h in histories[1:]) + "\n")
    proc = run_cli("query", str(snap_dir), "--history", ",".join(map(str, histories[0])),
                   "--history-file", str(tmp_path / "h.txt"), "--k", "5", "--json")
    out = json.loads(proc.stdout)
    expect = silverrec.load(snap_dir).recommend(histories)
    assert out["item_ids"] == expect.item_ids[:, :5].tolist()


def test_bf16_snapshot_agrees_with_fp32(setup):
    root, sids, dec, snap_dir = setup
    out = publish_generative(dec, sids, root / "bf16", beam_width=W, top_k=5, max_history=MAX_HISTORY,
                             weights="bf16", torchscript=False)
    cfg = json.loads((out / "manifest.json").read_text())["config"]
    assert cfg["weights_dtype"] == "bf16" and 0.0 <= cfg["bf16_check"]["top10_overlap_vs_fp32"] <= 1.0
    histories = _histories(sids.item_ids, n=20, seed=7, lengths=(2, 4, 6))
    a = silverrec.load(out).recommend(histories).item_ids
    b = silverrec.load(snap_dir).recommend(histories).item_ids
    overlap = np.mean([len(set(x[:10].tolist()) & set(y[:10].tolist())) / 10 for x, y in zip(a, b)])
    assert overlap >= 0.8, overlap
    real = set(sids.item_ids.tolist())
    assert set(a.reshape(-1).tolist()) <= real
    # bf16 weights in the program: the snapshot file is about half the fp32 one
    sizes = [json.loads((d / "manifest.json").read_text())["files"]["model.pt2"]["bytes"] for d in (out, snap_dir)]
    assert sizes[0] < sizes[1]


def test_publish_errors_are_named(setup, tmp_path):
    root, sids, dec, _ = setup
    with pytest.raises(PoolError, match="weights must be"):
        publish_generative(dec, sids, tmp_path / "x", weights="int4")
    with pytest.raises(PoolError, match="RoPE table"):
        publish_generative(dec, sids, tmp_path / "x", max_history=100)
    other = random_decoder([4, 4, 2], dim=32)
    with pytest.raises(PoolError, match="decoder vocabulary"):
        publish_generative(other, sids, tmp_path / "x")
    # a pool item the checkpoint has no semantic ID for
    x, ids = _embeddings()
    write_pool(tmp_path / "p.parquet", np.r_[ids, 99], np.r_[x, x[:1]])
    proc = run_cli("publish", "--generative", "--pool", str(tmp_path / "p.parquet"), "--out", str(tmp_path / "s"),
                   "--model", str(root / "model.ckpt"), check=False)
    assert proc.returncode == 2 and "item 99 has no semantic ID" in proc.stderr
    # no checkpoint and not MovieLens ids: nothing to train on
    write_pool(tmp_path / "q.parquet", ids + 10**9, x)
    proc = run_cli("publish", "--generative", "--pool", str(tmp_path / "q.parquet"), "--out", str(tmp_path / "t"),
                   check=False)
    assert proc.returncode == 2 and "not MovieLens movies" in proc.stderr
    assert not (tmp_path / "s").exists() and not (tmp_path / "t").exists()


# ------------------------------------------------------------------------- training helpers


def test_split_is_leave_last_out():
    ids = np.array([30, 10, 20, 40, 50])
    seqs = {7: np.array([10, 20, 30, 40]), 8: np.array([50, 99, 10, 30]), 9: np.array([10, 20, 99])}
    s = split_sequences(seqs, ids)
    assert s.user_ids.tolist() == [7, 8]  # user 9 has too few pool items; 99 is not in the pool
    assert [t.tolist() for t in s.train] == [[1, 2], [4]]
    assert s.valid_target.tolist() == [0, 1] and s.test_target.tolist() == [3, 0]
    assert [h.tolist() for h in s.valid_history] == [[1, 2], [4]]
    assert [h.tolist() for h in s.test_history] == [[1, 2, 0], [4, 1]]


def test_ranking_metrics_and_popularity():
    ranked = np.array([[5, 3, 9] + [0] * 7, [1] * 10, [2, 7] + [0] * 8])
    m = ranking_metrics(ranked, np.array([3, 4, 7]))
    assert m["recall@10"] == pytest.approx(2 / 3)
    assert m["ndcg@10"] == pytest.approx((1 / np.log2(3) + 1 / np.log2(3)) / 3)
    split = Split(np.array([1, 2]), [np.array([0, 0, 1]), np.array([0, 2])], [], np.array([]), [], np.array([]))
    hist = [np.array([0]), np.array([5])]
    ex = popularity_metrics(split, hist, np.array([1, 0]), 12, exclude_seen=True)
    assert ex["recall@10"] == pytest.approx(1.0)  # user 0: 0 is seen, 1 is next; user 1: 0 is top
    assert popularity_metrics(split, hist, np.array([1, 11]), 12, exclude_seen=False)["recall@10"] == pytest.approx(0.5)


def test_left_pad_contract():
    tokens = torch.tensor([[2, 5, 9], [3, 6, 10], [4, 7, 11]])
    out = left_pad([np.array([0, 2]), np.array([], dtype=np.int64), np.array([1, 2, 0])], tokens, 2)
    assert out.tolist() == [
        [BOS, 2, 5, 9, 4, 7, 11],
        [PAD] * 6 + [BOS],
        [BOS, 4, 7, 11, 2, 5, 9],  # the last 2 items, oldest first
    ]


def test_tiny_training_learns_a_sequential_pattern():
    """Users walk the items in a fixed cyclic order: after a few seconds of training the
    validation loss is far below uniform, and the beam decode ranks the true next item first."""
    x, ids = _embeddings(n=40, seed=5)
    sids = build_semantic_ids(x, ids, levels=2, codes=4, seed=0, niter=3)
    g = np.random.default_rng(0)
    cycle = g.permutation(40)
    seqs = {u: ids[cycle[(np.arange(12) + g.integers(40)) % 40]] for u in range(64)}
    split = split_sequences(seqs, sids.item_ids)
    cfg = TrainConfig(minutes=2.0, max_steps=150, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64,
                      max_history=4, batch_size=32, lr=1e-2, warmup_steps=10, eval_beam=10)
    dec, metrics = train_decoder(sids, split, cfg)
    assert metrics.steps == 150
    uniform = np.log(sids.vocab_size)
    assert metrics.valid_loss < 0.25 * uniform, (metrics.valid_loss, uniform)
    module = build_generative(dec, sids, 10)
    with torch.no_grad():
        found, _ = module(left_pad(split.test_history, torch.from_numpy(sids.tokens()), 4))
    hit1 = np.mean(found[:, 0].numpy() == sids.item_ids[split.test_target])
    assert hit1 > 0.9, hit1
