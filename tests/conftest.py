"""Shared test setup: Triton runs in its interpreter on CPU tensors, publish is quiet, seeds fixed."""

import os

# Must be set before anything imports triton (the kernels import it lazily). Not for the GPU suite
# (`make test-gpu` sets SILVERREC_GPU_TESTS=1): there Triton compiles for the device.
if os.environ.get("SILVERREC_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SILVERREC_QUIET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

ANN_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "ann")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)
    yield
