"""`silverrec serve` on a sharded snapshot: one process (ShardedSnapshot behind the app) and 2 gloo
ranks (`torchrun -m silverrec serve DIR --sharded`; or rank 0 in this process with rank 1 a
`silverrec serve --sharded --rank 1` subprocess). HTTP answers are checked against the one-process
sharded answer and the integer brute force of test_shards.py; a corrupt shard refuses to start; a
reload swaps every rank's shards or none; a killed rank turns requests into 503s, not a hang.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import numpy as np
import pytest

import silverrec
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.shards import ShardSpec, publish_sharded
from silverrec.serving.distributed import ShardedRuntime, served_view
from silverrec.serving.app import ServeConfig
from silverrec.serving.server import start_in_thread
from tests.helpers import REPO
from tests.test_shards import D, check_topk, make_pool, matches, reference_scores

TIMEOUT_S = 3.0
TOKEN = "sharded-token"
FILTERS = ["genre = a AND NOT tag = t3", None, "tag = t5", "genre IN (b, c) OR tag = t7"]
ENV = dict(os.environ, SILVERREC_QUIET="1", OMP_NUM_THREADS="1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def corrupt(src, dst, shard: int):
    shutil.copytree(src, dst)
    model = dst / f"shard-{shard:05d}" / "model.pt2"
    data = bytearray(model.read_bytes())
    data[len(data) // 3] ^= 0x55
    model.write_bytes(bytes(data))
    return dst


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two versions (different pools) of a 2-shard filtered IVF snapshot and copies with a bad shard."""
    root = tmp_path_factory.mktemp("serve_sharded")
    cfg = IVFConfig(nlist=40, seed=0, residual=False)
    out = {}
    for name, seed in (("v1", 0), ("v2", 1)):
        pool = make_pool(seed)
        path = publish_sharded(pool, root / name, spec=ShardSpec(2, "items"), config=cfg,
                               torchscript=False)
        out[name] = (pool, path, silverrec.load(path))
    out["bad1"] = corrupt(out["v2"][1], root / "bad1", 1)  # only rank 1's shard is bad
    out["bad0"] = corrupt(out["v2"][1], root / "bad0", 0)  # only rank 0's shard is bad
    return out


def search(url: str, q: np.ndarray, k: int, **opts):
    r = httpx.post(url + "/v1/search", json={"queries": q.tolist(), "k": k, **opts}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    scores = np.array([[-np.inf if s is None else s for s in row] for row in body["scores"]], dtype=np.float32)
    return np.array(body["item_ids"], dtype=np.int64), scores, body["version"]


def check_answers(url: str, pool, one_process, seed: int = 0) -> str:
    """HTTP answers == the one-process sharded answers, and (filtered, unprobed: exact) == brute force."""
    allowed = np.stack([matches(pool, f) for f in FILTERS])
    version = None
    for k in (1, 16, 100):
        q = np.random.default_rng(seed + k).standard_normal((4, D)).astype(np.float32)
        ids, scores, version = search(url, q, k, filter=FILTERS, mode="unprobed")
        check_topk(ids, scores, reference_scores(q, pool.embeddings, per_dim=True), pool.item_ids, allowed, k)
        want = one_process.search(q, k, filter=FILTERS, mode="unprobed")
        np.testing.assert_array_equal(ids, want.item_ids.numpy())
        np.testing.assert_array_equal(scores, want.scores.numpy())
    q = np.random.default_rng(seed).standard_normal((16, D)).astype(np.float32)
    for k, opts in ((100, {"nprobe": 4}), (1600, {})):  # 1600 > either shard's items
        ids, scores, _ = search(url, q, k, **opts)
        want = one_process.search(q, k, **opts)
        np.testing.assert_array_equal(ids, want.item_ids.numpy())
        np.testing.assert_array_equal(scores, want.scores.numpy())
    return version


def wait_ready(url: str, procs, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert all(p.poll() is None for p in procs), "a rank exited before the server was ready"
        time.sleep(0.2)
    raise AssertionError("sharded server not ready")


def stderr_of(proc) -> str:
    proc.log_file.seek(0)
    return proc.log_file.read()


def popen(args) -> subprocess.Popen:
    err = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the process
    p = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=err)
    p.log_file = err
    return p


def rank_cmd(path, rank: int, init: str, port: int = 0) -> list[str]:
    return [sys.executable, "-m", "silverrec", "serve", str(path), "--sharded", "--rank", str(rank), "--world-size", "2",
            "--init-method", init, "--shard-timeout", str(TIMEOUT_S), "--port", str(port)]


def test_one_process_sharded_snapshot_behind_the_app(built):
    pool, path, one = built["v1"]
    run = start_in_thread(path, ServeConfig(port=0, max_batch=8, max_wait_ms=5))
    try:
        version = check_answers(run.url, pool, one)
        assert version == f"v1@{one.config['version'][:12]}"
        model = httpx.get(run.url + "/v1/model").json()
        assert model["kind"] == "rec" and model["manifest"]["kind"] == "sharded"
        r = httpx.post(run.url + "/v1/search", json={"queries": [[0.0] * D], "k": 3, "filter": "colour = red"})
        assert r.status_code == 400 and "colour" in r.json()["detail"]
    finally:
        run.stop()


def test_torchrun_two_ranks_answer_as_one_process_and_brute_force(built):
    pool, path, one = built["v1"]
    port = free_port()
    proc = popen([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2",
                  "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                  "-m", "silverrec", "serve", str(path), "--sharded", "--port", str(port),
                  "--shard-timeout", str(TIMEOUT_S)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, [proc])
        check_answers(url, pool, one, seed=7)
        assert "2 gloo ranks" in httpx.get(url + "/v1/model").json()["backend"]
    finally:
        proc.send_signal(signal.SIGTERM)  # torchrun stops both ranks (rank 0 drains first)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "stopped (in-flight requests answered)" in stderr_of(proc), stderr_of(proc)[-3000:]


def test_corrupt_shard_refuses_to_start(built):
    init, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    procs = [popen(rank_cmd(built["bad1"], r, init, port)) for r in (0, 1)]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [2, 2], [stderr_of(p)[-2000:] for p in procs]
    for p in procs:  # every rank names the failing shard
        err = stderr_of(p)
        assert "refusing to start" in err and "rank 1" in err and "shard 1" in err and "checksum mismatch" in err, err
    with pytest.raises(httpx.HTTPError):  # nothing was bound
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)


def test_reload_swaps_all_shards_or_none_and_a_killed_rank_gives_503(built):
    pool1, path1, one1 = built["v1"]
    pool2, path2, one2 = built["v2"]
    init = f"tcp://127.0.0.1:{free_port()}"
    worker = popen(rank_cmd(path1, 1, init))
    rt = ShardedRuntime(path1, rank=0, world_size=2, init_method=init, timeout_s=TIMEOUT_S)
    run = start_in_thread(path1, ServeConfig(port=0, max_batch=8, max_wait_ms=2, admin_token=TOKEN),
                          served=served_view(rt), loader=lambda p: served_view(rt, p))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        v1 = check_answers(run.url, pool1, one1)

        # a shard that fails on one rank only: every rank keeps v1 (mixed shards would change answers)
        for bad, rank in ((built["bad1"], 1), (built["bad0"], 0)):
            r = httpx.post(run.url + "/v1/admin/reload", json={"path": str(bad)}, headers=auth, timeout=120)
            assert r.status_code == 409, r.text
            assert f"rank {rank}" in r.json()["detail"] and "still serving " + v1 in r.json()["detail"]
            assert check_answers(run.url, pool1, one1, seed=3) == v1

        # a good reload under load: every answer comes from the version it names, none fails
        q = np.random.default_rng(11).standard_normal((2, D)).astype(np.float32)
        refs = {v1: one1.search(q, 10, nprobe=4).item_ids.numpy()}
        seen, stop = [], threading.Event()

        def load():
            while not stop.is_set():
                seen.append(search(run.url, q, 10, nprobe=4))

        t = threading.Thread(target=load)
        t.start()
        try:
            r = httpx.post(run.url + "/v1/admin/reload", json={"path": str(path2)}, headers=auth, timeout=120)
            time.sleep(0.3)
        finally:
            stop.set()
            t.join(60)
        assert r.status_code == 200, r.text
        v2 = r.json()["version"]
        assert v2 == f"v2@{one2.config['version'][:12]}" and r.json()["previous"] == v1
        refs[v2] = one2.search(q, 10, nprobe=4).item_ids.numpy()
        assert seen and seen[-1][2] == v2
        for ids, _, version in seen:
            np.testing.assert_array_equal(ids, refs[version])
        assert check_answers(run.url, pool2, one2, seed=5) == v2

        # a killed rank: 503 with Retry-After within the collective timeout, then at once; not ready
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        t0 = time.monotonic()
        r = httpx.post(run.url + "/v1/search", json={"queries": q.tolist(), "k": 5}, timeout=60)
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", r.text
        assert "rank" in r.json()["detail"] and r.json()["version"] == v2
        assert time.monotonic() - t0 < TIMEOUT_S + 10
        t0 = time.monotonic()
        r = httpx.post(run.url + "/v1/search", json={"queries": q.tolist(), "k": 5}, timeout=60)
        assert r.status_code == 503 and time.monotonic() - t0 < 2.0
        assert httpx.get(run.url + "/readyz").status_code == 503
        r = httpx.post(run.url + "/v1/admin/reload", json={"path": str(path1)}, headers=auth, timeout=60)
        assert r.status_code == 409 and "unavailable" in r.json()["detail"]
    finally:
        run.stop()
        rt.close()
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_stalled_rank_gives_503_after_the_timeout_and_rank_0_still_exits(built):
    _, path, _ = built["v1"]
    init, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    procs = [popen(rank_cmd(path, r, init, port)) for r in (0, 1)]
    url = f"http://127.0.0.1:{port}"
    body = {"queries": [[0.5] * D], "k": 5}
    try:
        wait_ready(url, procs)
        assert httpx.post(url + "/v1/search", json=body, timeout=60).status_code == 200
        os.kill(procs[1].pid, signal.SIGSTOP)  # alive, connected, silent: only the timeout can tell
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/search", json=body, timeout=60)
        assert r.status_code == 503 and "timed out" in r.json()["detail"], r.text
        assert TIMEOUT_S - 0.5 < time.monotonic() - t0 < TIMEOUT_S + 10
        assert httpx.get(url + "/readyz").status_code == 503
        procs[0].send_signal(signal.SIGTERM)  # the timed-out collective is still pending: exit without leaving
        assert procs[0].wait(timeout=30) == 3
        assert "exiting without leaving the group" in stderr_of(procs[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
