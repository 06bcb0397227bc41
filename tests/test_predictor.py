"""silverrec-predictor (predictor/, the C++ program) answers as the Python predictor does.

For each snapshot kind it serves (pure ANN: exact, IVF, with a filter bank; recommendation: each OverArch, a
filter template, a team's own modules, hybrid with a generative source; decode-only), the program's answers to a set of /v1/search, /v1/recommend and /v1/rank
bodies (one JSON line each on its stdin) equal `silverrec serve`'s for the same bodies: served.Served over
`silverrec.load(DIR)` (its search / recommend / rank) with the pydantic models of schemas.py: the same items in
the same order, scores within SCORE_TOL (the Python side runs the snapshot's preferred program, torch.export or
TorchScript; the C++ side TorchScript: the same kernels, summation order aside). Bad requests get the same status
and, for 400, the same message; a snapshot with an altered file is refused with Python's message. One HTTP test
checks the routes, batching under concurrent callers and /metrics.

Skipped, saying why, where the program is not built (`make setup` skips it without CMake or a C++ compiler).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import silverrec
from silverrec.errors import QueryError, SnapshotError
from silverrec.serving.schemas import request_models
from silverrec.serving.served import Served
from tests.rec_fixtures import rec_setup

BINARY = Path(sys.executable).parent / "silverrec-predictor"
SCORE_TOL = 1e-4
pytestmark = pytest.mark.skipif(not BINARY.is_file(), reason=f"{BINARY} is not built (make setup builds it where "
                                                              "CMake and a C++ compiler are found)")


def predictor(snapshot: Path, route: str, bodies: list[dict]) -> list[dict]:
    """The program's answers to `bodies`, one JSON line each on its stdin."""
    text = "".join(json.dumps(b) + "\n" for b in bodies)
    out = subprocess.run([str(BINARY), str(snapshot), "--route", route], input=text, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def python(served: Served, route: str, body: dict) -> dict:
    """`silverrec serve`'s answer to `body` (status 400 / 422 with its message for a bad one)."""
    models = request_models()
    model = {"search": models.SearchBody, "recommend": models.RecommendBody, "rank": models.RankBody}[route]
    from pydantic import ValidationError

    try:
        parsed = model.model_validate(body)
    except ValidationError:
        return {"status": 422}
    try:
        key, payload = getattr(served, f"prepare_{route}")(parsed)
        out = served.run(key, [payload])[0]  # JSON bytes, or the QueryError that refuses the request
    except QueryError as e:
        out = e
    if isinstance(out, QueryError):
        return {"status": 400, "detail": str(out)}
    return json.loads(out)


def assert_same(cpp: dict, py: dict, body: dict) -> None:
    if "status" in py:
        assert cpp.get("status") == py["status"], (body, cpp, py)
        if py["status"] == 400:
            assert cpp["detail"] == py["detail"], body
        return
    assert "status" not in cpp, (body, cpp)
    assert cpp["item_ids"] == py["item_ids"], body
    close(cpp["scores"], py["scores"])
    assert set(cpp.get("task_scores", {})) == set(py.get("task_scores", {}))
    for task, scores in py.get("task_scores", {}).items():
        close(cpp["task_scores"][task], scores)


def close(a, b) -> None:
    a = np.array([[np.nan if x is None else x for x in row] for row in a], dtype=np.float64)
    b = np.array([[np.nan if x is None else x for x in row] for row in b], dtype=np.float64)
    np.testing.assert_allclose(a, b, atol=SCORE_TOL, rtol=SCORE_TOL, equal_nan=True)


def check(snapshot: Path, route: str, bodies: list[dict]) -> list[dict]:
    served = Served(silverrec.load(snapshot))
    answers = predictor(snapshot, route, bodies)
    assert len(answers) == len(bodies)
    for body, cpp in zip(bodies, answers):
        assert_same(cpp, python(served, route, body), body)
        if "status" not in cpp:
            assert cpp["version"] == served.version
    return answers


# ------------------------------------------------------------------------------------------------ pure ANN
N, D = 1200, 16


@pytest.fixture(scope="module")
def ann(tmp_path_factory):
    """IVF, exact and filter-bank snapshots of one small pool, and query rows."""
    from silverrec.publish.filtered_ivf import publish_index
    from silverrec.publish.ivf import IVFConfig
    from silverrec.publish.pool import read_pool, write_pool

    d = tmp_path_factory.mktemp("predictor_ann")
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((N, D)).astype(np.float32)
    ids = np.arange(N, dtype=np.int64) * 7 + 3
    write_pool(d / "pool.parquet", ids, emb)
    write_pool(d / "attrs.parquet", ids, emb, {"color": [f"c{i % 5}" for i in range(N)],
                                               "tags": [[f"t{i % 3}", f"t{i % 7}"] for i in range(N)]})
    return {"ivf": publish_index(read_pool(d / "pool.parquet"), d / "ivf", config=IVFConfig(nlist=8), torchscript=True),
            "exact": publish_index(read_pool(d / "pool.parquet"), d / "exact", exact=True, torchscript=True),
            "filtered": publish_index(read_pool(d / "attrs.parquet"), d / "filtered", config=IVFConfig(nlist=8),
                                      torchscript=True),
            "queries": rng.standard_normal((20, D)).astype(np.float32), "emb": emb, "ids": ids}


def search_bodies(queries: np.ndarray) -> list[dict]:
    q = queries.tolist()
    return [{"queries": q[:1], "k": 10}, {"queries": q[1:17], "k": 5}, {"queries": q[17:20], "k": 50, "nprobe": 8},
            {"queries": q[:2], "k": 3, "nprobe": 1},
            # bad requests: 400 with served.py's messages, 422 for the wrong types
            {"queries": [], "k": 5}, {"queries": [q[0][:5]], "k": 5}, {"queries": q[:1], "k": 0},
            {"queries": q[:1], "k": N + 1}, {"queries": q[:1], "nprobe": 99}, {"queries": q[:1], "k": "ten"},
            {"queries": q[:1], "nope": 1}, {"queries": [[1, 2]]}]


@pytest.mark.parametrize("kind", ["ivf", "exact", "filtered"])
def test_search_answers_as_python(ann, kind):
    check(ann[kind], "search", search_bodies(ann["queries"]))


def ann_attributes(item_id: int) -> dict[str, set[str]]:
    """The fixture's attributes of an item (written here, from the pool the fixture publishes)."""
    i = (item_id - 3) // 7
    return {"color": {f"c{i % 5}"}, "tags": {f"t{i % 3}", f"t{i % 7}"}}


# filters over the fixture's attributes, and a brute-force evaluation of each (the reference of the C++ compiler)
ANN_FILTERS = {
    "color = c1": lambda a: "c1" in a["color"],
    "color IN (c2, c3) AND NOT tags = t1": lambda a: bool(a["color"] & {"c2", "c3"}) and "t1" not in a["tags"],
    "tags = t6 OR color != 'c0'": lambda a: "t6" in a["tags"] or "c0" not in a["color"],
    "NOT (tags IN (t0, t4) OR color = c4) AND tags != nope": lambda a: not (a["tags"] & {"t0", "t4"} or "c4" in a["color"]),
}


def filtered_search_bodies(queries: np.ndarray) -> list[dict]:
    q, f = queries.tolist(), list(ANN_FILTERS)
    return [{"queries": q[:3], "k": 5, "filter": f[0]}, {"queries": q[3:7], "k": 7, "filter": [f[1], None, f[2], f[3]]},
            {"queries": q[7:9], "k": 6, "filter": f[2], "mode": "unprobed"},
            {"queries": q[9:11], "k": 4, "filter": f[3], "mode": ["probed", "auto"], "nprobe": 2, "max_probe": 4},
            {"queries": q[11:13], "k": 5, "filter": f[1], "max_probe": 3}, {"queries": q[:2], "k": 3, "filter": [None, None]},
            # bad filters and options: the compiler's messages, position and all
            {"queries": q[:1], "filter": "color = "}, {"queries": q[:2], "filter": [None, "colour = c1 OR tags = t1"]},
            {"queries": q[:1], "filter": "color = c1 AND (tags = t1"}, {"queries": q[:1], "filter": "名 = 'x'"},
            {"queries": q[:2], "filter": ["color = c1"]}, {"queries": q[:1], "filter": "color = c1", "mode": "fast"},
            {"queries": q[:2], "filter": "color = c1", "mode": ["auto"]},
            {"queries": q[:1], "filter": "color = c1", "nprobe": 4, "max_probe": 2},
            {"queries": q[:1], "filter": 5}, {"queries": q[:1], "filter": ["color = c1", 3]}, {"queries": q[:1], "mode": 1}]


def test_filtered_search_answers_as_python_and_as_brute_force(ann):
    bodies = filtered_search_bodies(ann["queries"])
    answers = check(ann["filtered"], "search", bodies)
    assert sum("status" not in a for a in answers) == 6
    for body, out in zip(bodies, answers):
        if "status" in out:
            continue
        filters = body["filter"] if isinstance(body["filter"], list) else [body["filter"]] * len(body["queries"])
        for f, ids in zip(filters, out["item_ids"]):
            assert len(ids) == body["k"] and all(ids)
            assert f is None or all(ANN_FILTERS[f](ann_attributes(i)) for i in ids), (f, ids)
    # the whole pool scanned (unprobed): the brute-force top k of the passing items, by the codes' scores
    emb = torch.from_numpy(ann["emb"])
    for row, ids in zip(bodies[2]["queries"], answers[2]["item_ids"]):
        ok = torch.tensor([ANN_FILTERS[bodies[2]["filter"]](ann_attributes(int(i))) for i in ann["ids"]])
        scores = torch.where(ok, emb @ torch.tensor(row), torch.tensor(-np.inf))
        best = set(ann["ids"][scores.topk(6).indices.numpy()].tolist())
        assert len(best & set(ids)) >= 5  # int8 codes may swap a near tie


def test_filters_need_a_filter_index(ann):
    check(ann["ivf"], "search", [{"queries": ann["queries"][:1].tolist(), "filter": "color = c1"}])


def test_a_pure_ann_index_does_not_recommend(ann):
    (out,) = predictor(ann["ivf"], "recommend", [{"history": [3]}])
    assert out["status"] == 400
    assert out["detail"] == "this snapshot is a pure-ANN index: it answers /v1/search, not /v1/recommend"


def test_altered_snapshot_is_refused_with_pythons_message(ann, tmp_path):
    snap = tmp_path / "snap"
    shutil.copytree(ann["ivf"], snap)
    with open(snap / "model.ts", "r+b") as f:  # one byte flipped, the size kept
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(SnapshotError) as python_error:
        silverrec.load(snap)
    out = subprocess.run([str(BINARY), str(snap), "--route", "search"], input="", capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == f"silverrec-predictor: {python_error.value}"
    manifest = json.loads((snap / "manifest.json").read_text())
    manifest["format_version"] = 99
    (snap / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError) as python_error:
        silverrec.load(snap)
    out = subprocess.run([str(BINARY), str(snap), "--route", "search"], input="", capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip() == f"silverrec-predictor: {python_error.value}"


# ------------------------------------------------------------------------------------------------ recommendation
@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return rec_setup(tmp_path_factory)


def rec_bodies(rec) -> list[dict]:
    logs = rec.logs
    users = [int(u) for u in logs.user_ids[:6]]
    items = [int(i) for i in logs.item_ids]
    hist = logs.history(users[0])
    return [{"user_id": users[0], "k": 10}, {"history": hist[:7], "k": 5},
            {"requests": [{"user_id": u} for u in users[1:5]] + [{"history": hist[3:9], "exclude": items[:4]}], "k": 8},
            {"user_id": users[1], "k": 12, "exclude_history": False, "exclude": [hist[0]]},
            {"history": logs.history(users[2]), "k": 6, "k0": 30, "nprobe": 2, "max_probe": 4, "mode": "probed"},
            # bad requests
            {"user_id": 123456789}, {"history": [items[0], -5]}, {"user_id": users[0], "history": [items[0]]},
            {"requests": [{"user_id": users[0]}, {"history": [items[1]], "exclude": [7]}]},
            {"history": [items[0]], "k": 0}, {"history": [items[0]], "nprobe": 99}, {"history": [items[0]], "mode": "fast"},
            {"history": [items[0]], "numeric": {"age": 3.0}}, {"history": [items[0]], "features": {"city": "x"}},
            {"user_id": users[0], "requests": [{"user_id": users[1]}]}, {"requests": []}, {"history": ["a"]},
            {"history": [items[0]], "filter": 3}]


def rec_filter_bodies(rec) -> list[dict]:
    users = [int(u) for u in rec.logs.user_ids[:6]]
    return [{"user_id": users[0], "k": 6, "filter": "cat = c1"},
            {"requests": [{"user_id": users[1], "filter": "tags IN (t1, t2) AND cat != c0"}, {"user_id": users[2]},
                          {"user_id": users[3], "filter": "NOT cat IN (c1, c2)"}], "k": 5},
            {"user_id": users[4], "k": 4, "filter": "cat = c3", "mode": "unprobed"},
            # bad filters: named by their request
            {"user_id": users[0], "filter": "cat = = c1"},
            {"requests": [{"user_id": users[1]}, {"user_id": users[2], "filter": "colour = c1"}]},
            {"requests": [{"user_id": users[1], "filter": "cat = c1 AND"}, {"user_id": 123456789}]}]


def rank_bodies(rec) -> list[dict]:
    logs = rec.logs
    items = [int(i) for i in logs.item_ids]
    return [{"user_id": int(logs.user_ids[0]), "items": items[:25]}, {"history": items[5:9], "items": items[40:41]},
            {"user_id": int(logs.user_ids[3]), "items": items[::-7], "exclude": items[:2]},
            {"user_id": int(logs.user_ids[0]), "items": [items[0], 17]}, {"history": [items[0]], "items": []}]


def test_recommend_and_rank_answer_as_python(rec):
    answers = check(rec.snap_dir, "recommend", rec_bodies(rec))
    assert sum("status" not in a for a in answers) == 5
    check(rec.snap_dir, "rank", rank_bodies(rec))


def test_recommend_with_filters_answers_as_python_and_as_brute_force(rec):
    bodies = rec_filter_bodies(rec)
    answers = check(rec.snap_dir, "recommend", bodies)
    assert [("status" in a) for a in answers] == [False] * 3 + [True] * 3
    logs = rec.logs
    row_of = {int(i): r for r, i in enumerate(logs.item_ids)}
    has = {"cat = c1": lambda r: logs.features["cat"][r] == ["c1"],
           "tags IN (t1, t2) AND cat != c0": lambda r: bool({"t1", "t2"} & set(logs.features["tags"][r]))
           and logs.features["cat"][r] != ["c0"],
           "NOT cat IN (c1, c2)": lambda r: logs.features["cat"][r][0] not in ("c1", "c2"),
           "cat = c3": lambda r: logs.features["cat"][r] == ["c3"]}
    for body, out in zip(bodies[:3], answers):
        users = body.get("requests", [body])
        for u, ids in zip(users, out["item_ids"]):
            assert len(ids) == body["k"]
            if "filter" in u:
                assert all(has[u["filter"]](row_of[i]) for i in ids), (u, ids)


@pytest.fixture(scope="module")
def overarches(rec, tmp_path_factory):
    """The fixture's checkpoint with every OverArch trained, published once with each (and with none)."""
    from silverrec.publish.rec import PublishConfig, publish_rec
    from silverrec.publish.train import TrainConfig, train
    from silverrec.ranking.overarch import OVERARCHES

    d = tmp_path_factory.mktemp("predictor_overarch")
    toml = d / "train.toml"
    text = rec.train_toml.read_text().replace('overarch = ["mol"]', f"overarch = {json.dumps(sorted(OVERARCHES))}")
    toml.write_text(text.replace('"interactions.parquet"', json.dumps(str(rec.inter_path)))
                    .replace('"items.parquet"', json.dumps(str(rec.items_path))))
    train(TrainConfig.from_toml(toml), d / "model.ckpt", max_steps=15)
    return {kind: publish_rec(PublishConfig(checkpoint=str(d / "model.ckpt"), overarch=kind, k0=20, nlist=8), d / kind)
            for kind in [*sorted(OVERARCHES), "none"]}


@pytest.mark.parametrize("kind", ["mlp", "listwise", "none"])
def test_each_overarch_answers_as_python(rec, overarches, kind):
    check(overarches[kind], "recommend", rec_bodies(rec)[:5])
    check(overarches[kind], "rank", rank_bodies(rec)[:3])


def test_transitions_snapshot_answers_as_python(rec, tmp_path_factory):
    """Next-item transitions (retrieval/transitions.py): the C++ predictor hands the forward each
    request's newest history row, as the Python one does. A weight far above the tiny model's values
    makes the successors reorder the lists. k may reach the candidates ranked: 30 from the ANN and
    6 successors, 36 and no more."""
    from silverrec.publish.rec import PublishConfig, publish_rec

    snap = publish_rec(PublishConfig(checkpoint=str(rec.ckpt_path), overarch="mol", k0=20, nlist=8, candidates=30,
                                     transitions=6, transition_weight=50.0, transition_window=3, transition_decay=0.8),
                       tmp_path_factory.mktemp("predictor_transitions") / "snap")
    user = int(rec.logs.user_ids[0])
    answers = check(snap, "recommend", rec_bodies(rec)[:6] + rec_filter_bodies(rec)[:3] +
                    [{"user_id": user, "k": 36}, {"user_id": user, "k": 37}])
    assert "status" not in answers[-2] and "k must be" in answers[-1]["detail"]
    check(snap, "rank", rank_bodies(rec)[:2])


def test_filter_template_snapshot_answers_as_python(tmp_path_factory):
    from tests.test_templates import template_snapshot

    s = template_snapshot(tmp_path_factory.mktemp("predictor_template"))
    users = s["users"]
    bodies = [dict(users[0], k=10), {"requests": [dict(u) for u in users[1:6]], "k": 5},
              {"history": [int(i) for i in s["built"].row_to_item[:4]], "features": users[7]["features"], "k": 7},
              {"user_id": users[0]["user_id"]},  # no bound feature: the template's message
              {"user_id": users[0]["user_id"], "features": {"fav_cat": ["c1", "c2"], "ok_tags": "t1"}}]
    check(s["snap_dir"], "recommend", bodies)


def test_byo_snapshots_answer_as_python(tmp_path_factory):
    """A team's own modules: an entry-point user tower and list-wise OverArch; a tower reading user features."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from silverrec.publish.byo import publish_byo
    from tests.test_byo import DIM, GENRES, N as BYO_N, config, make_world

    world = make_world(tmp_path_factory.mktemp("predictor_byo"))
    d = world["dir"]
    user = {"entry": "models:UserTower", "path": "user_state.pt",
            "args": {"num_items": BYO_N, "num_values": len(GENRES), "dim": DIM, "hidden": 16}}
    arch = {"entry": "models:ListwiseRanker", "args": {"dim": DIM, "feat_dim": 1, "width": 16, "heads": 2},
            "path": "arch_state.pt", "mask": True}
    snap = publish_byo(config(world, user, arch), d / "snap")
    ids = [int(i) for i in world["item_ids"]]
    bodies = [{"history": ids[:5], "k": 5}, {"requests": [{"history": ids[i:i + 3]} for i in range(0, 30, 3)], "k": 4},
              {"user_id": 3, "k": 6}, {"history": [ids[0], 5]}]
    check(snap, "recommend", bodies)
    check(snap, "rank", [{"history": ids[:3], "items": ids[10:30]}])

    pq.write_table(pa.table({"user_id": pa.array(np.arange(12), pa.int64()),
                             "gender": pa.array(["m", "f", "x"] * 4, pa.string()),
                             "age": pa.array(np.arange(12) * 3.0 + 20, pa.float32())}), d / "users.parquet")
    features = {"entry": "tests.test_predictor:FeatureTower", "user_features": ["gender"], "numeric": ["age"],
                "item_ids": "item_id"}
    snap = publish_byo(config(world, features, None, users=str(d / "users.parquet")), d / "features")
    check(snap, "recommend", [{"history": ids[:4], "features": {"gender": "x"}, "numeric": {"age": 41.0}, "k": 5},
                              {"requests": [{"user_id": 2}, {"history": ids[7:9], "features": {"gender": ["f", "q"]}}]},
                              {"history": ids[:4], "numeric": {"height": 1.0}}, {"history": ids[:4], "features": {"x": "y"}}])


class FeatureTower(torch.nn.Module):
    """tests/test_byo.py's tower over every key kind (hist_item, recent_item, hist_genre, user_gender + 2 dense),
    scriptable (its sizes held, not read from globals): the program silverrec-predictor runs is model.ts."""

    def __init__(self):
        super().__init__()
        from tests.test_byo import DIM, N as BYO_N

        self.dim = DIM
        self.emb = torch.nn.Embedding(1100 + BYO_N * 7, DIM)
        self.lin = torch.nn.Linear(4 * DIM + 2, DIM)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        B = dense.shape[0]
        bags = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths.long(), output_size=values.shape[0])
        emb = self.emb(values)
        total = torch.zeros(lengths.shape[0], self.dim).index_add(0, bags, emb)
        pooled = (total / lengths.clamp_min(1).unsqueeze(1).to(emb.dtype)).reshape(4, B, self.dim)
        return self.lin(torch.cat([pooled[0], pooled[1], pooled[2], pooled[3], dense], dim=1))


def test_hybrid_snapshot_answers_as_python(rec, tmp_path_factory):
    """The fixture's model with a tiny generative source trained on the same logs (tests/test_hybrid.py's)."""
    import dataclasses

    from silverrec.generative.source import SOURCES
    from silverrec.publish.rec import publish_rec
    from silverrec.publish.train_generative import TrainConfig as GenConfig, train as train_generative

    d = tmp_path_factory.mktemp("predictor_hybrid")
    train_generative(GenConfig(interactions=str(rec.inter_path), items=str(rec.items_path), embeddings=str(rec.ckpt_path),
                               levels=2, codes=4, minutes=1e6, max_steps=20, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                               ffn_hidden=32, max_history=4, eval_users=4, eval_beam=10), d / "gen.ckpt")
    snap = publish_rec(dataclasses.replace(rec.publish_cfg, sources=list(SOURCES), generative_checkpoint=str(d / "gen.ckpt"),
                                           beam_width=8), d / "snap")
    check(snap, "recommend", rec_bodies(rec))
    check(snap, "rank", rank_bodies(rec)[:3])


def test_generative_snapshot_answers_as_python(tmp_path_factory):
    """A decode-only model (tests/test_generative_publish.py's: semantic IDs of a 240-item pool, a random decoder)."""
    from tests.test_generative_publish import W, publish_snapshot

    _, sids, _, snap = publish_snapshot(tmp_path_factory.mktemp("predictor_gen"))
    i = [int(v) for v in sids.item_ids]
    check(snap, "recommend", [
        {"history": i[:3], "k": 5}, {"requests": [{"history": i[j:j + 1 + j % 9]} for j in range(12)], "k": W},
        {"history": i[10:20], "exclude_history": False}, {"history": [i[0], 7]}, {"user_id": 3},
        {"history": i[:2], "k": W + 1}, {"history": i[:2], "nprobe": 5}])
    check(snap, "rank", [{"history": i[:2], "items": i[:3]}])


# ------------------------------------------------------------------------------------------------ HTTP
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, route: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{route}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_http_routes_batching_and_metrics(rec):
    port = free_port()
    proc = subprocess.Popen([str(BINARY), str(rec.snap_dir), "--http", str(port), "--max-batch", "8",
                             "--max-wait-ms", "20"], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.1)
        served = Served(silverrec.load(rec.snap_dir))
        bodies = [{"user_id": int(u), "k": 5 + i % 3} for i, u in enumerate(rec.logs.user_ids[:24])]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # concurrent callers: batched forwards
            answers = list(pool.map(lambda b: post(port, "/v1/recommend", b), bodies))
        for body, (status, out) in zip(bodies, answers):
            assert status == 200
            assert_same(out, python(served, "recommend", body), body)
        status, out = post(port, "/v1/rank", rank_bodies(rec)[0])
        assert status == 200 and out["item_ids"][0] == rank_bodies(rec)[0]["items"]
        status, out = post(port, "/v1/recommend", {"user_id": 123456789})
        assert status == 400 and out["detail"] == python(served, "recommend", {"user_id": 123456789})["detail"]
        assert post(port, "/v1/search", {"queries": [[0.1]]})[0] == 400
        assert post(port, "/v1/recommend", {"user_id": "x"})[0] == 422
        assert post(port, "/v1/recommend", {"user_id": int(rec.logs.user_ids[0])}, {"X-Deadline-Ms": "-1"})[0] == 400
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'silverrec_requests_total{route="/v1/recommend",status="200"} 24' in metrics
        count = next(line for line in metrics.splitlines() if line.startswith("silverrec_batch_requests_count"))
        assert int(float(count.split()[1])) < 25, "24 concurrent requests took fewer forwards than requests"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
