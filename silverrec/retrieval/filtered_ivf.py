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
   (filter_program.estimate_matches) and sends the query unprobed (mode 2) when m x exact_cost_ratio
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

Modes (forward arg `mode`, int64 [B], one per query): AUTO (0, the above), PROBED (1: exactly `nprobe` clusters, the plain
co-designed search), UNPROBED (2: filter the whole pool, then exact scan; exact up to Bloom false
positives, for small pools or very selective filters; posting lists are used when they qualify).

Results are `(scores float32 [B, k], item_ids int64 [B, k])`, padded with -inf / -1 when fewer
than k items pass. Filter semantics (Bloom false positives, exact NOT) are in filter_program.py.
"""

from __future__ import annotations

from typing import Optional

import torch

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.*)
from silverrec.retrieval.ivf_index import Int8IVFIndex
from silverrec.kernels.ivf_scan import bitmask_words

MODE_AUTO, MODE_PROBED, MODE_UNPROBED = 0, 1, 2
MODES = {"auto": MODE_AUTO, "probed": MODE_PROBED, "unprobed": MODE_UNPROBED}
DEFAULT_MATCH_FACTOR = 8  # probe until the probed clusters hold >= this many matches per result


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
        self.avg_cluster = max(1, int(n) // int(centroids.shape[0]))
        self.match_factor = int(match_factor)
        self.exact_cost_ratio = float(exact_cost_ratio)

    @classmethod
    def from_ivf(cls, ivf: Int8IVFIndex, bits: torch.Tensor, **kwargs) -> "FilteredIVFIndex":
        """Wrap an `Int8IVFIndex`'s buffers (same rows, same order) with a filter row bank (and
        optionally post_rows / post_offsets / posting_limit)."""
        return cls(ivf.codes, ivf.dim_scale, ivf.dim_offset, ivf.cluster_offsets, ivf.centroids, ivf.row_to_item, bits,
                   residual=ivf.residual, **kwargs)

    def plan_probes(
        self,
        queries: torch.Tensor,
        k: int,
        nprobe: int,
        ops: torch.Tensor,
        rows: torch.Tensor,
        lists: torch.Tensor,
        max_probe: int,
        mode: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 0-5 in one op (`silverrec::filter_plan`): (probes int64 [B, P] with -1 = unused,
        bitmask int64 [B, P, Wc], route int64 [B]: 0 = probed IVF scan, 1 = whole pool then exact
        scan, 2 = posting lists).

        Requires 1 <= nprobe <= max_probe <= nlist (the predictor checks; no host sync here).
        """
        return torch.ops.silverrec.filter_plan(
            queries, self.centroids, self.cluster_offsets, self.bits, ops, rows, lists, self.post_sizes, mode,
            k, nprobe, max_probe, self.window_words, self.match_factor, self.avg_cluster, self.num_items,
            self.exact_cost_ratio, self.posting_limit,
        )

    def forward(
        self,
        queries: torch.Tensor,
        k: int,
        nprobe: int,
        ops: torch.Tensor,
        rows: torch.Tensor,
        vops: torch.Tensor,
        vrows: torch.Tensor,
        lists: torch.Tensor,
        max_probe: int,
        mode: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """queries float32 [B, D]; (ops int64 [B, L], rows int64 [B, L, T]) the Bloom programs,
        (vops, vrows) the verify programs and lists int64 [B, T2] the posting lists of the filters
        (filter_program.compile_request); 1 <= nprobe <= max_probe <= nlist; mode int64 [B]
        (MODE_AUTO / MODE_PROBED / MODE_UNPROBED per query)
        -> (scores float32 [B, k], item_ids int64 [B, k]).

        Steps 0-7 run as one op, `silverrec::filtered_ivf_search` (kernels/filtered_ivf_search.py:
        one C++ call on CPU, the composition of the per-step ops elsewhere)."""
        return torch.ops.silverrec.filtered_ivf_search(
            queries, self.codes, self.dim_scale, self.dim_offset, self.cluster_offsets, self.centroids, self.row_to_item,
            self.bits, self.post_rows, self.post_offsets, self.post_sizes, ops, rows, vops, vrows, lists, mode,
            k, nprobe, max_probe, self.window_words, self.match_factor, self.avg_cluster, self.num_items,
            self.exact_cost_ratio, self.posting_limit, 0, 0, self.residual,
        )
