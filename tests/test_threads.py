"""silverrec/threads.py: the OpenMP wait policy torch runs under, as the package sets and reads it, and as the
C++ ops read it to choose who runs their parallel steps (each case in a fresh interpreter: OpenMP reads the policy
once, when torch loads)."""

import os
import subprocess
import sys

import pytest

PROBE = "from silverrec.threads import OMP_PASSIVE; from silverrec.serving.recommend import ONE_THREAD_MAX_BATCH; " \
        "from silverrec.kernels.library import host; " \
        "import os; print(os.environ.get('OMP_WAIT_POLICY'), OMP_PASSIVE, ONE_THREAD_MAX_BATCH, host().parallel_runner())"


@pytest.mark.parametrize("first, env, want", [
    ("import silverrec", None, "PASSIVE True 16 team"),  # silverrec before torch: it sets PASSIVE
    ("import silverrec.kernels", None, "PASSIVE True 16 team"),  # any submodule first runs silverrec/__init__ first
    ("import torch; import silverrec", None, "None False 1 openmp"),  # torch loaded OpenMP first: default policy
    ("import silverrec", "ACTIVE", "ACTIVE False 1 openmp"),  # the user's setting wins
    ("import torch; import silverrec", "passive", "passive True 16 team"),
])
def test_wait_policy_and_the_one_thread_batch(first, env, want):
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env is not None:
        environ["OMP_WAIT_POLICY"] = env
    out = subprocess.run([sys.executable, "-c", f"{first}; {PROBE}"], env=environ, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip().splitlines()[-1] == want
