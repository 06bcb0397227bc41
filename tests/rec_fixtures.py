"""One tiny trained and published recommendation model, shared by test_rec_model.py and test_recommend.py.

Synthetic logs with a planted structure (generated here, so the tests know the truth without
asking the code under test): 300 items in 6 categories (`cat`, single-valued) with 1-3 tags each
(`tags`, multi-valued); 80 users with 10-40 distinct interactions, 90% of them in the user's
preferred category (user index % 6), rated 4-5 there and 1-3 elsewhere. Item ids and user ids are
not row numbers (ids = offsets * primes) so that an id/row mix-up shows.

`rec_setup(tmp_path_factory)` trains once (two-tower 15 steps, MoL OverArch 5 steps), publishes
once, keeps the in-process composition that publish wrote (`Built`, the eager reference), and
caches all of it for the session: both test modules call it from a module-scoped fixture, and each still works alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

N_ITEMS = 300
N_USERS = 80
N_CATS = 6
N_TAGS = 8
K0 = 20
NLIST = 8
TASKS = ["interacted", "liked"]
# a value model that reads an item feature too (the cache's bf16 `log_count` column)
FORMULA = {"add": [{"weights": {"interacted": 1.0, "liked": 0.5}}, {"mul": [0.25, {"sigmoid": "feature:log_count"}]}]}
TRAIN_STEPS = 15  # two-tower steps (HR@10 ~0.28 against ~0.04 for a random ranking)
OVERARCH_STEPS = 5  # the tests check how the OverArch is composed, not how good it is

TRAIN_TOML = """\
interactions = "interactions.parquet"
items = "items.parquet"
user_tower = "bag"           # the pooled tower: these tests check its TorchRec tables and int8 path
dim = 16
batch = 64
negatives = 64
lr = 0.005
k0 = {k0}
steps = {steps}               # fixed step counts, not time budgets: the same model on a busy machine
overarch_steps = {overarch_steps}
overarch = ["mol"]

[[tasks]]
name = "interacted"

[[tasks]]
name = "liked"
label = "rating"
min = 4.0
"""


@dataclass
class SyntheticLogs:
    item_ids: np.ndarray  # int64 [N], items.parquet order (= pool rows)
    cat: np.ndarray  # int64 [N] category index of each item
    features: dict[str, list[list[str]]]  # per pool row
    user_ids: np.ndarray  # int64 [U]
    prefs: np.ndarray  # int64 [U] preferred category
    events: dict[int, list[int]] = field(default_factory=dict)  # user id -> item ids in time order
    ratings: dict[int, list[float]] = field(default_factory=dict)

    def history(self, user_id: int) -> list[int]:
        """What the snapshot stores for a user at stage "test": everything but the last interaction."""
        return self.events[int(user_id)][:-1]

    def target(self, user_id: int) -> int:
        return self.events[int(user_id)][-1]


def make_logs(seed: int = 0) -> SyntheticLogs:
    rng = np.random.default_rng(seed)
    item_ids = (1000 + 7 * rng.permutation(N_ITEMS)).astype(np.int64)  # file order != id order
    cat = rng.integers(0, N_CATS, N_ITEMS)
    tags = [sorted({f"t{x}" for x in rng.choice(N_TAGS, rng.integers(1, 4), replace=False)}) for _ in range(N_ITEMS)]
    features = {"cat": [[f"c{c}"] for c in cat], "tags": tags}
    user_ids = (500 + 3 * np.arange(N_USERS)).astype(np.int64)
    prefs = np.arange(N_USERS) % N_CATS
    logs = SyntheticLogs(item_ids, cat, features, user_ids, prefs)
    for u, uid in enumerate(user_ids):
        n = int(rng.integers(10, 41))
        inside = np.flatnonzero(cat == prefs[u])
        outside = np.flatnonzero(cat != prefs[u])
        n_in = min(len(inside), int(round(0.9 * n)))
        rows = np.concatenate([rng.choice(inside, n_in, replace=False), rng.choice(outside, n - n_in, replace=False)])
        rng.shuffle(rows)
        logs.events[int(uid)] = [int(item_ids[r]) for r in rows]
        logs.ratings[int(uid)] = [float(rng.integers(4, 6) if cat[r] == prefs[u] else rng.integers(1, 4)) for r in rows]
    return logs


def write_logs(logs: SyntheticLogs, out: Path, drop_label: bool = False) -> tuple[Path, Path]:
    """items.parquet and interactions.parquet (rows in a shuffled order; timestamps give the time order)."""
    out.mkdir(parents=True, exist_ok=True)
    items_path, inter_path = out / "items.parquet", out / "interactions.parquet"
    pq.write_table(pa.table({
        "item_id": pa.array(logs.item_ids, pa.int64()),
        "cat": pa.array([v[0] for v in logs.features["cat"]], pa.string()),
        "tags": pa.array(logs.features["tags"], pa.list_(pa.string())),
    }), items_path)
    uid, iid, ts, rating = [], [], [], []
    for u, items in logs.events.items():
        for j, i in enumerate(items):
            uid.append(u)
            iid.append(i)
            ts.append(1_000_000 + 60 * j)
            rating.append(logs.ratings[u][j])
    order = np.random.default_rng(1).permutation(len(uid))
    cols = {
        "user_id": pa.array(np.asarray(uid)[order], pa.int64()),
        "item_id": pa.array(np.asarray(iid)[order], pa.int64()),
        "timestamp": pa.array(np.asarray(ts)[order], pa.int64()),
        "rating": pa.array(np.asarray(rating, dtype=np.float32)[order], pa.float32()),
    }
    if drop_label:
        del cols["rating"]
    pq.write_table(pa.table(cols), inter_path)
    return inter_path, items_path


@dataclass
class RecSetup:
    root: Path
    logs: SyntheticLogs
    inter_path: Path
    items_path: Path
    train_toml: Path
    train_cfg: Any  # TrainConfig
    ckpt_path: Path
    ckpt: dict
    publish_cfg: Any  # PublishConfig
    snap_dir: Path
    built: Any  # publish.rec.Built (the eager model, same weights as the snapshot)
    _snaps: dict = field(default_factory=dict)

    def snap(self, backend: str = "export"):
        """The published snapshot, loaded once per backend."""
        import silverrec

        if backend not in self._snaps:
            self._snaps[backend] = silverrec.load(self.snap_dir, backend=backend)
        return self._snaps[backend]


_CACHE: dict[str, RecSetup] = {}


def publish_keeping_model(cfg, out: Path):
    """publish_rec(cfg, out) -> (snapshot dir, the `Built` it composed): that very composition is
    the eager reference (publish makes measured choices, so a second build need not be equal)."""
    import silverrec.publish.rec as rec_module
    from silverrec.publish.rec import build_rec_model, publish_rec

    built = []

    def capture(*args, **kwargs):
        built.append(build_rec_model(*args, **kwargs))
        return built[-1]

    rec_module.build_rec_model = capture
    try:
        snap_dir = publish_rec(cfg, out)
    finally:
        rec_module.build_rec_model = build_rec_model
    assert len(built) == 1
    return snap_dir, built[0]


def rec_setup(tmp_path_factory) -> RecSetup:
    if "setup" in _CACHE:
        return _CACHE["setup"]
    os.environ.setdefault("SILVERREC_QUIET", "1")
    from silverrec.publish.rec import PublishConfig
    from silverrec.publish.train import TrainConfig, train

    root = tmp_path_factory.mktemp("rec")
    logs = make_logs()
    inter_path, items_path = write_logs(logs, root)
    toml = root / "train.toml"
    toml.write_text(TRAIN_TOML.format(k0=K0, steps=TRAIN_STEPS, overarch_steps=OVERARCH_STEPS))
    cfg = TrainConfig.from_toml(toml)
    ckpt_path = root / "model.ckpt"
    ckpt = train(cfg, ckpt_path, max_steps=TRAIN_STEPS)
    pcfg = PublishConfig(checkpoint=str(ckpt_path), overarch="mol", value_model=FORMULA, k0=K0, nlist=NLIST)
    snap_dir, built = publish_keeping_model(pcfg, root / "snap")
    _CACHE["setup"] = RecSetup(root, logs, inter_path, items_path, toml, cfg, ckpt_path, ckpt, pcfg, snap_dir, built)
    return _CACHE["setup"]
