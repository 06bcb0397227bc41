"""torch's intra-op thread count, set for a block and restored after it (one helper for the
predictor's per-call policy, k-means' small-matrix steps and the generative trainer)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch


@contextmanager
def num_threads(n: Optional[int]) -> Iterator[None]:
    """torch.set_num_threads(n) inside the block, the previous count restored after it (None: unchanged).

    The count is process-wide: callers that run forwards from several threads at once (the server's
    workers) leave it to one owner (the batcher) instead."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
