"""The predictor: load a snapshot and answer requests with one forward call.

    >>> import silverrec
    >>> snap = silverrec.load("snapshots/v1")
    >>> result = snap.search(queries, k=100)      # queries float32 [B, D]
    >>> result.item_ids, result.scores             # int64 / float32 [B, 100]
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import silverrec.kernels  # noqa: F401  (ops must be registered before deserialising)
from silverrec.aoti import AotiProgram, package_entry
from silverrec.errors import QueryError, SnapshotError, check_k, check_queries
from silverrec.retrieval.filtered_search import search_index
from silverrec.serving.device import CPU, exported_on, moves, resolve_device, serving_module
from silverrec.snapshot import SCRIPT_FILE, check_build, load_exported, load_scripted, needs_torchrec, read_manifest
from silverrec.spec import ModelSpec


@dataclass
class SearchResult:
    """Top-k answer: item ids int64 [B, k] (-1 = no item) and scores float32 [B, k] (-inf = none)."""

    item_ids: torch.Tensor
    scores: torch.Tensor

    def to_json(self, arrays: bool = False) -> dict[str, Any]:
        """{"item_ids", "scores"} as lists (non-finite scores as None); arrays=True: as C-contiguous
        numpy arrays, for an encoder that writes them (orjson; it writes non-finite as null)."""
        if arrays:
            return {"item_ids": np.ascontiguousarray(self.item_ids.numpy()),
                    "scores": np.ascontiguousarray(self.scores.numpy())}
        scores = self.scores.tolist()
        scores = [[s if np.isfinite(s) else None for s in row] for row in scores]
        return {"item_ids": self.item_ids.tolist(), "scores": scores}



class Snapshot:
    """A loaded, verified snapshot: its manifest and its runtime module."""

    def __init__(self, path: Path, manifest: dict[str, Any], module: torch.nn.Module, backend: str,
                 device: torch.device = CPU):
        self.path = path
        self.manifest = manifest
        self.module = module
        self.backend = backend
        self.device = device  # where the program runs (requests and results stay on the CPU)
        self.buckets = None  # on a device, the shape buckets its calls are padded to (silverrec/serving/buckets.py)

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["config"]

    def recommend(self, requests, **options: Any):
        """Recommendations, one forward call, from every snapshot but a pure-ANN index:
        `recommend(requests, k=10, k0=None, nprobe=None, max_probe=None, mode="auto",
        exclude_history=True)` with requests as in silverrec/serving/recommend.py -> `Recommendations`.
        """
        if self.kind != "rec" or self.spec.answers_search:
            raise QueryError("this snapshot is a pure-ANN index (published from a pool): it answers search "
                             "requests by query embedding, not recommend requests")
        return self.rec_handler().recommend(requests, **options)

    def rank(self, request, item_ids):
        """Early-stage ranking (a model with a trained user tower): scores of `item_ids` for one user, in their order."""
        if self.kind != "rec" or not self.spec.ranks:
            raise QueryError("only a recommendation model with a user tower (silverrec publish --config) ranks "
                             "items for a user")
        return self.rec_handler().rank(request, item_ids)

    def rec_handler(self):
        if getattr(self, "_rec", None) is None:
            from silverrec.serving.recommend import RecHandler

            self._rec = RecHandler.from_snapshot(self)
        return self._rec

    @property
    def spec(self) -> ModelSpec | None:
        """The root module's configuration (a "rec" snapshot), None for a sharded top manifest."""
        if self.kind != "rec":
            return None
        if getattr(self, "_spec", None) is None:
            self._spec = ModelSpec.from_json(self.config.get("spec"))
        return self._spec

    def search(self, queries: torch.Tensor | np.ndarray, k: int, **options: Any) -> SearchResult:
        """Top-k items for each query embedding (a pure-ANN snapshot: `silverrec publish --pool`).
        Options: filter, nprobe, max_probe, mode (silverrec/retrieval/filtered_search.py)."""
        spec = self.spec
        if spec is None or not spec.answers_search:
            what = f"kind {self.kind!r}" if spec is None else "a recommendation model (its user is computed in-model)"
            raise QueryError(f"snapshot {what} does not answer search requests by query embedding (use recommend)")
        if isinstance(queries, np.ndarray):
            queries = torch.from_numpy(queries)
        queries = check_queries(queries, self.config["dim"])
        check_k(k, self.manifest["item_count"])
        with torch.inference_mode():
            scores, item_ids = search_index(self, queries, k, **options)
        return SearchResult(item_ids=item_ids, scores=scores)


def load_snapshot(path: str | os.PathLike, backend: str = "auto", verify: bool = True,
                  device: str | torch.device = "cpu", buckets: Any = True, streams: int = 1) -> Snapshot:
    """Verify and load one snapshot directory (`silverrec.load` also loads a sharded one).

    Args:
        path: snapshot directory.
        backend: "export" (model.pt2), "torchscript" (model.ts), "aoti" (the AOTInductor package for the
            device, model.cpu.pt2 / model.cuda.pt2: silverrec/aoti.py), or "auto" (default): the one the
            publisher measured fastest on this snapshot (manifest `config.backend.preferred`; a snapshot
            that records none loads model.pt2).
        verify: check sizes and sha256 of every file against the manifest (default on).
        device: where the program runs: "cpu" (default), "cuda", "cuda:N" or a torch.device. The
            API takes and returns CPU tensors on every device (silverrec/serving/device.py).
        buckets: on a device, the request shapes' padding and the warm-up at load
            (silverrec/serving/buckets.py): True (default) the defaults, a dict of `Buckets` fields
            (`{"warm_batches": ()}`: no warm-up), False: shapes as they come. Unread on the CPU.
        streams: on a device, the CUDA streams concurrent calls run on (StreamPool; `silverrec tune`
            picks the count for a server). Unread on the CPU.
    Raises:
        SnapshotError: missing/truncated/altered file, newer format version, unknown backend, or
            built by a torch / silverrec / torchrec / fbgemm_gpu whose major.minor differs from this
            process's (`snapshot.check_build`; the message names both versions), or an unknown
            device, or CUDA requested where torch.cuda.is_available() is False.
    """
    device = resolve_device(device)
    root = Path(path)
    manifest = read_manifest(root, verify=verify)
    check_build(manifest, root)  # the versions that built it against this process's, before deserialising
    if backend == "auto":
        backend = manifest.get("config", {}).get("backend", {}).get("preferred", "export")
        if backend == "aoti" and package_entry(manifest, device) is None:  # measured on another device
            backend = "export"
    if needs_torchrec(manifest):  # the trained user tower's program holds fbgemm / torchrec ops
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    elif manifest.get("kind") == "rec":  # a team's own tower may use them: register their ops if installed
        with contextlib.suppress(ImportError):
            import fbgemm_gpu  # noqa: F401
            import torchrec  # noqa: F401
    try:
        if backend == "export":
            # Unbacked size symbols of data-dependent ops are re-created on load; torch warns once
            # per symbol that it "did not appear in the graph", which is expected and harmless.
            serde_log = logging.getLogger("torch._export.serde.serialize")
            level = serde_log.level
            serde_log.setLevel(logging.ERROR)
            try:
                program = load_exported(root, manifest)
                module = exported_on(program, device) if moves(device) else program.module()
            finally:
                serde_log.setLevel(level)
        elif backend == "torchscript":
            if SCRIPT_FILE not in manifest["files"]:
                raise SnapshotError(f"snapshot {root} has no TorchScript file ({SCRIPT_FILE})")
            module = load_scripted(root, manifest, map_location=device if moves(device) else None)
        elif backend == "aoti":
            entry = package_entry(manifest, device)
            if entry is None or entry["file"] not in manifest["files"]:
                failed = (manifest.get("config", {}).get("backend", {}).get("aoti") or {}).get(device.type, {})
                why = (f"its compile failed: {failed['error']}" if "error" in failed else
                       "published with SILVERREC_AOTI=0, or on a machine without that device")
                raise SnapshotError(f"snapshot {root} has no AOTInductor package for {device.type} ({why})")
            module = AotiProgram(root / entry["file"], entry["int_args"], device)
        else:
            raise SnapshotError(f"unknown backend {backend!r}: use 'export', 'torchscript' or 'aoti'")
    except SnapshotError:
        raise
    except Exception as e:  # deserialisation failures become one clear error
        raise SnapshotError(f"cannot load {backend} program from {root}: {type(e).__name__}: {e}") from e
    if not moves(device) or backend == "aoti":  # a package is compiled for its device
        return Snapshot(root, manifest, module, backend, device)
    from silverrec.serving.buckets import Buckets, warm_up

    buckets = Buckets.coerce(buckets)
    snap = Snapshot(root, manifest, serving_module(module, manifest, device, streams, buckets), backend, device)
    snap.buckets = buckets  # the rank program's too (RecHandler)
    if buckets is not None:
        warm_up(snap, buckets)
    return snap
