"""Sharded publish: one logical index split into S ordinary snapshots plus a top manifest.

    DIR/manifest.json        kind "sharded": base kind ("rec"), shard count, shard_by, one version id,
                             {shard-i/manifest.json: {sha256, bytes}} and per-shard item counts
    DIR/centroids.npy        float32 [nlist, D] the global coarse quantiser (routing)
    DIR/shard-00000/ ...     an ordinary pure-ANN snapshot of the shard's rows (loads and verifies alone)

Every shard is built from one global state, so the union of the shards answers like the unsharded
index: one global k-means (on a sample: `kmeans` trains on at most max_points_per_centroid * nlist
points; an exact index is one cluster) gives the centroids every shard keeps, one set of
per-dimension quantisation ranges gives the codes, one global vocabulary and Bloom configuration
gives the filter rows. A shard holds some rows of the global cluster-major layout, in the same
order, with their Bloom bank words, exact value planes and posting lists rebuilt on its rows.

Two ways to split the rows (`shard_by`):
    items     item id hashed (splitmix64) to a shard: every shard holds part of every cluster;
              balanced; every query reaches every shard.
    clusters  whole clusters to shards, largest first to the lightest shard (LPT): a query scans
              only the shards owning one of its probed clusters (nlist > 1 only).

    >>> publish_sharded(pool, "snapshots/v1", spec=ShardSpec(4, "items"))
    >>> silverrec.load("snapshots/v1").search(queries, k=100)    # exact merge of the 4 shards
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from silverrec.errors import PoolError
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.kernels.ivf_scan import bitmask_words
from silverrec.retrieval.filtered_ivf import FilteredIVFIndex
from silverrec.retrieval.ivf_index import Int8IVFIndex
from silverrec.publish.bloom import choose_config
from silverrec.publish.filtered_ivf import empty_filter_config, filter_index, pool_rows, search_section, write_index
from silverrec.publish.ivf import IVFConfig, build_ivf, ivf_manifest_config
from silverrec.publish.pool import Pool
from silverrec.publish.postings import default_limit
from silverrec.publish.progress import step
from silverrec.serving.sharded import CENTROIDS_FILE, SHARDED_KIND
from silverrec.snapshot import FORMAT_VERSION, MANIFEST, move_into_place, sha256_file

SHARD_BY = ("items", "clusters")
# Chosen from benchmarks/results/shards.json (see docs/scale-out.md): at batch 16 a request probes
# clusters on every shard anyway, so cluster ownership saves no fan-out and costs imbalance.
DEFAULT_SHARD_BY = "items"


def shard_dir_name(i: int) -> str:
    return f"shard-{i:05d}"


@dataclass
class ShardSpec:
    """How to split: `shards` >= 1 snapshots, rows by `shard_by` ("items" | "clusters")."""

    shards: int
    shard_by: str = DEFAULT_SHARD_BY

    def __post_init__(self):
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise PoolError(f"shards must be a positive int, got {self.shards!r}")
        if self.shard_by not in SHARD_BY:
            raise PoolError(f"shard_by must be one of {SHARD_BY}, got {self.shard_by!r}")


def hash_items(item_ids: np.ndarray, shards: int) -> np.ndarray:
    """int64 [N] shard of each item id: splitmix64(id) mod shards (stable across publishes)."""
    z = item_ids.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(shards)).astype(np.int64)


def clusters_to_shards(sizes: np.ndarray, shards: int) -> np.ndarray:
    """int64 [nlist] owning shard of each cluster: largest cluster first to the lightest shard."""
    if shards > sizes.size:
        raise PoolError(f"--shard-by clusters needs at least one cluster per shard: {shards} shards, {sizes.size} clusters")
    owner = np.zeros(sizes.size, dtype=np.int64)
    load = np.zeros(shards, dtype=np.int64)
    for c in np.argsort(-sizes, kind="stable"):
        s = int(np.argmin(load))
        owner[c] = s
        load[s] += int(sizes[c])
    return owner


def _sub_ivf(ivf: Int8IVFIndex, rows: torch.Tensor) -> Int8IVFIndex:
    """The global index restricted to `rows` (ascending global rows: cluster-major order kept)."""
    cluster_of_row = torch.repeat_interleave(
        torch.arange(ivf.nlist), ivf.cluster_offsets[1:] - ivf.cluster_offsets[:-1]
    )
    counts = torch.bincount(cluster_of_row[rows], minlength=ivf.nlist)
    offsets = torch.zeros(ivf.nlist + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    # clone: a shard's buffers must own their storage (torch.export.save cannot package views of
    # a larger tensor it does not see)
    return Int8IVFIndex(ivf.codes[rows], ivf.dim_scale.clone(), ivf.dim_offset.clone(), offsets,
                        ivf.centroids.clone(), ivf.row_to_item[rows], residual=ivf.residual)


def _shard_of_rows(item_ids: np.ndarray, cluster_of_row: Optional[np.ndarray], sizes: Optional[np.ndarray],
                   spec: ShardSpec) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """(shard of every row int64 [N], owning shard of every cluster or None)."""
    if spec.shard_by == "items":
        return hash_items(item_ids, spec.shards), None
    owner = clusters_to_shards(sizes, spec.shards)
    return owner[cluster_of_row], owner


def publish_sharded(
    pool: Pool,
    out: str | os.PathLike,
    *,
    spec: ShardSpec,
    config: Optional[IVFConfig] = None,
    bloom_bits: Optional[int] = None,
    bloom_hashes: Optional[int] = None,
    torchscript: bool = True,
    overwrite: bool = False,
) -> Path:
    """Publish `pool` as a sharded snapshot at `out` (atomically: a temporary sibling, then rename).

    Args:
        spec: shard count and split; "clusters" needs nlist > 1.
        config / bloom_bits / bloom_hashes: as for `publish_index` (config.nlist 1: an exact index).
    Raises:
        PoolError: clusters split of an exact index, a shard with no items.
    """
    if config is not None and config.nlist == 1 and spec.shard_by == "clusters":
        raise PoolError("--shard-by clusters needs an IVF index (an exact index has one cluster): use --shard-by items")
    if spec.shards > pool.size:
        raise PoolError(f"{spec.shards} shards exceed the {pool.size} items in the pool")
    out = Path(out).resolve()
    if out.exists() and not overwrite:
        raise PoolError(f"{out} already exists; choose a new version directory or pass overwrite")
    shard_modules, base_config, centroids, owner = _index_shards(pool, spec, config, bloom_bits, bloom_hashes)
    empty = [i for i, (m, _) in enumerate(shard_modules) if m.codes.shape[0] == 0]
    if empty:
        raise PoolError(f"shard {empty[0]} of {spec.shards} would hold no items: publish fewer shards")

    version = uuid.uuid4().hex
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shard_meta = []
        for i, (module, shard_cfg) in enumerate(shard_modules):
            n_i = int(module.codes.shape[0])
            cfg = dict(base_config, **shard_cfg)
            cfg["shard"] = {"index": i, "count": spec.shards, "shard_by": spec.shard_by, "version": version}
            with step(f"shard {i}/{spec.shards}: {n_i} items, exporting"):
                write_index(module, cfg, tmp / shard_dir_name(i), torchscript=torchscript)
            shard_meta.append({"dir": shard_dir_name(i), "item_count": n_i,
                               "clusters": None if owner is None else np.flatnonzero(owner == i).tolist()})
        files = {}
        if centroids is not None:
            np.save(tmp / CENTROIDS_FILE, centroids.numpy().astype(np.float32))
        for i in range(spec.shards):
            p = tmp / shard_dir_name(i) / MANIFEST
            files[f"{shard_dir_name(i)}/{MANIFEST}"] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        if centroids is not None:
            p = tmp / CENTROIDS_FILE
            files[CENTROIDS_FILE] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        top_cfg = {k: v for k, v in base_config.items() if k != "filter"}
        top_cfg.update({"base_kind": "rec", "shards": shard_meta, "shard_by": spec.shard_by, "version": version})
        manifest = _top_manifest(top_cfg, pool.size, files)
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _top_manifest(config: dict[str, Any], item_count: int, files: dict[str, Any]) -> dict[str, Any]:
    from silverrec import __version__

    return {
        "format_version": FORMAT_VERSION,
        "silverrec_version": __version__,
        "torch_version": torch.__version__,
        "kind": SHARDED_KIND,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "item_count": int(item_count),
        "config": config,
        "files": files,
    }


def _global_ivf(pool: Pool, spec: ShardSpec, config: Optional[IVFConfig]):
    config = config or IVFConfig()
    ivf, km = build_ivf(pool, config)
    sizes = (ivf.cluster_offsets[1:] - ivf.cluster_offsets[:-1]).numpy()
    cluster_of_row = np.repeat(np.arange(ivf.nlist), sizes)
    shard, owner = _shard_of_rows(ivf.row_to_item.numpy().astype(np.int64), cluster_of_row, sizes, spec)
    base = ivf_manifest_config(pool, ivf, config, km)
    return ivf, shard, owner, base


def _index_shards(pool: Pool, spec: ShardSpec, config, bloom_bits, bloom_hashes):
    """Per shard: its rows of the global layout as a FilteredIVFIndex (an empty filter bank when the
    pool has no categorical features) and its manifest additions."""
    ivf, shard, owner, base = _global_ivf(pool, spec, config)
    nprobe = int(base["default_nprobe"])
    fwd = None
    if pool.features:
        with step("global vocabulary and Bloom configuration"):
            fwd = ForwardIndex.from_lists(pool.features).permute(pool_rows(pool, ivf.row_to_item))
            bloom_cfg = choose_config(fwd, bloom_bits, bloom_hashes)
            limit = default_limit(pool.size)  # one posting limit: a filter takes the same route everywhere
    elif bloom_bits is not None or bloom_hashes is not None:
        raise PoolError("Bloom options need a pool with categorical features")
    base["index"] = "filtered_ivf_int8"
    mods = []
    for i in range(spec.shards):
        rows = torch.from_numpy(np.flatnonzero(shard == i))
        sub = _sub_ivf(ivf, rows)
        if fwd is None:
            module = FilteredIVFIndex.from_ivf(sub, torch.zeros(0, (rows.numel() + 63) // 64, dtype=torch.int64))
            filter_config = empty_filter_config(rows.numel())
        else:
            with step(f"shard {i}: Bloom bank, exact planes and posting lists of {rows.numel()} rows"):
                module, filter_config = filter_index(sub, fwd.permute(rows), bloom_cfg, posting_limit=limit)
        mods.append((module, {"filter": filter_config, "search": search_section(module, nprobe),
                              "bitmask_words": bitmask_words(sub.cluster_offsets)}))
    return mods, base, ivf.centroids, owner


