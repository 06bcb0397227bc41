"""Triton kernel for `silverrec::ivf_scan` on CUDA.

`_ivf_scan_keys_kernel` streams the probed clusters straight from the cluster-major int8 codes:
program (b, g, t) takes query b's probe slot j = j0 + g, loads row tile t of cluster probes[b, j],
scores it with int8 `tl.dot` (int32 accumulation), applies the slot's bitmask and writes int64 sort
keys (score << 32 | ~row), EMPTY_KEY for rows outside the cluster, masked rows or slot -1. The
launcher walks the probe slots in groups (`slots_per_merge`: as many as 16 MiB of keys hold, at
least SLOT_GROUP) and merges each group's keys into the running top-k with `torch.topk` on the
device, the running top-k kept in the first k columns of the same buffer. The probed rows are never
gathered; the key buffer is B x (k + group x max cluster size) int64.

Residual codes (`bias` int32 [B, nlist]): `_ivf_scan_bias_keys_kernel` adds bias[b, c], one scalar
load per program, to the slot's dots before the keys are packed, so it ranks. Without bias the
launcher runs `_ivf_scan_keys_kernel`, that kernel with HAS_BIAS off (the same code, the old
signature).

The query is broadcast over the 16 columns of the dot's second operand (tl.dot needs N >= 16), so
the MMA does 16x the useful work; the scan is bound by reading the codes, which happens once.
Grouping the queries that probe the same cluster into one program would recover that factor.

Runs on CPU tensors under TRITON_INTERPRET=1 (tests).
"""

import torch
import triton
import triton.language as tl

from silverrec.kernels import constants
from silverrec.kernels.constants import EMPTY_KEY

NO_CLUSTER = tl.constexpr(constants.NO_CLUSTER)  # a probe slot that scans nothing (kernels/constants.py)

SLOT_GROUP = 8  # the fewest probe slots scored per launch before a top-k merge
# ... and the most: as many as this many bytes of keys hold. Each merge is a torch.topk, a multi-block
# radix select of several passes of small kernels; merging every 8 slots made it the largest share of
# a search's device time (benchmarks/profile_cuda.py). One merge per 16 MiB of keys makes it 2-3 a
# search at batch 16, max_probe 128.
KEY_BUFFER_BYTES = 16 << 20


def slots_per_merge(batch: int, probes: int, columns: int, slot_group: int | None = None) -> int:
    """Probe slots scored per launch: `slot_group` if given (tests), else as many as KEY_BUFFER_BYTES
    of int64 keys hold for `batch` queries x `columns` keys per slot, at least SLOT_GROUP, at most all."""
    if slot_group is not None:
        return max(1, min(int(slot_group), probes))
    return max(1, min(probes, max(SLOT_GROUP, KEY_BUFFER_BYTES // max(1, batch * columns * 8))))


@triton.jit
def row_scores(q_ptr, x_ptr, b, rows, ok, D, stride_q, stride_x, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """int32 [BLOCK]: exact int8 dot products of query b with the code rows `rows` int64 [BLOCK]
    (lanes where `ok` is False score 0). The query is broadcast over the 16 columns of the dot's
    second operand (tl.dot needs N >= 16); all columns come out equal. Shared by the ivf_scan and
    filtered_topk kernels."""
    acc = tl.zeros((BLOCK, 16), dtype=tl.int32)
    cols = tl.arange(0, 16)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_d[None, :],
            mask=ok[:, None] & (offs_d[None, :] < D),
            other=0,
        )  # [BLOCK, BLOCK_D]
        q = tl.load(
            q_ptr + b * stride_q + offs_d[:, None] + cols[None, :] * 0,
            mask=(offs_d[:, None] < D) & (cols[None, :] >= 0),
            other=0,
        )  # [BLOCK_D, 16], every column = query b
        acc += tl.dot(x, q, out_dtype=tl.int32)
    return tl.max(acc, axis=1)


@triton.jit
def _ivf_scan_bias_keys_kernel(
    q_ptr,  # int8 [B, D] quantised queries
    x_ptr,  # int8 [N, D] cluster-major codes
    off_ptr,  # int64 [nlist + 1] cluster offsets
    probes_ptr,  # int64 [B, P] (canonical: repeats replaced by -1)
    mask_ptr,  # int64 [B, P, Wc] bitmask (ignored unless HAS_MASK)
    out_ptr,  # int64 [B, G * L] sort keys
    D,
    P,
    Wc,
    j0,  # first probe slot of this launch
    L,  # key columns per slot (>= max cluster size)
    stride_q,
    stride_x,
    stride_p,
    stride_mb,
    stride_mp,
    stride_o,
    bias_ptr,  # int32 [B, nlist] per-(query, cluster) score terms (ignored unless HAS_BIAS)
    stride_bias,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[b, g * L + n] = key of row off[c] + n of cluster c = probes[b, j0 + g]:
    (sum_d q[b, d] * x[row, d] + bias[b, c]) * 2**32 + (2**32 - 1 - row) if the row exists and is
    allowed, else EMPTY_KEY (bias[b, c] = 0 unless HAS_BIAS)."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    t = tl.program_id(2)
    j = j0 + g
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + b * stride_o + g * L + offs_n
    empty = tl.full((BLOCK_N,), -9223372036854775808, tl.int64)
    c = tl.load(probes_ptr + b * stride_p + j, mask=j < P, other=NO_CLUSTER)
    if c < 0:
        tl.store(out_ptrs, empty, mask=offs_n < L)
    else:
        start = tl.load(off_ptr + c)
        stop = tl.load(off_ptr + c + 1)
        rows = start + offs_n  # int64 [BLOCK_N]
        valid = rows < stop
        score = row_scores(q_ptr, x_ptr, b, rows, valid, D, stride_q, stride_x, BLOCK_N, BLOCK_D)
        if HAS_BIAS:  # one scalar per (query, slot) program, added before the selection
            score += tl.load(bias_ptr + b * stride_bias + c)
        if HAS_MASK:
            word = tl.load(
                mask_ptr + b * stride_mb + j * stride_mp + ((rows >> 6) - (start >> 6)),
                mask=valid,
                other=0,
            )
            valid = valid & (((word >> (rows & 63)) & 1) != 0)
        keys = score.to(tl.int64) * 4294967296 + (4294967295 - rows)
        tl.store(out_ptrs, tl.where(valid, keys, empty), mask=offs_n < L)


@triton.jit
def _ivf_scan_keys_kernel(
    q_ptr, x_ptr, off_ptr, probes_ptr, mask_ptr, out_ptr,
    D, P, Wc, j0, L, stride_q, stride_x, stride_p, stride_mb, stride_mp, stride_o,
    HAS_MASK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """`_ivf_scan_bias_keys_kernel` without bias (the same code): the kernel of the scan without
    residual codes, its signature unchanged."""
    _ivf_scan_bias_keys_kernel(
        q_ptr, x_ptr, off_ptr, probes_ptr, mask_ptr, out_ptr,
        D, P, Wc, j0, L, stride_q, stride_x, stride_p, stride_mb, stride_mp, stride_o, probes_ptr, 0,
        HAS_MASK, False, BLOCK_N, BLOCK_D,
    )


def scan_keys_triton(qcodes, codes, cluster_offsets, probes, k, bitmask, slot_group: int | None = None,
                     window_words: int = 0, bias: torch.Tensor | None = None):
    """Top-k sort keys int64 [B, k] (descending, EMPTY_KEY padding); same contract as
    `ivf_scan.scan_keys_cpu` (probes canonical). window_words: the index's Wc, 0 = unknown
    (`silverrec::ivf_scan`). bias: None or int32 [B, nlist] in [BIAS_FLOOR, 0] (kernels/common.py), added to the int8
    dot of every row of cluster c for query b before the selection (residual codes: the
    per-(query, cluster) term of row ~ centroid[c] + dim_scale * code + dim_offset)."""
    qcodes = qcodes.contiguous()
    codes = codes.contiguous()
    probes = probes.contiguous()
    B, D = qcodes.shape
    P = probes.shape[1]
    best = torch.full((B, k), EMPTY_KEY, dtype=torch.int64, device=codes.device)
    if B == 0 or P == 0:
        return best
    # Key columns per slot >= the largest cluster: the bitmask's or the index's Wc words per slot bound
    # every cluster (no host synchronisation: a CUDA graph can capture the scan); else one host read.
    if bitmask is not None:
        max_size = bitmask.shape[2] * 64
    elif window_words > 0:
        max_size = window_words * 64
    else:
        max_size = int((cluster_offsets[1:] - cluster_offsets[:-1]).max())
    if max_size == 0:
        return best
    BLOCK_N = 64
    BLOCK_D = max(32, min(128, triton.next_power_of_2(D)))  # int8 tl.dot needs K >= 32 on NVIDIA (min_dot_size)
    L = triton.cdiv(max_size, BLOCK_N) * BLOCK_N
    G = slots_per_merge(B, P, L, slot_group)
    has_mask = bitmask is not None
    mask = bitmask.contiguous() if has_mask else probes  # dummy pointer when unused
    Wc = mask.shape[2] if has_mask else 0
    if bias is None:  # the kernel without bias arguments (same code as HAS_BIAS=False)
        kernel, bias_args, bias_flag = _ivf_scan_keys_kernel, (), {}
    else:
        if tuple(bias.shape) != (B, cluster_offsets.numel() - 1):
            raise ValueError(f"ivf_scan: bias must be [B, nlist], got {tuple(bias.shape)}")
        bias = bias.contiguous()
        kernel, bias_args, bias_flag = _ivf_scan_bias_keys_kernel, (bias, bias.stride(0)), {"HAS_BIAS": True}
    buf = torch.empty((B, k + G * L), dtype=torch.int64, device=codes.device)
    buf[:, :k] = best  # the running top-k, then this launch's G slots of keys
    keys = buf[:, k:]
    for j0 in range(0, P, G):
        grid = (B, G, L // BLOCK_N)
        kernel[grid](
            qcodes, codes, cluster_offsets, probes, mask, keys,
            D, P, Wc, j0, L,
            qcodes.stride(0), codes.stride(0), probes.stride(0),
            mask.stride(0) if has_mask else 0, mask.stride(1) if has_mask else 0, buf.stride(0),
            *bias_args, HAS_MASK=has_mask, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, **bias_flag,
        )
        buf[:, :k] = buf.topk(k, dim=1, sorted=False).values
    return buf[:, :k].sort(dim=1, descending=True).values
