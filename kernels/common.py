"""Helpers shared by the int8 scoring ops: query quantisation and (score, row) sort keys.

A sort key packs an int32 dot product and a row index into one int64 so that one `topk` orders
by score (descending) and breaks ties by row (ascending), deterministically on every device:

    key = score * 2**32 + (2**32 - 1 - row)        score: int32, 0 <= row < 2**32
"""

import torch

from silverrec.kernels.cpu_ext import cpu_ext

ROW_MASK = (1 << 32) - 1
BIAS_FLOOR = -(1 << 24)  # lowest per-(query, cluster) score bias (csrc/scan.h kBiasFloor; checked by a test)
EMPTY_KEY = torch.iinfo(torch.int64).min  # padding key: sorts after every real item


def quantize_queries(queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-query int8 quantisation.

    Args:
        queries: float [B, D].
    Returns:
        codes int8 [B, D] in [-127, 127] and scale float32 [B] with queries ~= scale[:, None] * codes.
    """
    q = queries.float()
    if q.device.type == "cpu" and q.dim() == 2 and q.shape[0] and q.shape[1]:
        ext = cpu_ext()
        if ext is not None and hasattr(ext, "quantize_queries"):  # one call instead of eight ops
            return ext.quantize_queries(q.contiguous())
    scale = q.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    codes = torch.round(q / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def make_keys(scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Pack int32 scores and int64 rows (broadcastable) into int64 sort keys."""
    return torch.add(ROW_MASK - rows, scores.to(torch.int64), alpha=1 << 32)


def split_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `make_keys`: (int64 integer scores, int64 rows). Padding keys give row -1."""
    rows = ROW_MASK - (keys & ROW_MASK)
    scores = keys >> 32
    rows = torch.where(keys == EMPTY_KEY, torch.full_like(rows, -1), rows)
    return scores, rows


def dequantize_scores(
    int_scores: torch.Tensor,
    query_scale: torch.Tensor,
    query_sum: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float inner products from int8 dot products.

    item ~= scale * code + offset and query ~= query_scale * qcode, so
    <query, item> ~= scale * query_scale * <qcode, code> + offset * sum(query).
    Rows where `valid` is False get -inf.
    """
    s = int_scores.to(torch.float32) * (scale * query_scale)[:, None] + (offset * query_sum)[:, None]
    if valid is not None:
        s = torch.where(valid, s, torch.full_like(s, float("-inf")))
    return s


def cluster_bias(
    cluster_scores: torch.Tensor, query_scale: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual codes' cluster term in the scans' integer units.

    A row of cluster c scores <q, centroid c> + <q, residual>; the scans add
    bias[b, c] = round((cluster_scores[b, c] - shift[b]) / (scale * query_scale[b])) to the int8 dot,
    and shift[b] = max_c cluster_scores[b, c] is added back to the dequantised score. Shifting by the
    best cluster keeps every bias <= 0; clamping at BIAS_FLOOR (2**24, more than twice the largest
    possible |dot| 127 * 127 * D for D <= 520) only touches clusters too far below the best one for any
    of their rows to outrank a row of the best cluster.

    cluster_scores float32 [B, nlist], query_scale float32 [B], scale float32 []
    -> (bias int32 [B, nlist] in [BIAS_FLOOR, 0], shift float32 [B]).
    """
    shift = cluster_scores.amax(dim=1)
    units = (cluster_scores - shift[:, None]) / (scale * query_scale)[:, None]
    return torch.round(units).clamp_(BIAS_FLOOR, 0).to(torch.int32).contiguous(), shift
