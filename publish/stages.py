"""Time and peak resident memory per publish / update stage.

    >>> clock = StageClock()
    >>> with clock("k-means"):
    ...     ...
    >>> clock.report()   # {"stages": [{"name", "seconds", "peak_rss_bytes"}, ...], "peak_rss_bytes": ...}

The per-stage peak is the kernel's high-water mark (VmHWM in /proc/self/status), reset at the start
of each stage by writing "5" to /proc/self/clear_refs (Linux >= 4.0). Where that reset is refused,
the stage's peak is the process-lifetime peak so far (an upper bound), and `report()` says so.
Each stage is also announced like `progress.step`.
"""

from __future__ import annotations

import resource
import time
from contextlib import contextmanager
from pathlib import Path

from silverrec.publish.progress import step


def _hwm_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class StageClock:
    """Collects (name, seconds, peak RSS bytes) for consecutive stages."""

    def __init__(self):
        self.stages: list[dict] = []
        self.per_stage = True
        self._t0 = time.perf_counter()

    @contextmanager
    def __call__(self, name: str):
        self.per_stage &= _reset_hwm()
        t0 = time.perf_counter()
        with step(name):
            yield
        self.stages.append({"name": name, "seconds": round(time.perf_counter() - t0, 3), "peak_rss_bytes": _hwm_bytes()})

    def report(self) -> dict:
        return {
            "stages": list(self.stages),
            "total_seconds": round(time.perf_counter() - self._t0, 3),
            "peak_rss_bytes": max([s["peak_rss_bytes"] for s in self.stages] + [0]),
            "peak_is_per_stage": self.per_stage,
        }
