"""silverrec: large-scale recommendation served as one PyTorch model.

Importing silverrec registers its operators (`torch.ops.silverrec.*`), which a snapshot needs
before it can be loaded in a fresh process.
"""

import os as _os

__version__ = "0.1.0"

# A predictor shares its cores with a server's event loop, its batcher and other processes: OpenMP
# workers that spin after each op (the default) took a 2-thread batch-1 recommend from 2.9 ms to
# 11 ms median on a loaded 2-core machine, where passive waiting kept 3.4 ms. Effective only when
# silverrec is imported before torch first starts OpenMP (the `silverrec` CLI, `silverrec serve`);
# a value the user set wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from silverrec import kernels as _kernels  # noqa: F401  (registers torch.ops.silverrec.*)
from silverrec.errors import PoolError, QueryError, SilverrecError, SnapshotError
from silverrec.serving.predictor import SearchResult, Snapshot, load
from silverrec.snapshot import FORMAT_VERSION

__all__ = [
    "FORMAT_VERSION",
    "PoolError",
    "QueryError",
    "SilverrecError",
    "SnapshotError",
    "load",
    "SearchResult",
    "Snapshot",
]
