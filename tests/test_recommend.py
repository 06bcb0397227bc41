"""The recommendation pipeline end to end: train -> publish -> load -> recommend / rank / evaluate.

References: the planted structure of the synthetic logs (tests/rec_fixtures.py) and a plain numpy
leave-one-out HR@10 over the checkpoint's float towers; the logs themselves for histories and
targets; named errors for every bad request, bad file and bad command line; a flipped byte for
snapshot integrity. Training and publishing run once per session (rec_fixtures.rec_setup).
"""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch

import silverrec
from silverrec.errors import PoolError, QueryError, SnapshotError
from silverrec.filtering.filter_lang import FilterSyntaxError
from silverrec.cli import main
from silverrec.publish.train import (
    ConfigError,
    Examples,
    TaskSpec,
    TrainConfig,
    load_checkpoint,
    rebuild_item_tower,
    rebuild_user_tower,
    train,
)
from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec
from silverrec.serving.recommend import RecHandler

from tests.rec_fixtures import N_ITEMS, NLIST, OVERARCH_STEPS, TASKS, TRAIN_STEPS, TRAIN_TOML, make_logs, rec_setup, write_logs

# what build_rec_model reads from a checkpoint
PUBLISH_KEYS = {"spec", "tasks", "user_tower", "user_tower_args", "item_ids", "item_features", "item_tower",
                "item_tower_args", "item_embeddings", "item_dense", "item_feature_names", "overarch", "users"}


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return rec_setup(tmp_path_factory)


def _rows(rec):
    return {int(i): r for r, i in enumerate(rec.logs.item_ids)}


# ------------------------------------------------------------------------------------- training

def test_checkpoint_holds_what_publish_needs(rec):
    ckpt = rec.ckpt
    assert PUBLISH_KEYS <= set(ckpt)
    assert [t["name"] for t in ckpt["tasks"]] == TASKS
    assert ckpt["item_ids"].tolist() == rec.logs.item_ids.tolist()  # pool rows = items.parquet order
    assert set(ckpt["overarch"]) == {"mol"}
    assert ckpt["stats"]["two_tower"]["steps"] == TRAIN_STEPS and ckpt["stats"]["overarch_mol"]["steps"] == OVERARCH_STEPS
    emb = ckpt["item_embeddings"]
    assert emb.shape == (N_ITEMS, 16) and bool(torch.isfinite(emb).all())
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(N_ITEMS), atol=1e-5, rtol=0)
    for part in ("user_tower", "item_tower"):
        for name, t in ckpt[part].items():
            assert bool(torch.isfinite(t.float()).all()), f"{part}.{name} is not finite"
    assert ckpt["item_dense"].shape == (N_ITEMS, len(ckpt["item_feature_names"]))
    # the stored user histories are the logs minus each user's held-out last interaction
    users = ckpt["users"]
    assert users["user_ids"].tolist() == sorted(rec.logs.events)
    for i, u in enumerate(users["user_ids"].tolist()):
        assert users["item_ids"][users["offsets"][i]:users["offsets"][i + 1]].tolist() == rec.logs.history(u)
    on_disk = load_checkpoint(rec.ckpt_path)
    assert set(on_disk) == set(ckpt)
    torch.testing.assert_close(on_disk["item_embeddings"], emb)


def test_training_lowers_the_sampled_softmax_loss(rec):
    """The trained towers' loss on training examples is finite and below the untrained towers'."""
    from silverrec.publish.logs import leave_one_out, read_logs
    from silverrec.publish.two_tower import ItemTower, sampled_softmax_loss, target_log_q
    from silverrec.retrieval.user_tower import UserTower

    cfg, ckpt = rec.train_cfg, rec.ckpt
    logs = read_logs(rec.inter_path, rec.items_path)
    ex = Examples(leave_one_out(logs), "test", cfg.tasks)
    spec = UserFeatureSpec.from_json(ckpt["spec"])
    enc = FeatureEncoder(spec, logs.item_features)
    idx = np.random.default_rng(0).choice(len(ex), 256, replace=False)
    log_q = target_log_q(ex.targets, N_ITEMS)

    def loss(user, item) -> float:
        with torch.no_grad():
            u = user(*ex.user_inputs(enc, idx))
            return float(sampled_softmax_loss(u, torch.from_numpy(ex.targets[idx]), item, log_q, 64, cfg.temperature,
                                              torch.from_numpy(ex.weights[idx]), torch.Generator().manual_seed(0)))

    trained = loss(rebuild_user_tower(ckpt), rebuild_item_tower(ckpt))
    torch.manual_seed(0)
    fresh = loss(UserTower(spec, cfg.dim, len(TASKS)).eval(), ItemTower(spec, logs.item_features, cfg.dim).eval())
    assert math.isfinite(trained) and math.isfinite(fresh)
    assert trained < fresh - 0.2, (trained, fresh)


def test_two_tower_learns_the_planted_structure(rec):
    """Leave-one-out HR@10 of the float two-tower over the whole pool (history masked, ties at the
    expected rank), computed here in numpy, is well above a random ranking's."""
    ckpt, logs = rec.ckpt, rec.logs
    spec = UserFeatureSpec.from_json(ckpt["spec"])
    enc = FeatureEncoder(spec, ckpt["item_features"])
    row = _rows(rec)
    uids = sorted(logs.events)
    hists = [np.asarray([row[i] for i in logs.history(u)], dtype=np.int64) for u in uids]
    targets = np.asarray([row[logs.target(u)] for u in uids])
    with torch.no_grad():
        user = rebuild_user_tower(ckpt)(*enc.encode(hists))[:, 0]
    scores = (user.double() @ ckpt["item_embeddings"].double().T).numpy()
    hits, chance = [], []
    for b, h in enumerate(hists):
        s = scores[b].copy()
        known = np.setdiff1d(h, [targets[b]])
        s[known] = -np.inf
        t = s[targets[b]]
        rank = (s > t).sum() + ((s == t).sum() - 1) / 2
        hits.append(rank < 10)
        chance.append(min(1.0, 10 / (N_ITEMS - known.size)))
    hr, random_hr = float(np.mean(hits)), float(np.mean(chance))
    # 90% of the targets lie in the user's category (~50 items, half of them seen): the best a
    # category-level model can do is about 0.3; a random ranking gets about 0.036
    assert hr >= 3 * random_hr and hr >= 0.15, (hr, random_hr)
    assert ckpt["metrics"]["two_tower_exact"]["HR@10"] == pytest.approx(hr, abs=1e-9)


# ----------------------------------------------------------------------------------- bad requests

def _bad_requests(rec):
    u = int(rec.logs.user_ids[0])
    h = rec.logs.history(u)[:4]
    unknown = int(rec.logs.item_ids.max()) + 1
    return {
        "history unknown id": ([{"user_id": u}, {"history": [h[0], h[1], unknown, h[3]]}], {},
                               QueryError, rf"request 1 history: unknown item id {unknown} \(position 2\)"),
        "exclude unknown id": ([{"user_id": u, "exclude": [h[0], unknown]}], {},
                               QueryError, rf"request 0 exclude: unknown item id {unknown} \(position 1\)"),
        "unknown user_id": ([{"user_id": 123456}], {}, QueryError, "unknown user_id 123456"),
        "both user and history": ([{"user_id": u, "history": h}], {}, QueryError, "exactly one of user_id and history"),
        "neither user nor history": ([{"filter": "cat = c1"}], {}, QueryError, "exactly one of user_id and history"),
        "unknown field": ([{"user_id": u, "histroy": h}], {}, QueryError, "unknown request field 'histroy'"),
        "unknown user feature": ([{"user_id": u, "features": {"age": "30"}}], {}, QueryError, "unknown user feature 'age'"),
        "k = 0": ([{"user_id": u}], {"k": 0}, QueryError, r"k must be an int in \[1, 300\], got 0"),
        "k < 0": ([{"user_id": u}], {"k": -3}, QueryError, r"k must be an int in \[1, 300\], got -3"),
        "k > pool": ([{"user_id": u}], {"k": N_ITEMS + 1}, QueryError, rf"k must be an int in \[1, 300\], got {N_ITEMS + 1}"),
        "nprobe = 0": ([{"user_id": u}], {"nprobe": 0}, QueryError, rf"nprobe must be an int in \[1, {NLIST}\]"),
        "nprobe > nlist": ([{"user_id": u}], {"nprobe": NLIST + 1}, QueryError, rf"nprobe must be an int in \[1, {NLIST}\]"),
        "filter syntax": ([{"user_id": u, "filter": "cat = c1 AND (tags = t1"}], {}, FilterSyntaxError,
                          "filter syntax error at position 23"),
        "filter syntax 2": ([{"user_id": u, "filter": "cat = = c1"}], {}, FilterSyntaxError,
                            "filter syntax error at position 6"),
        "filter feature": ([{"user_id": u, "filter": "cat = c1 OR colour = red"}], {}, QueryError,
                           "unknown feature 'colour' in filter at position 12"),
        "search mode": ([{"user_id": u}], {"mode": "fast"}, QueryError, "unknown search mode 'fast'"),
        "threads = 0": ([{"user_id": u}], {"threads": 0}, QueryError, r"threads must be an int in \[1, 1024\], got 0"),
        "threads word": ([{"user_id": u}], {"threads": "many"}, QueryError, "threads must be an int .*, got 'many'"),
    }


BAD_REQUESTS = ["history unknown id", "exclude unknown id", "unknown user_id", "both user and history",
                "neither user nor history", "unknown field", "unknown user feature", "k = 0", "k < 0", "k > pool",
                "nprobe = 0", "nprobe > nlist", "filter syntax", "filter syntax 2", "filter feature", "search mode",
                "threads = 0", "threads word"]


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_gets_its_named_error(rec, case):
    requests, options, error, message = _bad_requests(rec)[case]
    with pytest.raises(error, match=message):
        rec.snap().recommend(requests, **options)


def test_threads_policy_and_the_process_setting(rec):
    """threads="auto" runs a small batch's forward on one thread and a larger one on the process's
    threads, an int on that many; the process's setting is back after every call, and the answer
    does not depend on the thread count."""
    from silverrec.serving.recommend import ONE_THREAD_MAX_BATCH

    handler = rec.snap().rec_handler()
    seen = []
    module = handler.module

    def recording(*args):
        seen.append(torch.get_num_threads())
        return module(*args)

    users = [int(u) for u in rec.logs.user_ids]
    small = [{"user_id": u} for u in users[:ONE_THREAD_MAX_BATCH]]
    large = [{"user_id": users[i % len(users)]} for i in range(ONE_THREAD_MAX_BATCH + 1)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    handler.module = recording
    try:
        want = handler.recommend(small, k=5, threads=None)
        got = {t: handler.recommend(small, k=5, threads=t) for t in ("auto", 1, 3)}
        assert torch.get_num_threads() == 2
        handler.recommend(large, k=5)
        assert torch.get_num_threads() == 2
    finally:
        handler.module = module
        torch.set_num_threads(before)
    assert seen == [2, 1, 1, 3, 2]
    for res in got.values():
        assert torch.equal(res.item_ids, want.item_ids)
        torch.testing.assert_close(res.scores, want.scores)


def test_unknown_numeric_user_feature_is_an_error(rec):
    with pytest.raises(QueryError, match="age"):
        rec.snap().recommend({"user_id": int(rec.logs.user_ids[0]), "numeric": {"age": 31.0}}, k=3)


def test_bad_rank_requests(rec):
    snap = rec.snap()
    u = int(rec.logs.user_ids[0])
    good = [int(i) for i in rec.logs.item_ids[:3]]
    unknown = int(rec.logs.item_ids.max()) + 5
    with pytest.raises(QueryError, match=rf"items: unknown item id {unknown} \(position 2\)"):
        snap.rank({"user_id": u}, good[:2] + [unknown])
    with pytest.raises(QueryError, match="rank takes 1 to .* item ids .*, got 0"):
        snap.rank({"user_id": u}, [])
    with pytest.raises(QueryError, match="unknown user_id 7"):
        snap.rank({"user_id": 7}, good)
    listwise = RecHandler(dict(snap.config, spec=dict(snap.config["spec"], overarch="listwise")), snap.module, rec.built.row_to_item,
                          rec.built.item_csr, rec.built.users)  # a list-wise OverArch attends over the list
    with pytest.raises(QueryError, match=r"rank takes 1 to 4096 item ids with this snapshot's OverArch \(listwise\), got 4097"):
        listwise.rank({"user_id": u}, [good[0]] * 4097)
    capped = RecHandler(dict(snap.config, spec=dict(snap.config["spec"], candidates=5)), snap.module, rec.built.row_to_item, rec.built.item_csr,
                        rec.built.users)  # a snapshot that ranks at most 5 candidates per request
    with pytest.raises(QueryError, match=r"k must be an int in \[1, 5\], got 6"):
        capped.recommend({"user_id": u}, k=6)


# ------------------------------------------------------------------------------- bad train files

def test_train_config_with_an_unknown_key(rec, tmp_path):
    path = tmp_path / "train.toml"
    path.write_text(rec.train_toml.read_text().replace("dim = 16", "dim = 16\nepochs = 3"))
    with pytest.raises(ConfigError, match="unknown key 'epochs'"):
        TrainConfig.from_toml(path)
    path.write_text(rec.train_toml.read_text() + "\n[[tasks]]\nname = \"liked\"\n")
    with pytest.raises(ConfigError, match="duplicate task name"):
        TrainConfig.from_toml(path)


def test_trainer_trains_a_listwise_overarch_on_whole_candidate_lists(rec, tmp_path):
    from silverrec.publish.train import rebuild_overarch

    inter, items = write_logs(make_logs(), tmp_path)
    cfg = TrainConfig(interactions=str(inter), items=str(items), user_tower="bag", dim=8, batch=16, negatives=8, k0=6,
                      steps=3, overarch_steps=4, overarch=["listwise"], overarch_negatives=1)
    ckpt = train(cfg, None, max_steps=4, quiet_eval=True)
    assert ckpt["stats"]["overarch_listwise"]["steps"] == 4
    arch = rebuild_overarch(ckpt, "listwise")
    assert arch.kind == "listwise" and arch.config()["tasks"] == 1
    user, cand = torch.randn(2, 1, 8), torch.randn(2, 6, 8)
    feats = torch.zeros(2, 6, ckpt["item_dense"].shape[1])
    assert arch(user, cand, feats).shape == (2, 6, 1)
    with pytest.raises(ConfigError, match="unknown overarch kind 'dlrm': use one of mlp, mol, listwise"):
        TrainConfig(interactions=str(inter), items=str(items), overarch=["dlrm"])


def test_task_naming_a_missing_label_column(rec, tmp_path):
    inter, items = write_logs(make_logs(), tmp_path, drop_label=True)
    cfg = TrainConfig(interactions=str(inter), items=str(items), dim=8, batch=8, negatives=8, k0=5,
                      tasks=[TaskSpec("interacted"), TaskSpec("liked", "rating", 4.0)], overarch=[])
    with pytest.raises(ConfigError, match="task 'liked': label column 'rating' is not in the interactions"):
        train(cfg, None, max_steps=1)


def test_interaction_with_an_item_not_in_the_items_file(rec, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(rec.inter_path)
    ids = table.column("item_id").to_numpy().copy()
    missing = int(rec.logs.item_ids.max()) + 11
    ids[17] = missing
    table = table.set_column(table.column_names.index("item_id"), "item_id", pa.array(ids))
    pq.write_table(table, tmp_path / "interactions.parquet")
    shutil.copy(rec.items_path, tmp_path / "items.parquet")
    (tmp_path / "train.toml").write_text(rec.train_toml.read_text())
    cfg = TrainConfig.from_toml(tmp_path / "train.toml")
    message = rf"interactions.parquet row 17: item_id {missing} is not in items.parquet"
    with pytest.raises(PoolError, match=message):
        train(cfg, None, max_steps=1)


def test_cli_train_reports_a_bad_config(rec, tmp_path, capsys):
    path = tmp_path / "train.toml"
    path.write_text(TRAIN_TOML.format(k0=5, steps=1, overarch_steps=1).replace("interactions.parquet", "missing.parquet"))
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "m.ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("silverrec: error:") and "missing.parquet does not exist" in err
    assert not (tmp_path / "m.ckpt").exists()


# -------------------------------------------------------------------------------------------- CLI

def test_cli_recommend_json(rec, capsys):
    u = int(rec.logs.user_ids[3])
    assert main(["recommend", str(rec.snap_dir), "--user", str(u), "--k", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ids = out["item_ids"][0]
    assert len(ids) == 5 and len(set(ids)) == 5
    assert set(ids) <= set(rec.logs.item_ids.tolist()) and not set(ids) & set(rec.logs.history(u))
    assert sorted(out["task_scores"]) == sorted(TASKS) and len(out["scores"][0]) == 5
    assert ids == rec.snap().recommend({"user_id": u}, k=5).item_ids[0].tolist()


def test_cli_recommend_with_history_and_filter(rec, capsys):
    hist = rec.logs.history(int(rec.logs.user_ids[4]))
    args = ["recommend", str(rec.snap_dir), "--history", ",".join(map(str, hist)), "--filter", "cat = c2",
            "--k", "4", "--json", "--backend", "torchscript"]
    assert main(args) == 0
    ids = json.loads(capsys.readouterr().out)["item_ids"][0]
    row = _rows(rec)
    assert len(ids) == 4 and all(rec.logs.features["cat"][row[i]] == ["c2"] for i in ids)


def test_cli_rank_with_a_file_of_ids(rec, tmp_path, capsys):
    u = int(rec.logs.user_ids[5])
    items = [int(i) for i in rec.logs.item_ids[[7, 3, 250, 42]]]
    path = tmp_path / "items.txt"
    path.write_text("\n".join(map(str, items)) + "\n")
    assert main(["rank", str(rec.snap_dir), "--user", str(u), "--items", str(path), "--json", "--backend", "torchscript"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["item_ids"] == [items]
    want = rec.snap("torchscript").rank({"user_id": u}, items)
    np.testing.assert_allclose(out["scores"][0], want.scores[0].numpy(), rtol=1e-6, atol=1e-6)


def test_cli_evaluate_prints_hr_at_10(rec, capsys):
    assert main(["evaluate", str(rec.snap_dir), "--interactions", str(rec.inter_path), "--items", str(rec.items_path),
                 "--backend", "torchscript"]) == 0
    out = capsys.readouterr().out
    fields = out.split()
    hr = float(fields[fields.index("HR@10") + 1])
    assert "users 80" in out
    # the same protocol by hand: each user's stored history, top-100, target among the first 10
    snap = rec.snap("torchscript")
    uids = sorted(rec.logs.events)
    hits = []
    for s in range(0, len(uids), 64):  # evaluate's batches (a request's answer depends on its batch,
        batch = uids[s:s + 64]          # see test_rec_model.py::test_a_request_does_not_depend_on_its_batch_neighbours)
        res = snap.recommend([{"history": rec.logs.history(u)} for u in batch], k=100)
        hits += [rec.logs.target(u) in res.item_ids[b, :10].tolist() for b, u in enumerate(batch)]
    assert hr == pytest.approx(float(np.mean(hits)), abs=1e-4)
    assert hr > 0.1


@pytest.fixture(scope="module")
def index_snapshot(tmp_path_factory):
    """A tiny non-recommendation (exact index) snapshot."""
    from silverrec.publish.filtered_ivf import publish_index
    from silverrec.publish.pool import Pool

    rng = np.random.default_rng(0)
    pool = Pool(np.arange(20, dtype=np.int64), rng.standard_normal((20, 4)).astype(np.float32))
    return publish_index(pool, tmp_path_factory.mktemp("exact") / "snap", exact=True, torchscript=False)


@pytest.mark.parametrize("command", ["recommend", "rank", "evaluate"])
def test_cli_refuses_a_non_rec_snapshot(rec, index_snapshot, command, tmp_path, capsys):
    (tmp_path / "ids.txt").write_text("1 2 3")
    extra = {"recommend": ["--user", "500"], "rank": ["--user", "500", "--items", str(tmp_path / "ids.txt")],
             "evaluate": ["--interactions", str(rec.inter_path), "--items", str(rec.items_path)]}[command]
    assert main([command, str(index_snapshot), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("silverrec: error:") and "recommendation model" in err


@pytest.mark.parametrize("history,message", [
    ("1000,abc,1007", "history item id 'abc' is not an integer"),
    ("999999", r"unknown item id 999999 \(position 0\)"),
])
def test_cli_bad_history(rec, history, message, capsys):
    assert main(["recommend", str(rec.snap_dir), "--history", history, "--backend", "torchscript"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("silverrec: error:") and re.search(message, err), err


def test_cli_user_and_history_together(rec, capsys):
    args = ["recommend", str(rec.snap_dir), "--user", "500", "--history", "1000", "--backend", "torchscript"]
    assert main(args) == 2
    assert "exactly one of --user" in capsys.readouterr().err


# ----------------------------------------------------------------------------- snapshot integrity

def test_altered_rank_program_fails_to_load(rec, tmp_path):
    copy = tmp_path / "snap"
    shutil.copytree(rec.snap_dir, copy)
    path = copy / "rank.pt2"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="rank.pt2"):
        silverrec.load(copy)
    path.write_bytes(bytes(data[:-10]))  # truncated
    with pytest.raises(SnapshotError, match="rank.pt2"):
        silverrec.load(copy, backend="torchscript")
    path.unlink()
    with pytest.raises(SnapshotError, match="missing rank.pt2"):
        silverrec.load(copy)
