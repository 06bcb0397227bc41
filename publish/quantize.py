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


def quantize_per_dim(embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-dimension min/max to [-128, 127] (Faiss SQ8's ranges), for indexes that fold the
    per-dimension scale into the query (`Int8IVFIndex.fold`).

    float [N, D] -> (codes int8 [N, D], dim_scale float32 [D], dim_offset float32 [D]) with
    x[:, d] ~= dim_scale[d] * code[:, d] + dim_offset[d]. Since <q, x> = <q * dim_scale, code> +
    <q, dim_offset>, the scan stays int8 x int8 and the second term is one constant per query.
    """
    x = embeddings.float()
    lo, hi = x.amin(dim=0), x.amax(dim=0)
    scale = ((hi - lo) / 255.0).clamp_min(1e-12)
    offset = lo + 128.0 * scale
    codes = torch.round((x - offset) / scale).clamp_(-128, 127).to(torch.int8)
    return codes, scale, offset
