"""Bloom signatures and exact value-code planes for attribute filtering, bit-sliced (publish side).

Every (feature, value) token sets K hashed bits (`silverrec.filtering.bloom_hash`) of an M-bit signature; an
item's signature is the OR over its tokens. Signatures are stored bit-sliced in a row bank

    bits int64 [R, W],  W = ceil(N / 64),  R = M + exact plane rows

row m < M holds bit m of the signatures of items 64w..64w+63 in word w (bit r & 63; bit 63 is the
int64 sign bit), in the caller's row order (the IVF's cluster-major order), so a cluster is a
contiguous word range and `f = v` over 64 items is K word ANDs.

Rows M.. hold exact value-code planes for negated terms (see silverrec/filtering/filter_program.py): for a
feature with at most `slots` values per item and V values, ceil(log2(V + 1)) bit rows per slot,
kept when slots x bits <= EXACT_MAX_BITS.

Sizing rule (SilverTorch 6.3.2): M ~ max tokens per item x K x buffer, rounded up to 64 bits.
With K = 7 and buffer 1.5 the false-positive rate of one term on the fullest item is
(1 - e^(-1/1.5))^7 = 0.65%; items with fewer tokens do better. The estimate from the pool is the
mean over items of (1 - (1 - 1/M)^(K n_i))^K, n_i = tokens of item i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from silverrec.filtering.bloom_hash import token_positions
from silverrec.errors import PoolError
from silverrec.filtering.forward_index import ForwardIndex

DEFAULT_HASHES = 7
BUFFER = 1.5
EXACT_MAX_BITS = 64  # per item and feature: slots x code bits
DEFAULT_SEED = 0x5EED
CHUNK_ITEMS = 1 << 15  # items per signature-building chunk (multiple of 64)


@dataclass(frozen=True)
class BloomConfig:
    bits: int  # M
    hashes: int  # K
    seed: int = DEFAULT_SEED

    def __post_init__(self):
        if self.bits < 1 or self.bits % 64:
            raise PoolError(f"--bloom-bits must be a positive multiple of 64, got {self.bits}")
        if not 1 <= self.hashes <= 64:
            raise PoolError(f"--bloom-hashes must be in [1, 64], got {self.hashes}")


def sizing_rule(max_tokens: int, hashes: int = DEFAULT_HASHES, buffer: float = BUFFER) -> int:
    """Default M: max tokens per item x K x buffer, rounded up to a multiple of 64 (>= 64)."""
    return max(64, int(math.ceil(max(1, max_tokens) * hashes * buffer / 64.0)) * 64)


def estimate_fp_rate(token_counts: torch.Tensor, bits: int, hashes: int) -> float:
    """Expected false-positive rate of one `f = v` term over items without v (mean over items)."""
    n = token_counts.to(torch.float64)
    fill = 1.0 - torch.pow(1.0 - 1.0 / bits, hashes * n)
    return float(torch.pow(fill, hashes).mean()) if n.numel() else 0.0


def choose_config(fwd: ForwardIndex, bits: Optional[int] = None, hashes: Optional[int] = None, seed: int = DEFAULT_SEED) -> BloomConfig:
    """The CLI defaults: K = 7 unless given, M from the sizing rule unless given."""
    k = DEFAULT_HASHES if hashes is None else hashes
    counts = fwd.token_counts()
    m = sizing_rule(int(counts.max()) if counts.numel() else 1, k) if bits is None else bits
    return BloomConfig(m, k, seed)


def token_table(fwd: ForwardIndex, cfg: BloomConfig) -> np.ndarray:
    """int64 [num_tokens, K]: bit positions of every vocabulary token (global token id order)."""
    rows = [token_positions(f, v, cfg.bits, cfg.hashes, cfg.seed) for f, voc in zip(fwd.features, fwd.vocabs) for v in voc]
    return np.asarray(rows, dtype=np.int64).reshape(-1, cfg.hashes)


def _pack_columns(rows_bool: np.ndarray) -> np.ndarray:
    """bool [R, C] (C multiple of 64) -> int64 [R, C / 64], bit c & 63 of word c >> 6."""
    packed = np.packbits(rows_bool, axis=1, bitorder="little")
    return packed.view("<u8").view(np.int64)


def bloom_rows(fwd: ForwardIndex, cfg: BloomConfig, out: np.ndarray) -> None:
    """Write the M Bloom rows into out int64 [>= M, W] (chunked over items: memory O(M x chunk))."""
    n = fwd.size
    table = token_table(fwd, cfg)
    tokens = fwd.token_ids.numpy()
    offsets = fwd.offsets.numpy()
    token_rows = fwd.token_rows.numpy()
    for start in range(0, n, CHUNK_ITEMS):
        stop = min(n, start + CHUNK_ITEMS)
        width = (stop - start + 63) // 64 * 64
        sig = np.zeros((cfg.bits, width), dtype=bool)
        a, b = offsets[start], offsets[stop]
        pos = table[tokens[a:b]]  # [nnz_chunk, K]
        local = (token_rows[a:b] - start).astype(np.int64)
        sig[pos.reshape(-1), np.repeat(local, cfg.hashes)] = True
        out[: cfg.bits, start // 64 : start // 64 + width // 64] = _pack_columns(sig)


def exact_planes(fwd: ForwardIndex, first_row: int) -> tuple[list[np.ndarray], dict[str, Optional[dict[str, int]]]]:
    """Exact value-code planes for every feature that fits EXACT_MAX_BITS; and their manifest entries."""
    n = fwd.size
    width = (n + 63) // 64 * 64
    planes: list[np.ndarray] = []
    meta: dict[str, Optional[dict[str, int]]] = {}
    row = first_row
    for f, vocab in zip(fwd.features, fwd.vocabs):
        nbits = max(1, int(len(vocab)).bit_length())  # codes 1..V
        codes, slots = fwd.feature_codes(f)
        if slots * nbits > EXACT_MAX_BITS:
            meta[f] = None
            continue
        codes_np = codes.numpy()
        block = np.zeros((slots * nbits, width), dtype=bool)
        for s in range(slots):
            for b in range(nbits):
                block[s * nbits + b, :n] = (codes_np[:, s] >> b) & 1
        planes.append(_pack_columns(block))
        meta[f] = {"row": row, "slots": slots, "bits": nbits}
        row += slots * nbits
    return planes, meta


def build_filter_bank(fwd: ForwardIndex, cfg: BloomConfig) -> tuple[torch.Tensor, dict[str, Any]]:
    """The row bank int64 [R, W] (Bloom rows, then exact planes) and the manifest's "filter" config.

    `fwd` must already be in the index's row order (e.g. `fwd.permute(cluster_major_order)`).
    """
    n = fwd.size
    w = (n + 63) // 64
    planes, exact = exact_planes(fwd, cfg.bits)
    total = cfg.bits + sum(p.shape[0] for p in planes)
    bank = np.zeros((total, w), dtype=np.int64)
    bloom_rows(fwd, cfg, bank)
    r = cfg.bits
    for p in planes:
        bank[r : r + p.shape[0]] = p
        r += p.shape[0]
    counts = fwd.token_counts()
    config = {
        "bloom": {"bits": cfg.bits, "hashes": cfg.hashes, "seed": cfg.seed},
        "rows": total,
        "features": {
            f: {"values": list(vocab), "exact": exact[f]} for f, vocab in zip(fwd.features, fwd.vocabs)
        },
        "stats": {
            "max_tokens_per_item": int(counts.max()) if n else 0,
            "mean_tokens_per_item": float(counts.float().mean()) if n else 0.0,
            "estimated_fp_rate": estimate_fp_rate(counts, cfg.bits, cfg.hashes),
            "bank_bytes": int(total * w * 8),
        },
    }
    return torch.from_numpy(bank), config
