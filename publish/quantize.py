"""Int8 quantisation of item embeddings with one global range (SilverTorch 4.2).

The global min/max of all embedding values maps to [-128, 127]:
    code = round((x - offset) / scale),  x ~= scale * code + offset.
"""

import torch


def quantize_global(embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, D] -> (codes int8 [N, D], scale float32 [], offset float32 [])."""
    x = embeddings.float()
    lo, hi = x.min(), x.max()
    scale = ((hi - lo) / 255.0).clamp_min(1e-12)
    offset = lo + 128.0 * scale  # code -128 <-> lo, code 127 <-> hi
    codes = torch.round((x - offset) / scale).clamp_(-128, 127).to(torch.int8)
    return codes, scale.reshape(()), offset.reshape(())
