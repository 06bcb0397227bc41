"""Publish -> snapshot -> load in a fresh process -> query, and every bad input's error."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import silverrec
from silverrec.publish.pool import write_pool
from silverrec.snapshot import MANIFEST, read_manifest
from tests.helpers import load_ann, run_cli


@pytest.fixture(scope="module")
def real_pool(tmp_path_factory):
    """A pool of 2,000 real SIFT vectors (bigann10k) with categorical features, and queries."""
    d = tmp_path_factory.mktemp("pool")
    base, queries = load_ann("bigann10k")
    base, queries = base[:2000] / 100.0, queries[:8] / 100.0
    ids = np.arange(2000, dtype=np.int64) * 7 + 3
    features = {"country": [["US", "FR", "DE"][i % 3] for i in range(2000)],
                "genre": [["a", "b"][: 1 + i % 2] for i in range(2000)]}
    write_pool(d / "pool.parquet", ids, base, features)
    np.save(d / "q.npy", queries.astype(np.float32))
    return d, ids, base, queries


@pytest.fixture(scope="module")
def exact_snapshot(real_pool):
    d, *_ = real_pool
    run_cli("publish", "--pool", str(d / "pool.parquet"), "--out", str(d / "snap"), "--exact")
    return d / "snap"


def test_publish_writes_manifest_with_checksums(exact_snapshot, real_pool):
    m = read_manifest(exact_snapshot)
    assert m["format_version"] == silverrec.FORMAT_VERSION
    assert m["item_count"] == 2000 and m["kind"] == "rec" and m["config"]["spec"]["tower"] == "query" and m["config"]["nlist"] == 1 and m["config"]["dim"] == 128
    assert {"model.pt2", "model.ts"} <= set(m["files"])
    assert sorted(p.name for p in exact_snapshot.parent.iterdir() if p.name.startswith(".")) == []


def test_query_in_fresh_process_equals_in_process(exact_snapshot, real_pool):
    d, ids, base, queries = real_pool
    proc = run_cli("query", str(exact_snapshot), "--queries", str(d / "q.npy"), "--k", "10", "--json")
    out = json.loads(proc.stdout)
    snap = silverrec.load(exact_snapshot)
    res = snap.search(queries.astype(np.float32), 10)
    assert out["item_ids"] == res.item_ids.tolist()
    np.testing.assert_allclose(np.array(out["scores"]), res.scores.numpy(), rtol=1e-6)
    # and the answer is (almost) the float brute-force one, mapped to external ids
    truth = ids[np.argsort(-(queries @ base.T), axis=1, kind="stable")[:, :10]]
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(res.item_ids.tolist(), truth.tolist())])
    assert overlap >= 0.9


def test_torchscript_and_export_agree(exact_snapshot, real_pool):
    _, _, _, queries = real_pool
    a = silverrec.load(exact_snapshot, backend="export").search(queries, 25)
    b = silverrec.load(exact_snapshot, backend="torchscript").search(queries, 25)
    assert torch.equal(a.item_ids, b.item_ids) and torch.equal(a.scores, b.scores)
    one = silverrec.load(exact_snapshot).search(queries[:1], 1)  # batch 1, k 1: no 0/1 specialisation
    assert one.item_ids[0, 0] == a.item_ids[0, 0]


def test_inspect(exact_snapshot):
    out = run_cli("inspect", str(exact_snapshot)).stdout
    assert "kind          rec" in out and "nlist 1 (exact)" in out and "items         2,000" in out and "model.pt2" in out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_file_is_rejected(exact_snapshot, tmp_path):
    snap = _copy(exact_snapshot, tmp_path / "s")
    data = (snap / "model.pt2").read_bytes()
    (snap / "model.pt2").write_bytes(data[: len(data) // 2])
    with pytest.raises(silverrec.SnapshotError, match="truncated"):
        silverrec.load(snap)


def test_checksum_mismatch_is_rejected(exact_snapshot, tmp_path):
    snap = _copy(exact_snapshot, tmp_path / "s")
    data = bytearray((snap / "model.ts").read_bytes())
    data[100] ^= 0xFF
    (snap / "model.ts").write_bytes(bytes(data))
    with pytest.raises(silverrec.SnapshotError, match="checksum mismatch"):
        silverrec.load(snap, backend="torchscript")


def test_newer_format_version_is_rejected(exact_snapshot, tmp_path):
    snap = _copy(exact_snapshot, tmp_path / "s")
    m = json.loads((snap / MANIFEST).read_text())
    m["format_version"] = silverrec.FORMAT_VERSION + 1
    (snap / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(silverrec.SnapshotError, match=f"format version {silverrec.FORMAT_VERSION + 1}.*upgrade silverrec"):
        silverrec.load(snap)
    proc = run_cli("query", str(snap), "--queries", "x.npy", "--k", "1", check=False)
    assert proc.returncode == 2 and "format version" in proc.stderr


@pytest.mark.parametrize("kind", ["exact", "ivf", "filtered_ivf", "rec", "generative"])
def test_older_format_is_refused_naming_format_and_kind(exact_snapshot, tmp_path, kind):
    """Format 6 composes every snapshot from its spec (the kind generative became the decode-only
    recommendation model, the forward's inputs changed): a snapshot of an older format holds
    programs this silverrec cannot call, so load refuses it before deserialising."""
    from silverrec.snapshot import MIN_FORMAT_VERSION

    snap = _copy(exact_snapshot, tmp_path / "s")
    m = json.loads((snap / MANIFEST).read_text())
    m["format_version"], m["kind"] = MIN_FORMAT_VERSION - 1, kind
    (snap / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(silverrec.SnapshotError, match=f"format version {MIN_FORMAT_VERSION - 1} .kind '{kind}'.*re-publish"):
        silverrec.load(snap)


def test_manifest_records_the_build_versions(exact_snapshot):
    import platform
    from importlib import metadata

    build = read_manifest(exact_snapshot)["build"]
    assert build["torch"] == torch.__version__ and build["silverrec"] == silverrec.__version__
    assert build["python"] == platform.python_version()
    assert build["torchrec"] == metadata.version("torchrec")


@pytest.mark.parametrize("package, built_with", [("torch", "1.13.1"), ("silverrec", "0.9.0")])
def test_snapshot_built_by_other_versions_is_refused(exact_snapshot, tmp_path, package, built_with):
    snap = _copy(exact_snapshot, tmp_path / "s")
    m = json.loads((snap / MANIFEST).read_text())
    ours = m["build"][package]
    m["build"][package] = built_with
    (snap / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(silverrec.SnapshotError, match=re.escape(f"built with {package} {built_with}; this process has {package} {ours}")):
        silverrec.load(snap)
    m["build"][package] = re.sub(r"^(\d+\.\d+)\.\d+", r"\g<1>.77", ours)  # another patch release loads
    (snap / MANIFEST).write_text(json.dumps(m))
    assert silverrec.load(snap).manifest["build"][package] != ours


def test_missing_manifest_is_rejected(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(silverrec.SnapshotError, match="no manifest.json"):
        silverrec.load(tmp_path / "half")


def test_bad_queries(exact_snapshot):
    snap = silverrec.load(exact_snapshot)
    with pytest.raises(silverrec.QueryError, match="dimension 5"):
        snap.search(np.zeros((2, 5), np.float32), 3)
    with pytest.raises(silverrec.QueryError, match="k must be positive"):
        snap.search(np.zeros((2, 128), np.float32), 0)
    with pytest.raises(silverrec.QueryError, match="exceeds the 2000"):
        snap.search(np.zeros((2, 128), np.float32), 2001)
    q = np.zeros((3, 128), np.float32)
    q[2, 7] = np.nan
    with pytest.raises(silverrec.QueryError, match="row 2 contains NaN"):
        snap.search(q, 3)


def _bad_pool(tmp_path, ids, emb, **features):
    path = tmp_path / "bad.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {"item_id": pa.array(ids, type=pa.int64()), "embedding": pa.array(emb, type=pa.list_(pa.float32()))}
    cols.update({k: pa.array(v) for k, v in features.items()})
    pq.write_table(pa.table(cols), path)
    return path


@pytest.mark.parametrize(
    "ids,emb,features,message",
    [
        ([1, 2, 3], [[0.0, 1.0], [float("nan"), 0.0], [1.0, 1.0]], {}, "NaN or Inf at row 1 \\(item_id 2\\)"),
        ([1, 2, 3], [[0.0, 1.0], [0.0, float("inf")], [1.0, 1.0]], {}, "NaN or Inf at row 1"),
        ([1, 2, 3], [[0.0, 1.0], [0.0, 1.0, 2.0], [1.0, 1.0]], {}, "ragged: row 1 \\(item_id 2\\) has length 3"),
        ([1, 2, 1], [[0.0, 1.0], [0.0, 1.0], [1.0, 1.0]], {}, "duplicate item_id 1 at rows 0 and 2"),
        ([], [], {}, "empty"),
        ([1, 2], [[0.0], [1.0]], {"genre": [1, 2]}, "feature column 'genre' must be string"),
    ],
)
def test_bad_pools_are_rejected_and_leave_nothing(tmp_path, ids, emb, features, message):
    pool = _bad_pool(tmp_path, ids, emb, **features)
    out = tmp_path / "snap"
    proc = run_cli("publish", "--pool", str(pool), "--out", str(out), "--exact", check=False)
    assert proc.returncode == 2, proc.stderr
    import re

    assert re.search(message, proc.stderr), proc.stderr
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "bad.parquet"] == []


def test_missing_columns_and_files(tmp_path):
    proc = run_cli("publish", "--pool", str(tmp_path / "nope.parquet"), "--out", str(tmp_path / "s"), check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"item_id": pa.array([1])}), tmp_path / "p.parquet")
    proc = run_cli("publish", "--pool", str(tmp_path / "p.parquet"), "--out", str(tmp_path / "s"), check=False)
    assert proc.returncode == 2 and "no column 'embedding'" in proc.stderr


def test_failed_export_leaves_no_partial_directory(tmp_path, monkeypatch):
    """A crash in the middle of writing (here: export raises) removes the temporary directory."""
    from silverrec.publish import filtered_ivf as build
    from silverrec.publish.pool import Pool

    pool = Pool(np.arange(10, dtype=np.int64), np.random.rand(10, 4).astype(np.float32), {})

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(build, "export_module", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        build.publish_index(pool, tmp_path / "snap", exact=True)
    assert list(tmp_path.iterdir()) == []


def test_existing_snapshot_is_not_clobbered(exact_snapshot, real_pool):
    d, *_ = real_pool
    proc = run_cli("publish", "--pool", str(d / "pool.parquet"), "--out", str(exact_snapshot), "--exact", check=False)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert read_manifest(exact_snapshot)["item_count"] == 2000


@pytest.mark.parametrize("row, value", [(0, float("nan")), (2, float("-inf")), (3, float("inf"))])
def test_check_queries_names_the_first_non_finite_row(row, value):
    from silverrec.errors import QueryError, check_queries

    q = torch.randn(4, 6)
    q[row, 5] = value
    with pytest.raises(QueryError, match=f"row {row} contains NaN or Inf"):
        check_queries(q, 6)


def test_check_queries_accepts_finite_values_whose_sum_overflows():
    from silverrec.errors import check_queries

    q = torch.full((4, 6), 3e38)  # every value finite, the float32 sum is inf: the per-value check decides
    assert torch.equal(check_queries(q, 6), q)
