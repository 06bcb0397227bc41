"""AOTInductor packages (silverrec/aoti.py): a published pure-ANN snapshot holds model.cpu.pt2, named in the manifest
with the torch that built it and checksummed like every file; a fresh Python process loads it with backend "aoti"
and answers every request exactly as backend "export" does (the same kernels: item ids equal, scores equal), over
batch sizes, k, nprobe and filters the example never had. One compile (minutes on a small machine): the suite's
only one."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from silverrec.aoti import PACKAGE_FILES, TensorEntry, entry_arguments, int_arg
from silverrec.errors import SnapshotError
from silverrec.publish.filtered_ivf import publish_index
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool
from silverrec.snapshot import read_manifest
from tests.helpers import REPO

COMPARE = """
import sys, json, numpy as np, torch, silverrec
path = sys.argv[1]
a, e = silverrec.load(path, backend="aoti"), silverrec.load(path, backend="export")
assert a.backend == "aoti" and type(a.module).__name__ == "AotiProgram"
rng = np.random.default_rng(5)
checked = 0
for b, k, options in [(1, 10, {}), (16, 7, {"nprobe": 4}), (3, 50, {"filter": "colour = c1"}),
                      (5, 1, {"filter": "NOT colour = c2 AND size = s0", "nprobe": 2}), (2, 300, {})]:
    q = rng.normal(size=(b, 16)).astype(np.float32)
    x, y = a.search(q, k, **options), e.search(q, k, **options)
    assert torch.equal(x.item_ids, y.item_ids), (b, k, options)
    assert torch.equal(x.scores, y.scores), (b, k, options)
    checked += 1
print(json.dumps({"checked": checked}))
"""


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    rng = np.random.default_rng(0)
    n = 3000
    x = rng.normal(size=(n, 16)).astype(np.float32)
    feats = {"colour": [[f"c{v}"] for v in rng.integers(0, 4, n)], "size": [[f"s{v}"] for v in rng.integers(0, 3, n)]}
    pool = Pool(np.arange(n, dtype=np.int64) * 3 + 1, x, feats)
    mp = pytest.MonkeyPatch()
    mp.setenv("SILVERREC_AOTI", "1")  # the suite turns the packages off (tests/conftest.py)
    try:
        path = publish_index(pool, tmp_path_factory.mktemp("aoti") / "s", config=IVFConfig(nlist=12, seed=0),
                             torchscript=False)
    finally:
        mp.undo()
    return path


def test_the_manifest_names_the_package_and_its_torch(snapshot):
    manifest = read_manifest(snapshot)
    entry = manifest["config"]["backend"]["aoti"]["cpu"]
    assert entry["file"] == PACKAGE_FILES["cpu"] and entry["torch"] == torch.__version__
    assert entry["file"] in manifest["files"] and (snapshot / entry["file"]).stat().st_size == manifest["files"][entry["file"]]["bytes"]
    assert manifest["config"]["backend"]["preferred"] in ("export", "aoti")
    assert {"export_ms", "aoti_ms"} <= set(manifest["config"]["backend"])


def test_a_fresh_process_answers_as_the_exported_program(snapshot):
    out = subprocess.run([sys.executable, "-c", COMPARE, str(snapshot)], capture_output=True, text=True, cwd=REPO,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"checked": 5}


def test_an_altered_package_is_refused(snapshot, tmp_path):
    import shutil

    copy = tmp_path / "s"
    shutil.copytree(snapshot, copy)
    with open(copy / PACKAGE_FILES["cpu"], "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(SnapshotError, match="checksum"):
        read_manifest(copy)


def test_the_entry_point_takes_ints_as_lengths():
    """The tensors-only entry point: each int argument as the length of an empty tensor, the module called with
    the same ints (no package compiled here)."""

    class Echo(torch.nn.Module):
        def forward(self, x: torch.Tensor, k: int, flag: bool, n: int):
            return x[:, :k] * n

    x = torch.arange(12.0).reshape(2, 6)
    positions, args, dynamic = entry_arguments(Echo(), (x, 4, True, 3), {"x": {0: None}, "k": None, "flag": None,
                                                                         "n": None})
    assert positions == [1, 3] and args[1].shape == (4, 0) and args[1].numel() == 0 and args[2] is True
    assert len(dynamic["args"]) == 4
    assert torch.equal(TensorEntry(Echo(), positions)(*args), Echo()(x, 4, True, 3))
    assert int_arg(0).shape == (0, 0)


def test_a_package_that_does_not_compile_is_recorded_not_fatal(tmp_path, monkeypatch):
    """A compiler failure leaves no package file and a manifest entry that says why; the loader reports it."""
    from silverrec import aoti
    from silverrec.aoti import compile_packages, package_entry

    def fails(module, args, dynamic, directory, export_program, device):
        (directory / PACKAGE_FILES[device]).write_bytes(b"partial")
        raise RuntimeError("cannot lower op X\nlong trace")

    monkeypatch.setattr(aoti, "compile_package", fails)
    with pytest.warns(UserWarning, match="no AOTInductor cpu package: RuntimeError: cannot lower op X"):
        packages = compile_packages(torch.nn.Identity(), (torch.ones(1),), {}, tmp_path, lambda *a: None)
    assert packages["cpu"] == {"error": "RuntimeError: cannot lower op X", "torch": torch.__version__}
    assert not (tmp_path / PACKAGE_FILES["cpu"]).exists()
    assert package_entry({"config": {"backend": {"aoti": packages}}}, "cpu") is None
