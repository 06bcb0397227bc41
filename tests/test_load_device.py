"""`silverrec.load(path, device=...)` without a GPU: the device path (program moved, `OnDevice`
around it) forced on the CPU answers exactly like the plain CPU path; the decode through
GraphedDecode answers as the module; device "cpu" is that plain path; bad devices are refused with a named error. The
same loads on CUDA against the CPU: tests/gpu/test_snapshots_cuda.py."""

import numpy as np
import pytest
import torch

import silverrec
import silverrec.serving.device as device_path
from silverrec.serving.buckets import BucketedForward
from silverrec.bitmask import pack_bits
from silverrec.errors import SnapshotError
from silverrec.serving.cuda_graphs import capture_eager
from silverrec.serving.graphed_decode import GraphedDecode
from silverrec.publish.filtered_ivf import publish_index
from silverrec.publish.generative import build_generative
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool
from silverrec.publish.semantic_ids import build_semantic_ids

from .reference_beam_search import random_decoder


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    g = np.random.default_rng(0)
    n = 2000
    pool = Pool(np.arange(n, dtype=np.int64) * 3, g.normal(size=(n, 16)).astype(np.float32),
                {"country": [[f"c{v}"] for v in g.integers(0, 5, n)]})
    path = publish_index(pool, tmp_path_factory.mktemp("idx") / "s", config=IVFConfig(nlist=16, seed=0))
    return path, torch.from_numpy(g.normal(size=(3, 16)).astype(np.float32))


def test_cpu_is_the_plain_path(index):
    path, _ = index
    for device in ("cpu", torch.device("cpu")):
        snap = silverrec.load(path, device=device)
        assert snap.device == torch.device("cpu") and isinstance(snap.module, torch.nn.Module)


@pytest.mark.parametrize("device, message", [
    ("cuda", r"device 'cuda' requested but torch.cuda.is_available\(\) is False"),
    ("cuda:1", r"device 'cuda:1' requested but torch.cuda.is_available\(\) is False"),
    ("gpu", r"unknown device 'gpu'"),
    ("meta", r"unsupported device 'meta'"),
    (3.5, r"unknown device 3.5"),
])
def test_bad_device_is_refused(monkeypatch, device, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SnapshotError, match=message):
        silverrec.load("/nonexistent", device=device)  # refused before the path is read


@pytest.mark.parametrize("backend", ["export", "torchscript"])
def test_index_through_the_device_path(index, backend, monkeypatch):
    path, queries = index
    plain = silverrec.load(path, backend=backend, device="cpu")
    monkeypatch.setattr(device_path, "MOVE_CPU", True)
    moved = silverrec.load(path, backend=backend, device="cpu")
    assert isinstance(moved.module, BucketedForward) and isinstance(moved.module.module, device_path.OnDevice)
    # probe depths given as powers of two: the device path pads a calibrated depth up to one (buckets.py)
    for options in ({"nprobe": 4}, {"filter": ["country = c1", None, "country IN (c2, c3)"], "nprobe": 2, "max_probe": 8},
                    {"filter": "country = c4", "mode": "probed", "nprobe": 4, "max_probe": 8}):
        want = plain.search(queries, 20, **options)
        got = moved.search(queries, 20, **options)
        assert got.item_ids.device.type == "cpu" and torch.equal(got.item_ids, want.item_ids)
        assert torch.equal(got.scores, want.scores) and (want.item_ids >= 0).any()


def test_generative_through_graphed_decode():
    """The decode behind GraphedDecode with capture_eager on the CPU (the padding to batch / history
    buckets and the static buffers the CUDA graph uses), behind OnDevice, returns the module's own
    ranking; one capture per bucket. (A published generative snapshot is a RecModel, served through
    GraphedForward: tests/gpu/test_snapshots_cuda.py; moved whole: tests/test_device_move.py.)"""
    g = np.random.default_rng(0)
    x = g.normal(size=(200, 8)).astype(np.float32)
    sids = build_semantic_ids(x, np.arange(200, dtype=np.int64) + 7, levels=1, codes=16, seed=0, niter=3)
    module = build_generative(random_decoder(sids.level_sizes, dim=32, n_layers=2, max_seq_len=64, seed=1),
                              sids, 8, None, torch.float32)
    served = device_path.OnDevice(GraphedDecode(module, beam_width=8, capture=capture_eager), torch.device("cpu"))
    decode = served.module
    assert isinstance(served, device_path.OnDevice) and isinstance(decode, GraphedDecode)
    words = (len(sids.item_ids) + 63) // 64
    for seed, T in ((0, 5), (1, 9)):
        gen = torch.Generator().manual_seed(seed)
        history = torch.randint(2, 18, (3, T), generator=gen)
        history[:, 0] = 1  # BOS
        bitmask = pack_bits(torch.rand(3, 64 * words, generator=gen) < 0.6)
        with torch.inference_mode():
            want = module(history, bitmask)
        got = served(history, bitmask)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
        found = want[1] > -np.inf
        assert found.any() and torch.equal(got[0][found], want[0][found])
    assert decode.captures == 1  # both batches fall in one (batch 4, history 16) bucket: one graph


def test_serve_loads_onto_its_device(index, monkeypatch):
    """ServeConfig.device (`silverrec serve --device`) reaches silverrec.load, for reloads too, with a stream per
    batch worker (3: a StreamPool of three lanes)."""
    from silverrec.serving.app import ServeConfig, create_app

    path, _ = index
    monkeypatch.setattr(device_path, "MOVE_CPU", True)
    server = create_app(path, ServeConfig(port=0, device="cpu", batch_workers=3)).server
    for snap in (server.current.snap, server.reloads.loader(path).snap):
        pool = snap.module.module
        assert isinstance(pool, device_path.StreamPool) and len(pool.lanes) == 3
        assert all(isinstance(lane, device_path.OnDevice) for lane in pool.lanes)


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["query", "--queries", "q.npy", "--k", "5"]])
def test_cli_device_flag(index, monkeypatch, capsys, command):
    from silverrec.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path, _ = index
    assert main([command[0], str(path), *command[1:], "--device", "cuda"]) == 2
    assert "device 'cuda' requested but torch.cuda.is_available() is False" in capsys.readouterr().err


def test_sharded_snapshot_loads_every_shard_onto_the_device(tmp_path, monkeypatch):
    from silverrec.publish.shards import ShardSpec, publish_sharded

    g = np.random.default_rng(1)
    pool = Pool(np.arange(600, dtype=np.int64) + 5, g.normal(size=(600, 8)).astype(np.float32))
    path = publish_sharded(pool, tmp_path / "s", spec=ShardSpec(2, "items"), config=IVFConfig(nlist=4, seed=0),
                           torchscript=False)
    plain = silverrec.load(path)
    monkeypatch.setattr(device_path, "MOVE_CPU", True)
    moved = silverrec.load(path, device="cpu")
    assert all(isinstance(s.module.module, device_path.OnDevice) for s in moved.shards)
    q = torch.from_numpy(g.normal(size=(4, 8)).astype(np.float32))
    want, got = plain.search(q, 15, nprobe=2), moved.search(q, 15, nprobe=2)
    assert torch.equal(got.item_ids, want.item_ids) and torch.equal(got.scores, want.scores)
