"""Sharded search on torch.distributed: each rank loads its shards, rank 0 fans requests out.

    torchrun --nproc-per-node 2 -m silverrec serve snapshots/sharded --sharded --port 8080   # HTTP on rank 0
    torchrun --nproc-per-node 2 -m silverrec.serving.distributed snapshots/sharded --queries q.npy --k 100
    python -m silverrec.serving.distributed DIR --rank 1 --world-size 2 --init-method tcp://127.0.0.1:29500

Rank r loads shards r, r + W, r + 2W, ... of a sharded snapshot (publish --shards S), each verified
alone; every rank then reports its verification to every other (one all_gather), and all refuse
to start, with the first failing shard named, when any shard fails (`ShardVerificationError`).

One process group after start-up, with a long timeout (CONTROL_TIMEOUT: idle ranks wait in its
broadcast); rank 0 bounds each of its own collectives with `Work.wait(timeout_s)` instead. (A second
group with a short timeout for the data was measured: switching groups within a request cost ~2 ms
of thread wake-ups per request on this loaded 2-core machine, against ~0.5 ms for one group.)
A request on rank 0 (`ShardedRuntime.search`, same surface as `Snapshot.search`) is one broadcast
and one gather:
    1. broadcast a fixed-size uint8 [64 + INLINE] buffer: header int64 [8] (op, B, k, options
       bytes, generation) then the queries and JSON options inline when they fit (else a second
       broadcast of exactly those bytes)
    2. every rank: `shard_topk` of its shards, merged locally       (sharded.py, the one-process code)
    3. gather int64 [1 + B*2k] per rank (status, scores as bits, ids)
    4. rank 0: `merge_topk` of the W parts                          exact, (score desc, item id asc)
Bytes per request: 64 + INLINE (or 64 + INLINE + B*D*4 + options) to each of W-1 ranks,
(1 + 2*B*k) * 8 back from each. No store round trips on the hot path.

A rank that dies makes step 1 or 3 fail on rank 0 at once (closed connection); one that stalls
makes the gather fail after `timeout_s`: the request raises `ShardUnavailableError` (http_status
503) and so does every later one (the group is not usable after a failed collective; restart the
ranks), instead of hanging. After a timeout the group still holds the pending collective, so the
process cannot leave the group cleanly (`wedged`; `silverrec serve --sharded` then exits with
os._exit). Rank 0 sends a header-only keep-alive when idle for KEEPALIVE_S so that idle ranks
never reach CONTROL_TIMEOUT.

Reload (`reload(path)`, rank 0): every rank loads and verifies its shards of the new sharded
snapshot as a new generation, all exchange the outcome (one all_gather, RELOAD_TIMEOUT), and all switch
together only if every rank succeeded; otherwise every rank drops the new generation and keeps
serving the old one. A request names the generation it was validated on; each rank keeps the
current and the previous generation, so requests in flight during a reload finish on their version.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from silverrec.errors import QueryError, SilverrecError, SnapshotError, check_k, check_queries
from silverrec.serving.sharded import ShardVerificationError, load_shard, merge_topk, read_top, routed_rows, shard_topk

OP_STOP, OP_SEARCH, OP_PING, OP_LOAD, OP_NOOP = 0, 1, 2, 3, 4
STATUS_OK, STATUS_REJECTED, STATUS_RETIRED = 0, 1, 2
STARTUP_TIMEOUT = _dt.timedelta(minutes=10)  # rendezvous and the verification all_gather
CONTROL_TIMEOUT = _dt.timedelta(days=1)  # idle ranks wait for the next header this long at most
KEEPALIVE_S = 600.0  # rank 0 sends a header-only round when idle this long (far below CONTROL_TIMEOUT)
RELOAD_TIMEOUT = _dt.timedelta(minutes=10)  # rank 0 waits this long for the other ranks' reload outcome
ERROR_BYTES = 1024  # a rank's reload outcome: utf-8 error message, empty = loaded and verified
HEADER = 64  # bytes: int64 [8] = op, B, k, options bytes, generation, 0, 0, 0
INLINE = 16384  # payload bytes carried in the header broadcast (B*D*4 + options); larger ones follow on `data`


class ShardUnavailableError(RuntimeError):
    """A rank died or stalled past the collective timeout: the request failed (HTTP 503)."""

    http_status = 503


@dataclass
class Generation:
    """One loaded version of the sharded snapshot on one rank."""

    path: Path
    manifest: dict[str, Any]
    centroids: Optional[torch.Tensor]
    shard_ids: list[int]
    shards: list  # predictor.Snapshot per shard id


def rank_device(device: str | torch.device, rank: int) -> str | torch.device:
    """The device a rank's shards run on: "cuda" (no index) on a host with several GPUs is this
    rank's own, cuda:(LOCAL_RANK or rank) % count; anything else as given ("cpu", "cuda:N")."""
    import os

    if str(device) != "cuda" or not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return device
    return f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) % torch.cuda.device_count()}"


def load_generation(path: str | Path, rank: int, world_size: int, backend: str = "auto", verify: bool = True,
                    device: str | torch.device = "cpu") -> Generation:
    """This rank's shards (r, r + W, ...) of the sharded snapshot at `path`, each verified alone and
    loaded onto `rank_device(device, rank)`."""
    path = Path(path)
    manifest, centroids = read_top(path, verify=verify)
    count = len(manifest["config"]["shards"])
    if not 1 <= world_size <= count:
        raise ShardVerificationError(f"{world_size} ranks for {count} shards: run at most one rank per shard")
    shard_ids = list(range(rank, count, world_size))
    dev = rank_device(device, rank)
    return Generation(path, manifest, centroids, shard_ids,
                      [load_shard(path, manifest, i, backend, verify, dev) for i in shard_ids])


class ShardedRuntime:
    """One rank of a sharded deployment. Rank 0 answers `search` (and `reload`); the other ranks run `serve()`.

    Args:
        path: sharded snapshot directory (top manifest).
        rank, world_size: this process and the group (world_size <= shard count).
        init_method: torch.distributed rendezvous ("env://" under torchrun, or tcp://HOST:PORT).
        timeout_s: collective timeout of a request (the gather, an oversized payload's broadcast).
        backend: program backend of the shards ("auto" | "export" | "torchscript").
        device: where the shards' programs run ("cpu", "cuda", "cuda:N"; `rank_device`); requests
            and answers cross the group as CPU tensors either way.
    Raises:
        ShardVerificationError: on every rank, when any rank's shard fails verification.
    """

    def __init__(self, path: str | Path, *, rank: int, world_size: int, init_method: str = "env://",
                 timeout_s: float = 5.0, backend: str = "auto", verify: bool = True, device: str = "cpu"):
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.backend_name, self.verify, self.device = backend, verify, device
        self.dead: Optional[str] = None
        self.wedged = False
        self._local_error: Optional[str] = None
        error, gen = None, None
        try:
            gen = load_generation(path, rank, world_size, backend, verify, device)
        except SnapshotError as e:
            error = f"rank {rank}: {e}"
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=STARTUP_TIMEOUT)
        errors: list = [None] * world_size
        dist.all_gather_object(errors, error)
        bad = [e for e in errors if e is not None]
        if bad:
            dist.destroy_process_group()
            raise ShardVerificationError(f"refusing to start: {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        self.group = dist.new_group(timeout=CONTROL_TIMEOUT)
        self.wedged = False  # a collective timed out and is still pending in the group
        self.gens: dict[int, Generation] = {0: gen}
        self.current, self._next_gen = 0, 1
        self.requests = 0
        self._buf = torch.zeros(HEADER + INLINE, dtype=torch.uint8)  # the header broadcast, reused
        self._hdr = self._buf[:HEADER].view(torch.int64)
        self._lock = threading.Lock()  # one round at a time (batcher workers, reloads, keep-alive)
        self._last = time.monotonic()
        self._closed = threading.Event()
        if rank == 0:
            threading.Thread(target=self._keepalive, daemon=True, name="silverrec-keepalive").start()

    # ------------------------------------------------------------------ generations

    @property
    def path(self) -> Path:
        return self.gens[self.current].path

    @property
    def manifest(self) -> dict[str, Any]:
        return self.gens[self.current].manifest

    @property
    def shards(self) -> list:
        return self.gens[self.current].shards

    @property
    def shard_ids(self) -> list[int]:
        return self.gens[self.current].shard_ids

    @property
    def dim(self) -> int:
        return int(self.manifest["config"]["dim"])

    @property
    def kind(self) -> str:
        return self.manifest["config"]["base_kind"]

    def view(self, gen: Optional[int] = None) -> "RuntimeView":
        """Generation `gen` (default: the current one) behind the predictor surface (rank 0)."""
        return RuntimeView(self, self.current if gen is None else gen)

    # ------------------------------------------------------------------ rank 0

    def search(self, queries, k: int, gen: Optional[int] = None, **options: Any):
        """Top-k over all shards on all ranks (rank 0 only) -> SearchResult; ShardUnavailableError
        when a rank is gone. `gen`: the generation to answer from (default: the current one)."""
        from silverrec.serving.predictor import SearchResult

        if self.rank != 0:
            raise SilverrecError("only rank 0 answers requests; the other ranks run serve()")
        gen = self.current if gen is None else gen
        g = self.gens.get(gen)
        if isinstance(queries, np.ndarray):
            queries = torch.from_numpy(queries)
        dim = int((g or self.gens[self.current]).manifest["config"]["dim"])
        queries = check_queries(queries, dim)
        if g is not None:
            check_k(k, g.manifest["item_count"])
        try:
            opts = json.dumps(options).encode()
        except TypeError:
            raise QueryError(f"search options must be JSON values (strings, ints, lists), got {sorted(options)}") from None
        parts = self._round(OP_SEARCH, queries, k, opts, gen)
        status = parts[:, 0]
        if bool((status == STATUS_RETIRED).any()):
            raise ShardUnavailableError(f"snapshot generation {gen} was replaced by two reloads while this request "
                                        "waited; retry")
        if bool((status != STATUS_OK).any()):
            r = int(torch.nonzero(status)[0, 0])
            raise QueryError(self._local_error if r == 0 and self._local_error else f"shards on rank {r} rejected the request")
        scores, ids = _unpack(parts[:, 1:], queries.shape[0], k)
        s, i = merge_topk(list(scores), list(ids), k)
        return SearchResult(item_ids=i, scores=s)

    def ping(self, batch: int, k: int) -> None:
        """One request's collectives with no search (the benchmark's collective cost)."""
        self._round(OP_PING, torch.zeros(batch, self.dim), k, b"{}", self.current)

    def reload(self, path: str | Path) -> "RuntimeView":
        """Every rank loads and verifies its shards of `path`; all switch together, or none does.

        Raises:
            ShardVerificationError: a rank's shard failed (every rank keeps the old generation).
            ShardUnavailableError: a rank is gone.
        """
        if self.rank != 0:
            raise SilverrecError("only rank 0 starts a reload")
        opts = json.dumps({"path": str(Path(path).resolve())}).encode()
        with self._lock:
            self._check_alive()
            gen = self._next_gen
            self._next_gen += 1
            try:
                late = self._send_header(OP_LOAD, 0, 0, opts, gen)
                if late is not None:
                    self._wait(dist.broadcast(late, 0, group=self.group, async_op=True))
                self._load_and_agree(gen, opts)
            except RuntimeError as e:
                if isinstance(e, ShardVerificationError):
                    raise
                raise self._fail(e) from None
            return self.view(gen)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise ShardUnavailableError(f"sharded runtime unavailable: {self.dead}")

    def _wait(self, work, timeout: Optional[_dt.timedelta] = None) -> None:
        """Rank 0: wait for an async collective at most `timeout` (default: the request timeout)."""
        work.wait(timeout=timeout or _dt.timedelta(seconds=self.timeout_s))

    def _fail(self, e: BaseException) -> ShardUnavailableError:
        self.wedged = self.wedged or "timed out" in str(e).lower()
        self.dead = f"a rank stopped answering ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        return ShardUnavailableError(f"request failed: {self.dead}")

    def _send_header(self, op: int, B: int, k: int, payload: bytes | torch.Tensor, gen: int,
                     pending: Optional[list] = None) -> Optional[torch.Tensor]:
        """Broadcast the header (and the payload inline when it fits) -> the payload still to send, or None.
        With `pending`, the broadcast's Work is appended there for the caller to wait on later."""
        n = len(payload)
        self._hdr[:5] = torch.tensor([op, B, k, n, gen], dtype=torch.int64)
        late = None
        if n <= INLINE:
            if n:
                src = payload if isinstance(payload, torch.Tensor) else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                self._buf[HEADER:HEADER + n] = src
        else:
            late = payload if isinstance(payload, torch.Tensor) else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        work = dist.broadcast(self._buf, 0, group=self.group, async_op=True)
        if pending is None:
            self._wait(work)
        else:
            pending.append(work)
        return late

    def _round(self, op: int, queries: torch.Tensor, k: int, opts: bytes, gen: int) -> torch.Tensor:
        B = queries.shape[0]
        q = queries.contiguous()
        payload = torch.cat([q.view(torch.uint8).reshape(-1), torch.frombuffer(bytearray(opts), dtype=torch.uint8)])
        with self._lock:
            self._check_alive()
            try:
                sends: list = []  # rank 0 searches its shards while the broadcasts go out
                late = self._send_header(op, B, k, payload, gen, sends)
                if late is not None:
                    sends.append(dist.broadcast(late, 0, group=self.group, async_op=True))
                self.requests += 1
                mine = self._local(op, q, k, opts, gen)
                out = [torch.empty_like(mine) for _ in range(self.world_size)]
                self._wait(dist.gather(mine, out, dst=0, group=self.group, async_op=True))
                for work in sends:  # done by now (the gather came back); the buffer may be reused
                    self._wait(work)
            except RuntimeError as e:  # gloo errors, timeouts, a closed connection
                raise self._fail(e) from None
            finally:
                self._last = time.monotonic()
        return torch.stack(out)

    def _keepalive(self) -> None:
        while not self._closed.wait(min(60.0, KEEPALIVE_S)):
            if self.dead is not None:
                return
            if time.monotonic() - self._last < KEEPALIVE_S:
                continue
            with self._lock:
                if self._closed.is_set() or self.dead is not None:
                    return
                try:
                    self._send_header(OP_NOOP, 0, 0, b"", self.current)
                except RuntimeError as e:
                    self._fail(e)
                    return
                self._last = time.monotonic()

    def close(self) -> None:
        """Stop the other ranks (rank 0) and leave the group."""
        self._closed.set()
        if not dist.is_initialized():
            return
        if self.rank == 0 and self.dead is None:
            with self._lock:
                try:
                    self._send_header(OP_STOP, 0, 0, b"", self.current)
                    self._wait(dist.barrier(group=self.group, async_op=True))  # they have it before the connections close
                except RuntimeError as e:
                    self._fail(e)
        if not self.wedged:  # a pending collective would block destroy until CONTROL_TIMEOUT
            dist.destroy_process_group()

    # ------------------------------------------------------------------ every rank

    def _load_and_agree(self, gen: int, opts: bytes) -> None:
        """Load generation `gen` (its path in `opts`), exchange outcomes, switch together or drop it."""
        error, new = None, None
        try:
            new = load_generation(json.loads(opts)["path"], self.rank, self.world_size, self.backend_name, self.verify,
                                  self.device)
        except SnapshotError as e:
            error = f"rank {self.rank}: {e}"
        except Exception as e:  # noqa: BLE001  (any failure refuses the snapshot, on every rank)
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        mine = torch.zeros(ERROR_BYTES, dtype=torch.uint8)
        if error is not None:
            raw = error.encode()[:ERROR_BYTES]
            mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        outcomes = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(outcomes, mine, group=self.group, async_op=True)
        if self.rank == 0:
            self._wait(work, RELOAD_TIMEOUT)
        else:
            work.wait()
        bad = [t.numpy().tobytes().rstrip(b"\0").decode(errors="replace") for t in outcomes]
        bad = [e for e in bad if e]
        if bad:
            raise ShardVerificationError(f"reload refused on every rank: {bad[0]}"
                                         + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        previous = self.current
        self.gens = {g: v for g, v in self.gens.items() if g == previous}  # keep the previous for in-flight requests
        self.gens[gen] = new
        self.current = gen

    def _local(self, op: int, queries: torch.Tensor, k: int, opts: bytes, gen: int) -> torch.Tensor:
        """This rank's part: int64 [1 + B*2k] = status, then its shards' merged top-k (packed)."""
        B = queries.shape[0]
        out = torch.zeros(1 + 2 * B * k, dtype=torch.int64)
        if op == OP_PING:
            return out
        g = self.gens.get(gen)
        if g is None:
            out[0] = STATUS_RETIRED
            return out
        self._local_error = None
        try:
            options = json.loads(opts)
            cfg = g.manifest["config"]
            parts_s, parts_i = [], []
            for i, snap in zip(g.shard_ids, g.shards):
                rows = routed_rows(g.centroids, cfg["shards"][i]["clusters"], queries, k, options, snap.config)
                s, ids = shard_topk(snap, queries, k, options, rows)
                parts_s.append(s)
                parts_i.append(ids)
            s, ids = merge_topk(parts_s, parts_i, k) if len(parts_s) > 1 else (parts_s[0], parts_i[0])
            out[1:] = _pack(s, ids)
        except SilverrecError as e:
            self._local_error = str(e)
            out[0] = STATUS_REJECTED
        return out

    def serve(self) -> None:
        """Ranks > 0: answer rank 0's requests until it stops them. Raises RuntimeError when rank 0 is gone."""
        buf, hdr = self._buf, self._hdr
        while True:
            dist.broadcast(buf, 0, group=self.group)
            op, B, k, n, gen = (int(x) for x in hdr[:5])
            if op == OP_STOP:
                dist.barrier(group=self.group)
                return
            if op == OP_NOOP:
                continue
            if n <= INLINE:
                payload = buf[HEADER:HEADER + n].clone()
            else:
                payload = torch.empty(n, dtype=torch.uint8)
                dist.broadcast(payload, 0, group=self.group)
            if op == OP_LOAD:
                try:
                    self._load_and_agree(gen, payload.numpy().tobytes())
                except ShardVerificationError:
                    pass  # rank 0 reports it; every rank keeps the old generation
                continue
            self.requests += 1
            qbytes = B * self.dim * 4 if gen not in self.gens else B * int(self.gens[gen].manifest["config"]["dim"]) * 4
            queries = payload[:qbytes].view(torch.float32).reshape(B, -1)
            mine = self._local(op, queries, k, payload[qbytes:].numpy().tobytes(), gen)
            dist.gather(mine, None, dst=0, group=self.group)


class RuntimeView:
    """One generation of a runtime behind the predictor surface that served.Served wraps (rank 0):
    path, manifest, config, kind, backend, template, search."""

    def __init__(self, runtime: ShardedRuntime, gen: int):
        self.runtime, self.gen = runtime, gen
        g = runtime.gens[gen]
        self.path, self.manifest, self.centroids = g.path, g.manifest, g.centroids
        self.template = g.shards[0]  # rank 0 holds shard 0: the global search config and filter vocabulary

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["config"]

    @property
    def kind(self) -> str:
        return self.config["base_kind"]

    @property
    def backend(self) -> str:
        return f"{self.template.backend} x {self.runtime.world_size} gloo ranks"

    @property
    def unavailable(self) -> Optional[str]:
        """Why the runtime cannot answer (a rank is gone), or None."""
        return self.runtime.dead

    def search(self, queries, k: int, **options: Any):
        return self.runtime.search(queries, k, gen=self.gen, **options)

    def recommend(self, *args: Any, **kwargs: Any):
        raise QueryError("sharded snapshots answer search requests; sharded recommendation models are not built yet")


def spawn_workers(path: str | Path, world_size: int, init_method: str, timeout_s: float = 5.0, stderr=None,
                  device: str = "cpu") -> list:
    """Ranks 1..world_size-1 as local subprocesses (this process then joins as rank 0): the
    launcher for tests, benchmarks and one-host deployments without torchrun."""
    import os
    import subprocess

    env = dict(os.environ, SILVERREC_QUIET="1")
    return [subprocess.Popen([sys.executable, "-m", "silverrec.serving.distributed", str(path), "--rank", str(r),
                              "--world-size", str(world_size), "--init-method", init_method, "--timeout", str(timeout_s),
                              "--device", str(device)],
                             env=env, stdout=subprocess.DEVNULL, stderr=stderr or subprocess.DEVNULL)
            for r in range(1, world_size)]


def _pack(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(float32 [B, k], int64 [B, k]) -> int64 [B*2k]: score bits (int32 widened), then ids."""
    return torch.cat([scores.contiguous().view(torch.int32).to(torch.int64).reshape(-1), ids.reshape(-1)])


def _unpack(packed: torch.Tensor, B: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [W, B*2k] -> (scores float32 [W, B, k], ids int64 [W, B, k])."""
    n = B * k
    scores = packed[:, :n].to(torch.int32).view(torch.float32).reshape(-1, B, k)
    return scores, packed[:, n:].reshape(-1, B, k)


# ----------------------------------------------------------------------------------- HTTP launcher

def served_view(runtime: ShardedRuntime, path: Optional[str | Path] = None):
    """served.Served over the runtime's current generation, or over `path` after an all-or-none reload."""
    from silverrec.serving.served import Served

    served = Served(runtime.view() if path is None else runtime.reload(path))
    served.smoke()
    return served


def serve_http(path: str | Path, config, *, rank: int, world_size: int, init_method: str = "env://",
               timeout_s: float = 5.0) -> int:
    """`silverrec serve DIR --sharded`: rank 0 runs serving/app.py's app and batcher over the runtime
    (`served_view`), reloads go through `ShardedRuntime.reload`; other ranks serve their shards.

    Raises:
        ShardVerificationError: on every rank, when any shard fails verification (nothing is bound).
    """
    import os

    from silverrec.serving.server import check_bind, serve

    if rank == 0:
        check_bind(config)
    rt = ShardedRuntime(path, rank=rank, world_size=world_size, init_method=init_method, timeout_s=timeout_s,
                        device=config.device)
    try:
        if rank != 0:
            print(f"silverrec: rank {rank}/{world_size} serving shards {rt.shard_ids} of {rt.path}", file=sys.stderr, flush=True)
            try:
                rt.serve()
            except RuntimeError as e:
                rt.dead = "rank 0 is gone"
                print(f"silverrec: rank {rank}: rank 0 is gone ({str(e).splitlines()[0][:200] if str(e) else ''})",
                      file=sys.stderr, flush=True)
                return 3
            return 0
        code = serve(path, config, served=served_view(rt), loader=lambda p: served_view(rt, p))
    finally:
        if rt.dead is None or rank == 0:
            rt.close()
    if rt.wedged:  # a collective timed out on a stalled rank and is still pending: leaving would block
        print(f"silverrec: {rt.dead}; exiting without leaving the group", file=sys.stderr, flush=True)
        os._exit(3)
    return code


def main(argv: Optional[list[str]] = None) -> int:
    """Launcher: torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment) or explicit flags.
    Rank 0 answers --queries once (JSON to stdout) and stops the group; other ranks serve."""
    import os

    p = argparse.ArgumentParser(prog="python -m silverrec.serving.distributed")
    p.add_argument("snapshot")
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    p.add_argument("--world-size", dest="world_size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    p.add_argument("--init-method", dest="init_method", default="env://")
    p.add_argument("--timeout", type=float, default=5.0, help="collective timeout per request, seconds")
    p.add_argument("--queries", default=None, help="rank 0: .npy float32 [B, D] to answer")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--nprobe", type=int, default=None)
    p.add_argument("--filter", default=None)
    p.add_argument("--device", default="cpu", help="where the shards' programs run: cpu (default), cuda, cuda:N")
    args = p.parse_args(argv)
    try:
        rt = ShardedRuntime(args.snapshot, rank=args.rank, world_size=args.world_size,
                            init_method=args.init_method, timeout_s=args.timeout, device=args.device)
    except SilverrecError as e:
        print(f"silverrec: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.rank != 0:
            rt.serve()
            return 0
        if args.queries is not None:
            opts = {n: getattr(args, n) for n in ("nprobe", "filter") if getattr(args, n) is not None}
            print(json.dumps(rt.search(np.load(args.queries), args.k, **opts).to_json()))
        return 0
    except (SilverrecError, ShardUnavailableError) as e:
        print(f"silverrec: error: {e}", file=sys.stderr)
        return 3 if isinstance(e, ShardUnavailableError) else 2
    finally:
        rt.close()


if __name__ == "__main__":
    sys.exit(main())
