"""The IVF searches' probe on CUDA as one Triton kernel: the query folded and quantised, every centroid
scored, each query's best P centroids selected.

    probe = probe_triton(queries, centroids, dim_scale, dim_offset, P, counters)
    # queries float32 [B, D], centroids float32 [C, D], dim_scale / dim_offset float32 [D], 1 <= P <= C,
    # counters int32 [B] zeroed (one per query: the tile programs that have finished)
    # -> Probe(qcodes int8 [B, D], qscale float32 [B], constant float32 [B], scores float32 [B, C], cand int64 [B, P])

Program (b, t) scores query b against centroid tile t (BLOCK_C centroids) in `common.dot_lanes`'s order
(16 lanes, each summed in order, then a tree; fused multiply-adds off), which is the order the C++ probe
and `centroid_candidates_torch` rank by on the CPU, so the candidates are the CPU's, ties to the lower
centroid. It keeps the tile's best PB keys (`topk_triton.float_key`, a sort of the tile); the last of
query b's NT programs to finish (an atomic counter; the others' lists are read past L1) sorts the NT
lists and writes the best P: one launch where `centroid_candidates_torch` is a matmul and a sort.
Program (b, 0) also folds the query into the scan's int8 query (`q * dim_scale`, quantised as
`common.quantize_queries`: scale = max(amax, floor) / 127 and codes rounded half to even, divisions
correctly rounded, the same bits) and the per-query score constant `<q, dim_offset>` (float sums: its
summation order is this kernel's). The scores [B, C] stay for the residual codes' cluster term.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from silverrec.kernels import constants
from silverrec.kernels.topk_triton import EMPTY, float_key, key_row, merged, sort_desc

QUERY_CODE_MAX = tl.constexpr(float(constants.QUERY_CODE_MAX))
QUERY_SCALE_FLOOR = tl.constexpr(constants.QUERY_SCALE_FLOOR)
ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 x 2**23: (x + m) - m rounds |x| < 2**22 half to even in float32
MERGE_KEYS = 4096  # most keys the last program sorts (NT lists x PB); larger tiles beyond it
SUB = 64  # centroids scored per step of a tile (a [SUB, 16] float32 accumulator)


class Probe(NamedTuple):
    qcodes: torch.Tensor  # int8 [B, D] the folded query's codes
    qscale: torch.Tensor  # float32 [B] their scale
    constant: torch.Tensor  # float32 [B] <q, dim_offset>
    scores: torch.Tensor  # float32 [B, C] <q, centroid c>
    cand: torch.Tensor  # int64 [B, P] the best P centroids, best first


@triton.jit
def _fold_query(q_ptr, scale_ptr, offset_ptr, qcode_ptr, qscale_ptr, const_ptr, b, D, DB: tl.constexpr):
    """Query b folded (q * dim_scale) and quantised like common.quantize_queries; <q, dim_offset>."""
    d = tl.arange(0, DB)
    q = tl.load(q_ptr + b * D + d, mask=d < D, other=0.0)
    folded = q * tl.load(scale_ptr + d, mask=d < D, other=0.0)
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(folded), axis=0), QUERY_SCALE_FLOOR), QUERY_CODE_MAX)
    x = tl.div_rn(folded, tl.zeros_like(folded) + scale)
    r = (x + ROUND_MAGIC) - ROUND_MAGIC
    r = tl.minimum(tl.maximum(r, -QUERY_CODE_MAX), QUERY_CODE_MAX)
    tl.store(qcode_ptr + b * D + d, r.to(tl.int8), mask=d < D)
    tl.store(qscale_ptr + b, scale)
    tl.store(const_ptr + b, tl.sum(q * tl.load(offset_ptr + d, mask=d < D, other=0.0), axis=0))


@triton.jit
def _lane_scores(q_ptr, cent_ptr, b, c, C, D):
    """float32 [SUB]: <q_b, centroid c> for centroids c [SUB] (0 past C), in dot_lanes's order."""
    lane = tl.arange(0, 16)
    acc = tl.zeros((c.shape[0], 16), tl.float32)
    for d0 in range(0, D, 16):
        d = d0 + lane
        x = tl.load(cent_ptr + c[:, None].to(tl.int64) * D + d[None, :], mask=(c[:, None] < C) & (d[None, :] < D),
                    other=0.0)
        acc = acc + x * tl.load(q_ptr + b * D + d, mask=d < D, other=0.0)[None, :]
    return lane_tree(acc)


@triton.jit
def lane_tree(acc):
    """[M, 16] lane sums -> [M]: dot_lanes's tree (lane i + lane i + 8, then + 4, + 2, + 1)."""
    M: tl.constexpr = acc.shape[0]
    s = tl.sum(tl.reshape(acc, [M, 2, 8]), axis=1)
    s = tl.sum(tl.reshape(s, [M, 2, 4]), axis=1)
    s = tl.sum(tl.reshape(s, [M, 2, 2]), axis=1)
    return tl.sum(s, axis=1)


@triton.jit
def _probe_kernel(
    q_ptr,  # float32 [B, D] queries
    cent_ptr,  # float32 [C, D]
    scale_ptr,  # float32 [D] dim_scale
    offset_ptr,  # float32 [D] dim_offset
    qcode_ptr,  # out int8 [B, D]
    qscale_ptr,  # out float32 [B]
    const_ptr,  # out float32 [B]
    score_ptr,  # out float32 [B, C]
    part_ptr,  # scratch int64 [B, NT, PB]: each tile's best keys
    cand_ptr,  # out int64 [B, P]
    counter_ptr,  # int32 [B], zeroed
    C,
    D,
    P,
    NT,
    DB: tl.constexpr,  # power of two >= D
    BLOCK_C: tl.constexpr,  # centroids per program (a multiple of SUB, >= PB)
    SUB_C: tl.constexpr,
    PB: tl.constexpr,  # power of two >= P
    NTB: tl.constexpr,  # power of two >= NT
):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    if t == 0:
        _fold_query(q_ptr, scale_ptr, offset_ptr, qcode_ptr, qscale_ptr, const_ptr, b, D, DB)
    for c0 in range(0, BLOCK_C, SUB_C):  # the tile's scores, into the scores row
        c = t * BLOCK_C + c0 + tl.arange(0, SUB_C)
        s = _lane_scores(q_ptr, cent_ptr, b, c, C, D) + 0.0  # -0.0 counts as 0.0, as in a sort
        tl.store(score_ptr + b * C + c, s, mask=c < C)
    tl.debug_barrier()  # the row's scores written by every thread before they are read back
    c = t * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.load(score_ptr + b * C + c, mask=c < C, other=0.0)
    keys = tl.where(c < C, float_key(s, c), EMPTY)
    best = sort_desc(keys)
    j = tl.arange(0, BLOCK_C)
    tl.store(part_ptr + (b * NT + t) * PB + j, best, mask=j < PB)
    tl.debug_barrier()  # this program's list stored before it counts itself done
    if tl.atomic_add(counter_ptr + b, 1, sem="acq_rel") == NT - 1:  # the last tile of query b: merge
        top = merged(part_ptr + b * NT * PB, NT, PB, NTB)
        slot = tl.arange(0, PB)
        tl.store(cand_ptr + b * P + slot, key_row(top), mask=slot < P)


def probe_shapes(C: int, P: int) -> tuple[int, int, int]:
    """(BLOCK_C, PB, NT) for C centroids and P candidates: tiles of at least SUB centroids and PB, large
    enough that the last program sorts at most MERGE_KEYS keys."""
    pb = triton.next_power_of_2(P)
    block = max(SUB, pb, triton.next_power_of_2(triton.cdiv(C * pb, MERGE_KEYS)))
    return block, pb, triton.cdiv(C, block)


def probe_triton(queries: torch.Tensor, centroids: torch.Tensor, dim_scale: torch.Tensor, dim_offset: torch.Tensor,
                 P: int, counters: torch.Tensor) -> Probe:
    """Launcher (module docstring); every tensor contiguous float32 on one device, counters int32 [B] zeroed."""
    B, D = queries.shape
    C = centroids.shape[0]
    dev = queries.device
    block, pb, nt = probe_shapes(C, P)
    qcodes = torch.empty((B, D), dtype=torch.int8, device=dev)
    qscale = torch.empty((B,), dtype=torch.float32, device=dev)
    constant = torch.empty((B,), dtype=torch.float32, device=dev)
    scores = torch.empty((B, C), dtype=torch.float32, device=dev)
    cand = torch.empty((B, P), dtype=torch.int64, device=dev)
    if B:
        part = torch.empty((B, nt, pb), dtype=torch.int64, device=dev)
        _probe_kernel[(B, nt)](
            queries, centroids, dim_scale, dim_offset, qcodes, qscale, constant, scores, part, cand, counters,
            C, D, P, nt, DB=triton.next_power_of_2(D), BLOCK_C=block, SUB_C=SUB, PB=pb, NTB=triton.next_power_of_2(nt),
            enable_fp_fusion=False,
        )
    return Probe(qcodes, qscale, constant, scores, cand)
