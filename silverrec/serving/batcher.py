"""Server-side dynamic batching: a bounded queue, dispatch at once when a worker is free, batches from
what queues while the workers are busy, per-request deadlines.

    >>> batcher = Batcher(run_group, max_batch=64, max_wait_ms=0, max_queue=1024, workers=2)
    >>> await batcher.start()
    >>> result = await batcher.submit(key, payload, deadline=time.monotonic() + 0.1)

A *job* is one validated request: a group `key` and a `payload`. A job that arrives while a worker
is free and nothing is queued runs at once, alone: an idle server adds no wait to a request. Jobs
that arrive while every worker is busy queue, and the next worker to come free takes up to
`max_batch` of them as one batch, so batches grow with the load and no further. With several
workers, a free worker beside a busy one may hold a short queue open for up to `max_wait_ms` (from
its oldest job's arrival) to let a fuller batch form; the window bounds that wait and is never a
minimum (0 = never hold). A batch drops the jobs whose deadline passed (`DeadlineExceeded`, before
any compute), groups the rest by key and calls `run_group(key, payloads) -> results` once per group
in one of the batcher's worker threads. A finished batch wakes the event loop with one
call_soon_threadsafe whose callback frees the worker, starts what queued and resolves every future
of the batch: the hand-off between the loop and the workers is a request's largest cost beside its
forward, so it carries no concurrent.futures future, lock or chained callback and no second turn of
the loop. Jobs with the same key can share one forward call (the server's key,
served.GroupKey: the snapshot version and options); `run_group` returns one result per payload in
order (an exception instance in place of a result fails that job alone), or raises. A `QueryError`
raised by a group is isolated by re-running each of its payloads alone, so one bad request never
fails its neighbours.

Backpressure: `submit` raises `QueueFull` when `max_queue` jobs are already waiting.
Concurrency: `workers` (default: one per core the process may run on) bounds the batches computed at
once; `threads` is applied with torch.set_num_threads in the worker before its batch runs. A
`policy(concurrency) -> (workers, threads)` (silverrec tune's table) is asked at every batch with the
number of requests in flight instead.
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from silverrec.errors import QueryError


class QueueFull(Exception):
    """The batcher's queue holds max_queue jobs (answer 503 with Retry-After)."""


class DeadlineExceeded(Exception):
    """The job's deadline passed before it was computed (answer 504)."""


class ShuttingDown(Exception):
    """The batcher is stopping and takes no new jobs (answer 503)."""


@dataclass
class Job:
    key: Hashable
    payload: Any
    deadline: Optional[float]  # time.monotonic() seconds, None = no deadline
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    abandoned: bool = False  # the caller stopped waiting (its deadline passed)


RunGroup = Callable[[Hashable, Sequence[Any]], Sequence[Any]]
Policy = Callable[[int], tuple[int, int]]


def cores() -> int:
    """The cores this process may run on (its CPU affinity, else os.cpu_count())."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def process_compute(processes: int, workers: Optional[int] = None, threads: Optional[int] = None) -> tuple[int, int]:
    """(batch workers, threads per batch) of one of `processes` server processes sharing this machine's
    cores: `workers` or one per two cores of its share (cores / processes; at least one), and `threads`
    or the cores left per worker."""
    share = max(1, cores() // processes)
    workers = workers or max(1, share // 2)
    return workers, threads or max(1, share // workers)


class Batcher:
    """Dynamic batcher (module docstring). Create and use inside one asyncio event loop."""

    def __init__(self, run_group: RunGroup, max_batch: int = 64, max_wait_ms: float = 0.0, max_queue: int = 1024,
                 workers: Optional[int] = None, threads: Optional[int] = None, policy: Optional[Policy] = None,
                 on_batch: Optional[Callable[[int], None]] = None):
        workers = cores() if workers is None else workers
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.run_group = run_group
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.workers = workers
        self.threads = threads
        self.policy = policy
        self.on_batch = on_batch
        self._queue: collections.deque[Job] = collections.deque()
        self._busy = 0  # batches being computed
        self._in_flight = 0  # submitted jobs not yet answered
        self._closing = False
        self._kick: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._loop_ref: Optional[asyncio.AbstractEventLoop] = None
        self._batches: "queue.SimpleQueue[Optional[tuple[list[Job], Optional[int]]]]" = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._max_workers = max(workers, 1)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, max_workers: Optional[int] = None) -> None:
        self._max_workers = max(self.workers, max_workers or 1)
        self._loop_ref = asyncio.get_running_loop()
        self._threads = [threading.Thread(target=self._work, name=f"silverrec-batch-{i}", daemon=True)
                         for i in range(self._max_workers)]
        for t in self._threads:
            t.start()
        self._kick = asyncio.Event()
        self._task = self._loop_ref.create_task(self._loop())

    async def stop(self) -> None:
        """Take no new jobs, compute every queued one, wait for running batches, then stop."""
        self._closing = True
        if self._kick is not None:
            self._kick.set()
        if self._task is not None:
            await self._task
        for _ in self._threads:
            self._batches.put(None)
        for t in self._threads:  # idle: every batch has finished
            t.join()
        self._threads = []

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ------------------------------------------------------------------ submit
    async def submit(self, key: Hashable, payload: Any, deadline: Optional[float] = None) -> Any:
        """Queue one job and wait for its result. Raises QueueFull, DeadlineExceeded, ShuttingDown,
        or what run_group raised for this job."""
        if self._closing or self._kick is None:
            raise ShuttingDown("the server is shutting down")
        if len(self._queue) >= self.max_queue:
            raise QueueFull(f"queue full ({self.max_queue} requests waiting)")
        now = time.monotonic()
        if deadline is not None and deadline <= now:
            raise DeadlineExceeded("deadline passed before the request was queued")
        job = Job(key, payload, deadline, asyncio.get_running_loop().create_future(), now)
        self._queue.append(job)
        self._in_flight += 1
        if self._pump() is not None:  # held open beside a busy worker: the loop keeps the time
            self._kick.set()
        try:
            if deadline is None:
                return await job.future
            try:
                return await asyncio.wait_for(asyncio.shield(job.future), deadline - time.monotonic())
            except (asyncio.TimeoutError, TimeoutError):
                job.abandoned = True
                raise DeadlineExceeded(f"deadline passed after {1000 * (time.monotonic() - now):.1f} ms "
                                       "(waiting in the queue or computing)") from None
        finally:
            self._in_flight -= 1

    # ------------------------------------------------------------------ dispatch
    async def _wait(self, timeout: Optional[float] = None) -> None:
        self._kick.clear()
        try:
            await asyncio.wait_for(self._kick.wait(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            pass

    def _limits(self) -> tuple[int, Optional[int]]:
        if self.policy is None:
            return self.workers, self.threads
        workers, threads = self.policy(self._in_flight)
        return max(1, min(int(workers), self._max_workers)), threads

    def _pump(self) -> Optional[float]:
        """Start batches while a worker is free and jobs are queued (on the event loop: from submit, a
        finished batch and the loop) -> seconds until a held queue must go, or None."""
        while self._queue:
            workers, threads = self._limits()
            if self._busy >= workers:
                return None
            if self._busy and len(self._queue) < self.max_batch and not self._closing:
                remaining = self._queue[0].enqueued + self.max_wait - time.monotonic()
                if remaining > 0:
                    return remaining
            batch = self._take()
            if batch:
                self._busy += 1
                if self.on_batch is not None:
                    self.on_batch(len(batch))
                self._batches.put((batch, threads))  # a worker thread is free: _busy < workers <= threads
        return None

    async def _loop(self) -> None:
        """Holds a short queue open (max_wait) and drains the queue on stop; dispatch itself runs in _pump."""
        while True:
            hold = self._pump()
            if self._closing and not self._queue and self._busy == 0:
                return
            await self._wait(hold)

    def _take(self) -> list[Job]:
        batch, now = [], time.monotonic()
        while self._queue and len(batch) < self.max_batch:
            job = self._queue.popleft()
            if job.abandoned or job.future.done():
                job.future.cancel()  # nobody waits for it any more
                continue
            if job.deadline is not None and job.deadline <= now:
                job.future.set_exception(DeadlineExceeded(
                    f"deadline passed after {1000 * (now - job.enqueued):.1f} ms in the queue; dropped before compute"))
                continue
            batch.append(job)
        return batch

    def _work(self) -> None:
        """Worker thread: compute batches until stopped; each finished batch wakes the loop once."""
        while True:
            item = self._batches.get()
            if item is None:
                return
            batch, threads = item
            try:
                results: Any = self._execute(batch, threads)
            except BaseException as e:  # noqa: BLE001  (handed to every job of the batch)
                results = e
            try:
                self._loop_ref.call_soon_threadsafe(self._finish, batch, results)
            except RuntimeError:  # the event loop is closed: nobody waits for these jobs any more
                return

    def _execute(self, batch: list[Job], threads: Optional[int]) -> list[tuple[bool, Any]]:
        """Worker thread: group by key, one run_group call per group. -> (ok, result or exception) per job."""
        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(int(threads))
        groups: dict[Hashable, list[int]] = {}
        for i, job in enumerate(batch):
            groups.setdefault(job.key, []).append(i)
        out: list[tuple[bool, Any]] = [(False, RuntimeError("not computed"))] * len(batch)
        for key, idx in groups.items():
            # a job abandoned while its batch waited for a worker is dropped before compute
            idx = [i for i in idx if not batch[i].abandoned]
            for i, r in zip(idx, self._run(key, [batch[i].payload for i in idx])):
                out[i] = r
        return out

    def _run(self, key: Hashable, payloads: list[Any]) -> list[tuple[bool, Any]]:
        if not payloads:
            return []
        try:
            results = self.run_group(key, payloads)
            return [(not isinstance(r, BaseException), r) for r in results]
        except QueryError as e:
            if len(payloads) == 1:
                return [(False, e)]
            return [r for p in payloads for r in self._run(key, [p])]  # isolate the bad request
        except Exception as e:  # noqa: BLE001  (handed to each waiting request)
            return [(False, e)] * len(payloads)

    def _finish(self, batch: list[Job], results: "list[tuple[bool, Any]] | BaseException") -> None:
        """On the event loop, once per batch: free its worker, start what queued, resolve every job."""
        self._busy -= 1
        self._pump()
        self._kick.set()
        for i, job in enumerate(batch):
            if job.future.done():
                continue
            if job.abandoned:
                job.future.cancel()
                continue
            if isinstance(results, BaseException):
                job.future.set_exception(results)
                continue
            ok, value = results[i]
            if ok:
                job.future.set_result(value)
            else:
                job.future.set_exception(value)
