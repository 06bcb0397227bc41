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
from silverrec.errors import QueryError, SnapshotError, check_k, check_queries
from silverrec.retrieval.filtered_search import search_index
from silverrec.serving.device import CPU, exported_on, moves, resolve_device, serving_module
from silverrec.snapshot import SCRIPT_FILE, check_build, load_exported, load_scripted, needs_torchrec, read_manifest
from silverrec.bitmask import pack_bits, unpack_bits
from silverrec.spec import ModelSpec


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

    def __init__(self, path: Path, manifest: dict[str, Any], module: torch.nn.Module, backend: str,
                 device: torch.device = CPU):
        self.path = path
        self.manifest = manifest
        self.module = module
        self.backend = backend
        self.device = device  # where the program runs (requests and results stay on the CPU)

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["config"]

    def recommend(self, requests, *args: Any, **options: Any):
        """Recommendations, one forward call.

        A "rec" snapshot (the recommendation model): `recommend(requests, k=10, k0=None,
        nprobe=None, max_probe=None, mode="auto", exclude_history=True)` with requests as in
        silverrec/serving/recommend.py -> `Recommendations`. A "generative" snapshot:
        `recommend(history_item_ids, filter_bitmask=None, exclude_history=False)` -> SearchResult.
        """
        if self.kind == "rec":
            if self.spec.answers_search:
                raise QueryError("this snapshot is a pure-ANN index (published from a pool): it answers search "
                                 "requests by query embedding, not recommend requests")
            return self.rec_handler().recommend(requests, *args, **options)
        return self._recommend_generative(requests, *args, **options)

    def rank(self, request, item_ids):
        """Early-stage ranking (a "rec" snapshot): scores of `item_ids` for one user, in their order."""
        if self.kind != "rec" or self.spec.answers_search:
            raise QueryError("only a recommendation model (silverrec publish --config) ranks items for a user")
        return self.rec_handler().rank(request, item_ids)

    def rec_handler(self):
        if getattr(self, "_rec", None) is None:
            from silverrec.serving.recommend import RecHandler

            self._rec = RecHandler.from_snapshot(self)
        return self._rec

    def _recommend_generative(self, history_item_ids: list[list[int]], filter_bitmask: torch.Tensor | None = None,
                              exclude_history: bool = False) -> SearchResult:
        """Next items for each history (a "generative" snapshot), one forward call.

        Args:
            history_item_ids: per request, item ids oldest first; only the most recent
                `config["max_history_items"]` are used. Unknown ids raise QueryError.
            filter_bitmask: optional int64 [B, ceil(N/64)]: bit r & 63 of word r >> 6 allows item
                row r of `generative_item_ids()` (trie leaf order); None = every item.
            exclude_history: also clear the bits of each request's history items (its whole
                history, not only the most recent items), so they are pruned during the decode.
        Returns:
            item_ids int64 [B, beam_width] (-1 = fewer valid items) and scores float32 (summed
            log-probs, descending; -inf = none).
        """
        if self.kind != "generative":
            raise QueryError(f"snapshot kind {self.kind!r} does not answer recommend requests (use search)")
        ids, tokens, order = self._generative_items()
        history = history_tokens(history_item_ids, ids[order], tokens[order], int(self.config["max_history_items"]))
        n, B = self.manifest["item_count"], history.shape[0]
        words = (n + 63) // 64
        if filter_bitmask is None:
            filter_bitmask = torch.full((B, words), -1, dtype=torch.int64)
        elif not isinstance(filter_bitmask, torch.Tensor) or filter_bitmask.dtype != torch.int64 \
                or tuple(filter_bitmask.shape) != (B, words):
            got = tuple(filter_bitmask.shape) if isinstance(filter_bitmask, torch.Tensor) else type(filter_bitmask).__name__
            raise QueryError(f"filter_bitmask must be int64 [{B}, {words}], got "
                             f"{getattr(filter_bitmask, 'dtype', '')} {got}")
        if exclude_history:
            allowed = unpack_bits(filter_bitmask, n)
            for b, h in enumerate(history_item_ids):  # every id is known: history_tokens checked them
                hist = np.asarray(h, dtype=np.int64).reshape(-1)
                allowed[b, torch.from_numpy(order[np.searchsorted(ids[order], hist)])] = False
            filter_bitmask = pack_bits(allowed)
        with torch.inference_mode():
            item_ids, scores = self.module(history.contiguous(), filter_bitmask.contiguous())
        return SearchResult(item_ids=item_ids, scores=scores)

    def generative_item_ids(self) -> np.ndarray:
        """int64 [N] item id of every row of a generative snapshot (the filter bitmask's order)."""
        return self._generative_items()[0]

    def _generative_items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if getattr(self, "_items", None) is None:
            with np.load(self.path / self.config["items_file"], allow_pickle=False) as f:
                ids, tokens = f["item_ids"], f["tokens"]
            self._items = (ids, tokens, np.argsort(ids, kind="stable"))
        return self._items

    @property
    def spec(self) -> ModelSpec | None:
        """The root module's configuration (a "rec" snapshot), None for other kinds."""
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


ITEMS_FILE = "items.npz"  # generative snapshots: item_ids [N], tokens [N, L] in trie leaf order


def history_tokens(histories: list[list[int]], sorted_ids: np.ndarray, sorted_tokens: np.ndarray,
                   max_items: int) -> torch.Tensor:
    """Item-id histories -> left-padded decoder input int64 [B, T] (generative contract).

    Each row is BOS (1) + the L tokens of its last `max_items` items, oldest first, left-padded
    with PAD (0); T = max(2, longest row). sorted_ids int64 [N] ascending, sorted_tokens [N, L].
    Raises QueryError naming the first unknown item id (and its request).
    """
    if isinstance(histories, (str, bytes)) or not hasattr(histories, "__len__") or len(histories) == 0:
        raise QueryError("history_item_ids must be a non-empty list of item-id lists")
    rows = []
    for b, h in enumerate(histories):
        try:
            h = np.asarray(h, dtype=np.int64).reshape(-1)[-max_items:] if len(h) else np.zeros(0, np.int64)
        except (TypeError, ValueError, OverflowError):
            raise QueryError(f"history {b} must be a list of integer item ids") from None
        pos = np.searchsorted(sorted_ids, h).clip(0, len(sorted_ids) - 1)
        bad = np.flatnonzero(sorted_ids[pos] != h)
        if bad.size:
            raise QueryError(f"unknown history item id {int(h[bad[0]])} in history {b}: not in the snapshot's pool")
        rows.append(sorted_tokens[pos].reshape(-1))
    T = max(2, 1 + max(r.size for r in rows))
    out = torch.zeros(len(rows), T, dtype=torch.int64)
    for b, r in enumerate(rows):
        out[b, T - r.size - 1] = 1  # BOS
        out[b, T - r.size :] = torch.from_numpy(r)
    return out


def load_snapshot(path: str | os.PathLike, backend: str = "auto", verify: bool = True,
                  device: str | torch.device = "cpu") -> Snapshot:
    """Verify and load one snapshot directory (`silverrec.load` also loads a sharded one).

    Args:
        path: snapshot directory.
        backend: "export" (model.pt2), "torchscript" (model.ts), or "auto" (default): the one the
            publisher measured faster on this snapshot (manifest `config.backend.preferred`; a
            snapshot that records none loads model.pt2).
        verify: check sizes and sha256 of every file against the manifest (default on).
        device: where the program runs: "cpu" (default), "cuda", "cuda:N" or a torch.device. The
            API takes and returns CPU tensors on every device (silverrec/serving/device.py).
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
        else:
            raise SnapshotError(f"unknown backend {backend!r}: use 'export' or 'torchscript'")
    except SnapshotError:
        raise
    except Exception as e:  # deserialisation failures become one clear error
        raise SnapshotError(f"cannot load {backend} program from {root}: {type(e).__name__}: {e}") from e
    if moves(device):
        module = serving_module(module, manifest, device)
    return Snapshot(root, manifest, module, backend, device)
