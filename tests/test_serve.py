"""`silverrec serve`: the HTTP server on an ephemeral loopback port, its batcher, reloads and errors.

References: direct `Snapshot.search` / `recommend` / `rank` calls on the same snapshot (each
request's answer inside a batch must equal its answer alone); status codes and messages named per
bad input; a slowed-down model (a `Served` whose run sleeps) to fill queues, pass deadlines and
have requests in flight during reloads and shutdown. Timing is never asserted, only outcomes.
"""

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import silverrec
from silverrec.errors import QueryError, SilverrecError
from silverrec.serving.batcher import Batcher, DeadlineExceeded, QueueFull
from silverrec.serving.app import ServeConfig
from silverrec.serving.served import Served, load_served
from silverrec.serving.server import check_bind, start_in_thread
from silverrec.serving.tune import TunePolicy

from tests.rec_fixtures import rec_setup

N, D = 1500, 16
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def snaps(tmp_path_factory):
    """Two small IVF snapshots of different pools (two versions) and an exact one."""
    from silverrec.publish.filtered_ivf import publish_index
    from silverrec.publish.ivf import IVFConfig
    from silverrec.publish.pool import read_pool, write_pool

    d = tmp_path_factory.mktemp("serve")
    rng = np.random.default_rng(0)
    out = {}
    for name, seed in (("v1", 1), ("v2", 2)):
        emb = np.random.default_rng(seed).standard_normal((N, D)).astype(np.float32)
        write_pool(d / f"{name}.parquet", np.arange(N, dtype=np.int64) * 3 + seed, emb)
        out[name] = publish_index(read_pool(d / f"{name}.parquet"), d / name, config=IVFConfig(nlist=8))
    out["exact"] = publish_index(read_pool(d / "v1.parquet"), d / "exact", exact=True, torchscript=False)
    out["queries"] = rng.standard_normal((64, D)).astype(np.float32)
    out["dir"] = d
    return out


class SlowServed(Served):
    """The real model, `delay` seconds slower per group (to fill queues and hold requests in flight)."""

    delay = 0.2

    def run(self, key, payloads):
        time.sleep(self.delay)
        return super().run(key, payloads)


def slow(path, delay=0.2):
    s = SlowServed(silverrec.load(path))
    s.delay = delay
    return s


@pytest.fixture(scope="module")
def ivf_server(snaps):
    run = start_in_thread(snaps["v1"], ServeConfig(port=0, max_batch=16, max_wait_ms=20, max_body_bytes=1 << 16))
    yield run
    run.stop()


def post(url, path, body=None, **kw):
    with httpx.Client(base_url=url, timeout=30) as c:
        if isinstance(body, (str, bytes)):
            return c.post(path, content=body, headers={"content-type": "application/json", **kw.pop("headers", {})}, **kw)
        return c.post(path, json=body, **kw)


def parallel(fn, args, threads=16):
    out = [None] * len(args)

    def work(i):
        out[i] = fn(args[i])

    ts = [threading.Thread(target=work, args=(i,)) for i in range(len(args))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


# ------------------------------------------------------------------------------------ answers

def test_each_request_gets_its_own_rows_inside_a_batch(snaps, ivf_server):
    snap, q = silverrec.load(snaps["v1"]), snaps["queries"]
    # rows, k, and nprobe, a target recall (mapped through the snapshot's calibration curve) or neither
    cases = [(i, 1 + i % 3, 1 + (7 * i) % 20, None if i % 4 else {"nprobe": 1 + i % 8} if i % 8 else
              {"target_recall": 0.5 + 0.05 * (i % 9)}) for i in range(32)]

    def one(case):
        i, rows, k, opts = case
        return post(ivf_server.url, "/v1/search", {"queries": q[i:i + rows].tolist(), "k": k, **(opts or {})})

    answers = parallel(one, cases)
    for (i, rows, k, opts), r in zip(cases, answers):
        assert r.status_code == 200, r.text
        got = r.json()
        opts = opts or {}
        ref = snap.search(q[i:i + rows], k, **opts)
        assert got["item_ids"] == ref.item_ids.tolist()
        np.testing.assert_allclose(np.array(got["scores"], dtype=np.float32), ref.scores.numpy(), rtol=1e-5)
        assert got["version"].startswith("v1@")
    metrics = httpx.get(ivf_server.url + "/metrics").text
    sizes = {float(m.group(1)): float(m.group(2))
             for m in re.finditer(r'silverrec_batch_requests_bucket\{le="([\d.]+)"\} ([\d.]+)', metrics)}
    assert sizes[1.0] < sizes[16.0], "no batch held more than one request"


def test_exact_snapshot_answers_like_search(snaps):
    run = start_in_thread(snaps["exact"], ServeConfig(port=0))
    try:
        q = snaps["queries"][:3]
        r = post(run.url, "/v1/search", {"queries": q.tolist(), "k": 4})
        assert r.status_code == 200 and r.json()["item_ids"] == silverrec.load(snaps["exact"]).search(q, 4).item_ids.tolist()
        r = post(run.url, "/v1/search", {"queries": q.tolist(), "k": 4, "nprobe": 2})
        assert r.status_code == 400 and "nprobe must be an int in [1, 1]" in r.json()["detail"]
        r = post(run.url, "/v1/recommend", {"history": [1, 2]})
        assert r.status_code == 400 and "it answers /v1/search, not /v1/recommend" in r.json()["detail"]
    finally:
        run.stop()


def _read_responses(data: bytes) -> list[tuple[int, dict, bytes]]:
    """HTTP/1.1 responses one after another in `data` -> (status, headers, body) each (a Content-Length
    or a chunked body)."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        if "content-length" in headers:
            n = int(headers["content-length"])
            body, data = data[:n], data[n:]
        else:
            assert headers.get("transfer-encoding") == "chunked", headers
            body = b""
            while True:
                size, _, data = data.partition(b"\r\n")
                n = int(size, 16)
                body, data = body + data[:n], data[n + 2:]
                if n == 0:
                    break
        out.append((int(lines[0].split()[1]), headers, body))
    return out


def test_requests_answered_on_the_connection_and_the_asgi_way_alike(snaps, ivf_server):
    """A request plain enough to be answered on the connection and the same request the ASGI way (a
    query string, a chunked body) get the same status, body and headers; requests pipelined on one
    connection are all answered, in order; Connection: close is answered, then the connection closes."""
    import socket

    q = snaps["queries"][:2].tolist()
    good, bad = json.dumps({"queries": q, "k": 5}).encode(), json.dumps({"queries": q, "k": 0}).encode()
    for body, status in ((good, 200), (bad, 400)):
        with httpx.Client(base_url=ivf_server.url, timeout=30) as c:
            plain = c.post("/v1/search", content=body, headers={"content-type": "application/json"})
            query = c.post("/v1/search?via=asgi", content=body, headers={"content-type": "application/json"})
            chunked = c.post("/v1/search", content=iter([body]), headers={"content-type": "application/json"})
        assert plain.status_code == query.status_code == chunked.status_code == status
        assert plain.json() == query.json() == chunked.json()
        for h in ("content-type", "x-silverrec-version"):
            assert plain.headers[h] == query.headers[h] == chunked.headers[h]
    expected = post(ivf_server.url, "/v1/search", good).json()

    def request(body: bytes, close: bool = False) -> bytes:
        return (b"POST /v1/search HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                + (b"Connection: close\r\n" if close else b"") + b"Content-Length: %d\r\n\r\n" % len(body) + body)

    with socket.create_connection((ivf_server.host, ivf_server.port), timeout=30) as sock:
        sock.sendall(request(good) + request(bad) + request(good, close=True))
        data = b""
        while chunk := sock.recv(1 << 16):  # the server closes after the third answer
            data += chunk
    answers = _read_responses(data)
    assert [a[0] for a in answers] == [200, 400, 200]
    assert json.loads(answers[0][2]) == json.loads(answers[2][2]) == expected
    assert "k must be positive" in json.loads(answers[1][2])["detail"]
    assert answers[2][1].get("connection") == "close"


def test_service_routes(ivf_server):
    with httpx.Client(base_url=ivf_server.url) as c:
        assert c.get("/healthz").json()["status"] == "ok"
        assert c.get("/readyz").status_code == 200
        model = c.get("/v1/model").json()
        assert model["kind"] == "rec" and model["version"].startswith("v1@") and "admin_token" not in model["serving"]
        assert "/v1/search" in c.get("/openapi.json").json()["paths"]
        text = c.get("/metrics").text
        for name in ("silverrec_requests_total", "silverrec_request_latency_seconds_bucket", "silverrec_queue_depth",
                     "silverrec_batch_requests_bucket", "silverrec_snapshot_info"):
            assert name in text


# ------------------------------------------------------------------------------------ bad requests

BAD = [  # body, status, message pattern
    ('{"queries": [[1.0, 2.0', 400, r"malformed JSON at position \d+"),
    ('[1, 2]', 422, r"invalid request"),
    ({"queries": [[0.5] * (D - 1)], "k": 5}, 400, r"query row 0 has 15 values, the index holds 16-d items"),
    ({"queries": [[0.5] * D, [0.5] * (D + 1)], "k": 5}, 400, r"query row 1 has 17 values"),
    ({"queries": [["x"] * D], "k": 5}, 422, r"queries\.0\.0: Input should be a valid number"),
    ({"queries": [[0.5] * D], "k": 0}, 400, r"k must be positive, got 0"),
    ({"queries": [[0.5] * D], "k": N + 1}, 400, rf"k={N + 1} exceeds the {N} items"),
    ({"queries": [[0.5] * D], "k": 2.5}, 422, r"k: Input should be a valid integer"),
    ({"queries": [[0.5] * D], "k": 5, "nprobe": 99}, 400, r"nprobe must be an int in \[1, 8\], got 99"),
    ({"queries": [[0.5] * D], "k": 5, "nprobe": 2, "target_recall": 0.9}, 400, r"give nprobe or target_recall, not both"),
    ({"queries": [[0.5] * D], "k": 5, "target_recall": 1.5}, 400, r"target_recall must be a number in \(0, 1\], got 1.5"),
    ({"queries": [[0.5] * D], "k": 5, "filter": "a = b"}, 400, r"unknown feature .a. in filter at position 0; this snapshot can filter on no features"),
    ({"queries": [[0.5] * D], "k": 5, "colour": 1}, 422, r"colour: Extra inputs are not permitted"),
    ({"queries": [], "k": 5}, 400, r"at least one row"),
    ({"k": 5}, 422, r"queries: Field required"),
    ('{"queries": [[NaN' + ", 0.5" * (D - 1) + ']], "k": 5}', 400, r"row 0 contains NaN or Inf"),
    ("x" * (1 << 17), 413, r"request body exceeds 65536 bytes"),
]


def test_every_error_status_names_the_problem(ivf_server):
    for body, status, pattern in BAD:
        r = post(ivf_server.url, "/v1/search", body)
        assert r.status_code == status, (body if len(str(body)) < 200 else "big", r.text)
        assert re.search(pattern, r.json()["detail"]), r.json()["detail"]
        assert r.json()["version"].startswith("v1@")
    r = post(ivf_server.url, "/v1/search", {"queries": [[0.5] * D]}, headers={"X-Deadline-Ms": "soon"})
    assert r.status_code == 400 and "X-Deadline-Ms must be a number" in r.json()["detail"]


def test_bad_requests_never_disturb_their_batch(snaps, ivf_server):
    snap, q = silverrec.load(snaps["v1"]), snaps["queries"]
    jobs = [("good", i) if i % 3 else ("bad", i) for i in range(30)]

    def one(job):
        kind, i = job
        if kind == "good":
            return post(ivf_server.url, "/v1/search", {"queries": q[i:i + 1].tolist(), "k": 5})
        body, _, _ = BAD[i % (len(BAD) - 1)]
        return post(ivf_server.url, "/v1/search", body)

    for (kind, i), r in zip(jobs, parallel(one, jobs)):
        if kind == "good":
            assert r.status_code == 200 and r.json()["item_ids"] == snap.search(q[i:i + 1], 5).item_ids.tolist()
        else:
            assert r.status_code in (400, 413, 422), r.text


# ------------------------------------------------------------------------------------ backpressure, deadlines

def test_deadline_expiry_answers_504_and_skips_compute(snaps):
    run = start_in_thread(snaps["v1"], ServeConfig(port=0, max_batch=1, max_wait_ms=0), served=slow(snaps["v1"], 0.3))
    try:
        q = snaps["queries"][:1].tolist()
        first = threading.Thread(target=post, args=(run.url, "/v1/search", {"queries": q, "k": 3}))
        first.start()
        time.sleep(0.05)  # the worker is busy with the first request for 0.3 s
        r = post(run.url, "/v1/search", {"queries": q, "k": 3, "deadline_ms": 50})
        assert r.status_code == 504 and "deadline of 50 ms exceeded" in r.json()["detail"]
        r = post(run.url, "/v1/search", {"queries": q, "k": 3}, headers={"X-Deadline-Ms": "40"})
        assert r.status_code == 504 and "deadline of 40 ms exceeded" in r.json()["detail"]
        first.join()
        assert 'silverrec_rejections_total{reason="deadline"} 2.0' in httpx.get(run.url + "/metrics").text
    finally:
        run.stop()


def test_batcher_drops_expired_jobs_before_compute():
    computed = []

    def run_group(key, payloads):
        computed.extend(payloads)
        time.sleep(0.1)
        return payloads

    async def main():
        b = Batcher(run_group, max_batch=4, max_wait_ms=0, max_queue=8, workers=1)
        await b.start()
        first = asyncio.ensure_future(b.submit("k", "first"))
        await asyncio.sleep(0.02)
        late = b.submit("k", "late", deadline=time.monotonic() + 0.03)
        ok = b.submit("k", "ok")
        res = await asyncio.gather(first, late, ok, return_exceptions=True)
        await b.stop()
        return res

    first, late, ok = asyncio.run(main())
    assert first == "first" and ok == "ok" and isinstance(late, DeadlineExceeded)
    assert computed == ["first", "ok"]


def test_queue_full_answers_503_with_retry_after(snaps):
    run = start_in_thread(snaps["v1"], ServeConfig(port=0, max_batch=1, max_wait_ms=0, max_queue=2),
                          served=slow(snaps["v1"], 0.25))
    try:
        q = snaps["queries"][:1].tolist()
        answers = parallel(lambda _: post(run.url, "/v1/search", {"queries": q, "k": 3}), list(range(10)))
        codes = sorted(r.status_code for r in answers)
        assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
        full = next(r for r in answers if r.status_code == 503)
        assert full.headers["retry-after"] == "1" and "queue full (2 requests waiting)" in full.json()["detail"]
    finally:
        run.stop()


class Gated:
    """A run_group that records its batches and holds every call until `release()`."""

    def __init__(self, fail_on=None):
        self.batches, self.fail_on = [], fail_on
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)

    def __call__(self, key, payloads):
        self.batches.append(list(payloads))
        self.started.release()
        self.gate.wait(30)
        if self.fail_on in payloads:
            raise QueryError(f"bad payload {self.fail_on}")
        return [p.upper() for p in payloads]

    async def running(self, n: int):
        """Wait until n more batches have started."""
        for _ in range(n):
            await asyncio.get_running_loop().run_in_executor(None, self.started.acquire)

    def release(self):
        self.gate.set()


def test_batcher_runs_a_lone_request_at_once_and_batches_what_queues_behind_busy_workers():
    async def main(workers, max_wait_ms):
        run = Gated()
        b = Batcher(run, max_batch=8, max_wait_ms=max_wait_ms, workers=workers)
        await b.start()
        first = asyncio.ensure_future(b.submit("k", "a"))
        await run.running(1)  # "a" runs alone: nothing was queued and a worker was free
        rest = [asyncio.ensure_future(b.submit("k", p)) for p in ("b", "c", "d")]
        await asyncio.sleep(0.05)
        run.release()
        out = await asyncio.gather(first, *rest)
        await b.stop()
        return run.batches, out

    # one worker: "b", "c", "d" queue while it is busy and go as one batch when it comes free
    batches, out = asyncio.run(main(1, 0))
    assert batches == [["a"], ["b", "c", "d"]] and out == ["A", "B", "C", "D"]
    # two workers, no window: the free worker takes "b" at once, "c" and "d" queue behind both
    batches, out = asyncio.run(main(2, 0))
    assert batches == [["a"], ["b"], ["c", "d"]] and out == ["A", "B", "C", "D"]
    # two workers, a window longer than the test: beside the busy worker the free one holds the queue
    # open, and takes it all when the first worker comes free (the window bounds the wait)
    batches, out = asyncio.run(main(2, 60_000))
    assert batches == [["a"], ["b", "c", "d"]] and out == ["A", "B", "C", "D"]


def test_batcher_isolates_a_failing_request():
    async def main():
        run = Gated(fail_on="bad")
        b = Batcher(run, max_batch=8, max_wait_ms=0, max_queue=2, workers=1)
        await b.start()
        blocker = asyncio.ensure_future(b.submit("k", "first"))
        await run.running(1)
        pair = [asyncio.ensure_future(b.submit("k", p)) for p in ("a", "bad")]  # queue behind the busy worker
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match="queue full"):
            await b.submit("k", "x")
        run.release()  # the pair's batch fails, then each of its payloads runs alone
        res = await asyncio.gather(blocker, *pair, return_exceptions=True)
        await b.stop()
        return run.batches, res

    batches, (first, a, bad) = asyncio.run(main())
    assert batches[:2] == [["first"], ["a", "bad"]] and sorted(map(tuple, batches[2:])) == [("a",), ("bad",)]
    assert first == "FIRST" and a == "A" and isinstance(bad, QueryError)


def test_batcher_resolves_every_future_with_its_own_answer_waking_the_loop_once_per_batch():
    """Jobs of four keys from 64 concurrent submitters, through two workers: every job gets the answer
    computed from its own payload, or its own error (a payload refused alone, a key whose group raises),
    and the event loop is woken from the workers once per batch, not once per job."""
    batches = []

    def run_group(key, payloads):
        batches.append((key, list(payloads)))
        time.sleep(0.002)  # let jobs queue behind the busy workers, so batches hold several
        if key == "broken":
            raise RuntimeError(f"group {key} failed")
        return [ValueError(f"odd {p}") if p % 2 else (key, p * 10) for p in payloads]

    async def main():
        loop = asyncio.get_running_loop()
        wakes, wake = [], loop.call_soon_threadsafe

        def counting(*args, **kw):
            if threading.current_thread().name.startswith("silverrec-batch"):
                wakes.append(1)
            return wake(*args, **kw)

        loop.call_soon_threadsafe = counting
        dispatched = []
        b = Batcher(run_group, max_batch=8, max_wait_ms=0, workers=2, on_batch=dispatched.append)
        await b.start()
        jobs = [(("a", "b", "c", "broken")[i % 4], i) for i in range(64)]
        res = await asyncio.gather(*(b.submit(k, p) for k, p in jobs), return_exceptions=True)
        await b.stop()
        return jobs, res, len(wakes), dispatched

    jobs, res, wakes, dispatched = asyncio.run(main())
    for (key, p), r in zip(jobs, res):
        if key == "broken":
            assert isinstance(r, RuntimeError) and str(r) == "group broken failed"
        elif p % 2:
            assert isinstance(r, ValueError) and str(r) == f"odd {p}"
        else:
            assert r == (key, p * 10)
    assert sorted(p for _, ps in batches for p in ps) == list(range(64))  # each job computed once
    assert sum(dispatched) == 64 and max(dispatched) > 1  # the queue formed batches
    assert wakes == len(dispatched)  # one wake per batch, shared by its groups (one run_group call each)


# ------------------------------------------------------------------------------------ reload

def test_reload_under_load_loses_no_request(snaps, monkeypatch):
    refs = {v: silverrec.load(snaps[v]) for v in ("v1", "v2")}
    versions = {v: load_served(snaps[v]).version for v in ("v1", "v2")}
    run = start_in_thread(snaps["v1"], ServeConfig(port=0, max_batch=8, max_wait_ms=5, admin_token=TOKEN))
    q = snaps["queries"]
    stop, answers = threading.Event(), []

    def load(c):
        with httpx.Client(base_url=run.url, timeout=30) as client:
            i = c
            while not stop.is_set():
                r = client.post("/v1/search", json={"queries": q[i % 64:i % 64 + 1].tolist(), "k": 5})
                answers.append((i % 64, r))
                i += 7

    threads = [threading.Thread(target=load, args=(c,)) for c in range(6)]
    try:
        for t in threads:
            t.start()
        for n in range(4):
            target = "v2" if n % 2 == 0 else "v1"
            r = post(run.url, "/v1/admin/reload", {"path": str(snaps[target])},
                     headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200 and r.json()["version"] == versions[target], r.text
            time.sleep(0.15)
    finally:
        stop.set()
        for t in threads:
            t.join()
        run.stop()
    assert len(answers) > 20
    by_version = {versions[v]: v for v in versions}
    seen = set()
    for i, r in answers:
        assert r.status_code == 200, r.text
        v = by_version[r.json()["version"]]
        seen.add(v)
        assert r.json()["item_ids"] == refs[v].search(q[i:i + 1], 5).item_ids.tolist()
    assert seen == {"v1", "v2"}


def test_corrupt_snapshot_refused_while_old_keeps_serving(snaps, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(snaps["v2"], bad)
    data = bytearray((bad / "model.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "model.pt2").write_bytes(bytes(data))
    run = start_in_thread(snaps["v1"], ServeConfig(port=0, admin_token=TOKEN))
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        old = httpx.get(run.url + "/v1/model").json()["version"]
        r = post(run.url, "/v1/admin/reload", {"path": str(bad)}, headers=auth)
        assert r.status_code == 409 and f"still serving {old}" in r.json()["detail"]
        assert "model.pt2" in r.json()["detail"]
        r = post(run.url, "/v1/admin/reload", {"path": str(tmp_path / "missing")}, headers=auth)
        assert r.status_code == 409 and "refused" in r.json()["detail"]
        r = post(run.url, "/v1/search", {"queries": snaps["queries"][:1].tolist(), "k": 3})
        assert r.status_code == 200 and r.json()["version"] == old
        r = post(run.url, "/v1/admin/reload", {}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "admin token" in r.json()["detail"]
        assert 'silverrec_reloads_total{result="refused"} 2.0' in httpx.get(run.url + "/metrics").text
    finally:
        run.stop()
    run = start_in_thread(snaps["v1"], ServeConfig(port=0))  # no token: reload disabled
    try:
        r = post(run.url, "/v1/admin/reload", {}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 403 and "reload is disabled" in r.json()["detail"]
    finally:
        run.stop()
    with pytest.raises(SilverrecError, match="refusing to bind non-loopback address 0.0.0.0 without an admin token"):
        check_bind(ServeConfig(host="0.0.0.0", port=0))
    check_bind(ServeConfig(host="0.0.0.0", port=0, admin_token=TOKEN))


def test_clean_shutdown_finishes_in_flight_requests(snaps):
    run = start_in_thread(snaps["v1"], ServeConfig(port=0, max_batch=2, max_wait_ms=0), served=slow(snaps["v1"], 0.3))
    q = snaps["queries"][:1].tolist()
    answers = []
    ts = [threading.Thread(target=lambda: answers.append(post(run.url, "/v1/search", {"queries": q, "k": 3})))
          for _ in range(4)]
    for t in ts:
        t.start()
    t0 = time.monotonic()
    while run.app.server.batcher.in_flight < 4 and time.monotonic() - t0 < 20:
        time.sleep(0.01)
    run.stop()
    for t in ts:
        t.join()
    assert not run.thread.is_alive()
    assert [r.status_code for r in answers] == [200] * 4


def test_cli_serve_starts_answers_and_stops_on_sigterm(snaps):
    env = dict(os.environ, SILVERREC_QUIET="1")
    proc = subprocess.Popen([sys.executable, "-m", "silverrec", "serve", str(snaps["v1"]), "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert m, line
        assert httpx.get(m.group(1) + "/readyz", timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert "stopped (in-flight requests answered)" in proc.stderr.read()


def serve_cli(*args, token=None):
    """`silverrec serve ARGS` in a subprocess -> (process, its first line, the base URL it names or None)."""
    env = dict(os.environ, SILVERREC_QUIET="1", **({"SILVERREC_ADMIN_TOKEN": token} if token else {}))
    proc = subprocess.Popen([sys.executable, "-m", "silverrec", "serve", *map(str, args)], stderr=subprocess.PIPE,
                            text=True, env=env)
    line = proc.stderr.readline()
    m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
    return proc, line, m and m.group(1)


def versions_by_process(url, want=2, tries=400):
    """{process id: version} from /v1/model, a new connection each time, until `want` processes answered."""
    seen = {}
    for _ in range(tries):
        model = httpx.get(url + "/v1/model", timeout=30).json()
        seen.setdefault(model["process"], set()).add(model["version"])
        if len(seen) == want and _ >= 20:
            break
    return seen


def test_processes_share_the_port_and_reload_together(snaps, tmp_path):
    """--workers 2: both processes answer on one port; a reload switches both or, refused, neither."""
    versions = {v: load_served(snaps[v]).version for v in ("v1", "v2")}
    bad = tmp_path / "corrupt"
    shutil.copytree(snaps["v2"], bad)
    (bad / "model.pt2").write_bytes(b"not a program")
    proc, line, url = serve_cli(snaps["v1"], "--port", 0, "--workers", 2, token=TOKEN)
    try:
        assert url and "(2 processes, " in line, line
        seen = versions_by_process(url)
        assert len(seen) == 2 and all(v == {versions["v1"]} for v in seen.values()), seen
        port = url.rsplit(":", 1)[1]  # a second server on the taken port is refused, not let in beside
        second, line2, _ = serve_cli(snaps["v2"], "--port", port, "--workers", 2)
        assert second.wait(120) == 2 and f"cannot bind 127.0.0.1:{port}" in line2, line2
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = post(url, "/v1/admin/reload", {"path": str(snaps["v2"])}, headers=auth)
        assert r.status_code == 200 and r.json()["version"] == versions["v2"], r.text
        seen = versions_by_process(url)
        assert len(seen) == 2 and all(v == {versions["v2"]} for v in seen.values()), seen
        r = post(url, "/v1/admin/reload", {"path": str(bad)}, headers=auth)
        assert r.status_code == 409 and f"still serving {versions['v2']}" in r.json()["detail"], r.text
        seen = versions_by_process(url)
        assert len(seen) == 2 and all(v == {versions["v2"]} for v in seen.values()), seen
        q = snaps["queries"][:2]
        r = post(url, "/v1/search", {"queries": q.tolist(), "k": 3})
        assert r.status_code == 200 and r.json()["item_ids"] == silverrec.load(snaps["v2"]).search(q, 3).item_ids.tolist()
        for _ in range(20):  # /metrics adds up both processes, whichever answers
            text = httpx.get(url + "/metrics", timeout=30).text
            served = {m.group(1): float(m.group(2)) for m in
                      re.finditer(r'silverrec_snapshot_info\{[^}]*version="([^"]+)"[^}]*\} ([\d.]+)', text)}
            assert served == {versions["v1"]: 0.0, versions["v2"]: 2.0}, served
            assert 'silverrec_reloads_total{result="ok"} 2.0' in text and 'result="refused"} 2.0' in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    assert "stopped (in-flight requests answered)" in proc.stderr.read()


def test_processes_that_cannot_load_stop_with_the_reason(tmp_path):
    proc, line, _ = serve_cli(tmp_path / "missing", "--port", 0, "--workers", 2)
    try:
        assert proc.wait(120) == 2
    finally:
        proc.kill()
    assert "is not a snapshot directory" in line + proc.stderr.read()


def test_cli_serve_refuses_non_loopback_without_token(snaps, monkeypatch, capsys):
    from silverrec.cli import main

    monkeypatch.delenv("SILVERREC_ADMIN_TOKEN", raising=False)
    assert main(["serve", str(snaps["v1"]), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "refusing to bind non-loopback address 0.0.0.0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ tune

def test_tune_writes_a_table_serve_reads(snaps, tmp_path):
    from silverrec.serving.tune import tune

    out = tmp_path / "t.json"
    table = tune(snaps["v1"], out, seconds=0.05, workers=(1, 2), threads=(1,), levels=(1, 8), processes=(),
                 log=lambda s: None)
    assert [r["concurrency"] for r in table["best"]] == [1, 8]
    assert table["processes"] is None and table["process_results"] == []
    sizes = [r["batch"] for r in table["batch_results"]]
    assert sizes == [1, 2, 4, 8, 16, 32, 64] and table["max_batch"] in sizes
    from silverrec.serving.tune import choose_max_batch
    assert table["max_batch"] == choose_max_batch(table["batch_results"])
    # the window is measured (none and the time of one request alone) only where it acts: two batch
    # workers and a largest batch above 1
    windows = sorted({r["max_wait_ms"] for r in table["results"]})
    assert windows == ([0.0] if table["max_batch"] == 1 else [0.0, round(table["batch_results"][0]["ms_per_request"], 3)])
    assert all(r["max_wait_ms"] == 0.0 for r in table["results"] if r["batch_workers"] == 1)
    assert len(table["results"]) == 2 * (len(windows) + 1) and table["max_wait_ms"] in windows
    policy = TunePolicy.from_file(out)
    assert policy(0) == policy(1) and policy(100) == (table["best"][1]["batch_workers"], table["best"][1]["threads"])
    run = start_in_thread(snaps["v1"], ServeConfig(port=0, tune_file=str(out)))
    try:
        assert post(run.url, "/v1/search", {"queries": snaps["queries"][:2].tolist(), "k": 2}).status_code == 200
    finally:
        run.stop()
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(SilverrecError, match="cannot read tune file"):
        TunePolicy.from_file(tmp_path / "broken.json")


def test_best_on_average_takes_the_best_relative_throughput_over_the_levels():
    from silverrec.serving.tune import best_on_average

    rows = [{"processes": 1, "concurrency": 1, "throughput": 100.0}, {"processes": 2, "concurrency": 1, "throughput": 90.0},
            {"processes": 1, "concurrency": 64, "throughput": 500.0}, {"processes": 2, "concurrency": 64, "throughput": 900.0}]
    assert best_on_average(rows, "processes") == 2  # (1.0 + 0.556) / 2 against (0.9 + 1.0) / 2
    rows[1]["throughput"], rows[3]["throughput"] = 50.0, 500.0
    assert best_on_average(rows, "processes") == 1  # behind at c 1, tied at c 64
    tie = [{"processes": n, "concurrency": 1, "throughput": 10.0} for n in (4, 2, 1)]
    assert best_on_average(tie, "processes") == 1  # the fewer processes on a tie
    # several settings per (window, level): the best of them stands for the window at that level
    windows = [{"max_wait_ms": 0.0, "concurrency": 4, "throughput": 300.0},
               {"max_wait_ms": 0.0, "concurrency": 4, "throughput": 400.0},
               {"max_wait_ms": 0.5, "concurrency": 4, "throughput": 380.0},
               {"max_wait_ms": 0.0, "concurrency": 64, "throughput": 600.0},
               {"max_wait_ms": 0.5, "concurrency": 64, "throughput": 660.0}]
    assert best_on_average(windows, "max_wait_ms") == 0.5  # (0.95 + 1.0) / 2 against (1.0 + 0.909) / 2
    windows[2]["throughput"] = 320.0
    assert best_on_average(windows, "max_wait_ms") == 0.0  # (0.8 + 1.0) / 2 against (1.0 + 0.909) / 2


def test_choose_max_batch_keeps_the_cheapest_size_that_no_smaller_size_makes_dearer_than_alone():
    from silverrec.serving.tune import batch_sizes, choose_max_batch

    def rows(*ms):
        return [{"batch": b, "ms_per_request": m} for b, m in zip(batch_sizes(64), ms)]

    assert batch_sizes(64) == (1, 2, 4, 8, 16, 32, 64) and batch_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert batch_sizes(1) == (1,)
    # recommend-like: every size cheaper per request than alone, the cheapest at 64
    assert choose_max_batch(rows(1.0, 0.6, 0.4, 0.3, 0.25, 0.22, 0.20)) == 64
    # the cheapest in the middle: batches of 64 would cost more per request than batches of 16
    assert choose_max_batch(rows(1.0, 0.6, 0.4, 0.3, 0.25, 0.27, 0.29)) == 16
    # every batch dearer per request than a request alone: batching does not pay
    assert choose_max_batch(rows(0.7, 0.9, 1.0, 1.2, 1.5, 1.7, 1.8)) == 1
    # batch 4 dearer than alone: a limit of 64 would form batches of 4 under some load, so the cheap
    # sizes beyond it are not taken; 2 is the cheapest size before it
    assert choose_max_batch(rows(1.0, 0.9, 1.1, 0.5, 0.4, 0.3, 0.2)) == 2
    # equal to alone is not dearer; the smaller size on a tie
    assert choose_max_batch(rows(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)) == 1
    assert choose_max_batch(rows(1.0, 0.5, 0.5, 1.0, 2.0, 0.1, 0.1)) == 2
    with pytest.raises(SilverrecError, match="cost of a request alone"):
        choose_max_batch([{"batch": 2, "ms_per_request": 0.5}])


def test_measure_batches_computes_the_same_requests_at_every_size():
    from collections import namedtuple

    from silverrec.serving.tune import measure_batches

    Key = namedtuple("Key", "served group")

    class Recorder:
        def __init__(self):
            self.calls = []

        def prepare(self, body):
            return Key(self, "odd" if body == "other" else "main"), body

        def run(self, key, payloads):
            assert key.group == "main"  # the samples' most common group only
            self.calls.append(list(payloads))
            return payloads

    served = Recorder()
    rows = measure_batches(served, ["other"] + list(range(100)), "prepare", (1, 2, 4, 8), 0.0, log=lambda s: None)
    assert [r["batch"] for r in rows] == [1, 2, 4, 8] and all(r["rounds"] == 3 and r["ms_per_request"] >= 0 for r in rows)
    calls = served.calls[1:]  # after the warm-up
    for rnd in range(3):  # each round: 8 requests, taken in turn from the 100, at every size
        want = [(rnd * 8 + i) % 100 for i in range(8)]
        sizes = (1, 2, 4, 8) if rnd % 2 == 0 else (8, 4, 2, 1)  # the order reversed every other round
        for b in sizes:
            got, calls = calls[:8 // b], calls[8 // b:]
            assert [len(c) for c in got] == [b] * (8 // b) and [p for c in got for p in c] == want
    assert calls == []


def serve_args(*argv):
    from silverrec.commands import add_runtime_parsers, serve_config
    import argparse

    parser = argparse.ArgumentParser()
    add_runtime_parsers(parser.add_subparsers())
    return serve_config(parser.parse_args(["serve", *map(str, argv)]))


def test_serve_starts_the_process_count_tune_chose(snaps, tmp_path):
    from silverrec.serving.batcher import cores
    from silverrec.serving.tune import default_tune_path

    snap = tmp_path / "snap"
    shutil.copytree(snaps["v1"], snap)
    assert serve_args(snap).processes == max(1, cores() // 2)  # no tune file: one per two cores
    rows = [{"concurrency": 1, "batch_workers": 1, "threads": 1}]
    default_tune_path(snap).write_text(json.dumps({"processes": 3, "best": rows}))
    config = serve_args(snap)
    assert config.processes == 3 and config.tune_file == str(default_tune_path(snap))
    assert serve_args(snap, "--workers", 1).processes == 1  # --workers wins
    config = serve_args(snap, "--batch-workers", 2)  # the table is not applied, the process count still is
    assert config.processes == 3 and config.tune_file is None
    default_tune_path(snap).write_text(json.dumps({"processes": 0, "best": rows}))
    with pytest.raises(SilverrecError, match="processes must be a positive int, got 0"):
        serve_args(snap)


@pytest.mark.parametrize("n_cores, processes, expected", [
    (1, 1, (1, 1)), (2, 1, (1, 2)), (2, 2, (1, 1)), (8, 1, (4, 2)), (16, 8, (1, 2)), (6, 1, (3, 2)), (3, 1, (1, 3))])
def test_a_process_has_one_batch_worker_per_two_cores_of_its_share(monkeypatch, n_cores, processes, expected):
    import silverrec.serving.batcher as batcher
    from silverrec.serving.processes import default_processes

    monkeypatch.setattr(batcher, "cores", lambda: n_cores)
    assert ServeConfig(processes=processes).compute() == expected
    assert ServeConfig(processes=processes, batch_workers=1, threads=3).compute() == (1, 3)  # flags win
    monkeypatch.setattr("silverrec.serving.processes.cores", lambda: n_cores)
    assert default_processes() == max(1, n_cores // 2)


def test_serve_takes_the_largest_batch_and_window_tune_chose(snaps, tmp_path):
    from silverrec.serving.tune import default_tune_path

    snap = tmp_path / "snap"
    shutil.copytree(snaps["v1"], snap)
    config = serve_args(snap)  # no tune file: batches of up to 64, no window
    assert (config.max_batch, config.max_wait_ms) == (64, 0.0)
    rows = [{"concurrency": 1, "batch_workers": 1, "threads": 1}]
    default_tune_path(snap).write_text(json.dumps({"max_batch": 1, "max_wait_ms": 0.4, "best": rows}))
    config = serve_args(snap)
    assert (config.max_batch, config.max_wait_ms) == (1, 0.4)
    config = serve_args(snap, "--max-batch", 8, "--max-wait-ms", 0)  # the flags win
    assert (config.max_batch, config.max_wait_ms) == (8, 0.0)
    assert serve_args(snap, "--batch-workers", 2).max_batch == 1  # the table is not applied, the batch still is
    for bad, message in (({"max_batch": 0}, "max_batch must be a positive int, got 0"),
                         ({"max_batch": 2.5}, "max_batch must be a positive int, got 2.5"),
                         ({"max_wait_ms": -1}, "max_wait_ms must be a number >= 0, got -1")):
        default_tune_path(snap).write_text(json.dumps({**bad, "best": rows}))
        with pytest.raises(SilverrecError, match=re.escape(message)):
            serve_args(snap)


def test_tune_times_the_requests_it_is_given_and_names_bad_ones(snaps, tmp_path, capsys):
    from silverrec.cli import main

    q = snaps["queries"]
    lines = [json.dumps({"queries": [q[i].tolist()], "k": 3}) for i in range(8)]
    good, out = tmp_path / "requests.jsonl", tmp_path / "t.json"
    good.write_text("\n".join(lines) + "\n")
    assert main(["tune", str(snaps["v1"]), "--out", str(out), "--seconds", "0.05", "--concurrency", "1",
                 "--processes", "", "--requests", str(good)]) == 0
    table = json.loads(out.read_text())
    assert [r["batch"] for r in table["batch_results"]] == [1, 2, 4, 8, 16, 32, 64]
    for text, message in (("{not json", "cannot read --requests"), ("[1, 2]\n", "must hold one JSON object a line"),
                          (json.dumps({"queries": [[0.1, 0.2]], "k": 3}), "query row 0 has 2 values"),
                          (json.dumps({"quries": []}), "do not fit the route's body")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        assert main(["tune", str(snaps["v1"]), "--out", str(out), "--processes", "", "--requests", str(bad)]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk (Debian's package) drives the servers")
def test_tune_measures_server_processes_over_http(snaps, tmp_path):
    from silverrec.serving.tune import tune

    out = tmp_path / "t.json"
    table = tune(snaps["v1"], out, seconds=1, levels=(1, 4), processes=(1, 2), log=lambda s: None)
    rows = table["process_results"]
    assert sorted((r["processes"], r["concurrency"]) for r in rows) == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(r["throughput"] > 0 and r["errors"] == 0 for r in rows)
    assert table["processes"] in (1, 2) and json.loads(out.read_text())["processes"] == table["processes"]


# ------------------------------------------------------------------------------------ recommendation model

@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return rec_setup(tmp_path_factory)


@pytest.fixture(scope="module")
def rec_server(rec):
    run = start_in_thread(rec.snap_dir, ServeConfig(port=0, max_batch=16, max_wait_ms=20))
    yield run
    run.stop()


def test_recommend_and_rank_answer_like_the_snapshot(rec, rec_server):
    snap = silverrec.load(rec.snap_dir)
    users = rec.logs.user_ids[:12].tolist()
    cases = [{"user_id": u, "k": 3 + i % 5, **({"filter": "cat = c1"} if i % 3 == 0 else {}),
              **({"target_recall": 0.5 + 0.1 * (i % 5)} if i % 4 == 1 else {})} for i, u in enumerate(users)]
    answers = parallel(lambda body: post(rec_server.url, "/v1/recommend", body), cases)
    for body, r in zip(cases, answers):
        assert r.status_code == 200, r.text
        k, target = body.pop("k"), body.pop("target_recall", None)
        ref = snap.recommend([body], k=k, **({} if target is None else {"target_recall": target})).to_json()
        assert r.json()["item_ids"] == ref["item_ids"]
        np.testing.assert_allclose(np.array(r.json()["scores"], dtype=np.float32), np.array(ref["scores"]), rtol=1e-4)
    many = post(rec_server.url, "/v1/recommend", {"requests": [{"user_id": users[0]}, {"history": rec.logs.history(users[1])}],
                                                  "k": 4})
    assert many.status_code == 200 and len(many.json()["item_ids"]) == 2
    items = rec.logs.item_ids[:5].tolist()
    r = post(rec_server.url, "/v1/rank", {"user_id": users[0], "items": items})
    assert r.status_code == 200, r.text
    ref = snap.rank({"user_id": users[0]}, items).to_json()
    assert r.json()["item_ids"] == ref["item_ids"]
    np.testing.assert_allclose(np.array(r.json()["scores"], dtype=np.float32), np.array(ref["scores"]), rtol=1e-4)


REC_BAD = [
    ("/v1/recommend", {"user_id": 1}, r"unknown user_id 1: not a user of the snapshot's training logs"),
    ("/v1/recommend", {"history": [999999]}, r"unknown item id 999999"),
    ("/v1/recommend", {}, r"give exactly one of user_id and history"),
    ("/v1/recommend", {"history": [1000], "filter": "colour = red"}, r"colour"),
    ("/v1/recommend", {"history": [1000], "filter": "cat = = c1"}, r"filter syntax error at position \d+"),
    ("/v1/recommend", {"history": [1000], "k": 0}, r"k must be an int in \[1, 300\], got 0"),
    ("/v1/recommend", {"history": [1000], "mode": "fast"}, r"unknown search mode 'fast'"),
    ("/v1/recommend", {"history": [1000], "nprobe": 2, "target_recall": 0.9}, r"give nprobe or target_recall, not both"),
    ("/v1/recommend", {"requests": [{"history": [1000]}], "user_id": 503}, r"either 'requests' or the top-level"),
    ("/v1/rank", {"user_id": 503, "items": [1]}, r"unknown item id 1"),
    ("/v1/search", {"queries": [[0.0] * 16]}, r"does not answer /v1/search"),
]


def test_recommend_errors_name_the_problem(rec_server):
    for path, body, pattern in REC_BAD:
        r = post(rec_server.url, path, body)
        assert r.status_code == 400, (body, r.text)
        assert re.search(pattern, r.json()["detail"]), r.json()["detail"]


def test_bad_users_in_a_batch_get_their_own_errors_and_the_rest_their_answers(rec):
    """Users are checked by the batch's one encoding; when it refuses, each request alone names its fault."""
    from silverrec.serving.schemas import request_models

    served, snap = load_served(rec.snap_dir), silverrec.load(rec.snap_dir)
    Body = request_models().RecommendBody
    users = rec.logs.user_ids[:4].tolist()
    bodies = [Body(user_id=users[0], k=3), Body(user_id=1, k=3), Body(user_id=users[1], k=5),
              Body(requests=[{"user_id": users[2]}, {"history": [999999]}], k=3),
              Body(history=rec.logs.history(users[3]), filter="colour = red", k=3), Body(user_id=users[3], k=4)]
    prepared = [served.prepare_recommend(b) for b in bodies]
    assert len({key for key, _ in prepared}) == 1  # one group: one forward for all
    out = served.run(prepared[0][0], [payload for _, payload in prepared])
    errors = {1: r"^request: unknown user_id 1: not a user", 3: r"^request 1 history: unknown item id 999999",
              4: r"unknown feature 'colour'"}
    for i, (body, answer) in enumerate(zip(bodies, out)):
        if i in errors:
            assert isinstance(answer, QueryError) and re.search(errors[i], str(answer)), (i, answer)
            continue
        got = json.loads(answer)
        ref = snap.recommend([{"user_id": body.user_id}], k=body.k).to_json()
        assert got["item_ids"] == ref["item_ids"] and got["version"] == served.version
        np.testing.assert_allclose(np.array(got["scores"], dtype=np.float32), np.array(ref["scores"]), rtol=1e-4)


# ------------------------------------------------------------------------------------ fuzz: no 500s

FILTER_TOKENS = ["cat", "tags", "c1", "t2", "=", "!=", "IN", "(", ")", ",", "AND", "OR", "NOT", "'", '"', " ", "x",
                 "\\", "é", "0", "-", "cat = c1", "tags IN (t1, t2)"]
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
SEARCH_KEYS = st.sampled_from(["queries", "k", "filter", "nprobe", "max_probe", "mode", "deadline_ms", "other"])
REC_KEYS = st.sampled_from(["user_id", "history", "features", "numeric", "filter", "exclude", "k", "k0", "nprobe",
                            "mode", "requests", "items", "exclude_history"])


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(parts=st.lists(st.sampled_from(FILTER_TOKENS), max_size=10), k=st.integers(-2, 400))
def test_fuzz_filters_never_500(rec_server, rec, parts, k):
    body = {"history": [int(rec.logs.item_ids[0])], "filter": " ".join(parts), "k": k}
    r = post(rec_server.url, "/v1/recommend", body)
    assert r.status_code in (200, 400, 422), r.text


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(SEARCH_KEYS, JSON, max_size=5), rows=st.integers(0, 3), dim=st.sampled_from([0, 15, 16]))
def test_fuzz_search_decoding_never_500(ivf_server, body, rows, dim):
    if rows:
        body.setdefault("queries", [[0.25] * dim] * rows)
    text = json.dumps(body, allow_nan=True)
    r = post(ivf_server.url, "/v1/search", text)
    # a body with a deadline may get the documented 504 once it passes (a 1 ms deadline can pass in the queue)
    allowed = (200, 400, 413, 422) + ((504,) if "deadline_ms" in body else ())
    assert r.status_code in allowed, r.text
    if r.status_code == 504:
        assert "deadline" in r.json()["detail"], r.text


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(REC_KEYS, JSON, max_size=5), path=st.sampled_from(["/v1/recommend", "/v1/rank"]))
def test_fuzz_rec_decoding_never_500(rec_server, body, path):
    r = post(rec_server.url, path, json.dumps(body, allow_nan=True))
    assert r.status_code in (200, 400, 413, 422), r.text


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=64))
def test_fuzz_raw_bytes_never_500(ivf_server, raw):
    r = post(ivf_server.url, "/v1/search", raw)
    assert r.status_code in (400, 422), r.text
