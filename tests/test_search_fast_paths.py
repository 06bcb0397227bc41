"""The CPU filtered search's shortcuts (kernels/csrc/plan.cpp, search.cpp, filter_scan.cpp) change no result.

- An unfiltered batch (every program TRUE) of probed queries skips the Bloom counts and the cluster
  mask and decodes the scan's keys once; auto queries still count.
- The exact routes hand over unpadded keys, and the output is padded once: with far fewer matches
  than k, every slot after the matches must still be (-inf + constant, -1).
Each is checked bit for bit against the composition of the per-step ops (with the C++ kernels and
with the reference kernels in their place: tests/reference_kernels.py), and the exact routes against brute force.
"""

import pytest
import torch

from silverrec.filtering.filter_program import compile_request
from silverrec.kernels.filtered_ivf_search import filtered_ivf_search_torch
from silverrec.retrieval.filtered_ivf import MODE_AUTO, MODE_PROBED, MODE_UNPROBED
from tests.test_filter_ivf import _exact_filtered
from tests.reference_kernels import cpp_and_reference as _both_paths
from tests.test_postings import built  # noqa: F401  (the module-scoped pool, index and plan)


def _search(module, plan, queries, filters, modes, k, nprobe, max_probe):
    """(fused op, composition with C++ steps, composition with torch steps): (scores, item ids) each."""
    inputs = compile_request(filters, plan)
    modes = torch.full((len(filters),), modes, dtype=torch.int64) if isinstance(modes, int) else modes
    args = module.filtered_search_args(queries, list(inputs), modes, k, nprobe, max_probe)
    with torch.inference_mode():
        fused = module(queries, k, nprobe, *inputs, max_probe, modes)
        composed, composed_torch = _both_paths(lambda: filtered_ivf_search_torch(*args))
    return fused, composed, composed_torch


def _queries(queries, repeat, seed):
    g = torch.Generator().manual_seed(seed)
    return queries.repeat(repeat, 1) + 0.1 * torch.randn(repeat * queries.shape[0], queries.shape[1], generator=g)


@pytest.mark.parametrize("mode", [MODE_PROBED, MODE_AUTO])
@pytest.mark.parametrize("k, nprobe, max_probe", [(20, 4, 4), (150, 8, 40), (10, 2, 80)])
def test_unfiltered_batch_equals_the_composition(built, mode, k, nprobe, max_probe):  # noqa: F811
    module, _, plan, _, queries = built
    q = _queries(queries, 2, k)
    fused, composed, composed_torch = _search(module, plan, q, [None] * q.shape[0], mode, k, nprobe, max_probe)
    for other in (composed, composed_torch):
        assert torch.equal(fused[0], other[0]) and torch.equal(fused[1], other[1])
    assert (fused[1] >= 0).all(dim=1).any()


@pytest.mark.parametrize("mode", [MODE_UNPROBED, MODE_AUTO])
def test_few_matches_at_large_k_are_padded_once(built, mode, team_mode):  # noqa: F811
    """k far above the matches (posting route for auto, whole pool for unprobed): the matches
    equal brute force, then padding to k. 16 queries x 1500 results: a result large enough (288 KB) that
    both threads decode and pad it where workers spin (threads.h kParallelResultBytes)."""
    module, _, plan, fwd, queries = built
    filters = ["rare = r7", "rare IN (r7, r8, r9) AND country = c1", "rare = nowhere", "country = c3 AND rare = r1"] * 4
    q = _queries(queries[:4], 4, 5)
    k = 1500
    fused, composed, composed_torch = _search(module, plan, q, filters, mode, k, 4, 16)
    for other in (composed, composed_torch):
        assert torch.equal(fused[0], other[0]) and torch.equal(fused[1], other[1])
    exact = _exact_filtered(module, fwd, q, filters, k)
    constant = module.fold(q)[1]
    for b, ids in enumerate(exact):
        n = len(ids)
        assert n < k and fused[1][b, :n].tolist() == ids
        assert (fused[1][b, n:] == -1).all() and (fused[0][b, n:] == float("-inf") + constant[b]).all()
