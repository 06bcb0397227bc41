"""requirements.lock agrees with pyproject.toml, the Makefile and the environment (tools/lock.py)."""

import importlib.util
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("silverrec_lock_tool", ROOT / "tools" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)


def test_every_pyproject_dependency_is_locked_within_its_specifier():
    """Dependencies, every extra and the setuptools build backend: locked, version inside the spec."""
    locked = lock.parse_lock(lock.LOCK.read_text())
    roots = lock.root_requirements()
    assert {"torch", "numpy", "torchrec", "fbgemm-gpu-cpu", "setuptools"} <= {r.name for r in roots}
    assert lock.disagreements(locked, roots) == []


def test_every_package_the_makefile_installs_is_locked():
    """make setup installs the lock with --no-deps, and anything it names by hand is locked too."""
    makefile = (ROOT / "Makefile").read_text()
    assert "$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements.lock" in makefile
    locked = lock.parse_lock(lock.LOCK.read_text())
    assert lock.disagreements(locked, lock.makefile_requirements(makefile)) == []
    # The CPU builds the Makefile used to name by hand stay pinned exactly.
    assert locked["torch"].startswith("2.13.0") and locked["torchrec"] == "1.8.0"
    assert locked["fbgemm-gpu-cpu"] == "1.8.0" and "fbgemm-gpu" not in locked


def test_lock_is_the_closure_of_this_environment():
    """The lock equals what tools/lock.py writes from the running venv (stale lock or drifted venv)."""
    assert lock.LOCK.read_text() == lock.render(lock.resolve_installed(lock.root_requirements()))


def test_disagreements_are_named():
    """The checker itself: a pin outside a specifier and a missing package are both reported."""
    locked = lock.parse_lock("# c\nnumpy==2.4.6\ntorch==2.13.0+cpu\n")
    msgs = lock.disagreements(locked, [Requirement("numpy>=3"), Requirement("pyarrow>=14"), Requirement("torch>=2.13,<2.14")])
    assert len(msgs) == 2
    assert "numpy==2.4.6" in msgs[0] and "numpy>=3" in msgs[0]
    assert "pyarrow>=14 is not in requirements.lock" == msgs[1]
    make = "x:\n\t$(BIN)/pip install -q --no-deps -r requirements.lock torch==2.12.0 \\\n\t\tfaiss-cpu\n" \
           "\t$(BIN)/pip install --no-deps -e .\n\t$(VENV)/ray/bin/pip install ray[serve]\n"
    reqs = lock.makefile_requirements(make)
    assert [str(r) for r in reqs] == ["torch==2.12.0", "faiss-cpu"]
    assert len(lock.disagreements(locked, reqs)) == 2


@pytest.mark.parametrize("bad", ["numpy>=2\n", "numpy==2.4.6\nNumPy==2.4.6\n", "numpy\n"])
def test_malformed_lock_is_a_named_error(bad):
    with pytest.raises(lock.LockError, match="requirements.lock line"):
        lock.parse_lock(bad)

