"""`silverrec::candidate_rows` (kernels/candidate_rows.py, kernels/csrc/candidates.cpp) and the steps of
its composition (`exclude_rows`, `merge_tasks`), against independent references: sets, a plain-Python
rank-by-rank walk, and a per-request Python re-score / sort / merge in float64.

The C++ kernel's dot products sum in another order than the composition's batched matmul, so the
op-vs-reference tests use integer-valued queries and embeddings (exact in bfloat16 and float32: every
sum is exact), where the two orders agree bit for bit and ties are common: the tie rule (position in
the search's list) is exercised too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import silverrec.kernels  # noqa: F401  (registers the ops)
from silverrec.kernels.candidate_rows import candidate_rows_torch, exclude_rows, merge_tasks
from tests.helpers import runs_cpp_kernel


# -------------------------------------------------------------------------- merge_tasks, exclude_rows

def _merge_reference(rows: np.ndarray, intersection: bool, limit: int) -> list[list[int]]:
    """Per request: walk the tasks' lists rank by rank, keep each row once (intersection: only
    rows in every task's list), stop at `limit`."""
    out = []
    for per_task in rows:
        held = [set(int(x) for x in t if x >= 0) for t in per_task]
        every = set.intersection(*held)
        seen, kept = set(), []
        for r in range(per_task.shape[1]):
            for t in range(per_task.shape[0]):
                x = int(per_task[t, r])
                if x >= 0 and x not in seen and (not intersection or x in every):
                    seen.add(x)
                    kept.append(x)
        out.append(kept[:limit])
    return out


@pytest.mark.parametrize("tasks", [1, 2, 3])
@pytest.mark.parametrize("intersection", [False, True])
@pytest.mark.parametrize("limit", [None, 5, 40])
@pytest.mark.parametrize("dense", [True, False])  # the [B, N + 1] table of a small pool, the sort of a large one
def test_merge_tasks_matches_a_rank_by_rank_walk(tasks, intersection, limit, dense):
    rng = np.random.default_rng(10 * tasks + intersection)
    B, K, n = 7, 9, 23  # a small row space: the tasks' lists overlap a lot
    rows = np.full((B, tasks, K), -1, dtype=np.int64)
    for b in range(B):
        for t in range(tasks):
            m = int(rng.integers(0, K + 1))  # some lists short or empty (-1 padding), rows unique per task
            if b == 0:  # request 0: rows 4, 5, 6 retrieved by every task
                m = max(m, 3)
                rows[b, t, :m] = np.r_[[4, 5, 6], rng.choice(np.setdiff1d(np.arange(n), [4, 5, 6]), m - 3, replace=False)]
            else:
                rows[b, t, :m] = rng.choice(n, m, replace=False)
    cap = tasks * K if limit is None else limit
    got = merge_tasks(torch.from_numpy(rows), intersection, cap, n, n if dense else n - 1)
    assert got.shape == (B, cap) and got.dtype == torch.int64
    want = _merge_reference(rows, intersection, cap)
    for b in range(B):
        kept = got[b][got[b] >= 0].tolist()
        assert kept == want[b], (b, kept, want[b])  # the same rows, in the same rank-by-rank order
        assert bool((got[b][len(kept):] == -1).all())
    if cap >= 3:
        assert {4, 5, 6} <= set(got[0].tolist())


@pytest.mark.parametrize("num_rows", [-1, 7])
def test_merge_tasks_all_padding(num_rows):
    assert bool((merge_tasks(torch.full((2, 2, 3), -1, dtype=torch.int64), False, 6, num_rows) == -1).all())
    disjoint = torch.tensor([[[1, 2, 3], [4, 5, 6]]])
    assert bool((merge_tasks(disjoint, True, 4, num_rows) == -1).all())


@pytest.mark.parametrize("dense", [True, False])
def test_exclude_rows_matches_python_sets(dense):
    """Both ways (the bool table of a small pool, the shifted 1-D search of a large one) against sets;
    the exclusions in no particular order."""
    rng = np.random.default_rng(3)
    B, M, E, n = 6, 11, 5, 23
    rows = np.where(rng.random((B, M)) < 0.2, -1, rng.integers(0, n, (B, M)))
    exclude = np.full((B, E), -1, dtype=np.int64)
    for b in range(B):
        e = np.unique(rng.choice(n, int(rng.integers(0, E + 1)), replace=False))
        exclude[b, E - e.size:] = e
    exclude[1, :] = -1  # nothing excluded
    exclude[2, :] = np.arange(n - E, n)  # the largest rows excluded (the shifted search's edge)
    exclude[3, :] = np.arange(E)  # the smallest
    exclude = rng.permuted(exclude, axis=1)  # any order, -1 anywhere
    got = exclude_rows(torch.from_numpy(rows), torch.from_numpy(exclude), n, n if dense else n - 1).numpy()
    for b in range(B):
        ex = set(exclude[b][exclude[b] >= 0].tolist())
        want = [-1 if (x < 0 or x in ex) else x for x in rows[b].tolist()]
        assert got[b].tolist() == want, b


# ------------------------------------------------------------------------------ candidate_rows


def _candidates_reference(q, found, exclude, emb, k0, limit, intersection) -> list[list[int]]:
    """Per request, in Python: each task's rows not excluded, scored <q, emb[row]> in float64, the
    best k0 by (score desc, position asc), then the rank-by-rank walk."""
    B, T = exclude.shape[0], found.shape[0] // exclude.shape[0]
    q, emb = q.double().numpy(), emb.double().numpy()
    lists = np.full((B, T, max(1, k0)), -1, dtype=np.int64)
    for b in range(B):
        ex = set(exclude[b].tolist()) - {-1}
        for t in range(T):
            qt = q[b * T + t]
            scored = [(-float(qt @ emb[r]), j, r) for j, r in enumerate(found[b * T + t].tolist())
                      if r >= 0 and r not in ex]
            best = [r for _, _, r in sorted(scored)[:k0]]
            lists[b, t, :len(best)] = best
    return _merge_reference(lists, intersection, limit)


def _case(seed, B, T, K, D, n, E, emb_dtype=torch.bfloat16, pad=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (B * T, D), generator=g).float()
    emb = torch.randint(-3, 4, (n, D), generator=g).to(emb_dtype)  # small integers: exact, many ties
    found = torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(B * T)])
    found[:, K - pad:] = -1  # the search's padding
    if B > 1:
        found[1] = -1  # a query the search found nothing for
    ex = torch.stack([torch.randperm(n, generator=g)[:E] for _ in range(B)])
    ex[:, : E // 3] = -1  # -1 anywhere, rows in no order
    ex = ex[:, torch.randperm(E, generator=g)]
    if B > 2:  # request 2 excludes task 0's first rows, one of them twice
        ex[2, :2] = found[2 * T, :2]
        ex[2, 2] = found[2 * T, 0]
    return q, found, ex, emb


@pytest.mark.parametrize("B,T,K,D,n,E,k0,limit", [
    (1, 2, 40, 16, 60, 9, 20, 30),    # one request, two tasks, a limit below T*k0
    (5, 3, 17, 7, 25, 6, 17, 51),     # D below one 16-lane block, every row kept, tasks overlapping a lot
    (4, 1, 33, 40, 90, 5, 8, 3),      # one task, D with a ragged tail, limit < k0
    (3, 2, 12, 16, 30, 4, 50, 200),   # k0 above K and limit above every candidate: -1 padding
    (6, 4, 25, 24, 200, 30, 10, 40),  # exclusions longer than many lists
])
@pytest.mark.parametrize("intersection", [False, True])
@pytest.mark.parametrize("emb_dtype", [torch.bfloat16, torch.float32])
def test_candidate_rows_equals_the_reference(B, T, K, D, n, E, k0, limit, intersection, emb_dtype):
    q, found, ex, emb = _case(B * 100 + T + K, B, T, K, D, n, E, emb_dtype)
    got = torch.ops.silverrec.candidate_rows(q, found, ex, emb, k0, limit, intersection)
    assert got.shape == (B, limit) and got.dtype == torch.int64
    want = _candidates_reference(q, found, ex, emb, k0, limit, intersection)
    for b in range(B):
        kept = got[b][got[b] >= 0].tolist()
        assert kept == want[b], (b, kept, want[b])
        assert bool((got[b][len(kept):] == -1).all())
    assert torch.equal(got, candidate_rows_torch(q, found, ex, emb, k0, limit, intersection))  # the CUDA path's composition
    if B > 2:
        assert not set(got[2].tolist()) & set(found[2 * T, :2].tolist())


def test_candidate_rows_runs_the_cpp_kernel_and_drops_nan_scores():
    assert runs_cpp_kernel("candidate_rows"), "the operator library registers the C++ kernel"
    q, found, ex, emb = _case(7, 2, 2, 20, 16, 40, 4, torch.float32)
    q[0] = float("nan")  # request 0's task 0 scores NaN everywhere: its rows are dropped, task 1's kept
    got = torch.ops.silverrec.candidate_rows(q, found, ex, emb, 10, 40, False)
    task1 = _candidates_reference(q[[1]], found[[1]], ex[[0]], emb, 10, 40, False)[0]
    assert got[0][got[0] >= 0].tolist() == task1
    assert torch.equal(got, candidate_rows_torch(q, found, ex, emb, 10, 40, False))


def test_candidate_rows_bad_input_is_named():
    q, found, ex, emb = _case(3, 2, 2, 10, 8, 20, 3)
    with pytest.raises(IndexError, match="out of range"):
        torch.ops.silverrec.candidate_rows(q, found.clamp_max(19) + 1, ex, emb, 5, 10, False)
    with pytest.raises(RuntimeError, match="disagree"):
        torch.ops.silverrec.candidate_rows(q[:3], found[:3], ex, emb, 5, 10, False)
    with pytest.raises(RuntimeError, match="queries must be float32"):
        torch.ops.silverrec.candidate_rows(q.double(), found, ex, emb, 5, 10, False)


def test_candidate_rows_export_keeps_one_op():
    """The op traces as one node of the exported program (its fake gives [B, limit])."""

    class Tail(torch.nn.Module):
        def forward(self, q, found, ex, emb):
            return torch.ops.silverrec.candidate_rows(q, found, ex, emb, 5, 7, False)

    q, found, ex, emb = _case(5, 3, 2, 10, 8, 20, 3)
    prog = torch.export.export(Tail(), (q, found, ex, emb))
    calls = [n.target for n in prog.graph.nodes if n.op == "call_function"]
    assert calls == [torch.ops.silverrec.candidate_rows.default]
    assert torch.equal(prog.module()(q, found, ex, emb), Tail()(q, found, ex, emb))
