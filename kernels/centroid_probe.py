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
`common.dot_lanes`'s order: the same P, in the same order, as `centroid_candidates_torch` (the tests'
reference, and the CUDA kernel: one matmul and a stable sort).
"""

from __future__ import annotations

import torch

from silverrec.kernels.common import centroid_scores


def centroid_candidates_torch(queries: torch.Tensor, centroids: torch.Tensor, P: int) -> torch.Tensor:
    """The reference (device-generic): a stable descending sort of every score, first P."""
    return torch.sort(centroid_scores(centroids, queries), dim=1, descending=True, stable=True).indices[:, :P].contiguous()


torch.library.register_kernel("silverrec::centroid_candidates", "cuda", centroid_candidates_torch)
