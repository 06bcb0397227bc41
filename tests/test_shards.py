"""Sharded snapshots in one process: publish, verification, exact merge against brute force.

References are independent of the code under test: numpy integer brute force over the pool's
embeddings and queries quantised here (`reference_scores`), filters
evaluated here on the pool's Python value lists, and recall against float64 exact top-k.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import silverrec
from silverrec.errors import PoolError, SilverrecError
from silverrec.publish.filtered_ivf import publish_index
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool, write_pool
from silverrec.publish.shards import ShardSpec, clusters_to_shards, hash_items, publish_sharded
from silverrec.serving.sharded import ShardedSnapshot, ShardVerificationError
from tests.helpers import check_rescored_topk, inner_product_topk, load_ann, recall, run_cli

N, D, NLIST = 3001, 24, 40
GENRES = ["a", "b", "c", "d"]


def make_pool(seed: int = 0) -> Pool:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((30, D)).astype(np.float32) * 2
    emb = centers[rng.integers(0, 30, N)] + rng.standard_normal((N, D)).astype(np.float32)
    ids = rng.permutation(10**7)[:N].astype(np.int64) * 7 + 3  # sparse, unordered external ids
    genre = [[g] for g in rng.choice(GENRES, N)]
    tag = [[f"t{t}" for t in sorted(set(rng.integers(0, 60, rng.integers(0, 3)).tolist()))] for _ in range(N)]
    return Pool(ids, emb, {"genre": genre, "tag": tag})


def matches(pool: Pool, filt) -> np.ndarray:
    """bool [N]: this test's own evaluation of the few filters used below."""
    g = np.array([v[0] for v in pool.features["genre"]])
    tags = pool.features["tag"]
    if filt is None:
        return np.ones(N, dtype=bool)
    if filt == "genre = a AND NOT tag = t3":
        return (g == "a") & np.array(["t3" not in t for t in tags])
    if filt == "tag = t5":
        return np.array(["t5" in t for t in tags])
    if filt == "genre IN (b, c) OR tag = t7":
        return np.isin(g, ["b", "c"]) | np.array(["t7" in t for t in tags])
    raise AssertionError(filt)


def reference_scores(queries: np.ndarray, x: np.ndarray, per_dim: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Brute force as the int8 index defines it, written out here: items through min/max int8
    quantisation (global, or per dimension with the scale folded into the query), queries through
    symmetric per-row int8 quantisation. -> (integer dot products int64 [B, N] that rank the scan,
    float64 [B, N] the float query on the decoded codes, which rank its top rows, float64 [B, N]
    the scan's dequantised scores)."""
    f32 = np.float32
    lo = x.min(axis=0) if per_dim else x.min()
    hi = x.max(axis=0) if per_dim else x.max()
    scale = np.maximum((hi - lo) / f32(255.0), f32(1e-12)).astype(f32)
    offset = (lo + f32(128.0) * scale).astype(f32)
    codes = np.clip(np.round((x - offset) / scale), -128, 127).astype(np.int64)
    q = (queries * scale).astype(f32) if per_dim else queries
    qscale = np.maximum(np.abs(q).max(axis=1), f32(1e-30)) / f32(127.0)
    qcodes = np.clip(np.round(q / qscale[:, None]), -127, 127).astype(np.int64)
    ints = qcodes @ codes.T
    if per_dim:
        approx = ints * qscale[:, None].astype(np.float64) + (queries.astype(np.float64) @ offset.astype(np.float64))[:, None]
    else:
        approx = ints * (qscale[:, None].astype(np.float64) * float(scale)) + float(offset) * queries.astype(np.float64).sum(1)[:, None]
    decoded = codes * np.asarray(scale, np.float64) + np.asarray(offset, np.float64)
    return ints, queries.astype(np.float64) @ decoded.T, approx


def check_topk(ids, scores, ref: tuple[np.ndarray, np.ndarray, np.ndarray], item_ids: np.ndarray, allowed: np.ndarray,
               k: int):
    """`check_rescored_topk` (tests/helpers.py) with `reference_scores`'s (ints, floats, scan scores)."""
    ints, floats, approx = ref
    check_rescored_topk(ids, scores, ints, floats, item_ids, allowed, k, approx)


@pytest.fixture(scope="module")
def snaps(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    pool = make_pool()
    cfg = IVFConfig(nlist=NLIST, seed=0, residual=False)
    out = {"pool": pool, "root": root}
    out["exact"] = silverrec.load(publish_index(pool, root / "exact", exact=True, config=IVFConfig(residual=False)))
    out["exact2"] = silverrec.load(publish_sharded(pool, root / "exact2", spec=ShardSpec(2, "items"), config=IVFConfig(nlist=1, residual=False)))
    out["fivf"] = silverrec.load(publish_index(pool, root / "fivf", config=cfg))
    for by in ("items", "clusters"):
        out[f"fivf2_{by}"] = silverrec.load(
            publish_sharded(pool, root / f"fivf2_{by}", spec=ShardSpec(2, by), config=cfg))
    return out


def test_top_manifest_and_shards_load_alone(snaps):
    s = snaps["fivf2_items"]
    assert isinstance(s, ShardedSnapshot) and s.kind == "rec"
    top = json.loads((s.path / "manifest.json").read_text())
    assert top["kind"] == "sharded" and top["item_count"] == N
    assert sum(m["item_count"] for m in top["config"]["shards"]) == N
    seen = []
    for meta in top["config"]["shards"]:
        alone = silverrec.load(s.path / meta["dir"])  # an ordinary snapshot, verified alone
        assert alone.kind == "rec" and alone.config["shard"]["version"] == top["config"]["version"]
        q = np.zeros((1, D), np.float32)
        seen += alone.search(q, alone.manifest["item_count"], mode="unprobed", filter="genre IN (a, b, c, d)").item_ids[0].tolist()
    # every item on exactly one shard (ids map back to the pool's ids)
    with_genre = snaps["pool"].item_ids
    assert sorted(seen) == sorted(with_genre.tolist())


@pytest.mark.parametrize("k", [1, 17, 100, 2000])  # 2000 > either shard's items
def test_sharded_exact_equals_brute_force_and_unsharded(snaps, k):
    pool = snaps["pool"]
    q = np.random.default_rng(k).standard_normal((7, D)).astype(np.float32)
    ref = reference_scores(q, pool.embeddings, per_dim=True)
    allowed = np.ones((7, N), dtype=bool)
    sharded = snaps["exact2"].search(q, k)
    check_topk(sharded.item_ids.numpy(), sharded.scores.numpy(), ref, pool.item_ids, allowed, k)
    plain = snaps["exact"].search(q, k)
    np.testing.assert_array_equal(sharded.scores.numpy(), plain.scores.numpy())


@pytest.mark.parametrize("by", ["items", "clusters"])
@pytest.mark.parametrize("k", [1, 10, 300])
def test_sharded_filtered_exact_mode_equals_brute_force(snaps, by, k):
    """Unprobed mode (filter over the whole pool, exact scan; verified on exact planes) with one
    filter per query row, None included: sharded == brute force == unsharded."""
    pool = snaps["pool"]
    filters = ["genre = a AND NOT tag = t3", None, "tag = t5", "genre IN (b, c) OR tag = t7"]
    q = np.random.default_rng(k).standard_normal((4, D)).astype(np.float32)
    ref = reference_scores(q, pool.embeddings, per_dim=True)
    allowed = np.stack([matches(pool, f) for f in filters])
    opts = dict(filter=filters, mode="unprobed")
    sharded = snaps[f"fivf2_{by}"].search(q, k, **opts)
    check_topk(sharded.item_ids.numpy(), sharded.scores.numpy(), ref, pool.item_ids, allowed, k)
    plain = snaps["fivf"].search(q, k, **opts)
    np.testing.assert_allclose(sharded.scores.numpy(), plain.scores.numpy(), atol=1e-5)


@pytest.mark.parametrize("by", ["items", "clusters"])
def test_sharded_probed_ivf_scores_equal_unsharded(snaps, by):
    """Same centroids and ranges on every shard: probed search returns the unsharded scores."""
    q = np.random.default_rng(1).standard_normal((16, D)).astype(np.float32)
    for opts in (dict(nprobe=3), dict(nprobe=5, filter="tag = t5", mode="probed")):
        a = snaps[f"fivf2_{by}"].search(q, 50, **opts)
        b = snaps["fivf"].search(q, 50, **opts)
        np.testing.assert_allclose(a.scores.numpy(), b.scores.numpy(), atol=1e-5)


@pytest.mark.parametrize("by", ["items", "clusters"])
def test_ivf_recall_within_0005_of_unsharded(tmp_path, by):
    base, queries = load_ann("bigann10k")
    base, queries = base[:6000] / 100.0, queries[:60] / 100.0
    pool = Pool(np.arange(6000, dtype=np.int64) * 3 + 1, base)
    cfg = IVFConfig(nlist=64, seed=0, residual=False)
    plain = silverrec.load(publish_index(pool, tmp_path / "u", config=cfg, torchscript=False))
    sharded = silverrec.load(publish_sharded(pool, tmp_path / "s", spec=ShardSpec(2, by), config=cfg,
                                             torchscript=False))
    truth = pool.item_ids[inner_product_topk(base, queries, 10)]
    for nprobe in (2, 8):
        r_plain = recall(plain.search(queries, 10, nprobe=nprobe).item_ids.numpy(), truth)
        r_shard = recall(sharded.search(queries, 10, nprobe=nprobe).item_ids.numpy(), truth)
        assert abs(r_plain - r_shard) <= 0.005, (nprobe, r_plain, r_shard)
        assert r_shard > 0.3  # the probe does real work


def test_corrupt_shard_refused(snaps, tmp_path):
    src = snaps["fivf2_items"].path
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    model = bad / "shard-00001" / "model.pt2"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    with pytest.raises(ShardVerificationError, match=r"shard 1 .*checksum mismatch"):
        silverrec.load(bad)
    # a shard manifest swapped for another version's is caught by the top manifest's checksum
    shutil.rmtree(bad)
    shutil.copytree(src, bad)
    shutil.copy(snaps["fivf2_clusters"].path / "shard-00000" / "manifest.json", bad / "shard-00000" / "manifest.json")
    with pytest.raises(ShardVerificationError, match="shard-00000/manifest.json"):
        silverrec.load(bad)


def test_split_helpers():
    ids = np.arange(100_000, dtype=np.int64)
    counts = np.bincount(hash_items(ids, 4), minlength=4)
    assert counts.min() > 0.95 * 25_000  # hashing balances consecutive ids
    sizes = np.array([50, 10, 40, 30, 20, 5])
    owner = clusters_to_shards(sizes, 2)
    loads = np.bincount(owner, weights=sizes, minlength=2)
    assert abs(loads[0] - loads[1]) <= 5


def test_named_errors(snaps, tmp_path):
    pool = snaps["pool"]
    with pytest.raises(PoolError, match="shards must be a positive int"):
        ShardSpec(0)
    with pytest.raises(PoolError, match="shard_by must be one of"):
        ShardSpec(2, "rows")
    with pytest.raises(PoolError, match="exact index has one cluster"):
        publish_sharded(pool, tmp_path / "x", spec=ShardSpec(2, "clusters"), config=IVFConfig(nlist=1, residual=False))
    with pytest.raises(PoolError, match="at least one cluster per shard"):
        publish_sharded(pool, tmp_path / "x", spec=ShardSpec(5, "clusters"), config=IVFConfig(nlist=4))
    with pytest.raises(PoolError, match="already exists"):
        publish_sharded(pool, snaps["exact2"].path, spec=ShardSpec(2), config=IVFConfig(nlist=1, residual=False))
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp-*"))
    with pytest.raises(SilverrecError, match="k=3002 exceeds"):
        snaps["exact2"].search(np.zeros((1, D), np.float32), N + 1)
    with pytest.raises(SilverrecError, match="dimension 3"):
        snaps["exact2"].search(np.zeros((1, 3), np.float32), 5)


def test_cli_publish_and_query(tmp_path):
    rng = np.random.default_rng(3)
    emb = rng.standard_normal((500, 8)).astype(np.float32)
    write_pool(tmp_path / "pool.parquet", np.arange(500) * 11, emb)
    np.save(tmp_path / "q.npy", emb[:3])
    run_cli("publish", "--pool", str(tmp_path / "pool.parquet"), "--out", str(tmp_path / "s"), "--shards", "2",
            "--nlist", "8", "--residual", "off")
    out = run_cli("query", str(tmp_path / "s"), "--queries", str(tmp_path / "q.npy"), "--k", "5", "--nprobe", "8", "--json")
    ids = np.array(json.loads(out.stdout)["item_ids"])
    truth = (np.arange(500) * 11)[inner_product_topk(emb, emb[:3], 5)]
    assert recall(ids, truth) >= 0.8  # full probe, int8 codes
    bad = run_cli("publish", "--pool", str(tmp_path / "pool.parquet"), "--out", str(tmp_path / "t"), "--shard-by",
                  "items", check=False)
    assert bad.returncode == 2 and "--shard-by needs --shards" in bad.stderr
