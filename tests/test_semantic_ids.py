"""Semantic IDs: residual k-means, disambiguation token, collision statistics, vocabulary mapping.

References are independent: reconstruction errors recomputed in float64 numpy from the codebooks,
collisions and codebook usage counted with Python dicts/sets, vocabulary decoded by hand.
"""

from collections import Counter

import numpy as np
import pytest
import torch

from silverrec.generative.decoder import BOS, PAD, level_offsets, paths_to_tokens, vocab_size
from silverrec.errors import PoolError
from silverrec.publish.semantic_ids import build_semantic_ids, check_paths, collision_stats, disambiguate
from silverrec.generative.trie import ValidPathTrie


def clustered(n: int = 2000, d: int = 12, centers: int = 40, dup_groups: int = 5, dup_size: int = 7, seed: int = 0):
    """Gaussian mixture embeddings plus `dup_groups` groups of identical rows (forced collisions)."""
    g = np.random.default_rng(seed)
    c = g.normal(size=(centers, d)) * 3
    x = c[g.integers(0, centers, n)] + g.normal(size=(n, d))
    for k in range(dup_groups):
        x[k * dup_size : (k + 1) * dup_size] = x[k * dup_size]
    ids = g.permutation(np.arange(10_000, 10_000 + 3 * n))[:n]
    return x.astype(np.float32), ids.astype(np.int64)


@pytest.fixture(scope="module")
def sids():
    x, ids = clustered()
    return x, ids, build_semantic_ids(x, ids, levels=3, codes=16, seed=3, niter=10)


def test_reconstruction_error_decreases_with_levels(sids):
    x, _, s = sids
    codes = s.paths[:, :-1]
    recon = np.zeros_like(x, dtype=np.float64)
    energy = (x.astype(np.float64) ** 2).sum(1).mean()
    errors = []
    for l, book in enumerate(s.codebooks):
        recon += book.astype(np.float64)[codes[:, l]]
        errors.append(((x - recon) ** 2).sum(1).mean() / energy)
    np.testing.assert_allclose(s.stats.relative_error, errors, rtol=1e-4)
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.5 * errors[0]
    # every item uses its nearest centroid at each level (residual k-means assignment)
    residual = x.astype(np.float64) - (recon - s.codebooks[-1].astype(np.float64)[codes[:, -1]])
    d2 = ((residual[:, None, :] - s.codebooks[-1][None].astype(np.float64)) ** 2).sum(-1)
    assert np.all(d2[np.arange(len(x)), codes[:, -1]] <= d2.min(1) + 1e-3)


def test_paths_unique_and_in_range(sids):
    x, ids, s = sids
    assert s.paths.shape == (len(ids), 4) and s.paths.dtype == np.int64
    assert len({tuple(p) for p in s.paths.tolist()}) == len(ids)
    for l, size in enumerate(s.level_sizes):
        assert 0 <= s.paths[:, l].min() and s.paths[:, l].max() < size
    check_paths(s.paths, s.level_sizes)
    trie = ValidPathTrie(torch.from_numpy(s.paths), s.level_sizes)  # accepts exactly these paths
    assert bool(trie.accepts(torch.from_numpy(s.paths)).all())


def test_collisions_and_usage_match_brute_force(sids):
    x, ids, s = sids
    groups = Counter(tuple(p) for p in s.paths[:, :-1].tolist())
    assert max(groups.values()) >= 7  # the identical rows collide
    st = s.stats
    assert st.colliding_paths == sum(1 for c in groups.values() if c > 1)
    assert st.colliding_items == sum(c for c in groups.values() if c > 1)
    assert st.max_items_per_path == max(groups.values())
    assert st.mean_items_per_path == pytest.approx(len(ids) / len(groups))
    assert st.used_codes == [len(set(s.paths[:, l].tolist())) for l in range(3)]
    assert st.distinct_prefixes == [len({tuple(p[: l + 1]) for p in s.paths.tolist()}) for l in range(3)]
    assert s.level_sizes == [16, 16, 16, max(groups.values())]
    # disambiguation: 0 when alone on the path, a permutation of 0..g-1 within a group of g
    by_path: dict[tuple, list[int]] = {}
    for p in s.paths.tolist():
        by_path.setdefault(tuple(p[:-1]), []).append(p[-1])
    for path, dis in by_path.items():
        assert sorted(dis) == list(range(len(dis))), path


def test_disambiguate_orders_groups_by_key():
    codes = torch.tensor([[1, 2], [0, 0], [1, 2], [1, 2], [3, 3]])
    assert disambiguate(codes).tolist() == [0, 0, 1, 2, 0]
    key = torch.tensor([5.0, 0.0, 1.0, 3.0, 0.0])
    assert disambiguate(codes, key).tolist() == [2, 0, 0, 1, 0]


def test_collision_stats_hand_example():
    codes = np.array([[0, 1], [0, 1], [0, 2], [1, 1], [1, 1], [1, 1]])
    st = collision_stats(codes, [4, 4, 3], [0.5, 0.25])
    assert (st.colliding_paths, st.colliding_items, st.max_items_per_path) == (2, 5, 3)
    assert st.mean_items_per_path == pytest.approx(2.0)
    assert st.used_codes == [2, 2] and st.distinct_prefixes == [2, 3]


def test_vocabulary_round_trip(sids):
    _, _, s = sids
    sizes = s.level_sizes
    offsets = [2, 2 + sizes[0], 2 + sizes[0] + sizes[1], 2 + sizes[0] + sizes[1] + sizes[2]]
    assert s.level_offsets == offsets == level_offsets(sizes)
    assert s.vocab_size == 2 + sum(sizes) == vocab_size(sizes)
    tokens = s.tokens()
    assert tokens.min() > max(PAD, BOS) and tokens.max() < s.vocab_size
    for l in range(4):  # each level's tokens live in its own block
        assert np.all((tokens[:, l] >= offsets[l]) & (tokens[:, l] < offsets[l] + sizes[l]))
    decoded = tokens - np.asarray(offsets)
    np.testing.assert_array_equal(decoded, s.paths)
    np.testing.assert_array_equal(paths_to_tokens(torch.from_numpy(s.paths), sizes).numpy(), tokens)
    cfg = s.config()
    assert cfg["level_sizes"] == sizes and cfg["levels"] == 4 and cfg["vocab_size"] == s.vocab_size


def test_deterministic_for_a_seed():
    x, ids = clustered(n=600, seed=1)
    a = build_semantic_ids(x, ids, levels=2, codes=8, seed=5, niter=5)
    b = build_semantic_ids(x, ids, levels=2, codes=8, seed=5, niter=5)
    np.testing.assert_array_equal(a.paths, b.paths)
    assert a.stats == b.stats


def test_fewer_items_than_codes():
    x, ids = clustered(n=10, centers=3, dup_groups=0)
    s = build_semantic_ids(x, ids, levels=3, codes=256, seed=0, niter=3)
    assert s.level_sizes[:3] == [10, 10, 10]
    assert len({tuple(p) for p in s.paths.tolist()}) == 10


def test_bad_input_is_named():
    x, ids = clustered(n=100, dup_groups=0)
    x[17, 3] = np.nan
    with pytest.raises(PoolError, match=f"item {ids[17]} .row 17."):
        build_semantic_ids(x, ids, codes=4)
    with pytest.raises(PoolError, match="item_ids"):
        build_semantic_ids(np.ones((5, 2), np.float32), ids[:4])
    with pytest.raises(PoolError, match="rows 0 and 2 are equal"):
        check_paths(np.array([[0, 1], [1, 1], [0, 1]]), [2, 2])
    with pytest.raises(PoolError, match="code 5 at level 1"):
        check_paths(np.array([[0, 5]]), [2, 2])


def test_subset_keeps_vocabulary_and_names_missing_items(sids):
    _, ids, s = sids
    sub = s.subset(ids[[5, 1, 9]])
    assert sub.level_sizes == s.level_sizes
    np.testing.assert_array_equal(sub.paths, s.paths[[5, 1, 9]])
    with pytest.raises(PoolError, match="item 7 has no semantic ID"):
        s.subset(np.array([ids[0], 7]))


def test_order_sets_the_disambiguation_ranks():
    """order (e.g. minus popularity): the items of each shared code path get last codes 0, 1, ... by
    ascending key (ties by row), checked by grouping the k-means codes by hand; a wrong shape is named."""
    g = np.random.default_rng(3)
    x = g.normal(size=(300, 6)).astype(np.float32)
    ids = np.arange(300, dtype=np.int64) * 7
    key = g.integers(0, 5, 300).astype(np.float64)  # many ties: broken by row
    sids = build_semantic_ids(x, ids, levels=1, codes=8, seed=0, niter=5, order=key)
    groups = {}
    for row, p in enumerate(sids.paths.tolist()):
        groups.setdefault(p[0], []).append(row)
    assert max(len(r) for r in groups.values()) > 10
    for rows in groups.values():
        ranked = sorted(rows, key=lambda r: (key[r], r))
        assert [int(sids.paths[r, 1]) for r in ranked] == list(range(len(rows)))
    assert sids.level_sizes[-1] == max(len(r) for r in groups.values())
    with pytest.raises(PoolError, match=r"order must be \[300\]"):
        build_semantic_ids(x, ids, levels=1, codes=8, order=key[:5])
