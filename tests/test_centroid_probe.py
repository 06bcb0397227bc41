"""silverrec::centroid_candidates (kernels/centroid_probe.py, kernels/csrc/centroid_probe.cpp): each query's best P
centroids, equal to the reference (every score in dot_lanes's order, a stable descending sort) whichever path the C++
takes: the int8 screen with its error bound, or every score exact; on real vectors full of exact ties (SIFT: integer
dot products), on near ties the screen cannot tell apart, on values its bound refuses, and after the centroids change."""

import numpy as np
import pytest
import torch

import silverrec.kernels  # noqa: F401  (registers the ops)
from silverrec.kernels.centroid_probe import centroid_candidates_torch
from silverrec.kernels.common import dot_lanes
from silverrec.kernels.library import host
from tests.helpers import load_ann

EXT = host()


def brute_force(queries: torch.Tensor, centroids: torch.Tensor, P: int) -> torch.Tensor:
    """Independent of the op's reference: each query's scores in dot_lanes's order, ranked by a Python sort
    (higher score, then lower centroid)."""
    out = []
    for q in queries:
        s = dot_lanes(q[None, :], centroids).tolist()
        out.append(sorted(range(len(s)), key=lambda c: (-s[c], c))[:P])
    return torch.tensor(out, dtype=torch.int64)


def both_paths(queries, centroids, P):
    """The C++ screen and the C++ exact path, each checked equal to the reference; -> the candidates."""
    want = centroid_candidates_torch(queries, centroids, P)
    assert torch.equal(EXT.centroid_candidates(queries, centroids, P), want)
    assert torch.equal(EXT.centroid_candidates(queries, centroids, P, False), want)
    assert torch.equal(torch.ops.silverrec.centroid_candidates(queries, centroids, P), want)
    return want


def test_reference_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    c, q = torch.randn(300, 40, generator=g), torch.randn(5, 40, generator=g)
    c[[7, 70, 170]] = c[3].clone()  # exact ties: the lower centroid first
    assert torch.equal(centroid_candidates_torch(q, c, 20), brute_force(q, c, 20))


@pytest.mark.parametrize("C, D, B", [(4000, 128, 16), (3999, 96, 7), (1000, 64, 17), (300, 33, 3), (17, 3, 1),
                                     (257, 200, 40), (64, 1, 2)])
@pytest.mark.parametrize("P", [1, 4, 16, 17, 128])
def test_equals_reference_at_every_shape(C, D, B, P):
    """C past a whole tile of 16, D past a group of 4, B past a block of 16, P on both sides of the insertion
    limit (16) and P = C - 1, C."""
    g = torch.Generator().manual_seed(C * 1000 + D + B)
    centroids, queries = torch.randn(C, D, generator=g), torch.randn(B, D, generator=g)
    for p in {min(P, C), C - 1, C} - {0}:
        both_paths(queries, centroids, p)


@pytest.mark.parametrize("C, D, B, P", [(4000, 128, 16, 4), (1000, 64, 17, 128)])
def test_the_same_candidates_on_every_runner(C, D, B, P, team_mode):
    """The screen's tiles and the per-query step split between threads (or not): the same answer."""
    g = torch.Generator().manual_seed(C + D + B)
    both_paths(torch.randn(B, D, generator=g), torch.randn(C, D, generator=g), P)


@pytest.mark.parametrize("name", ["bigann10k", "fmnistsmall"])
def test_real_vectors_with_exact_ties(name):
    """Real vectors as centroids: SIFT's integer components make many dot products equal (exact in float32)."""
    base, queries = load_ann(name)
    centroids = torch.from_numpy(base.astype(np.float32))
    q = torch.from_numpy(queries[:33].astype(np.float32))
    got = both_paths(q, centroids, 16)
    assert torch.equal(got[:4], brute_force(q[:4], centroids, 16))
    both_paths(q, centroids, 128)
    if name == "bigann10k":  # duplicated rows: equal scores at the top, the lower centroid first
        dup = torch.cat([centroids[:2000], centroids[:2000]])
        for row in both_paths(q, dup, 8).tolist():  # a copy never before its original
            assert all(c < 2000 or c - 2000 in row[:j] for j, c in enumerate(row)), row


def test_near_ties_the_screen_cannot_separate():
    """Centroids a few ulps apart in score (and -0 beside +0): only the exact scores order them."""
    g = torch.Generator().manual_seed(3)
    D = 128
    base = torch.randn(D, generator=g)
    centroids = torch.randn(500, D, generator=g) * 0.1
    for i in range(40):  # near copies of one strong direction, each nudged by a few ulps in one component
        c = base.clone()
        c[i % D] = torch.nextafter(c[i % D], torch.tensor(float("inf")) * (1 if i % 2 else -1))
        centroids[10 * i] = c
    q = torch.stack([base, -base, torch.zeros(D), base * 1e-30])
    centroids[5] = -0.0
    for P in (1, 3, 16, 40, 41):
        both_paths(q, centroids, P)


def test_values_outside_the_bound_take_the_exact_path():
    """Huge values (products near float's range), a zero row and a zero query: the same candidates."""
    g = torch.Generator().manual_seed(4)
    centroids, q = torch.randn(200, 64, generator=g), torch.randn(6, 64, generator=g)
    q[0] = 0.0
    centroids[9] = 0.0
    both_paths(q, centroids, 5)
    centroids[11] *= 1e18  # |q|_inf |c|_1 past the screen's limit: every score exact
    both_paths(q, centroids, 5)
    both_paths(q * 1e12, centroids, 5)


@pytest.mark.parametrize("where", ["query", "centroid"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_take_the_exact_path(where, bad):
    """A NaN or an infinity anywhere: no screen (its bound would not hold), the exact path's answer."""
    g = torch.Generator().manual_seed(6)
    centroids, q = torch.randn(500, 48, generator=g), torch.randn(5, 48, generator=g)
    (q if where == "query" else centroids)[2, 7] = bad
    assert torch.equal(EXT.centroid_candidates(q, centroids, 4), EXT.centroid_candidates(q, centroids, 4, False))


def test_codes_follow_the_centroids():
    """The int8 codes are cached per centroid tensor: changed in place (its version moves) or replaced, the
    candidates follow; inference tensors (no version count) are coded afresh on each call."""
    g = torch.Generator().manual_seed(5)
    centroids, q = torch.randn(1000, 32, generator=g), torch.randn(4, 32, generator=g)
    before = both_paths(q, centroids, 4)
    centroids[before[:, 0]] *= -1.0  # each query's best centroid now scores low
    after = both_paths(q, centroids, 4)
    assert not torch.equal(before, after)
    with torch.inference_mode():
        inf_centroids = torch.randn(1000, 32, generator=g)
        first = both_paths(q, inf_centroids, 4)
        inf_centroids[first[:, 0]] = 0.0
        assert not torch.equal(first, both_paths(q, inf_centroids, 4))


def test_bad_arguments_name_the_problem():
    c, q = torch.randn(10, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match="P \\(11\\)"):
        torch.ops.silverrec.centroid_candidates(q, c, 11)
    with pytest.raises(ValueError, match="queries \\[B, D\\] and centroids \\[C, D\\]"):
        torch.ops.silverrec.centroid_candidates(q[:, :4], c, 2)
