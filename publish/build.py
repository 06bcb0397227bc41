"""Compose runtime modules from a validated pool and write them as snapshots."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim

from silverrec.retrieval.exact_index import ExactInt8Index
from silverrec.publish.pool import Pool
from silverrec.publish.progress import step
from silverrec.publish.quantize import quantize_global
from silverrec.snapshot import export_module, write_snapshot

BATCH = Dim("batch", min=1, max=1 << 16)


def build_exact(pool: Pool) -> ExactInt8Index:
    """Quantise the pool to int8 and wrap it in an ExactInt8Index (rows in pool order)."""
    codes, scale, offset = quantize_global(torch.from_numpy(pool.embeddings))
    return ExactInt8Index(codes, scale, offset, torch.from_numpy(pool.item_ids))


def publish_exact(pool: Pool, out: str | os.PathLike, *, torchscript: bool = True, overwrite: bool = False) -> Path:
    """Build an exact int8 snapshot of `pool` at `out`."""
    with step("quantising embeddings to int8"):
        module = build_exact(pool)
    config: dict[str, Any] = {
        "dim": pool.dim,
        "index": "exact_int8",
        "quantization": {"scale": float(module.scale), "offset": float(module.offset)},
        "features": sorted(pool.features),
    }
    example = (torch.zeros(2, pool.dim), min(2, pool.size))
    dynamic = {"queries": {0: BATCH}, "k": Dim.DYNAMIC}

    def write(tmp: Path) -> None:
        with step("exporting model (torch.export + TorchScript)"):
            export_module(module, example, dynamic, tmp, torchscript=torchscript)

    return write_snapshot(out, kind="exact", config=config, item_count=pool.size, write_files=write, overwrite=overwrite)
