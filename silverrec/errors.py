"""Exceptions raised at silverrec's public boundary.

Every error names what is wrong (which feature, which value, which row or file) and never prints
a whole tensor.
"""

import math


class SilverrecError(ValueError):
    """Base class: bad input to a silverrec API, CLI or snapshot."""


class PoolError(SilverrecError):
    """The candidate pool given to `publish` is invalid (NaN, ragged, duplicate ids, empty...)."""


class SnapshotError(SilverrecError):
    """A snapshot directory cannot be loaded: missing or truncated file, checksum mismatch,
    incompatible format version."""


class QueryError(SilverrecError):
    """A request is invalid: wrong dtype or dimension of queries, k <= 0, bad filter..."""


def check_queries(queries, dim: int, name: str = "queries"):
    """Validate a float query batch `[B, dim]`; return it as contiguous float32."""
    import torch

    if not isinstance(queries, torch.Tensor):
        raise QueryError(f"{name} must be a torch.Tensor, got {type(queries).__name__}")
    if queries.dim() != 2:
        raise QueryError(f"{name} must have shape [B, {dim}], got {tuple(queries.shape)}")
    if queries.shape[1] != dim:
        raise QueryError(f"{name} has dimension {queries.shape[1]}, the index holds {dim}-d items")
    if not queries.dtype.is_floating_point:
        raise QueryError(f"{name} must be floating point, got {queries.dtype}")
    queries = queries.float().contiguous()
    # A finite sum proves every value finite (NaN and Inf propagate) in one reduction, a few
    # microseconds; only a non-finite sum (a bad value, or finite values overflowing) checks each.
    if not math.isfinite(float(queries.sum())) and not bool(torch.isfinite(queries).all()):
        bad = int((~torch.isfinite(queries)).any(dim=1).nonzero()[0, 0])
        raise QueryError(f"{name} row {bad} contains NaN or Inf")
    return queries


def check_k(k: int, limit: int | None = None, what: str = "items") -> int:
    """Validate a requested result count."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise QueryError(f"k must be an int, got {type(k).__name__}")
    if k <= 0:
        raise QueryError(f"k must be positive, got {k}")
    if limit is not None and k > limit:
        raise QueryError(f"k={k} exceeds the {limit} {what} in the index")
    return k
