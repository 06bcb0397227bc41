"""`FilteredIVFIndex`: int8 IVF search with attribute filters, co-designed and selectivity-aware.

One forward call per request, one op (`silverrec::filtered_ivf_search`: a single C++ call on CPU,
the composition of the per-step ops below on CUDA); every decision below is made per query, on
the device, with no host round trip (static shapes: `max_probe` candidate slots, unused ones -1).
Steps 0-5 are `silverrec::filter_plan`:

0. Posting lists: when the filter has a posting-list superset (`lists`, chosen at compile time from
   the manifest's value counts) of at most `posting_limit` rows, the query takes the posting route:
   the filter runs on those rows only and the survivors are scored exactly
   (`silverrec::filtered_topk`); steps 1-7 skip it. A very selective filter costs its list, not
   the centroids' neighbourhood or the pool.
0b. Selective filters without a posting list (ANDs of frequent values: country AND language AND
   category): the predictor estimates each filter's matches m from the manifest's value counts
   (filter_program.compile_estimates) and sends the query unprobed (mode 2) when m x exact_cost_ratio
   <= the rows the probed search would scan, max(nprobe x N / nlist, target x N / m), with step 4's
   target at density m / N (filtered_search.whole_pool_by_estimate):
   no centroid is scored, the filter runs over the pool on the values' own bit planes (one row per
   frequent value, publish/filtered_ivf.py value_planes: N / 64 words per term), and the passing
   rows are copied and scanned exactly (step 5's route, without its candidate evaluation).
1. Probe candidates: the `max_probe` best centroids by dot product (`[B, P]`, best first).
2. Filter only those clusters: `silverrec::bloom_filter_counts` runs each query's program over its
   candidates' row ranges -> bitmask `[B, P, Wc]` (scratch proportional to probed items; on CPU
   only each cluster's own words are evaluated, not the largest cluster's width)
3. ... and, in the same op, the per-cluster match counts (popcount inside each cluster's rows).
4. Widen: probe the smallest prefix of candidates holding >= target = `match_factor * k / sqrt(d)`
   matching items, d = the candidates' match density (their matches / their rows), but at least
   `nprobe` clusters. A selective filter's k nearest matches spread over more clusters than its
   k x match_factor nearest matches suggest, hence the 1 / sqrt(d) (1M x 96 Gaussian mixture, k
   100, 16 clusters of 976 rows: recall@100 0.956 at d = 8.6%, 0.929 at 6.2%, 0.917 at 5.1%; 0.95
   needed ~1,000 matches at 8.6%, ~1,900 at 6.2%, ~2,400 at 5.1%: benchmarks/filter.py --part
   conjunctions). Unfiltered (d = 1) the target is k x match_factor.
5. Switch: when even all `max_probe` candidates hold fewer matches than that, or scanning the
   needed clusters would touch more rows than the whole pool has matches x exact_cost_ratio
   (estimated from the candidates' match density), the query goes "unprobed": the filter runs over
   the whole pool
   and `silverrec::filtered_topk` scans exactly the matching rows (copied into a compact buffer
   up to half the pool; beyond that the pool is scanned through the mask).
6. `silverrec::ivf_scan` scans the chosen clusters, dropping rows whose bit is 0 before top-k
   (k + k/4 + 16 results, a margin for Bloom false positives).
7. Verify: the "verify" program (positive terms on exact value-code planes where the features
   have them) is evaluated on the ranked result rows only (`silverrec::verify_topk`, which stops
   once k rows passed); false positives are dropped, the best k kept. The unprobed and posting
   routes evaluate the verify program directly (`silverrec::filtered_topk`).

Modes (`mode`, int64 [B], one per query; kernels/constants.py): MODE_AUTO (the above), MODE_PROBED (exactly
`nprobe` clusters, the plain co-designed search), MODE_UNPROBED (filter the whole pool, then exact scan; exact up
to Bloom false positives, for small pools or very selective filters; posting lists are used when they qualify).

Results are `(scores float32 [B, k], item_ids int64 [B, k])`, padded with -inf / -1 when fewer
than k items pass. Filter semantics (Bloom false positives, exact NOT) are in filter_program.py.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.*)
from silverrec.kernels.constants import DEFAULT_MATCH_FACTOR, FILTERED_IVF_PARAMS, MODE_AUTO, MODE_PROBED, MODE_UNPROBED
from silverrec.kernels.ivf_scan import bitmask_words
from silverrec.retrieval.ivf_index import Int8IVFIndex

__all__ = ["FilteredIVFIndex", "MODES", "MODE_AUTO", "MODE_PROBED", "MODE_UNPROBED", "DEFAULT_MATCH_FACTOR"]
MODES = {"auto": MODE_AUTO, "probed": MODE_PROBED, "unprobed": MODE_UNPROBED}  # the request's names of the modes


class FilteredIVFIndex(Int8IVFIndex):
    """Filtered int8 IVF search (see module docstring).

    Buffers: those of `Int8IVFIndex` (codes, dim_scale/dim_offset, cluster_offsets, centroids,
    row_to_item) plus bits int64 [R, ceil(N / 64)], the filter row bank (Bloom rows + exact
    planes), and the posting lists post_rows int32 [E] / post_offsets int64 [V + 1]
    (publish/postings.py), all in the same cluster-major row order.

    Example:
        >>> filt = compile_request(["genre = Drama"] * B, plan)   # ops, rows, vops, vrows, lists
        >>> scores, ids = index(queries, 100, 32, *filt, 256, torch.zeros(B, dtype=torch.int64))
    """

    def __init__(
        self,
        codes: torch.Tensor,
        dim_scale: torch.Tensor,
        dim_offset: torch.Tensor,
        cluster_offsets: torch.Tensor,
        centroids: torch.Tensor,
        row_to_item: torch.Tensor,
        bits: torch.Tensor,
        post_rows: Optional[torch.Tensor] = None,
        post_offsets: Optional[torch.Tensor] = None,
        posting_limit: int = 0,
        match_factor: int = DEFAULT_MATCH_FACTOR,
        exact_cost_ratio: float = 1.0,
        residual: bool = False,
    ):
        super().__init__(codes, dim_scale, dim_offset, cluster_offsets, centroids, row_to_item, residual)
        n = codes.shape[0]
        if bits.dim() != 2 or bits.shape[1] != (n + 63) // 64:
            raise ValueError(f"bits must be int64 [R, {(n + 63) // 64}], got {tuple(bits.shape)}")
        self.register_buffer("bits", bits.to(torch.int64).contiguous())
        if post_rows is None or post_offsets is None:  # no posting lists: the route is never taken
            post_rows, post_offsets = torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
        if post_offsets.dim() != 1 or post_offsets.numel() < 1 or int(post_offsets[-1]) != post_rows.numel():
            raise ValueError(f"post_offsets must be int64 [V + 1] ending at len(post_rows) = {post_rows.numel()}")
        self.register_buffer("post_rows", post_rows.to(torch.int32).contiguous())
        self.register_buffer("post_offsets", post_offsets.to(torch.int64).contiguous())
        # list lengths with a trailing 0 for unused slots (lists = -1)
        self.register_buffer("post_sizes", torch.cat([post_offsets[1:] - post_offsets[:-1], post_offsets.new_zeros(1)]))
        self.posting_limit = int(posting_limit)
        self.window_words = max(1, bitmask_words(self.cluster_offsets))
        self.total_words = int(bits.shape[1])
        self.num_items = int(n)
        self.match_factor = int(match_factor)
        self.exact_cost_ratio = float(exact_cost_ratio)
        # the integer parameters as the filtered search ops take them, in FILTERED_IVF_PARAMS order
        self.filtered_params: List[int] = [int(getattr(self, name)) for name in FILTERED_IVF_PARAMS]

    @classmethod
    def from_ivf(cls, ivf: Int8IVFIndex, bits: torch.Tensor, **kwargs) -> "FilteredIVFIndex":
        """Wrap an `Int8IVFIndex`'s buffers (same rows, same order) with a filter row bank (and
        optionally post_rows / post_offsets / posting_limit)."""
        return cls(ivf.codes, ivf.dim_scale, ivf.dim_offset, ivf.cluster_offsets, ivf.centroids, ivf.row_to_item, bits,
                   residual=ivf.residual, **kwargs)

    def filtered_index_tensors(self, item_ids: bool = True) -> List[Tensor]:
        """The index as the filtered search ops take it (kernels/constants.py FILTERED_IVF_TENSORS order: the
        IVF's tensors, `index_tensors`, then the filter indexes')."""
        return [self.codes, self.dim_scale, self.dim_offset, self.cluster_offsets, self.centroids,
                self.row_to_item if item_ids else self.no_row_map, self.bits, self.post_rows, self.post_offsets,
                self.post_sizes]

    def plan_probes(self, queries: Tensor, program: List[Tensor], mode: Tensor, k: int, nprobe: int,
                    max_probe: int) -> Tuple[Tensor, Tensor, Tensor]:
        """Steps 0-5 in one op (`silverrec::filter_plan`): (probes int64 [B, P] with -1 = unused,
        bitmask int64 [B, P, Wc], route int64 [B]: ROUTE_PROBED (probed IVF scan), ROUTE_WHOLE_POOL (whole pool
        then exact scan), ROUTE_POSTING (posting lists), kernels/constants.py). program, mode: as `filtered_search`.

        Requires 1 <= nprobe <= max_probe <= nlist (the predictor checks; no host sync here).
        """
        return torch.ops.silverrec.filter_plan(queries, self.filtered_index_tensors(), self.filtered_params,
                                               self.exact_cost_ratio, program, mode, k, nprobe, max_probe)

    def filtered_search_args(
        self, queries: Tensor, program: List[Tensor], mode: Tensor, k: int, nprobe: int, max_probe: int,
        rescore_margin: int = 0, rescore_max_k: int = 0, item_ids: bool = True,
    ) -> Tuple[Tensor, List[Tensor], List[int], float, List[Tensor], Tensor, int, int, int, int, int]:
        """`silverrec::filtered_ivf_search`'s arguments (kernels/filtered_ivf_search.py): the one place they are
        built."""
        return (queries, self.filtered_index_tensors(item_ids), self.filtered_params, self.exact_cost_ratio, program,
                mode, k, nprobe, max_probe, rescore_margin, rescore_max_k)

    def filtered_search(
        self, queries: Tensor, program: List[Tensor], mode: Tensor, k: int, nprobe: int, max_probe: int,
        rescore_margin: int = 0, rescore_max_k: int = 0, item_ids: bool = True,
    ) -> Tuple[Tensor, Tensor]:
        """queries float32 [B, D]; program [ops, rows, vops, vrows, lists] (kernels/constants.py PROGRAM_TENSORS:
        the Bloom programs ops int64 [B, L] / rows int64 [B, L, T], the verify programs vops / vrows and the
        posting lists int64 [B, T2] of the filters, filter_program.compile_request; one row per query, or one per
        request of B / R consecutive queries); mode int64 [B] (MODE_AUTO / MODE_PROBED / MODE_UNPROBED per query);
        1 <= nprobe <= max_probe <= nlist -> (scores float32 [B, k], item_ids int64 [B, k], or rows with item_ids
        False). rescore_margin > 0 and k <= rescore_max_k: every route finds k + rescore_margin rows, re-scored by
        the float query (kernels/rescore_rows.py).

        Steps 0-7 run as one op, `silverrec::filtered_ivf_search` (kernels/filtered_ivf_search.py: one C++ call on
        CPU, the composition of the per-step ops elsewhere)."""
        return torch.ops.silverrec.filtered_ivf_search(*self.filtered_search_args(
            queries, program, mode, k, nprobe, max_probe, rescore_margin, rescore_max_k, item_ids))

    def forward(
        self,
        queries: Tensor,
        k: int,
        nprobe: int,
        ops: Tensor,
        rows: Tensor,
        vops: Tensor,
        vrows: Tensor,
        lists: Tensor,
        max_probe: int,
        mode: Tensor,
    ) -> Tuple[Tensor, Tensor]:
        """`filtered_search` with the request's programs as separate tensors (filter_program.compile_request's
        order) -> (scores float32 [B, k], item_ids int64 [B, k])."""
        return self.filtered_search(queries, [ops, rows, vops, vrows, lists], mode, k, nprobe, max_probe)
