"""A snapshot's program on a device: `silverrec.load(path, device="cuda")`.

    >>> snap = silverrec.load("snapshots/v1", device="cuda")   # or "cuda:1", torch.device("cuda", 1)
    >>> snap.search(queries, k=100)                             # CPU tensors in, CPU tensors out

The CPU path (device "cpu", the default) is untouched: no move, no wrapper. On another device:
- model.pt2 goes through torch.export's `move_to_device_pass` (the CPU-traced graph burns
  device='cpu' into its factory calls, which a plain `.to` would leave on the CPU); model.ts loads
  with `map_location` (tensors.pt too, where a format-5 snapshot keeps its tensors apart); the
  exported rank program (rank.pt2) moves the same way, the TorchScript `rank` method with its module.
- `OnDevice` runs it behind the unchanged predictor API: a call moves its tensor arguments to the
  device once and its outputs back once (non-blocking copies both ways, one stream synchronisation).
- Its forward is replayed from CUDA graphs through `GraphedForward` (one graph per request shape;
  silverrec/serving/cuda_graphs.py), every call padded to its shape bucket first
  (silverrec/serving/buckets.py), so that a small closed set of shapes is captured (at load and on
  first use) and replayed; concurrent calls run on a `StreamPool` of CUDA streams.
"""

from __future__ import annotations

import contextlib
import queue
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from silverrec.errors import SnapshotError

CPU = torch.device("cpu")
# Tests set this to run the device path (move + OnDevice + the graphs' buckets) with device "cpu", so a
# machine without a GPU still checks the plumbing; False keeps device "cpu" on the plain CPU path.
MOVE_CPU = False


def resolve_device(device: str | torch.device) -> torch.device:
    """"cpu", "cuda", "cuda:N" or a torch.device -> torch.device.

    Raises:
        SnapshotError: an unparseable or unsupported device, or CUDA requested while
            torch.cuda.is_available() is False, or a CUDA index this machine does not have.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise SnapshotError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N' ({e})") from None
    if dev.type == "cpu":
        return CPU
    if dev.type != "cuda":
        raise SnapshotError(f"unsupported device {device!r}: silverrec serves on 'cpu' or 'cuda' ('cuda:N')")
    if not torch.cuda.is_available():
        raise SnapshotError(f"device {str(device)!r} requested but torch.cuda.is_available() is False")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SnapshotError(f"device {str(device)!r} requested but this machine has {torch.cuda.device_count()} "
                            "CUDA device(s)")
    return dev


def moves(device: torch.device) -> bool:
    """Whether a program loaded for `device` is moved and wrapped (every device but the CPU)."""
    return device.type != "cpu" or MOVE_CPU


def exported_on(program: torch.export.ExportedProgram, device: torch.device | str) -> torch.nn.Module:
    """An ExportedProgram's module with every tensor and device constant on `device`."""
    from torch.export.passes import move_to_device_pass

    return move_to_device_pass(program, device).module()


def program_on(path: str | Path, backend: str, device: torch.device | str,
               manifest: Optional[dict[str, Any]] = None):
    """A snapshot's program loaded by silverrec's own loaders (state tensors attached) on `device`,
    unwrapped (its calls take tensors on `device`): model.pt2 moved by `exported_on`, model.ts
    loaded with map_location. Any device torch knows (the CPU tests move to "meta")."""
    from silverrec.snapshot import load_exported, load_scripted, read_manifest

    root = Path(path)
    manifest = read_manifest(root) if manifest is None else manifest
    if backend == "export":
        return exported_on(load_exported(root, manifest), device)
    if backend == "torchscript":
        return load_scripted(root, manifest, map_location=device)
    raise SnapshotError(f"unknown backend {backend!r}: use 'export' or 'torchscript'")


def to_device(tree: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Every tensor of a (nested) tuple / list / dict moved to `device`; other leaves as they are."""
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, tree)


class OnDevice:
    """`module` on `device` called with CPU tensors: arguments moved there, outputs moved back.

    Arguments go with non-blocking copies (a blocking host-to-device copy would synchronise the
    stream once per argument), outputs come back with non-blocking copies (torch puts them in pinned
    memory) and one synchronisation of the device's current stream, not one per output. Callable attributes (the
    TorchScript `rank` method) are wrapped the same way; other attributes are the module's own.
    """

    def __init__(self, module, device: torch.device | str, stream: Optional["torch.cuda.Stream"] = None):
        self.module = module
        self.device = torch.device(device)
        self.stream = stream  # the CUDA stream its calls run on (StreamPool); None: the device's current one

    def __getattr__(self, name):
        attr = getattr(self.module, name)
        return OnDevice(attr, self.device, self.stream) if callable(attr) and not isinstance(attr, torch.Tensor) \
            else attr

    def __call__(self, *args, **kwargs):
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            args, kwargs = to_device((args, kwargs), self.device, non_blocking=True)
            out = self.module(*args, **kwargs)
            out = to_device(out, CPU, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the copies above are complete
        return out


class StreamPool:
    """Forwards of concurrent batches on a few CUDA streams instead of one at a time: `lanes` (each an
    OnDevice on its own stream around its own GraphedForward: its graphs and static buffers); a call
    takes a free lane, waiting for one when all are busy. The server's workers (silverrec tune's
    table) bound the batches in flight, so each finds a lane."""

    def __init__(self, lanes: list):
        if not lanes:
            raise ValueError("a StreamPool needs at least one lane")
        self.lanes = list(lanes)
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for lane in self.lanes:
            self.free.put(lane)

    def __getattr__(self, name):
        return getattr(self.__dict__["lanes"][0], name)

    def __call__(self, *args, **kwargs):
        lane = self.free.get()
        try:
            return lane(*args, **kwargs)
        finally:
            self.free.put(lane)


def graph_counts(module) -> dict[str, int]:
    """calls / captures / replays / eager calls of every GraphedForward inside a loaded snapshot's module
    (through BucketedForward, StreamPool and OnDevice); zeros where nothing is graphed (the CPU path)."""
    total = {"calls": 0, "captures": 0, "replays": 0, "eager": 0}
    inner = getattr(module, "__dict__", {})
    if "cache" in inner:
        return inner["cache"].counts()
    for part in inner.get("lanes", [inner.get("module")]):
        if part is not None:
            for key, value in graph_counts(part).items():
                total[key] += value
    return total


def serving_module(module, manifest: dict[str, Any], device: torch.device, streams: int = 1, buckets=None):
    """A program already on `device` behind the CPU API, its forward replayed from CUDA graphs through
    GraphedForward (one graph per request shape), its calls padded to their shape buckets
    (`buckets`, silverrec/serving/buckets.py: each shape captured on first use; None: shapes as they
    come, captured on their second call). `streams` > 1: a StreamPool of that many lanes. On the CPU
    (the tests' forced device path), `capture_eager`: the same keys, static buffers and copies, no graph."""
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    cuda = device.type == "cuda"

    def lane(stream) -> OnDevice:
        return OnDevice(_graphed(module, device, buckets), device, stream)

    served = lane(None) if streams == 1 else StreamPool([lane(torch.cuda.Stream(device) if cuda else None)
                                                         for _ in range(streams)])
    if buckets is None or manifest.get("kind") != "rec":
        return served
    from silverrec.serving.buckets import BucketedForward, max_k

    cfg = manifest["config"]
    return BucketedForward(served, buckets, search=cfg.get("spec", {}).get("tower") == "query", max_k=max_k(manifest),
                           max_history=(cfg.get("generative") or {}).get("max_items"),
                           nlist=int(cfg["nlist"]) if cfg.get("nlist") else None)


def exported_module(program: torch.export.ExportedProgram, device: torch.device, buckets=None,
                    listwise: bool = False):
    """A loaded ExportedProgram (rank.pt2) as the predictor calls it: `program.module()` on the
    CPU path, else moved to `device` behind `rank_serving`."""
    if not moves(device):
        return program.module()
    return rank_serving(exported_on(program, device), device, buckets, listwise)


def rank_serving(rank, device: torch.device, buckets=None, listwise: bool = False):
    """The rank program `rank(values, lengths, dense, rows)` on `device` behind the CPU API, replayed from CUDA
    graphs; with `buckets`, its calls padded (BucketedRank: the list of items too, unless a list-wise OverArch
    attends over it)."""
    graphed = _graphed(rank, device, buckets, padded=not listwise)
    if buckets is None:
        return OnDevice(graphed, device)
    from silverrec.serving.buckets import BucketedRank

    return BucketedRank(OnDevice(graphed, device), buckets, listwise)


def _capture(device: torch.device):
    """How graphs are captured on `device`: CUDA graphs, or on the CPU (the forced device path) `capture_eager`."""
    from silverrec.serving.cuda_graphs import capture_cuda_graph, capture_eager

    return capture_cuda_graph if device.type == "cuda" else capture_eager


def _graphed(module, device: torch.device, buckets=None, padded: bool = True):
    """GraphedForward around `module`: with buckets (and calls padded to them) every shape is captured on first
    use, as many as the buckets keep; otherwise on its second call (a one-off shape runs eagerly)."""
    from silverrec.serving.cuda_graphs import CAPTURE_AFTER, DEFAULT_MAX_GRAPHS, GraphedForward

    first_use = buckets is not None and padded
    return GraphedForward(module, max_graphs=buckets.max_graphs if buckets else DEFAULT_MAX_GRAPHS,
                          capture=_capture(device), capture_after=1 if first_use else CAPTURE_AFTER)
