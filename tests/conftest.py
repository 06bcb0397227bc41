"""Shared test setup: Triton runs in its interpreter on CPU tensors, publish is quiet and compiles no AOTInductor
package (minutes each on a small machine; tests/test_aoti.py asks for them), seeds fixed."""

import os

# Must be set before anything imports triton (the kernels import it lazily). Not for the GPU suite
# (`make test-gpu` sets SILVERREC_GPU_TESTS=1): there Triton compiles for the device.
if os.environ.get("SILVERREC_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SILVERREC_QUIET", "1")
os.environ.setdefault("SILVERREC_AOTI", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

ANN_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "ann")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)
    yield


@pytest.fixture(params=["alone", "team", "openmp"])
def team_mode(request):
    """Who runs the C++ ops' parallel steps (kernels/csrc/team.h), pinned for the test: the calling thread alone;
    the helper team, each step of several chunks waiting until a helper has taken one, and the test fails unless
    some chunk ran on a helper (the split paths, whatever the wake latency); or torch's OpenMP threads (where
    their workers spin). The same results every way."""
    from silverrec.kernels.library import host

    ext = host()
    if request.param != "alone" and torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: nothing to split between")
    before = ext.team_helper_chunks()
    ext.set_team_pin({"alone": 0, "team": 1, "openmp": 2}[request.param])
    try:
        yield request.param
    finally:
        ext.set_team_pin(-1)
    ran = ext.team_helper_chunks() - before
    if request.param == "team":
        assert ran > 0, "no chunk of the test's steps ran on a helper thread: its split paths went untested"
    else:
        assert ran == 0, f"{ran} chunks ran on helpers with the steps pinned to {request.param}"
