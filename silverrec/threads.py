"""torch's intra-op threads: the OpenMP wait policy they run under, and the thread count set for a
block and restored after it (one helper for the predictor's per-call policy, k-means' small-matrix
steps and the generative trainer)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

# A predictor shares its cores with a server's event loop, its batcher and other processes: OpenMP
# workers that spin after each op (the default) take the cores those need, and on a loaded 2-core
# machine made a batch-1 recommend several times slower than passive waiting does. OpenMP reads the
# policy once, when torch loads it: set here (silverrec/__init__ imports this module first) only
# if torch is not loaded yet, and a value the user set wins.
_TORCH_LOADED_FIRST = "torch" in sys.modules
if not _TORCH_LOADED_FIRST:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# True when torch's OpenMP workers sleep between ops (each parallel op then pays a wake-up), from
# the environment torch loaded with (as far as this process can tell).
OMP_PASSIVE = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


@contextmanager
def num_threads(n: Optional[int]) -> Iterator[None]:
    """torch.set_num_threads(n) inside the block, the previous count restored after it (None: unchanged).

    The count is process-wide: callers that run forwards from several threads at once (the server's
    workers) leave it to one owner (the batcher) instead."""
    import torch  # here, not at the top: `import silverrec` runs this module and stays free of torch

    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
