"""`silverrec::rescore_rows` (kernels/rescore_rows.py, kernels/csrc/rescore.cpp) against a per-query
float64 Python re-score, and the pure-ANN root module's re-scored search against float brute force on
the decoded codes (the re-score's own definition, independent of the scan).

The C++ kernel's dot products sum in another order than the composition's batched matmul, so the
op-vs-reference tests use integer-valued queries, codes, scales and offsets (every sum is exact), where
the two orders agree bit for bit and ties are common: the tie rule (position in the scan's list) is
exercised too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import silverrec.kernels  # noqa: F401  (registers the ops)
from tests.helpers import runs_cpp_kernel
from silverrec.kernels.rescore_rows import RESCORE_MAX_K, rescore_margin, rescore_rows_torch
from tests.test_filter_ivf import built  # noqa: F401  (the filtered index fixture)


def _reference(q, found, codes, scale, offset, k):
    """Per query, in Python: the found rows scored <q, scale * code + offset> in float64, the best k by
    (score desc, position asc), -inf / -1 padded."""
    q, codes, scale, offset = q.double().numpy(), codes.double().numpy(), scale.double().numpy(), offset.double().numpy()
    scores = np.full((q.shape[0], k), -np.inf)
    rows = np.full((q.shape[0], k), -1, dtype=np.int64)
    for b in range(q.shape[0]):
        scored = sorted((-float(q[b] @ (scale * codes[r] + offset)), j, r)
                        for j, r in enumerate(found[b].tolist()) if r >= 0)[:k]
        for i, (s, _, r) in enumerate(scored):
            scores[b, i], rows[b, i] = -s, r
    return torch.from_numpy(scores).float(), torch.from_numpy(rows)


def _case(seed, B, K, D, n, pad=3):
    """(queries, the scan's rows, codes, scale, offset): integer values throughout."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (B, D), generator=g).float()
    codes = torch.randint(-128, 128, (n, D), generator=g).to(torch.int8)
    scale = torch.randint(1, 4, (D,), generator=g).float()
    offset = torch.randint(-2, 3, (D,), generator=g).float()
    found = torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(B)])
    found[:, K - pad:] = -1  # the scan's padding
    if B > 1:
        found[1] = -1  # a query the scan found nothing for
    return q, found, codes, scale, offset


@pytest.mark.parametrize("B,K,D,n,k", [
    (1, 40, 16, 60, 20),    # one query, k below K
    (5, 17, 7, 25, 17),     # D below one 16-lane block, k = K
    (4, 33, 40, 90, 8),     # D with a ragged tail
    (3, 12, 16, 30, 50),    # k above K: -inf / -1 padding
    (6, 25, 128, 200, 1),   # k 1
])
def test_rescore_rows_equals_the_reference(B, K, D, n, k):
    q, found, codes, scale, offset = _case(B * 100 + K, B, K, D, n)
    scores, rows = torch.ops.silverrec.rescore_rows(q, found, codes, scale, offset, k)
    assert scores.shape == rows.shape == (B, k) and scores.dtype == torch.float32 and rows.dtype == torch.int64
    want_scores, want_rows = _reference(q, found, codes, scale, offset, k)
    assert torch.equal(rows, want_rows) and torch.equal(scores, want_scores)
    got_t = rescore_rows_torch(q, found, codes, scale, offset, k)  # the CUDA path's composition
    assert torch.equal(got_t[0], scores) and torch.equal(got_t[1], rows)


def test_rescore_rows_runs_the_cpp_kernel_and_drops_nan_scores():
    assert runs_cpp_kernel("rescore_rows"), "the operator library registers the C++ kernel"
    q, found, codes, scale, offset = _case(7, 3, 20, 16, 40)
    q[0] = float("nan")  # query 0 scores NaN everywhere: nothing returned
    scores, rows = torch.ops.silverrec.rescore_rows(q, found, codes, scale, offset, 10)
    assert bool((rows[0] == -1).all()) and bool((scores[0] == float("-inf")).all())
    want = _reference(q[2:], found[2:], codes, scale, offset, 10)
    assert torch.equal(rows[2:], want[1]) and torch.equal(scores[2:], want[0])
    got_t = rescore_rows_torch(q, found, codes, scale, offset, 10)
    assert torch.equal(got_t[0], scores) and torch.equal(got_t[1], rows)


def test_rescore_rows_bad_input_is_named():
    q, found, codes, scale, offset = _case(3, 2, 10, 8, 20)
    bad = found.clone()
    bad[0, 0] = 20  # one past the last of 20 coded rows
    op = torch.ops.silverrec.rescore_rows
    with pytest.raises(IndexError, match="row 20 out of range"):
        op(q, bad, codes, scale, offset, 5)
    with pytest.raises(RuntimeError, match="disagree"):
        op(q[:, :4], found, codes, scale, offset, 5)
    with pytest.raises(RuntimeError, match="codes must be int8"):
        op(q, found, codes.float(), scale, offset, 5)


def test_rescore_margin_grows_with_k():
    assert [rescore_margin(k) for k in (1, 100, 4096)] == [4, 10, 260]


def test_published_search_ranks_by_the_float_query_on_the_codes(tmp_path):
    """A pure-ANN snapshot searched over every cluster (the scan is then exact up to the int8 query)
    returns the float brute-force top-k of <q, dim_scale * code + dim_offset> (the re-score's own
    definition, computed here in float64), scores included: the int8 scan alone misses some of them,
    which the margin's rows catch."""
    import silverrec
    from silverrec.publish.ivf import IVFConfig, build_ivf
    from silverrec.publish.pool import Pool
    from silverrec.publish.filtered_ivf import publish_index
    from tests.helpers import recall

    g = torch.Generator().manual_seed(11)
    centers = 3.0 * torch.randn(20, 32, generator=g)
    x = centers[torch.randint(0, 20, (4000,), generator=g)] + torch.randn(4000, 32, generator=g)
    q = centers[torch.randint(0, 20, (64,), generator=g)] + torch.randn(64, 32, generator=g)
    pool = Pool(np.arange(4000, dtype=np.int64) * 3 + 5, x.numpy())
    snap = silverrec.load(publish_index(pool, tmp_path / "s", config=IVFConfig(nlist=16, seed=0, residual=False), torchscript=False))
    index, _ = build_ivf(pool, IVFConfig(nlist=16, seed=0, residual=False))  # the published index (seeded)
    decoded = index.codes.double() * index.dim_scale.double() + index.dim_offset.double()
    exact = q.double() @ decoded.t()
    k = 50
    truth = index.row_to_item[torch.topk(exact, k, dim=1).indices].numpy()
    got = snap.search(q, k, nprobe=16)
    assert snap.config["search"]["rescore"] is True
    assert recall(got.item_ids.numpy(), truth) == 1.0
    rows = {int(i): r for r, i in enumerate(index.row_to_item.tolist())}
    want = torch.stack([exact[b, [rows[int(i)] for i in got.item_ids[b]]] for b in range(64)]).float()
    torch.testing.assert_close(got.scores, want, rtol=1e-5, atol=1e-4)
    int8_only = index(q, k, 16)[1].numpy()  # the scan's own ranking misses some of them
    assert recall(int8_only, truth) < 1.0
    # above RESCORE_MAX_K the snapshot returns the scan's ranking as it is
    big = RESCORE_MAX_K + 1
    got = snap.search(q, big, nprobe=16)
    scan_scores, scan_ids = index(q, big, 16)
    assert torch.equal(got.item_ids, scan_ids) and torch.equal(got.scores, scan_scores)


def test_the_search_op_rescores_inside(built):  # noqa: F811  (tests/test_filter_ivf.py's fixture)
    """`filtered_ivf_search` with a re-score margin: the C++ op equals the composition (ids; scores up
    to float32 summation order) and exact filtered brute force re-scored in float64; above
    rescore_max_k it equals the search without re-score."""
    from silverrec.filtering.filter_program import compile_request
    from silverrec.kernels.constants import MODE_UNPROBED
    from silverrec.kernels.filtered_ivf_search import filtered_ivf_search_torch
    from tests.test_filter_ivf import _exact_filtered_rescored, assert_same_ranking

    _, m, _, plan, fwd, queries = built
    filters = ["country = c0", "country = c2 AND NOT lang = l0", "rare IN (r7, r8, r9)", "NOT lang = l1"] * 2
    program, modes = list(compile_request(filters, plan)), torch.full((8,), MODE_UNPROBED)  # the exact routes
    q = queries[:8]

    def args(k, margin):
        return m.filtered_search_args(q, program, modes, k, 3, 9, margin, RESCORE_MAX_K)

    for k in (1, 20):
        got = torch.ops.silverrec.filtered_ivf_search(*args(k, rescore_margin(k)))
        composed = filtered_ivf_search_torch(*args(k, rescore_margin(k)))
        assert torch.equal(got[1], composed[1])
        torch.testing.assert_close(got[0], composed[0], rtol=1e-5, atol=1e-5)
        want = _exact_filtered_rescored(m, fwd, q, filters, k)
        for b in range(len(filters)):
            assert_same_ranking(got[1][b].tolist(), want[b])
        plain = torch.ops.silverrec.filtered_ivf_search(*args(k, 0))
        assert not torch.equal(got[0], plain[0])  # float scores, not the scan's
    big = RESCORE_MAX_K + 1
    with_margin = torch.ops.silverrec.filtered_ivf_search(*args(big, rescore_margin(big)))
    plain = torch.ops.silverrec.filtered_ivf_search(*args(big, 0))
    assert torch.equal(with_margin[0], plain[0]) and torch.equal(with_margin[1], plain[1])


@pytest.mark.parametrize("residual", [False, True])
def test_selective_exact_routes_rank_every_passing_row_in_float(residual, team_mode):
    """A re-scored exact route whose filter passes at most EXACT_FLOAT_ROWS rows answers the float top k of
    all of them (float64 brute force on the decoded codes), which the int8 top k + margin it used to re-score
    misses here (direct codes: a dimension that dominates the int8 query's scale); more passing rows (a compact scan, a masked whole pool)
    keep the int8 top k + margin. The C++ op (which ranks the few without the int8 scan) equals the
    composition bit for bit, duplicated rows included (equal floats: the int8 order, then the row)."""
    from silverrec.filtering.filter_program import FilterPlan, compile_request
    from silverrec.filtering.forward_index import ForwardIndex
    from silverrec.kernels.filtered_ivf_search import filtered_ivf_search_torch
    from silverrec.kernels.constants import EXACT_FLOAT_ROWS
    from silverrec.publish.filtered_ivf import build_filtered_ivf
    from silverrec.publish.ivf import IVFConfig
    from silverrec.publish.pool import Pool
    from silverrec.retrieval.filtered_ivf import MODE_UNPROBED
    from tests.test_filter_ivf import _exact_filtered, _exact_filtered_rescored, assert_same_ranking

    rng = np.random.default_rng(7)
    n, d = 4000, 8
    x = rng.normal(size=(n, d)).astype(np.float32)
    # dimension 0: four outliers (filtered out) stretch its code range, so that a query weighing it dominates
    # the int8 query's scale and the other dimensions quantise coarsely: the int8 ranking misses rows
    x[:, 0] = 0.0
    x[3990:3994, 0] = [100.0, -100.0, 100.0, -100.0]
    x[0:40] *= 3  # long: query x[i] (i < 3) ranks row i and its duplicate first
    x[3000:3040] = x[0:40]  # duplicates: equal codes (and clusters), equal float scores
    shade = rng.integers(0, 40, n)
    shade[3000:3040] = shade[0:40] = 39
    shade[3990:3994] = 0
    size = rng.integers(0, 3, n)
    feats = {"shade": [[f"s{v}"] for v in shade], "size": [[f"z{v}"] for v in size]}
    pool = Pool(np.arange(n, dtype=np.int64) * 2 + 1, x, feats)
    m, manifest = build_filtered_ivf(pool, IVFConfig(nlist=24, residual=residual))
    fwd = ForwardIndex.from_codes({"shade": ([f"s{v}" for v in range(40)], shade[m.row_to_item.numpy() // 2 % n]),
                                   "size": ([f"z{v}" for v in range(3)], size[m.row_to_item.numpy() // 2 % n])})
    filters = ["shade = s39"] * 3 + ["shade = s1 OR shade = s2", "shade = s5 AND size = z1", "shade = s3", "size = z1",
                                     "NOT shade = s4", "shade = s6 AND shade = s7"] + ["shade IN (s8, s9, s10, s11)"] * 7
    b = len(filters)
    q = torch.from_numpy(x[rng.integers(0, n, b)] + 0.3 * rng.normal(size=(b, d)).astype(np.float32))
    q[:, 0] = 30.0
    q[:3] = torch.from_numpy(x[:3])  # the duplicated rows tie at the top
    passing = [int(fwd.evaluate(f).sum()) for f in filters]
    assert max(passing) > n // 2 and any(EXACT_FLOAT_ROWS < p <= n // 2 for p in passing) and 0 in passing
    # the last group: 7 queries x ~400 rows, enough that its rows are scored and its queries ranked on both
    # threads where workers spin (threads.h kMinParallelKeys); "shade = s3": one query, one thread
    assert 7 * passing[-1] >= 2048 and passing[-1] <= EXACT_FLOAT_ROWS
    k = 5
    program = list(compile_request(filters, FilterPlan.from_config(manifest["filter"])))
    args = m.filtered_search_args(q, program, torch.full((b,), MODE_UNPROBED), k, 3, 9, rescore_margin(k), RESCORE_MAX_K)
    with torch.inference_mode():
        got = torch.ops.silverrec.filtered_ivf_search(*args)
        composed = filtered_ivf_search_torch(*args)
    assert torch.equal(got[1], composed[1]) and torch.equal(got[0], composed[0])
    want = _exact_filtered_rescored(m, fwd, q, filters, k)
    for i in range(b):
        assert_same_ranking(got[1][i].tolist(), want[i])
    # the contract changed the answer: the int8 top k + margin, re-scored, misses some float top-k rows
    old = _exact_filtered(m, fwd, q, filters, k + rescore_margin(k))
    missed = [i for i in range(b) if passing[i] <= EXACT_FLOAT_ROWS and set(got[1][i].tolist()) - set(old[i]) - {-1}]
    if not residual:  # (residual codes: each cluster's own ranges, no miss on this data)
        assert missed, "no query where all passing rows beat the int8 top k + margin: the test shows nothing"
    # ties: the duplicated pair of each of the first three queries, in the int8 order (equal: the lower row)
    for i in range(3):
        rows = [int(torch.nonzero(m.row_to_item == v)[0]) for v in got[1][i, :2].tolist()]
        assert got[0][i, 0] == got[0][i, 1] and rows[0] < rows[1]
