"""The Prometheus metrics of `silverrec serve` (served at GET /metrics)."""

REJECTION_REASONS = ("queue_full", "shutting_down", "deadline", "unavailable")


class Metrics:
    """The metrics of one app, in its own registry (so several apps can live in one process): requests and
    latency per route (the app's Gate), batch sizes (the batcher), queue depth, requests in flight,
    rejections by reason, reloads by result, and the served snapshot's version.

    A request touches two of them (`observe`), through children looked up once per (route, status):
    the queue depth and the requests in flight are read from the batcher when /metrics is scraped."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("silverrec_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram("silverrec_request_latency_seconds", "request latency by route", ["route"],
                                 buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5),
                                 registry=self.registry)
        self.batch = Histogram("silverrec_batch_requests", "requests per batch",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.queue = Gauge("silverrec_queue_depth", "requests waiting for a batch", registry=self.registry)
        self.in_flight = Gauge("silverrec_in_flight", "requests admitted and not yet answered", registry=self.registry)
        self.rejections = Counter("silverrec_rejections", "requests refused or dropped", ["reason"],
                                  registry=self.registry)
        self.rejected = {reason: self.rejections.labels(reason) for reason in REJECTION_REASONS}
        self.reloads = Counter("silverrec_reloads", "reload attempts by result", ["result"], registry=self.registry)
        self.info = Gauge("silverrec_snapshot_info", "the served snapshot (value 1)", ["version", "kind"],
                          registry=self.registry)
        self._children: dict = {}

    def observe(self, route: str, status: int, seconds: float) -> None:
        """One answered request: its count by (route, status) and its latency by route."""
        children = self._children.get((route, status))
        if children is None:
            children = self._children[(route, status)] = (self.requests.labels(route, str(status)),
                                                          self.latency.labels(route))
        children[0].inc()
        children[1].observe(seconds)
