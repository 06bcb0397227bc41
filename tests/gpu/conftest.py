"""The GPU suite (`make test-gpu`): silverrec on CUDA tensors against its CPU path.

Runs from the checkout alone on a machine whose python3 has torch and triton (no install, no
network, no torchrec / fbgemm / faiss / pyroaring: tests needing them skip by importorskip):
tools/repo_import.py maps pyproject's package folders. Every test here is skipped without a CUDA
device, and under TRITON_INTERPRET=1 (the CPU suite's setting: `make test` collects this folder
too), since interpreted Triton cannot launch on CUDA tensors.

SILVERREC_TEST_DEVICE=cpu runs the suite's plumbing on the CPU instead (both sides on CPU: a dry
run of the test code itself, not a GPU check).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import repo_import  # noqa: E402

repo_import.install()

GPU_DIR = Path(__file__).resolve().parent
DEVICE = os.environ.get("SILVERREC_TEST_DEVICE", "cuda")


def skip_reason() -> str | None:
    """Why the GPU suite cannot run in this process, or None."""
    if DEVICE == "cpu":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 (the CPU suite): run the GPU suite with `make test-gpu`"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = skip_reason()
    if reason is None:
        return
    for item in items:
        if GPU_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    return torch.device(DEVICE)
