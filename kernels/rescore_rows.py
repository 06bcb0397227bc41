"""`silverrec::rescore_rows`: the int8 scan's top rows re-scored with the float query on the same codes.

    scores, rows = torch.ops.silverrec.rescore_rows(queries, found, codes, dim_scale, dim_offset, k)
    # queries float32 [B, D], found int64 [B, K] (the scan's rows, best first, -1 = none, no row
    # twice in a list), codes int8 [N, D] with per-dimension dim_scale / dim_offset float32 [D]
    # (item ~= dim_scale * code + dim_offset, publish/quantize.py quantize_per_dim), k >= 1
    # -> scores float32 [B, k] (descending, -inf pads), rows int64 [B, k] (-1 pads)
    # optional cluster_offsets int64 [nlist + 1] with centroids float32 [nlist, D]: residual codes
    #     (item ~= centroid[c] + dim_scale * code + dim_offset), a row of cluster c adds <queries[b], centroid c>

Each found row is scored <queries * dim_scale, code> + <queries, dim_offset>, in float32 arithmetic on
the stored codes; the best k are kept, ties by position in `found` (the scan's order); a NaN or
-inf score drops the row.

Where it runs: the last step of `silverrec::filtered_ivf_search` when the caller passes a
`rescore_margin` and k <= `rescore_max_k` (RecModel's pure-ANN configuration: `rescore_margin(k)` and
RESCORE_MAX_K). An exact route whose filter passes at most EXACT_FLOAT_ROWS (kernels/constants.py) rows hands it every one of
them, so a selective filter's answer is the exact float top k of its survivors (ties in the scan's order). Above RESCORE_MAX_K the scan's ranking is returned: the re-score costs B x K x D
multiply-adds, as much as a scan at large k, and a long candidate list (for a ranking stage) gains
little from the order of its last rows.

Why: the scan quantises the folded query to int8 (kernels/common.py quantize_queries), which costs
recall that the codes themselves do not: on the 1M x 128 mixture of benchmarks/ann.py, recall@100
0.98563 with the int8 query against 0.98621 with the float query on the same codes at nprobe 16
(benchmarks/residual_codes.py). Faiss IVF-SQ8 scores the float query against its codes. Re-scoring
the scan's top k + k/16 + 4 rows recovers all of it (a margin of 4 already did at k = 100), for
B x K x D multiply-adds. CPU: kernels/csrc/rescore.cpp, one pass per query; the composition below
(`rescore_rows_torch`) is the CUDA kernel and the tests' reference.
Results agree up to float32 summation order.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from silverrec.kernels.common import cluster_of_rows

RESCORE_MAX_K = 256  # larger k: the scan's ranking (module docstring)


def rescore_margin(k: int) -> int:
    """Rows the scan returns beyond k for the re-score to choose from (one place for the rule)."""
    return k // 16 + 4


def rescore_rows_torch(queries: Tensor, found: Tensor, codes: Tensor, dim_scale: Tensor, dim_offset: Tensor,
                       k: int, cluster_offsets: Optional[Tensor] = None,
                       centroids: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The reference (device-generic; see the module docstring)."""
    if (cluster_offsets is None) != (centroids is None):
        raise ValueError("rescore_rows: cluster_offsets and centroids go together (residual codes)")
    B, K = found.shape
    D = codes.shape[1]
    if queries.shape != (B, D) or dim_scale.shape != (D,) or dim_offset.shape != (D,):
        raise ValueError(f"rescore_rows: queries {tuple(queries.shape)}, found {tuple(found.shape)}, codes "
                         f"{tuple(codes.shape)}, dim_scale {tuple(dim_scale.shape)} and dim_offset "
                         f"{tuple(dim_offset.shape)} disagree (queries [B, D], found [B, K], codes [N, D], [D], [D])")
    folded = queries * dim_scale
    const = (queries * dim_offset).sum(dim=1, keepdim=True)
    cand = codes.index_select(0, found.clamp(min=0).reshape(-1)).reshape(B, K, D).to(queries.dtype)
    s = torch.bmm(cand, folded.unsqueeze(2)).squeeze(2) + const
    if centroids is not None:
        cluster = cluster_of_rows(cluster_offsets, found.clamp(min=0))
        s = s + torch.bmm(centroids.to(queries.dtype)[cluster], queries.unsqueeze(2)).squeeze(2)
    s = torch.where((found >= 0) & (s > float("-inf")), s, float("-inf"))  # NaN too
    # k padding columns first, so that any k works whatever K is
    s = torch.cat([s, torch.full((B, k), float("-inf"), dtype=s.dtype, device=s.device)], dim=1)
    rows = torch.cat([found, torch.full((B, k), -1, dtype=found.dtype, device=found.device)], dim=1)
    values, order = torch.sort(s, dim=1, descending=True, stable=True)
    values, order = values[:, :k], order[:, :k]
    rows = rows.gather(1, order)
    return values, torch.where(values > float("-inf"), rows, torch.full_like(rows, -1))


torch.library.register_kernel("silverrec::rescore_rows", "cuda", rescore_rows_torch)
