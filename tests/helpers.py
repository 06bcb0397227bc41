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
    """Real vectors from ../shared/data/ann/<name>: (base float32 [N, D], queries float32 [Q, D])."""
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
    """Run `python -m silverrec.publish.cli ARGS` in a fresh process."""
    env = dict(os.environ, SILVERREC_QUIET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "silverrec.publish.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"silverrec {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc
