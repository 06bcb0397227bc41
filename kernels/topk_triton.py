"""Triton device helpers for exact top-k selection on unique int64 keys, shared by the fused search kernels.

Every selection in kernels/search_triton.py ranks int64 keys that are unique per candidate, so one integer
order decides everything, ties included:

- row keys (kernels/common.py `make_keys`): int32 score << 32 | (2**32 - 1 - row): score descending,
  ties to the lower row; EMPTY_KEY (the smallest int64) is padding;
- centroid keys (`float_key`): the score's float32 bits mapped to an order-preserving int32, << 32 |
  (2**32 - 1 - index): score descending, ties to the lower index (a stable descending sort's order).

`offer` / `flush` keep a running top-KM of a stream of key tiles in a program's candidate buffer (global
scratch the program alone touches, CAP = 2 x KM entries): keys above the current threshold are appended, and
when the buffer would overflow it is sorted and cut to its best KM, whose last key becomes the threshold
(keys are unique, so a key equal to the threshold is the same candidate). Between a store and a load by
other threads of the program sits a CTA barrier (`tl.debug_barrier`).

Ordering is `tl.sort` (Triton >= 3.0; no `tl.topk`, which later versions added) on the device. Triton's
interpreter runs tl.sort's bitonic network with its XOR reductions element by element in Python (most of a
second per sort of 128 keys), so under TRITON_INTERPRET=1 `sort_desc` sorts the tensor's numpy data instead:
the same result, keys being unique; the compiled kernels never contain that branch (a constexpr `if`).
"""

from __future__ import annotations

import os

import numpy as np
import triton
import triton.language as tl

from silverrec.kernels import constants

EMPTY = tl.constexpr(constants.EMPTY_KEY)
LOW = tl.constexpr((1 << 32) - 1)  # the low 32 bits of a key
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


def _numpy_sorted(x):
    """Interpreter only: x's last axis sorted descending, as a tensor of the interpreter."""
    from triton.runtime.interpreter import TensorHandle

    data = np.ascontiguousarray(np.sort(x.handle.data, axis=-1)[..., ::-1])
    return tl.core.tensor(TensorHandle(data, x.handle.dtype), x.type)


_numpy_sorted.__triton_builtin__ = True  # not a device function: Triton's dependency scan passes it by


@triton.jit
def sort_desc(x):
    """x sorted descending along its last axis (a power of two)."""
    if INTERPRET:
        y = _numpy_sorted(x)
    else:
        y = tl.sort(x, descending=True)
    return y


@triton.jit
def first(x, K: tl.constexpr):
    """The first K entries of x [N] (K divides N, both powers of two) -> [K]."""
    N: tl.constexpr = x.shape[0]
    if N == K:
        out = x
    else:
        y = tl.reshape(x, [N // K, K])
        pick = tl.arange(0, N // K)[:, None] == 0
        out = tl.sum(tl.where(pick, y, tl.zeros_like(y)), axis=0)
    return out


@triton.jit
def at(x, i):
    """x[i] of a 1-D tensor as a scalar (0 when i is out of range)."""
    return tl.sum(tl.where(tl.arange(0, x.shape[0]) == i, x, tl.zeros_like(x)), axis=0)


@triton.jit
def float_key(score, index):
    """int64 keys of float32 scores (canonical: -0.0 counts as +0.0), ties to the lower int index."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered.to(tl.int64) * 4294967296 + (index.to(tl.int64) ^ LOW)


@triton.jit
def key_float(key):
    """The float32 score of a `float_key` key."""
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def key_row(key):
    """The row (or index) of a key, NO_ROW (-1) for EMPTY."""
    return tl.where(key == EMPTY, -1, (key & LOW) ^ LOW)


@triton.jit
def _compact(cbuf, count, CAP: tl.constexpr, KM: tl.constexpr):
    """Sort the buffer's `count` keys, keep the best KM in place -> (count KM, threshold = the KM-th best)."""
    idx = tl.arange(0, CAP)
    tl.debug_barrier()
    x = sort_desc(tl.load(cbuf + idx, mask=idx < count, other=EMPTY))
    tl.debug_barrier()  # every thread has read the buffer before it is rewritten
    tl.store(cbuf + idx, x)
    tl.debug_barrier()
    return KM, at(x, KM - 1)


@triton.jit
def offer(keys, cbuf, count, thr, CAP: tl.constexpr, KM: tl.constexpr):
    """Merge a tile of keys [BLOCK] (EMPTY = nothing) into the running top-KM held in cbuf[0:count]
    (BLOCK <= KM, CAP = 2 KM) -> the new (count, threshold)."""
    sel = keys > thr
    n = tl.sum(sel.to(tl.int32), axis=0)
    if n > 0:
        if count + n > CAP:
            count, thr = _compact(cbuf, count, CAP, KM)
            sel = keys > thr
            n = tl.sum(sel.to(tl.int32), axis=0)
        slot = count + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(cbuf + slot, keys, mask=sel)
        count += n
    return count, thr


@triton.jit
def flush(cbuf, count, out, CAP: tl.constexpr, KM: tl.constexpr):
    """Write the running top-KM to out[0:KM], best first (EMPTY padding)."""
    idx = tl.arange(0, CAP)
    tl.debug_barrier()
    x = sort_desc(tl.load(cbuf + idx, mask=idx < count, other=EMPTY))
    tl.store(out + tl.arange(0, KM), first(x, KM))


@triton.jit
def merged(parts, n, KM: tl.constexpr, NB: tl.constexpr):
    """The best KM of n sorted lists of KM keys at parts[i * KM + j] (lists i >= n are absent; NB a power of
    two >= n) -> [KM] best first. The lists were written by other programs: read past L1."""
    i = tl.arange(0, NB)[:, None]
    j = tl.arange(0, KM)[None, :]
    x = tl.load(parts + i * KM + j, mask=(i < n) & (j >= 0), other=EMPTY, cache_modifier=".cg")
    return first(sort_desc(tl.reshape(x, [NB * KM])), KM)
