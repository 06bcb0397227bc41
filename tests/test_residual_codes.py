"""Residual int8 codes (item ~= centroid + dim_scale * code + dim_offset): the ops' cluster term.

Every op that scores codes adds the per-(query, cluster) term <q, centroid c> (from `centroids` and the
unfolded queries): ivf_scan, filtered_topk and rescore_rows. The references here add it independently (int64 dot +
the bias of the row's cluster, found by a Python search of the offsets; float64 for the re-score);
the C++ path and the torch path (extension switched off) must equal them. Then a published residual
index on real vectors (bigann10k) against float brute force, and against direct codes.
"""

from __future__ import annotations

import bisect

import numpy as np
import pytest
import torch

import silverrec.kernels  # noqa: F401  (registers the ops)
from silverrec.bitmask import pack_bits
from silverrec.filtering.filter_program import FilterPlan, compile_request
from silverrec.kernels.rescore_rows import rescore_margin
from silverrec.publish.filtered_ivf import build_filtered_ivf
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool
from silverrec.retrieval.filtered_ivf import MODE_PROBED, MODE_UNPROBED
from silverrec.kernels.common import BIAS_FLOOR, cluster_bias, dot_lanes, quantize_queries
from silverrec.kernels.constants import NO_LISTS
from silverrec.kernels.ivf_scan import bitmask_words, ivf_scan_reference
from tests.helpers import inner_product_topk, load_ann, recall
from tests.reference_kernels import cpp_and_reference as _both_paths
from tests.test_filtered_topk import _allowed_from, _bank, _expected, _postings
from tests.test_cpu_scan import _programs

ONE, ZERO = torch.tensor(1.0), torch.tensor(0.0)


def _layout(n_clusters, d, g, max_size=120):
    """Ragged cluster sizes (some empty), codes with many ties, cluster scores spread wide."""
    sizes = torch.randint(0, max_size, (n_clusters,), generator=g)
    sizes[1] = 0
    off = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    codes = torch.randint(-4, 5, (int(off[-1]), d), dtype=torch.int8, generator=g)
    return codes, off


def _cluster_of(off, rows):
    o = off.tolist()
    return [bisect.bisect_right(o, r) - 1 for r in rows]


def test_cluster_bias_is_shifted_rounded_and_clamped():
    cs = torch.tensor([[3.0, 1.0, -1e10], [0.5, 0.5, 0.25]])
    bias, shift = cluster_bias(cs, torch.tensor([0.5, 0.125]), torch.tensor(2.0))
    assert shift.tolist() == [3.0, 0.5]
    assert bias.dtype == torch.int32
    assert bias.tolist() == [[0, -2, BIAS_FLOOR], [0, 0, -1]]


def test_cluster_bias_ranks_alike_whatever_clusters_set_the_shift():
    """The probed route shifts by its probed clusters, the exact routes by those holding passing rows:
    the biases of the clusters both visit differ by one integer per query, so they rank alike."""
    g = torch.Generator().manual_seed(5)
    cs, qs = torch.randn(6, 40, generator=g) * 7, torch.rand(6, generator=g) * 0.01 + 1e-3
    visited = torch.rand(6, 40, generator=g) < 0.3
    visited[:, 0] = True
    all_bias, _ = cluster_bias(cs, qs, ONE)
    some_bias, some_shift = cluster_bias(cs, qs, ONE, visited)
    best = torch.where(visited, cs, float("-inf")).amax(1)  # the shift added back: the best, rounded to a unit
    assert bool(((some_shift - best).abs() <= qs / 2 + 1e-6).all())
    diff = (all_bias.long() - some_bias.long())[visited].reshape(-1)
    ok = (some_bias > BIAS_FLOOR) & (all_bias > BIAS_FLOOR) & visited
    for i in range(6):
        d = (all_bias[i].long() - some_bias[i].long())[ok[i]]
        assert d.numel() and bool((d == d[0]).all())
    assert diff.numel()


def test_dot_lanes_matches_the_cpp_summation_order():
    """kernels/common.py dot_lanes emulates csrc/widen.h's (16 lanes, then a tree): the same float32 bits
    as the C++ re-score's cluster term on data where the order matters."""
    g = torch.Generator().manual_seed(0)
    for d in (7, 16, 37, 96):
        a, b = torch.randn(5, d, generator=g) * 1e3, torch.randn(5, d, generator=g) * 1e-3
        lanes = torch.zeros(5, 16)
        for i in range(d):
            lanes[:, i % 16] = lanes[:, i % 16] + a[:, i] * b[:, i]
        for w in (8, 4, 2, 1):
            lanes[:, :w] = lanes[:, :w] + lanes[:, w : 2 * w]
        assert torch.equal(dot_lanes(a, b), lanes[:, 0])


@pytest.mark.parametrize("nlist, d, b, p, k", [(20, 16, 5, 6, 30), (9, 32, 3, 9, 2000), (30, 8, 17, 4, 1)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_ivf_scan_adds_the_cluster_term(nlist, d, b, p, k, with_mask):
    """The cluster term <query, centroid> of the probed clusters, shifted by the best probed one (integer
    centroids and queries: every float sum exact)."""
    g = torch.Generator().manual_seed(nlist * 7 + b)
    codes, off = _layout(nlist, d, g)
    queries = torch.randint(-4, 5, (b, d), generator=g).float()
    centroids = torch.randint(-3, 4, (nlist, d), generator=g).float()
    cs = queries @ centroids.t()
    probes = torch.randint(-1, nlist, (b, p), generator=g)
    bitmask = torch.randint(-(2**62), 2**62, (b, p, bitmask_words(off)), generator=g) if with_mask else None
    qscale = quantize_queries(queries)[1]
    best = torch.tensor([max([float(cs[i, c]) for c in probes[i].tolist() if c >= 0], default=0.0) for i in range(b)])
    whole = torch.round(best.double() / qscale.double())
    shift = (whole * qscale.double()).float()
    bias = (torch.round(cs.double() / qscale.double()[:, None]) - whole[:, None]).clamp(BIAS_FLOOR, 0).to(torch.int32)
    ref_ints, ref_rows = ivf_scan_reference(queries, codes, off, probes, k, bitmask, bias)
    # the reference's bias, re-derived row by row (independent of its searchsorted)
    qc = quantize_queries(queries)[0].long()
    for i in range(b):
        rows = [r for r in ref_rows[i].tolist() if r >= 0]
        for r, c, s in zip(rows, _cluster_of(off, rows), ref_ints[i].tolist()):
            assert s == int(codes[r].long() @ qc[i]) + int(bias[i, c])
    want = ref_ints.float() * qscale[:, None] + shift[:, None]
    for got_s, got_r in _both_paths(lambda: torch.ops.silverrec.ivf_scan(queries, codes, ONE, ZERO, off, probes, k,
                                                                         bitmask, 0, centroids, queries)):
        assert torch.equal(got_r, ref_rows)
        valid = ref_rows >= 0
        torch.testing.assert_close(got_s[valid], want[valid])
        assert torch.all(got_s[~valid] == float("-inf"))


def test_ivf_scan_cluster_term_changes_the_ranking():
    """Two clusters of identical codes: the cluster with the higher score wins every slot."""
    codes = torch.randint(-50, 50, (1, 8), dtype=torch.int8).repeat(40, 1)
    off = torch.tensor([0, 20, 40])
    q = torch.randn(1, 8)
    probes = torch.tensor([[0, 1]])
    towards, away = torch.cat([torch.zeros(1, 8), q]), torch.cat([q, torch.zeros(1, 8)])  # <q, centroid 1> > 0 = ...
    _, rows = torch.ops.silverrec.ivf_scan(q, codes, ONE, ZERO, off, probes, 20, None, 0, towards, q)
    assert rows.min() >= 20
    _, rows = torch.ops.silverrec.ivf_scan(q, codes, ONE, ZERO, off, probes, 20, None, 0, away, q)
    assert rows.max() < 20


@pytest.mark.parametrize("nlist, d, b, k, dense", [(25, 16, 7, 40, False), (12, 32, 4, 900, True), (40, 8, 9, 3, False)])
def test_filtered_topk_adds_the_cluster_term(nlist, d, b, k, dense):
    """Whole-pool queries (dense: most rows pass, the C++ masked scan; else the compacted rows) and
    posting-list queries, against brute force with the bias of each row's cluster: its cluster term
    <query, centroid> less the best term among the clusters holding the query's allowed rows, in the
    scores' integer unit (integer centroids and queries: every float sum exact)."""
    g = torch.Generator().manual_seed(nlist + d + b)
    codes, off = _layout(nlist, d, g)
    n = codes.shape[0]
    queries = torch.randint(-4, 5, (b, d), generator=g).float()
    centroids = torch.randint(-3, 4, (nlist, d), generator=g).float()
    cs = queries @ centroids.t()
    bank = torch.full((3, (n + 63) // 64), -1, dtype=torch.int64) if dense else _bank(11, n, g)
    ops, prow = (torch.ones(b, 1, dtype=torch.int64), torch.zeros(b, 1, 1, dtype=torch.int64)) if dense else \
        _programs(b, 5, 2, 11, g)
    post_rows, post_off, lists = _postings(n, 7, g)
    sel = torch.full((b, 2), -1, dtype=torch.int64)
    for i in range(b):
        if i % 2 == 0 or dense:
            sel[i, 0] = NO_LISTS
        else:
            sel[i, 0], sel[i, 1] = i % 7, (i + 3) % 7
    active = torch.ones(b, dtype=torch.bool)
    active[-1] = False
    allowed = _allowed_from(bank, ops, prow, n, sel, lists, active)
    cluster = torch.tensor(_cluster_of(off, range(n)), dtype=torch.int64)
    qscale = quantize_queries(queries)[1]
    row_bias, shift = torch.zeros(b, n, dtype=torch.int64), torch.zeros(b)
    for i in range(b):  # the shift: the best term among the clusters of the query's allowed rows
        present = sorted(set(cluster[allowed[i]].tolist()))
        if present:
            u = float(qscale[i])
            best = round(max(float(cs[i, c]) for c in present) / u)
            shift[i] = best * u
            row_bias[i] = (torch.round(cs[i].double() / u) - best).clamp(BIAS_FLOOR, 0).long()[cluster]
    want_s, want_r = _expected(queries, codes, allowed, k, ONE, ZERO, row_bias, shift)

    def run():
        return torch.ops.silverrec.filtered_topk(queries, codes, ONE, ZERO, bank, [ops, prow], [post_rows, post_off, sel],
                                                 active, k, n, [off, centroids, queries])

    for got_s, got_r in _both_paths(run):
        assert torch.equal(got_r, want_r)
        valid = want_r >= 0
        torch.testing.assert_close(got_s[valid], want_s[valid])


def test_filtered_topk_names_a_half_given_cluster_term():
    codes, off = _layout(4, 8, torch.Generator().manual_seed(0))
    n = codes.shape[0]
    with pytest.raises(ValueError, match="go together"):
        torch.ops.silverrec.filtered_topk(torch.randn(1, 8), codes, ONE, ZERO, torch.zeros(1, (n + 63) // 64, dtype=torch.int64),
                                          [torch.ones(1, 1, dtype=torch.int64), torch.zeros(1, 1, 1, dtype=torch.int64)],
                                          [torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                                           torch.full((1, 1), NO_LISTS)], torch.ones(1, dtype=torch.bool), 5, n, [off])


@pytest.mark.parametrize("B, K, D, k, nlist, max_size", [(3, 30, 16, 10, 10, 40), (2, 12, 40, 20, 10, 40),
                                                        (2, 200, 8, 150, 300, 4), (2, 300, 8, 100, 20, 200)])
def test_rescore_rows_adds_the_cluster_term(B, K, D, k, nlist, max_size):
    """Against float64 with each row's cluster found by a search of the offsets; the last layouts have three
    empty clusters at the end, and hundreds of clusters of 0-3 rows, or 20 of up to 200 (the op's row -> cluster
    buckets: one row each, or 32)."""
    g = torch.Generator().manual_seed(B * K)
    codes, off = _layout(nlist, D, g, max_size=max_size)
    off[-4:] = off[-1]
    n = codes.shape[0]
    q = torch.randint(-3, 4, (B, D), generator=g).float()  # integer data: exact float32 sums
    scale = torch.randint(1, 4, (D,), generator=g).float()
    offset = torch.randint(-2, 3, (D,), generator=g).float()
    centroids = torch.randint(-5, 6, (nlist, D), generator=g).float()
    cs = q @ centroids.t()
    found = torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(B)])
    found[:, -2:] = -1
    want_s = np.full((B, k), -np.inf)
    want_r = np.full((B, k), -1)
    for b in range(B):
        rows = [r for r in found[b].tolist() if r >= 0]
        scored = sorted((-(float(q[b].double() @ (scale.double() * codes[r].double() + offset.double()))
                           + float(cs[b, c])), j, r)
                        for j, (r, c) in enumerate(zip(rows, _cluster_of(off, rows))))[:k]
        for i, (s, _, r) in enumerate(scored):
            want_s[b, i], want_r[b, i] = -s, r
    for got_s, got_r in _both_paths(lambda: torch.ops.silverrec.rescore_rows(q, found, codes, scale, offset, k, off, centroids)):
        assert got_r.tolist() == want_r.tolist()
        assert np.array_equal(got_s.double().numpy(), want_s)


@pytest.fixture(scope="module")
def sift():
    base, queries = load_ann("bigann10k")
    return base.astype(np.float32), queries[:64].astype(np.float32)


def _publish(base, residual):
    from silverrec.publish.ivf import IVFConfig, build_ivf
    from silverrec.publish.pool import Pool

    index, _ = build_ivf(Pool(np.arange(base.shape[0], dtype=np.int64), base.copy()),
                         IVFConfig(nlist=32, seed=0, niter=6, residual=residual))
    return index


def _decode_error(index, base):
    rows = torch.arange(index.codes.shape[0])
    return float(((index.decode(rows) - torch.from_numpy(base)[index.row_to_item.long()]) ** 2).mean())


def test_auto_keeps_direct_codes_for_sift_and_residual_search_is_exact(sift):
    """bigann10k's values are integers that direct codes hold exactly: "auto" keeps them. A residual
    index forced on it still searches right: with every cluster probed, its top 100 are the decoded
    items' own top 100 by inner product (up to the int8 query's rounding before the re-score)."""
    base, queries = sift
    auto, res = _publish(base, "auto"), _publish(base, True)
    assert not auto.residual and res.residual
    assert _decode_error(auto, base) < _decode_error(res, base)
    decoded = res.decode(torch.arange(res.codes.shape[0])).numpy()
    own = res.row_to_item.long().numpy()[inner_product_topk(decoded, queries, 100)]
    _, ids = res(torch.from_numpy(queries), 100, 32)
    assert recall(ids.numpy(), own) >= 0.97


def test_auto_picks_residual_codes_for_a_mixture_and_they_find_more():
    """Clustered vectors (a Gaussian mixture, where Faiss IVF-SQ8's by_residual pays): "auto" picks
    residual codes, which decode closer and find more of the float brute-force top 100 (probing every
    cluster) than direct codes."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(40, 32, generator=g) * 3
    base = (centres[torch.randint(0, 40, (8000,), generator=g)] + torch.randn(8000, 32, generator=g)).numpy()
    queries = base[:64] + np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32)
    truth = inner_product_topk(base, queries, 100)
    auto, direct = _publish(base, "auto"), _publish(base, False)
    assert auto.residual
    assert _decode_error(auto, base) < 0.7 * _decode_error(direct, base)
    found = {name: recall(index(torch.from_numpy(queries), 100, 32)[1].numpy(), truth)
             for name, index in (("residual", auto), ("direct", direct))}
    assert found["residual"] > found["direct"], found


def test_published_residual_snapshot_answers_like_its_decoded_items(tmp_path):
    """The public API on a residual snapshot: probed (every cluster), whole-pool / posting-list
    ("unprobed") and filtered searches find the decoded items' own top 100 by inner product among
    the rows each filter allows (what the snapshot can know of its items)."""
    import silverrec
    from silverrec.publish.filtered_ivf import publish_index
    from silverrec.publish.ivf import IVFConfig
    from silverrec.publish.pool import Pool

    g = torch.Generator().manual_seed(1)
    n, d, nlist = 6000, 24, 24
    centres = torch.randn(30, d, generator=g) * 3
    x = (centres[torch.randint(0, 30, (n,), generator=g)] + torch.randn(n, d, generator=g)).numpy()
    feats = {"color": [[["red", "green", "blue"][int(v)]] for v in torch.randint(0, 3, (n,), generator=g)]}
    ids = np.arange(n, dtype=np.int64) * 7 + 1
    snap = silverrec.load(publish_index(Pool(ids, x.copy(), feats), tmp_path / "s",
                                        config=IVFConfig(nlist=nlist, residual=True), torchscript=False))
    assert snap.config["quantization"]["residual"] is True
    from silverrec.snapshot import read_manifest, read_tensors

    t = read_tensors(snap.path, read_manifest(snap.path))
    if not t:  # the exported program's state
        t = {k: v for k, v in snap.module.state_dict().items()}
    t = {k.split("sources.index.")[-1]: v for k, v in t.items() if "sources.index." in k}
    off = t["cluster_offsets"]
    cluster = torch.repeat_interleave(torch.arange(nlist), off[1:] - off[:-1])
    decoded = t["centroids"][cluster] + t["codes"].float() * t["dim_scale"] + t["dim_offset"]
    row_ids = t["row_to_item"].long()
    red = torch.tensor([feats["color"][(int(i) - 1) // 7] == ["red"] for i in row_ids])
    q = torch.from_numpy(x[:32] + 0.5 * np.random.default_rng(0).normal(size=(32, d)).astype(np.float32))
    s = q @ decoded.t()
    for filt, allowed, mode in ((None, torch.ones_like(red), "auto"), ("color = red", red, "auto"),
                                ("color = red", red, "unprobed")):
        own = row_ids[torch.topk(torch.where(allowed, s, float("-inf")), 100, dim=1).indices]
        res = snap.search(q, 100, nprobe=nlist, filter=filt, mode=mode)
        assert recall(res.item_ids.numpy(), own.numpy()) >= 0.97, (filt, mode)
        if filt is not None:  # every result passes the filter
            assert all(feats["color"][(int(i) - 1) // 7] == ["red"] for i in res.item_ids[res.item_ids >= 0].tolist())


@pytest.mark.parametrize("d", [8, 40, 96, 128])
def test_fused_search_computes_the_terms_of_the_composition(d):
    """The fused C++ search against the torch composition, bit for bit, on float data (sums inexact, so
    any change of summation order shows): whole-pool and posting-list queries in groups of one, of 3 and
    of 18 sharing a filter (the C++ op computes a group's terms 16 queries at a time, one query alone),
    probed queries, a dimension below 16 and one with a ragged 16-lane tail; with the float re-score,
    which reads the terms the routes computed (and whose few-survivor exact routes the C++ op ranks in
    float itself, at the compile-time widths 96 and 128 too)."""
    from silverrec.kernels.filtered_ivf_search import filtered_ivf_search_torch

    rng = np.random.default_rng(d)
    n, nlist = 4000, 30
    centres = rng.normal(size=(40, d)).astype(np.float32) * 3
    x = centres[rng.integers(0, 40, n)] + rng.normal(size=(n, d)).astype(np.float32)
    feats = {"shade": [[f"s{v}"] for v in rng.integers(0, 12, n)], "size": [[f"z{v}"] for v in rng.integers(0, 3, n)]}
    pool = Pool(np.arange(n, dtype=np.int64) + 5, x, feats)
    module, manifest = build_filtered_ivf(pool, IVFConfig(nlist=nlist, residual=True))
    assert module.residual
    filters = ["shade = s3 AND size = z1"] * 18 + ["size = z2"] * 3 + ["shade = s7", "NOT size = z0", None, "shade = s1"]
    b = len(filters)
    q = torch.from_numpy(x[rng.integers(0, n, b)] + 0.5 * rng.normal(size=(b, d)).astype(np.float32))
    modes = torch.full((b,), MODE_UNPROBED)
    modes[-2:] = MODE_PROBED
    program = list(compile_request(filters, FilterPlan.from_config(manifest["filter"])))
    for k, margin in ((30, rescore_margin(30)), (30, 0), (700, 0)):
        args = module.filtered_search_args(q, program, modes, k, 6, 12, margin, 256)
        with torch.inference_mode():
            fused = torch.ops.silverrec.filtered_ivf_search(*args)
            composed, composed_torch = _both_paths(lambda: filtered_ivf_search_torch(*args))
        for other in (composed, composed_torch):
            assert torch.equal(fused[1], other[1]), k
            assert torch.equal(fused[0], other[0]), k
        assert (fused[1][:18, 0] >= 0).all() and (fused[1][-1, 0] >= 0)


def test_rows_of_far_clusters_rank_on_every_path():
    """The query's best cluster holds no passing row, and the clusters that do sit 2**26 units below it:
    the C++ op shifts by the best cluster holding passing rows, the CUDA function (run here on CPU
    tensors, Triton interpreted) by the best of all clusters. Both must rank like brute force, so the
    far clusters must stay above BIAS_FLOOR; with the old floor, 2**24, they were clamped together and
    the CUDA path ranked their rows by their residual dots alone (a spread of 2**22.6 units is real:
    kernels/common.py cluster_bias)."""
    from silverrec.kernels.filtered_topk import filtered_topk_cuda

    g = torch.Generator().manual_seed(3)
    d, b, k = 8, 4, 40
    off = torch.tensor([0, 50, 110, 170])  # clusters 0, 1, 2; only the rows of 1 and 2 pass
    n = int(off[-1])
    codes = torch.randint(-127, 128, (n, d), dtype=torch.int8, generator=g)
    queries = torch.randint(-4, 5, (b, d), generator=g).float()
    queries[:, 0] = 4  # max |q| = 4: the unit u = 4 / 127
    centroids = torch.zeros(3, d)
    centroids[0, 0] = 2 ** 26 / 127  # cluster 0: q[0] * this / u = 2**26 units above the others
    centroids[1, 1:] = torch.randint(-300, 301, (d - 1,), generator=g).float()
    centroids[2, 1:] = torch.randint(-300, 301, (d - 1,), generator=g).float()
    passing = torch.zeros(n, dtype=torch.bool)
    passing[50:] = True
    bank = pack_bits(passing[None])
    ops, prow = torch.ones(b, 1, dtype=torch.int64), torch.zeros(b, 1, 1, dtype=torch.int64)
    sel = torch.full((b, 1), NO_LISTS, dtype=torch.int64)
    args = (queries, codes, ONE, ZERO, bank, [ops, prow], [torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
            sel], torch.ones(b, dtype=torch.bool), k, n, [off, centroids, queries])
    qcodes, qscale = quantize_queries(queries)
    cs = dot_lanes(queries[:, None, :], centroids[None])
    exact = qcodes.to(torch.int64) @ codes.to(torch.int64).t() + torch.round(cs.double() / qscale.double()[:, None]).long()[
        :, torch.tensor(_cluster_of(off, range(n)))]
    order = torch.sort(-torch.where(passing, exact, torch.iinfo(torch.int64).min + 1), dim=1, stable=True).indices
    want = order[:, :k]  # best first, ties to the lower row
    assert (cs[:, 0] - cs[:, 1:].amax(1) > 2 ** 25 * qscale).all()  # far below cluster 0 for every query
    for got_s, got_r in (torch.ops.silverrec.filtered_topk(*args), filtered_topk_cuda(*args)):
        assert torch.equal(got_r, want), "rows of the far clusters ranked otherwise"
        assert (got_r >= 50).all()
