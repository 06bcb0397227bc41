"""Training the sequential user tower (publish/train_sequence.py) and serving it: the sampled softmax
against a plain loop, the training windows against the logs they come from, order learned from a
planted chain, and a trained tower published and answering (export == eager == TorchScript, a
history no training user has, the CLI, a process without torchrec)."""

from __future__ import annotations

import io
import json
import math
import os
from contextlib import redirect_stdout

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from silverrec.publish.logs import leave_one_out, logs_from_arrays
from silverrec.publish.train import TaskSpec, TrainConfig, feature_spec, train, user_side
from silverrec.publish.train_sequence import Windows
from silverrec.publish.two_tower import full_softmax_loss, sampled_softmax_loss
from silverrec.retrieval.user_tower import FeatureEncoder

from tests.rec_fixtures import FORMULA, K0, NLIST, make_logs, publish_keeping_model, write_logs


class _Table(torch.nn.Module):
    """An 'item tower' that is a plain embedding table (rows -> float [n, D])."""

    def __init__(self, n: int, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, d))

    def forward(self, rows):
        return self.weight[rows]


@pytest.mark.parametrize("in_batch, uniform", [(None, 6), (3, 6), (0, None), (2, None)])
def test_sampled_softmax_loss_against_a_plain_loop(in_batch, uniform):
    """In-batch (all or K drawn) + uniform negatives, or every item once (in_batch 0: the full softmax)."""
    n, B, T, D, tau = 30, 7, 2, 5, 0.3
    g = torch.Generator().manual_seed(0)
    user = torch.randn(B, T, D, generator=g)
    targets = torch.tensor([3, 3, 8, 0, 29, 8, 12])
    weights = torch.tensor([[1, 0], [1, 1], [0, 1], [1, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.float32)
    share = torch.rand(n, generator=g) + 0.1
    log_q = torch.log(share / share.sum())
    table = _Table(n, D)
    got = sampled_softmax_loss(user, targets, table, log_q, uniform, tau, weights, torch.Generator().manual_seed(5), in_batch)
    # the same draws, replayed: K in-batch targets (a permutation's first K unless all), R uniform or every item
    replay = torch.Generator().manual_seed(5)
    K = B if in_batch is None else in_batch
    shared = targets.tolist() if K == B else targets[torch.randperm(B, generator=replay)[:K]].tolist()
    R = n if uniform is None else uniform
    negatives = shared + (list(range(n)) if uniform is None else torch.randint(0, n, (R,), generator=replay).tolist())
    total, count = 0.0, 0.0
    for b in range(B):
        for t in range(T):
            if weights[b, t] == 0:
                continue

            def logit(j):
                q = K * math.exp(float(log_q[j])) + R / n
                return float(user[b, t] @ table.weight[j].detach()) / tau - math.log(q)

            others = [logit(j) for j in negatives if j != int(targets[b])]
            top = max([logit(int(targets[b]))] + others)
            lse = top + math.log(sum(math.exp(x - top) for x in [logit(int(targets[b]))] + others))
            total += lse - logit(int(targets[b]))
            count += 1
    assert float(got.detach()) == pytest.approx(total / count, rel=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 4096])
def test_full_softmax_loss_against_a_plain_loop(chunk):
    """Every item a candidate, each (example, task) positive weighed as given, in chunks of any size."""
    n, B, T, D, tau = 30, 7, 2, 5, 0.3
    g = torch.Generator().manual_seed(1)
    user = torch.randn(B, T, D, generator=g)
    items = torch.randn(n, D, generator=g)
    targets = torch.tensor([3, 3, 8, 0, 29, 8, 12])
    weights = torch.tensor([[1, 0], [1, 1], [0, 1], [1, 1], [2, 0], [1, 1], [0, 0]], dtype=torch.float32)
    got = full_softmax_loss(user, targets, items, tau, weights, chunk)
    total = 0.0
    for b in range(B):
        for t in range(T):
            logits = [float(user[b, t] @ items[j]) / tau for j in range(n)]
            top = max(logits)
            lse = top + math.log(sum(math.exp(x - top) for x in logits))
            total += float(weights[b, t]) * (lse - logits[int(targets[b])])
    assert float(got) == pytest.approx(total / float(weights.sum()), rel=1e-5)


def _logs(seed=0):
    rng = np.random.default_rng(seed)
    users, items, ts = [], [], []
    for u in range(12):
        n = int(rng.integers(1, 15))
        users += [100 + u] * n
        items += rng.integers(0, 20, n).tolist()
        ts += sorted(rng.integers(0, 50, n).tolist())  # ties: the seeded shuffle orders them
    return logs_from_arrays(np.arange(20), {"g": [[f"v{i % 3}"] for i in range(20)]}, users, items, ts,
                            {"r": rng.random(len(users))}, seed=seed)


def test_windows_are_the_training_histories_position_by_position():
    logs = _logs()
    split = leave_one_out(logs)
    end = split.history_end("valid")
    cfg = TrainConfig(interactions="-", items="-", history_len=4, recent_len=2, tasks=[TaskSpec("all"), TaskSpec("high", "r", 0.5)])
    spec = feature_spec(logs, cfg, np.arange(logs.num_users))
    positives = np.stack([t.positives(logs) for t in cfg.tasks], axis=1)
    windows = Windows(split, end, 4, positives, FeatureEncoder(spec, logs.item_features), user_side, np.random.default_rng(0))
    for _ in range(3):  # epochs: random shifts
        seen = {}
        for users, anchors in windows.epoch(batch=3):
            x = windows.inputs(users, anchors)
            for b, (u, a) in enumerate(zip(users, anchors)):
                s = logs.offsets[u]
                assert s < a < end[u]  # a training target: never the validation or test item
                cols = np.flatnonzero(x["valid"][b].numpy())
                assert cols.size == min(4, a - s) and cols[-1] == x["valid"].shape[1] - 1  # left-padded
                for j, col in enumerate(cols):
                    g = a - cols.size + 1 + j  # the target's index in the logs
                    assert x["targets"][b, col] == logs.items[g] and x["rows"][b, col] == logs.items[g - 1]
                    np.testing.assert_array_equal(x["weights"][b, col].numpy(), positives[g].astype(np.float32))
                    assert x["dense"][b, col, 0] == pytest.approx(math.log1p(g - s))
                    seen[g] = seen.get(g, 0) + 1
                assert not x["weights"][b][~x["valid"][b]].any()
        want = [g for u in range(logs.num_users) for g in range(logs.offsets[u] + 1, end[u])]
        assert sorted(seen) == want  # every training target, in some window of the epoch


def _chain_logs(tmp_path, n_items=24, n_users=90, seed=0):
    """Each user walks the chain i -> i + 1 (mod n) from a random start: the next item is the last
    one's successor, which no order-blind model can tell from the history's other items."""
    rng = np.random.default_rng(seed)
    users, items, ts = [], [], []
    for u in range(n_users):
        start, n = int(rng.integers(0, n_items)), int(rng.integers(5, 12))
        users += [u] * n
        items += [(start + j) % n_items for j in range(n)]
        ts += list(range(n))
    inter, pool = tmp_path / "interactions.parquet", tmp_path / "items.parquet"
    pq.write_table(pa.table({"user_id": pa.array(users, pa.int64()), "item_id": pa.array(items, pa.int64()),
                             "timestamp": pa.array(ts, pa.int64())}), inter)
    pq.write_table(pa.table({"item_id": pa.array(np.arange(n_items), pa.int64())}), pool)
    return inter, pool


@pytest.mark.parametrize("softmax", ["full", "sampled"])
def test_the_tower_learns_order_from_every_position(tmp_path, softmax):
    os.environ.setdefault("SILVERREC_QUIET", "1")
    inter, pool = _chain_logs(tmp_path)
    cfg = TrainConfig(interactions=str(inter), items=str(pool), user_tower="sequence", dim=16, history_len=8,
                      steps=150, batch=32, negatives=16, lr=0.01, overarch=[], valid_every=50, patience=3,
                      softmax=softmax, sequence={"model_dim": 16, "layers": 1, "heads": 2, "dropout": 0.0})
    ckpt = train(cfg, None)
    stats = ckpt["stats"]["two_tower"]
    assert stats["softmax"] == softmax
    assert stats["positions"] > stats["steps"] * 32  # more than one target per window
    assert ckpt["metrics"]["two_tower_exact"]["HR@10"] > 0.9  # chance: 10 / 24 (history masked)
    assert ckpt["metrics"]["two_tower_exact"]["NDCG@10"] > 0.8


def test_the_softmax_is_chosen_by_config_and_pool_size():
    from silverrec.publish.config import ConfigError
    from silverrec.publish.train import FULL_SOFTMAX_ITEMS

    cfg = TrainConfig(interactions="i", items="p", user_tower="sequence")
    assert cfg.full_softmax(FULL_SOFTMAX_ITEMS) and not cfg.full_softmax(FULL_SOFTMAX_ITEMS + 1)
    assert TrainConfig(interactions="i", items="p", softmax="full").full_softmax(10 * FULL_SOFTMAX_ITEMS)
    assert not TrainConfig(interactions="i", items="p", softmax="sampled").full_softmax(10)
    with pytest.raises(ConfigError, match="softmax must be one of"):
        TrainConfig(interactions="i", items="p", softmax="everything")


def test_the_default_item_table_needs_the_item_towers_width():
    """item_table "tower" (the default) feeds the item tower's dim-wide outputs to a model_dim-wide
    transformer: model_dim follows dim unless [sequence] sets it, and a mismatch set there is refused
    when the config is read, naming the fixes."""
    from silverrec.publish.config import ConfigError

    with pytest.raises(ConfigError, match=r"dim = 32 and sequence.model_dim = 64: drop \[sequence\] model_dim "
                                          r"\(it follows dim\) or set it to 32"):
        TrainConfig(interactions="i", items="p", user_tower="sequence", dim=32, sequence={"model_dim": 64})
    assert TrainConfig(interactions="i", items="p", user_tower="sequence", dim=32).sequence.model_dim == 32
    own = TrainConfig(interactions="i", items="p", user_tower="sequence", dim=32, sequence={"item_table": "own"})
    assert own.sequence.model_dim == 32
    wide = TrainConfig(interactions="i", items="p", dim=32, sequence={"item_table": "own", "model_dim": 48})
    assert wide.sequence.model_dim == 48
    TrainConfig(interactions="i", items="p", user_tower="bag", dim=32)  # the bag tower has no [sequence]


def test_the_default_tower_is_the_sequential_one_with_its_own_budget():
    """A config that names no tower trains the sequential one (the better on both development data
    sets) with its batch and time cap; the bag tower keeps its own; a config's values win."""
    from silverrec.publish.train import TOWER_DEFAULTS

    seq = TrainConfig(interactions="i", items="p")
    assert seq.user_tower == "sequence" and (seq.minutes, seq.batch) == TOWER_DEFAULTS["sequence"] == (20.0, 64)
    bag = TrainConfig(interactions="i", items="p", user_tower="bag")
    assert (bag.minutes, bag.batch) == TOWER_DEFAULTS["bag"] == (1.5, 256)
    mine = TrainConfig(interactions="i", items="p", minutes=3.0, batch=32)
    assert (mine.minutes, mine.batch) == (3.0, 32)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    os.environ.setdefault("SILVERREC_QUIET", "1")
    from silverrec.publish.rec import PublishConfig

    root = tmp_path_factory.mktemp("seqrec")
    logs = make_logs()
    inter, items = write_logs(logs, root)
    cfg = TrainConfig(interactions=str(inter), items=str(items), user_tower="sequence", dim=16, batch=32, negatives=64,
                      history_len=12, steps=20, valid_every=10, overarch_steps=5, overarch=["mol"], k0=K0,
                      tasks=[TaskSpec("interacted"), TaskSpec("liked", "rating", 4.0)],
                      sequence={"model_dim": 16, "layers": 2, "heads": 2})
    ckpt_path = root / "model.ckpt"
    train(cfg, ckpt_path)
    pcfg = PublishConfig(checkpoint=str(ckpt_path), overarch="mol", value_model=FORMULA, k0=K0, nlist=NLIST)
    snap_dir, built = publish_keeping_model(pcfg, root / "snap")
    return logs, snap_dir, built


def test_published_sequence_tower_answers_as_eager(published):
    import silverrec
    from tests.test_rec_model import model_inputs, run

    logs, snap_dir, built = published
    snaps = {b: silverrec.load(snap_dir, backend=b) for b in ("export", "torchscript")}
    assert snaps["export"].config["spec"]["tower"] == "sequence"
    unseen = [int(i) for i in logs.item_ids[[5, 17, 3, 250, 41]]]  # a history no training user has
    users = [int(u) for u in logs.user_ids[:3]]
    for requests in ([{"history": unseen}], [{"user_id": users[0]}, {"history": unseen[:2]}, {"user_id": users[2]}]):
        handler = snaps["export"].rec_handler()
        args = model_inputs(handler, requests, k=10)
        eager = run(built.model, args)
        for backend, snap in snaps.items():
            got = run(snap.module, args)
            torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0, msg=f"{backend} item ids")
            torch.testing.assert_close(got[1], eager[1], rtol=1e-5, atol=1e-5, msg=f"{backend} scores")
        assert bool((eager[0] >= 0).all())
        answer = snaps["torchscript"].recommend(requests, k=10)
        torch.testing.assert_close(answer.item_ids, eager[0][:, :10], rtol=0, atol=0)
        for b, r in enumerate(requests):  # the history is excluded
            hist = r["history"] if "history" in r else logs.history(r["user_id"])
            assert not set(answer.item_ids[b].tolist()) & set(hist)


def test_cli_recommends_for_an_unseen_history(published):
    from silverrec.cli import main

    logs, snap_dir, built = published
    unseen = [int(i) for i in logs.item_ids[[9, 2, 77]]]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["recommend", str(snap_dir), "--history", ",".join(map(str, unseen)), "--k", "5", "--json"]) == 0
    ids = json.loads(out.getvalue())["item_ids"][0]
    assert len(ids) == 5 and not set(ids) & set(unseen) and set(ids) <= set(logs.item_ids.tolist())


def test_a_sequence_snapshot_serves_without_torchrec(published):
    """The sequential tower is plain PyTorch: its snapshot (spec tower "sequence") needs neither
    torchrec nor fbgemm_gpu, and a fresh process with both imports blocked answers as this one does."""
    import subprocess
    import sys

    import silverrec
    from silverrec.snapshot import needs_torchrec

    logs, snap_dir, _ = published
    snap = silverrec.load(snap_dir)
    assert not needs_torchrec(snap.manifest)
    history = [int(i) for i in logs.item_ids[[5, 17, 3]]]
    code = ("import sys; sys.modules['torchrec'] = None; sys.modules['fbgemm_gpu'] = None; import silverrec; "
            f"print(silverrec.load({str(snap_dir)!r}).recommend({{'history': {history}}}, k=10).item_ids.tolist())")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert json.loads(got.stdout.strip().splitlines()[-1]) == snap.recommend({"history": history}, k=10).item_ids.tolist()


def test_cpp_predictor_serves_the_sequential_snapshot(published):
    """silverrec-predictor answers `recommend` and `rank` for a sequential snapshot as Python does."""
    from tests.test_predictor import BINARY, check

    if not BINARY.is_file():
        pytest.skip(f"{BINARY} is not built")
    logs, snap_dir, _ = published
    users = [int(u) for u in logs.user_ids[:3]]
    items = [int(i) for i in logs.item_ids]
    check(snap_dir, "recommend", [{"user_id": users[0], "k": 5}, {"history": logs.history(users[1])[:6], "k": 7},
                                  {"requests": [{"user_id": u} for u in users], "k": 4}])
    check(snap_dir, "rank", [{"user_id": users[2], "items": items[:12]}, {"history": items[3:8], "items": items[20:23]}])
