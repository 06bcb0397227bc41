"""Sharded search on torch.distributed: each rank loads its shards, rank 0 fans requests out.

    torchrun --nproc-per-node 2 -m silverrec.serving.distributed snapshots/sharded --queries q.npy --k 100
    python -m silverrec.serving.distributed DIR --rank 1 --world-size 2 --init-method tcp://127.0.0.1:29500

Rank r loads shards r, r + W, r + 2W, ... of a sharded snapshot (publish --shards S), each verified
alone; every rank then reports its verification to every other (one all_gather), and all refuse
to start, with the first failing shard named, when any shard fails (`ShardVerificationError`).

A request on rank 0 (`ShardedRuntime.search`, same surface as `Snapshot.search`):
    1. the header "op,B,k,options bytes" under key req/<n> in the group's store (idle ranks wait
       on the key: no collective is ever left waiting without a timeout)
    2. broadcast the payload uint8 [B*D*4 + options]               data group, `timeout_s`
    3. every rank: `shard_topk` of its shards, merged locally       (sharded.py, the one-process code)
    4. gather int64 [1 + B*2k] per rank (status, scores as bits, ids) data group, `timeout_s`
    5. rank 0: `merge_topk` of the W parts                          exact, (score desc, item id asc)
Bytes per request: header ~20 (store) + B*D*4 + options to each of W-1 ranks, (1 + 2*B*k) * 8 back from each.

A rank that dies or stalls makes step 2 or 4 fail on rank 0 within `timeout_s`: the request raises
`ShardUnavailableError` (http_status 503) and so does every later one (the group is not usable
after a failed collective; restart the ranks), instead of hanging.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from silverrec.errors import QueryError, SilverrecError, SnapshotError, check_k, check_queries
from silverrec.serving.sharded import ShardVerificationError, load_shard, merge_topk, read_top, routed_rows, shard_topk

OP_STOP, OP_SEARCH, OP_PING = 0, 1, 2
STARTUP_TIMEOUT = _dt.timedelta(minutes=10)  # rendezvous and the verification all_gather
POLL = _dt.timedelta(seconds=2)  # an idle rank re-checks its request key this often


class ShardUnavailableError(RuntimeError):
    """A rank died or stalled past the collective timeout: the request failed (HTTP 503)."""

    http_status = 503


class ShardedRuntime:
    """One rank of a sharded deployment. Rank 0 answers `search`; the other ranks run `serve()`.

    Args:
        path: sharded snapshot directory (top manifest).
        rank, world_size: this process and the group (world_size <= shard count).
        init_method: torch.distributed rendezvous ("env://" under torchrun, or tcp://HOST:PORT).
        timeout_s: collective timeout of a request (payload broadcast, gather).
        backend: program backend of the shards ("auto" | "export" | "torchscript").
    Raises:
        ShardVerificationError: on every rank, when any rank's shard fails verification.
    """

    def __init__(self, path: str | Path, *, rank: int, world_size: int, init_method: str = "env://",
                 timeout_s: float = 5.0, backend: str = "auto", verify: bool = True):
        self.path, self.rank, self.world_size, self.timeout_s = Path(path), rank, world_size, float(timeout_s)
        self.dead: Optional[str] = None
        error, self.shards = None, []
        try:
            self.manifest, self.centroids = read_top(self.path, verify=verify)
            count = len(self.manifest["config"]["shards"])
            if not 1 <= world_size <= count:
                raise ShardVerificationError(f"{world_size} ranks for {count} shards: run at most one rank per shard")
            self.shard_ids = list(range(rank, count, world_size))
            self.shards = [load_shard(self.path, self.manifest, i, backend, verify) for i in self.shard_ids]
        except SnapshotError as e:
            error = f"rank {rank}: {e}"
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=STARTUP_TIMEOUT)
        errors: list = [None] * world_size
        dist.all_gather_object(errors, error)
        bad = [e for e in errors if e is not None]
        if bad:
            dist.destroy_process_group()
            raise ShardVerificationError(f"refusing to start: {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        self.data = dist.new_group(timeout=_dt.timedelta(seconds=self.timeout_s))
        self.store = dist.distributed_c10d._get_default_store()  # the rendezvous store (private accessor)
        self.requests = 0
        cfg = self.manifest["config"]
        self.kind, self.dim = cfg["base_kind"], int(cfg["dim"])

    # ------------------------------------------------------------------ rank 0

    def search(self, queries, k: int, **options: Any):
        """Top-k over all shards on all ranks (rank 0 only) -> SearchResult; ShardUnavailableError
        when a rank is gone."""
        from silverrec.serving.predictor import SearchResult

        if self.rank != 0:
            raise SilverrecError("only rank 0 answers requests; the other ranks run serve()")
        if isinstance(queries, np.ndarray):
            queries = torch.from_numpy(queries)
        queries = check_queries(queries, self.dim)
        check_k(k, self.manifest["item_count"])
        try:
            opts = json.dumps(options).encode()
        except TypeError:
            raise QueryError(f"search options must be JSON values (strings, ints, lists), got {sorted(options)}") from None
        parts = self._round(OP_SEARCH, queries, k, opts)
        status = parts[:, 0]
        if bool((status != 0).any()):
            r = int(torch.nonzero(status)[0, 0])
            raise QueryError(self._local_error if r == 0 else f"shards on rank {r} rejected the request")
        scores, ids = _unpack(parts[:, 1:], queries.shape[0], k)
        s, i = merge_topk(list(scores), list(ids), k)
        return SearchResult(item_ids=i, scores=s)

    def ping(self, batch: int, k: int) -> None:
        """One request's collectives with no search (the benchmark's collective cost)."""
        self._round(OP_PING, torch.zeros(batch, self.dim), k, b"{}")

    def _round(self, op: int, queries: torch.Tensor, k: int, opts: bytes) -> torch.Tensor:
        if self.dead is not None:
            raise ShardUnavailableError(f"sharded runtime unavailable: {self.dead}")
        B = queries.shape[0]
        payload = torch.cat([queries.contiguous().view(torch.uint8).reshape(-1),
                             torch.frombuffer(bytearray(opts), dtype=torch.uint8)])
        try:
            key = f"req/{self.requests}"
            self.store.set(key, f"{op},{B},{k},{len(opts)}")
            self.requests += 1
            dist.broadcast(payload, 0, group=self.data)
            mine = self._local(op, queries, k, opts)
            out = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.gather(mine, out, dst=0, group=self.data)
            self.store.delete_key(key)  # every rank read it before the gather completed
        except RuntimeError as e:  # gloo errors, timeouts, a closed connection
            self.dead = f"a rank stopped answering ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            raise ShardUnavailableError(f"request failed: {self.dead}") from None
        return torch.stack(out)

    def close(self) -> None:
        """Stop the other ranks (rank 0) and leave the group."""
        if not dist.is_initialized():
            return
        if self.rank == 0 and self.dead is None:
            self.store.set(f"req/{self.requests}", f"{OP_STOP},0,0,0")
            dist.barrier(group=self.data)  # the others have read it: the store may go
        dist.destroy_process_group()

    # ------------------------------------------------------------------ every rank

    def _local(self, op: int, queries: torch.Tensor, k: int, opts: bytes) -> torch.Tensor:
        """This rank's part: int64 [1 + B*2k] = status, then its shards' merged top-k (packed)."""
        B = queries.shape[0]
        out = torch.zeros(1 + 2 * B * k, dtype=torch.int64)
        if op == OP_PING:
            return out
        self._local_error = None
        try:
            options = json.loads(opts)
            parts_s, parts_i = [], []
            for i, snap in zip(self.shard_ids, self.shards):
                rows = routed_rows(self.kind, self.centroids, self.manifest["config"]["shards"][i]["clusters"],
                                   queries, options, int(self.manifest["config"].get("default_nprobe", 1)))
                s, ids = shard_topk(snap, queries, k, options, rows)
                parts_s.append(s)
                parts_i.append(ids)
            s, ids = merge_topk(parts_s, parts_i, k) if len(parts_s) > 1 else (parts_s[0], parts_i[0])
            out[1:] = _pack(s, ids)
        except SilverrecError as e:
            self._local_error = str(e)
            out[0] = 1
        return out

    def serve(self) -> None:
        """Ranks > 0: answer rank 0's requests until it stops them (or dies)."""
        while True:
            key = f"req/{self.requests}"
            while True:
                try:
                    self.store.wait([key], POLL)
                    break
                except RuntimeError as e:  # a timeout: keep waiting; anything else: rank 0 is gone
                    if "imeout" not in str(e):
                        raise
            op, B, k, nopts = (int(x) for x in self.store.get(key).decode().split(","))
            self.requests += 1
            if op == OP_STOP:
                dist.barrier(group=self.data)
                return
            payload = torch.empty(B * self.dim * 4 + nopts, dtype=torch.uint8)
            dist.broadcast(payload, 0, group=self.data)
            queries = payload[: B * self.dim * 4].view(torch.float32).reshape(B, self.dim)
            mine = self._local(op, queries, k, payload[B * self.dim * 4 :].numpy().tobytes())
            dist.gather(mine, None, dst=0, group=self.data)


def spawn_workers(path: str | Path, world_size: int, init_method: str, timeout_s: float = 5.0, stderr=None) -> list:
    """Ranks 1..world_size-1 as local subprocesses (this process then joins as rank 0): the
    launcher for tests, benchmarks and one-host deployments without torchrun."""
    import os
    import subprocess

    env = dict(os.environ, SILVERREC_QUIET="1")
    return [subprocess.Popen([sys.executable, "-m", "silverrec.serving.distributed", str(path), "--rank", str(r),
                              "--world-size", str(world_size), "--init-method", init_method, "--timeout", str(timeout_s)],
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
    args = p.parse_args(argv)
    try:
        rt = ShardedRuntime(args.snapshot, rank=args.rank, world_size=args.world_size,
                            init_method=args.init_method, timeout_s=args.timeout)
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
