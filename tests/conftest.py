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


@pytest.fixture(params=["alone", "shared"])
def team_mode(request):
    """The C++ ops' parallel steps (kernels/csrc/team.h) pinned to the calling thread alone, or shared: each step of
    several chunks waits until a helper thread has taken one, and the test fails unless some chunk ran on a helper
    (the split paths, whatever the wake latency). The same results either way."""
    from silverrec.kernels.cpu_ext import cpu_ext

    ext = cpu_ext()
    if ext is None:
        pytest.skip("the C++ CPU extension is not built")
    if request.param == "shared" and torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: the team has no helpers")
    before = ext.team_helper_chunks()
    ext.set_team_pin(0 if request.param == "alone" else 1)
    try:
        yield request.param
    finally:
        ext.set_team_pin(-1)
    ran = ext.team_helper_chunks() - before
    if request.param == "alone":
        assert ran == 0, f"{ran} chunks ran on helpers with the team pinned to the calling thread"
    else:
        assert ran > 0, "no chunk of the test's steps ran on a helper thread: its split paths went untested"
