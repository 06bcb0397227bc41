"""The Triton ivf_scan kernel under TRITON_INTERPRET=1 (conftest) equals the CPU scan and the reference."""

import pytest
import torch

from silverrec.kernels.common import quantize_queries, split_keys
from silverrec.kernels.ivf_scan import (
    _ivf_scan_impl,
    bitmask_words,
    canonical_probes,
    ivf_scan_reference,
)
from silverrec.kernels.library import host

triton = pytest.importorskip("triton")
from silverrec.kernels.ivf_scan_triton import SLOT_GROUP, scan_keys_triton, slots_per_merge  # noqa: E402

SCALE, OFFSET = torch.tensor(0.02), torch.tensor(0.3)


@pytest.mark.parametrize(
    "sizes, d, b, p, k, group",
    [
        ([50, 0, 70, 1, 64, 30, 20, 40, 25], 40, 3, 3, 10, 2),  # empty + 1-row clusters, odd D
        ([50, 0, 70, 1, 64, 30, 20, 40, 25], 40, 3, 9, 300, 4),  # every cluster, k = N
        ([17, 130, 5], 16, 2, 3, 200, 8),  # k beyond the probed items, one launch
        ([33] * 6, 130, 1, 2, 5, 1),  # D beyond one BLOCK_D
        ([50, 0, 70, 1, 64, 30, 20, 40, 25], 40, 3, 9, 100, None),  # slots_per_merge's default: one merge
    ],
)
@pytest.mark.parametrize("with_mask", [False, True])
def test_triton_scan_equals_cpu_and_reference(sizes, d, b, p, k, group, with_mask):
    g = torch.Generator().manual_seed(len(sizes) * 100 + d)
    off = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(torch.tensor(sizes), 0)
    n, nlist = int(off[-1]), len(sizes)
    codes = torch.randint(-128, 128, (n, d), dtype=torch.int8, generator=g)
    queries = torch.randn(b, d, generator=g)
    probes = torch.stack([torch.randperm(nlist, generator=g)[:p] for _ in range(b)])
    probes[0, -1] = -1
    if b > 1 and p > 2:
        probes[1, 2] = probes[1, 0]
    bitmask = torch.randint(-(2**62), 2**62, (b, p, bitmask_words(off)), generator=g) if with_mask else None
    qcodes, _ = quantize_queries(queries)
    canon = canonical_probes(probes)
    keys = scan_keys_triton(qcodes, codes, off, canon, k, bitmask, slot_group=group)
    assert torch.equal(keys, host().ivf_scan_keys(qcodes, codes, off, canon, bitmask, k))
    ref_scores, ref_rows = ivf_scan_reference(queries, codes, off, probes, k, bitmask)
    int_scores, rows = split_keys(keys)
    assert torch.equal(rows, ref_rows)
    assert torch.equal(torch.where(rows >= 0, int_scores, 0), ref_scores)
    # full op path with the Triton keys function (what the CUDA registration runs)
    scores, rows2 = _ivf_scan_impl(queries, codes, SCALE, OFFSET, off, probes, k, bitmask, scan_keys_triton)
    cpu_scores, cpu_rows = torch.ops.silverrec.ivf_scan(queries, codes, SCALE, OFFSET, off, probes, k, bitmask)
    assert torch.equal(rows2, cpu_rows) and torch.equal(scores, cpu_scores)


def test_slots_per_merge_fill_the_key_budget():
    assert slots_per_merge(16, 128, 3072) == 42  # 16 MiB / (16 x 3,072 x 8 B): 4 merges, not 16
    assert slots_per_merge(16, 16, 1024) == 16  # every slot in one launch
    assert slots_per_merge(4096, 128, 4096) == SLOT_GROUP  # huge batches keep the floor
    assert slots_per_merge(16, 5, 64) == 5 and slots_per_merge(16, 128, 64, slot_group=3) == 3


def test_index_window_words_spare_the_host_read():
    """Int8IVFIndex passes its Wc (an int constant) so that the CUDA scan reads no cluster size from
    the device (a CUDA graph cannot capture that read): the same keys, and no `.max()` host read."""
    from unittest import mock

    from silverrec.kernels.ivf_scan import ivf_scan_cuda
    from silverrec.retrieval.ivf_index import Int8IVFIndex

    g = torch.Generator().manual_seed(7)
    sizes = [50, 0, 70, 1, 130, 30]
    off = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(torch.tensor(sizes), 0)
    n, d = int(off[-1]), 24
    index = Int8IVFIndex(torch.randint(-128, 128, (n, d), dtype=torch.int8, generator=g), torch.ones(d),
                         torch.zeros(d), off, torch.randn(len(sizes), d, generator=g), torch.arange(n) * 3)
    assert index.window_words == bitmask_words(off) == 3  # the 130-row cluster, rows 121..250: words 1..3
    queries = torch.randn(3, d, generator=g)
    probes = index.probe(queries, 4)
    want = ivf_scan_cuda(queries, index.codes, SCALE, OFFSET, off, probes, 40)  # window_words 0: one host read
    with mock.patch.object(torch.Tensor, "max", side_effect=AssertionError("host read of the cluster sizes")):
        got = ivf_scan_cuda(queries, index.codes, SCALE, OFFSET, off, probes, 40, None, index.window_words)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(AssertionError, match="host read"), \
            mock.patch.object(torch.Tensor, "max", side_effect=AssertionError("host read of the cluster sizes")):
        ivf_scan_cuda(queries, index.codes, SCALE, OFFSET, off, probes, 40)  # the check can fail
