"""ValidPathTrie: accepts exactly the pool's paths; child tables and per-request pruning vs brute force."""

import itertools

import pytest
import torch

from silverrec.bitmask import pack_bits, unpack_bits
from silverrec.generative.trie import ValidPathTrie

from .reference_beam_search import random_paths

SIZES = [6, 5, 4, 3]


def _pool(n=150, seed=0):
    return random_paths(n, SIZES, seed=seed)


def _prefixes(paths, d):
    return sorted({tuple(p[:d]) for p in paths.tolist()})


def test_accepts_exactly_the_pool():
    paths = _pool()
    trie = ValidPathTrie(paths, SIZES)
    pool = {tuple(p) for p in paths.tolist()}
    assert {tuple(p) for p in trie.enumerate_paths().tolist()} == pool
    assert trie.enumerate_paths().shape[0] == len(pool)
    everything = torch.tensor(list(itertools.product(*[range(s) for s in SIZES])))
    accepted = trie.accepts(everything)
    assert {tuple(p) for p in everything[accepted].tolist()} == pool
    assert not trie.accepts(torch.tensor([[0, 0, 0, 3], [-1, 0, 0, 0], [6, 0, 0, 0]])).any()


def test_rows_are_sorted_paths():
    paths = _pool(seed=1)
    trie = ValidPathTrie(paths, SIZES)
    assert torch.equal(trie.leaf_paths, paths[trie.row_order])
    assert trie.leaf_paths.tolist() == sorted(paths.tolist())
    assert trie.n_items == paths.shape[0] and trie.leaf_base + trie.n_items == trie.offsets.numel() - 1 + trie.n_items


def test_child_table_vs_brute_force():
    paths = _pool(seed=2)
    trie = ValidPathTrie(paths, SIZES)
    for d in range(len(SIZES)):
        nodes = _prefixes(paths, d)
        ids = torch.arange(len(nodes)) + trie.level_base[d]
        table = trie.child_table(ids, d)
        children = _prefixes(paths, d + 1)
        child_id = {p: trie.level_base[d + 1] + i for i, p in enumerate(children)}
        expect = torch.full((len(nodes), SIZES[d]), -1, dtype=torch.int64)
        for i, p in enumerate(nodes):
            for c in range(SIZES[d]):
                expect[i, c] = child_id.get(p + (c,), -1)
        assert torch.equal(table, expect), d
    assert torch.equal(trie.first_mask, trie.child_table(torch.zeros(1, dtype=torch.int64), 0)[0] >= 0)


def test_node_alive_vs_brute_force():
    paths = _pool(seed=3)
    trie = ValidPathTrie(paths, SIZES)
    N = paths.shape[0]
    allowed = torch.rand(4, N) < torch.tensor([[0.0], [0.05], [0.5], [1.0]])
    alive = trie.node_alive(pack_bits(allowed))
    for b in range(4):
        pool = trie.leaf_paths[allowed[b]].tolist()
        for d in range(len(SIZES) + 1):
            for i, p in enumerate(_prefixes(paths, d)):
                expect = any(tuple(q[:d]) == p for q in pool)
                assert bool(alive[b, trie.level_base[d] + i]) == expect, (b, d, p)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_bitmask_pack_round_trip(n):
    mask = torch.rand(3, n) < 0.5
    mask[:, -1] = True  # includes bit 63 of a word when n % 64 == 0
    bits = pack_bits(mask)
    assert bits.shape == (3, (n + 63) // 64) and bits.dtype == torch.int64
    assert torch.equal(unpack_bits(bits, n), mask)
    for r in range(n):  # the Bloom packed format: bit r & 63 of word r >> 6
        assert torch.equal((bits[:, r >> 6] >> (r & 63)) & 1 == 1, mask[:, r])


def test_bad_paths():
    with pytest.raises(ValueError, match="share"):
        ValidPathTrie(torch.tensor([[0, 1, 2, 0], [0, 1, 2, 0]]), SIZES)
    with pytest.raises(ValueError, match="outside"):
        ValidPathTrie(torch.tensor([[0, 5, 2, 0]]), SIZES)
    with pytest.raises(ValueError, match="levels"):
        ValidPathTrie(torch.tensor([[0, 1, 2]]), SIZES)
    with pytest.raises(ValueError, match="non-empty"):
        ValidPathTrie(torch.zeros(0, 4, dtype=torch.int64), SIZES)


def test_path_nodes_and_child_tokens_vs_brute_force():
    """path_nodes: each row's node at every depth (the ids child_table hands out); child_tokens: the
    decoder tokens (level offset + code) of each internal node's children, nothing else."""
    from silverrec.generative.decoder import level_offsets, vocab_size

    paths = _pool(seed=4)
    trie = ValidPathTrie(paths, SIZES)
    nodes = trie.path_nodes()
    assert nodes.shape == (trie.n_items, len(SIZES) + 1)
    for d in range(len(SIZES) + 1):
        ids = {p: trie.level_base[d] + i for i, p in enumerate(_prefixes(paths, d))}
        assert nodes[:, d].tolist() == [ids[tuple(p[:d])] for p in trie.leaf_paths.tolist()], d
    offsets = level_offsets(SIZES)
    allowed = trie.child_tokens(offsets, vocab_size(SIZES))
    assert allowed.shape == (trie.leaf_base, vocab_size(SIZES))
    for d in range(len(SIZES)):
        for i, p in enumerate(_prefixes(paths, d)):
            expect = {offsets[d] + q[d] for q in paths.tolist() if tuple(q[:d]) == p}
            assert set(allowed[trie.level_base[d] + i].nonzero().flatten().tolist()) == expect, (d, p)
