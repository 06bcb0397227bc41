"""`silverrec::centroid_candidates`: each query's best P centroids, the IVF searches' probe candidates.

    cand = torch.ops.silverrec.centroid_candidates(queries, centroids, P)
    # queries float32 [B, D], centroids float32 [C, D], 1 <= P <= C
    # -> int64 [B, P]: best first by <q, c> (common.centroid_scores), equal scores to the lower centroid

One op for every caller that ranks centroids: silverrec::filter_plan's candidates (plan.cpp calls the
same C++ function), Int8IVFIndex.probe and the sharded router (silverrec/serving/sharded.py), so that a
router and the shards it routes to agree on every probe.

CPU: kernels/csrc/centroid_probe.cpp. Scoring every centroid in float was ~40% of an unfiltered
nprobe-4 search (16 queries, 4000 x 128 centroids: one MKL sgemm, 220 us on a thread); there an int8
screen bounds every score with a proven error bound (VNNI, on centroid codes built once per centroid
tensor), and only the centroids whose bound can reach a query's top P are scored in float, in
`common.dot_lanes`'s order: the same P, in the same order, as `centroid_candidates_torch` (the
reference; on CUDA and without the extension, the op itself).
"""

from __future__ import annotations

import torch

from silverrec.kernels.common import centroid_scores
from silverrec.kernels.cpu_ext import cpu_ext


def centroid_candidates_torch(queries: torch.Tensor, centroids: torch.Tensor, P: int) -> torch.Tensor:
    """The reference (device-generic): a stable descending sort of every score, first P."""
    return torch.sort(centroid_scores(centroids, queries), dim=1, descending=True, stable=True).indices[:, :P].contiguous()


@torch.library.custom_op("silverrec::centroid_candidates", mutates_args=())
def centroid_candidates(queries: torch.Tensor, centroids: torch.Tensor, P: int) -> torch.Tensor:
    """See the module docstring."""
    if not 1 <= P <= centroids.shape[0]:
        raise ValueError(f"need 1 <= P ({P}) <= the number of centroids ({centroids.shape[0]})")
    if queries.dim() != 2 or centroids.dim() != 2 or queries.shape[1] != centroids.shape[1]:
        raise ValueError(f"queries [B, D] and centroids [C, D] expected, got {tuple(queries.shape)} and {tuple(centroids.shape)}")
    queries, centroids = queries.float().contiguous(), centroids.float().contiguous()
    ext = cpu_ext() if queries.device.type == "cpu" else None
    if ext is not None and hasattr(ext, "centroid_candidates"):
        return ext.centroid_candidates(queries, centroids, P)
    return centroid_candidates_torch(queries, centroids, P)


@centroid_candidates.register_fake
def _(queries, centroids, P):
    return queries.new_empty(queries.shape[0], P, dtype=torch.int64)
