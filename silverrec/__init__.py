"""silverrec: large-scale recommendation served as one PyTorch model.

Importing silverrec registers its operators (`torch.ops.silverrec.*`), which a snapshot needs
before it can be loaded in a fresh process.
"""

__version__ = "0.1.0"

# first: OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP, unless the user set it (silverrec/threads.py)
from silverrec import threads as _threads  # noqa: F401, I001
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
