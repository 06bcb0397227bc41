"""Progress reporting for long publish steps (tqdm on stderr; silent when SILVERREC_QUIET=1)."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

from tqdm.auto import tqdm


def quiet() -> bool:
    return os.environ.get("SILVERREC_QUIET") == "1"


@contextmanager
def step(name: str):
    """Announce a step and its duration."""
    t0 = time.perf_counter()
    if not quiet():
        print(f"[silverrec] {name} ...", file=sys.stderr, flush=True)
    yield
    if not quiet():
        print(f"[silverrec] {name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)


def bar(total: int, desc: str):
    """A progress bar for iterative steps (k-means iterations, chunks)."""
    return tqdm(total=total, desc=desc, disable=quiet(), file=sys.stderr, leave=False)
