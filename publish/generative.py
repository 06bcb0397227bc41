"""Publish a generative (semantic-ID beam decode) snapshot: the root module whose only source is the decode.

    >>> decoder, sids, info = load_checkpoint("generative.ckpt")          # silverrec train --generative
    >>> publish_generative(decoder, sids, "snapshots/gen-v1", beam_width=64)
    >>> snap = silverrec.load("snapshots/gen-v1")
    >>> snap.recommend([{"history": [1, 50, 260]}], k=10).item_ids        # int64 [1, 10]

The snapshot is a `RecModel` composed from the spec tower "none", sources ["generative"] (one task,
"log_prob": the summed log-prob the decode ranks by) and the decode (`GenerativeRetrieval`: decoder
weights, the valid-path trie), as model.pt2 (torch.export, dynamic batch and history length) and
model.ts (TorchScript); its canonical rows are the trie's leaf order (items.npz: row_to_item). It
answers `recommend` like every recommendation snapshot: histories, exclusions and filters (over
the item features the pool has, in-model by the filter row bank) in, ranked items out. The
manifest's "generative" section holds the vocabulary (level_sizes, level_offsets, vocab_size, L),
beam_width, top_k, the decoder config, the weight dtype, the semantic-ID statistics and the
bf16-vs-fp32 check.

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

from silverrec.compose import ModelParts, compose
from silverrec.generative.decoder import RecDecoder
from silverrec.errors import PoolError
from silverrec.generative.generative import GenerativeRetrieval
from silverrec.publish.filtered_ivf import filter_bank
from silverrec.publish.progress import step
from silverrec.publish.rec_files import Built, write_rec_files
from silverrec.publish.semantic_ids import SemanticIds, check_paths, history_tokens
from silverrec.retrieval.user_tower import UserFeatureSpec
from silverrec.serving.recommend import DEFAULT_EXCLUDE_LIMIT
from silverrec.snapshot import write_snapshot
from silverrec.spec import ModelSpec
from silverrec.generative.trie import ValidPathTrie

BF16_MIN_OVERLAP = 0.9
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TASK = "log_prob"  # the one task score of the decode alone


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
    features: dict[str, list] | None = None,
    extra_config: dict[str, Any] | None = None,
    torchscript: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write a generative snapshot (module docstring).

    Args:
        decoder: trained `RecDecoder` (any dtype; cast as `weights` says).
        sids: the semantic IDs it was trained on (item ids, paths [N, L], level sizes).
        out: snapshot directory.
        beam_width: W, the most items a request gets; top_k: per-beam candidates (default W).
        max_history: the decoder reads the most recent `max_history` items of a history.
        weights: "auto" | "bf16" | "fp32" (see module docstring).
        probe: histories (item ids) for the bf16 check; default 64 random 20-item histories.
        features: categorical item features (name -> per item of `sids` its values) requests may
            filter on; None = no filter features.
        extra_config: merged into the manifest's "generative" section (e.g. training metrics).
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
    n = len(item_ids)
    bank, filter_config = filter_bank(features or {}, module.trie.row_order.numpy())
    spec = ModelSpec("none", 0, 0, (TASK,), ("generative",), decode_history=max_history)
    parts = ModelParts(decode=module, bank=bank)
    model = compose(spec, parts)
    dec = decoder.config
    user_features = UserFeatureSpec(num_items=n, history_len=1, recent_len=1)  # the tower reads nothing
    config: dict[str, Any] = {
        "index": "generative",
        "spec": spec.to_json(),
        "user_features": user_features.to_json(),
        "item_feature_order": [],
        "item_feature_names": [],
        "filter": filter_config,
        "filter_template": None,
        "default_k0": module.beam_width,
        "exclude_limit": DEFAULT_EXCLUDE_LIMIT,
        "generative": {
            **sids.config(),
            "beam_width": module.beam_width,
            "top_k": module.top_k,
            "max_items": max_history,
            "max_history_tokens": 1 + L * max_history,
            "weights_dtype": chosen,
            "compute_dtype": compute,
            "compute_timing": None if timing is None else {
                "median_ms": timing, "batch": 1, "history_tokens": int(histories.shape[1]),
                "measured_on": device_name(), "threads": torch.get_num_threads()},
            "bf16_check": {"top10_overlap_vs_fp32": overlap, "threshold": BF16_MIN_OVERLAP,
                           "probe_histories": int(histories.shape[0]), "compute_dtype": compute},
            "decoder": dec.to_dict(),
            **(extra_config or {}),
        },
    }
    built = Built(model, spec, parts, config, module.row_to_item.to(torch.int64).numpy())

    def write(tmp: Path) -> None:
        with step(f"exporting generative model ({chosen} weights; torch.export" + (" + TorchScript)" if torchscript else ")")):
            write_rec_files(built, tmp, torchscript)

    return write_snapshot(out, kind="rec", config=config, item_count=n, write_files=write, overwrite=overwrite)


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
    rows = pool_positions(pool.item_ids, sids.item_ids)
    features = {f: [values[r] for r in rows] for f, values in pool.features.items()}  # in sids' item order
    return publish_generative(decoder, sids, out, beam_width=beam_width, top_k=top_k, max_history=max_history,
                              weights=weights, features=features, extra_config=extra, torchscript=torchscript,
                              overwrite=overwrite)


def pool_positions(pool_ids: np.ndarray, item_ids: np.ndarray) -> np.ndarray:
    """int64 [len(item_ids)]: the pool row of each item id (every id is in the pool)."""
    order = np.argsort(pool_ids, kind="stable")
    return order[np.searchsorted(pool_ids[order], item_ids)]
