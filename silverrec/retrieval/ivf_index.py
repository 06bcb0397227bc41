"""`Int8IVFIndex`: inverted-file ANN search by inner product over cluster-major int8 codes."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.*)
from silverrec.kernels.common import cluster_of_rows
from silverrec.kernels.constants import IVF_PARAMS
from silverrec.kernels.ivf_scan import bitmask_words
from silverrec.retrieval.item_ids import compact_item_ids, rows_to_items


def fold_queries(queries: torch.Tensor, dim_scale: torch.Tensor, dim_offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """<q, dim_scale * code + dim_offset> = <q * dim_scale, code> + <q, dim_offset>.

    float [B, D] -> (float32 [B, D] queries for the int8 ops (called with scale 1, offset 0),
    float32 [B] per-query constant to add to their scores).
    """
    q = queries.float()
    return q * dim_scale, q @ dim_offset


class Int8IVFIndex(nn.Module):
    """IVF index as tensors: probe = top-`nprobe` centroids by dot product, scan = `silverrec::ivf_scan`.

    Buffers:
        codes: int8 [N, D] item codes sorted cluster-major, item ~= dim_scale * code + dim_offset, or
            with `residual` (publish's default, as Faiss IVF-SQ8's by_residual) item ~= centroid of its
            cluster + dim_scale * code + dim_offset: the codes then quantise the item's offset from its
            centroid, a narrower range per dimension, and every scan adds <q, centroid> per cluster.
        dim_scale, dim_offset: float32 [D] per-dimension quantisation ranges (`quantize_per_dim`),
            folded into the query (`fold`) so that the scan stays int8 x int8 -> int32.
        cluster_offsets: int64 [nlist + 1]; cluster c holds rows [off[c], off[c + 1]) (no padding).
        centroids: float32 [nlist, D] coarse quantiser.
        row_to_item: int32/int64 [N] external item id of each row (`compact_item_ids`).

    `probe` and `scan` are public so that a caller (e.g. the Bloom filter) can evaluate something on
    the probed clusters and hand a bitmask to the scan:

        >>> probes = index.probe(queries, nprobe)                 # int64 [B, nprobe]
        >>> scores, item_ids = index.scan(queries, probes, k, bitmask)

    Example:
        >>> scores, item_ids = index(queries, 100, 32)            # [B, 100] each
    """

    def __init__(
        self,
        codes: torch.Tensor,
        dim_scale: torch.Tensor,
        dim_offset: torch.Tensor,
        cluster_offsets: torch.Tensor,
        centroids: torch.Tensor,
        row_to_item: torch.Tensor,
        residual: bool = False,
    ):
        super().__init__()
        if codes.dim() != 2 or centroids.dim() != 2 or centroids.shape[1] != codes.shape[1]:
            raise ValueError(f"codes [N, D] and centroids [nlist, D] disagree: {tuple(codes.shape)} vs {tuple(centroids.shape)}")
        if cluster_offsets.shape != (centroids.shape[0] + 1,):
            raise ValueError(f"cluster_offsets must be [{centroids.shape[0] + 1}], got {tuple(cluster_offsets.shape)}")
        if row_to_item.shape != (codes.shape[0],):
            raise ValueError(f"row_to_item must be [{codes.shape[0]}], got {tuple(row_to_item.shape)}")
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        dim = codes.shape[1]
        self.register_buffer("dim_scale", dim_scale.to(torch.float32).expand(dim).contiguous())
        self.register_buffer("dim_offset", dim_offset.to(torch.float32).expand(dim).contiguous())
        self.register_buffer("cluster_offsets", cluster_offsets.to(torch.int64).contiguous())
        self.register_buffer("centroids", centroids.to(torch.float32).contiguous())
        self.register_buffer("row_to_item", compact_item_ids(row_to_item))
        self.residual = bool(residual)  # codes quantise item - centroid (an index constant of the program)
        # an index constant (int attribute, frozen into the program): lets the CUDA scan size its key
        # columns without reading cluster sizes from the device, so a CUDA graph can capture `scan`
        self.window_words = bitmask_words(self.cluster_offsets)
        # the search ops' zero-length row map: they return rows (for stages that read rows); not saved
        self.register_buffer("no_row_map", torch.zeros(0, dtype=torch.int32), persistent=False)
        # the index's integer parameters as the search ops take them, in IVF_PARAMS order (kernels/constants.py)
        self.ivf_params: List[int] = [int(getattr(self, name)) for name in IVF_PARAMS]

    @property
    def nlist(self) -> int:
        return int(self.centroids.shape[0])

    def fold(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-dimension ranges folded into the query: float [B, D] -> (queries for the int8 ops
        float32 [B, D], per-query score constant float32 [B]); score = op score + constant."""
        return fold_queries(queries, self.dim_scale, self.dim_offset)

    @torch.jit.unused
    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """The items the codes stand for: rows int64 [M] -> float32 [M, D] (the centroid added back for
        residual codes). What exact references and re-encoding (publish/update.py) read."""
        x = self.codes[rows].float() * self.dim_scale + self.dim_offset
        if self.residual:
            x += self.centroids[cluster_of_rows(self.cluster_offsets, rows)]
        return x

    def probe(self, queries: torch.Tensor, nprobe: int) -> torch.Tensor:
        """queries float [B, D] -> probes int64 [B, nprobe]: cluster ids by descending dot product, ties to the
        lower cluster (silverrec::centroid_candidates, the op that picks silverrec::filter_plan's)."""
        return torch.ops.silverrec.centroid_candidates(queries.float(), self.centroids, nprobe)

    def scan(
        self, queries: torch.Tensor, probes: torch.Tensor, k: int, bitmask: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scan the probed clusters (probes int64 [B, P], -1 = empty slot; optional bitmask int64
        [B, P, Wc], see `silverrec::ivf_scan`) -> (scores float32 [B, k], item_ids int64 [B, k]),
        padded with item id -1 and score -inf when fewer than k items are probed and allowed."""
        folded, constant = self.fold(queries)
        one, zero = folded.new_ones(()), folded.new_zeros(())
        scores, rows = torch.ops.silverrec.ivf_scan(
            folded, self.codes, one, zero, self.cluster_offsets, probes, k, bitmask, self.window_words,
            self.centroids if self.residual else None, queries.float() if self.residual else None,
        )
        return scores + constant[:, None], rows_to_items(self.row_to_item, rows)

    def index_tensors(self, item_ids: bool = True) -> List[Tensor]:
        """The index as the search ops take it (kernels/constants.py IVF_TENSORS order); item_ids False: a
        zero-length row map, and the ops return rows instead of item ids."""
        return [self.codes, self.dim_scale, self.dim_offset, self.cluster_offsets, self.centroids,
                self.row_to_item if item_ids else self.no_row_map]

    def search_args(self, queries: Tensor, k: int, nprobe: int, rescore_margin: int = 0, rescore_max_k: int = 0,
                    item_ids: bool = True) -> Tuple[Tensor, List[Tensor], List[int], int, int, int, int]:
        """`silverrec::ivf_search`'s arguments (kernels/filtered_ivf_search.py): the one place they are built."""
        return queries.float(), self.index_tensors(item_ids), self.ivf_params, k, nprobe, rescore_margin, rescore_max_k

    def search(self, queries: Tensor, k: int, nprobe: int, rescore_margin: int = 0, rescore_max_k: int = 0,
               item_ids: bool = True) -> Tuple[Tensor, Tensor]:
        """queries float [B, D], k >= 1, 1 <= nprobe <= nlist -> (scores float32 [B, k], item_ids int64 [B, k],
        or rows with item_ids False), padded with -inf / -1: `scan` of `probe` as one op, `silverrec::ivf_search`
        (one C++ call on CPU: the same results as the two ops without their per-step tensor work). With
        rescore_margin > 0 and k <= rescore_max_k, the scan's top k + rescore_margin rows re-scored by the float
        query (kernels/rescore_rows.py)."""
        return torch.ops.silverrec.ivf_search(*self.search_args(queries, k, nprobe, rescore_margin, rescore_max_k,
                                                                item_ids))

    def forward(self, queries: Tensor, k: int, nprobe: int) -> Tuple[Tensor, Tensor]:
        """queries float [B, D], k >= 1, 1 <= nprobe <= nlist -> (scores float32 [B, k], item_ids int64 [B, k])
        (`search`)."""
        return self.search(queries, k, nprobe)
