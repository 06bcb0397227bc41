"""Import silverrec from this checkout without installing it (no pip, no network, no venv).

pyproject.toml's `[tool.setuptools.package-dir]` maps packages to folders that are not where Python
would look (`silverrec.kernels` -> kernels/, `silverrec.publish` -> publish/); an editable install
does that mapping with a finder of its own. On a machine whose python3 only has torch and triton
(the GPU machine of `make test-gpu`), `install()` puts the repository first on sys.path and adds a
meta-path finder reading the same table from pyproject.toml, so `import silverrec` works from the
checkout alone. Nothing is written anywhere (no .pth file, no build, no compiled C++ extension:
silverrec's CPU kernels then run their torch implementations, which the CPU tests show equal).

    sys.path.insert(0, str(REPO / "tools")); import repo_import; repo_import.install()
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def package_dirs(repo: Path = REPO) -> dict[str, Path]:
    """pyproject's package-dir table: {dotted package: its folder}, the identity entries left out."""
    with open(repo / "pyproject.toml", "rb") as f:
        table = tomllib.load(f)["tool"]["setuptools"].get("package-dir", {})
    return {name: repo / folder for name, folder in table.items() if folder != name.replace(".", "/")}


class RepoLayoutFinder(importlib.abc.MetaPathFinder):
    """Finds the packages of `package_dirs` in their folders (their submodules then load normally)."""

    def __init__(self, dirs: dict[str, Path]):
        self.dirs = dirs

    def find_spec(self, name, path=None, target=None):
        folder = self.dirs.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def install(repo: Path = REPO) -> None:
    """Make `import silverrec` load this checkout (idempotent; harmless beside an editable install,
    whose finder maps the same folders)."""
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    if not any(isinstance(f, RepoLayoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, RepoLayoutFinder(package_dirs(repo)))
