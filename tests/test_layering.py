"""The package's import layering, read from the source (ast) of every module of silverrec,
silverrec.publish and silverrec.kernels (pyproject's package-dir): no import cycle between modules
or between the top-level parts of silverrec, kernels/ importing nothing of the runtime, and
`import silverrec` / `import silverrec.kernels` staying light in a fresh interpreter.

Every import counts, at module level or inside a function (a lazy import is still a dependency).
An import of a module's own ancestor package is left out: Python runs every ancestor's __init__
before the module itself, so such an edge adds nothing (this is how each module reaches the root
`silverrec/__init__.py`, whose public names are loaded lazily and which imports only threads.py).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ("ranking", "retrieval", "serving", "filtering", "generative", "publish")  # what kernels/ must not import


def package_dirs() -> dict[str, Path]:
    """Package name -> its source folder, as pyproject installs them (package-dir, else the name's path)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    where = tool.get("package-dir", {})
    return {name: ROOT / where.get(name, name.replace(".", "/")) for name in tool["packages"]}


def modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of every installed package."""
    out = {}
    for pkg, folder in package_dirs().items():
        for f in folder.glob("*.py"):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The silverrec modules `name` imports (`from P import X` counts as P.X where that is a module)."""
    is_pkg = path.stem == "__init__"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # a compiled module -> its package
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # not itself, not its own ancestors
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def explain(graph: dict[str, set[str]], comp: list[str]) -> str:
    return "; ".join(f"{v} -> {sorted(graph[v] & set(comp))}" for v in comp)


def part(module: str) -> str:
    """The top-level part of silverrec a module belongs to: silverrec.serving.app -> silverrec.serving."""
    return ".".join(module.split(".")[:2])


def test_the_walker_sees_the_package():
    graph = import_graph()
    assert {"silverrec", "silverrec.kernels", "silverrec.publish", "silverrec.serving.predictor",
            "silverrec.publish.cli", "silverrec.kernels.library"} <= set(graph)
    assert "silverrec.serving.predictor" in graph["silverrec.serving.loader"]  # a module-level import
    assert "silverrec.publish.cli" in graph["silverrec.cli"]  # a lazy import inside a function


def test_cycles_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def in_kernels(comp: list[str]) -> bool:
    return all(part(v) == "silverrec.kernels" for v in comp)


def test_no_import_cycle_between_modules():
    """(A cycle inside kernels/ is the kernels test's.)"""
    graph = import_graph()
    found = [c for c in cycles(graph) if not in_kernels(c)]
    assert not found, "import cycles: " + " | ".join(explain(graph, c) for c in found)


def test_no_import_cycle_between_the_parts_of_silverrec():
    """serving/, generative/, retrieval/, rec_model.py, publish/, kernels/ ...: each part may import
    parts below it only (serving -> generative, never back)."""
    graph: dict[str, set[str]] = {}
    for v, targets in import_graph().items():
        graph.setdefault(part(v), set()).update(part(t) for t in targets if part(t) != part(v) and t != "silverrec")
    found = cycles(graph)
    assert not found, "cycles between parts: " + " | ".join(explain(graph, c) for c in found)


def test_kernels_import_nothing_of_the_runtime_and_have_no_cycle():
    """kernels/ is the bottom layer: no module of it imports silverrec.ranking, retrieval, serving,
    filtering, generative or publish, and its modules import one another without a cycle."""
    graph = import_graph()
    bad = {v: sorted(t for t in targets if part(t) in {f"silverrec.{r}" for r in RUNTIME})
           for v, targets in graph.items() if part(v) == "silverrec.kernels"}
    assert not {v: t for v, t in bad.items() if t}, "kernels import the runtime"
    found = [c for c in cycles(graph) if in_kernels(c)]
    assert not found, "import cycles in kernels/: " + " | ".join(explain(graph, c) for c in found)


def test_runtime_imports_nothing_of_publish():
    """A serving host needs no silverrec.publish: no module of silverrec outside publish/ imports it,
    except the CLI's entry point, which dispatches the build commands to it lazily."""
    graph = import_graph()
    bad = {v: sorted(t for t in targets if part(t) == "silverrec.publish")
           for v, targets in graph.items() if part(v) != "silverrec.publish" and v != "silverrec.cli"}
    assert not {v: t for v, t in bad.items() if t}


def fresh(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_import_silverrec_is_light_and_its_names_load_on_use():
    assert fresh("import sys, silverrec; print('torch' in sys.modules)") == "False"
    out = fresh("import sys, silverrec; heavy = [m for m in sys.modules if m.startswith('silverrec.') "
                "and m != 'silverrec.threads']; print(heavy); print(silverrec.QueryError.__module__, "
                "silverrec.load.__module__, silverrec.Snapshot.__name__, silverrec.FORMAT_VERSION > 0, "
                "'load' in dir(silverrec), 'torch' in sys.modules)")
    assert out.splitlines() == ["[]", "silverrec.errors silverrec.serving.loader Snapshot True True True"]
    with pytest.raises(AttributeError, match="has no attribute 'nonexistent'"):
        import silverrec

        silverrec.nonexistent  # noqa: B018


def test_importing_a_kernel_does_not_import_the_predictor():
    out = fresh("import silverrec.kernels, sys, torch; print('silverrec.serving.predictor' in sys.modules, "
                "hasattr(torch.ops.silverrec, 'filtered_ivf_search'))")
    assert out == "False True"


def test_the_runtime_commands_import_nothing_of_publish(tmp_path):
    """`silverrec inspect` (a runtime command) runs without importing silverrec.publish; a build command's
    parser still comes with `--help`."""
    out = fresh("import sys; from silverrec.cli import main; code = main(['inspect', 'missing-dir']); "
                "print(code, [m for m in sys.modules if m.startswith('silverrec.publish')])")
    assert out.splitlines()[-1] == "2 []"
    assert "publish" in fresh("from silverrec.cli import build_parser; print(build_parser().format_help())")
