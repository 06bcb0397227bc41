"""Publish a generative (semantic-ID beam decode) snapshot.

    >>> decoder, sids, info = load_checkpoint("generative.ckpt")          # or train_movielens(...)
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
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict
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


def cast_decoder(decoder: RecDecoder, dtype: torch.dtype) -> RecDecoder:
    """A copy of `decoder` with weights in `dtype`; the RoPE tables stay float32 (exact angles)."""
    out = copy.deepcopy(decoder).to(dtype).eval()
    out.rope_cos = decoder.rope_cos.float().clone()
    out.rope_sin = decoder.rope_sin.float().clone()
    return out


def build_generative(decoder: RecDecoder, sids: SemanticIds, beam_width: int, top_k: int | None = None,
                     dtype: torch.dtype = torch.float32) -> GenerativeRetrieval:
    """`GenerativeRetrieval` over every item of `sids`, decoder weights in `dtype`."""
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
    return GenerativeRetrieval(cast_decoder(decoder, dtype), trie, row_to_item, beam_width, top_k).eval()


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
    module = bf16 if chosen == "bf16" else fp32
    dec = decoder.config
    config: dict[str, Any] = {
        **sids.config(),
        "beam_width": module.beam_width,
        "top_k": module.top_k,
        "max_history_items": max_history,
        "max_history_tokens": 1 + L * max_history,
        "weights_dtype": chosen,
        "bf16_check": {"top10_overlap_vs_fp32": overlap, "threshold": BF16_MIN_OVERLAP,
                       "probe_histories": int(histories.shape[0])},
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
    minutes: float = 3.0,
    beam_width: int = 64,
    top_k: int | None = None,
    weights: str = "auto",
    seed: int = 0,
    torchscript: bool = True,
    overwrite: bool = False,
) -> Path:
    """The `silverrec publish --generative` path.

    With `model` (a checkpoint from `python -m silverrec.publish.train_generative`): its decoder
    and semantic IDs, restricted to the pool's items (every pool item must have one). Without:
    semantic IDs from the pool's embeddings, then a `minutes` training run on the bundled MovieLens
    sequences of the pool's items (the pool must hold MovieLens movie ids).
    """
    from silverrec.publish import movielens
    from silverrec.publish.semantic_ids import build_semantic_ids
    from silverrec.publish.train_generative import (
        TrainConfig, evaluate_all, load_checkpoint, split_sequences, torch_threads, train_decoder,
    )

    extra: dict[str, Any] = {}
    probe = None
    if model is not None:
        decoder, sids, info = load_checkpoint(model)
        sids = sids.subset(pool.item_ids)
        max_history = int(info["train_config"]["max_history"])
        extra["training"] = {"checkpoint": str(model), **info["metrics"]}
    else:
        cfg = TrainConfig(minutes=minutes, seed=seed)
        with step("semantic IDs (residual k-means over the pool embeddings)"):
            sids = build_semantic_ids(pool.embeddings, pool.item_ids, seed=seed)
        print(f"[silverrec] {sids.stats.summary()}", flush=True)
        try:
            split = split_sequences(movielens.user_sequences(), sids.item_ids)
        except PoolError:
            raise PoolError("no checkpoint given (--model) and the pool's item ids are not MovieLens movies: "
                            "train with python -m silverrec.publish.train_generative, or pass --model") from None
        with step(f"training decoder on MovieLens sequences ({minutes:g} min budget)"):
            decoder, metrics = train_decoder(sids, split, cfg)
        with step("evaluating on held-out users"), torch_threads(cfg.threads):
            evaluate_all(decoder, sids, split, cfg, metrics)
        print(f"[silverrec] {metrics.summary()}", flush=True)
        max_history = cfg.max_history
        extra["training"] = {"minutes": minutes, **asdict(metrics)}
        probe = [sids.item_ids[h].tolist() for h in split.valid_history[:64]]
    return publish_generative(decoder, sids, out, beam_width=beam_width, top_k=top_k, max_history=max_history,
                              weights=weights, probe=probe, extra_config=extra, torchscript=torchscript,
                              overwrite=overwrite)
