"""Bring your own model (publish/byo.py): a user's towers and OverArch, published, answer like the
same modules run eagerly; each form loads; an unexportable module gets its named error.

The reference is an independent eager pipeline: the user's tower on hand-built inputs -> brute-force
top-K0 over the item tower's embeddings (history excluded) -> the user's OverArch -> top-k. The pool
is small and nprobe = nlist, so the IVF search is exact. The cache keeps item embeddings in bf16,
so the reference rounds them the same way (the features are multiples of 1/4: exact in bf16).
"""

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.export import Dim

import silverrec
from silverrec.publish.byo import ByoConfig, ByoError, UserModule, publish_byo

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "byo"
sys.path.insert(0, str(EXAMPLE))  # entry points "models:..." import from here
import models  # noqa: E402  (examples/byo/models.py: plain PyTorch, no silverrec)

N, GENRES, DIM, K0, K = 90, ["a", "b", "c", "d", "e"], 8, 12, 5


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("byo"))


def make_world(d: Path) -> dict:
    """Tiny logs in `d`, the user's three modules (random weights) saved in the three forms."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    item_ids = 1000 + 7 * np.arange(N)
    genres = [sorted(set(rng.choice(GENRES, size=rng.integers(1, 3)).tolist())) for _ in range(N)]
    quality = (np.arange(N) % 4) * 0.25
    user = models.UserTower(N, len(GENRES), dim=DIM, hidden=16).eval()
    item = models.ItemTower(N, len(GENRES), dim=DIM, hidden=16).eval()
    arch = models.ListwiseRanker(dim=DIM, feat_dim=1, width=16, heads=2).eval()
    world = {"dir": d, "user": user, "item": item, "arch": arch, "item_ids": item_ids, "genres": genres, "quality": quality}
    emb = item_embeddings(world)  # the `embedding` column: what a config without [item_tower] publishes
    pq.write_table(pa.table({"item_id": pa.array(item_ids, pa.int64()), "genre": pa.array(genres, pa.list_(pa.string())),
                             "quality": pa.array(quality, pa.float32()),
                             "embedding": pa.array(list(emb.numpy()), pa.list_(pa.float32()))}), d / "items.parquet")
    users, items, ts = [], [], []
    for u in range(12):
        picks = rng.choice(N, size=int(rng.integers(3, 9)), replace=False)
        users += [u] * len(picks)
        items += item_ids[picks].tolist()
        ts += list(range(len(picks)))
    pq.write_table(pa.table({"user_id": pa.array(users, pa.int64()), "item_id": pa.array(items, pa.int64()),
                             "timestamp": pa.array(ts, pa.int64())}), d / "interactions.parquet")
    batch = Dim("batch", min=1, max=1 << 16)
    example = encode_user([[1, 2, 3], [4]], genres)
    ep = torch.export.export(user, example, strict=False, dynamic_shapes={
        "values": {0: Dim.DYNAMIC}, "lengths": {0: 3 * batch}, "dense": {0: batch}})
    torch.export.save(ep, d / "user.pt2")
    torch.jit.save(torch.jit.script(user), str(d / "user.ts"))
    torch.save(user.state_dict(), d / "user_state.pt")
    torch.jit.save(torch.jit.script(item), str(d / "item.ts"))
    torch.save(arch.state_dict(), d / "arch_state.pt")
    return world


@torch.no_grad()
def item_embeddings(world) -> torch.Tensor:
    """The item tower over the pool, inputs built by hand: float32 [N, D]."""
    code = {g: i + 1 for i, g in enumerate(GENRES)}
    genres = world["genres"]
    vals = list(range(N)) + [code[g] for r in range(N) for g in genres[r]]
    lens = [1] * N + [len(genres[r]) for r in range(N)]
    return world["item"](torch.tensor(vals), torch.tensor(lens, dtype=torch.int32), torch.zeros(N, 0))


def encode_user(histories, genres):
    """The user tower's inputs by hand: keys hist_item, recent_item (pool rows), hist_genre (codes)."""
    code = {g: i + 1 for i, g in enumerate(GENRES)}
    hist = [list(h)[-50:] for h in histories]
    recent = [h[-5:] for h in hist]
    gen = [[code[g] for r in h for g in genres[r]] for h in hist]
    values = [v for part in (hist, recent, gen) for h in part for v in h]
    lengths = [len(h) for part in (hist, recent, gen) for h in part]
    dense = torch.tensor([[np.log1p(len(h))] for h in histories], dtype=torch.float32)
    return torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int32), dense


def config(world, user: dict, overarch: dict | None, **extra) -> ByoConfig:
    d = world["dir"]
    tower = {"history_len": 50, "recent_len": 5, "item_features": ["genre"], "item_ids": "pool_row"} | user
    return ByoConfig(items=str(d / "items.parquet"), interactions=str(d / "interactions.parquet"),
                     user_tower=tower, item_tower={"path": "item.ts", "item_features": ["genre"], "item_ids": "pool_row",
                                                   "batch": 32},
                     overarch=overarch, item_dense=["quality"], k0=K0, nlist=4, nprobe=4, base=str(d), **extra)


@torch.no_grad()
def eager_top(world, history_rows: list[int], arch=True) -> tuple[np.ndarray, np.ndarray]:
    """The reference pipeline for one user: (item ids [K], scores [K])."""
    emb = item_embeddings(world).to(torch.bfloat16).float()  # as the cache stores it
    u = world["user"](*encode_user([history_rows], world["genres"]))  # [1, D]
    scores = (u @ emb.T)[0]
    scores[history_rows] = float("-inf")
    cand = torch.topk(scores, K0).indices
    if arch:
        feats = torch.from_numpy(world["quality"][cand.numpy()]).float().reshape(1, K0, 1)
        final = world["arch"](u[:, None], emb[cand][None], feats, torch.ones(1, K0, dtype=torch.bool))[0, :, 0]
    else:
        final = scores[cand]
    top = torch.topk(final, K)
    return world["item_ids"][cand[top.indices].numpy()], top.values.numpy()


def check_against_eager(snap, world, arch=True, exclude_history=True):
    rng = np.random.default_rng(1)
    for _ in range(3):
        rows = rng.choice(N, size=int(rng.integers(1, 7)), replace=False).tolist()
        got = snap.recommend({"history": world["item_ids"][rows].tolist()}, k=K, exclude_history=exclude_history)
        ids, scores = eager_top(world, rows, arch)
        np.testing.assert_array_equal(got.item_ids[0].numpy(), ids)
        np.testing.assert_allclose(got.scores[0].numpy(), scores, rtol=1e-4, atol=1e-4)


def test_published_export_program_equals_eager(world, tmp_path):
    """.pt2 user tower, TorchScript item tower, entry-point list-wise OverArch (masked)."""
    arch = {"entry": "models:ListwiseRanker", "args": {"dim": DIM, "feat_dim": 1, "width": 16, "heads": 2},
            "path": "arch_state.pt", "mask": True}
    cfg = config(world, {"path": "user.pt2"}, arch)
    out = publish_byo(cfg, tmp_path / "snap")
    snap = silverrec.load(out)
    m = snap.manifest["config"]
    assert m["spec"]["overarch"] == "listwise"
    assert "torch.export program" in m["torchscript"] and not (out / "model.ts").exists()  # .pt2 does not script
    assert snap.backend == "export"
    check_against_eager(snap, world)


def test_cli_publish_entry_point_and_embedding_column_equal_eager(world, tmp_path):
    """`silverrec publish --config` with an entry-point user tower (state dict), the items file's
    `embedding` column instead of an item tower, no OverArch, a filter template that excludes the
    history (so requests sent with exclude_history=False still match the reference, which
    excludes it): both programs (model.pt2, model.ts)."""
    from silverrec.cli import main

    d = world["dir"]
    (d / "publish.toml").write_text(f"""
items = "items.parquet"
interactions = "interactions.parquet"
item_dense = ["quality"]
k0 = {K0}
nlist = 4
nprobe = 4
filter_template = "NOT item_id IN $history"
[user_tower]
entry = "models:UserTower"
path = "user_state.pt"
args = {{ num_items = {N}, num_values = {len(GENRES)}, dim = {DIM}, hidden = 16 }}
item_features = ["genre"]
item_ids = "pool_row"
""")
    assert main(["publish", "--config", str(d / "publish.toml"), "--out", str(tmp_path / "snap")]) == 0
    out = tmp_path / "snap"
    assert (out / "model.ts").exists()
    for backend in ("export", "torchscript"):
        check_against_eager(silverrec.load(out, backend=backend), world, arch=False, exclude_history=False)


@pytest.mark.parametrize("form", ["pt2", "ts", "entry"])
def test_each_form_loads_and_runs_like_the_module(world, form):
    d = world["dir"]
    spec = {"pt2": UserModule("user tower", path="user.pt2", base=str(d)),
            "ts": UserModule("user tower", path="user.ts", base=str(d)),
            "entry": UserModule("user tower", entry="models:UserTower", path="user_state.pt", base=str(d),
                                args={"num_items": N, "num_values": len(GENRES), "dim": DIM, "hidden": 16})}[form]
    assert spec.form == {"pt2": "export", "ts": "torchscript", "entry": "entry"}[form]
    inputs = encode_user([[3, 1, 4, 1, 5], [9], [2, 6]], world["genres"])
    with torch.no_grad():
        torch.testing.assert_close(spec.load()(*inputs), world["user"](*inputs))


def test_example_attention_block_equals_the_plain_call():
    """examples/byo's Block folds the batch into the heads (export on torch < 2.13): the plain 4-D
    attention with the broadcast mask gives the same tokens."""
    torch.manual_seed(1)
    block = models.Block(8, 2).eval()
    x = torch.randn(3, 5, 8)
    mask = (torch.rand(3, 1, 1, 5) < 0.7) | (torch.arange(5) == 0)
    qkv = block.qkv(block.norm1(x)).reshape(3, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
    a = torch.nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask)
    h = x + block.proj(a.transpose(1, 2).reshape(3, 5, 8))
    with torch.no_grad():
        torch.testing.assert_close(block(x, mask), h + block.ffn(block.norm2(h)))


class DataDependentTower(torch.nn.Module):
    """A user tower torch.export cannot trace: Python control flow on a tensor's value."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.lin = torch.nn.Linear(1, dim)

    def forward(self, values, lengths, dense):
        if values.sum() > 10:  # data-dependent branch
            return self.lin(dense)
        return -self.lin(dense)


class NumpyTower(DataDependentTower):
    """A user tower with an op torch.export cannot trace: a trip through numpy."""

    def forward(self, values, lengths, dense):
        return self.lin(torch.from_numpy(dense.numpy() * 2))


class DataDependentArch(torch.nn.Module):
    """An OverArch that branches on its scores."""

    def forward(self, user, cand, feats):
        scores = torch.bmm(cand, user.transpose(1, 2))
        if scores.max() > 0:
            return scores
        return -scores


@pytest.mark.parametrize("tower, arch, what, line", [
    ("DataDependentTower", None, "user tower", r"if values.sum\(\) > 10:"),
    ("NumpyTower", None, "user tower", r"return self.lin\(torch.from_numpy\(dense.numpy\(\) \* 2\)\)"),
    (None, "DataDependentArch", "OverArch", r"if scores.max\(\) > 0:"),
])
def test_unexportable_module_is_named_and_leaves_nothing(world, tmp_path, tower, arch, what, line):
    user = {"entry": f"tests.test_byo:{tower}"} if tower else {"path": "user.pt2"}
    cfg = config(world, user, {"entry": f"tests.test_byo:{arch}"} if arch else None)
    name = tower or arch
    with pytest.raises(ByoError, match=rf"{what} \(tests.test_byo:{name}.*cannot be exported.*test_byo.py:\d+ `{line}"):
        publish_byo(cfg, tmp_path / "snap")
    assert list(tmp_path.iterdir()) == []


class BatchSpecialisedArch(torch.nn.Module):
    """An OverArch that branches on the batch size (a shape guard, not an untraceable op)."""

    def forward(self, user, cand, feats):
        scores = torch.bmm(cand, user.transpose(1, 2))
        return scores * 2 if user.shape[0] == 1 else scores


def test_batch_specialised_module_is_named_with_the_guard(world, tmp_path):
    cfg = config(world, {"path": "user.pt2"}, {"entry": "tests.test_byo:BatchSpecialisedArch"})
    with pytest.raises(ByoError, match=r"OverArch \(tests.test_byo:BatchSpecialisedArch.*\) cannot be exported with a "
                                       r"dynamic batch: .*Not all values of batch.*torch < 2.13"):
        publish_byo(cfg, tmp_path / "snap")
    assert list(tmp_path.iterdir()) == []


def test_torchscript_user_tower_is_refused_by_name(world, tmp_path):
    """A ScriptModule cannot be traced into model.pt2: named, with what to give instead."""
    with pytest.raises(ByoError, match=r"user tower \(user.ts\) is TorchScript.*\.pt2.*entry point"):
        publish_byo(config(world, {"path": "user.ts"}, None), tmp_path / "snap")
    assert list(tmp_path.iterdir()) == []


def test_wrong_output_shape_is_named(world, tmp_path):
    cfg = config(world, {"entry": "tests.test_byo:DataDependentTower", "args": {"dim": DIM + 1}}, None)
    with pytest.raises(ByoError, match=r"user tower .* returned shape \(\d+, 9\): expected \[B, D\] or \[B, T, D\] with D = 8"):
        publish_byo(cfg, tmp_path / "snap")
    assert list(tmp_path.iterdir()) == []


def test_user_tower_adapter_maps_only_the_item_keys():
    """Canonical rows of hist_item / recent_item go through item_input; feature codes pass unchanged."""
    from silverrec.adapters import UserTowerAdapter

    class Echo(torch.nn.Module):
        def forward(self, values, lengths, dense):
            return values.float()[None]  # [1, nnz] -> the adapter's [1, 1, nnz]

    item_input = torch.tensor([50, 51, 52, 53, 54])
    adapter = UserTowerAdapter(Echo(), item_input)
    # B = 2, keys hist_item [3 | 1], recent_item [2 | 1], hist_genre [4 | 0] (key-major)
    values = torch.tensor([0, 4, 2, 3, 4, 2, 3, 1, 2, 3, 4])
    lengths = torch.tensor([3, 1, 2, 1, 4, 0], dtype=torch.int32)
    got = adapter(values, lengths, torch.zeros(2, 1))[0, 0].long()
    torch.testing.assert_close(got, torch.tensor([50, 54, 52, 53, 54, 52, 53, 1, 2, 3, 4]))


def test_overarch_adapter_item_side_and_single_score_for_every_task():
    from silverrec.adapters import OverArchAdapter

    class Pointwise(torch.nn.Module):
        def forward(self, user, cand, feats):
            return (user[:, :1] * cand).sum(-1) + feats.sum(-1)  # [B, K]

    B, K, T, D, F = 2, 5, 3, 4, 2
    user, cand, feats = torch.randn(B, T, D), torch.randn(B, K, D), torch.randn(B, K, F)
    arch = OverArchAdapter(Pointwise(), D, F, T)
    item = arch.item_side(cand, feats)
    assert arch.item_width == D + F and item.shape == (B, K, D + F)
    got = arch.score(user, cand, item, torch.ones(B, K, dtype=torch.bool))
    want = ((user[:, :1] * cand).sum(-1) + feats.sum(-1))[:, :, None].expand(B, K, T)
    torch.testing.assert_close(got, want)


class FeatureTower(torch.nn.Module):
    """A user tower over every key kind: hist_item, recent_item, hist_genre, user_gender (+ 2 dense)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1100 + N * 7, DIM)
        self.lin = torch.nn.Linear(4 * DIM + 2, DIM)

    def forward(self, values, lengths, dense):
        B = dense.shape[0]
        pooled = models.pool_bags(self.emb(values), lengths).reshape(4, B, DIM)
        return self.lin(torch.cat([pooled[0], pooled[1], pooled[2], pooled[3], dense], dim=1))


def test_user_features_and_numeric_from_the_users_file(world, tmp_path):
    """users.parquet's categorical and numeric columns become user_<g> keys and standardised dense
    columns (vocabulary sorted, mean / std of the users), items arrive as item ids: the published
    tower equals the module on inputs built by hand."""
    from silverrec.publish.byo import build_byo_model

    d = world["dir"]
    pq.write_table(pa.table({"user_id": pa.array(np.arange(12), pa.int64()),
                             "gender": pa.array(["m", "f", "x"] * 4, pa.string()),
                             "age": pa.array(np.arange(12) * 3.0 + 20, pa.float32())}), tmp_path / "users.parquet")
    cfg = config(world, {"entry": "tests.test_byo:FeatureTower", "user_features": ["gender"], "numeric": ["age"],
                         "item_ids": "item_id"}, None, users=str(tmp_path / "users.parquet"))
    built = build_byo_model(cfg)
    spec = built.manifest["user_features"]
    assert dict(spec["user_vocabs"]) == {"gender": ["f", "m", "x"]}
    ages = np.arange(12) * 3.0 + 20
    np.testing.assert_allclose(dict(spec["user_numeric"])["age"], [ages.mean(), ages.std()], rtol=1e-5)
    handler_rows = {int(i): r for r, i in enumerate(built.row_to_item)}
    history = [1000 + 7 * 5, 1000 + 7 * 2]
    from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec

    enc = FeatureEncoder.from_arrays(UserFeatureSpec.from_json(spec), built.item_csr)
    inputs = enc.encode([np.asarray([handler_rows[i] for i in history])], [{"gender": "x"}], [{"age": 41.0}])
    code = {g: i + 1 for i, g in enumerate(GENRES)}
    genre_codes = [code[g] for r in (5, 2) for g in world["genres"][r]]
    values = torch.tensor(history + history + genre_codes + [3])  # items as ids; gender "x" = code 3
    lengths = torch.tensor([2, 2, len(genre_codes), 1], dtype=torch.int32)
    dense = torch.tensor([[np.log1p(2), (41.0 - ages.mean()) / ages.std()]], dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(built.model.user_tower(*inputs)[:, 0], built.model.user_tower.module(values, lengths, dense))


def test_byo_snapshot_loads_and_answers_without_torchrec(world, tmp_path):
    """A team's plain-PyTorch towers need neither torchrec nor fbgemm to load (the GPU machine has
    neither): a fresh process with both imports blocked loads the snapshot and recommends; only
    silverrec's own TorchRec tower needs them (snapshot.needs_torchrec)."""
    import subprocess

    from silverrec.snapshot import needs_torchrec

    out = publish_byo(config(world, {"path": "user.pt2"}, None), tmp_path / "snap")
    assert not needs_torchrec(silverrec.load(out).manifest)
    assert needs_torchrec({"kind": "rec", "config": {"spec": {"tower": "two_tower"}}})
    assert not needs_torchrec({"kind": "rec", "config": {"spec": {"tower": "query"}}})
    history = world["item_ids"][:3].tolist()
    code = ("import sys; sys.modules['torchrec'] = None; sys.modules['fbgemm_gpu'] = None; import silverrec; "
            f"print(silverrec.load({str(out)!r}).recommend({{'history': {history}}}, k={K}).item_ids.tolist())")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    want = silverrec.load(out).recommend({"history": history}, k=K).item_ids.tolist()
    assert got.stdout.strip().splitlines()[-1] == str(want)
