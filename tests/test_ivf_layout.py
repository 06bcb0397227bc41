"""The cluster-major int8 layout quantised over the float pool's own buffer (publish --pool's
`consume`) equals the layout built from a separate buffer, code for code."""

import numpy as np
import pytest
import torch

import silverrec.publish.ivf as ivf
from silverrec.publish.pool import Pool


@pytest.mark.parametrize("n, d, chunk", [(1000, 13, 7), (4099, 96, 1024), (5, 3, 2)])
@pytest.mark.parametrize("residual", [False, True])
def test_consumed_layout_equals_copied_layout(n, d, chunk, residual, monkeypatch):
    monkeypatch.setattr(ivf, "LAYOUT_CHUNK", chunk)  # many chunks: each one's codes land over rows already read
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((n, d)) * rng.uniform(0.1, 5, d)).astype(np.float32)
    ids = torch.from_numpy(rng.permutation(10 * n)[:n].astype(np.int64))
    nlist = min(8, n)
    centroids = torch.from_numpy(x[:nlist].copy())
    assignment = torch.from_numpy(rng.integers(0, nlist, n))
    # reference: numpy quantisation of the pool rows (minus their centroids: residual), in cluster-major order
    v = x - x[:nlist][assignment.numpy()] if residual else x
    lo, hi = v.min(0), v.max(0)
    scale = np.maximum((hi - lo) / 255.0, 1e-12)
    ref = np.clip(np.round((v - (lo + 128 * scale)) / scale), -128, 127)[np.argsort(assignment.numpy(), kind="stable")]
    want = ivf.cluster_major_layout(torch.from_numpy(x.copy()), ids, centroids, assignment, residual=residual)
    got = ivf.cluster_major_layout(torch.from_numpy(x), ids, centroids, assignment, consume=True, residual=residual)
    assert got.residual == residual
    for name, t in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name
    assert np.abs(got.codes.numpy().astype(np.int64) - ref).max() <= 1  # float rounding at exact halves
    tail = x.reshape(-1).view(np.uint8)[n * d :]  # the buffer's last 3 N D bytes: whole pages went back to the OS
    assert (tail == 0).sum() >= tail.size - 2 * 4096


def test_build_ivf_consume_empties_the_pool():
    rng = np.random.default_rng(0)
    pool = Pool(np.arange(3000, dtype=np.int64), rng.standard_normal((3000, 24)).astype(np.float32))
    keep = pool.embeddings.copy()
    index, _ = ivf.build_ivf(Pool(pool.item_ids, keep.copy()), ivf.IVFConfig(nlist=10))
    used, _ = ivf.build_ivf(pool, ivf.IVFConfig(nlist=10), consume=True)
    assert pool.embeddings.shape == (0, 24) and pool.size == 3000
    for name, t in index.state_dict().items():
        assert torch.equal(used.state_dict()[name], t), name


def test_release_pages_zeroes_whole_pages_only():
    t = torch.ones(3 * 4096 + 100, dtype=torch.int8)
    part = t[50:]
    released = ivf.release_pages(part)
    if released == 0:
        pytest.skip("madvise unavailable")
    assert released % 4096 == 0 and released <= part.numel()
    assert int(t[:50].sum()) == 50  # bytes before the range untouched
    assert int((part == 0).sum()) == released
