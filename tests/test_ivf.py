"""Int8 IVF index: ivf_scan vs independent references, recall bounds, padding, bitmask, export, CLI."""

import json
import numpy as np
import pytest
import torch

import silverrec
from silverrec.errors import QueryError
from silverrec.retrieval.ivf_index import Int8IVFIndex
from silverrec.kernels.common import quantize_queries, split_keys
from silverrec.kernels.rescore_rows import RESCORE_MAX_K, rescore_margin, rescore_rows_torch
from silverrec.kernels.ivf_scan import bitmask_words, ivf_scan_reference
from silverrec.kernels.library import host
from silverrec.publish.filtered_ivf import publish_index
from silverrec.publish.ivf import IVFConfig, build_ivf
from silverrec.publish.pool import Pool, write_pool
from tests.helpers import inner_product_topk, load_ann, run_cli

SCALE, OFFSET = torch.tensor(0.013), torch.tensor(-0.2)


def _random_layout(n, d, nlist, seed=0):
    """Random cluster sizes (some empty, none 64-aligned on purpose), random codes."""
    g = torch.Generator().manual_seed(seed)
    cut = torch.sort(torch.randint(0, n + 1, (nlist - 1,), generator=g)).values
    off = torch.cat([torch.zeros(1, dtype=torch.int64), cut, torch.tensor([n])])
    off[3] = off[2]  # cluster 2 empty
    codes = torch.randint(-128, 128, (n, d), dtype=torch.int8, generator=g)
    return codes, off


def _probes(b, p, nlist, seed=0):
    g = torch.Generator().manual_seed(seed)
    pr = torch.stack([torch.randperm(nlist, generator=g)[:p] for _ in range(b)])
    pr[0, -1] = -1  # empty slot
    if p > 2:
        pr[1, 2] = pr[1, 0]  # repeated cluster: scanned once
        pr[2 % b, :] = -1  # a query that probes nothing
    return pr


def _gmm(n, d, centers, seed):
    g = torch.Generator().manual_seed(seed)
    c = 3.0 * torch.randn(centers, d, generator=g)
    x = c[torch.randint(0, centers, (n,), generator=g)] + torch.randn(n, d, generator=g)
    q = c[torch.randint(0, centers, (24,), generator=g)] + torch.randn(24, d, generator=g)
    return x, q


def exact_int8(index, q, k):
    """Exact int8 search on the index's codes by brute force, the queries folded and quantised as the index does:
    every row's int64 dot product, a stable sort (ties to the lower row) -> (scores [B, k] dequantised as the ops
    do, rows [B, k])."""
    folded, constant = index.fold(q)
    qcodes, qscale = quantize_queries(folded)
    dots = qcodes.long() @ index.codes.long().t()
    rows = torch.sort(-dots, dim=1, stable=True).indices[:, :k]
    return dots.gather(1, rows).float() * qscale[:, None] + constant[:, None], rows


def rescored(index, q, scores, rows, k):
    """A published snapshot's ranking of the scan's results (scores float32, rows int64 [B, k'];
    publish/filtered_ivf.py search_model): the float query on their codes, best k
    (kernels/rescore_rows.py's composition), or above RESCORE_MAX_K the scan's own first k
    -> (scores float32 [B, k], item ids int64 [B, k])."""
    if k > RESCORE_MAX_K:
        scores, top = scores[:, :k], rows[:, :k]
    else:
        scores, top = rescore_rows_torch(q, rows, index.codes, index.dim_scale, index.dim_offset, k)
    return scores, torch.where(top >= 0, index.row_to_item[top.clamp_min(0)].long(), -1)


def _rows_of(index, ids):
    """Item ids int64 [B, K] (-1 = none) -> the index's rows."""
    inverse = {int(i): r for r, i in enumerate(index.row_to_item.tolist())}
    return torch.tensor([[inverse.get(int(i), -1) for i in row] for row in ids.tolist()], dtype=torch.int64)


def _index(x, nlist, seed=0):
    pool = Pool(np.arange(x.shape[0], dtype=np.int64) * 10 + 3, x.numpy())
    index, _ = build_ivf(pool, IVFConfig(nlist=nlist, seed=seed, niter=6, residual=False))
    return index


@pytest.mark.parametrize(
    "n, d, nlist, b, p, k",
    [
        (2000, 24, 37, 5, 5, 10),
        (2000, 24, 37, 5, 37, 2000),  # every cluster, k = N
        (2000, 24, 37, 5, 8, 700),
        (999, 19, 16, 3, 3, 50),  # odd dims
        (600, 16, 5, 1, 1, 1),  # batch 1, k 1
    ],
)
@pytest.mark.parametrize("with_mask", [False, True])
def test_scan_equals_reference(n, d, nlist, b, p, k, with_mask):
    codes, off = _random_layout(n, d, nlist)
    queries = torch.randn(b, d)
    probes = _probes(b, p, nlist)
    bitmask = torch.randint(-(2**62), 2**62, (b, p, bitmask_words(off))) if with_mask else None
    ref_scores, ref_rows = ivf_scan_reference(queries, codes, off, probes, k, bitmask)
    keys = host().ivf_scan_keys(quantize_queries(queries)[0], codes, off, probes, bitmask, k)
    int_scores, rows = split_keys(keys)
    assert torch.equal(rows, ref_rows)
    assert torch.equal(torch.where(rows >= 0, int_scores, 0), ref_scores)
    # the registered op: same rows, scores dequantised, padding -inf
    scores, op_rows = torch.ops.silverrec.ivf_scan(queries, codes, SCALE, OFFSET, off, probes, k, bitmask)
    assert torch.equal(op_rows, ref_rows)
    qcodes, qscale = quantize_queries(queries)
    expect = ref_scores.float() * (SCALE * qscale)[:, None] + OFFSET * queries.sum(1, keepdim=True)
    expect = torch.where(ref_rows >= 0, expect, torch.tensor(float("-inf")))
    torch.testing.assert_close(scores, expect)
    assert torch.all(scores[:, :-1] >= scores[:, 1:])


def test_k_beyond_probed_items_pads():
    codes, off = _random_layout(1500, 8, 20, seed=1)
    queries = torch.randn(3, 8)
    probes = torch.tensor([[4, 7], [2, -1], [-1, -1]])  # cluster 2 is empty
    k = 1500
    scores, rows = torch.ops.silverrec.ivf_scan(queries, codes, SCALE, OFFSET, off, probes, k, None)
    sizes = off[1:] - off[:-1]
    expect_valid = [int(sizes[4] + sizes[7]), 0, 0]
    for b in range(3):
        m = expect_valid[b]
        assert torch.all(rows[b, :m] >= 0) and torch.all(rows[b, m:] == -1)
        assert torch.isfinite(scores[b, :m]).all() and torch.all(scores[b, m:] == float("-inf"))
    got = set(rows[0, : expect_valid[0]].tolist())
    assert got == set(range(int(off[4]), int(off[5]))) | set(range(int(off[7]), int(off[8])))


def _pack_window_bitmask(allowed: torch.Tensor, probes: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Independent packer: item-level allowed bool [B, N] -> int64 [B, P, Wc] per the contract."""
    b_n, p_n = probes.shape
    wc = bitmask_words(off)
    out = np.zeros((b_n, p_n, wc), dtype=np.uint64)
    for b in range(b_n):
        for j in range(p_n):
            c = int(probes[b, j])
            if c < 0:
                continue
            base = int(off[c]) >> 6
            for r in range(int(off[c]), int(off[c + 1])):
                if allowed[b, r]:
                    out[b, j, (r >> 6) - base] |= np.uint64(1) << np.uint64(r & 63)
    return torch.from_numpy(out.view(np.int64))


def test_bitmask_semantics_vs_masked_brute_force():
    x, q = _gmm(3000, 16, 12, seed=2)
    index = _index(x, 30)
    queries = q[:6]
    nprobe, k = 7, 40
    probes = index.probe(queries, nprobe)
    allowed = torch.rand(6, 3000) < 0.3
    bitmask = _pack_window_bitmask(allowed, probes, index.cluster_offsets)
    scores, ids = index.scan(queries, probes, k, bitmask)
    # brute force: exact int8 scores (of the folded queries) over rows that are probed AND allowed
    qcodes, _ = quantize_queries(index.fold(queries)[0])
    s = qcodes.long() @ index.codes.long().t()  # [B, N] (test only)
    off = index.cluster_offsets
    cluster_of_row = torch.repeat_interleave(torch.arange(index.nlist), off[1:] - off[:-1])
    probed = (cluster_of_row[None, :, None] == probes[:, None, :]).any(-1)
    ok = probed & allowed
    for b in range(6):
        rows = ok[b].nonzero().flatten()
        order = torch.sort(-s[b, rows], stable=True).indices[:k]
        expect_ids = index.row_to_item[rows[order]]
        got = ids[b][ids[b] >= 0]
        assert torch.equal(got, expect_ids)
        assert ids[b].numel() == k and (ids[b] < 0).sum() == k - expect_ids.numel()


def _recall_rows(found: np.ndarray, truth: np.ndarray) -> np.ndarray:
    return np.array([len(set(f) & set(t)) for f, t in zip(found.tolist(), truth.tolist())]) / truth.shape[1]


def _check_recall_bounds(index: Int8IVFIndex, base: np.ndarray, queries: np.ndarray, k: int, nprobe: int):
    """Per query: recall(IVF) <= coverage and recall(IVF) >= coverage - (1 - recall(exact int8)).

    coverage = fraction of the true (float64) top-k whose cluster is probed. Derivation of the lower
    bound: a true neighbour in a probed cluster that IVF misses has k probed items with a better int8
    key; those beat it in the whole pool too, so exact int8 search misses it as well.
    """
    truth = inner_product_topk(base, queries, k)  # item rows in pool order
    q = torch.from_numpy(queries)
    _, ids = index(q, k, nprobe)
    # item ids are 10 * pool_row + 3
    found = ((ids.numpy() - 3) // 10)
    # independent probe: float64 top-nprobe centroids
    cs = queries.astype(np.float64) @ index.centroids.numpy().astype(np.float64).T
    probed = np.argsort(-cs, axis=1, kind="stable")[:, :nprobe]
    assert torch.equal(torch.from_numpy(np.sort(probed, 1)), index.probe(q, nprobe).sort(1).values)
    off = index.cluster_offsets.numpy()
    cluster_of_row = np.repeat(np.arange(index.nlist), np.diff(off))
    pool_row_of_row = (index.row_to_item.numpy() - 3) // 10
    cluster_of_item = np.empty_like(cluster_of_row)
    cluster_of_item[pool_row_of_row] = cluster_of_row
    coverage = np.array([np.isin(cluster_of_item[t], p).mean() for t, p in zip(truth, probed)])
    _, exact_ids = exact_int8(index, q, k)
    exact_recall = _recall_rows((index.row_to_item[exact_ids].numpy() - 3) // 10, truth)
    ivf_recall = _recall_rows(found, truth)
    assert np.all(ivf_recall <= coverage + 1e-12)
    assert np.all(ivf_recall >= coverage - (1 - exact_recall) - 1e-12)
    return ivf_recall, coverage, exact_recall


def test_recall_bounds_on_clustered_data():
    x, q = _gmm(20000, 32, 50, seed=3)
    index = _index(x, 100)
    for nprobe in (4, 16):
        ivf, coverage, exact = _check_recall_bounds(index, x.numpy(), q.numpy(), 50, nprobe)
        # the derived floor is not vacuous on this data
        assert (coverage - (1 - exact)).mean() > 0.5
    # more probes never lose coverage; all probes = exact int8 recall
    ivf_all, coverage_all, exact = _check_recall_bounds(index, x.numpy(), q.numpy(), 50, index.nlist)
    assert np.all(coverage_all == 1.0) and np.allclose(ivf_all, exact)


def test_recall_bounds_on_real_vectors():
    base, queries = load_ann("bigann10k")
    base = base / np.float32(np.abs(base).max())
    queries = queries[:32] / np.float32(np.abs(base).max())
    index = _index(torch.from_numpy(base), 100, seed=1)
    ivf, coverage, exact = _check_recall_bounds(index, base, queries, 100, 10)
    assert ivf.mean() > 0  # finds real neighbours
    assert exact.mean() > 0.9  # int8 loses little on SIFT vectors (measured 0.99)


def test_all_probes_equal_exact_int8():
    x, q = _gmm(5000, 24, 20, seed=4)
    index = _index(x, 40)
    for k in (1, 37, 5000):
        scores, ids = index(q, k, index.nlist)
        e_scores, e_rows = exact_int8(index, q, k)
        assert torch.equal(ids, index.row_to_item[e_rows])
        assert torch.equal(scores, e_scores)


def test_layout_and_memory_budget():
    x, _ = _gmm(4000, 128, 10, seed=5)
    index = _index(x, 64)
    off = index.cluster_offsets
    assert off[0] == 0 and off[-1] == 4000 and torch.all(off[1:] >= off[:-1])
    # rows really are cluster-major: every row's nearest centroid (L2) is its cluster
    cluster_of_row = torch.repeat_interleave(torch.arange(64), off[1:] - off[:-1])
    pool_row = (index.row_to_item - 3) // 10
    d = torch.cdist(x[pool_row], index.centroids)
    torch.testing.assert_close(d.gather(1, cluster_of_row[:, None])[:, 0], d.min(1).values)
    # codes are the per-dimension-range quantisation of the item, within half a step
    approx = index.dim_scale * index.codes.float() + index.dim_offset
    assert bool(((approx - x[pool_row]).abs() <= index.dim_scale * 0.5 + 1e-5).all())
    n, dim = index.codes.shape
    total = sum(t.numel() * t.element_size() for t in index.buffers())
    centroids = index.centroids.numel() * 4
    assert total <= 1.1 * n * dim + centroids


def test_deterministic_build():
    x, _ = _gmm(3000, 16, 8, seed=6)
    a, b, c = _index(x, 20, seed=5), _index(x, 20, seed=5), _index(x, 20, seed=6)
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name
    assert not torch.equal(a.centroids, c.centroids)


def test_bad_inputs():
    codes, off = _random_layout(300, 8, 6)
    q = torch.randn(2, 8)
    ok = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="probes"):
        torch.ops.silverrec.ivf_scan(q, codes, SCALE, OFFSET, off, torch.tensor([[0, 6], [1, 2]]), 3, None)
    with pytest.raises(ValueError, match="probes"):
        torch.ops.silverrec.ivf_scan(q, codes, SCALE, OFFSET, off, ok.int(), 3, None)
    with pytest.raises(ValueError, match="bitmask"):
        torch.ops.silverrec.ivf_scan(q, codes, SCALE, OFFSET, off, ok, 3, torch.zeros(2, 2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="k must"):
        torch.ops.silverrec.ivf_scan(q, codes, SCALE, OFFSET, off, ok, 0, None)
    with pytest.raises(ValueError, match="cluster_offsets"):
        torch.ops.silverrec.ivf_scan(q, codes, SCALE, OFFSET, off - 1, ok, 3, None)
    with pytest.raises(ValueError, match="queries"):
        torch.ops.silverrec.ivf_scan(torch.randn(2, 9), codes, SCALE, OFFSET, off, ok, 3, None)


def test_export_round_trip_and_cli(tmp_path, capsys):
    x, q = _gmm(3000, 16, 10, seed=7)
    ids = np.arange(3000, dtype=np.int64) * 7 + 1
    write_pool(tmp_path / "pool.parquet", ids, x.numpy())
    run_cli("publish", "--pool", str(tmp_path / "pool.parquet"), "--out", str(tmp_path / "snap"),
            "--nlist", "24", "--seed", "3", "--residual", "off")
    manifest = json.loads((tmp_path / "snap" / "manifest.json").read_text())
    assert manifest["kind"] == "rec" and manifest["config"]["nlist"] == 24
    assert manifest["config"]["build"]["seed"] == 3
    assert manifest["config"]["bitmask_words"] >= 1
    # in-process reference with the same build settings
    index, _ = build_ivf(Pool(ids, x.numpy()), IVFConfig(nlist=24, seed=3, residual=False))
    queries = torch.cat([q[:5]] * 3)  # batch 15: neither the export example's batch nor k/nprobe
    np.save(tmp_path / "q.npy", queries.numpy())
    qfile, snap = str(tmp_path / "q.npy"), str(tmp_path / "snap")
    # a fresh process loads the exported program (ops registered by importing silverrec)
    out = run_cli("query", snap, "--queries", qfile, "--k", "300", "--nprobe", "7", "--json")
    got = json.loads(out.stdout)
    kk = 300 + rescore_margin(300)
    scan_scores, found = index(queries, kk, 7)
    exp_scores, exp_ids = rescored(index, queries, scan_scores, _rows_of(index, found), 300)  # k 300: the scan's
    assert exp_ids.tolist() == index(queries, 300, 7)[1].tolist()
    assert got["item_ids"] == exp_ids.tolist()
    got_scores = np.array([[-np.inf if v is None else v for v in row] for row in got["scores"]])
    np.testing.assert_allclose(got_scores, exp_scores.numpy(), rtol=1e-6)
    # TorchScript backend and error exit, in process
    from silverrec.cli import main

    assert main(["query", snap, "--queries", qfile, "--k", "9", "--nprobe", "5", "--json", "--backend", "torchscript"]) == 0
    got = json.loads(capsys.readouterr().out)
    scan_scores, found = index(queries, 9 + rescore_margin(9), 5)
    assert got["item_ids"] == rescored(index, queries, scan_scores, _rows_of(index, found), 9)[1].tolist()
    assert main(["query", snap, "--queries", qfile, "--k", "9", "--nprobe", "25"]) == 2
    assert "nprobe" in capsys.readouterr().err


def test_predictor_nprobe_validation(tmp_path):
    x, q = _gmm(500, 8, 4, seed=8)
    snap_dir = publish_index(Pool(np.arange(500, dtype=np.int64), x.numpy()), tmp_path / "s",
                           config=IVFConfig(nlist=10, residual=False), torchscript=False)
    snap = silverrec.load(snap_dir)
    assert snap.search(q[:2], 5).item_ids.shape == (2, 5)  # default nprobe
    for bad in (0, 11, 2.5, True):
        with pytest.raises(QueryError, match="nprobe"):
            snap.search(q[:2], 5, nprobe=bad)
    with pytest.raises(QueryError, match="filter"):
        snap.search(q[:2], 5, filter="genre = x")
    # nprobe = nlist through the snapshot equals exact int8 search, its top rows re-scored
    index, _ = build_ivf(Pool(np.arange(500, dtype=np.int64), x.numpy()), IVFConfig(nlist=10, residual=False))
    r = snap.search(q, 20, nprobe=10)
    e_scores, e_rows = exact_int8(index, q, 20 + rescore_margin(20))
    e_scores, e_ids = rescored(index, q, e_scores, e_rows, 20)
    assert torch.equal(r.item_ids, e_ids)
    torch.testing.assert_close(r.scores, e_scores)


@pytest.mark.parametrize("residual", [False, True])
def test_forward_is_scan_of_probe_bit_for_bit(residual):
    """forward (one fused op, `silverrec::ivf_search`) == scan(probe) (the two public steps), scores and ids, with
    k past the probed items and nprobe = nlist; the op's C++ kernel == its composition (kernels/filtered_ivf_search.py
    ivf_search_torch), with the C++ kernels and with the reference kernels (tests/reference_kernels.py), also with the float re-score and as rows."""
    from silverrec.kernels.filtered_ivf_search import ivf_search_torch
    from tests.reference_kernels import cpp_and_reference as _both_paths

    g = torch.Generator().manual_seed(7)
    x = torch.randn(3000, 40, generator=g)
    index, _ = build_ivf(Pool(np.arange(3000, dtype=np.int64) * 7, x.numpy()), IVFConfig(nlist=24, seed=0, residual=residual))
    q = torch.randn(9, 40, generator=g)
    with torch.inference_mode():
        for k, nprobe in [(1, 1), (10, 3), (100, 8), (500, 2), (3100, 24)]:
            want = index.scan(q, index.probe(q, nprobe), k)
            got = index(q, k, nprobe)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (k, nprobe)
            for margin, item_ids in ((0, False), (rescore_margin(k), True)):
                args = index.search_args(q, k, nprobe, margin, RESCORE_MAX_K, item_ids)
                fused = torch.ops.silverrec.ivf_search(*args)
                for other in _both_paths(lambda: ivf_search_torch(*args)):
                    assert torch.equal(fused[1], other[1]), (k, nprobe, margin)
                    if margin == 0 or k > RESCORE_MAX_K:
                        assert torch.equal(fused[0], other[0]), (k, nprobe, margin)
                    else:  # the re-score's sums: float32 summation order
                        torch.testing.assert_close(fused[0], other[0], rtol=1e-5, atol=1e-5)
