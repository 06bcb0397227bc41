"""The IVF searches on CUDA as four fused Triton kernels (and one memset): the launch budget of a search.

    scores, ids = fused_filtered_search(queries, index, params, exact_cost_ratio, program, mode, k, nprobe,
                                        max_probe, rescore_margin, rescore_max_k)     # silverrec::filtered_ivf_search
    scores, ids = fused_ivf_search(queries, index, params, k, nprobe, rescore_margin, rescore_max_k)  # ivf_search
    # None where the search's shape is beyond the kernels (`supported`): the composition of the ops runs it

The contracts are the ops' (kernels/filtered_ivf_search.py), the same answers as the composition's steps
(`compose_search`): the same routes, probes, rows and integer scores; float scores up to the summation order
of the per-query constant <q, dim_offset> and of the float re-score. The kernels, in launch order:

1. `probe_triton` (kernels/probe_triton.py): the query folded and quantised, every centroid scored, the best
   P centroids selected (P = max_probe filtered, nprobe plain): what `centroid_candidates` and the fold are.
2. `_plan_kernel` (filtered only), program (b, j) per candidate cluster: the Bloom program over the cluster's
   words (`program_words`), the bits outside its rows cleared, its matches counted: the plan's bitmask; the
   last of query b's programs (an atomic counter) decides the route and the probes as `filter_plan` does
   (posting lists, the widening target, the whole-pool switches; float32 arithmetic operation by operation).
3. `_scan_kernel`, S programs per query, each taking every S-th tile of the query's work: a probed query's
   clusters' rows (tiles of BLOCK_N rows of one cluster, the bitmask's bits tested before any dot); a
   whole-pool query's words (the verify program per tile of words, then the 64 rows of each non-zero word);
   a posting-list query's list positions (rows deduplicated, the verify program per row). Every scored tile
   goes into the program's running top-KM (`topk_triton.offer`: a candidate buffer cut back by a sort in
   place of torch.topk's radix passes), flushed sorted at the end. Residual codes add the cluster term
   (`common.cluster_bias`, float64 on the device) of each row's cluster. An exact route of a re-scored
   search also appends its passing rows' keys to a buffer of EXACT_FLOAT_ROWS + 1 (an atomic slot counter).
4. `_finish_kernel`, one program per query: the S lists merged (one sort); a probed query's first
   verify_margin(k) rows through the exact verify program, the first k that pass kept (`verify_topk`); an
   exact route's first k, or all its passing rows when at most EXACT_FLOAT_ROWS pass and the search re-scores
   (kernels/rescore_rows.py); the integer scores dequantised (+ shift + constant), or the rows re-scored with
   the float query in dot_lanes order and ranked (ties by position); rows mapped to item ids.

Counters for the last-program patterns and the buffer's slots are one zeroed int32 tensor: the memset.
Nothing is sized by N (the centroid scores are [B, C]); no host synchronisation, so a CUDA graph captures the
whole search. The interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors, one program at a time
(tests/test_search_triton.py); compiled for sm_90 by tests/test_search_triton.py without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from silverrec.kernels import constants
from silverrec.kernels.bloom_filter_triton import program_words
from silverrec.kernels.constants import EXACT_FLOAT_ROWS, VERIFY_MARGIN_DIVISOR, VERIFY_MARGIN_ROWS
from silverrec.kernels.filtered_topk_triton import _posting_rows
from silverrec.kernels.ivf_scan_triton import row_scores
from silverrec.kernels.probe_triton import lane_tree, probe_triton
from silverrec.kernels.search_args import FilteredIvfParams, FilteredIvfTensors, IvfParams, IvfTensors, Program, unpack
from silverrec.kernels.topk_triton import EMPTY, LOW, at, first, flush, float_key, key_float, key_row, merged, offer, sort_desc

MODE_AUTO = tl.constexpr(constants.MODE_AUTO)
MODE_PROBED = tl.constexpr(constants.MODE_PROBED)
MODE_UNPROBED = tl.constexpr(constants.MODE_UNPROBED)
ROUTE_PROBED = tl.constexpr(constants.ROUTE_PROBED)
ROUTE_WHOLE_POOL = tl.constexpr(constants.ROUTE_WHOLE_POOL)
ROUTE_POSTING = tl.constexpr(constants.ROUTE_POSTING)
NO_LISTS = tl.constexpr(constants.NO_LISTS)
NO_LIST = tl.constexpr(constants.NO_LIST)
NO_CLUSTER = tl.constexpr(constants.NO_CLUSTER)
BIAS_FLOOR = tl.constexpr(constants.BIAS_FLOOR)
FEW_ROWS = tl.constexpr(EXACT_FLOAT_ROWS)
ROUND_MAGIC64 = tl.constexpr(6755399441055744.0)  # 1.5 x 2**52: (x + m) - m rounds float64 half to even

BLOCK_N = 64  # rows per probed tile
BLOCK = 64  # words per whole-pool tile, positions per posting tile (one bank word = 64 rows)
BLOCK_W = 16  # words per step of a candidate cluster in the plan
RESCORE_ROWS = 32  # rows per step of the float re-score
MAX_KEYS = 2048  # the largest running top (KM) a scan program keeps: beyond it, the composition
MERGE_KEYS = 4096  # the most keys the finish program merges (S lists x KM)
TARGET_PROGRAMS = 512  # scan programs per launch (B x S): a few per SM of an H100 / H200
FEW_KEYS = 2048  # the re-score's passing-row buffer (>= EXACT_FLOAT_ROWS + 1, a power of two)
FEW_KEYS_C = tl.constexpr(FEW_KEYS)
RESCORE_ROWS_C = tl.constexpr(RESCORE_ROWS)


def verify_margin(k: int) -> int:
    """Rows the probed route scans for k results (kernels/filtered_ivf_search.py's rule)."""
    return k + k // VERIFY_MARGIN_DIVISOR + VERIFY_MARGIN_ROWS


# ------------------------------------------------------------------------------------------- device helpers


@triton.jit
def _popcount(x):
    """Set bits of int64 words (SWAR on the unsigned pattern)."""
    u = x.to(tl.uint64, bitcast=True)
    u = u - ((u >> 1) & 0x5555555555555555)
    u = (u & 0x3333333333333333) + ((u >> 2) & 0x3333333333333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F0F0F0F0F
    return ((u * 0x0101010101010101) >> 56).to(tl.int64)


@triton.jit
def _posting_choice(lists_ptr, post_sizes_ptr, g, mode, T2, V, posting_limit, BLOCK_T: tl.constexpr):
    """Program g's posting-list route (filter_plan): it has lists, they hold <= posting_limit rows, and the
    mode is not probed (list ids outside [0, V) count 0) -> (posting, their total length)."""
    size = tl.zeros((BLOCK_T,), tl.int64)
    for t0 in range(0, T2, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        lid = tl.load(lists_ptr + g * T2 + t, mask=t < T2, other=NO_LIST)
        lid = tl.where((lid >= 0) & (lid < V), lid, V)
        size += tl.load(post_sizes_ptr + lid, mask=t < T2, other=0)
    total = tl.sum(size, axis=0)
    head = tl.load(lists_ptr + g * T2, mask=T2 > 0, other=NO_LISTS)
    return (head != NO_LISTS) & (total <= posting_limit) & (mode != MODE_PROBED), total


@triton.jit
def _unit_terms(qscale_ptr, score_ptr, cand_ptr, b, C, P):
    """Residual codes' integer units of query b: (u float64 = its scale, whole = round(shift / u)), the shift
    the best visited cluster's score, which on every route is the first candidate's (common.cluster_bias)."""
    u = tl.load(qscale_ptr + b).to(tl.float64)
    shift = tl.load(score_ptr + b * C + tl.load(cand_ptr + b * P))
    return u, _round64(shift.to(tl.float64) / u)


@triton.jit
def _round64(x):
    return (x + ROUND_MAGIC64) - ROUND_MAGIC64


@triton.jit
def _bias(score, u, whole):
    """The cluster term in integer units: clamp(round(score / u) - whole, BIAS_FLOOR, 0) as int64."""
    units = _round64(score.to(tl.float64) / u) - whole
    return tl.minimum(tl.maximum(units, BIAS_FLOOR * 1.0), 0.0).to(tl.int64)


@triton.jit
def _cluster_of(off_ptr, rows, ok, C, CITER: tl.constexpr):
    """The cluster of each row (the last c with off[c] <= row): a binary search over off[0, C) per lane."""
    a = tl.zeros_like(rows)
    z = tl.zeros_like(rows) + C
    for _ in tl.static_range(CITER):
        live = ok & (a < z)
        mid = (a + z) >> 1
        val = tl.load(off_ptr + mid, mask=live, other=0)
        a = tl.where(live & (val <= rows), mid + 1, a)
        z = tl.where(live & (val > rows), mid, z)
    return tl.maximum(a - 1, 0)


# ------------------------------------------------------------------------------------------------- the plan


@triton.jit
def _plan_kernel(
    cand_ptr,  # int64 [B, P] candidate clusters, best first (probe_triton)
    off_ptr,  # int64 [C + 1] cluster offsets
    bits_ptr,  # int64 [R, W] row bank
    ops_ptr,  # int64 [G, L] Bloom programs (G = B / per)
    prog_ptr,  # int64 [G, L, T]
    lists_ptr,  # int64 [G, T2]
    post_sizes_ptr,  # int64 [V + 1]
    mode_ptr,  # int64 [G]
    mask_ptr,  # out int64 [B, P, Wc] the Bloom program on each candidate's rows
    matches_ptr,  # out int64 [B, P]
    probes_ptr,  # out int64 [B, P] clusters to scan, best first (NO_CLUSTER = none)
    route_ptr,  # out int64 [B]
    scratch_ptr,  # int64 [B, P, L, BLOCK_W] program stacks
    counter_ptr,  # int32 [B], zeroed
    W, L, T, T2, V, P, Wc, per, nprobe, posting_limit,
    base,  # float32 k x match_factor
    num_items_f,  # float32 pool size
    ratio,  # float32 exact_cost_ratio
    BLOCK_WORDS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PB: tl.constexpr,
):
    """Program (b, j): candidate j of query b filtered and counted; the last of b's decides (module docstring)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    g = b // per
    mode = tl.load(mode_ptr + g)
    posting, _ = _posting_choice(lists_ptr, post_sizes_ptr, g, mode, T2, V, posting_limit, BLOCK_T)
    skip = posting | (mode == MODE_UNPROBED)  # no candidate evaluated: zero bitmask rows, no matches
    c = tl.load(cand_ptr + b * P + j)
    lo = tl.load(off_ptr + c)
    hi = tl.load(off_ptr + c + 1)
    wbase = lo >> 6
    total = tl.zeros((BLOCK_WORDS,), tl.int64)
    lane = tl.arange(0, BLOCK_WORDS)
    scratch = scratch_ptr + (b * P + j) * L * BLOCK_WORDS + lane
    one = tl.full((BLOCK_WORDS,), 1, tl.int64)
    for w0 in range(0, Wc, BLOCK_WORDS):
        offs = w0 + lane
        inb = offs < Wc
        widx = wbase + offs
        valid = inb & (widx < W)
        x = tl.zeros((BLOCK_WORDS,), tl.int64)
        if skip == 0:
            x = program_words(bits_ptr, W, ops_ptr, prog_ptr, g, L, T, widx, valid, scratch, BLOCK_WORDS, inb,
                              BLOCK_WORDS)
            start = widx * 64  # the word's first row; keep rows [lo, hi)
            a = tl.minimum(tl.maximum(lo - start, 0), 64)
            z = tl.minimum(tl.maximum(hi - start, 0), 64)
            upto_z = tl.where(z >= 64, -1, (one << tl.minimum(z, 63)) - 1)
            upto_a = tl.where(a >= 64, -1, (one << tl.minimum(a, 63)) - 1)
            x = tl.where(valid, x & upto_z & ~upto_a, 0)
            total += _popcount(x)
        tl.store(mask_ptr + (b * P + j) * Wc + offs, x, mask=inb)
    tl.store(matches_ptr + b * P + j, tl.sum(total, axis=0))
    tl.debug_barrier()  # this program's count stored before it counts itself done
    if tl.atomic_add(counter_ptr + b, 1, sem="acq_rel") == P - 1:  # the last candidate of query b: route it
        jj = tl.arange(0, PB)
        inb = jj < P
        cj = tl.load(cand_ptr + b * P + jj, mask=inb, other=0)
        sizes = tl.load(off_ptr + cj + 1, mask=inb, other=0) - tl.load(off_ptr + cj, mask=inb, other=0)
        matches = tl.load(matches_ptr + b * P + jj, mask=inb, other=0, cache_modifier=".cg")
        cum = tl.cumsum(matches, axis=0)
        total_f = tl.sum(matches, axis=0).to(tl.float32)
        cand_rows = tl.maximum(tl.sum(sizes, axis=0), 1).to(tl.float32)
        target = tl.div_rn(base, tl.sqrt_rn(tl.div_rn(total_f, cand_rows)))
        need = tl.sum((inb & (cum.to(tl.float32) < target)).to(tl.int64), axis=0) + 1
        use = tl.where(mode == MODE_PROBED, nprobe, tl.minimum(tl.maximum(need, nprobe), P))
        chosen = jj < use
        scanned = tl.sum(tl.where(chosen, sizes, 0), axis=0).to(tl.float32)
        est_total = total_f * tl.div_rn(num_items_f, cand_rows)
        auto = (total_f < target) | (scanned > est_total * ratio)
        unprobed = tl.where(mode == MODE_AUTO, auto, mode == MODE_UNPROBED) & ~posting
        tl.store(probes_ptr + b * P + jj, tl.where(chosen & ~unprobed & ~posting, cj, NO_CLUSTER), mask=inb)
        route = tl.where(posting, ROUTE_POSTING, tl.where(unprobed, ROUTE_WHOLE_POOL, ROUTE_PROBED))
        tl.store(route_ptr + b, route.to(tl.int64))


# ------------------------------------------------------------------------------------------------- the scan


@triton.jit
def _exact_rows(qcode_ptr, codes_ptr, b, rows, ok, D, off_ptr, score_ptr, C, u, whole, few_ptr, fewcount_ptr,
                cbuf, count, thr, RESIDUAL: tl.constexpr, FEW: tl.constexpr, CITER: tl.constexpr,
                CAP: tl.constexpr, KM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows int64 [BLOCK] (lanes `ok`) of an exact route scored (+ each row's cluster term), offered to the
    running top-KM and, for a re-scored search, appended to the passing-row buffer -> (count, threshold)."""
    sc = row_scores(qcode_ptr, codes_ptr, b, rows, ok, D, D, D, rows.shape[0], BLOCK_D).to(tl.int64)
    if RESIDUAL:
        c = _cluster_of(off_ptr, rows, ok, C, CITER)
        sc += _bias(tl.load(score_ptr + b * C + c, mask=ok, other=0.0), u, whole)
    keys = tl.where(ok, sc * 4294967296 + (rows ^ LOW), EMPTY)
    if FEW:
        base = tl.atomic_add(fewcount_ptr + b, tl.sum(ok.to(tl.int32), axis=0))
        slot = base + tl.cumsum(ok.to(tl.int32), axis=0) - 1
        tl.store(few_ptr + b * FEW_KEYS_C + slot, keys, mask=ok & (slot <= FEW_ROWS))
    return offer(keys, cbuf, count, thr, CAP, KM)



@triton.jit
def _scan_kernel(
    qcode_ptr,  # int8 [B, D] the folded queries' codes
    codes_ptr,  # int8 [N, D] cluster-major codes
    off_ptr,  # int64 [C + 1]
    probes_ptr,  # int64 [B, P] clusters to scan (NO_CLUSTER = none)
    mask_ptr,  # int64 [B, P, Wc] the plan's bitmask (HAS_MASK)
    route_ptr,  # int64 [B] (HAS_EXACT)
    qscale_ptr,  # float32 [B] (RESIDUAL)
    score_ptr,  # float32 [B, C] centroid scores (RESIDUAL)
    cand_ptr,  # int64 [B, P] (RESIDUAL: the shift is the first candidate's score)
    bits_ptr,  # int64 [R, W] row bank (HAS_EXACT)
    vops_ptr,  # int64 [G, L] verify programs (HAS_EXACT)
    vprog_ptr,  # int64 [G, L, T]
    post_rows_ptr,  # int32 [E] posting lists
    post_off_ptr,  # int64 [V + 1]
    post_sizes_ptr,  # int64 [V + 1]
    lists_ptr,  # int64 [G, T2]
    mode_ptr,  # int64 [G]
    scratch_ptr,  # int64 [B, S, L + 1, BLOCK] program stacks (HAS_EXACT)
    cbuf_ptr,  # int64 [B, S, CAP] candidate buffers
    part_ptr,  # out int64 [B, S, KM] each program's best keys
    few_ptr,  # out int64 [B, FEW_KEYS] an exact route's passing rows' keys (FEW)
    fewcount_ptr,  # int32 [B] zeroed: their count (FEW)
    N, D, C, P, Wc, W, L, T, T2, V, S, per, max_cand,
    HAS_MASK: tl.constexpr,
    HAS_EXACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    FEW: tl.constexpr,
    KM: tl.constexpr,
    CAP: tl.constexpr,
    PB: tl.constexpr,
    TILE_N: tl.constexpr,
    TILE_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NITER: tl.constexpr,
    CITER: tl.constexpr,
):
    """Program (b, s): every S-th tile of query b's work into a running top-KM (module docstring)."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    cbuf = cbuf_ptr + (b * S + s) * CAP
    count = tl.zeros((), tl.int32)
    thr = tl.full((), EMPTY, tl.int64)
    u = tl.full((), 1.0, tl.float64)
    whole = tl.full((), 0.0, tl.float64)
    if RESIDUAL:
        u, whole = _unit_terms(qscale_ptr, score_ptr, cand_ptr, b, C, P)
    route = b * 0 + ROUTE_PROBED
    if HAS_EXACT:
        route = tl.load(route_ptr + b)
    if route == ROUTE_PROBED:
        jj = tl.arange(0, PB)
        cj = tl.load(probes_ptr + b * P + jj, mask=jj < P, other=NO_CLUSTER)
        has = cj >= 0
        cs = tl.where(has, cj, 0)
        start = tl.load(off_ptr + cs, mask=has, other=0)
        stop = tl.load(off_ptr + cs + 1, mask=has, other=0)
        ntile = tl.where(has, (stop - start + TILE_N - 1) // TILE_N, 0)
        cum = tl.cumsum(ntile, axis=0)
        for t in range(s, tl.sum(ntile, axis=0), S):
            slot = tl.sum((cum <= t).to(tl.int64), axis=0)  # the probe slot holding tile t
            c0 = at(start, slot)
            rows = c0 + (t - at(cum, slot) + at(ntile, slot)) * TILE_N + tl.arange(0, TILE_N)
            valid = rows < at(stop, slot)
            if HAS_MASK:  # the plan's bits, tested before any dot product
                word = tl.load(mask_ptr + (b * P + slot) * Wc + ((rows >> 6) - (c0 >> 6)), mask=valid, other=0)
                valid = valid & (((word >> (rows & 63)) & 1) != 0)
            if tl.max(valid.to(tl.int32), axis=0) > 0:
                sc = row_scores(qcode_ptr, codes_ptr, b, rows, valid, D, D, D, TILE_N, BLOCK_D).to(tl.int64)
                if RESIDUAL:
                    sc += _bias(tl.load(score_ptr + b * C + at(cj, slot)), u, whole)
                keys = tl.where(valid, sc * 4294967296 + (rows ^ LOW), EMPTY)
                count, thr = offer(keys, cbuf, count, thr, CAP, KM)
    elif HAS_EXACT:  # the whole pool or the posting lists, through the verify program
        g = b // per
        lane = tl.arange(0, TILE_W).to(tl.int64)
        stack = scratch_ptr + (b * S + s) * (L + 1) * TILE_W  # this program's [L + 1, TILE_W]
        scratch = stack + lane
        if route == ROUTE_WHOLE_POOL:  # the program per word, then the 64 rows of each non-zero word
            for tw in range(s, tl.cdiv(W, TILE_W), S):
                widx = tw * TILE_W + lane
                words = program_words(bits_ptr, W, vops_ptr, vprog_ptr, g, L, T, widx, widx < W, scratch, TILE_W,
                                      lane >= 0, TILE_W)
                tl.store(scratch + L * TILE_W, tl.where(widx < W, words, 0))  # slot L: the tile's words
                tl.debug_barrier()
                for w in range(0, TILE_W):
                    word = tl.load(stack + L * TILE_W + w)
                    if word != 0:
                        rows = (tw * TILE_W + w) * 64 + lane
                        ok = (((word >> lane) & 1) != 0) & (rows < N)
                        count, thr = _exact_rows(qcode_ptr, codes_ptr, b, rows, ok, D, off_ptr, score_ptr, C, u, whole,
                                                 few_ptr, fewcount_ptr, cbuf, count, thr, RESIDUAL, FEW, CITER, CAP,
                                                 KM, BLOCK_D)
                tl.debug_barrier()  # every lane has read slot L before the next tile writes it
        else:  # list positions; the program per row
            _, listed = _posting_choice(lists_ptr, post_sizes_ptr, g, tl.load(mode_ptr + g), T2, V, max_cand, BLOCK_T)
            n = tl.minimum(listed, max_cand)
            for tp in range(s, tl.cdiv(n, TILE_W), S):
                pos = tp * TILE_W + lane
                rows, ok = _posting_rows(post_rows_ptr, post_off_ptr, lists_ptr, g, pos, pos < n, T2, V, NITER)
                words = program_words(bits_ptr, W, vops_ptr, vprog_ptr, g, L, T, rows >> 6, ok, scratch, TILE_W,
                                      lane >= 0, TILE_W)
                ok = ok & (((words >> (rows & 63)) & 1) != 0)
                if tl.max(ok.to(tl.int32), axis=0) > 0:
                    count, thr = _exact_rows(qcode_ptr, codes_ptr, b, rows, ok, D, off_ptr, score_ptr, C, u, whole,
                                             few_ptr, fewcount_ptr, cbuf, count, thr, RESIDUAL, FEW, CITER, CAP, KM,
                                             BLOCK_D)
    flush(cbuf, count, part_ptr + (b * S + s) * KM, CAP, KM)


# ----------------------------------------------------------------------------------------------- the finish


@triton.jit
def _float_scores(q_ptr, codes_ptr, dscale_ptr, b, rows, ok, D):
    """float32 [M]: <q_b * dim_scale, code of row> for rows int64 [M] (lanes `ok`), in dot_lanes's order."""
    lane = tl.arange(0, 16)
    acc = tl.zeros((rows.shape[0], 16), tl.float32)
    for d0 in range(0, D, 16):
        d = d0 + lane
        inb = d < D
        folded = tl.load(q_ptr + b * D + d, mask=inb, other=0.0) * tl.load(dscale_ptr + d, mask=inb, other=0.0)
        x = tl.load(codes_ptr + rows[:, None] * D + d[None, :], mask=ok[:, None] & inb[None, :], other=0)
        acc = acc + x.to(tl.float32) * folded[None, :]
    return lane_tree(acc)


@triton.jit
def _float_top(fs, m, NB: tl.constexpr, KO: tl.constexpr):
    """The best KO of the float scores fs[0:m] (m <= NB) as `float_key`s, ties to the lower position."""
    i = tl.arange(0, NB)
    f = tl.load(fs + i, mask=i < m, other=0.0)
    return first(sort_desc(tl.where(i < m, float_key(f, i), EMPTY)), KO)


@triton.jit
def _finish_kernel(
    part_ptr,  # int64 [B, S, KM] the scan programs' best keys
    route_ptr,  # int64 [B] (HAS_EXACT)
    few_ptr,  # int64 [B, FEW_KEYS] (FEW)
    fewcount_ptr,  # int32 [B] (FEW)
    bits_ptr,  # int64 [R, W] (VERIFY)
    vops_ptr,  # int64 [G, L] verify programs (VERIFY)
    vprog_ptr,  # int64 [G, L, T]
    vscratch_ptr,  # int64 [B, L, KM] program stacks (VERIFY)
    qscale_ptr,  # float32 [B]
    const_ptr,  # float32 [B] <q, dim_offset>
    score_ptr,  # float32 [B, C] (RESIDUAL)
    cand_ptr,  # int64 [B, P] (RESIDUAL)
    q_ptr,  # float32 [B, D] queries (RESCORE)
    codes_ptr,  # int8 [N, D] (RESCORE)
    dscale_ptr,  # float32 [D] dim_scale (RESCORE)
    off_ptr,  # int64 [C + 1] (RESCORE and RESIDUAL)
    map_ptr,  # int32 / int64 [N] row -> item id (HAS_MAP)
    list_ptr,  # scratch int64 [B, LB] the ranked rows' keys
    fs_ptr,  # scratch float32 [B, LB] their float scores (RESCORE)
    out_s_ptr,  # out float32 [B, k]
    out_i_ptr,  # out int64 [B, k]
    S, k, kk, vk, W, L, T, D, C, P, per,
    KM: tl.constexpr,
    SB: tl.constexpr,
    LB: tl.constexpr,
    KO: tl.constexpr,
    VERIFY: tl.constexpr,
    HAS_EXACT: tl.constexpr,
    FEW: tl.constexpr,
    RESCORE: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAS_MAP: tl.constexpr,
    CITER: tl.constexpr,
):
    """Program b: query b's answer from its scan lists (module docstring)."""
    b = tl.program_id(0).to(tl.int64)
    keys = merged(part_ptr + b * S * KM, S, KM, SB)
    pos = tl.arange(0, KM)
    lst = list_ptr + b * LB
    route = b * 0 + ROUTE_PROBED
    if HAS_EXACT:
        route = tl.load(route_ptr + b)
    n_few = tl.zeros((), tl.int32)
    use_few = route < 0  # False
    if FEW:
        n_few = tl.load(fewcount_ptr + b, cache_modifier=".cg")
        use_few = (route != ROUTE_PROBED) & (n_few <= FEW_ROWS)
    if use_few:  # an exact route passing few rows: all of them, in the scan's order
        i = tl.arange(0, FEW_KEYS_C)
        x = tl.load(few_ptr + b * FEW_KEYS_C + i, mask=i < n_few, other=EMPTY, cache_modifier=".cg")
        tl.store(lst + i, sort_desc(x))
        m = n_few
    else:
        ok = (keys != EMPTY) & (pos < kk)
        if VERIFY:
            if route == ROUTE_PROBED:  # the first vk rows through the exact verify program
                rows = key_row(keys)
                widx = rows >> 6
                inb = (keys != EMPTY) & (pos < vk) & (widx < W)
                words = program_words(bits_ptr, W, vops_ptr, vprog_ptr, b // per, L, T, widx, inb,
                                      vscratch_ptr + b * L * KM + pos, KM, pos >= 0, KM)
                ok = inb & (((words >> (rows & 63)) & 1) != 0)
        slot = tl.cumsum(ok.to(tl.int32), axis=0) - 1
        tl.store(lst + slot, keys, mask=ok & (slot < kk))
        m = tl.minimum(tl.sum(ok.to(tl.int32), axis=0), kk)
    tl.debug_barrier()  # the list stored before it is read back
    o = tl.arange(0, KO)
    if RESCORE:  # every listed row scored with the float query, ranked by it (ties: list order)
        const = tl.load(const_ptr + b)
        for c0 in range(0, m, RESCORE_ROWS_C):
            i = c0 + tl.arange(0, RESCORE_ROWS_C)
            inl = i < m
            rows = key_row(tl.load(lst + i, mask=inl, other=EMPTY))
            okr = inl & (rows >= 0)
            f = _float_scores(q_ptr, codes_ptr, dscale_ptr, b, tl.maximum(rows, 0), okr, D) + const
            if RESIDUAL:
                f += tl.load(score_ptr + b * C + _cluster_of(off_ptr, rows, okr, C, CITER), mask=okr, other=0.0)
            f = tl.where(okr & (f > float("-inf")), f, float("-inf"))  # NaN too
            tl.store(fs_ptr + b * LB + i, f, mask=inl)
        tl.debug_barrier()
        if use_few:
            top = _float_top(fs_ptr + b * LB, m, FEW_KEYS_C, KO)
        else:
            top = _float_top(fs_ptr + b * LB, m, KM, KO)
        score = key_float(top)
        idx = key_row(top)
        valid = (idx >= 0) & (o < k) & (score > float("-inf"))
        row = key_row(tl.load(lst + idx, mask=valid, other=EMPTY))
    else:  # the integer scores dequantised as common.dequantize_scores, + shift, + constant
        key = tl.load(lst + o, mask=o < m, other=EMPTY)
        row = key_row(key)
        valid = (o < m) & (o < k) & (row >= 0)
        score = (key >> 32).to(tl.float32) * tl.load(qscale_ptr + b)
        if RESIDUAL:
            u, whole = _unit_terms(qscale_ptr, score_ptr, cand_ptr, b, C, P)
            score = score + (whole * u).to(tl.float32)
        score = score + tl.load(const_ptr + b)
    ids = row
    if HAS_MAP:
        ids = tl.load(map_ptr + tl.maximum(row, 0), mask=valid, other=0).to(tl.int64)
    tl.store(out_s_ptr + b * k + o, tl.where(valid, score, float("-inf")), mask=o < k)
    tl.store(out_i_ptr + b * k + o, tl.where(valid, ids, -1), mask=o < k)



# -------------------------------------------------------------------------------------------- the launchers


def scan_keys(k_rows: int) -> int:
    """KM, the running top a scan program keeps for k_rows results: a power of two >= k_rows and the tiles."""
    return max(BLOCK_N, BLOCK, triton.next_power_of_2(k_rows))


def supported(k_rows: int, candidates: int) -> bool:
    """Whether the kernels run a search that keeps k_rows rows per route (verify_margin(k) for a filtered
    search) over `candidates` probe candidates; larger ones run as the composition of the ops."""
    return scan_keys(k_rows) <= MAX_KEYS and triton.next_power_of_2(candidates) <= MERGE_KEYS // 4


def splits(batch: int, km: int, max_tiles: int) -> int:
    """Scan programs per query: enough for TARGET_PROGRAMS in all, no more than its tiles, and no more lists
    than the finish merges in one sort."""
    return max(1, min(max_tiles, TARGET_PROGRAMS // max(batch, 1), MERGE_KEYS // km))


def _results(batch: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((batch, k), dtype=torch.float32, device=device),
            torch.empty((batch, k), dtype=torch.int64, device=device))


def _scan_and_finish(q, ix, probe, probes, mask, route, program, per: int, counters, k_out: int, kk: int, vk: int,
                     rescore: bool, residual: bool, max_cand: int, max_tiles: int):
    """Launch the scan and the finish (module docstring) -> (scores float32 [B, k_out], ids int64 [B, k_out])."""
    B, D = q.shape
    N, C, P = ix.codes.shape[0], ix.centroids.shape[0], probes.shape[1]
    dev = q.device
    km = scan_keys(vk)
    s = splits(B, km, max_tiles)
    cap = 2 * km
    filtered = program is not None
    few = filtered and rescore
    if filtered:
        bits, vops, vrows, lists = ix.bits, program.vops, program.vrows, program.lists
        post_rows, post_off, post_sizes = ix.post_rows, ix.post_offsets, ix.post_sizes
        L, T, T2, V, W = vops.shape[1], vrows.shape[2], lists.shape[1], post_off.numel() - 1, bits.shape[1]
        mode = program.mode
        scratch = torch.empty((B, s, L + 1, BLOCK), dtype=torch.int64, device=dev)
    else:  # unused pointers
        bits = vops = vrows = lists = post_rows = post_off = post_sizes = mode = scratch = probes
        L = T = T2 = V = W = 0
    Wc = mask.shape[2] if mask is not None else 0
    cbuf = torch.empty((B, s, cap), dtype=torch.int64, device=dev)
    part = torch.empty((B, s, km), dtype=torch.int64, device=dev)
    few_keys = torch.empty((B, FEW_KEYS), dtype=torch.int64, device=dev) if few else probes
    fewcount = counters[2 * B: 3 * B] if few else counters
    citer = max(C.bit_length(), 1)
    _scan_kernel[(B, s)](
        probe.qcodes, ix.codes, ix.cluster_offsets, probes, mask if mask is not None else probes,
        route if route is not None else probes, probe.qscale, probe.scores, probe.cand,
        bits, vops, vrows, post_rows, post_off, post_sizes, lists, mode, scratch, cbuf, part, few_keys, fewcount,
        N, D, C, P, Wc, W, L, T, T2, V, s, per, max_cand,
        HAS_MASK=mask is not None, HAS_EXACT=filtered, RESIDUAL=residual, FEW=few, KM=km, CAP=cap,
        PB=triton.next_power_of_2(P), TILE_N=BLOCK_N, TILE_W=BLOCK, BLOCK_D=max(32, min(128, triton.next_power_of_2(D))),
        BLOCK_T=max(16, min(256, triton.next_power_of_2(max(T2, 1)))), NITER=max(int(max_cand), 1).bit_length() + 1,
        CITER=citer,
    )
    lb = max(km, FEW_KEYS if few else km)
    lst = torch.empty((B, lb), dtype=torch.int64, device=dev)
    fs = torch.empty((B, lb), dtype=torch.float32, device=dev) if rescore else lst
    vscratch = torch.empty((B, L, km), dtype=torch.int64, device=dev) if filtered else lst
    has_map = ix.row_to_item.numel() > 0
    out_s, out_i = _results(B, k_out, dev)
    _finish_kernel[(B,)](
        part, route if route is not None else probes, few_keys, fewcount, bits, vops, vrows, vscratch,
        probe.qscale, probe.constant, probe.scores, probe.cand, q, ix.codes, ix.dim_scale, ix.cluster_offsets,
        ix.row_to_item if has_map else probes, lst, fs, out_s, out_i,
        s, k_out, kk, vk, W, L, T, D, C, probe.cand.shape[1], per,
        KM=km, SB=triton.next_power_of_2(s), LB=lb, KO=triton.next_power_of_2(k_out), VERIFY=filtered,
        HAS_EXACT=filtered, FEW=few, RESCORE=rescore, RESIDUAL=residual, HAS_MAP=has_map, CITER=citer,
        enable_fp_fusion=False,
    )
    return out_s, out_i


class _Program:
    """The request's programs with the mode, as the kernels read them."""

    def __init__(self, program: Program, mode: torch.Tensor):
        self.ops, self.rows, self.vops, self.vrows, self.lists = (t.contiguous() for t in program)
        self.mode = mode.to(torch.int64).contiguous()


def _index(ix):
    """The index tensors contiguous, ranges [D], centroids float32 (what the kernels read)."""
    D = ix.codes.shape[1]
    ix = ix._replace(**{f: getattr(ix, f).contiguous() for f in ix._fields})
    return ix._replace(dim_scale=ix.dim_scale.float().expand(D).contiguous(),
                       dim_offset=ix.dim_offset.float().expand(D).contiguous(), centroids=ix.centroids.float().contiguous())


def plan_triton(queries, ix, pa, exact_cost_ratio: float, program: _Program, per: int, k: int, nprobe: int,
                max_probe: int, counters: torch.Tensor):
    """The probe and the plan kernels -> (Probe, probes int64 [B, max_probe], bitmask int64 [B, max_probe,
    window_words], route int64 [B]): silverrec::filter_plan's outputs (kernels/filter_plan.py) in two launches."""
    B = queries.shape[0]
    dev = queries.device
    P = max_probe
    probe = probe_triton(queries, ix.centroids, ix.dim_scale, ix.dim_offset, P, counters[:B])
    Wc = pa.window_words
    L, T, T2 = program.ops.shape[1], program.rows.shape[2], program.lists.shape[1]
    probes = torch.empty((B, P), dtype=torch.int64, device=dev)
    mask = torch.empty((B, P, Wc), dtype=torch.int64, device=dev)
    route = torch.empty((B,), dtype=torch.int64, device=dev)
    if B:
        matches = torch.empty((B, P), dtype=torch.int64, device=dev)
        scratch = torch.empty((B, P, L, BLOCK_W), dtype=torch.int64, device=dev)
        _plan_kernel[(B, P)](
            probe.cand, ix.cluster_offsets, ix.bits, program.ops, program.rows, program.lists, ix.post_sizes,
            program.mode, mask, matches, probes, route, scratch, counters[B: 2 * B],
            ix.bits.shape[1], L, T, T2, ix.post_sizes.shape[0] - 1, P, Wc, per, nprobe, pa.posting_limit,
            float(k * pa.match_factor), float(pa.num_items), float(exact_cost_ratio),
            BLOCK_WORDS=BLOCK_W, BLOCK_T=max(16, min(256, triton.next_power_of_2(max(T2, 1)))),
            PB=triton.next_power_of_2(P),
        )
    return probe, probes, mask, route


def fused_filter_plan(queries, index, params, exact_cost_ratio: float, program, mode, k: int, nprobe: int,
                      max_probe: int):
    """silverrec::filter_plan in three launches (the memset, the probe, the plan); its arguments checked and
    normalised (filter_plan.checked_args); None when max_probe is beyond the probe's merge."""
    if not supported(1, max_probe):
        return None
    ix, pa = _index(FilteredIvfTensors(*index)), FilteredIvfParams(*params)
    B = queries.shape[0]
    counters = torch.zeros(2 * B, dtype=torch.int32, device=queries.device)
    _, probes, mask, route = plan_triton(queries, ix, pa, exact_cost_ratio, _Program(Program(*program), mode), 1, k,
                                         nprobe, max_probe, counters)
    return probes, mask, route


def fused_filtered_search(queries, index, params, exact_cost_ratio: float, program, mode, k: int, nprobe: int,
                          max_probe: int, rescore_margin: int = 0, rescore_max_k: int = 0):
    """silverrec::filtered_ivf_search in five launches (module docstring); None when not `supported`."""
    ix = _index(unpack(FilteredIvfTensors, index, "filtered_ivf_search", "index"))
    pa = unpack(FilteredIvfParams, params, "filtered_ivf_search", "params")
    pr = unpack(Program, program, "filtered_ivf_search", "program")
    if not 1 <= nprobe <= max_probe <= ix.centroids.shape[0]:
        raise ValueError(f"need 1 <= nprobe ({nprobe}) <= max_probe ({max_probe}) <= nlist ({ix.centroids.shape[0]})")
    rescore = rescore_margin > 0 and k <= rescore_max_k
    kk = k + rescore_margin if rescore else k
    vk = verify_margin(kk)
    if not supported(vk, max_probe):
        return None
    B = queries.shape[0]
    groups = pr.ops.shape[0]
    per = B // groups if groups and B % groups == 0 else 1  # a request's task queries share its program
    q = queries.float().contiguous()
    if B == 0:
        return _results(0, k, q.device)
    prog = _Program(pr, mode)
    counters = torch.zeros(3 * B, dtype=torch.int32, device=q.device)  # probe, plan, passing-row slots
    probe, probes, mask, route = plan_triton(q, ix, pa, exact_cost_ratio, prog, per, kk, nprobe, max_probe, counters)
    W = ix.bits.shape[1]
    max_tiles = max(max_probe * triton.cdiv(max(pa.window_words, 1) * 64, BLOCK_N), triton.cdiv(W, BLOCK),
                    triton.cdiv(max(pa.posting_limit, 1), BLOCK))
    return _scan_and_finish(q, ix, probe, probes, mask, route, prog, per, counters, k, kk, vk, rescore,
                            bool(pa.residual), pa.posting_limit, max_tiles)


def fused_ivf_search(queries, index, params, k: int, nprobe: int, rescore_margin: int = 0, rescore_max_k: int = 0):
    """silverrec::ivf_search in four launches (module docstring); None when not `supported`."""
    ix = _index(unpack(IvfTensors, index, "ivf_search", "index"))
    pa = unpack(IvfParams, params, "ivf_search", "params")
    if not 1 <= nprobe <= ix.centroids.shape[0]:
        raise ValueError(f"need 1 <= nprobe ({nprobe}) <= nlist ({ix.centroids.shape[0]})")
    rescore = rescore_margin > 0 and k <= rescore_max_k
    kk = k + rescore_margin if rescore else k
    if not supported(kk, nprobe):
        return None
    B = queries.shape[0]
    q = queries.float().contiguous()
    if B == 0:
        return _results(0, k, q.device)
    counters = torch.zeros(B, dtype=torch.int32, device=q.device)
    probe = probe_triton(q, ix.centroids, ix.dim_scale, ix.dim_offset, nprobe, counters)
    N = ix.codes.shape[0]
    rows = max(pa.window_words, 1) * 64 if pa.window_words > 0 else N
    return _scan_and_finish(q, ix, probe, probe.cand, None, None, None, 1, counters, k, kk, kk, rescore,
                            bool(pa.residual), 0, nprobe * triton.cdiv(rows, BLOCK_N))
