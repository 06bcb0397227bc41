"""The generative decode replayed from a CUDA graph (GraphedDecode) against eager launches of the
same module on the same padded inputs: bit-identical item ids and scores across replays with new
inputs (static buffers re-filled), several (batch, history) buckets, batch padding included, and
beam width 128. (A published generative snapshot is a RecModel, replayed by GraphedForward:
tests/gpu/test_snapshots_cuda.py.)"""

import pytest
import torch

from silverrec.bitmask import pack_bits
from silverrec.serving.cuda_graphs import capture_cuda_graph, capture_eager
from silverrec.serving.graphed_decode import GraphedDecode
from silverrec.generative.generative import GenerativeRetrieval
from silverrec.generative.trie import ValidPathTrie

from ..reference_beam_search import random_decoder, random_histories, random_paths
from .device import assert_ranking_close

SIZES = [16, 12, 8, 4]


def _capture(device):
    """The CUDA capture on a GPU; the eager stand-in for the suite's CPU dry run."""
    return capture_cuda_graph if device.type == "cuda" else capture_eager


def _inputs(paths, trie, batch, items, seed, device):
    hist = random_histories(paths, SIZES, batch, items, seed=seed, min_items=1)
    allowed = torch.rand(batch, trie.n_items, generator=torch.Generator().manual_seed(seed)) < 0.6
    return hist.to(device), pack_bits(allowed).to(device)


@pytest.mark.parametrize("beam_width, top_k", [(16, 16), (128, 8)])
def test_replay_equals_eager(beam_width, top_k, cuda):
    paths = random_paths(1500, SIZES, seed=2)
    trie = ValidPathTrie(paths, SIZES)
    module = GenerativeRetrieval(random_decoder(SIZES, dim=64, seed=5), trie, torch.arange(trie.n_items),
                                 beam_width, top_k).eval().to(cuda)
    graphed = GraphedDecode(module, beam_width, max_graphs=2, capture=_capture(cuda))
    cases = [(4, 3, 1), (3, 2, 2), (1, 3, 3), (4, 6, 4), (4, 3, 5)]  # (batch, items, seed): keys (4, 16), (4, 16),
    # (1, 16), (4, 32), (4, 16)
    for batch, items, seed in cases:
        hist, bits = _inputs(paths, trie, batch, items, seed, cuda)
        got = graphed(hist, bits)
        with torch.inference_mode():
            want = [t[:batch] for t in module(*graphed.pad(hist, bits))]
            unpadded = module(hist, bits)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (batch, items, seed)
        assert_ranking_close(got[0], got[1], unpadded[0].cpu(), unpadded[1].cpu())
        assert (got[0] >= 0).any()
    assert graphed.captures == 4 and len(graphed.graphs) == 2  # (4, 16), (1, 16), (4, 32), (4, 16) again
