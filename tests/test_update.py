"""Incremental pool updates (publish/update.py) against brute force over the final pool quantised
with the parent's ranges and the exact filter evaluation of its features."""

from pathlib import Path

import numpy as np
import pytest
import torch

import silverrec
from silverrec.errors import PoolError, SnapshotError
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.publish.filtered_ivf import publish_index
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool, write_pool
from silverrec.publish.quantize import quantize_global, quantize_per_dim
from silverrec.publish.update import DeltaError, update_snapshot
from silverrec.snapshot import read_manifest, read_tensors, write_snapshot
from tests.helpers import check_rescored_topk, run_cli

N, D, NLIST = 3000, 20, 12
COLORS = ["red", "green", "blue", "black"]
TAGS = [f"t{i}" for i in range(50)]


def _features(rng, n, colors=COLORS):
    return {
        "color": [[str(rng.choice(colors))] if rng.random() > 0.05 else [] for _ in range(n)],
        "tag": [list(rng.choice(TAGS, size=int(rng.integers(0, 3)), replace=False)) for _ in range(n)],
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Parent pool, a delta (new items, changed items with a never-seen colour, deletes), final pool."""
    rng = np.random.default_rng(7)
    ids = rng.permutation(100_000)[:N].astype(np.int64)
    x = rng.standard_normal((N, D)).astype(np.float32)
    feats = _features(rng, N)
    parent = Pool(ids, x, feats)
    changed = ids[rng.choice(N, 120, replace=False)]
    rest = np.setdiff1d(ids, changed)
    deleted = rng.choice(rest, 90, replace=False)
    new_ids = np.arange(200_000, 200_150, dtype=np.int64)
    up_ids = np.concatenate([changed, new_ids])
    up_x = (1.3 * rng.standard_normal((up_ids.size, D))).astype(np.float32)  # some values clamp
    up_feats = _features(rng, up_ids.size, COLORS + ["violet"])
    for r in range(10):  # changed items moving to a colour the parent never saw
        up_feats["color"][r] = ["violet"]
    # the final pool, in any order: kept parent items + upserted items
    keep = ~np.isin(ids, np.concatenate([changed, deleted]))
    final_ids = np.concatenate([ids[keep], up_ids])
    final_x = np.concatenate([x[keep], up_x])
    final_feats = {f: [v for v, k in zip(feats[f], keep) if k] + up_feats[f] for f in feats}
    d = tmp_path_factory.mktemp("upd")
    write_pool(d / "up.parquet", up_ids, up_x, up_feats)
    (d / "delete.txt").write_text("\n".join(str(int(i)) for i in deleted) + "\n")
    return dict(parent=parent, up=Pool(up_ids, up_x, up_feats), deleted=deleted, changed=changed,
                final=Pool(final_ids, final_x, final_feats), dir=d, rng=rng)


def _codes(x, scale, offset):
    return torch.round((torch.from_numpy(x) - offset) / scale).clamp(-128, 127).to(torch.int64)


def _per_dim(parent_x):
    """Item codes with the parent's per-dimension ranges, the query transform folded into them, and
    the decoded items (float64) that the float re-score reads."""
    _, scale, offset = quantize_per_dim(torch.from_numpy(parent_x))
    return (lambda x: _codes(x, scale, offset)), (lambda q: q * scale), scale.double(), offset.double()


def _global(parent_x):
    _, scale, offset = quantize_global(torch.from_numpy(parent_x))
    return (lambda x: _codes(x, scale, offset)), (lambda q: q), scale.double(), offset.double()


def _reference(final: Pool, quant, queries, k, filt=None):
    """Brute force over the final pool's int8 codes (parent ranges) and int8 queries (per-query
    symmetric, as the scan ops quantise them), with the exact filter: (int scores int64 [Q, N] that
    rank the scan, float64 [Q, N] the float query on the decoded codes, allowed bool [Q, N], float64
    [Q, N] the scan's dequantised scores)."""
    codes_fn, fold, scale, offset = quant
    q = fold(torch.from_numpy(queries).float())
    qs = q.abs().amax(dim=1, keepdim=True) / 127.0
    qc = torch.round(q / qs).clamp(-127, 127).to(torch.int64)
    codes = codes_fn(final.embeddings)
    raw = torch.from_numpy(queries).double()
    floats = raw @ (codes.double() * scale + offset).t()
    allowed = np.ones((queries.shape[0], codes.shape[0]), dtype=bool)
    if filt is not None:
        allowed[:] = ForwardIndex.from_lists(final.features).evaluate(filt)
    ints = qc @ codes.t()
    # the scan's dequantised scores: q ~= qs * qc on the folded query (per dimension: the scale is
    # folded in; global: one scale), plus <q, offset>
    scan = ints.double() * qs.double() * (scale if scale.dim() == 0 else 1.0) + (raw @ offset.expand(raw.shape[1]))[:, None]
    return ints.numpy(), floats.numpy(), allowed, scan.numpy()


def _assert_same(res, ref, final: Pool):
    """The snapshot's answer is the re-scored exact search over the final pool (`check_rescored_topk`)."""
    ints, floats, allowed, scan = ref
    check_rescored_topk(res.item_ids.numpy(), res.scores.numpy(), ints, floats, final.item_ids, allowed,
                        res.item_ids.shape[1], scan)


FILTERS = [None, "color = violet", "color = red", "NOT color = red AND tag IN (t3, t4, t5)", "tag = t7 OR color = violet",
           "NOT tag = t1"]


def test_filtered_update_equals_brute_force_with_filters(world, tmp_path):
    parent = publish_index(world["parent"], tmp_path / "v1", config=IVFConfig(nlist=NLIST, residual=False), torchscript=False)
    v2 = update_snapshot(parent, tmp_path / "v2", upsert=world["dir"] / "up.parquet", delete=world["dir"] / "delete.txt")
    snap = silverrec.load(v2)
    final = world["final"]
    assert snap.manifest["item_count"] == final.size
    up = snap.config["update"]
    assert up["counts"] == {"items": final.size, "parent_items": N, "inserted": 150, "changed": 120, "deleted": 90, "kept": N - 210}
    assert up["drift"]["clamped_values"] > 0
    assert "violet" in snap.config["filter"]["features"]["color"]["values"]
    q = world["rng"].standard_normal((7, D)).astype(np.float32)
    quant = _per_dim(world["parent"].embeddings)
    for filt in FILTERS:
        res = snap.search(torch.from_numpy(q), 25, filter=filt, mode="unprobed") if filt else \
            snap.search(torch.from_numpy(q), 25, nprobe=NLIST)
        _assert_same(res, _reference(final, quant, q, 25, filt), final)
    # a deleted item is never returned, every final item is returned once
    res = snap.search(torch.from_numpy(q[:2]), final.size, nprobe=NLIST)
    for row in res.item_ids:
        assert sorted(row.tolist()) == sorted(final.item_ids.tolist())
    # changed colour honoured, the parent's colour forgotten
    violet = snap.search(torch.from_numpy(q[:1]), final.size, filter="color = violet", mode="unprobed").item_ids[0]
    want = {int(i) for i, c in zip(final.item_ids, final.features["color"]) if c == ["violet"]}
    assert {int(i) for i in violet.tolist() if i >= 0} == want
    assert set(world["changed"][:10].tolist()) <= want

    # a second update on top (generation 2): delete a violet item, add a new tag value
    gone = int(world["changed"][0])
    extra = Pool(np.array([300_000], dtype=np.int64), np.ones((1, D), np.float32),
                 {"color": [["violet"]], "tag": [["brand-new"]]})
    v3 = update_snapshot(v2, tmp_path / "v3", upsert=extra, delete=[gone])
    snap3 = silverrec.load(v3)
    assert snap3.config["update"]["generation"] == 2
    res = snap3.search(torch.from_numpy(q[:1]), 100, filter="color = violet OR tag = brand-new", mode="unprobed")
    assert set(res.item_ids[0].tolist()) - {-1} == (want - {gone}) | {300_000}


def test_ivf_update_equals_brute_force(world, tmp_path):
    plain = Pool(world["parent"].item_ids, world["parent"].embeddings)
    published = Pool(plain.item_ids, plain.embeddings.copy())  # used up by the publish, as the CLI's pool is
    parent = publish_index(published, tmp_path / "v1", config=IVFConfig(nlist=NLIST, residual=False), torchscript=False, release_embeddings=True)
    assert published.embeddings.shape == (0, D) and plain.embeddings.shape == (N, D)
    up = Pool(world["up"].item_ids, world["up"].embeddings)
    v2 = update_snapshot(parent, tmp_path / "v2", upsert=up, delete=world["deleted"])
    snap = silverrec.load(v2)
    final = Pool(world["final"].item_ids, world["final"].embeddings)
    q = world["rng"].standard_normal((5, D)).astype(np.float32)
    _assert_same(snap.search(torch.from_numpy(q), 30, nprobe=NLIST), _reference(final, _per_dim(plain.embeddings), q, 30), final)
    # upserted items sit in their nearest parent centroid's cluster: a 1-probe search of an item's
    # own embedding along its nearest centroid finds it
    centroids = read_tensors(Path(parent), read_manifest(parent))["sources.index.centroids"]
    x = torch.from_numpy(up.embeddings[:20])
    res = snap.search(x, 50, nprobe=1)
    best = (x @ centroids.t()).argmax(1)
    nearest = torch.cdist(x, centroids).argmin(1)
    for i in torch.nonzero(best == nearest).flatten().tolist():
        assert int(up.item_ids[i]) in res.item_ids[i].tolist()


def test_exact_update_equals_brute_force(world, tmp_path):
    plain = Pool(world["parent"].item_ids, world["parent"].embeddings)
    parent = publish_index(plain, tmp_path / "v1", exact=True, torchscript=False)
    v2 = update_snapshot(parent, tmp_path / "v2", upsert=Pool(world["up"].item_ids, world["up"].embeddings),
                         delete=world["deleted"].tolist())
    snap = silverrec.load(v2)
    final = Pool(world["final"].item_ids, world["final"].embeddings)
    q = world["rng"].standard_normal((5, D)).astype(np.float32)
    _assert_same(snap.search(torch.from_numpy(q), 40), _reference(final, _per_dim(plain.embeddings), q, 40), final)
    assert snap.config["quantization"] == silverrec.load(parent).config["quantization"]


def _leftovers(d: Path, name: str):
    return [p for p in d.iterdir() if p.name.startswith(f".{name}.") or p.name == name]


def test_bad_deltas_get_named_errors_and_leave_nothing(world, tmp_path):
    plain = Pool(world["parent"].item_ids, world["parent"].embeddings)
    parent = publish_index(plain, tmp_path / "v1", config=IVFConfig(nlist=NLIST, residual=False), torchscript=False)
    ids = world["parent"].item_ids
    cases = [
        (dict(delete=[123_456_789]), DeltaError, "cannot delete item_id 123456789"),
        (dict(delete=[int(ids[0]), int(ids[0])]), DeltaError, "duplicate id"),
        (dict(upsert=Pool(np.array([1], np.int64), np.zeros((1, D + 1), np.float32))), DeltaError, "dimension 21"),
        (dict(upsert=Pool(ids[:1], np.zeros((1, D), np.float32)), delete=ids[:1]), DeltaError, "both upserted and deleted"),
        (dict(upsert=Pool(np.array([5], np.int64), np.zeros((1, D), np.float32), {"genre": [["x"]]})), DeltaError, "feature columns"),
        (dict(), DeltaError, "empty delta"),
    ]
    dup = tmp_path / "dup.parquet"
    write_pool(dup, np.array([1, 2, 1]), np.zeros((3, D), np.float32))
    cases.append((dict(upsert=dup), PoolError, "duplicate item_id 1"))
    for kwargs, err, match in cases:
        with pytest.raises(err, match=match):
            update_snapshot(parent, tmp_path / "v2", **kwargs)
        assert not _leftovers(tmp_path, "v2")
    proc = run_cli("update", str(parent), "--delete", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "v2"), check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and not _leftovers(tmp_path, "v2")


def test_rec_snapshot_refused(tmp_path):
    rec = write_snapshot(tmp_path / "rec", kind="rec", config={"dim": 4}, item_count=1,
                         write_files=lambda d: (d / "model.pt2").write_bytes(b"x"))
    with pytest.raises(SnapshotError, match="'rec' snapshot with a trained user tower.*re-publish"):
        update_snapshot(rec, tmp_path / "v2", delete=[1])


def test_cli_update_and_inspect_advice(world, tmp_path):
    pool_path = tmp_path / "pool.parquet"
    p = world["parent"]
    write_pool(pool_path, p.item_ids, p.embeddings, p.features)
    run_cli("publish", "--pool", str(pool_path), "--out", str(tmp_path / "v1"), "--nlist", str(NLIST), "--residual", "off")
    proc = run_cli("update", str(tmp_path / "v1"), "--upsert", str(world["dir"] / "up.parquet"),
                   "--delete", str(world["dir"] / "delete.txt"), "--out", str(tmp_path / "v2"))
    assert "generation 1" in proc.stdout and "120 changed" in proc.stdout
    out = run_cli("inspect", str(tmp_path / "v2")).stdout
    assert "rebuild" in out
    # 9% of the items upserted with wider values than the parent's ranges: clamping is flagged
    assert "ADVISED" in out and "clamped" in out


def test_tensors_stored_once_and_format4_parent_updates(world, tmp_path, monkeypatch):
    """Format 5 keeps the index's tensors once, in tensors.pt (the programs hold placeholders); a
    format-4 parent (tensors inside model.pt2 / model.ts) still updates, into the new layout."""
    import silverrec.publish.filtered_ivf as fivf
    from silverrec.snapshot import TENSORS_FILE, export_module

    plain = Pool(world["parent"].item_ids, world["parent"].embeddings)
    up = Pool(world["up"].item_ids, world["up"].embeddings)
    new = publish_index(plain, tmp_path / "new", config=IVFConfig(nlist=NLIST, residual=False), torchscript=True)
    files = read_manifest(new)["files"]
    assert files[TENSORS_FILE]["bytes"] > N * D
    monkeypatch.setattr(fivf, "export_module", lambda *a, tensors_apart, **k: export_module(*a, tensors_apart=False, **k))
    old = publish_index(plain, tmp_path / "old", config=IVFConfig(nlist=NLIST, residual=False), torchscript=True)
    monkeypatch.undo()
    old_files = read_manifest(old)["files"]
    assert TENSORS_FILE not in old_files  # the codes (N x D bytes) moved out of both programs:
    assert all(old_files[f]["bytes"] >= files[f]["bytes"] + N * D for f in ("model.pt2", "model.ts"))
    final = Pool(world["final"].item_ids, world["final"].embeddings)
    q = world["rng"].standard_normal((5, D)).astype(np.float32)
    ref = _reference(final, _per_dim(plain.embeddings), q, 30)
    for parent in (new, old):
        v2 = update_snapshot(parent, tmp_path / f"{parent.name}-v2", upsert=up, delete=world["deleted"])
        assert TENSORS_FILE in read_manifest(v2)["files"]
        for backend in ("export", "torchscript"):
            _assert_same(silverrec.load(v2, backend=backend).search(torch.from_numpy(q), 30, nprobe=NLIST), ref, final)


def test_tensors_of_another_snapshot_are_refused(world, tmp_path):
    """A tensors.pt that does not fit the program (here: another pool's, checksums not verified) is a
    named SnapshotError, for both programs."""
    import shutil

    from silverrec.snapshot import TENSORS_FILE

    x, ids = world["parent"].embeddings, world["parent"].item_ids
    a = publish_index(Pool(ids, x), tmp_path / "a", exact=True, torchscript=True)
    b = publish_index(Pool(ids[:100], x[:100]), tmp_path / "b", exact=True, torchscript=True)
    shutil.copy(b / TENSORS_FILE, a / TENSORS_FILE)
    for backend in ("export", "torchscript"):
        with pytest.raises(SnapshotError, match=r"tensors.pt: tensor '[\w.]+' is \(100"):
            silverrec.load(a, backend=backend, verify=False)
    with pytest.raises(SnapshotError, match="tensors.pt is truncated or altered"):
        silverrec.load(a)


def test_residual_update_encodes_upserts_against_their_centroid(world, tmp_path):
    """A residual parent (codes of item - centroid): every row of the updated snapshot, kept or
    upserted, decodes to its item within half a quantisation step (values inside the parent's
    ranges), and the search over the final pool finds the decoded items' own top 30."""
    plain = Pool(world["parent"].item_ids, world["parent"].embeddings)
    parent = publish_index(plain, tmp_path / "v1", config=IVFConfig(nlist=NLIST, residual=True), torchscript=False)
    assert silverrec.load(parent).config["quantization"]["residual"] is True
    v2 = update_snapshot(parent, tmp_path / "v2", upsert=Pool(world["up"].item_ids, world["up"].embeddings),
                         delete=world["deleted"])
    t = read_tensors(Path(v2), read_manifest(v2))
    off = t["sources.index.cluster_offsets"]
    cluster = torch.repeat_interleave(torch.arange(off.numel() - 1), off[1:] - off[:-1])
    codes = t["sources.index.codes"].float()
    decoded = t["sources.index.centroids"][cluster] + codes * t["sources.index.dim_scale"] + t["sources.index.dim_offset"]
    final = world["final"]
    pos = {int(i): r for r, i in enumerate(final.item_ids)}
    x = torch.from_numpy(final.embeddings)[[pos[int(i)] for i in t["sources.index.row_to_item"].tolist()]]
    inside = (codes > -128) & (codes < 127)  # clamped values decode to the range's end
    assert inside.float().mean() > 0.95
    err = (decoded - x).abs()
    assert torch.all(err[inside] <= (t["sources.index.dim_scale"] / 2 + 1e-4).expand_as(err)[inside])
    q = torch.from_numpy(world["rng"].standard_normal((8, D)).astype(np.float32))
    own = t["sources.index.row_to_item"].long()[torch.topk(q @ decoded.t(), 30, dim=1).indices]
    res = silverrec.load(v2).search(q, 30, nprobe=NLIST)
    hits = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(res.item_ids, own)]
    assert np.mean(hits) / 30 >= 0.95
