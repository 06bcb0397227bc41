"""Packed bitmasks, the one layout every stage uses: bit r & 63 of int64 word r >> 6 holds row r.

Filters (Bloom results, exact evaluation), the generative decode's allowed items and the kernels'
masks all share it; the C++ kernels read the same words.
"""

import torch


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., N] -> int64 [..., ceil(N / 64)], on the mask's device."""
    n = mask.shape[-1]
    w = (n + 63) // 64
    lead = list(mask.shape[:-1])  # (no *-unpacking: TorchScript compiles these for the decode)
    padded = torch.zeros(lead + [w * 64], dtype=torch.int64, device=mask.device)
    padded[..., :n] = mask.to(torch.int64)
    shifts = torch.arange(64, dtype=torch.int64, device=mask.device)
    return (padded.reshape(lead + [w, 64]) << shifts).sum(dim=-1)  # disjoint bits: sum == OR


def unpack_bits(words: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [..., W] -> bool [..., n] (inverse of `pack_bits`)."""
    shifts = torch.arange(64, dtype=torch.int64, device=words.device)
    return ((words[..., None] >> shifts) & 1).reshape(list(words.shape[:-1]) + [-1])[..., :n] != 0
