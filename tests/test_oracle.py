"""The whole recommendation model against a plain float implementation of it (the oracle).

The bundled MovieLens ml-latest-small is trained briefly (fixed step counts: the oracle checks the
arithmetic, not the quality) with two tasks, a user feature (`fav_genres`: each user's two most
rated genres) and the three OverArch kinds, then published three times, once per OverArch (MLP,
mixture-of-logits, list-wise), each with a value model that reads an item feature and a filter
template bound to the user feature. `snap.recommend` at nprobe = nlist answers a batch of requests
(stored users and sent histories, with and without a request filter, exclude ids, a user without
the bound feature) and the answers are compared with `reference_recommend` below.

The reference reads only what the snapshot publishes (model.pt2's tensors, items.npz, users.npz,
the manifest's vocabularies and constants) and movies.csv (for the filters: genres and decades
parsed here), and recomputes every stage in float64 numpy: the user tower (mean-pooled tables,
MLP, task heads, L2 norm), the filter and the template, the exclusions, each task's exact re-score
and its best k0, the rank-by-rank merge of the tasks' lists capped at `candidates`, the OverArch
(each kind's formula written out here, its item side recomputed from the cached embeddings and
features), the value model formula and the top k. No silverrec op or module runs on its side.

The search budget (overfetch) covers the pool, so at nprobe = nlist the int8 scan returns every
row that passes the filter and its int8 scores decide nothing: the answer is defined by the float
arithmetic above (the int8 scan's own ranking is checked in test_ivf.py / test_filter_ivf.py).

Tolerances: the model computes in float32 on the published bf16 embeddings, the reference in
float64 on the same values. Task scores and values agree within ATOL + RTOL * |x|; "the same items
in the same order up to ties" is: every returned item's reference value equals its returned score
and the returned scores equal the reference's k best values, position by position (so items may
trade places only where their values are within tolerance). A request whose candidate set itself
hangs on a near tie (two exact re-scores within RESCORE_TIE at the k0 cut or at the merge's cap)
is not comparable position by position and is skipped; the test requires most requests compared.
"""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

MOVIELENS = Path(__file__).resolve().parents[1] / "data" / "movielens"
TASKS = ("interacted", "liked")
K0 = 40
CANDIDATES = 60  # < 2 * K0: the cap of the rank-by-rank merge is exercised
NLIST = 16
K = 20
FORMULA = {"add": [{"weights": {"interacted": 1.0, "liked": 0.5}},
                   {"mul": [0.3, {"sigmoid": {"feature": "log_count"}}]}]}
TEMPLATE = "genre IN $user.fav_genres AND NOT item_id IN $history"
REQUEST_FILTER = "genre = Comedy AND NOT decade = '1990s'"
ATOL, RTOL = 2e-3, 1e-4
RESCORE_TIE = 2e-5

TRAIN_TOML = """\
interactions = "interactions.parquet"
items = "items.parquet"
users = "users.parquet"
user_tower = "bag"
dim = 16
history_len = 30
recent_len = 5
batch = 128
negatives = 128
k0 = 50
steps = 25
overarch_steps = 3
overarch = ["mlp", "mol", "listwise"]

[[tasks]]
name = "interacted"

[[tasks]]
name = "liked"
label = "rating"
min = 4.0
"""


# ------------------------------------------------------------------------------------------ data


def read_movies() -> dict[int, tuple[set[str], str]]:
    """movies.csv -> {movie id: (genres, decade)}, parsed here (the filters' ground truth)."""
    out = {}
    with open(MOVIELENS / "movies.csv", newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            genres = set() if row["genres"] == "(no genres listed)" else set(row["genres"].split("|"))
            m = re.search(r"\((\d{4})\)\s*$", row["title"].strip())
            out[int(row["movieId"])] = (genres, f"{int(m.group(1)) // 10 * 10}s" if m else "unknown")
    return out


def read_ratings() -> dict[int, list[tuple[int, int]]]:
    """ratings.csv -> {user id: [(timestamp, movie id), ...]}."""
    out: dict[int, list] = {}
    with open(MOVIELENS / "ratings.csv", newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            out.setdefault(int(row["userId"]), []).append((int(row["timestamp"]), int(row["movieId"])))
    return out


def favourite_genres(ratings: dict[int, list], movies: dict[int, tuple]) -> dict[int, list[str]]:
    """Each user's two most rated genres (ties by name)."""
    fav = {}
    for u, events in ratings.items():
        counts: dict[str, int] = {}
        for _, m in events:
            for g in movies[m][0]:
                counts[g] = counts.get(g, 0) + 1
        fav[u] = sorted(counts, key=lambda g: (-counts[g], g))[:2]
    return fav


# ------------------------------------------------------------------------------------------ setup


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Train once, publish once per OverArch kind."""
    os.environ.setdefault("SILVERREC_QUIET", "1")
    from silverrec.publish.movielens import write_logs
    from silverrec.publish.rec import PublishConfig, publish_rec
    from silverrec.publish.train import TrainConfig, train

    root = tmp_path_factory.mktemp("oracle")
    write_logs(root)
    movies, ratings = read_movies(), read_ratings()
    fav = favourite_genres(ratings, movies)
    users = sorted(fav)
    pq.write_table(pa.table({"user_id": pa.array(users, pa.int64()),
                             "fav_genres": pa.array([fav[u] for u in users], pa.list_(pa.string()))}),
                   root / "users.parquet")
    (root / "train.toml").write_text(TRAIN_TOML)
    cfg = TrainConfig.from_toml(root / "train.toml")
    train(cfg, root / "model.ckpt", max_steps=cfg.steps)
    snaps = {}
    for kind in ("mlp", "mol", "listwise"):
        pcfg = PublishConfig(checkpoint=str(root / "model.ckpt"), overarch=kind, value_model=FORMULA, k0=K0,
                             candidates=CANDIDATES, nlist=NLIST, nprobe=NLIST, overfetch=len(movies),
                             quantize="none", filter_template=TEMPLATE, torchscript=kind == "mol")
        snaps[kind] = publish_rec(pcfg, root / f"snap-{kind}")
    arch = {k: v["config"] for k, v in torch.load(root / "model.ckpt", weights_only=False)["overarch"].items()}
    return {"snaps": snaps, "movies": movies, "ratings": ratings, "fav": fav, "overarch_config": arch}


def requests_for(setup) -> list[dict]:
    """A batch of requests: stored users with their feature, with and without the request filter;
    sent histories with exclude ids; a user whose feature value is no genre (the template matches
    nothing: no results)."""
    ratings, fav = setup["ratings"], setup["fav"]
    users = sorted(ratings)[::41]  # 15 users spread over the ids
    out = []
    for j, u in enumerate(users):
        r = {"user_id": u, "features": {"fav_genres": fav[u]}}
        out.append(r if j % 2 else {**r, "filter": REQUEST_FILTER})
    rng = np.random.default_rng(0)
    for u in users[:4]:
        history = [m for _, m in sorted(ratings[u])][-12:]
        pool = sorted(setup["movies"])
        out.append({"history": history, "features": {"fav_genres": fav[u]},
                    "exclude": [int(x) for x in rng.choice(pool, 30, replace=False)]})
    out.append({"user_id": users[0], "features": {"fav_genres": ["Noir-ish"]}})  # no genre: nothing passes
    return out


# ------------------------------------------------------------------------------------------ reference


class Published:
    """What a snapshot publishes, as float64 numpy: tensors by name suffix, side files, manifest."""

    def __init__(self, path: Path):
        self.config = json.loads((path / "manifest.json").read_text())["config"]
        program = torch.export.load(path / "model.pt2")
        self.tensors = {**dict(program.state_dict), **dict(program.constants)}
        with np.load(path / "items.npz") as f:
            self.row_to_item = f["row_to_item"].astype(np.int64)
        with np.load(path / "users.npz") as f:
            self.users = {k: f[k] for k in f.files}
        self.row_of = {int(i): r for r, i in enumerate(self.row_to_item)}

    def tensor(self, suffix: str) -> np.ndarray:
        """The one published tensor whose name ends with `suffix` (names of one shared tensor count
        once), as float64 (int64 for integers)."""
        hits = [n for n in self.tensors if isinstance(self.tensors[n], torch.Tensor)
                and (n == suffix or n.endswith("." + suffix))]
        assert len({self.tensors[n].data_ptr() for n in hits}) == 1, \
            f"tensor {suffix!r}: {hits or 'none'} in {sorted(self.tensors)}"
        t = self.tensors[hits[0]].detach()
        return t.to(torch.float64).numpy() if t.is_floating_point() else t.to(torch.int64).numpy()

    def history_ids(self, user_id: int) -> list[int]:
        u = self.users
        pos = int(np.flatnonzero(u["user_ids"] == user_id)[0])
        return [int(x) for x in u["item_ids"][u["offsets"][pos]:u["offsets"][pos + 1]]]


def normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def relu(x):
    return np.maximum(x, 0.0)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def gelu(x):
    from math import erf, sqrt

    return 0.5 * x * (1.0 + np.vectorize(erf)(x / sqrt(2.0)))


def layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def user_embeddings(pub: Published, movies: dict, history_ids: list[int], features: dict) -> np.ndarray:
    """The user tower: float64 [T, D], unit rows."""
    spec = pub.config["user_features"]
    item_vocabs, user_vocabs = dict(spec["item_vocabs"]), dict(spec["user_vocabs"])
    hist = [pub.row_of[i] for i in history_ids][-spec["history_len"]:]
    recent = hist[-spec["recent_len"]:]

    def mean_rows(table: np.ndarray, idx: list[int]) -> np.ndarray:
        return table[idx].mean(axis=0) if idx else np.zeros(table.shape[1])

    parts = [mean_rows(pub.tensor("embedding_bags.item.weight"), hist),
             mean_rows(pub.tensor("embedding_bags.item.weight"), recent)]
    for f, vocab in item_vocabs.items():
        code = {v: i + 1 for i, v in enumerate(vocab)}
        codes = []
        for r in hist:
            genres, decade = movies[int(pub.row_to_item[r])]
            codes += [code.get(v, 0) for v in (sorted(genres) if f == "genre" else [decade])]
        parts.append(mean_rows(pub.tensor(f"embedding_bags.item_{f}.weight"), codes))
    for g, vocab in user_vocabs.items():
        code = {v: i + 1 for i, v in enumerate(vocab)}
        raw = features.get(g, [])
        parts.append(mean_rows(pub.tensor(f"embedding_bags.user_{g}.weight"), [code.get(v, 0) for v in raw]))
    x = np.concatenate(parts + [np.array([np.log1p(len(history_ids))])])
    layer = 0
    while any(n.endswith(f"user_tower.mlp.{layer}.weight") for n in pub.tensors):
        x = relu(pub.tensor(f"user_tower.mlp.{layer}.weight") @ x + pub.tensor(f"user_tower.mlp.{layer}.bias"))
        layer += 2  # Linear, ReLU, Linear, ...
    u = pub.tensor("user_tower.heads.weight") @ x + pub.tensor("user_tower.heads.bias")
    return normalize(u.reshape(len(TASKS), -1))


def passes(movie: tuple, request_filter, fav: list[str]) -> bool:
    """The request's filter AND the template's genre term (its history term is the exclusions)."""
    genres, decade = movie
    if not genres & set(fav):
        return False
    if request_filter is None:
        return True
    assert request_filter == REQUEST_FILTER
    return "Comedy" in genres and decade != "1990s"


def overarch_scores(pub: Published, kind: str, cfg: dict, u: np.ndarray, v: np.ndarray, f: np.ndarray) -> np.ndarray:
    """The OverArch of `kind` with constructor arguments `cfg` (the checkpoint's): user [T, D], the
    candidates' embeddings [C, D] and features [C, F] -> [C, T]."""
    t = lambda name: pub.tensor(f"overarch.{name}")  # noqa: E731
    T, D = u.shape
    dot = (v @ u.T) * t("dot_scale")  # [C, T]
    if kind == "mlp":
        out = np.zeros((v.shape[0], T))
        for j in range(T):
            x = np.concatenate([np.repeat(u[j][None], len(v), 0), v, u[j] * v, f], axis=1)
            h = relu(x @ t("first.weight").T + t("first.bias"))
            layer = 0
            while any(n.endswith(f"overarch.rest.{layer}.weight") for n in pub.tensors):
                h = relu(h @ t(f"rest.{layer}.weight").T + t(f"rest.{layer}.bias"))
                layer += 1
            out[:, j] = h @ t("head_weight")[j] + t("head_bias")[j]
        return out + dot
    if kind == "mol":
        pq_, px, c = cfg["p_q"], cfg["p_x"], cfg["comp_dim"]
        x = normalize((v @ t("item_proj.weight").T + t("item_proj.bias")).reshape(len(v), px, c))  # [C, px, c]
        w = t("gate_in.weight")
        out = np.zeros((v.shape[0], T))
        for j in range(T):
            q = normalize((t("user_weight")[j] @ u[j] + t("user_bias")[j]).reshape(pq_, c))  # [pq, c]
            logits = np.einsum("ic,kjc->kij", q, x).reshape(len(v), pq_ * px)  # i-major
            z = np.concatenate([np.repeat(u[j][None], len(v), 0), v, f, logits], axis=1)
            h = silu(z @ w.T + t("gate_in.bias"))
            pi = softmax(h @ t("gate_weight")[j].T + t("gate_bias")[j])
            out[:, j] = min(np.exp(t("log_scale")[j]), 100.0) * (pi * logits).sum(1)
        return out + dot
    assert kind == "listwise"
    heads = cfg["heads"]
    s = np.concatenate([u @ t("user_in.weight").T + t("user_in.bias") + t("task_token"),
                        np.concatenate([v, f], 1) @ t("item_in.weight").T + t("item_in.bias")])  # [T + C, M]
    for b in range(cfg["layers"]):
        p = lambda name: t(f"blocks.{b}.{name}")  # noqa: E731
        y = layer_norm(s, p("norm1.weight"), p("norm1.bias"))
        qkv = (y @ p("qkv.weight").T + p("qkv.bias")).reshape(len(s), 3, heads, -1)
        q, k_, val = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [S, H, d]
        att = softmax(np.einsum("shd,thd->hst", q, k_) / np.sqrt(q.shape[-1]))  # every token is valid here
        a = np.einsum("hst,thd->shd", att, val).reshape(len(s), -1)
        s = s + a @ p("proj.weight").T + p("proj.bias")
        y = layer_norm(s, p("norm2.weight"), p("norm2.bias"))
        s = s + gelu(y @ p("ffn_in.weight").T + p("ffn_in.bias")) @ p("ffn_out.weight").T + p("ffn_out.bias")
    h = layer_norm(s[T:], t("out_norm.weight"), t("out_norm.bias"))
    return h @ t("head_weight").T + t("head_bias") + dot


def value_of(task_scores: np.ndarray, feats: np.ndarray, feature_names: list[str]) -> np.ndarray:
    """FORMULA, written out: interacted + 0.5 liked + 0.3 sigmoid(log_count)."""
    log_count = feats[:, feature_names.index("log_count")]
    return task_scores[:, 0] + 0.5 * task_scores[:, 1] + 0.3 * sigmoid(log_count)


def merge_rank_by_rank(lists: list[list[int]], cap: int) -> tuple[list[int], list[int]]:
    """Rows taken rank by rank across the tasks' lists, each once, the first `cap` -> (rows, the
    position in each list where the cap cut it)."""
    out, seen, cut = [], set(), [len(x) for x in lists]
    for i in range(max(len(x) for x in lists)):
        for t, rows in enumerate(lists):
            if i < len(rows) and rows[i] not in seen:
                if len(out) == cap:
                    cut[t] = min(cut[t], i)
                    continue
                seen.add(rows[i])
                out.append(rows[i])
    return out, cut


def reference_recommend(pub: Published, kind: str, arch_config: dict, movies: dict, request: dict, k: int):
    """-> (item ids, values, task scores [n, T]) of the top-k, best first, or None where the
    candidate set hangs on a near tie (module docstring)."""
    history = pub.history_ids(request["user_id"]) if "user_id" in request else list(request["history"])
    features = request.get("features", {})
    u = user_embeddings(pub, movies, history, features)
    excluded = {pub.row_of[i] for i in history} | {pub.row_of[i] for i in request.get("exclude", [])}
    fav = list(features.get("fav_genres", []))
    rows = np.array([r for r in range(len(pub.row_to_item)) if r not in excluded
                     and passes(movies[int(pub.row_to_item[r])], request.get("filter"), fav)], dtype=np.int64)
    if rows.size == 0:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros((0, len(TASKS)))
    emb = pub.tensor("cache.emb")
    exact = emb[rows] @ u.T  # [P, T]
    lists, gaps = [], []
    for j in range(len(TASKS)):
        order = np.argsort(-exact[:, j], kind="stable")
        lists.append(rows[order[:K0]].tolist())
        gaps.append(-np.diff(exact[order, j]))  # gap i: between positions i and i + 1
    cand, cut = merge_rank_by_rank(lists, CANDIDATES)
    for j in range(len(TASKS)):  # the k0 cut and the cap's cut must not fall on a near tie
        for i in {K0 - 1, cut[j] - 1}:
            if 0 <= i < len(gaps[j]) and gaps[j][i] < RESCORE_TIE:
                return None
    cand = np.asarray(cand, dtype=np.int64)
    feats = pub.tensor("cache.feats")[cand]
    tasks = overarch_scores(pub, kind, arch_config, u, emb[cand], feats)
    value = value_of(tasks, feats, pub.config["item_feature_names"])
    order = np.argsort(-value, kind="stable")[:k]
    return pub.row_to_item[cand[order]], value[order], tasks[order]


# ------------------------------------------------------------------------------------------ tests


def close(a, b) -> np.ndarray:
    return np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) <= ATOL + RTOL * np.abs(np.asarray(b, np.float64))


@pytest.mark.parametrize("kind", ["mlp", "mol", "listwise"])
def test_recommend_equals_the_float_reference(setup, kind):
    import silverrec

    path = setup["snaps"][kind]
    pub = Published(path)
    assert pub.config["spec"]["overarch"] == kind and pub.config["default_nprobe"] == NLIST
    requests = requests_for(setup)
    backends = ["export", "torchscript"] if kind == "mol" else ["export"]
    answers = {b: silverrec.load(path, backend=b).recommend(requests, k=K, nprobe=NLIST, max_probe=NLIST)
               for b in backends}
    compared = 0
    for b, req in enumerate(requests):
        ref = reference_recommend(pub, kind, setup["overarch_config"][kind], setup["movies"], req, K)
        if ref is None:
            continue
        compared += 1
        ids, values, tasks = ref
        n = len(ids)
        for backend, got in answers.items():
            where = f"{kind}/{backend}: request {b} {req}"
            got_ids, got_scores = got.item_ids[b].numpy(), got.scores[b].numpy()
            assert (got_ids[n:] == -1).all() and np.isneginf(got_scores[n:]).all(), f"{where}: more than {n} results"
            assert (got_ids[:n] >= 0).all(), f"{where}: fewer than {n} results"
            assert close(got_scores[:n], values).all(), f"{where}: scores {got_scores[:n]} vs reference {values}"
            ref_value = dict(zip(ids.tolist(), values.tolist()))
            ref_tasks = dict(zip(ids.tolist(), tasks.tolist()))
            for i, item in enumerate(got_ids[:n].tolist()):
                if item not in ref_value:  # only a near tie at the k-th value may bring in another item
                    assert close(got_scores[i], values[-1]), f"{where}: item {item} is not in the reference's top {n}"
                    continue
                assert close(got_scores[i], ref_value[item]), f"{where}: item {item} scored {got_scores[i]}, reference {ref_value[item]}"
                assert close(got.task_scores[b, i].numpy(), ref_tasks[item]).all(), f"{where}: item {item} task scores"
    assert compared >= len(requests) - 3, f"only {compared} of {len(requests)} requests free of near ties"


def test_the_reference_reads_what_the_snapshot_stores(setup):
    """The reference's inputs are the real data: the stored histories are the MovieLens users' rated
    movies (all but the held-out last)."""
    pub = Published(setup["snaps"]["mol"])
    ratings = setup["ratings"]
    for u in sorted(ratings)[::97]:
        stored = pub.history_ids(u)
        rated = {m for _, m in ratings[u]}
        assert set(stored) <= rated and len(stored) == len(ratings[u]) - 1
