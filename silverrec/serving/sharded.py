"""One-process sharded search: shard after shard, then an exact merge of the per-shard top-k.

The reference for the distributed runtime (silverrec/serving/distributed.py, which runs the same
`shard_topk` on every rank and the same `merge_topk` on rank 0) and the path for small deployments.

    >>> snap = silverrec.load("snapshots/sharded")       # a top manifest (publish --shards S)
    >>> snap.search(queries, k=100, nprobe=16)            # == the unsharded index's answer

Exactness: every shard keeps the global centroids and quantisation ranges, so a query probes the
same clusters and scores every row exactly as the unsharded index would; each shard returns its
best min(k, its items) and the merge keeps the best k of the union, ordered by (score descending,
item id ascending). For exact and IVF kinds the sharded answer therefore equals the unsharded one
item for item (up to the order of tied scores). Filtered IVF: the "probed" and "unprobed" modes
and the posting route are exact in the same way; "auto" widens the probe from each shard's own
match counts, so its answers can differ from the unsharded index's (both are valid auto answers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from silverrec.errors import QueryError, SnapshotError, check_k, check_queries
from silverrec.retrieval.filtered_search import probe_depth, search_index
from silverrec.serving.predictor import SearchResult, Snapshot, load_snapshot
from silverrec.snapshot import read_manifest

SHARDED_KIND = "sharded"
CENTROIDS_FILE = "centroids.npy"


class ShardVerificationError(SnapshotError):
    """A shard of a sharded snapshot fails verification (missing, altered, another version)."""


def read_top(path: str | Path, verify: bool = True) -> tuple[dict[str, Any], Optional[torch.Tensor]]:
    """Read and verify a sharded snapshot's top manifest -> (manifest, centroids float32 [nlist, D] or None).

    Verification covers the top manifest's files: each shard's manifest.json (sha256) and the
    centroids; each shard's own files are verified when the shard is loaded (`load_shard`).
    """
    root = Path(path)
    try:
        manifest = read_manifest(root, verify=verify)
    except SnapshotError as e:
        raise ShardVerificationError(f"sharded snapshot {root}: {e}") from None
    if manifest.get("kind") != SHARDED_KIND:
        raise SnapshotError(f"{root} is a {manifest.get('kind')!r} snapshot, not a sharded one")
    centroids = None
    if CENTROIDS_FILE in manifest["files"]:
        centroids = torch.from_numpy(np.load(root / CENTROIDS_FILE, allow_pickle=False))
    return manifest, centroids


def load_shard(path: str | Path, manifest: dict[str, Any], i: int, backend: str = "auto", verify: bool = True,
               device: str | torch.device = "cpu") -> Snapshot:
    """Load shard `i` alone (verifying its own files).

    Raises:
        ShardVerificationError: the shard is missing or altered, or belongs to another version.
    """
    cfg = manifest["config"]
    shards = cfg["shards"]
    if not 0 <= i < len(shards):
        raise ShardVerificationError(f"shard {i} out of range: the snapshot has {len(shards)} shards")
    shard_path = Path(path) / shards[i]["dir"]
    try:
        snap = load_snapshot(shard_path, backend=backend, verify=verify, device=device)
    except SnapshotError as e:
        raise ShardVerificationError(f"shard {i} ({shard_path}) failed verification: {e}") from None
    meta = snap.config.get("shard", {})
    if meta.get("version") != cfg["version"] or meta.get("index") != i or snap.kind != cfg["base_kind"]:
        raise ShardVerificationError(
            f"shard {i} ({shard_path}) is shard {meta.get('index')} of version {meta.get('version')!r} "
            f"(kind {snap.kind!r}); the top manifest names version {cfg['version']!r} (kind {cfg['base_kind']!r})"
        )
    if snap.manifest["item_count"] != shards[i]["item_count"]:
        raise ShardVerificationError(f"shard {i} holds {snap.manifest['item_count']} items, the top manifest says {shards[i]['item_count']}")
    return snap


def routed_rows(centroids: Optional[torch.Tensor], owned: Optional[Sequence[int]], queries: torch.Tensor, k: int,
                options: dict[str, Any], cfg: dict[str, Any]) -> Optional[torch.Tensor]:
    """bool [B]: the query rows whose probed clusters include one the shard owns (clusters split),
    or None = every row (items split, or a filtered request that may widen its probe). cfg: a shard's
    config (its probe defaults: the depth a request without nprobe gets, `probe_depth`)."""
    if owned is None or centroids is None:
        return None
    if options.get("filter") is not None:
        return None
    nprobe = options.get("nprobe")
    if nprobe is None:
        try:
            nprobe = int(probe_depth(cfg, k, 1.0, options.get("target_recall")))
        except QueryError:
            return None  # the shard's handler names the bad value
    if isinstance(nprobe, bool) or not isinstance(nprobe, int) or not 1 <= nprobe <= centroids.shape[0]:
        return None  # the shard's handler names the bad value
    probes = torch.ops.silverrec.centroid_candidates(queries, centroids, nprobe)  # [B, nprobe]: the shards' probes
    mine = torch.zeros(centroids.shape[0], dtype=torch.bool)
    mine[torch.as_tensor(list(owned), dtype=torch.int64)] = True
    return mine[probes].any(dim=1)


def shard_topk(snap, queries: torch.Tensor, k: int, options: dict[str, Any],
               rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One shard's part: (scores float32 [B, k], item_ids int64 [B, k]), padded with -inf / -1.

    Asks the shard for min(k, its items); `rows` bool [B] limits the search to those query rows
    (the others get padding only)."""
    B = queries.shape[0]
    scores = torch.full((B, k), float("-inf"), dtype=torch.float32)
    ids = torch.full((B, k), -1, dtype=torch.int64)
    k_s = min(k, int(snap.manifest["item_count"]))
    if rows is not None:
        if not bool(rows.any()):
            return scores, ids
        if bool(rows.all()):
            rows = None
    q = queries if rows is None else queries[rows]
    with torch.inference_mode():
        s, i = search_index(snap, q, k_s, **options)
    if rows is None:
        scores[:, :k_s], ids[:, :k_s] = s, i
    else:
        scores[rows, :k_s], ids[rows, :k_s] = s, i
    return scores, ids


def merge_topk(scores: Sequence[torch.Tensor], ids: Sequence[torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of per-shard top-k lists [B, k_i] -> the best k of their union [B, k], ordered by
    (score descending, item id ascending); padding (-inf, -1) sorts last. Cost O(B * S*k * log(S*k))."""
    s = torch.cat(list(scores), dim=1)
    i = torch.cat(list(ids), dim=1)
    by_id = torch.argsort(torch.where(i < 0, torch.iinfo(torch.int64).max, i), dim=1, stable=True)
    s, i = s.gather(1, by_id), i.gather(1, by_id)
    by_score = torch.argsort(s, dim=1, descending=True, stable=True)[:, :k]
    return s.gather(1, by_score), i.gather(1, by_score)


class ShardedSnapshot:
    """A loaded sharded snapshot answering in one process (same surface as predictor.Snapshot.search).

    Attributes: path, manifest (the top manifest), shards (predictor.Snapshot each), centroids.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], shards: list, centroids: Optional[torch.Tensor]):
        self.path = path
        self.manifest = manifest
        self.shards = shards
        self.centroids = centroids

    @property
    def kind(self) -> str:
        """The kind every shard has ("rec": the root module in its pure-ANN configuration)."""
        return self.manifest["config"]["base_kind"]

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["config"]

    @property
    def backend(self) -> str:
        return self.shards[0].backend

    @property
    def template(self):
        """Shard 0: its config (nlist, probe defaults) and filter vocabulary are the global ones
        (every shard keeps them), so the server validates requests against it."""
        return self.shards[0]

    def owned_clusters(self, i: int) -> Optional[list[int]]:
        return self.config["shards"][i]["clusters"]

    def search(self, queries, k: int, **options: Any):
        """Top-k over every shard, merged exactly -> SearchResult (item_ids int64 [B, k], scores float32 [B, k])."""
        if isinstance(queries, np.ndarray):
            queries = torch.from_numpy(queries)
        queries = check_queries(queries, self.config["dim"])
        check_k(k, self.manifest["item_count"])
        parts_s, parts_i = [], []
        for i, shard in enumerate(self.shards):
            rows = routed_rows(self.centroids, self.owned_clusters(i), queries, k, options, shard.config)
            s, ids = shard_topk(shard, queries, k, options, rows)
            parts_s.append(s)
            parts_i.append(ids)
        scores, item_ids = merge_topk(parts_s, parts_i, k)
        return SearchResult(item_ids=item_ids, scores=scores)

    def recommend(self, *args: Any, **kwargs: Any):
        raise QueryError("sharded snapshots answer search requests; sharded recommendation models are not built yet")


def load_sharded(path: str | Path, backend: str = "auto", verify: bool = True,
                 device: str | torch.device = "cpu") -> ShardedSnapshot:
    """Verify the top manifest, then load and verify every shard alone (`silverrec.load` calls this
    for a sharded snapshot). Raises ShardVerificationError naming the first bad shard."""
    root = Path(path)
    manifest, centroids = read_top(root, verify=verify)
    shards = [load_shard(root, manifest, i, backend, verify, device) for i in range(len(manifest["config"]["shards"]))]
    return ShardedSnapshot(root, manifest, shards, centroids)
