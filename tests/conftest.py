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


@pytest.fixture(params=["spinning", "sleeping"])
def worker_policy(request):
    """The C++ ops' thresholds for splitting work between threads, pinned for the test to those of spinning
    or of sleeping OpenMP workers (kernels/csrc/threads.h): the same results either way."""
    from silverrec.kernels.cpu_ext import cpu_ext

    ext = cpu_ext()
    if ext is None:
        pytest.skip("the C++ CPU extension is not built")
    ext.set_workers_sleep(1 if request.param == "sleeping" else 0)
    yield request.param
    ext.set_workers_sleep(-1)
