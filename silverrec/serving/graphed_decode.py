"""CUDA-graph replay of the generative decode: one graph per (batch bucket, beam width, history bucket).

A generative snapshot's forward (`GenerativeRetrieval`: prefill, then exactly L fixed decode steps
with staged attention and ping-pong KV buffers) has static shapes and no host synchronisation once
the batch and the history length are fixed. On CUDA its launch cost dominates (each step launches
dozens of small kernels for a few microseconds of work each), so this predictor-side wrapper pads
the history to a length bucket and the batch to a batch bucket, captures the whole forward once
per shape with
`torch.cuda.CUDAGraph` into the graph's private memory pool, and afterwards replays it:

    decode = GraphedDecode(snapshot.module, beam_width=W)          # eager, exported or TorchScript
    item_ids, scores = decode(history.cuda(), item_bitmask.cuda())  # int64 [B, W], float32 [B, W]

Static tensors: the graph reads its inputs from two buffers allocated at capture (history int64
[B, T_bucket], item_bitmask int64 [B, ceil(N / 64)]) and writes its outputs into the pool; every
tensor the forward allocates in between (the shared KV [n_layers, B, KV, T_bucket, hd], the
ping-pong unshared KV [2, n_layers, B*W, L-1, KV, hd], the step tokens, beam scores and trie nodes)
lives at a fixed address of that pool, which is what replay needs. A call copies its inputs into
the static buffers, replays, and returns clones of the outputs (the next replay overwrites them).

Left padding with PAD is the contract's own padding (PAD keys are masked and positions count
non-PAD tokens), so a padded history decodes the same items; the extra requests of a batch bucket
are bare BOS histories that allow no item (requests are independent), and their rows are dropped.
Only float reduction orders may differ from the unpadded call (tests/test_cuda_graph.py checks it
on CPU). Buckets are powers of two: a batcher's batches of 1..64 and histories of 16..1024 tokens
make at most 7 x 7 shapes, not 64 x 1009.

Graphs are cached by shape, least recently used first out beyond `max_graphs` (each holds its
pool). CPU tensors go straight to the module: the CPU path is unchanged. Nothing here is part of a
snapshot: torch.export / TorchScript programs are the same with or without it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from silverrec.generative.decoder import BOS, PAD
from silverrec.serving.cuda_graphs import DEFAULT_MAX_GRAPHS, Capture, GraphCache, HasGraphCache, capture_cuda_graph

__all__ = ["GraphedDecode", "bucket", "pad_history", "pad_batch"]

MIN_BUCKET = 16  # shortest padded history: history buckets are powers of two from here


def bucket(size: int, minimum: int = 1) -> int:
    """The padded size of a batch or a history length: the next power of two >= size, at least
    `minimum` (so log2(largest size) buckets at most)."""
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    out = max(int(minimum), 1)
    while out < size:
        out *= 2
    return out


def pad_history(history: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad int64 [B, T] with PAD to [B, length] (length >= T): the generative contract's padding."""
    T = history.shape[1]
    if length < T:
        raise ValueError(f"cannot pad a history of length {T} to {length}")
    return F.pad(history, (length - T, 0), value=PAD) if length > T else history


def pad_batch(history: torch.Tensor, item_bitmask: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] / [B, words] -> [batch, T] / [batch, words] (batch >= B): extra requests are a bare BOS
    (PAD ... PAD BOS) with an all-zero bitmask, so they decode no item."""
    B, T = history.shape
    if batch < B:
        raise ValueError(f"cannot pad a batch of {B} to {batch}")
    if batch == B:
        return history, item_bitmask
    extra = history.new_full((batch - B, T), PAD)
    extra[:, -1] = BOS
    return torch.cat([history, extra]), torch.cat([item_bitmask, item_bitmask.new_zeros(batch - B, item_bitmask.shape[1])])


class GraphedDecode(HasGraphCache):
    """Graph replay of a generative forward `module(history, item_bitmask) -> (item_ids, scores)`.

    Args:
        module: the decode (a `GenerativeRetrieval`, or a loaded snapshot's exported / TorchScript
            module) already on the device of the calls.
        beam_width: W of the module (part of the cache key: a module has one, but a key that names
            it cannot be confused across modules sharing a cache).
        max_graphs: graphs kept (least recently used evicted).
        min_bucket: shortest padded history length.
        capture: how a shape is captured (`capture_cuda_graph`; `capture_eager` in CPU tests).
    Call: history int64 [B, T] (left-padded), item_bitmask int64 [B, ceil(N / 64)], both on the same
        device -> (item_ids int64 [B, W], scores float32 [B, W]), computed on the inputs padded to
        (bucket(B), bucket(T, min_bucket)). CPU tensors (with the default
        capture) call the module directly. Thread-safe: calls from several threads take turns.
    """

    def __init__(self, module: Callable, beam_width: int, max_graphs: int = DEFAULT_MAX_GRAPHS,
                 min_bucket: int = MIN_BUCKET, capture: Capture = capture_cuda_graph):
        if max_graphs <= 0:
            raise ValueError(f"max_graphs must be positive, got {max_graphs}")
        if beam_width <= 0:
            raise ValueError(f"beam_width must be positive, got {beam_width}")
        self.module = module
        self.beam_width = int(beam_width)
        self.min_bucket = int(min_bucket)
        self.capture = capture
        # one call at a time (the cache's lock): calls share each key's static buffers (a server's
        # workers call from several threads), and nothing launches while a graph is being captured
        self.cache = GraphCache(module, max_graphs, capture)

    def key(self, history: torch.Tensor, item_bitmask: torch.Tensor) -> tuple:
        """(device, batch bucket, beam width, history bucket, bitmask words): one graph per key."""
        return (str(history.device), bucket(history.shape[0]), self.beam_width,
                bucket(history.shape[1], self.min_bucket), item_bitmask.shape[1])

    def pad(self, history: torch.Tensor, item_bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs padded to their key's shape (what the graph of that key runs on)."""
        _, batch, _, length, _ = self.key(history, item_bitmask)
        return pad_batch(pad_history(history, length), item_bitmask, batch)

    def __call__(self, history: torch.Tensor, item_bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if history.device.type == "cpu" and self.capture is capture_cuda_graph:
            return self.module(history, item_bitmask)
        if history.dtype != torch.int64 or history.dim() != 2 or item_bitmask.dtype != torch.int64 \
                or item_bitmask.dim() != 2 or item_bitmask.shape[0] != history.shape[0]:
            raise ValueError(f"history must be int64 [B, T] and item_bitmask int64 [B, words], got "
                             f"{history.dtype} {tuple(history.shape)} and {item_bitmask.dtype} {tuple(item_bitmask.shape)}")
        if item_bitmask.device != history.device:
            raise ValueError(f"history is on {history.device} but item_bitmask on {item_bitmask.device}")
        key = self.key(history, item_bitmask)
        B = history.shape[0]
        with self.cache.lock, torch.inference_mode():
            out = self.cache(key, self.pad(history, item_bitmask))
            return tuple(o[:B].clone() for o in out)
