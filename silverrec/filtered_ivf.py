"""`FilteredIVFIndex`: int8 IVF search with attribute filters, co-designed and selectivity-aware.

One forward call per request; every decision below is made per query, on the device, with no
host round trip (static shapes: `max_probe` candidate slots, unused ones set to -1):

1. Probe candidates: the `max_probe` best centroids by dot product (`[B, P]`, best first).
2. Filter only those clusters: `silverrec::bloom_filter_counts` runs each query's program over its
   candidates' row ranges -> bitmask `[B, P, Wc]` (scratch proportional to probed items; on CPU
   only each cluster's own words are evaluated, not the largest cluster's width)
3. ... and, in the same op, the per-cluster match counts (popcount inside each cluster's rows).
4. Widen: probe the smallest prefix of candidates holding >= max(`match_factor * k`, nprobe x
   mean cluster size) matching items (as many as the unfiltered search would scan), but at least
   `nprobe` clusters.
5. Switch: when even all `max_probe` candidates hold fewer matches than that, or scanning the
   needed clusters would touch more rows than the whole pool has matches (estimated from the
   candidates' match density), the query goes "unprobed": the filter runs over the whole pool
   and `silverrec::masked_topk` scans exactly the matching rows.
6. `silverrec::ivf_scan` scans the chosen clusters, dropping rows whose bit is 0 before top-k
   (k + k/4 + 16 results, a margin for Bloom false positives).
7. Verify: the "verify" program (positive terms on exact value-code planes where the features
   have them) is evaluated on the result rows only; false positives are dropped, the best k kept.
   The unprobed mask is computed with the verify program directly.

Modes (forward arg `mode`, int64 [B], one per query): AUTO (0, the above), PROBED (1: exactly `nprobe` clusters, the plain
co-designed search), UNPROBED (2: filter the whole pool, then exact scan; exact up to Bloom false
positives, for small pools or very selective filters).

Results are `(scores float32 [B, k], item_ids int64 [B, k])`, padded with -inf / -1 when fewer
than k items pass. Filter semantics (Bloom false positives, exact NOT) are in filter_program.py.
"""

from __future__ import annotations

import torch

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.*)
from silverrec.exact_index import rows_to_items
from silverrec.ivf_index import Int8IVFIndex
from silverrec.kernels.ivf_scan import bitmask_words

MODE_AUTO, MODE_PROBED, MODE_UNPROBED = 0, 1, 2
MODES = {"auto": MODE_AUTO, "probed": MODE_PROBED, "unprobed": MODE_UNPROBED}
DEFAULT_MATCH_FACTOR = 8  # probe until the probed clusters hold >= this many matches per result


class FilteredIVFIndex(Int8IVFIndex):
    """Filtered int8 IVF search (see module docstring).

    Buffers: those of `Int8IVFIndex` (codes, dim_scale/dim_offset, cluster_offsets, centroids,
    row_to_item) plus bits int64 [R, ceil(N / 64)], the filter row bank (Bloom rows + exact
    planes) in the same cluster-major row order.

    Example:
        >>> ops, rows = compile_batch(["genre = Drama"] * B, plan)
        >>> scores, ids = index(queries, 100, 32, ops, rows, 256, torch.zeros(B, dtype=torch.int64))
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
        match_factor: int = DEFAULT_MATCH_FACTOR,
        exact_cost_ratio: float = 1.0,
    ):
        super().__init__(codes, dim_scale, dim_offset, cluster_offsets, centroids, row_to_item)
        n = codes.shape[0]
        if bits.dim() != 2 or bits.shape[1] != (n + 63) // 64:
            raise ValueError(f"bits must be int64 [R, {(n + 63) // 64}], got {tuple(bits.shape)}")
        self.register_buffer("bits", bits.to(torch.int64).contiguous())
        self.window_words = max(1, bitmask_words(self.cluster_offsets))
        self.total_words = int(bits.shape[1])
        self.num_items = int(n)
        self.avg_cluster = max(1, int(n) // int(centroids.shape[0]))
        self.match_factor = int(match_factor)
        self.exact_cost_ratio = float(exact_cost_ratio)

    @classmethod
    def from_ivf(cls, ivf: Int8IVFIndex, bits: torch.Tensor, **kwargs) -> "FilteredIVFIndex":
        """Wrap an `Int8IVFIndex`'s buffers (same rows, same order) with a filter row bank."""
        return cls(ivf.codes, ivf.dim_scale, ivf.dim_offset, ivf.cluster_offsets, ivf.centroids, ivf.row_to_item, bits, **kwargs)

    def plan_probes(
        self, queries: torch.Tensor, k: int, nprobe: int, ops: torch.Tensor, rows: torch.Tensor, max_probe: int, mode: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1-5: (probes int64 [B, P] with -1 = unused, bitmask int64 [B, P, Wc], unprobed bool [B]).

        Requires 1 <= nprobe <= max_probe <= nlist (the predictor checks; no host sync here).
        """
        cand = torch.topk(queries @ self.centroids.t(), max_probe, dim=1).indices  # [B, P] best first
        lo = self.cluster_offsets[cand]
        hi = self.cluster_offsets[cand + 1]
        # one fused op: the filter on each candidate's own words, bits outside its rows cleared, and
        # the per-cluster match counts [B, P]
        bitmask, matches = torch.ops.silverrec.bloom_filter_counts(self.bits, ops, rows, lo, hi, self.window_words)
        cum = torch.cumsum(matches, dim=1)
        # enough matches for k, and at least as many rows as the unfiltered search at nprobe scans
        # (= the rows an unfiltered search scans at nprobe: the filtered top-k of a fraction s of the
        # pool lies about as far out as the unfiltered top-k/s, so the same match count is needed)
        target = torch.maximum(cum.new_full([1], nprobe * self.avg_cluster), cum.new_full([1], k * self.match_factor))
        need = (cum < target).sum(dim=1) + 1  # probes to reach the target (P + 1 if never)
        mode_t = mode.to(need.dtype)
        use = torch.where(mode_t == 1,  # MODE_PROBED (literal: TorchScript reads no globals)
                           torch.full_like(need, nprobe), need.clamp(min=nprobe, max=max_probe))
        slot = torch.arange(cand.shape[1], device=queries.device)[None, :]
        chosen = slot < use[:, None]
        sizes = hi - lo
        scanned = torch.where(chosen, sizes, torch.zeros_like(sizes)).sum(dim=1)  # rows the IVF scan touches
        cand_rows = sizes.sum(dim=1).clamp_min(1)
        est_total = cum[:, -1].to(torch.float32) * (self.num_items / cand_rows.to(torch.float32))
        auto = (cum[:, -1] < target) | (scanned.to(torch.float32) > est_total * self.exact_cost_ratio)
        unprobed = torch.where(mode_t == 0, auto, mode_t == 2)  # MODE_AUTO, MODE_UNPROBED
        probes = torch.where(chosen & ~unprobed[:, None], cand, torch.full_like(cand, -1))
        return probes, bitmask, unprobed

    def verify(self, vops: torch.Tensor, vrows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """bool [B, K]: the verify program (exact where the features have planes) on result rows
        int64 [B, K] (-1 = padding -> False). One single-word window per result row."""
        words = torch.ops.silverrec.bloom_filter(self.bits, vops, vrows, torch.where(rows >= 0, rows >> 6, rows), 1)
        return (((words[:, :, 0] >> (rows.clamp_min(0) & 63)) & 1) != 0) & (rows >= 0)

    def forward(
        self,
        queries: torch.Tensor,
        k: int,
        nprobe: int,
        ops: torch.Tensor,
        rows: torch.Tensor,
        vops: torch.Tensor,
        vrows: torch.Tensor,
        max_probe: int,
        mode: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """queries float32 [B, D]; (ops int64 [B, L], rows int64 [B, L, T]) the Bloom programs and
        (vops, vrows) the verify programs of the filters (filter_program.compile_batch with
        exact_positive False / True); 1 <= nprobe <= max_probe <= nlist; mode int64 [B]
        (MODE_AUTO / MODE_PROBED / MODE_UNPROBED per query)
        -> (scores float32 [B, k], item_ids int64 [B, k])."""
        probes, bitmask, unprobed = self.plan_probes(queries, k, nprobe, ops, rows, max_probe, mode)
        # per-dimension ranges folded into the query: score = int8-op score + constant (per query)
        folded, constant = self.fold(queries)
        one, zero = folded.new_ones(()), folded.new_zeros(())
        # Bloom false positives may take result slots: scan a margin, verify, keep the best k.
        k2 = k + k // 4 + 16
        s_ivf, r_ivf = torch.ops.silverrec.ivf_scan(
            folded, self.codes, one, zero, self.cluster_offsets, probes, k2, bitmask
        )
        ok = self.verify(vops, vrows, r_ivf)
        s_ivf = torch.where(ok, s_ivf, torch.full_like(s_ivf, float("-inf")))
        r_ivf = torch.where(ok, r_ivf, torch.full_like(r_ivf, -1))
        order = torch.sort(s_ivf, dim=1, descending=True, stable=True).indices[:, :k]
        s_ivf, r_ivf = torch.gather(s_ivf, 1, order), torch.gather(r_ivf, 1, order)
        # Unprobed queries: the verify program over the whole pool, then an exact scan of its rows.
        starts = torch.where(unprobed, torch.zeros_like(unprobed, dtype=torch.int64), torch.full_like(unprobed, -1, dtype=torch.int64))
        pool_mask = torch.ops.silverrec.bloom_filter(self.bits, vops, vrows, starts[:, None], self.total_words)
        s_ex, r_ex = torch.ops.silverrec.masked_topk(
            folded, self.codes, one, zero, pool_mask[:, 0], unprobed, k
        )
        scores = torch.where(unprobed[:, None], s_ex, s_ivf) + constant[:, None]
        rows_out = torch.where(unprobed[:, None], r_ex, r_ivf)
        return scores, rows_to_items(self.row_to_item, rows_out)
