"""CUDA-graph replay of a snapshot's forward: one graph per request shape, least recently used out.

On a GPU a small batch's forward is bound by the host, not the device: the first GPU run
(benchmarks/profile_cuda.py, H200, 200k items, batch 16) counted 304 kernel launches in an
unfiltered search (4.9 ms of wall time for 0.95 ms of kernels) and 794 in a filtered one (9-11 ms
for 2.2 ms). A forward with static shapes and no host synchronisation (every silverrec op on CUDA,
by construction) can be captured once per shape with `torch.cuda.CUDAGraph` into a private memory
pool and replayed with one launch:

    search = GraphedForward(program)        # a loaded program already on the device
    scores, items = search(q, k, nprobe, *filter_tensors, max_probe, modes)   # device tensors

Keys: the call's tensor shapes and dtypes, its device, and its other arguments (k, nprobe, ...:
they are baked into the graph); a key is captured on its second call (`CAPTURE_AFTER`), so shapes
that never recur cost no capture. A call copies its tensors into the key's static inputs, replays,
and returns clones of the outputs (the next replay overwrites them). A forward that cannot be
captured (a host synchronisation, an op that refuses capture) runs eagerly for that key from then
on, with one warning. `GraphCache` is the shared part: the generative decode's `GraphedDecode`
(silverrec/serving/graphed_decode.py) keys it by its own padded buckets.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, Hashable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

DEFAULT_MAX_GRAPHS = 8
# GraphedForward captures a shape on its second call: a request whose shape varies call by call (a
# recommendation request's feature values, the length of its history) runs eagerly instead of
# paying a capture (warm-ups + capture + a private pool) for a graph that would never be replayed
CAPTURE_AFTER = 2
WARMUP_CALLS = 3  # eager calls on a side stream before capture (Triton compiles, cuBLAS workspaces)

CAPTURE_LOCK = threading.Lock()  # one capture at a time in the process
Capture = Callable[[Callable[..., Sequence[torch.Tensor]], Sequence[torch.Tensor]], "Replay"]


class Replay:
    """A captured call: `run()` re-executes it on its static inputs, leaving results in `outputs`."""

    def __init__(self, outputs: Sequence[torch.Tensor], run: Callable[[], None], keep: object = None):
        self.outputs = tuple(outputs)
        self.run = run
        self.keep = keep  # the CUDAGraph (and through it its memory pool)


def capture_cuda_graph(fn: Callable[..., Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor]) -> Replay:
    """Warm `fn` up on a side stream, then capture `fn(*inputs)` into a CUDA graph (private pool).

    The warm-up compiles Triton kernels and sets up cuBLAS before capture, which must not allocate
    host-visible state or synchronise.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_CALLS):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread-local capture: the other streams' forwards (StreamPool) keep running while this one captures
    with CAPTURE_LOCK, torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = fn(*inputs)
    return Replay(outputs, graph.replay, keep=graph)


def capture_eager(fn: Callable[..., Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor]) -> Replay:
    """The same contract without a GPU: `run()` calls `fn` on the static inputs and writes into the
    first call's output tensors (tests the buffer copy-in / copy-out on any device)."""
    outputs = tuple(fn(*inputs))

    def run() -> None:
        for out, new in zip(outputs, fn(*inputs)):
            out.copy_(new)

    return Replay(outputs, run)


EAGER = object()  # a key whose capture failed: its calls run `fn` directly


class GraphCache:
    """Captured calls of `fn(*tensors) -> tensors`, one per key, the least recently used evicted
    beyond `max_graphs` (each holds its pool). `__call__(key, inputs)` returns the replayed outputs
    (the static buffers: clone what you keep). Thread-safe: calls share a key's static buffers and
    nothing may launch while a graph is captured, so calls take turns."""

    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], max_graphs: int = DEFAULT_MAX_GRAPHS,
                 capture: Capture = capture_cuda_graph, capture_after: int = 1):
        if max_graphs <= 0 or capture_after <= 0:
            raise ValueError(f"max_graphs and capture_after must be positive, got {max_graphs} and {capture_after}")
        self.fn = fn
        self.max_graphs = int(max_graphs)
        self.capture = capture
        self.capture_after = int(capture_after)
        self.graphs: OrderedDict[Hashable, Any] = OrderedDict()
        self.seen: OrderedDict[Hashable, int] = OrderedDict()  # calls of keys not captured yet (bounded)
        self.captures = 0  # keys captured so far (evicted ones included)
        self.replays = 0  # calls answered by a replay
        self.eager = 0  # calls run eagerly: before a key's capture, or a key that refused capture
        self.lock = threading.Lock()

    def counts(self) -> dict[str, int]:
        """calls, captures, replays and eager calls so far (a capturing call counts as a capture)."""
        return {"calls": self.captures + self.replays + self.eager, "captures": self.captures,
                "replays": self.replays, "eager": self.eager}

    def __call__(self, key: Hashable, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run under `self.lock` (the caller holds it while it reads the outputs)."""
        entry = self.graphs.get(key)
        if entry is None:
            calls = self.seen.pop(key, 0) + 1
            if calls < self.capture_after:  # not (yet) a recurring shape: no capture for a one-off
                self.seen[key] = calls
                while len(self.seen) > 8 * self.max_graphs:
                    self.seen.popitem(last=False)
                self.eager += 1
                return tuple(self.fn(*inputs))
            entry = self._capture(key, inputs)
            captured = True
        else:
            self.graphs.move_to_end(key)
            captured = False
        if entry is EAGER:
            self.eager += not captured
            return tuple(self.fn(*inputs))
        static, replay = entry
        for buf, x in zip(static, inputs):
            buf.copy_(x)
        replay.run()
        self.replays += not captured
        return replay.outputs

    def _capture(self, key: Hashable, inputs: Sequence[torch.Tensor]):
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)  # drops the graph and its pool
        static = tuple(x.clone() for x in inputs)
        try:
            entry = (static, self.capture(self.fn, static))
        except Exception as e:  # noqa: BLE001  (any refusal to capture: run this key eagerly)
            warnings.warn(f"silverrec: CUDA-graph capture failed for {key!r} ({type(e).__name__}: {e}); "
                          "calls of this shape run eagerly", RuntimeWarning, stacklevel=3)
            entry = EAGER
        self.graphs[key] = entry
        self.captures += 1
        return entry


class HasGraphCache:
    """`graphs` (key -> captured entry, least recently used first) and `captures` of `self.cache`."""

    cache: GraphCache

    @property
    def graphs(self) -> OrderedDict:
        return self.cache.graphs

    @property
    def captures(self) -> int:
        return self.cache.captures


class GraphedForward(HasGraphCache):
    """Graph replay of any forward `module(*args) -> tensor(s)` whose tensor arguments are on one device.

    Args:
        module: the program (loaded snapshot module, exported or TorchScript) on the calls' device.
        max_graphs: shapes kept (least recently used evicted).
        capture: `capture_cuda_graph`; `capture_eager` in CPU tests.
        capture_after: a shape is captured on its this-many-th call (the earlier ones run eagerly).
    Call: the module's own arguments (tensors, ints, floats, None, nested tuples / lists) -> its
        outputs (cloned). CPU tensors with the default capture call the module directly. Other
        attributes (the TorchScript `rank` method) are the module's own, not graphed.
    """

    def __init__(self, module: Callable, max_graphs: int = DEFAULT_MAX_GRAPHS, capture: Capture = capture_cuda_graph,
                 capture_after: int = CAPTURE_AFTER):
        self.module = module
        self.cache = GraphCache(self._flat_call, max_graphs, capture, capture_after)
        self._calls: dict[Hashable, tuple] = {}  # key -> (args spec, non-tensor leaves, output spec box)
        self._current: Hashable = None

    def __getattr__(self, name: str):
        return getattr(self.__dict__["module"], name)

    def _flat_call(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        spec, others, out_spec = self._calls[self._current]
        it = iter(tensors)
        leaves = [next(it) if o is _TENSOR else o for o in others]
        out, spec_out = tree_flatten(self.module(*tree_unflatten(leaves, spec)))
        out_spec[0] = spec_out
        return tuple(out)

    def __call__(self, *args):
        leaves, spec = tree_flatten(args)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors or (tensors[0].device.type == "cpu" and self.cache.capture is capture_cuda_graph):
            return self.module(*args)
        devices = {x.device for x in tensors}
        if len(devices) > 1:
            raise ValueError(f"GraphedForward: tensor arguments on several devices {sorted(map(str, devices))}")
        others = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
        key = (str(tensors[0].device), str(spec), others,
               tuple((tuple(x.shape), x.dtype) for x in tensors))
        with self.cache.lock, torch.inference_mode():
            if key not in self._calls:
                self._calls[key] = (spec, others, [None])
            self._current = key
            out = self.cache(key, tensors)
            out_spec = self._calls[key][2][0]
            result = tree_unflatten([t.clone() for t in out], out_spec)
            for gone in [k for k in self._calls if k not in self.cache.graphs]:  # evicted keys
                del self._calls[gone]
            return result


class _Tensor:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Tensor()  # a tensor leaf's place in a key (the shapes are keyed apart)
