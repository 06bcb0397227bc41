"""Triton kernel for `silverrec::filtered_topk` on CUDA: filter, then exact int8 top-k, no `[B, N]`.

Candidates of query b (contract in kernels/filtered_topk.py):
- route 1 (`lists[b, 0] == NO_LISTS`): every row of the pool. A program walks tiles of BLOCK words;
  the filter program runs once per word (`bloom_filter_triton.program_words`, the evaluator of
  `silverrec::bloom_filter`), then each non-zero word's 64 rows are scored: rows in words the
  filter clears cost one bank read per program instruction, never a code read.
- route 2 (posting lists): positions [0, ncand[b]) of the concatenation of the query's lists,
  ncand[b] = min(their total length, max_candidates). Position -> (slot, row) by a walk over the
  T2 slots; a row also found in an earlier slot (binary search: lists are ascending) is dropped,
  so the union counts each row once. The program runs per row (one word per lane).
- inactive queries: none (all padding).
Passing rows are scored with int8 `tl.dot` and int32 accumulation (the query broadcast over the 16
columns tl.dot needs, as in ivf_scan_triton.py), exactly like `silverrec::ivf_scan`.

Selection: a radix select on the value v = (score + SOFF) << RB | (2**RB - 1 - row), SOFF =
127 * 128 * D (so score + SOFF >= 0) and RB = bits of N - 1. v orders rows exactly like the output
keys (score descending, ties to the lower row) and is unique per row, so a threshold on v splits
the rows exactly, ties included. Pass i (digits of DIGIT bits from the top) histograms digit i
over the rows whose higher digits equal the query's prefix; on the device, per query, the digit
holding the k-th best row extends the prefix. Once the rows at or above the prefix fit the buffer
(n_above + n_in_bin <= CAP = k + max(k, MIN_SLACK)) the query is resolved: later passes skip it
(its program loop is empty; no host synchronisation) and a last pass appends every row with
v >= prefix << shift (one atomic counter per query and tile, tl.cumsum for the slots) to keys
[B, CAP]; one torch.topk makes keys [B, k]. Every query is resolved after the last digit (v is
unique). The first digit holds the scores' top 16 bits, so the bin at the k-th best row is narrow
(64 score units at D = 96): on 1M x 96 int8 codes, batch 16, k 100 and 4096, selectivity 100% to
0.1%, every query was resolved by the first digit, i.e. 2 scans of its passing rows (one
histogram, one compaction; benchmarks/filtered_topk_passes.py). Many exact score ties (few-valued
codes) take more passes: ceil((SB + RB) / DIGIT) + 1 scans at most (SB, RB: bits of the score
range and of N).

Residual codes (optional `bias` int32 [B, nlist] in [-BIAS_BOUND, 0] with `cluster_offsets`): a row
r of cluster c scores dot + bias[b, c] (ranked, and in the keys), c found in the kernel by a binary
search of r over cluster_offsets (bit length of nlist steps per tile: no host synchronisation,
nothing sized by N). The score range grows by BIAS_BOUND and SOFF with it: at D = 128 the value
takes 31 + RB bits (22 + RB without bias), 58 bits at N = 100M (RB = 27).

Why not per-chunk key buffers merged by topk (as a plain exact scan would): [B, chunk] keys written per
chunk and N / chunk topk launches over [B, k + chunk]; here nothing but [B, 2**DIGIT] counts and
[B, CAP] keys is written, and no sort is larger than CAP.

Device memory (`workspace_shapes`): hist int32 [B, 2**DIGIT], buffer int64 [B, CAP], per-program
stack scratch int64 [B, SPLITS, L + 1, BLOCK] (SPLITS programs per query, at most
TARGET_PROGRAMS / B), a few [B] vectors: nothing proportional to N, nor to N / 64 words.
Runs on CPU tensors under TRITON_INTERPRET=1 (tests/test_filtered_topk_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from silverrec.kernels import constants
from silverrec.kernels.bloom_filter_triton import program_words
from silverrec.kernels.constants import BIAS_FLOOR, EMPTY_KEY, NO_LISTS
from silverrec.kernels.ivf_scan_triton import row_scores

DIGIT = 16  # bits per radix pass: 65536 bins per query
BLOCK = 64  # rows per scored tile (one bank word) and words per route-1 tile
TARGET_PROGRAMS = 1024  # programs per launch (B x SPLITS), enough to fill an H100's 132 SMs
MIN_SLACK = 256  # buffer rows beyond k for the boundary bin
BIAS_BOUND = -BIAS_FLOOR  # residual codes: bias[b, c] in [-BIAS_BOUND, 0] (kernels/common.py cluster_bias)
NO_ROW = tl.constexpr(constants.NO_ROW)  # no row (kernels/constants.py)


@triton.jit
def _posting_rows(post_rows_ptr, post_off_ptr, lists_ptr, b, pos, inb, T2, V, NITER: tl.constexpr):
    """Rows int64 [BLOCK] and ok bool [BLOCK] for positions `pos` of query b's concatenated lists.

    ok is False past the lists, for unused slots (-1, or ids >= V) and for a row that an earlier
    slot also holds (the union keeps its first copy).
    """
    rows = tl.zeros_like(pos) + NO_ROW
    slot = tl.zeros_like(pos) + T2
    cum = tl.zeros_like(pos)
    for t in range(0, T2):
        lid = tl.load(lists_ptr + b * T2 + t)
        used = (lid >= 0) & (lid < V)
        lid = tl.where(used, lid, 0)
        lo = tl.load(post_off_ptr + lid)
        size = tl.where(used, tl.load(post_off_ptr + lid + 1) - lo, 0)
        here = inb & (pos >= cum) & (pos < cum + size)
        r = tl.load(post_rows_ptr + lo + pos - cum, mask=here, other=NO_ROW)
        rows = tl.where(here, r.to(tl.int64), rows)
        slot = tl.where(here, t, slot)
        cum += size
    dup = rows < 0
    for t in range(0, tl.max(tl.where(dup, 0, slot), axis=0)):  # earlier slots of the tile's rows
        lid = tl.load(lists_ptr + b * T2 + t)
        used = (lid >= 0) & (lid < V)
        lid = tl.where(used, lid, 0)
        lo = tl.load(post_off_ptr + lid)
        size = tl.where(used, tl.load(post_off_ptr + lid + 1) - lo, 0)
        a = tl.zeros_like(pos)
        z = tl.zeros_like(pos) + size
        for _ in tl.static_range(NITER):  # lower bound of the row in list t
            live = a < z
            mid = (a + z) >> 1
            val = tl.load(post_rows_ptr + lo + mid, mask=live, other=0).to(tl.int64)
            a = tl.where(live & (val < rows), mid + 1, a)
            z = tl.where(live & (val >= rows), mid, z)
        hit = tl.load(post_rows_ptr + lo + a, mask=a < size, other=NO_ROW).to(tl.int64) == rows
        dup = dup | (hit & (a < size) & (t < slot))
    return tl.maximum(rows, 0), ~dup


@triton.jit
def _cluster_bias(coff_ptr, bias_ptr, b, rows, ok, NLIST, CITER: tl.constexpr):
    """int64 [BLOCK]: bias[b, c] of the cluster c of each row int64 [BLOCK] (lanes `ok`; others 0).

    c = the last cluster with off[c] <= row (so empty clusters are skipped), by a binary search of
    every lane over off[0, NLIST): CITER = bit length of NLIST steps, one gather each.
    """
    a = tl.zeros_like(rows)
    z = tl.zeros_like(rows) + NLIST
    for _ in tl.static_range(CITER):  # a = number of clusters c with off[c] <= row
        live = ok & (a < z)
        mid = (a + z) >> 1
        val = tl.load(coff_ptr + mid, mask=live, other=0)
        a = tl.where(live & (val <= rows), mid + 1, a)
        z = tl.where(live & (val > rows), mid, z)
    return tl.load(bias_ptr + b * NLIST + a - 1, mask=ok & (a > 0), other=0).to(tl.int64)


@triton.jit
def _select_rows(
    q_ptr, x_ptr, b, rows, ok, D, SOFF, RB, RMASK, prefix, shift_hi, shift, vmin,
    hist_ptr, count_ptr, buf_ptr, CAP, coff_ptr, bias_ptr, NLIST,
    COMPACT: tl.constexpr, NBINS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, CITER: tl.constexpr,
):
    """Score rows int64 [BLOCK] (lanes `ok`) against query b, plus their clusters' bias if HAS_BIAS;
    histogram or compact them (module docstring)."""
    score = row_scores(q_ptr, x_ptr, b, rows, ok, D, D, D, BLOCK, BLOCK_D).to(tl.int64)
    if HAS_BIAS:
        score += _cluster_bias(coff_ptr, bias_ptr, b, rows, ok, NLIST, CITER)
    v = ((score + SOFF) << RB) | (RMASK - rows)
    if COMPACT:
        sel = ok & (v >= vmin)
        n_sel = tl.sum(sel.to(tl.int32), axis=0)
        base = tl.atomic_add(count_ptr + b, n_sel)
        at = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        keys = score * 4294967296 + (4294967295 - rows)
        tl.store(buf_ptr + b * CAP + at, keys, mask=sel & (at < CAP))
    else:
        sel = ok & ((v >> shift_hi) == prefix)
        digit = (v >> shift) - (prefix << (shift_hi - shift))
        tl.atomic_add(hist_ptr + b * NBINS + digit, 1, mask=sel)


@triton.jit
def _filtered_scan_bias_kernel(
    q_ptr,  # int8 [B, D] quantised queries
    x_ptr,  # int8 [N, D] codes
    bits_ptr,  # int64 [R, W] filter row bank
    ops_ptr,  # int64 [B, L] filter programs
    prog_ptr,  # int64 [B, L, T]
    post_rows_ptr,  # int32 [E] posting lists
    post_off_ptr,  # int64 [V + 1]
    lists_ptr,  # int64 [B, T2]
    ncand_ptr,  # int64 [B] candidates: N (route 1), list positions (route 2), 0 (skip the query)
    prefix_ptr,  # int64 [B] histogram pass: rows with v >> shift_hi == prefix
    vmin_ptr,  # int64 [B] compaction pass: rows with v >= vmin
    hist_ptr,  # int32 [B, NBINS]
    count_ptr,  # int32 [B] rows appended per query
    buf_ptr,  # int64 [B, CAP] keys
    scratch_ptr,  # int64 [B, SPLITS, L + 1, BLOCK] program stacks
    D, W, L, T, T2, V, CAP, SPLITS, SOFF, RB, RMASK, shift_hi, shift, NO_LISTS,
    coff_ptr,  # int64 [NLIST + 1] cluster offsets (ignored unless HAS_BIAS)
    bias_ptr,  # int32 [B, NLIST] per-(query, cluster) score terms (ignored unless HAS_BIAS)
    NLIST,
    COMPACT: tl.constexpr,
    NITER: tl.constexpr,
    NBINS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CITER: tl.constexpr,  # binary search steps over the cluster offsets: bit length of NLIST
):
    """Program (b, s) takes tiles s, s + SPLITS, ... of query b's candidates (module docstring)."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.load(ncand_ptr + b)
    whole = tl.load(lists_ptr + b * T2) == NO_LISTS
    prefix = tl.load(prefix_ptr + b)
    vmin = tl.load(vmin_ptr + b)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    all_lanes = lane >= 0
    stack = scratch_ptr + (b * SPLITS + s).to(tl.int64) * (L + 1) * BLOCK  # this program's [L + 1, BLOCK]
    scratch = stack + lane
    if whole:  # route 1: the program per word, then the 64 rows of each non-zero word
        for t in range(s, tl.cdiv(tl.cdiv(n, 64), BLOCK), SPLITS):
            widx = t * BLOCK + lane
            words = program_words(bits_ptr, W, ops_ptr, prog_ptr, b, L, T, widx, widx < W, scratch, BLOCK, all_lanes, BLOCK)
            tl.store(scratch + L * BLOCK, tl.where(widx < W, words, 0))  # slot L: the tile's words (NOT / TRUE set bits past W)
            tl.debug_barrier()
            for w in range(0, BLOCK):
                word = tl.load(stack + L * BLOCK + w)
                if word != 0:
                    rows = (t * BLOCK + w) * 64 + lane
                    ok = (((word >> lane) & 1) != 0) & (rows < n)
                    _select_rows(
                        q_ptr, x_ptr, b, tl.minimum(rows, n - 1), ok, D, SOFF, RB, RMASK, prefix, shift_hi, shift,
                        vmin, hist_ptr, count_ptr, buf_ptr, CAP, coff_ptr, bias_ptr, NLIST,
                        COMPACT, NBINS, BLOCK, BLOCK_D, HAS_BIAS, CITER,
                    )
            tl.debug_barrier()  # every lane has read slot L before the next tile writes it
    else:  # route 2: list positions; the program per row
        for t in range(s, tl.cdiv(n, BLOCK), SPLITS):
            pos = t * BLOCK + lane
            rows, ok = _posting_rows(post_rows_ptr, post_off_ptr, lists_ptr, b, pos, pos < n, T2, V, NITER)
            words = program_words(bits_ptr, W, ops_ptr, prog_ptr, b, L, T, rows >> 6, ok, scratch, BLOCK, all_lanes, BLOCK)
            ok = ok & (((words >> (rows & 63)) & 1) != 0)
            if tl.max(ok.to(tl.int32), axis=0) > 0:
                _select_rows(
                    q_ptr, x_ptr, b, rows, ok, D, SOFF, RB, RMASK, prefix, shift_hi, shift,
                    vmin, hist_ptr, count_ptr, buf_ptr, CAP, coff_ptr, bias_ptr, NLIST,
                    COMPACT, NBINS, BLOCK, BLOCK_D, HAS_BIAS, CITER,
                )


@triton.jit
def _filtered_scan_kernel(
    q_ptr, x_ptr, bits_ptr, ops_ptr, prog_ptr, post_rows_ptr, post_off_ptr, lists_ptr, ncand_ptr, prefix_ptr,
    vmin_ptr, hist_ptr, count_ptr, buf_ptr, scratch_ptr,
    D, W, L, T, T2, V, CAP, SPLITS, SOFF, RB, RMASK, shift_hi, shift, NO_LISTS,
    COMPACT: tl.constexpr,
    NITER: tl.constexpr,
    NBINS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """`_filtered_scan_bias_kernel` without bias (the same code): the kernel of the search without
    residual codes, its signature unchanged."""
    _filtered_scan_bias_kernel(
        q_ptr, x_ptr, bits_ptr, ops_ptr, prog_ptr, post_rows_ptr, post_off_ptr, lists_ptr, ncand_ptr, prefix_ptr,
        vmin_ptr, hist_ptr, count_ptr, buf_ptr, scratch_ptr,
        D, W, L, T, T2, V, CAP, SPLITS, SOFF, RB, RMASK, shift_hi, shift, NO_LISTS, lists_ptr, lists_ptr, 0,
        COMPACT, NITER, NBINS, BLOCK, BLOCK_D, False, 1,
    )


def workspace_shapes(batch: int, prog_len: int, k: int, splits: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the device buffers `filtered_keys_triton` allocates (none depends on N).

    hist int32 [B, 2**DIGIT], keys buffer int64 [B, k + slack], program stacks int64
    [B, splits, L + 1, BLOCK], and per-query vectors [B] (ncand, prefix, vmin, n_above, done, count).
    """
    return {
        "hist": (batch, 1 << DIGIT),
        "buf": (batch, k + max(k, MIN_SLACK)),
        "scratch": (batch, splits, prog_len + 1, BLOCK),
        "per_query": (batch,),
    }


def value_bits(d: int, n: int, has_bias: bool) -> tuple[int, int, int]:
    """(SOFF, RB, total bits) of the selection value (score + SOFF) << RB | (2**RB - 1 - row) at D = d,
    N = n: |dot| <= 127 * 128 * d, and with residual codes a bias down to -BIAS_BOUND below that."""
    smax = 127 * 128 * d
    soff = smax + (BIAS_BOUND if has_bias else 0)  # score + soff >= 0
    rb = max(n - 1, 1).bit_length()
    return soff, rb, (soff + smax).bit_length() + rb


def _select_digit(hist, k, cap, width, shift, prefix, n_above, done, vmin):
    """One radix step per query, on the device: extend the prefix by the digit holding the k-th best row.

    hist int32 [B, NBINS] counts of the rows matching the prefix, by their next digit (`width`
    bits, the digit's lowest bit at `shift`); prefix / n_above (rows above the prefix) / vmin int64
    [B], done bool [B]. Returns the updated (prefix, n_above, done, vmin).
    """
    h = hist.to(torch.int64)
    at_or_above = h.flip(1).cumsum(1).flip(1)  # [B, NBINS]: rows in bins >= j
    need = (k - n_above)[:, None]
    j = ((at_or_above >= need).sum(1) - 1).clamp_min(0)[:, None]  # fewer than k rows: every bin (j = 0)
    in_bin = h.gather(1, j)[:, 0]
    above = n_above + at_or_above.gather(1, j)[:, 0] - in_bin
    new_prefix = (prefix << width) | j[:, 0]
    resolved = ~done & (above + in_bin <= cap)
    vmin = torch.where(resolved, new_prefix << shift, vmin)
    return torch.where(done, prefix, new_prefix), torch.where(done, n_above, above), done | resolved, vmin


def filtered_keys_triton(
    qcodes, codes, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k: int, max_candidates: int,
    splits: int | None = None, cluster_offsets: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k sort keys int64 [B, k] (descending, EMPTY_KEY padding) of the filtered exact search.

    qcodes int8 [B, D] (quantised queries); the other arguments as `silverrec::filtered_topk`
    (validated by the op). `splits`: programs per query (default: TARGET_PROGRAMS / B, at most the
    largest query's tiles). Residual codes: bias int32 [B, nlist] in [-BIAS_BOUND, 0] with
    cluster_offsets int64 [nlist + 1] (cluster-major rows, off[0] = 0, off[nlist] = N) adds
    bias[b, c] to the dot of every row of cluster c before the selection. Static shapes, no host
    synchronisation.
    """
    qcodes, codes, bits, ops, prog_rows = (t.contiguous() for t in (qcodes, codes, bits, ops, prog_rows))
    post_rows, post_offsets, lists = post_rows.contiguous(), post_offsets.contiguous(), lists.contiguous()
    B, D = qcodes.shape
    N, L, T, T2, V = codes.shape[0], ops.shape[1], prog_rows.shape[2], lists.shape[1], post_offsets.numel() - 1
    dev = codes.device
    has_bias = bias is not None
    if has_bias and (cluster_offsets is None or tuple(bias.shape) != (B, cluster_offsets.numel() - 1)):
        raise ValueError("filtered_topk: bias must be [B, nlist] with cluster_offsets [nlist + 1]")
    soff, rb, total_bits = value_bits(D, N, has_bias)
    if total_bits > 63:
        raise ValueError(f"filtered_topk: D = {D} and N = {N} do not fit a 63-bit (score, row) value")
    # candidates per query: N (whole pool), its lists' total length (posting route), 0 (inactive)
    whole = lists[:, 0] == NO_LISTS
    used = (lists >= 0) & (lists < V)
    sizes = post_offsets[1:] - post_offsets[:-1]
    lengths = sizes[torch.where(used, lists, 0)] if V > 0 else torch.zeros_like(lists)
    listed = torch.where(used, lengths, 0).sum(1).clamp(max=max(int(max_candidates), 0))
    ncand = torch.where(active, torch.where(whole, N, listed), 0)

    if splits is None:
        tiles = max(triton.cdiv(triton.cdiv(N, 64), BLOCK), triton.cdiv(max(int(max_candidates), 1), BLOCK))
        splits = max(1, min(tiles, TARGET_PROGRAMS // max(B, 1)))
    shapes = workspace_shapes(B, L, k, splits)
    cap = shapes["buf"][1]
    hist = torch.zeros(shapes["hist"], dtype=torch.int32, device=dev)
    buf = torch.full(shapes["buf"], EMPTY_KEY, dtype=torch.int64, device=dev)
    scratch = torch.empty(shapes["scratch"], dtype=torch.int64, device=dev)
    count = torch.zeros(shapes["per_query"], dtype=torch.int32, device=dev)
    prefix = torch.zeros(shapes["per_query"], dtype=torch.int64, device=dev)
    n_above = torch.zeros_like(prefix)
    vmin = torch.full_like(prefix, torch.iinfo(torch.int64).max)
    done = ncand == 0
    if B == 0 or N == 0:
        return buf[:, :k]
    BLOCK_D = max(32, min(128, triton.next_power_of_2(D)))
    niter = max(int(max_candidates), 1).bit_length() + 1
    grid = (B, splits)
    if has_bias:
        nlist = bias.shape[1]
        kernel, bias_args = _filtered_scan_bias_kernel, (cluster_offsets.contiguous(), bias.contiguous(), nlist)
        bias_flags = dict(HAS_BIAS=True, CITER=max(nlist.bit_length(), 1))
    else:  # the kernel without bias arguments (same code as HAS_BIAS=False)
        kernel, bias_args, bias_flags = _filtered_scan_kernel, (), {}

    def launch(n, shift_hi, shift, compact):
        kernel[grid](
            qcodes, codes, bits, ops, prog_rows, post_rows, post_offsets, lists, n, prefix, vmin,
            hist, count, buf, scratch,
            D, bits.shape[1], L, T, T2, V, cap, splits, soff, rb, (1 << rb) - 1, shift_hi, shift, NO_LISTS,
            *bias_args, COMPACT=compact, NITER=niter, NBINS=1 << DIGIT, BLOCK=BLOCK, BLOCK_D=BLOCK_D, **bias_flags,
        )

    shift_hi = total_bits
    while shift_hi > 0:  # a static number of radix passes; resolved queries scan nothing
        shift = max(shift_hi - DIGIT, 0)
        hist.zero_()
        launch(torch.where(done, 0, ncand), shift_hi, shift, False)
        prefix, n_above, done, vmin = _select_digit(hist, k, cap, shift_hi - shift, shift, prefix, n_above, done, vmin)
        shift_hi = shift
    launch(ncand, 0, 0, True)
    return torch.topk(buf, k, dim=1).values  # sorted, descending
