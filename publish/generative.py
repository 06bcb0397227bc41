"""Publish a generative (semantic-ID beam decode) snapshot.

    >>> decoder, sids, info = load_checkpoint("generative.ckpt")          # silverrec train --generative
    >>> publish_generative(decoder, sids, "snapshots/gen-v1", beam_width=64)
    >>> snap = silverrec.load("snapshots/gen-v1")
    >>> snap.recommend([[1, 50, 260]]).item_ids                           # int64 [1, 64]

The snapshot holds `GenerativeRetrieval` (decoder weights, the valid-path trie, row_to_item) as
model.pt2 (torch.export, dynamic batch and history length) and model.ts (TorchScript), plus
`items.npz`: item_ids int64 [N] and tokens int64 [N, L] in trie leaf order (row r of a filter
bitmask), which the predictor uses to turn history item ids into tokens. The manifest config holds
the vocabulary (level_sizes, level_offsets, vocab_size, L), beam_width, top_k, max history, the
decoder config, the weight dtype, the semantic-ID statistics and the bf16-vs-fp32 check.

Weights: `weights="auto"` (default) stores bf16 when the bf16 module's top-10 lists agree with
fp32's on probe histories (mean overlap >= `BF16_MIN_OVERLAP`), else fp32; "bf16"/"fp32" force it.
Compute: bf16 weights run in bf16 or, cast per use, in float32, whichever the publisher measures
faster at batch 1 on this machine (bf16 matmuls without bf16 units, e.g. AVX2-only CPUs, ran ~3x
slower than float32); the manifest records `weights_dtype`, `compute_dtype` and `compute_timing`
(the two medians and the CPU they were measured on), and `silverrec inspect` prints them. The
measurement is the publisher's: publish on the kind of machine that serves.
"""

from __future__ import annotations

import copy
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.export import Dim

from silverrec.generative.decoder import RecDecoder
from silverrec.errors import PoolError
from silverrec.generative.generative import GenerativeRetrieval
from silverrec.serving.predictor import ITEMS_FILE, history_tokens
from silverrec.publish.progress import step
from silverrec.publish.semantic_ids import SemanticIds, check_paths
from silverrec.snapshot import export_module, write_snapshot
from silverrec.generative.trie import ValidPathTrie

BF16_MIN_OVERLAP = 0.9
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cast_decoder(decoder: RecDecoder, dtype: torch.dtype, compute_dtype: torch.dtype | None = None) -> RecDecoder:
    """A copy of `decoder` with weights in `dtype`, computing in `compute_dtype` (None: `dtype`);
    the RoPE tables stay float32 (exact angles)."""
    out = copy.deepcopy(decoder).to(dtype).eval()
    out.rope_cos = decoder.rope_cos.float().clone()
    out.rope_sin = decoder.rope_sin.float().clone()
    return out.set_compute_dtype(compute_dtype)


def build_generative(decoder: RecDecoder, sids: SemanticIds, beam_width: int, top_k: int | None = None,
                     dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None) -> GenerativeRetrieval:
    """`GenerativeRetrieval` over every item of `sids`, decoder weights in `dtype`, activations and
    matmuls in `compute_dtype` (None: `dtype`)."""
    check_paths(sids.paths, sids.level_sizes)
    if decoder.vocab_size != sids.vocab_size:
        raise PoolError(f"decoder vocabulary {decoder.vocab_size} does not match the semantic IDs' "
                        f"{sids.vocab_size} (level sizes {sids.level_sizes})")
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width <= 0:
        raise PoolError(f"beam_width must be a positive int, got {beam_width!r}")
    top_k = beam_width if top_k is None else top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0:
        raise PoolError(f"top_k must be a positive int, got {top_k!r}")
    trie = ValidPathTrie(torch.from_numpy(sids.paths), sids.level_sizes)
    row_to_item = torch.from_numpy(sids.item_ids)[trie.row_order]
    return GenerativeRetrieval(cast_decoder(decoder, dtype, compute_dtype), trie, row_to_item, beam_width, top_k).eval()


def all_items_bitmask(batch: int, n_items: int) -> torch.Tensor:
    """int64 [batch, ceil(n/64)] with every item allowed (bits past n are ignored by the trie)."""
    return torch.full((batch, (n_items + 63) // 64), -1, dtype=torch.int64)


def probe_histories(sids: SemanticIds, n: int = 64, items: int = 20, seed: int = 0) -> list[list[int]]:
    """Synthetic histories of random pool items (when no real ones are given)."""
    g = np.random.default_rng(seed)
    return [g.choice(sids.item_ids, size=min(items, len(sids.item_ids)), replace=False).tolist() for _ in range(n)]


@torch.no_grad()
def top10_overlap(a: GenerativeRetrieval, b: GenerativeRetrieval, histories: torch.Tensor) -> float:
    """Mean |top10(a) ∩ top10(b)| / 10 over history rows int64 [B, T]."""
    mask = all_items_bitmask(histories.shape[0], a.trie.n_items)
    ia, _ = a(histories, mask)
    ib, _ = b(histories, mask)
    k = min(10, ia.shape[1])
    hits = [len(set(x[:k].tolist()) & set(y[:k].tolist())) for x, y in zip(ia, ib)]
    return float(np.mean(hits)) / k


def device_name() -> str:
    """This machine's CPU model (where the compute-dtype timing ran)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@torch.no_grad()
def time_modules(modules: dict[str, GenerativeRetrieval], history: torch.Tensor, runs: int = 7) -> dict[str, float]:
    """Median ms of one forward per module on history int64 [1, T] (all items allowed), calls
    alternated module by module so both see the same machine load; one warm-up call each."""
    mask = all_items_bitmask(history.shape[0], next(iter(modules.values())).trie.n_items)
    times: dict[str, list[float]] = {name: [] for name in modules}
    for r in range(runs + 1):
        for name, module in modules.items():
            t0 = time.perf_counter()
            module(history, mask)
            if r:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: float(np.median(t)) for name, t in times.items()}


def items_table(module: GenerativeRetrieval, sids: SemanticIds) -> tuple[np.ndarray, np.ndarray]:
    """(item_ids int64 [N], tokens int64 [N, L]) in trie leaf order."""
    order = module.trie.row_order.numpy()
    return sids.item_ids[order], sids.tokens()[order]


def publish_generative(
    decoder: RecDecoder,
    sids: SemanticIds,
    out: str | os.PathLike,
    *,
    beam_width: int = 64,
    top_k: int | None = None,
    max_history: int = 20,
    weights: str = "auto",
    probe: list[list[int]] | None = None,
    extra_config: dict[str, Any] | None = None,
    torchscript: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write a "generative" snapshot.

    Args:
        decoder: trained `RecDecoder` (any dtype; cast as `weights` says).
        sids: the semantic IDs it was trained on (item ids, paths [N, L], level sizes).
        out: snapshot directory.
        beam_width: W, items returned per request; top_k: per-beam candidates (default W).
        max_history: the predictor keeps the most recent `max_history` items of a history.
        weights: "auto" | "bf16" | "fp32" (see module docstring).
        probe: histories (item ids) for the bf16 check; default 64 random 20-item histories.
        extra_config: merged into the manifest config (e.g. training metrics).
    """
    if weights not in ("auto", *WEIGHT_DTYPES):
        raise PoolError(f"weights must be 'auto', 'bf16' or 'fp32', got {weights!r}")
    if isinstance(max_history, bool) or not isinstance(max_history, int) or max_history < 1:
        raise PoolError(f"max_history must be a positive int, got {max_history!r}")
    L = sids.depth
    if 1 + L * (max_history + 1) > decoder.max_seq_len:
        raise PoolError(f"max_history {max_history} needs {1 + L * (max_history + 1)} positions, the decoder's "
                        f"RoPE table covers {decoder.max_seq_len}")
    with step("building generative module (trie, decoder)"):
        fp32 = build_generative(decoder, sids, beam_width, top_k, torch.float32)
        item_ids, item_tokens = items_table(fp32, sids)
    sorted_order = np.argsort(item_ids)
    histories = history_tokens(probe or probe_histories(sids), item_ids[sorted_order], item_tokens[sorted_order],
                               max_history)
    with step("checking bf16 weights against fp32 (top-10 overlap)"):
        bf16 = build_generative(decoder, sids, beam_width, top_k, torch.bfloat16)
        overlap = top10_overlap(fp32, bf16, histories)
    chosen = weights if weights != "auto" else ("bf16" if overlap >= BF16_MIN_OVERLAP else "fp32")
    module, compute, timing = fp32, "fp32", None
    if chosen == "bf16":  # bf16 weights (half the size); compute in whichever dtype runs faster here
        with step("timing bf16 vs float32 compute of the bf16 weights (batch 1, longest probe history)"):
            modules = {"bf16": bf16, "fp32": build_generative(decoder, sids, beam_width, top_k, torch.bfloat16,
                                                              torch.float32)}
            longest = int((histories != 0).sum(dim=1).argmax())
            timing = time_modules(modules, histories[longest : longest + 1])
        compute = min(timing, key=timing.get)
        module = modules[compute]
        if compute == "fp32":
            overlap = top10_overlap(fp32, module, histories)
    dec = decoder.config
    config: dict[str, Any] = {
        **sids.config(),
        "beam_width": module.beam_width,
        "top_k": module.top_k,
        "max_history_items": max_history,
        "max_history_tokens": 1 + L * max_history,
        "weights_dtype": chosen,
        "compute_dtype": compute,
        "compute_timing": None if timing is None else {
            "median_ms": timing, "batch": 1, "history_tokens": int(histories.shape[1]), "measured_on": device_name(),
            "threads": torch.get_num_threads()},
        "bf16_check": {"top10_overlap_vs_fp32": overlap, "threshold": BF16_MIN_OVERLAP,
                       "probe_histories": int(histories.shape[0]), "compute_dtype": compute},
        "decoder": dec.to_dict(),
        "items_file": ITEMS_FILE,
        **(extra_config or {}),
    }
    batch = Dim("batch", min=1, max=4096)
    length = Dim("length", min=2, max=dec.max_seq_len - L)
    example = (histories[:2], all_items_bitmask(2, len(item_ids)))
    dynamic = {"history": {0: batch, 1: length}, "item_bitmask": {0: batch}}

    def write(tmp: Path) -> None:
        np.savez(tmp / ITEMS_FILE, item_ids=item_ids, tokens=item_tokens)
        with step(f"exporting generative model ({chosen} weights; torch.export + TorchScript)"):
            export_module(module, example, dynamic, tmp, torchscript=torchscript)

    return write_snapshot(out, kind="generative", config=config, item_count=len(item_ids), write_files=write,
                          overwrite=overwrite)


def publish_from_pool(
    pool,
    out: str | os.PathLike,
    *,
    model: str | os.PathLike | None = None,
    beam_width: int = 64,
    top_k: int | None = None,
    weights: str = "auto",
    torchscript: bool = True,
    overwrite: bool = False,
) -> Path:
    """The `silverrec publish --generative --pool POOL --model CKPT` path: the checkpoint's decoder
    and semantic IDs (`silverrec train --generative`), restricted to the pool's items (every pool
    item must have a semantic ID in the checkpoint)."""
    from silverrec.publish.generative_checkpoint import load_checkpoint

    if model is None:
        raise PoolError("publish --generative needs --model CKPT: train one with silverrec train --generative "
                        "--config generative.toml --out CKPT")
    decoder, sids, info = load_checkpoint(model)
    sids = sids.subset(pool.item_ids)
    max_history = int(info["train_config"]["max_history"])
    extra = {"training": {"checkpoint": str(model), **info["metrics"]}}
    return publish_generative(decoder, sids, out, beam_width=beam_width, top_k=top_k, max_history=max_history,
                              weights=weights, extra_config=extra, torchscript=torchscript, overwrite=overwrite)
