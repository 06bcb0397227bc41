"""Publish a pure-ANN snapshot (`silverrec publish --pool`): the int8 IVF index plus the Bloom row bank,
inside the root module (`RecModel`) in its retrieval-only configuration (`publish_index`).

The pool's categorical columns become the filterable features. The row bank and the posting lists
are built in the IVF's cluster-major row order, and the manifest's config gets a "filter" section (Bloom M, K, seed,
feature vocabularies, exact-plane locations, per-value posting list ids and counts, statistics) from which the predictor compiles filter
strings without touching the model.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from dataclasses import asdict
from typing import Callable, Optional

import numpy as np
import torch
from torch.export import Dim

from silverrec.compose import ModelParts, compose
from silverrec.retrieval.filtered_ivf import FilteredIVFIndex
from silverrec.rec_model import RecModel
from silverrec.spec import ModelSpec
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.kernels.constants import NO_LISTS, OP_PUSH, OP_TRUE
from silverrec.retrieval.ivf_index import Int8IVFIndex
from silverrec.publish.bloom import BloomConfig, build_filter_bank, choose_config
from silverrec.publish.calibrate import FILTER_SELECTIVITIES, CalibrationConfig, EagerSearch, calibrate, prepare
from silverrec.publish.ivf import TORCHSCRIPT_MAX_BYTES, IVFConfig, build_ivf, ivf_manifest_config, tensor_bytes
from silverrec.publish.stages import StageClock
from silverrec.publish.pool import Pool
from silverrec.publish.postings import build_postings, default_limit
from silverrec.publish.progress import step
from silverrec.snapshot import export_module, write_snapshot
from silverrec.publish.forward_file import save_forward

BATCH = Dim("batch", min=1, max=1 << 16)


def default_max_probe(nlist: int, nprobe: int) -> int:
    """Candidate clusters the selectivity-aware search may widen to: 8x nprobe, at least 64."""
    return max(nprobe, min(nlist, max(64, 8 * nprobe)))


def pool_rows(pool: Pool, row_to_item: torch.Tensor) -> torch.Tensor:
    """int64 [N]: the pool row of each index row (index rows are in cluster-major order)."""
    ids = pool.item_ids
    order = np.argsort(ids, kind="stable")
    pos = np.searchsorted(ids[order], row_to_item.numpy())
    return torch.from_numpy(order[pos])


def filter_index(ivf: Int8IVFIndex, fwd: ForwardIndex, cfg: BloomConfig, posting_limit: Optional[int] = None) -> tuple[FilteredIVFIndex, dict]:
    """The filtered module over `ivf` and the manifest's "filter" section, from the pool's forward
    index in the IVF's row order: Bloom row bank + exact planes (bloom.py) and posting lists of the
    tokens held by <= posting_limit items (postings.py; default max(256, N / 32))."""
    bank, filter_config = build_filter_bank(fwd, cfg)
    limit = default_limit(fwd.size) if posting_limit is None else int(posting_limit)
    return filter_module(ivf, fwd, bank, filter_config, limit)


def filter_module(ivf: Int8IVFIndex, fwd: ForwardIndex, bank: torch.Tensor, filter_config: dict, limit: int) -> tuple[FilteredIVFIndex, dict]:
    """Posting lists of `fwd` (tokens held by <= limit items), bit planes of the other tokens
    (appended to `bank`) + the module over `ivf` and the bank; completes `filter_config` (per-value
    list ids, counts and plane rows, "postings", postings_bytes, value_planes_bytes)."""
    bank, post_rows, post_offsets = filter_tables(fwd, bank, filter_config, limit)
    module = FilteredIVFIndex.from_ivf(ivf, bank, post_rows=post_rows, post_offsets=post_offsets, posting_limit=limit)
    return module, filter_config


def filter_tables(fwd: ForwardIndex, bank: torch.Tensor, filter_config: dict, limit: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`filter_module`'s tables: (the bank with the value planes appended, post_rows, post_offsets);
    completes `filter_config`."""
    post_rows, post_offsets, per_feature = build_postings(fwd, limit)
    for f, meta in per_feature.items():
        filter_config["features"][f].update(meta)
    bank = append_value_planes(fwd, bank, filter_config, limit)
    filter_config["postings"] = {"limit": limit, "lists": int(post_offsets.numel() - 1), "entries": int(post_rows.numel())}
    filter_config["stats"]["postings_bytes"] = int(post_rows.numel() * 4 + post_offsets.numel() * 8)
    return bank, post_rows, post_offsets


def filter_bank(features: dict[str, list], rows: np.ndarray) -> tuple[torch.Tensor, dict]:
    """The filter row bank of a model without an index (the decode alone) and the manifest's "filter"
    section: features (name -> per pool row its values), rows int64 [N] the pool row of each model
    row. A pool without categorical features: no bank rows (any filter names an unknown feature)."""
    n = len(rows)
    if not features:
        return torch.zeros(0, (n + 63) // 64, dtype=torch.int64), empty_filter_config(n)
    fwd = ForwardIndex.from_lists(features).permute(torch.as_tensor(rows))
    bank, filter_config = build_filter_bank(fwd, choose_config(fwd))
    bank, _, _ = filter_tables(fwd, bank, filter_config, default_limit(fwd.size))
    return bank.to(torch.int64).contiguous(), filter_config


def value_planes(fwd: ForwardIndex, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """(planes int64 [F, ceil(N / 64)], token ids int64 [F]): one bit plane per frequent token (held
    by more than `limit` items, i.e. without a posting list), bit r & 63 of word r >> 6 set when
    row r holds the token. A conjunction of frequent values is a few plane ANDs over the pool
    (N / 64 words each, what roaring's bitmap containers cost for values above 1/16 of the pool)."""
    tokens = fwd.token_ids.numpy().astype(np.int64)
    rows = fwd.token_rows.numpy().astype(np.int64)
    total = sum(len(v) for v in fwd.vocabs)
    frequent = np.flatnonzero(np.bincount(tokens, minlength=total) > limit)
    w = (fwd.size + 63) // 64
    planes = np.zeros((frequent.size, w * 8), dtype=np.uint8)
    for i, t in enumerate(frequent):
        mask = np.zeros(w * 64, dtype=bool)
        mask[rows[tokens == t]] = True
        planes[i] = np.packbits(mask, bitorder="little")
    return planes.view(np.int64).reshape(frequent.size, w), frequent


def append_value_planes(fwd: ForwardIndex, bank: torch.Tensor, filter_config: dict, limit: int) -> torch.Tensor:
    """`bank` with `value_planes` appended (last rows) and the manifest's per-value plane rows
    (features[f]["planes"], -1 = none) and plane bytes recorded."""
    planes, tokens = value_planes(fwd, limit)
    base = int(bank.shape[0])
    for f, vocab in zip(fwd.features, fwd.vocabs):
        filter_config["features"][f]["planes"] = [-1] * len(vocab)
    for i, t in enumerate(tokens.tolist()):
        fi = max(j for j, fb in enumerate(fwd.feature_base) if fb <= t)
        filter_config["features"][fwd.features[fi]]["planes"][t - fwd.feature_base[fi]] = base + i
    filter_config["rows"] = base + planes.shape[0]
    filter_config["items"] = int(fwd.size)
    filter_config["stats"]["value_planes"] = int(planes.shape[0])
    filter_config["stats"]["value_planes_bytes"] = int(planes.size * 8)
    filter_config["stats"]["bank_bytes"] = int((base + planes.shape[0]) * bank.shape[1] * 8)
    return torch.cat([bank.to(torch.int64), torch.from_numpy(planes)]) if planes.shape[0] else bank


def build_filtered_ivf(
    pool: Pool,
    config: Optional[IVFConfig] = None,
    bloom_bits: Optional[int] = None,
    bloom_hashes: Optional[int] = None,
) -> tuple[FilteredIVFIndex, dict]:
    """Build the module and the manifest config (IVF config + "filter" section)."""
    module, manifest, _ = build_filtered_ivf_forward(pool, config, bloom_bits, bloom_hashes)
    return module, manifest


def build_filtered_ivf_forward(
    pool: Pool,
    config: Optional[IVFConfig] = None,
    bloom_bits: Optional[int] = None,
    bloom_hashes: Optional[int] = None,
    clock: Optional[StageClock] = None,
    consume: bool = False,
    calibration: Optional[CalibrationConfig] = None,
) -> tuple[FilteredIVFIndex, dict, Optional[ForwardIndex]]:
    """`build_filtered_ivf`, also returning the forward index in the module's row order (None for a
    pool without categorical features: its filter bank is empty and any filter names an unknown
    feature); stages timed on `clock`; consume: `build_ivf`'s (pool.embeddings used up); calibration:
    measure the default probe depth and the filtered widening on the pool (publish/calibrate.py) and
    set them in the manifest (None: the fixed defaults, `default_nprobe`)."""
    config = config or IVFConfig()
    clock = clock or StageClock()
    fwd_pool = ForwardIndex.from_lists(pool.features) if pool.features else None
    truth = None
    if calibration is not None and config.nlist != 1:  # (an exact index has no probe depth to choose)
        t0 = time.perf_counter()
        with clock(f"calibration truth: exact top-{calibration.k} of the calibration queries and sampled filters"):
            truth = prepare(pool.embeddings, pool.item_ids, calibration.k, calibration.queries, fwd_pool,
                            calibration.seed, FILTER_SELECTIVITIES)
        truth_seconds = time.perf_counter() - t0
    ivf, km = build_ivf(pool, config, clock, consume=consume)
    fwd = None
    if pool.features:
        with clock("Bloom signatures, exact value planes and posting lists"):
            fwd = fwd_pool.permute(pool_rows(pool, ivf.row_to_item))
            module, filter_config = filter_index(ivf, fwd, choose_config(fwd, bloom_bits, bloom_hashes))
    else:
        module = FilteredIVFIndex.from_ivf(ivf, torch.zeros(0, (pool.size + 63) // 64, dtype=torch.int64))
        filter_config = empty_filter_config(pool.size)
    manifest = ivf_manifest_config(pool, ivf, config, km)
    nprobe = int(manifest["default_nprobe"])
    manifest["index"] = "filtered_ivf_int8"
    manifest["filter"] = filter_config
    manifest["search"] = search_section(module, nprobe)
    if truth is not None and module.nlist > 1:
        with clock(f"calibration: recall curve to {calibration.target_recall} at k {truth.k}, filtered widening"):
            calibrate(EagerSearch(search_model(module), manifest), truth, calibration.target_recall)
        manifest["calibration"]["truth_seconds"] = round(truth_seconds, 3)
    return module, manifest, fwd


def search_section(module: FilteredIVFIndex, nprobe: int) -> dict:
    """The manifest's "search" section: what the predictor plans a filtered search with."""
    return {
        "default_max_probe": default_max_probe(module.nlist, nprobe),
        "match_factor": module.match_factor,
        "exact_cost_ratio": module.exact_cost_ratio,
        "posting_limit": module.posting_limit,
        "modes": ["auto", "probed", "unprobed"],
    }


def empty_filter_config(n: int) -> dict:
    """The manifest's "filter" section of a pool without categorical features (no bank rows)."""
    return {"bloom": {"bits": 0, "hashes": 0, "seed": 0}, "features": {}, "rows": 0, "items": int(n),
            "postings": {"limit": 0, "lists": 0, "entries": 0},
            "stats": {"bank_bytes": 0, "estimated_fp_rate": 0.0, "value_planes": 0, "value_planes_bytes": 0,
                      "postings_bytes": 8}}


def example_inputs(module: FilteredIVFIndex, dim: int) -> tuple:
    """Export example: distinct values so that every dynamic int stays its own symbol."""
    nlist = module.nlist
    ops, rows, vops, vrows, lists = example_programs(module.bits.shape[0], module.post_offsets.numel() - 1)
    return (torch.zeros(2, dim), 5, min(8, nlist), ops, rows, vops, vrows, lists, min(9, nlist), torch.zeros(2, dtype=torch.int64))


def example_programs(bank_rows: int, n_lists: int) -> tuple:
    """Two requests' filter programs (ops, rows, vops, vrows, lists) for an export example, over a
    bank of `bank_rows` rows and `n_lists` posting lists (distinct sizes: separate symbols)."""
    ops = torch.tensor([[1, 1, 2], [6, 0, 0]], dtype=torch.int64)
    rows = torch.zeros(2, 3, 4, dtype=torch.int64)
    vops = torch.tensor([[1, 1, 3, 4, 0], [6, 0, 0, 0, 0]], dtype=torch.int64)
    vrows = torch.zeros(2, 5, 6, dtype=torch.int64)
    lists = torch.tensor([[-2, -1, -1, -1, -1, -1, -1], [0, -1, -1, -1, -1, -1, -1]], dtype=torch.int64)
    lists = lists.clamp_max(n_lists - 1)  # -1 when there are no lists
    if bank_rows == 0:  # no filter bank (a pool without features): programs that push no row
        ops, vops = torch.where(ops == OP_PUSH, OP_TRUE, ops), torch.where(vops == OP_PUSH, OP_TRUE, vops)
    return ops, rows, vops, vrows, lists


DYNAMIC = {
    "queries": {0: BATCH},
    "k": Dim.DYNAMIC,
    "nprobe": Dim.DYNAMIC,
    "ops": {0: BATCH, 1: Dim.DYNAMIC},
    "rows": {0: BATCH, 1: Dim.DYNAMIC, 2: Dim.DYNAMIC},
    "vops": {0: BATCH, 1: Dim.DYNAMIC},
    "vrows": {0: BATCH, 1: Dim.DYNAMIC, 2: Dim.DYNAMIC},
    "lists": {0: BATCH, 1: Dim.DYNAMIC},
    "max_probe": Dim.DYNAMIC,
    "mode": {0: BATCH},
}


def search_model(index: FilteredIVFIndex) -> RecModel:
    """The pure-ANN configuration of the root module: the query embedding is the user (one task), no
    embedding cache, no ranking stages, the scan's top rows re-scored with the float query
    (silverrec/retrieval/sources.py `AnnSearch`)."""
    return compose(ModelSpec.search(index.codes.shape[1], index.nlist), ModelParts(index=index))


def search_example(model: RecModel) -> tuple:
    """RecModel export example for the pure-ANN configuration (distinct ints: separate symbols)."""
    index = model.sources.index
    queries, k, nprobe, ops, rows, vops, vrows, lists, max_probe, mode = example_inputs(index, index.codes.shape[1])
    n = index.num_items
    exclude = torch.tensor([[-1, 0, 1], [-1, -1, 2]], dtype=torch.int64).clamp_max(n - 1)
    values, lengths = torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int32)
    history, sources = exclude.clone(), torch.ones(2, 2, dtype=torch.bool)
    return (values, lengths, queries, exclude, ops, rows, vops, vrows, lists, mode, history, sources, k, 6, nprobe,
            max_probe)


def search_timing_example(model: RecModel) -> tuple:
    """The lightest search (unfiltered, nprobe 1, k 1): the call that `preferred_backend` times, where the
    two programs' fixed costs are all there is to compare."""
    (values, lengths, queries, exclude, ops, rows, vops, vrows, lists, mode, history, sources, _, k0, _, _) = \
        search_example(model)
    unfiltered = ops[1:].expand_as(ops).clone(), vops[1:].expand_as(vops).clone()  # row 1: TRUE (example_programs)
    no_lists, no_exclusions = torch.full_like(lists, NO_LISTS), torch.full_like(exclude, -1)
    return (values, lengths, queries, no_exclusions, unfiltered[0], rows, unfiltered[1], vrows, no_lists, mode,
            no_exclusions, sources, 1, k0, 1, 1)


SEARCH_DYNAMIC = {
    "values": {0: Dim.DYNAMIC},
    "lengths": {0: Dim.DYNAMIC},
    "dense": {0: BATCH},
    "exclude": {0: BATCH, 1: Dim.DYNAMIC},
    **{k: DYNAMIC[k] for k in ("ops", "rows", "vops", "vrows", "lists", "mode", "k", "nprobe", "max_probe")},
    "history": {0: BATCH, 1: Dim.DYNAMIC},
    "sources": {0: BATCH},
    "k0": Dim.DYNAMIC,
}


def publish_index(
    pool: Pool,
    out: str | os.PathLike,
    *,
    config: Optional[IVFConfig] = None,
    exact: bool = False,
    bloom_bits: Optional[int] = None,
    bloom_hashes: Optional[int] = None,
    torchscript: Optional[bool] = None,
    overwrite: bool = False,
    release_embeddings: bool = False,
    calibration: Optional[CalibrationConfig] = CalibrationConfig(),
) -> Path:
    """Publish `pool` as a pure-ANN snapshot at `out`: the root module (`RecModel`, kind "rec") in its
    retrieval-only configuration over the int8 IVF + filter bank of the pool's categorical features.

    calibration: the default probe depth and filtered widening measured on the pool to its target
    recall (publish/calibrate.py; the manifest's "calibration"), or None: the fixed defaults.
    exact: one cluster (nlist 1), so every search scans every row (exact int8 top-k).
    torchscript: also write model.ts; None = only up to TORCHSCRIPT_MAX_BYTES of tensors.
    release_embeddings: the layout quantises over pool.embeddings, which is then replaced by an empty
    [0, D] array (the CLI, whose pool is not used again: pass a matrix nothing else uses), so that
    neither the layout nor the export holds the float32 pool beside the int8 one.
    The manifest's "build_report" gives time and peak resident memory per stage.
    """
    if exact:
        config = IVFConfig(**{**(asdict(config) if config else {}), "nlist": 1})
    clock = StageClock()
    index, manifest, fwd = build_filtered_ivf_forward(pool, config, bloom_bits, bloom_hashes, clock, consume=release_embeddings,
                                                      calibration=calibration)
    if fwd is not None:
        bloom, stats = manifest["filter"]["bloom"], manifest["filter"]["stats"]
        with step(
            f"Bloom M={bloom['bits']} K={bloom['hashes']}: estimated FP rate {stats['estimated_fp_rate']:.2e}, "
            f"{stats['bank_bytes'] / 2**20:.1f} MiB"
        ):
            pass
    return write_index(index, manifest, out, fwd=fwd, torchscript=torchscript, overwrite=overwrite, clock=clock)


def write_index(
    index: FilteredIVFIndex,
    manifest: dict,
    out: str | os.PathLike,
    *,
    fwd: Optional[ForwardIndex] = None,
    torchscript: Optional[bool] = None,
    overwrite: bool = False,
    clock: Optional[StageClock] = None,
    report: Optional[Callable[[dict], None]] = None,
    time_backends: bool = True,
) -> Path:
    """Write `index` (with its manifest config) as a pure-ANN snapshot at `out`, atomically: the root
    module in its retrieval-only configuration (model.pt2, model.ts when `torchscript`, the faster
    of the two recorded as config.backend), `forward.npz` when `fwd` is given (for updates), and
    config.spec. `report` receives the stage report (default: config.build_report).
    torchscript None = only up to TORCHSCRIPT_MAX_BYTES of tensors. The index's tensors are stored
    once, in tensors.pt (`export_module` tensors_apart). time_backends False: keep the manifest's
    config.backend (an update: the parent's measurement of the same program)."""
    clock = clock or StageClock()
    model = search_model(index)
    manifest.setdefault("search", {})["rescore"] = model.spec.rescore
    manifest["spec"] = model.spec.to_json()
    if torchscript is None:
        torchscript = tensor_bytes(index) <= TORCHSCRIPT_MAX_BYTES

    def write(tmp: Path) -> None:
        with clock("exporting model (torch.export" + (" + TorchScript)" if torchscript else ")")):
            backend = export_module(model, search_example(model), SEARCH_DYNAMIC, tmp, torchscript=torchscript,
                                    tensors_apart=True, time_backends=time_backends,
                                    timing_args=search_timing_example(model))
        if backend is not None:  # load(backend="auto") runs the fastest program; a parent's timing kept without one
            manifest["backend"] = {**manifest.get("backend", {}), **backend}
        if fwd is not None:
            save_forward(fwd, tmp)  # for incremental updates (publish/update.py)
        (report or (lambda r: manifest.__setitem__("build_report", r)))(clock.report())

    n = int(index.codes.shape[0])
    return write_snapshot(out, kind="rec", config=manifest, item_count=n, write_files=write, overwrite=overwrite)
