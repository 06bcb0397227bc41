"""The silverrec ops' plain Python references, registered as their CPU kernels for the length of a `with`.

Every op's CPU kernel is C++ (kernels/csrc). A composition test (the fused search against its steps, the
predictor's plan against the op) runs once with those kernels and once with these references in their place
(`cpp_and_reference`): the same answers, bit for bit. The references are the independent ones the kernel tests
use (kernels/*: `*_torch` compositions, brute-force scans, the stack machine); none of them is a production
path. rescore_rows, candidate_rows and mol_score keep their C++ kernels here: their references sum in another
order (a batched matmul), equal up to float32 rounding (their own tests compare them with a tolerance).
"""

from __future__ import annotations

import contextlib
import warnings
from functools import partial

import torch

from silverrec.kernels import constants
from silverrec.kernels.bloom_filter import bloom_filter_counts_torch, bloom_filter_reference
from silverrec.kernels.centroid_probe import centroid_candidates_torch
from silverrec.kernels.common import dequantize_scores, make_keys, quantize_queries, split_keys
from silverrec.kernels.filter_plan import checked_args, filter_plan_torch
from silverrec.kernels.filtered_topk import _unpacked, filtered_keys_torch, verify_topk_torch
from silverrec.kernels.ivf_scan import _ivf_scan_impl, canonical_probes
from silverrec.kernels.rows_to_items import rows_to_items_torch


def scan_keys_brute(qcodes, codes, cluster_offsets, probes, k, bitmask, bias=None) -> torch.Tensor:
    """ivf_scan's sort keys int64 [B, k] by brute force: every row of each query's probed clusters (first slot of
    a cluster wins, its bitmask bit set), exact int64 dots (+ bias[b, cluster]), one sort."""
    B, n = qcodes.shape[0], codes.shape[0]
    probes = canonical_probes(probes)
    nlist = cluster_offsets.numel() - 1
    cluster = torch.searchsorted(cluster_offsets, torch.arange(n), right=True) - 1  # [N]
    dots = qcodes.long() @ codes.long().t()  # [B, N]
    if bias is not None:
        dots = dots + bias.long()[:, cluster.clamp(0, nlist - 1)]
    keys = torch.full((B, max(n, k)), constants.EMPTY_KEY, dtype=torch.int64)
    rows = torch.arange(n)
    for b in range(B):
        allowed = torch.zeros(n, dtype=torch.bool)
        for j, c in enumerate(probes[b].tolist()):
            if c < 0:
                continue
            lo, hi = int(cluster_offsets[c]), int(cluster_offsets[c + 1])
            ok = torch.ones(hi - lo, dtype=torch.bool)
            if bitmask is not None:
                r = rows[lo:hi]
                ok = ((bitmask[b, j, (r >> 6) - (lo >> 6)] >> (r & 63)) & 1).bool()
            allowed[lo:hi] = ok
        keys[b, :n] = torch.where(allowed, make_keys(dots[b], rows), constants.EMPTY_KEY)
    return keys.sort(dim=1, descending=True).values[:, :k]


def ivf_scan_reference_kernel(queries, codes, scale, offset, cluster_offsets, probes, k, bitmask=None, window_words=0,
                              centroids=None, centroid_queries=None):
    return _ivf_scan_impl(queries, codes, scale, offset, cluster_offsets, probes, k, bitmask, scan_keys_brute,
                          centroids, centroid_queries)


def filtered_topk_reference_kernel(queries, codes, scale, offset, bits, program, postings, active, k, max_candidates,
                                   residual):
    ops, prog_rows, post_rows, post_offsets, lists, cluster_offsets, centroids, centroid_queries = _unpacked(
        program, postings, residual)
    qcodes, qscale = quantize_queries(queries)
    term = () if centroids is None else (cluster_offsets, centroids.float(), centroid_queries.float(),
                                         (scale * qscale).float())
    keys, shift = filtered_keys_torch(qcodes, codes, bits, ops, prog_rows, post_rows, post_offsets, lists, active, k,
                                      *term)
    int_scores, rows = split_keys(keys)
    scores = dequantize_scores(int_scores, qscale, queries.float().sum(dim=1), scale, offset, valid=rows >= 0)
    return scores if shift is None else scores + shift[:, None], rows


def _filter_plan(*args):
    return filter_plan_torch(*checked_args(*args))


def _centroid_candidates(queries, centroids, P):
    return centroid_candidates_torch(queries.float(), centroids.float(), P)


def _verify_topk(bits, ops, prog_rows, scores, rows, k):
    return verify_topk_torch(bits, ops, prog_rows, scores.float(), rows, k)


REFERENCES = {
    "ivf_scan": ivf_scan_reference_kernel,
    "filtered_topk": filtered_topk_reference_kernel,
    "filter_plan": _filter_plan,
    "centroid_candidates": _centroid_candidates,
    "bloom_filter": bloom_filter_reference,
    "bloom_filter_counts": partial(bloom_filter_counts_torch, bloom=bloom_filter_reference),
    "verify_topk": _verify_topk,
    "rows_to_items": rows_to_items_torch,
}


@contextlib.contextmanager
def reference_kernels():
    """The references above as the ops' CPU kernels inside the block (the C++ kernels again after it)."""
    with warnings.catch_warnings(), torch.library._scoped_library("silverrec", "IMPL") as lib:
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")
        for name, fn in REFERENCES.items():
            lib.impl(name, fn, "CPU")
        yield


def cpp_and_reference(fn):
    """fn() with the C++ kernels, then with the references in their place: both results."""
    cpp = fn()
    with reference_kernels():
        ref = fn()
    return cpp, ref
