"""The predictor: load a snapshot and answer requests with one forward call.

    >>> import silverrec
    >>> snap = silverrec.load("snapshots/v1")
    >>> result = snap.search(queries, k=100)      # queries float32 [B, D]
    >>> result.item_ids, result.scores             # int64 / float32 [B, 100]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import silverrec.kernels  # noqa: F401  (ops must be registered before deserialising)
from silverrec.errors import QueryError, SnapshotError, check_k, check_queries
from silverrec.filtered_search import search_filtered_ivf
from silverrec.snapshot import EXPORT_FILE, SCRIPT_FILE, read_manifest


@dataclass
class SearchResult:
    """Top-k answer: item ids int64 [B, k] (-1 = no item) and scores float32 [B, k] (-inf = none)."""

    item_ids: torch.Tensor
    scores: torch.Tensor

    def to_json(self) -> dict[str, Any]:
        scores = self.scores.tolist()
        scores = [[s if np.isfinite(s) else None for s in row] for row in scores]
        return {"item_ids": self.item_ids.tolist(), "scores": scores}


class Snapshot:
    """A loaded, verified snapshot: its manifest and its runtime module."""

    def __init__(self, path: Path, manifest: dict[str, Any], module: torch.nn.Module, backend: str):
        self.path = path
        self.manifest = manifest
        self.module = module
        self.backend = backend

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["config"]

    def search(self, queries: torch.Tensor | np.ndarray, k: int, **options: Any) -> SearchResult:
        """Top-k items for each query row. `options` are kind-specific (e.g. nprobe for "ivf")."""
        if isinstance(queries, np.ndarray):
            queries = torch.from_numpy(queries)
        queries = check_queries(queries, self.config["dim"])
        check_k(k, self.manifest["item_count"])
        handler = SEARCH_HANDLERS.get(self.kind)
        if handler is None:
            raise QueryError(f"snapshot kind {self.kind!r} does not answer search requests")
        with torch.inference_mode():
            scores, item_ids = handler(self, queries, k, **options)
        return SearchResult(item_ids=item_ids, scores=scores)


def _search_exact(snap: Snapshot, queries: torch.Tensor, k: int, **options: Any):
    if options:
        raise QueryError(f"an exact snapshot takes no search options, got {sorted(options)}")
    return snap.module(queries, k)


def _search_ivf(snap: Snapshot, queries: torch.Tensor, k: int, nprobe: int | None = None, **options: Any):
    """IVF search; nprobe defaults to the manifest's default_nprobe and must be in [1, nlist]."""
    if options:
        raise QueryError(f"an ivf snapshot takes only the search option nprobe, got {sorted(options)}")
    nlist = int(snap.config["nlist"])
    if nprobe is None:
        nprobe = int(snap.config["default_nprobe"])
    if isinstance(nprobe, bool) or not isinstance(nprobe, int) or not 1 <= nprobe <= nlist:
        raise QueryError(f"nprobe must be an int in [1, {nlist}] (the cluster count), got {nprobe!r}")
    return snap.module(queries, k, nprobe)


# kind -> callable(snapshot, queries, k, **options) -> (scores, item_ids). Runtime modules of other
# kinds register here.
SEARCH_HANDLERS = {"exact": _search_exact, "ivf": _search_ivf, "filtered_ivf": search_filtered_ivf}


def load(path: str | os.PathLike, backend: str = "export", verify: bool = True) -> Snapshot:
    """Verify and load a snapshot.

    Args:
        path: snapshot directory.
        backend: "export" (model.pt2, default) or "torchscript" (model.ts).
        verify: check sizes and sha256 of every file against the manifest (default on).
    Raises:
        SnapshotError: missing/truncated/altered file, newer format version, unknown backend.
    """
    root = Path(path)
    manifest = read_manifest(root, verify=verify)
    try:
        if backend == "export":
            module = torch.export.load(root / EXPORT_FILE).module()
        elif backend == "torchscript":
            if SCRIPT_FILE not in manifest["files"]:
                raise SnapshotError(f"snapshot {root} has no TorchScript file ({SCRIPT_FILE})")
            module = torch.jit.load(str(root / SCRIPT_FILE))
        else:
            raise SnapshotError(f"unknown backend {backend!r}: use 'export' or 'torchscript'")
    except SnapshotError:
        raise
    except Exception as e:  # deserialisation failures become one clear error
        raise SnapshotError(f"cannot load {backend} program from {root}: {type(e).__name__}: {e}") from e
    return Snapshot(root, manifest, module, backend)
