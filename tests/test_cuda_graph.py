"""GraphedDecode's device-independent parts on CPU: buckets, history and batch padding (same items as
the unpadded decode), the static-buffer copy-in / copy-out, the shape-keyed LRU cache, bad input. The
CUDA-graph capture itself is compared with eager launches in tests/gpu/test_cuda_graph_decode.py."""

import pytest
import torch

from silverrec.bitmask import pack_bits
from silverrec.serving.cuda_graphs import capture_eager
from silverrec.serving.graphed_decode import GraphedDecode, bucket, pad_batch, pad_history
from silverrec.generative.generative import GenerativeRetrieval
from silverrec.generative.trie import ValidPathTrie

from .reference_beam_search import random_decoder, random_histories, random_paths

SIZES = [8, 6, 5, 3]
W = 6


@pytest.fixture(scope="module")
def decode():
    paths = random_paths(160, SIZES, seed=1)
    trie = ValidPathTrie(paths, SIZES)
    item_ids = torch.arange(paths.shape[0], dtype=torch.int64) * 10 + 7
    dec = random_decoder(SIZES, dtype=torch.float64, seed=2)
    return paths, trie, GenerativeRetrieval(dec, trie, item_ids[trie.row_order], W, 4).eval()


def _inputs(paths, trie, batch, items, seed):
    hist = random_histories(paths, SIZES, batch, items, seed=seed, min_items=1)
    allowed = torch.rand(batch, trie.n_items, generator=torch.Generator().manual_seed(seed)) < 0.7
    return hist, pack_bits(allowed)


def test_bucket():
    assert [bucket(t, 16) for t in (1, 2, 16, 17, 32, 33, 100)] == [16, 16, 16, 32, 32, 64, 128]
    assert [bucket(b) for b in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    with pytest.raises(ValueError, match="positive"):
        bucket(0)


def test_left_padding_decodes_the_same_items(decode):
    paths, trie, module = decode
    hist, bits = _inputs(paths, trie, 4, 3, seed=5)  # T = 1 + 3 * 4 = 13
    padded = pad_history(hist, bucket(hist.shape[1], 16))
    assert padded.shape == (4, 16) and torch.equal(padded[:, 3:], hist) and torch.all(padded[:, :3] == 0)
    assert pad_history(hist, hist.shape[1]) is hist
    with pytest.raises(ValueError, match="cannot pad"):
        pad_history(hist, 5)
    ids, scores = module(hist, bits)
    ids_p, scores_p = module(padded, bits)
    assert torch.equal(ids, ids_p)
    torch.testing.assert_close(scores, scores_p, atol=1e-6, rtol=1e-6)


def test_batch_padding_adds_requests_that_find_nothing(decode):
    paths, trie, module = decode
    hist, bits = _inputs(paths, trie, 3, 3, seed=6)
    big_hist, big_bits = pad_batch(hist, bits, 8)
    assert big_hist.shape == (8, hist.shape[1]) and big_bits.shape == (8, bits.shape[1])
    assert torch.equal(big_hist[:3], hist) and torch.all(big_hist[3:, :-1] == 0) and torch.all(big_hist[3:, -1] == 1)
    assert pad_batch(hist, bits, 3)[0] is hist
    with pytest.raises(ValueError, match="cannot pad"):
        pad_batch(hist, bits, 2)
    ids, scores = module(hist, bits)
    ids_p, scores_p = module(big_hist, big_bits)
    assert torch.equal(ids_p[:3], ids) and torch.equal(scores_p[:3], scores)
    assert torch.all(ids_p[3:] == -1) and torch.all(scores_p[3:] == float("-inf"))


def test_replay_copies_inputs_in_and_outputs_out(decode):
    """Each call's own inputs reach the captured call (copy-in), and an earlier result is not
    overwritten by a later replay (copy-out): against the module on the padded inputs."""
    paths, trie, module = decode
    graphed = GraphedDecode(module, W, capture=capture_eager)
    calls = [_inputs(paths, trie, b, items, seed) for seed, b, items in [(1, 3, 3), (2, 4, 2), (3, 3, 3)]]  # T 13, 9, 13
    results = [graphed(h, b) for h, b in calls]
    assert graphed.captures == 1 and len(graphed.graphs) == 1  # one key (batch 4, history 16) for all three
    for (h, b), (ids, scores) in zip(calls, results):
        ref_ids, ref_scores = module(*pad_batch(pad_history(h, 16), b, 4))
        assert ids.shape == (h.shape[0], W)
        assert torch.equal(ids, ref_ids[: h.shape[0]]) and torch.equal(scores, ref_scores[: h.shape[0]])
    assert not torch.equal(results[0][0], results[1][0])  # different requests, different answers


def test_cache_is_keyed_by_shape_and_evicts_least_recently_used(decode):
    paths, trie, module = decode
    graphed = GraphedDecode(module, W, max_graphs=2, capture=capture_eager)
    a = _inputs(paths, trie, 2, 3, 1)  # (batch 2, history 16)
    b = _inputs(paths, trie, 3, 3, 2)  # (batch bucket 4, history 16)
    c = _inputs(paths, trie, 2, 5, 3)  # (batch 2, history 32: T = 21)
    key = lambda x: graphed.key(*x)  # noqa: E731
    assert key(a) == ("cpu", 2, W, 16, 3) and key(b) == ("cpu", 4, W, 16, 3) and key(c) == ("cpu", 2, W, 32, 3)
    graphed(*a)
    graphed(*b)
    graphed(*a)  # a is now the most recently used
    graphed(*c)  # evicts b
    assert list(graphed.graphs) == [key(a), key(c)] and graphed.captures == 3
    graphed(*b)  # captured again, evicts a
    assert list(graphed.graphs) == [key(c), key(b)] and graphed.captures == 4
    ids, scores = graphed(*c)
    ref = module(pad_history(c[0], 32), c[1])
    assert torch.equal(ids, ref[0]) and torch.equal(scores, ref[1])


def test_cpu_calls_go_straight_to_the_module(decode):
    paths, trie, module = decode
    graphed = GraphedDecode(module, W)  # the CUDA capture: never used for CPU tensors
    hist, bits = _inputs(paths, trie, 2, 3, 4)
    ids, scores = graphed(hist, bits)
    ref_ids, ref_scores = module(hist, bits)  # unpadded: the module itself
    assert torch.equal(ids, ref_ids) and torch.equal(scores, ref_scores) and not graphed.graphs


def test_bad_input_is_named(decode):
    paths, trie, module = decode
    graphed = GraphedDecode(module, W, capture=capture_eager)
    hist, bits = _inputs(paths, trie, 2, 3, 4)
    with pytest.raises(ValueError, match="int64"):
        graphed(hist.to(torch.int32), bits)
    with pytest.raises(ValueError, match="int64"):
        graphed(hist, bits[:1])
    with pytest.raises(ValueError, match="max_graphs"):
        GraphedDecode(module, W, max_graphs=0)
    with pytest.raises(ValueError, match="beam_width"):
        GraphedDecode(module, 0)


def test_calls_from_several_threads_take_turns():
    """A server's workers call one GraphedDecode from several threads: each call's answer is its own
    input's, though the calls share one key's static buffers (without the lock, a call that copies its
    input while another's replay reads the buffers answers for the other's input)."""
    import threading
    import time

    def slow(history, item_bitmask):  # stands in for the decode: the answer names the input
        out = history[:, -1:].clone()
        time.sleep(0.002)  # the window in which another call could overwrite the static history
        return out.expand(-1, 2).clone(), history[:, -1:].float().expand(-1, 2) + 0.5

    decode = GraphedDecode(slow, beam_width=2, capture=capture_eager)
    wrong = []

    def worker(token: int) -> None:
        history = torch.tensor([[0, 1, token]], dtype=torch.int64)
        for _ in range(30):
            ids, scores = decode(history, torch.zeros(1, 1, dtype=torch.int64))
            if int(ids[0, 0]) != token or float(scores[0, 0]) != token + 0.5:
                wrong.append((token, int(ids[0, 0])))

    threads = [threading.Thread(target=worker, args=(t,)) for t in (7, 8, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and decode.captures == 1
