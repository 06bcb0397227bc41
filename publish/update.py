"""Incremental pool updates: a new snapshot version from a parent snapshot and a delta.

    silverrec update SNAPSHOT --upsert ITEMS.parquet [--delete IDS] --out NEW_DIR

    >>> from silverrec.publish.update import update_snapshot
    >>> update_snapshot("snapshots/v1", "snapshots/v2", upsert="items.parquet", delete=[17, 42])

The new version keeps the parent's centroids, quantisation ranges and build config. Upserted items
(new ids, or ids whose embedding or features changed) are assigned to their nearest parent
centroid and quantised with the parent's ranges (values outside are clamped and counted); deleted
and replaced items leave every structure. Codes and ids of the other items are copied cluster by
cluster (no k-means, no re-quantisation); filtered snapshots copy their Bloom rows bit-column by
bit-column and compute Bloom rows only for the upserted items; new feature values join the end of
the vocabulary (existing value codes keep their meaning); exact planes are copied too unless
a feature's plane layout (values per item x code bits) changed, and posting lists are rebuilt from
the forward index (`forward.npz`, which filtered snapshots carry for this purpose).

The manifest's "update" section records the parent (path, created, manifest sha256), generation,
counts, timings and drift signals; `advice(manifest)` says when a full rebuild is advised.

Parents: pure-ANN snapshots (`silverrec publish --pool`: the root module with a query tower; an
exact one has one cluster). A recommendation model or a generative snapshot is refused (its item
embeddings come from a trained item tower and its pool carries ranking caches: re-publish it).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
import pyarrow.parquet as pq
import torch

from silverrec.errors import PoolError, SnapshotError
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.publish.bloom import BloomConfig, _pack_columns, bloom_rows, exact_planes, estimate_fp_rate
from silverrec.publish.forward_file import read_forward
from silverrec.publish.kmeans import assign
from silverrec.publish.pool import Pool, read_pool
from silverrec.publish.stages import StageClock
from silverrec.retrieval.sources import INDEX_TENSORS
from silverrec.snapshot import MANIFEST, load_exported, read_manifest, read_tensors, verify_files

# Drift thresholds past which `advice` recommends a full rebuild.
MAX_IMBALANCE_RATIO = 1.25  # cluster-size imbalance / imbalance of the last full build
MAX_CLAMPED_SHARE = 1e-3  # clamped values / values quantised since the last full build
MAX_CHANGED_SHARE = 0.5  # items upserted since the last full build / items now


_VERIFIER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="silverrec-verify")


class DeltaError(PoolError):
    """A bad update delta: unknown id to delete, wrong dimension, duplicate id, unknown feature..."""


# ------------------------------------------------------------------------------------ the delta


def read_ids(path: str | os.PathLike) -> np.ndarray:
    """Item ids to delete: a Parquet file with an `item_id` column, or text with one id a line."""
    path = Path(path)
    if not path.is_file():
        raise DeltaError(f"delete list {path} does not exist")
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        if "item_id" not in table.column_names:
            raise DeltaError(f"delete list {path} has no column 'item_id' (columns: {table.column_names})")
        return table.column("item_id").to_numpy().astype(np.int64)
    ids = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            ids.append(int(text))
        except ValueError:
            raise DeltaError(f"delete list {path} line {n}: {text!r} is not an integer item id") from None
    return np.asarray(ids, dtype=np.int64)


def _check_delta(parent_ids: np.ndarray, upsert: Optional[Pool], delete: np.ndarray, dim: int, features: list[str]) -> None:
    if upsert is None and delete.size == 0:
        raise DeltaError("empty delta: give items to upsert and/or ids to delete")
    if delete.size:
        uniq, counts = np.unique(delete, return_counts=True)
        if (counts > 1).any():
            raise DeltaError(f"duplicate id {int(uniq[counts > 1][0])} in the delete list")
        missing = ~np.isin(delete, parent_ids)
        if missing.any():
            raise DeltaError(
                f"cannot delete item_id {int(delete[missing][0])}: not in the parent snapshot "
                f"({int(missing.sum())} of {delete.size} ids to delete are unknown)"
            )
    if upsert is None:
        return
    if upsert.dim != dim:
        raise DeltaError(f"upserted items have dimension {upsert.dim}, the parent snapshot holds {dim}-d items")
    both = np.intersect1d(upsert.item_ids, delete)
    if both.size:
        raise DeltaError(f"item_id {int(both[0])} is both upserted and deleted")
    got = sorted(upsert.features)
    if got != sorted(features):
        extra = sorted(set(got) - set(features))
        lacking = sorted(set(features) - set(got))
        raise DeltaError(
            f"upserted items' feature columns {got} differ from the parent's {sorted(features)}"
            + (f" (unknown: {extra})" if extra else "") + (f" (missing: {lacking})" if lacking else "")
        )


# ------------------------------------------------------------------------------------ parent


def _parent_tensors(root: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """The parent's index buffers by name (codes, dim_scale, centroids, row_to_item, bits, ...):
    tensors.pt memory-mapped, or the state of its program."""
    state = read_tensors(root, manifest) or load_exported(root, manifest).state_dict
    return {k[len(INDEX_TENSORS):]: v.detach() for k, v in state.items() if k.startswith(INDEX_TENSORS)}


def _manifest_digest(root: Path) -> str:
    return hashlib.sha256((root / MANIFEST).read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------ quantisation


def quantize_with(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Codes int8 [N, D] of x with fixed ranges (scalar or per-dim); and the number of values clamped."""
    q = torch.round((x.float() - offset) / scale)
    clamped = int(((q < -128) | (q > 127)).sum())
    return q.clamp_(-128, 127).to(torch.int8), clamped


# ------------------------------------------------------------------------------------ bit banks


def gather_bit_columns(bank: np.ndarray, cols: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """out int64 [R, ceil(n / 64)] whose bit column j is bit column cols[j] of bank int64 [R, W]."""
    r, n = bank.shape[0], cols.shape[0]
    out = np.zeros((r, (n + 63) // 64), dtype=np.int64)
    ubank = bank.view(np.uint64)
    for start in range(0, n, chunk):
        c = cols[start : start + chunk]
        width = (c.shape[0] + 63) // 64 * 64
        bits = np.zeros((r, width), dtype=bool)
        bits[:, : c.shape[0]] = (ubank[:, c >> 6] >> (c & 63).astype(np.uint64)) & np.uint64(1)
        out[:, start // 64 : start // 64 + width // 64] = _pack_columns(bits)
    return out


def _merge_forward(parent: ForwardIndex, keep_rows: np.ndarray, new_features: dict[str, list[list[str]]]) -> tuple[ForwardIndex, ForwardIndex]:
    """(final forward index = kept parent rows then new items, the new items' own index), both with
    the parent's vocabularies extended by unseen values at the end."""
    names = parent.features
    vocabs = [list(v) for v in parent.vocabs]
    for fi, f in enumerate(names):
        known = set(vocabs[fi])
        for vals in new_features[f]:
            for v in vals:
                if v not in known:
                    known.add(v)
                    vocabs[fi].append(v)
    base = np.cumsum([0] + [len(v) for v in vocabs])
    old_base = np.cumsum([0] + [len(v) for v in parent.vocabs])
    # parent token ids re-based onto the extended vocabularies
    tok = parent.token_ids.numpy().astype(np.int64)
    shift = np.zeros(int(old_base[-1]), dtype=np.int64)
    for fi in range(len(names)):
        shift[old_base[fi] : old_base[fi + 1]] = base[fi] - old_base[fi]
    tok = tok + shift[tok] if tok.size else tok
    kept = ForwardIndex(names, vocabs, torch.from_numpy(tok.astype(np.int32)), parent.offsets).permute(torch.from_numpy(keep_rows))
    index = [{v: i for i, v in enumerate(voc)} for voc in vocabs]
    n_new = len(next(iter(new_features.values()))) if new_features else 0
    per_item: list[list[int]] = [[] for _ in range(n_new)]
    for fi, f in enumerate(names):
        for r, vals in enumerate(new_features[f]):
            per_item[r].extend(int(base[fi]) + index[fi][v] for v in dict.fromkeys(vals))
    counts = np.fromiter((len(t) for t in per_item), dtype=np.int64, count=n_new)
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    toks = np.fromiter((t for ts in per_item for t in ts), dtype=np.int32, count=int(offs[-1]))
    new = ForwardIndex(names, vocabs, torch.from_numpy(toks), torch.from_numpy(offs))
    both = ForwardIndex(
        names, vocabs, torch.cat([kept.token_ids, new.token_ids]), torch.cat([kept.offsets, kept.offsets[-1] + new.offsets[1:]])
    )
    return both, new


# ------------------------------------------------------------------------------------ the update


def update_snapshot(
    parent: str | os.PathLike,
    out: str | os.PathLike,
    *,
    upsert: str | os.PathLike | Pool | None = None,
    delete: str | os.PathLike | Iterable[int] | None = None,
    torchscript: Optional[bool] = None,
    overwrite: bool = False,
) -> Path:
    """Write `out`, a new version of snapshot `parent` with `upsert` (Parquet path or Pool) applied
    and the ids in `delete` (file path or ids) removed. Raises DeltaError for a bad delta and
    SnapshotError for a parent that cannot be updated; nothing is left at `out` on error.

    torchscript: also write model.ts (default: when the parent has one).
    """
    clock = StageClock()
    root = Path(parent).resolve()
    with clock("reading parent snapshot and delta"):
        manifest = read_manifest(root, verify=False)
        # the parent's checksums are checked on another thread (hashlib releases the GIL) while the
        # stages below run; the update waits for the result before it writes anything
        verified = _VERIFIER.submit(verify_files, root, manifest)
        cfg = manifest["config"]
        if manifest["kind"] != "rec" or cfg.get("spec", {}).get("tower") != "query":
            raise SnapshotError(
                f"snapshot {root} is a {manifest['kind']!r} snapshot with a trained user tower or decoder: incremental "
                "updates take pure-ANN snapshots (published from a pool); a recommendation or generative snapshot "
                "derives its items from trained models: re-publish it"
            )
        dim = int(cfg["dim"])
        features = sorted(cfg["filter"]["features"])
        pool = upsert if isinstance(upsert, Pool) or upsert is None else read_pool(upsert)
        if delete is None:
            del_ids = np.zeros(0, dtype=np.int64)
        elif isinstance(delete, (str, os.PathLike)):
            del_ids = read_ids(delete)
        else:
            del_ids = np.asarray(list(delete), dtype=np.int64).reshape(-1)
        t = _parent_tensors(root, manifest)
        parent_ids = t["row_to_item"].to(torch.int64).numpy()
        _check_delta(parent_ids, pool, del_ids, dim, features)
        up_ids = pool.item_ids if pool is not None else np.zeros(0, dtype=np.int64)
        changed = np.isin(parent_ids, up_ids)
        keep = ~(changed | np.isin(parent_ids, del_ids))
        keep_rows = np.flatnonzero(keep)
        n_final = keep_rows.size + up_ids.size
        if n_final == 0:
            raise DeltaError("the update would leave the pool empty")

    clamped = 0
    new_x = torch.from_numpy(pool.embeddings) if pool is not None else torch.zeros(0, dim)
    info: dict[str, Any] = {}
    # one cluster (an exact parent) or many: the same cluster-by-cluster copy
    centroids = t["centroids"]
    nlist = centroids.shape[0]
    with clock(f"assigning {up_ids.size} upserted items to {nlist} parent centroids"):
        labels = assign(new_x, centroids)[0] if up_ids.size else torch.zeros(0, dtype=torch.int64)
    residual = bool(cfg.get("quantization", {}).get("residual", False))  # codes of item - centroid (publish/ivf.py)
    with clock(f"quantising {up_ids.size} upserted items with the parent's ranges"):
        new_codes, clamped = quantize_with(new_x.float() - centroids.float()[labels] if residual else new_x,
                                           t["dim_scale"], t["dim_offset"])
    with clock("copying kept rows cluster by cluster (one gather)"):
        # source of every final row: parent row r, or n_parent + upserted item j
        src, sizes = merge_rows(t["cluster_offsets"].numpy(), keep_rows, labels.numpy())
        n_parent = parent_ids.size
        new_pos = np.flatnonzero(src >= n_parent)
        from_parent = src.copy()
        from_parent[new_pos] = 0  # rows overwritten by the upserted items below
        codes = t["codes"].index_select(0, torch.from_numpy(from_parent))
        codes[torch.from_numpy(new_pos)] = new_codes[torch.from_numpy(src[new_pos] - n_parent)]
        ids = parent_ids[from_parent]
        ids[new_pos] = up_ids[src[new_pos] - n_parent]
        new_off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        from silverrec.retrieval.ivf_index import Int8IVFIndex

        ivf = Int8IVFIndex(codes, t["dim_scale"], t["dim_offset"], torch.from_numpy(new_off), centroids, torch.from_numpy(ids),
                           residual=residual)
    config = dict(cfg)
    config["clusters"] = dict(cfg["clusters"]) | _cluster_stats(sizes)
    from silverrec.kernels.ivf_scan import bitmask_words

    config["bitmask_words"] = bitmask_words(ivf.cluster_offsets)
    if features:
        with clock("filter: Bloom rows, exact planes, posting lists"):
            module, config["filter"], fwd_final = _update_filter(root, manifest, t, ivf, keep_rows, src, pool)
            config["search"] = dict(cfg["search"]) | {"posting_limit": module.posting_limit}
        info["forward"] = fwd_final
    else:
        from silverrec.publish.filtered_ivf import empty_filter_config
        from silverrec.retrieval.filtered_ivf import FilteredIVFIndex

        module = FilteredIVFIndex.from_ivf(ivf, torch.zeros(0, (n_final + 63) // 64, dtype=torch.int64))
        config["filter"] = empty_filter_config(n_final)

    config.pop("build_report", None)  # the parent's; this version's stages are in update.timings
    counts = {
        "items": int(n_final),
        "parent_items": int(parent_ids.size),
        "inserted": int(up_ids.size - changed.sum()),
        "changed": int(changed.sum()),
        "deleted": int(del_ids.size),
        "kept": int(keep_rows.size),
    }
    prev = cfg.get("update", {})
    base = prev.get("base", {"imbalance": cfg.get("clusters", {}).get("imbalance"), "created": manifest["created"]})
    since = prev.get("since_build", {"upserted": 0, "quantised_values": 0, "clamped_values": 0, "updates": 0})
    since = {
        "upserted": since["upserted"] + int(up_ids.size),
        "quantised_values": since["quantised_values"] + int(up_ids.size * dim),
        "clamped_values": since["clamped_values"] + int(clamped),
        "updates": since["updates"] + 1,
    }
    drift = {
        "clamped_values": int(clamped),
        "clamped_share": clamped / max(1, up_ids.size * dim),
        "clamped_share_since_build": since["clamped_values"] / max(1, since["quantised_values"]),
        "changed_share_since_build": since["upserted"] / n_final,
    }
    imb = config["clusters"]["imbalance"]
    drift |= {
        "imbalance": imb,
        "parent_imbalance": cfg["clusters"]["imbalance"],
        "base_imbalance": base["imbalance"],
        "imbalance_ratio": imb / base["imbalance"] if base["imbalance"] else 1.0,
    }
    config["update"] = {
        "parent": {"path": str(root), "created": manifest["created"], "manifest_sha256": _manifest_digest(root), "item_count": manifest["item_count"]},
        "generation": int(prev.get("generation", 0)) + 1,
        "counts": counts,
        "base": base,
        "since_build": since,
        "drift": drift,
    }
    config["update"]["rebuild_advised"] = advice(config)
    ts = "model.ts" in manifest["files"] if torchscript is None else torchscript
    with clock("verifying the parent's checksums (the rest of the hashing overlapped the stages above)"):
        verified.result()
    return _write(module, config, out, ts, overwrite, clock, info)


def merge_rows(parent_offsets: np.ndarray, keep_rows: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The updated cluster-major order: per cluster, its kept parent rows (parent order), then the
    upserted items assigned to it (delta order).

    Args:
        parent_offsets: int64 [nlist + 1] the parent's cluster offsets; keep_rows: int64 [K] kept
            parent rows, ascending; labels: int64 [M] cluster of each upserted item.
    Returns:
        (src int64 [K + M]: source of each final row, parent row r or n_parent + j for upserted
        item j; sizes int64 [nlist] final cluster sizes).
    """
    nlist, n_parent = parent_offsets.size - 1, int(parent_offsets[-1])
    kept_cluster = np.searchsorted(parent_offsets, keep_rows, side="right") - 1  # ascending
    order_new = np.argsort(labels, kind="stable")
    keys = np.concatenate([kept_cluster, labels[order_new]]).astype(np.int64)
    src = np.concatenate([keep_rows, n_parent + order_new]).astype(np.int64)
    merged = np.argsort(keys, kind="stable")  # two sorted runs: one merge pass
    return src[merged], np.bincount(keys, minlength=nlist)


def _cluster_stats(sizes: np.ndarray) -> dict[str, Any]:
    n = max(1, int(sizes.sum()))
    return {
        "min_size": int(sizes.min()),
        "max_size": int(sizes.max()),
        "empty": int((sizes == 0).sum()),
        "imbalance": float(sizes.size * (sizes.astype(np.float64) ** 2).sum() / n**2),
    }


def _update_filter(root, manifest, t, ivf, keep_rows, src, pool):
    from silverrec.publish.filtered_ivf import filter_module

    fcfg = manifest["config"]["filter"]
    bloom = BloomConfig(int(fcfg["bloom"]["bits"]), int(fcfg["bloom"]["hashes"]), int(fcfg["bloom"]["seed"]))
    parent_fwd = read_forward(root, manifest)
    feats = pool.features if pool is not None else {f: [] for f in parent_fwd.features}
    both, new = _merge_forward(parent_fwd, keep_rows, feats)
    # final row i comes from `both` row: kept rows first (in parent order), then the upserted items
    both_row = np.empty(src.size, dtype=np.int64)
    is_new = src >= t["row_to_item"].numel()
    both_row[~is_new] = np.searchsorted(keep_rows, src[~is_new])
    both_row[is_new] = keep_rows.size + (src[is_new] - t["row_to_item"].numel())
    fwd = both.permute(torch.from_numpy(both_row))
    planes, exact = exact_planes(fwd, bloom.bits)
    old_exact = {f: fcfg["features"][f]["exact"] for f in fcfg["features"]}
    same_layout = exact == old_exact
    # new items' own bank (Bloom rows; and planes when the layout is unchanged)
    n_new = new.size
    rows = bloom.bits + (sum(p.shape[0] for p in planes) if same_layout else 0)
    new_bank = np.zeros((rows, (n_new + 63) // 64), dtype=np.int64)
    if n_new:
        bloom_rows(new, bloom, new_bank)
        if same_layout:
            new_planes, _ = exact_planes_with(new, exact, bloom.bits)
            new_bank[bloom.bits :] = new_planes
    parent_bank = t["bits"].numpy()[:rows]
    combined = np.concatenate([parent_bank, new_bank], axis=1)
    n_parent = t["row_to_item"].numel()
    cols = np.where(is_new, parent_bank.shape[1] * 64 + (src - n_parent), src)
    bank = gather_bit_columns(combined, cols)
    if not same_layout:
        bank = np.concatenate([bank] + planes, axis=0)
    limit = int(fcfg["postings"]["limit"])
    filter_config = {
        "bloom": dict(fcfg["bloom"]),
        "rows": int(bank.shape[0]),
        "features": {f: {"values": list(voc), "exact": exact[f]} for f, voc in zip(fwd.features, fwd.vocabs)},
    }
    counts = fwd.token_counts()
    filter_config["stats"] = {
        "max_tokens_per_item": int(counts.max()) if fwd.size else 0,
        "mean_tokens_per_item": float(counts.float().mean()) if fwd.size else 0.0,
        "estimated_fp_rate": estimate_fp_rate(counts, bloom.bits, bloom.hashes),
        "bank_bytes": int(bank.size * 8),
        "exact_planes": "copied" if same_layout else "rebuilt (layout changed)",
    }
    module, filter_config = filter_module(ivf, fwd, torch.from_numpy(bank), filter_config, limit)
    return module, filter_config, fwd


def exact_planes_with(fwd: ForwardIndex, layout: dict, first_row: int) -> tuple[np.ndarray, dict]:
    """Exact planes of `fwd` in a given layout (feature -> {"row", "slots", "bits"} or None)."""
    n = fwd.size
    width = (n + 63) // 64 * 64
    blocks = []
    for f in fwd.features:
        meta = layout[f]
        if meta is None:
            continue
        codes, slots = fwd.feature_codes(f)
        codes_np = codes.numpy()
        block = np.zeros((meta["slots"] * meta["bits"], width), dtype=bool)
        for s in range(min(slots, meta["slots"])):
            for b in range(meta["bits"]):
                block[s * meta["bits"] + b, :n] = (codes_np[:, s] >> b) & 1
        blocks.append(_pack_columns(block))
    return (np.concatenate(blocks, axis=0) if blocks else np.zeros((0, width // 64), dtype=np.int64)), layout


def advice(config: dict) -> list[str]:
    """Reasons a full rebuild is advised (empty: none), from the manifest's "update" drift."""
    up = config.get("update")
    if not up:
        return []
    d, out = up["drift"], []
    if d.get("imbalance_ratio", 1.0) > MAX_IMBALANCE_RATIO:
        out.append(f"cluster-size imbalance {d['imbalance']:.3f} is {d['imbalance_ratio']:.2f}x the last full build's (> {MAX_IMBALANCE_RATIO})")
    if d["clamped_share_since_build"] > MAX_CLAMPED_SHARE:
        out.append(f"{d['clamped_share_since_build']:.2%} of the values quantised since the last full build were clamped (> {MAX_CLAMPED_SHARE:.2%})")
    if d["changed_share_since_build"] > MAX_CHANGED_SHARE:
        out.append(f"{d['changed_share_since_build']:.0%} of the items were upserted since the last full build (> {MAX_CHANGED_SHARE:.0%})")
    return out


def _write(index, config, out, torchscript, overwrite, clock: StageClock, info) -> Path:
    from silverrec.publish.filtered_ivf import write_index

    return write_index(index, config, out, fwd=info.get("forward"), torchscript=torchscript, overwrite=overwrite,
                       clock=clock, report=lambda r: config["update"].__setitem__("timings", r), time_backends=False)

