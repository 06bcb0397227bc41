"""The Prometheus metrics of `silverrec serve` (served at GET /metrics).

With several server processes (serving/processes.py sets PROMETHEUS_MULTIPROC_DIR for them) every
process writes its values to files in that folder and GET /metrics, whichever process answers it,
adds them up over the live processes (prometheus_client's multiprocess mode).
"""

import asyncio
import os

REJECTION_REASONS = ("queue_full", "shutting_down", "deadline", "unavailable")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
SAMPLE_SECONDS = 1.0  # several processes: how often each writes its queue depth and requests in flight


class Metrics:
    """The metrics of one app, in its own registry (so several apps can live in one process): requests and
    latency per route (the app's Gate), batch sizes (the batcher), queue depth, requests in flight,
    rejections by reason, reloads by result, and the served snapshot's version.

    A request touches two of them (`observe`), through children looked up once per (route, status);
    the queue depth and the requests in flight are read from the batcher (`watch`)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        self.registry = CollectorRegistry()
        self.requests = Counter("silverrec_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram("silverrec_request_latency_seconds", "request latency by route", ["route"],
                                 buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5),
                                 registry=self.registry)
        self.batch = Histogram("silverrec_batch_requests", "requests per batch",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.queue = Gauge("silverrec_queue_depth", "requests waiting for a batch", registry=self.registry,
                           multiprocess_mode="livesum")
        self.in_flight = Gauge("silverrec_in_flight", "requests admitted and not yet answered", registry=self.registry,
                               multiprocess_mode="livesum")
        self.rejections = Counter("silverrec_rejections", "requests refused or dropped", ["reason"],
                                  registry=self.registry)
        self.rejected = {reason: self.rejections.labels(reason) for reason in REJECTION_REASONS}
        self.reloads = Counter("silverrec_reloads", "reload attempts by result", ["result"], registry=self.registry)
        self.info = Gauge("silverrec_snapshot_info", "the served snapshot (value 1; several processes: how many serve it)",
                          ["version", "kind"], registry=self.registry, multiprocess_mode="livesum")
        self._children: dict = {}
        self._serving = None

    def observe(self, route: str, status: int, seconds: float) -> None:
        """One answered request: its count by (route, status) and its latency by route."""
        children = self._children.get((route, status))
        if children is None:
            children = self._children[(route, status)] = (self.requests.labels(route, str(status)),
                                                          self.latency.labels(route))
        children[0].inc()
        children[1].observe(seconds)

    def serving(self, version: str, kind: str) -> None:
        """The snapshot info: this version served (the previous one's series 0, or gone in one process)."""
        if self._serving is not None:
            if self.multiprocess:  # its value lives on in this process's file: set it to 0
                self.info.labels(*self._serving).set(0)
            else:
                self.info.clear()
        self._serving = (version, kind)
        self.info.labels(version, kind).set(1)

    def watch(self, batcher) -> None:
        """Queue depth and requests in flight from the batcher: read when /metrics is scraped (one
        process), or written every SAMPLE_SECONDS by `sample` (several)."""
        self._batcher = batcher
        if not self.multiprocess:
            self.queue.set_function(lambda: batcher.queue_depth)
            self.in_flight.set_function(lambda: batcher.in_flight)

    async def sample(self) -> None:
        """Several processes: this process's queue depth and requests in flight, written until cancelled."""
        while True:
            self.queue.set(self._batcher.queue_depth)
            self.in_flight.set(self._batcher.in_flight)
            await asyncio.sleep(SAMPLE_SECONDS)

    def exposition(self) -> bytes:
        """The text GET /metrics answers: this app's registry, or every live process's values."""
        from prometheus_client import CollectorRegistry, generate_latest

        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry)
