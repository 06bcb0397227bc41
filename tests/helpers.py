"""Small shared test utilities: real ANN data, pools, subprocess CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ANN_DIR = Path(os.environ.get("SILVERREC_ANN_DATA", REPO.parent / "shared" / "data" / "ann"))


def load_ann(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Real vectors from ../shared/data/ann/<name>: (base float32 [N, D], queries float32 [Q, D]).

    The real-data tests are part of the suite, so a missing data folder is an error that says where
    the data was looked for (set SILVERREC_ANN_DATA to the folder of the ANN sets), not a skip."""
    if not (ANN_DIR / name / "base.npy").is_file():
        raise FileNotFoundError(
            f"ANN data set {name!r} not found under {ANN_DIR}: set SILVERREC_ANN_DATA to the folder that holds "
            f"{name}/base.npy and {name}/queries.npy (see its SOURCE.md)"
        )
    base = np.load(ANN_DIR / name / "base.npy").astype(np.float32)
    queries = np.load(ANN_DIR / name / "queries.npy").astype(np.float32)
    return base, queries


def inner_product_topk(base: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Float64 brute-force top-k row ids by inner product [Q, k] (the shipped ground truth is L2)."""
    s = queries.astype(np.float64) @ base.astype(np.float64).T
    return np.argsort(-s, axis=1, kind="stable")[:, :k]


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean |found ∩ truth| / |truth| over rows."""
    hits = [len(set(f.tolist()) & set(t.tolist())) for f, t in zip(found, truth)]
    return float(np.mean(hits)) / truth.shape[1]


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `python -m silverrec ARGS` in a fresh process."""
    env = dict(os.environ, SILVERREC_QUIET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "silverrec", *args], capture_output=True, text=True, env=env, timeout=600
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"silverrec {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def check_rescored_topk(ids: np.ndarray, scores: np.ndarray, ints: np.ndarray, floats: np.ndarray,
                        item_ids: np.ndarray, allowed: np.ndarray, k: int, scan_scores: np.ndarray,
                        tol: float = 1e-4) -> None:
    """Tie-tolerant check of a pure-ANN snapshot's exact answer against brute force. The snapshot
    ranks the int8 scan's top k' = k + rescore_margin(k) rows by the float query on their codes
    (kernels/rescore_rows.py); above RESCORE_MAX_K it returns the scan's top k as they are.
    ints int64 [B, N]: the int8 dot products that rank the scan; floats float64 [B, N]: the float
    query on the decoded codes; scan_scores float64 [B, N]: the scan's dequantised scores; allowed
    bool [B, N]; item_ids [N]. Per row: min(k, allowed) distinct allowed items, -1 / -inf padded,
    scores descending. Re-scored: each score is its item's float score, and no allowed item that
    every scan keeps (int score above the k'-th best: in any shard's top k' too) is left out with
    a float score above the lowest returned one. Above RESCORE_MAX_K: the items' int scores are the
    best k (the same items up to ties), each score its item's dequantised scan score."""
    from silverrec.kernels.rescore_rows import RESCORE_MAX_K, rescore_margin

    pos = {int(i): r for r, i in enumerate(item_ids)}
    kk = k + rescore_margin(k)
    for b in range(ids.shape[0]):
        n_allowed = int(allowed[b].sum())
        n_valid = min(k, n_allowed)
        got_ids = ids[b].tolist()
        assert all(i == -1 for i in got_ids[n_valid:]), "padding must be -1"
        got = got_ids[:n_valid]
        assert len(set(got)) == n_valid and -1 not in got
        rows = np.array([pos[i] for i in got], dtype=np.int64)
        assert allowed[b, rows].all()
        assert np.isneginf(scores[b, n_valid:]).all()
        assert np.all(np.diff(scores[b, :n_valid]) <= 0), "scores must descend"
        s = np.where(allowed[b], ints[b], np.iinfo(np.int64).min)
        if k > RESCORE_MAX_K:  # the scan's ranking
            np.testing.assert_array_equal(np.sort(ints[b, rows])[::-1], np.sort(s)[::-1][:n_valid])
            np.testing.assert_allclose(scores[b, :n_valid], scan_scores[b, rows], rtol=tol, atol=tol)
            continue
        np.testing.assert_allclose(scores[b, :n_valid], floats[b, rows], rtol=tol, atol=tol)
        sure = allowed[b].copy()
        if n_allowed > kk:
            sure &= ints[b] > np.sort(s)[::-1][kk - 1]
        sure[rows] = False
        if n_valid:
            assert floats[b, sure].max(initial=-np.inf) <= floats[b, rows].min() + tol, b


def compile_in_clean_process(script: str) -> None:
    """Run `script` (which prints "compiled") in a python process without TRITON_INTERPRET: the
    interpreter does not type-check like the compiler, and compiling for an H100 needs no GPU.
    Skips when triton has no NVIDIA backend."""
    import pytest

    if "nvidia" not in __import__("triton.backends", fromlist=["backends"]).backends:
        pytest.skip("triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def runs_cpp_kernel(op: str) -> bool:
    """Whether silverrec::`op`'s CPU kernel is the operator library's (registered from kernels/csrc when it loads)."""
    import torch

    import silverrec.kernels  # noqa: F401  (loads the operator library)

    cpu = [line for line in torch._C._dispatch_dump(f"silverrec::{op}").splitlines() if line.startswith("CPU:")]
    return bool(cpu) and "kernels/csrc/" in cpu[0]
