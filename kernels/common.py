"""Helpers shared by the int8 scoring ops: query quantisation and (score, row) sort keys.

A sort key packs an int32 dot product and a row index into one int64 so that one `topk` orders
by score (descending) and breaks ties by row (ascending), deterministically on every device:

    key = score * 2**32 + (2**32 - 1 - row)        score: int32, 0 <= row < 2**32
"""

import torch

from silverrec.kernels.constants import BIAS_FLOOR, EMPTY_KEY, NO_ROW, QUERY_CODE_MAX, QUERY_SCALE_FLOOR

ROW_MASK = (1 << 32) - 1


def quantize_queries(queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-query int8 quantisation.

    Args:
        queries: float [B, D].
    Returns:
        codes int8 [B, D] in [-QUERY_CODE_MAX, QUERY_CODE_MAX] and scale float32 [B] with queries ~= scale[:, None] * codes.
    """
    q = queries.float()
    scale = q.abs().amax(dim=1).clamp_min(QUERY_SCALE_FLOOR) / float(QUERY_CODE_MAX)
    codes = torch.round(q / scale[:, None]).clamp_(-QUERY_CODE_MAX, QUERY_CODE_MAX).to(torch.int8)
    return codes, scale


def make_keys(scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Pack int32 scores and int64 rows (broadcastable) into int64 sort keys."""
    return torch.add(ROW_MASK - rows, scores.to(torch.int64), alpha=1 << 32)


def split_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `make_keys`: (int64 integer scores, int64 rows). Padding keys give row NO_ROW."""
    rows = ROW_MASK - (keys & ROW_MASK)
    scores = keys >> 32
    rows = torch.where(keys == EMPTY_KEY, torch.full_like(rows, NO_ROW), rows)
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


def cluster_of_rows(cluster_offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The cluster of each cluster-major row: rows int64 [...] (each in [0, N)), cluster_offsets int64
    [nlist + 1] -> int64 [...], the last c with off[c] <= row (empty clusters skipped)."""
    return torch.searchsorted(cluster_offsets, rows, right=True) - 1


def dot_lanes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """<a, b> over the last dimension (broadcast), float32, summed in kernels/csrc/widen.h dot_lanes's order
    (16 lanes, each in order, then a tree), so torch and the C++ kernels compute the same bits."""
    p = a.float() * b.float()
    pad = (-p.shape[-1]) % 16
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    p = p.reshape(*p.shape[:-1], -1, 16)
    lane = p[..., 0, :]
    for i in range(1, p.shape[-2]):
        lane = lane + p[..., i, :]
    for w in (8, 4, 2, 1):
        lane = lane[..., :w] + lane[..., w : 2 * w]
    return lane[..., 0]


def centroid_scores(centroids: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """The probe scores: centroids float32 [C, D], queries float32 [B, D] -> float32 [B, C], <q, c>.

    On the CPU in `dot_lanes`'s order, the bits kernels/csrc/centroid_probe.cpp ranks by (it scores only
    the centroids an int8 screen cannot rule out, and needs an order it can reproduce per centroid: an
    MKL sgemm's sums depend on the matrix shapes). On CUDA one matmul: cuBLAS's sums (the GPU never
    matched the CPU's bits; tests/gpu compare probes on data without near ties)."""
    if queries.is_cuda:
        return (centroids @ queries.t()).t()
    rows = max(1, (1 << 22) // max(1, queries.shape[0] * queries.shape[1]))  # [B, rows, D] products at a time
    return torch.cat([dot_lanes(queries[:, None, :], centroids[None, i : i + rows])
                      for i in range(0, centroids.shape[0], rows)], dim=1)


def cluster_bias(
    cluster_scores: torch.Tensor, query_scale: torch.Tensor, scale: torch.Tensor, visited: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual codes' cluster term in the scans' integer units.

    A row of cluster c scores <q, centroid c> + <q, residual>; the scans add
    bias[b, c] = round(cluster_scores[b, c] / u[b]) - round(shift[b] / u[b]) (u = scale * query_scale, in
    float64, half to even) to the int8 dot, where shift[b] is the best score among the clusters the query
    visits (`visited`, default all); round(shift[b] / u[b]) * u[b] is added back to the dequantised score.
    The difference of two rounded terms makes the ranking, and the scores up to float rounding, independent
    of the shift (the probed and the exact routes visit different clusters and rank alike); shifting by
    the best keeps every bias <= 0, and the clamp at
    BIAS_FLOOR (2**30, more than twice the largest possible |dot| 127 * 128 * D for D <= 33,000) only
    touches clusters too far below the best for any of their rows to outrank a row of the best one. When
    the best visited cluster holds none of the rows that rank (the CUDA exact route shifts by the best of
    all clusters), the rows' own clusters must stay above the floor: their spread reached 2**22.6 units on
    Fashion-MNIST at nlist 100 (a tight cluster's residual range makes the unit small), so the floor
    was raised from 2**24.
    csrc/scan.h `cluster_bias` computes the same.

    cluster_scores float32 [B, nlist], query_scale float32 [B], scale float32 [], visited bool [B, nlist]
    -> (bias int32 [B, nlist] in [BIAS_FLOOR, 0], the shift to add back float32 [B]; 0 where nothing is visited).
    """
    scores = cluster_scores if visited is None else torch.where(visited, cluster_scores, float("-inf"))
    shift = scores.amax(dim=1)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    u = (scale * query_scale).double()
    whole = torch.round(shift.double() / u)  # the shift in units
    units = torch.round(cluster_scores.double() / u[:, None]) - whole[:, None]
    return units.clamp_(BIAS_FLOOR, 0).to(torch.int32).contiguous(), (whole * u).float()
