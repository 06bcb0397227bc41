"""The torch.distributed (gloo) runtime, 2 processes: rank 0 is this test process, rank 1 a
subprocess (`python -m silverrec.serving.distributed`). Answers are checked against the integer
brute force of test_shards.py and the unsharded snapshot; a corrupt shard refuses to start; a
killed rank fails requests (ShardUnavailableError, HTTP 503) within the timeout instead of hanging.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import silverrec
from silverrec.publish.filtered_ivf import publish_index
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.shards import ShardSpec, publish_sharded
from silverrec.serving.distributed import ShardedRuntime, ShardUnavailableError
from silverrec.serving.sharded import ShardVerificationError
from tests.helpers import REPO
from tests.test_shards import D, check_topk, make_pool, matches, reference_scores

TIMEOUT_S = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(path, world: int = 2):
    """Rank 1..world-1 as subprocesses, rank 0 here -> (runtime or exception, [processes])."""
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, SILVERREC_QUIET="1")
    procs = []
    for r in range(1, world):
        err = tempfile.TemporaryFile("w+")
        procs.append(subprocess.Popen([sys.executable, "-m", "silverrec.serving.distributed", str(path), "--rank", str(r),
                                       "--world-size", str(world), "--init-method", init, "--timeout", str(TIMEOUT_S)],
                                      cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err))
        procs[-1].log_file = err
    try:
        rt = ShardedRuntime(path, rank=0, world_size=world, init_method=init, timeout_s=TIMEOUT_S)
    except Exception as e:  # noqa: BLE001  (the test inspects it)
        return e, procs
    return rt, procs


def log(proc) -> str:
    """A worker's stderr (a file, not a pipe: a full pipe would block the worker)."""
    proc.log_file.seek(0)
    return proc.log_file.read()


def stop(rt, procs):
    if isinstance(rt, ShardedRuntime):
        rt.close()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    pool = make_pool()
    cfg = IVFConfig(nlist=40, seed=0, residual=False)
    plain = silverrec.load(publish_index(pool, root / "plain", config=cfg, torchscript=False))
    path = publish_sharded(pool, root / "s2", spec=ShardSpec(2, "items"), config=cfg, torchscript=False)
    return pool, plain, path


def test_distributed_equals_brute_force_and_one_process(built):
    pool, plain, path = built
    one_process = silverrec.load(path)
    rt, procs = start(path)
    try:
        assert isinstance(rt, ShardedRuntime), rt
        filters = ["genre = a AND NOT tag = t3", None, "tag = t5", "genre IN (b, c) OR tag = t7"]
        allowed = np.stack([matches(pool, f) for f in filters])
        for k in (1, 16, 100, 1600):  # 1600 > either shard's items
            q = np.random.default_rng(k).standard_normal((4, D)).astype(np.float32)
            got = rt.search(q, k, filter=filters, mode="unprobed")
            check_topk(got.item_ids.numpy(), got.scores.numpy(), reference_scores(q, pool.embeddings, per_dim=True),
                       pool.item_ids, allowed, k)
            want = one_process.search(q, k, filter=filters, mode="unprobed")
            np.testing.assert_array_equal(got.item_ids.numpy(), want.item_ids.numpy())
        q = np.random.default_rng(5).standard_normal((16, D)).astype(np.float32)
        got = rt.search(q, 100, nprobe=4)
        np.testing.assert_allclose(got.scores.numpy(), plain.search(q, 100, nprobe=4).scores.numpy(), atol=1e-5)
        with pytest.raises(silverrec.QueryError, match="unknown feature"):
            rt.search(q, 5, filter="colour = red")
        assert rt.search(q[:1], 3).item_ids.shape == (1, 3)  # the group still answers after a rejected request
    finally:
        stop(rt, procs)
    assert all(p.returncode == 0 for p in procs), [log(p)[-2000:] for p in procs]


def test_corrupt_shard_refuses_to_start(built, tmp_path):
    _, _, path = built
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    model = bad / "shard-00001" / "model.pt2"
    data = bytearray(model.read_bytes())
    data[len(data) // 3] ^= 0x55
    model.write_bytes(bytes(data))
    t0 = time.monotonic()
    rt, procs = start(bad)
    try:
        assert isinstance(rt, ShardVerificationError), rt
        assert "rank 1" in str(rt) and "shard 1" in str(rt) and "checksum mismatch" in str(rt)
    finally:
        stop(rt, procs)
    assert procs[0].returncode == 2 and "refusing to start" in log(procs[0])
    assert time.monotonic() - t0 < 60


def test_killed_rank_fails_requests_instead_of_hanging(built):
    _, _, path = built
    rt, procs = start(path)
    try:
        assert isinstance(rt, ShardedRuntime), rt
        q = np.random.default_rng(0).standard_normal((16, D)).astype(np.float32)
        rt.search(q, 100)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        t0 = time.monotonic()
        with pytest.raises(ShardUnavailableError) as err:
            rt.search(q, 100)
        assert err.value.http_status == 503
        assert time.monotonic() - t0 < TIMEOUT_S + 10
        t0 = time.monotonic()
        with pytest.raises(ShardUnavailableError, match="unavailable"):
            rt.search(q, 100)  # later requests fail at once
        assert time.monotonic() - t0 < 1.0
    finally:
        stop(rt, procs)


def test_device_reaches_every_shard(built):
    """`device` (silverrec serve --sharded --device) loads every shard onto the rank's device: the
    device path forced on the CPU (MOVE_CPU) answers like the one-process sharded snapshot."""
    from unittest import mock

    from silverrec.serving import device as device_path
    from silverrec.serving.distributed import rank_device

    pool, plain, path = built
    assert rank_device("cuda:1", 3) == "cuda:1" and rank_device("cpu", 2) == "cpu"
    with mock.patch.object(device_path, "MOVE_CPU", True):
        rt = ShardedRuntime(path, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}",
                            timeout_s=TIMEOUT_S, device="cpu")
    try:
        assert rt.shards and all(isinstance(s.module.module, device_path.OnDevice) for s in rt.shards)
        q = np.random.default_rng(3).standard_normal((4, D)).astype(np.float32)
        got, want = rt.search(q, 50, filter="tag = t5"), silverrec.load(path).search(q, 50, filter="tag = t5")
        np.testing.assert_array_equal(got.item_ids.numpy(), want.item_ids.numpy())
    finally:
        rt.close()
