"""Generative snapshots (a RecModel whose only source is the decode): publish -> load (fresh process)
-> recommend; the predictor's history mapping, filters and exclusions (checked against the
independent reference beam search), bad input, bf16 vs fp32, CLI;
the generic trainer (`silverrec train --generative`) on tiny synthetic logs: its split, embeddings
sources, metrics, the item-token reference and a training run that learns a known pattern."""

import copy
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
from silverrec.publish.semantic_ids import build_semantic_ids, history_tokens
from silverrec.publish.generative_checkpoint import load_checkpoint, save_checkpoint
from silverrec.publish.train_generative import Sequences, TrainConfig, item_embeddings, left_pad, popularity_rows

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
    return publish_snapshot(tmp_path_factory.mktemp("gen"))


def publish_snapshot(root):
    """(root, semantic IDs, decoder, its fp32 snapshot in root / "snap") (tests/test_predictor.py's too)."""
    x, ids = _embeddings()
    sids = build_semantic_ids(x, ids, levels=2, codes=8, seed=0, niter=5)
    dec = random_decoder(sids.level_sizes, dim=32, n_layers=2, max_seq_len=64, seed=1)
    ckpt = save_checkpoint(root / "model.ckpt", dec, sids, TrainConfig(max_history=MAX_HISTORY), _empty_metrics())
    write_pool(root / "pool.parquet", ids[::-1], x[::-1])  # pool order differs from the checkpoint's
    snap_dir = root / "snap"
    run_cli("publish", "--generative", "--pool", str(root / "pool.parquet"), "--out", str(snap_dir),
            "--model", str(ckpt), "--beam-width", str(W), "--top-k", "5", "--weights", "fp32")
    return root, sids, dec, snap_dir


def _recommend(snap, histories, k=W, **options):
    """recommend with one request per history (item ids, oldest first); the history is not excluded
    unless asked (the reference decodes over every item)."""
    options.setdefault("exclude_history", False)
    return snap.recommend([{"history": h} for h in histories], k=k, **options)


def _row_to_item(snap) -> np.ndarray:
    """The snapshot's item id of each row (its canonical order: the trie's)."""
    return snap.rec_handler().row_to_item


def _tokens(sids):
    """(item ids ascending, their decoder tokens [N, L]): semantic_ids.history_tokens' tables."""
    order = np.argsort(sids.item_ids)
    return sids.item_ids[order], sids.tokens()[order]


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
    spec, c = m["config"]["spec"], m["config"]["generative"]
    assert m["kind"] == "rec" and m["item_count"] == len(sids.item_ids)
    assert (spec["tower"], spec["sources"], spec["decode_history"]) == ("none", ["generative"], MAX_HISTORY)
    assert c["level_sizes"] == sids.level_sizes and c["levels"] == 3
    assert c["level_offsets"] == sids.level_offsets and c["vocab_size"] == dec.vocab_size
    assert (c["beam_width"], c["top_k"], c["max_items"], c["weights_dtype"]) == (W, 5, MAX_HISTORY, "fp32")
    assert c["decoder"] == dec.config.to_dict()
    assert c["stats"]["max_items_per_path"] >= 4
    assert {"model.pt2", "model.ts", "items.npz"} <= set(m["files"]) and "rank.pt2" not in m["files"]


def test_recommend_equals_reference_beam_search(setup):
    _, sids, dec, snap_dir = setup
    snap = silverrec.load(snap_dir)
    histories = _histories(sids.item_ids)
    got = _recommend(snap, histories)
    ref_ids, ref_scores = _reference(dec, sids, histories)
    assert torch.equal(got.item_ids, ref_ids)
    torch.testing.assert_close(got.scores, ref_scores, atol=2e-5, rtol=2e-5)
    # the one result type: the task score is the log-prob; the decode found every item
    assert got.tasks == ["log_prob"] and torch.equal(got.task_scores[:, :, 0], got.scores)
    assert bool((got.found_by == 2).all()) and torch.equal(got.source_scores[:, :, 1], got.scores)
    assert bool(torch.isneginf(got.source_scores[:, :, 0]).all())
    # every recommended item is a real pool item, once
    real = set(sids.item_ids.tolist())
    for row in got.item_ids.tolist():
        assert set(row) <= real and len(set(row)) == W


def test_filter_and_exclusions_prune_during_decode(setup, tmp_path):
    """A snapshot published with item features: each request's filter (in-model, on the filter row
    bank) and exclude ids prune the decode as the reference's allowed set does; a filter naming no
    feature of the pool is a named error."""
    _, sids, dec, snap_dir = setup
    g = np.random.default_rng(4)
    colour = [["red", "green", "blue"][c] for c in g.integers(0, 3, len(sids.item_ids))]
    tags = [sorted({f"t{x}" for x in g.choice(6, int(g.integers(1, 3)), replace=False)}) for _ in sids.item_ids]
    out = publish_generative(dec, sids, tmp_path / "f", beam_width=W, top_k=5, max_history=MAX_HISTORY,
                             weights="fp32", features={"colour": [[c] for c in colour], "tags": tags},
                             torchscript=False)
    snap = silverrec.load(out)
    histories = _histories(sids.item_ids, n=4, seed=2)
    filters = ["colour = red", "tags = t1 AND NOT colour = blue", None, "colour = purple"]
    exclude = [g.choice(sids.item_ids, 60, replace=False).tolist() if b % 2 else [] for b in range(4)]
    got = snap.recommend([{"history": h, "filter": f, "exclude": e} for h, f, e in zip(histories, filters, exclude)],
                         k=W, exclude_history=False)
    passes = {"colour = red": lambda i: colour[i] == "red", None: lambda i: True,
              "tags = t1 AND NOT colour = blue": lambda i: "t1" in tags[i] and colour[i] != "blue",
              "colour = purple": lambda i: False}
    allowed = torch.tensor([[passes[f](i) and int(sids.item_ids[i]) not in set(e) for i in range(len(sids.item_ids))]
                            for f, e in zip(filters, exclude)])
    some = allowed.any(dim=1)
    ref_ids, ref_scores = _reference(dec, sids, [h for h, s in zip(histories, some) if s], allowed=allowed[some])
    assert torch.equal(got.item_ids[some], ref_ids)
    torch.testing.assert_close(got.scores[some], ref_scores, atol=2e-5, rtol=2e-5)
    assert bool((got.item_ids[3] == -1).all()) and not bool(some[3])
    assert int((got.item_ids[0] >= 0).sum()) == min(W, int(allowed[0].sum()))
    with pytest.raises(QueryError, match="unknown feature 'colour'"):
        silverrec.load(snap_dir).recommend([{"history": histories[0], "filter": "colour = red"}], k=3)


def test_exclude_history_prunes_history_items(setup):
    _, sids, dec, snap_dir = setup
    snap = silverrec.load(snap_dir, backend="torchscript")
    histories = _histories(sids.item_ids, n=4, seed=8, lengths=(9, 0, 3, 12))
    got = _recommend(snap, histories, exclude_history=True)
    allowed = torch.tensor([[int(i) not in set(h) for i in sids.item_ids] for h in histories])
    ref_ids, _ = _reference(dec, sids, histories, allowed=allowed)
    assert torch.equal(got.item_ids, ref_ids)
    for row, h in zip(got.item_ids.tolist(), histories):
        assert not set(row) & set(h)
    plain = _recommend(snap, histories)
    assert any(set(row) & set(h) for row, h in zip(plain.item_ids.tolist(), histories))  # the option matters


_FRESH = textwrap.dedent(
    """
    import json, sys, silverrec
    out = {}
    for backend in ("export", "torchscript"):
        requests = [{"history": h} for h in json.loads(sys.argv[2])]
        r = silverrec.load(sys.argv[1], backend=backend).recommend(requests, k=int(sys.argv[3]), exclude_history=False)
        out[backend] = {"ids": r.item_ids.tolist(), "scores": r.scores.tolist()}
    print(json.dumps(out))
    """
)


def test_fresh_process_equals_in_process(setup):
    _, sids, dec, snap_dir = setup
    histories = _histories(sids.item_ids, seed=3)
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(snap_dir), json.dumps(histories), str(W)],
                          capture_output=True, text=True, timeout=300, check=True)
    ids = _row_to_item(silverrec.load(snap_dir))
    module = build_generative(dec, sids.subset(ids), W, 5)
    with torch.no_grad():
        hist = history_tokens(histories, *_tokens(sids), MAX_HISTORY)
        ref_ids, ref_scores = module(hist, torch.full((len(histories), (len(ids) + 63) // 64), -1))
    for backend, out in json.loads(proc.stdout).items():
        assert out["ids"] == ref_ids.tolist(), backend
        torch.testing.assert_close(torch.tensor(out["scores"]), ref_scores)


def test_truncation_and_padding(setup):
    _, sids, _, snap_dir = setup
    snap = silverrec.load(snap_dir)
    long = _histories(sids.item_ids, n=1, lengths=(15,), seed=4)[0]
    a = _recommend(snap, [long])
    b = _recommend(snap, [long[-MAX_HISTORY:]])
    assert torch.equal(a.item_ids, b.item_ids)
    # a batch of different lengths (left padding) answers each row as if alone
    histories = _histories(sids.item_ids, seed=5)
    batch = _recommend(snap, histories)
    for i, h in enumerate(histories):
        single = _recommend(snap, [h])
        assert torch.equal(batch.item_ids[i], single.item_ids[0])
        torch.testing.assert_close(batch.scores[i], single.scores[0], atol=1e-5, rtol=1e-5)


def test_unknown_history_item_is_named(setup, capsys):
    _, sids, _, snap_dir = setup
    snap = silverrec.load(snap_dir)
    unknown = int(sids.item_ids.max()) + 7
    with pytest.raises(QueryError, match=f"request 1 history: unknown item id {unknown}"):
        _recommend(snap, [[int(sids.item_ids[0])], [int(sids.item_ids[1]), unknown]])
    with pytest.raises(QueryError, match="at least one request"):
        snap.recommend([])
    with pytest.raises(QueryError, match=rf"k must be an int in \[1, {W}\]"):  # at most the beams
        _recommend(snap, [[]], k=W + 1)
    from silverrec.cli import main  # in-process CLI: exit code 2 and the message on stderr

    for argv, message in [
        (["--history", f"{int(sids.item_ids[0])},{unknown}", "--k", "3"], f"unknown item id {unknown}"),
        (["--history", "12,abc", "--k", "3"], "'abc' is not an integer"),
        (["--history", "", "--k", str(W + 1)], f"k must be an int in [1, {W}]"),
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
    expect = _recommend(silverrec.load(snap_dir), histories, k=5)
    assert out["item_ids"] == expect.item_ids.tolist()


def test_bf16_snapshot_agrees_with_fp32(setup):
    root, sids, dec, snap_dir = setup
    out = publish_generative(dec, sids, root / "bf16", beam_width=W, top_k=5, max_history=MAX_HISTORY,
                             weights="bf16", torchscript=False)
    cfg = json.loads((out / "manifest.json").read_text())["config"]["generative"]
    assert cfg["weights_dtype"] == "bf16" and 0.0 <= cfg["bf16_check"]["top10_overlap_vs_fp32"] <= 1.0
    histories = _histories(sids.item_ids, n=20, seed=7, lengths=(2, 4, 6))
    a = _recommend(silverrec.load(out), histories).item_ids
    b = _recommend(silverrec.load(snap_dir), histories).item_ids
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
    # no checkpoint: publish does not train
    proc = run_cli("publish", "--generative", "--pool", str(tmp_path / "p.parquet"), "--out", str(tmp_path / "t"),
                   check=False)
    assert proc.returncode == 2 and "needs --model" in proc.stderr
    assert not (tmp_path / "s").exists() and not (tmp_path / "t").exists()


# ------------------------------------------------------------------------- the generic trainer


def _cycle_logs(root, n_items=40, users=64, length=12, seed=5):
    """Synthetic generic logs: every user walks the items in one fixed cyclic order (timestamps
    increasing), so the next item is known exactly. items.parquet carries an `embedding` column
    (clustered, with a forced collision). Returns (interactions, items, item ids, cycle of ids)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    x, ids = _embeddings(n=n_items, seed=seed)
    g = np.random.default_rng(0)
    cycle = ids[g.permutation(n_items)]
    rows = []
    for u in range(users):
        start = int(g.integers(n_items))
        rows += [(1000 + u, int(cycle[(start + t) % n_items]), 10 * t) for t in range(length)]
    u, i, t = map(np.asarray, zip(*rows))
    order = g.permutation(len(rows))  # file order is not time order
    pq.write_table(pa.table({"user_id": u[order], "item_id": i[order], "timestamp": t[order]}),
                   root / "interactions.parquet")
    write_pool(root / "items.parquet", ids, x)
    return root / "interactions.parquet", root / "items.parquet", ids, cycle


_TINY = dict(levels=2, codes=4, minutes=2.0, max_steps=150, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64,
             max_history=4, batch_size=32, lr=1e-2, warmup_steps=10, eval_beam=10)


def test_generic_trainer_learns_the_next_item(tmp_path, capsys):
    """`silverrec train --generative` on generic logs: after 150 steps the decode puts the true next
    item of the cycle first for > 90% of the held-out users (popularity cannot: every item is
    equally frequent), the checkpoint loads, and `publish --generative --model` serves it."""
    inter, items, ids, cycle = _cycle_logs(tmp_path)
    toml = tmp_path / "generative.toml"
    toml.write_text(f'interactions = "{inter.name}"\nitems = "{items.name}"\nembeddings = "{items.name}"\n'
                    + "".join(f"{k} = {v}\n" for k, v in _TINY.items()))
    from silverrec.cli import main

    assert main(["train", "--generative", "--config", str(toml), "--out", str(tmp_path / "g.ckpt")]) == 0
    out = json.loads(capsys.readouterr().out)
    m = out["metrics"]
    assert m["steps"] == 150 and m["users"] == 64 and m["eval_beam"] == 10
    assert m["heldout_loss"] < 0.25 * np.log(len(ids))  # NLL per item; uniform over items: log(40)
    assert m["model"]["HR@10"] > 0.9 and m["model"]["NDCG@10"] > 0.8, m["model"]
    assert m["popularity"]["HR@10"] < 0.5
    assert set(m["model"]) == {"HR@10", "NDCG@10"}  # a top-10 list measures nothing deeper
    dec, sids, meta = load_checkpoint(tmp_path / "g.ckpt")
    assert meta["train_config"]["max_history"] == 4 and meta["train_config"]["embeddings"] == str(items)
    assert sorted(sids.item_ids.tolist()) == sorted(ids.tolist()) and sids.depth == 3
    # served: the next item of the cycle after a 4-item walk
    from silverrec.publish.generative import publish_from_pool
    from silverrec.publish.pool import read_pool

    publish_from_pool(read_pool(items), tmp_path / "snap", model=tmp_path / "g.ckpt", beam_width=10, weights="fp32",
                      torchscript=False)  # the CLI path of --model is the `setup` fixture's
    snap = silverrec.load(tmp_path / "snap")
    walks = [cycle[np.arange(s, s + 4) % len(cycle)] for s in range(0, 40, 3)]
    got = _recommend(snap, [w.tolist() for w in walks], k=1).item_ids[:, 0].numpy()
    expect = np.array([cycle[(s + 4) % len(cycle)] for s in range(0, 40, 3)])
    assert np.mean(got == expect) > 0.9


def test_item_token_reference_decodes_the_full_softmax(tmp_path):
    """embeddings = "items": one token per item; its beam decode's list (history excluded) is the top
    of the full softmax over items computed directly from the decoder's logits."""
    from silverrec.publish.logs import leave_one_out, read_logs
    from silverrec.publish.train_generative import build_module, decode_rows, semantic_ids_for, train_decoder

    inter, items, ids, _ = _cycle_logs(tmp_path, n_items=30, users=20)
    cfg = TrainConfig(interactions=str(inter), items=str(items), embeddings="items", **{**_TINY, "max_steps": 20})
    logs = read_logs(inter, items)
    data = Sequences.from_split(leave_one_out(logs), "test")
    sids = semantic_ids_for(cfg, logs.item_ids)
    assert sids.level_sizes == [30] and sids.depth == 1 and sids.paths[:, 0].tolist() == list(range(30))
    dec, _ = train_decoder(sids, data, cfg)
    rows = decode_rows(build_module(dec, sids, 10), sids, data.eval_history, 4)
    with torch.no_grad():
        logits = dec(left_pad(data.eval_history, torch.from_numpy(sids.tokens()), 4))[:, -1, 2:].double()
    for b, h in enumerate(data.eval_history):
        logits[b, np.unique(h)] = -np.inf
    expect = torch.topk(logits, 10).indices.numpy()
    assert (rows == expect).mean() > 0.99  # equal up to float near-ties


def test_sequences_follow_the_leave_one_out_split():
    from silverrec.publish.logs import leave_one_out, logs_from_arrays

    logs = logs_from_arrays([30, 10, 20, 40, 50], None, user_id=[7, 7, 7, 7, 8, 8, 8, 9, 9],
                            item_id=[10, 20, 30, 40, 50, 10, 30, 10, 20], timestamp=[1, 2, 3, 4, 1, 2, 3, 1, 2])
    split = leave_one_out(logs)
    test, valid = Sequences.from_split(split, "test"), Sequences.from_split(split, "valid")
    # pool rows: 30 -> 0, 10 -> 1, 20 -> 2, 40 -> 3, 50 -> 4; user 9 has 2 interactions: train only
    assert [t.tolist() for t in valid.train] == [[1, 2], [4], [1, 2]]
    assert [t.tolist() for t in test.train] == [[1, 2, 0], [4, 1], [1, 2]]
    assert valid.eval_target.tolist() == [0, 1] and test.eval_target.tolist() == [3, 0]
    assert [h.tolist() for h in test.eval_history] == [[1, 2, 0], [4, 1]]


def test_embedding_sources_align_to_the_logs(tmp_path):
    x, ids = _embeddings(n=20)
    logs_ids = ids[::-1].copy()
    torch.save({"item_ids": torch.from_numpy(ids), "item_embeddings": torch.from_numpy(x)}, tmp_path / "tt.ckpt")
    write_pool(tmp_path / "pool.parquet", ids[[3, 1, 0, 2] + list(range(4, 20))], x[[3, 1, 0, 2] + list(range(4, 20))])
    for source in (tmp_path / "tt.ckpt", tmp_path / "pool.parquet"):
        np.testing.assert_array_equal(item_embeddings(str(source), logs_ids), x[::-1])
    with pytest.raises(PoolError, match=f"item {int(ids[5]) + 10**6} of the logs has no embedding"):
        item_embeddings(str(tmp_path / "tt.ckpt"), np.r_[ids[:5], ids[5] + 10**6])
    with pytest.raises(PoolError, match="does not exist"):
        item_embeddings(str(tmp_path / "nope.ckpt"), ids)


def test_valid_next_allows_exactly_the_trie_children():
    """ValidNext.mask over left_pad's layout: an item token's row allows the tokens that complete its
    prefix to some pool item (brute force over the paths), BOS / PAD rows allow everything; lm_loss
    with it is the cross-entropy of the softmax restricted to those tokens, BOS / PAD never targets."""
    from silverrec.publish.train_generative import ValidNext, lm_loss

    x, ids = _embeddings(n=60)
    sids = build_semantic_ids(x, ids, levels=2, codes=4, seed=0, niter=5)
    tokens_of = sids.tokens()
    hists = [np.array([5, 1, 7]), np.array([], np.int64), np.array([59]), np.arange(10, 16)]
    tokens = left_pad(hists, torch.from_numpy(tokens_of), 4)
    mask = ValidNext(sids).mask(hists, 4)
    assert mask.shape == (*tokens.shape, sids.vocab_size)
    prefixes = {}
    for path in tokens_of.tolist():
        for l in range(sids.depth):
            prefixes.setdefault(tuple(path[:l]), set()).add(path[l])
    for b, h in enumerate(hists):
        row = tokens[b].tolist()
        first = len(row) - sids.depth * min(len(h), 4)
        for t, tok in enumerate(row):
            got = set(mask[b, t].nonzero().flatten().tolist())
            if t < first:
                assert tok in (PAD, BOS) and got == set(range(sids.vocab_size)), (b, t)
            else:
                l = (t - first) % sids.depth
                assert got == prefixes[tuple(row[t - l : t])], (b, t)
    dec = random_decoder(sids.level_sizes, dim=16, n_layers=1, max_seq_len=64, seed=2)
    with torch.no_grad():
        logits = dec(tokens[:, :-1]).double()
    nll = [-torch.log_softmax(logits[b, t][mask[b, t + 1]], 0)[int(mask[b, t + 1][: tokens[b, t + 1]].sum())]
           for b in range(len(hists)) for t in range(tokens.shape[1] - 1) if tokens[b, t + 1] >= 2]
    with torch.no_grad():
        got = lm_loss(dec, tokens, mask)
    assert torch.allclose(got.double(), torch.stack(nll).mean(), atol=1e-5)


def test_svd_embeddings_are_the_truncated_svd_factors():
    """embeddings = "svd": V * S of the binary user x item matrix of the training histories (repeats
    count once) equals numpy's dense SVD up to the factors' signs; unseen items get zero rows."""
    from silverrec.publish.train_generative import svd_item_embeddings

    g = np.random.default_rng(0)
    train = [g.integers(0, 25, size=g.integers(1, 12)) for _ in range(40)]
    x = svd_item_embeddings(train, 30, 5)
    dense = np.zeros((40, 30))
    for u, t in enumerate(train):
        dense[u, t] = 1.0
    _, s, vt = np.linalg.svd(dense)
    expect = vt[:5].T * s[:5]
    assert x.shape == (30, 5) and x.dtype == np.float32 and not x[25:].any()
    np.testing.assert_allclose(np.abs(x), np.abs(expect), atol=2e-3)
    np.testing.assert_allclose(np.abs(x.T @ expect), np.diag(s[:5] ** 2), atol=1e-2)  # same directions, no mix
    assert svd_item_embeddings(train, 30, 64).shape == (30, 64)  # rank above min(users, items): zero-padded


def test_popularity_rows_exclude_history():
    train = [np.array([0, 0, 1]), np.array([0, 2]), np.array([2, 2])]
    rows = popularity_rows(train, [np.array([0]), np.array([], np.int64)], n_items=5, k=3)
    assert rows.tolist() == [[2, 1, 3], [0, 2, 1]]  # counts 0:3, 2:3, 1:1; ties to the lower row


def test_left_pad_contract():
    tokens = torch.tensor([[2, 5, 9], [3, 6, 10], [4, 7, 11]])
    out = left_pad([np.array([0, 2]), np.array([], dtype=np.int64), np.array([1, 2, 0])], tokens, 2)
    assert out.tolist() == [
        [BOS, 2, 5, 9, 4, 7, 11],
        [PAD] * 6 + [BOS],
        [BOS, 4, 7, 11, 2, 5, 9],  # the last 2 items, oldest first
    ]


# ------------------------------------------------------------------- bf16 weights, compute dtype


def test_fp32_compute_of_bf16_weights_is_fp32_on_rounded_weights(setup):
    """set_compute_dtype(float32) on bf16 weights computes exactly what float32 computes on the
    bf16-rounded weights (the weights are cast per use, activations stay float32)."""
    _, sids, dec, _ = setup
    up = build_generative(dec, sids, W, 5, torch.bfloat16, torch.float32)
    assert up.decoder.output.weight.dtype == torch.bfloat16 and up.decoder.compute_dtype == torch.float32
    rounded_dec = copy.deepcopy(dec)  # float32 weights rounded to bf16 (RoPE tables untouched)
    with torch.no_grad():
        for p in rounded_dec.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    rounded = build_generative(rounded_dec, sids, W, 5)
    hist = left_pad([np.arange(i, i + 4) for i in range(6)], torch.from_numpy(sids.tokens()), MAX_HISTORY)
    with torch.no_grad():
        a, b = up(hist), rounded(hist)
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("faster", ["bf16", "fp32"])
def test_bf16_weights_compute_in_the_measured_faster_dtype(setup, tmp_path, monkeypatch, capsys, faster):
    """The publisher times bf16 vs float32 compute of the bf16 weights and exports the faster; the
    manifest records both timings and the choice, the served program computes in that dtype (its
    answers equal that eager module's), and `silverrec inspect` says which."""
    import silverrec.publish.generative as gen

    _, sids, dec, _ = setup
    timings = {"bf16": 1.0, "fp32": 2.0} if faster == "bf16" else {"bf16": 3.0, "fp32": 1.0}
    seen = []
    monkeypatch.setattr(gen, "time_modules", lambda modules, history: seen.append(
        {k: m.decoder.compute_dtype for k, m in modules.items()}) or timings)
    out = publish_generative(dec, sids, tmp_path / "s", beam_width=W, top_k=5, max_history=MAX_HISTORY,
                             weights="bf16", probe=_histories(sids.item_ids, n=8), torchscript=False)
    assert seen == [{"bf16": torch.bfloat16, "fp32": torch.float32}]
    cfg = json.loads((out / "manifest.json").read_text())["config"]["generative"]
    assert (cfg["weights_dtype"], cfg["compute_dtype"]) == ("bf16", faster)
    assert cfg["compute_timing"]["median_ms"] == timings and cfg["compute_timing"]["measured_on"]
    histories = _histories(sids.item_ids, n=4, seed=9, lengths=(2, 5))
    snap = silverrec.load(out)
    got = _recommend(snap, histories)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[faster]
    module = build_generative(dec, sids.subset(_row_to_item(snap)), W, 5, torch.bfloat16, dtype)
    with torch.no_grad():
        ref_ids, ref_scores = module(history_tokens(histories, *_tokens(sids), MAX_HISTORY))
    assert torch.equal(got.item_ids, ref_ids)
    torch.testing.assert_close(got.scores, ref_scores)
    from silverrec.cli import main

    assert main(["inspect", str(out)]) == 0
    assert f"weights bf16, compute {faster} (measured at publish" in capsys.readouterr().out
