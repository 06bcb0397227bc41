"""Redraw the PNG of every benchmark result from its JSON, without running any benchmark.

    .venv/bin/python tools/plot_results.py              # every benchmarks/results/*.json with a plot
    .venv/bin/python tools/plot_results.py ann filter   # only these results (file stems)

A result file belongs to the benchmark script whose name is its longest prefix (`filter_conj.json`:
benchmarks/filter.py, `generative_quality_hybrid.json`: benchmarks/generative_quality.py), except
the few that `OWNERS` names. Each script redraws its own files (`python benchmarks/X.py --plot-only
NAME ...`, benchmarks/common.py `plot_only`); a result without a plotting script is reported and
skipped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
OWNERS = {"recommend_cuda": "recommend_device", "load_device_cpu": "load_device"}  # not named by their script


def owner(stem: str, scripts: list[str]) -> str | None:
    """The benchmark script (stem) that wrote results/STEM.json."""
    if stem in OWNERS:
        return OWNERS[stem]
    matches = [s for s in scripts if stem == s or stem.startswith(s + "_") or stem.startswith(s + ".")]
    return max(matches, key=len) if matches else None


def main(argv: list[str]) -> int:
    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    plotting = {s for s in scripts if "plot_only(" in (BENCHMARKS / f"{s}.py").read_text()}
    stems = argv or sorted(p.stem for p in RESULTS.glob("*.json") if not p.stem.endswith("_dry_run"))
    by_script: dict[str, list[str]] = {}
    for stem in stems:
        script = owner(stem, scripts)
        if script in plotting:
            by_script.setdefault(script, []).append(stem)
        else:
            print(f"skipped {stem}: {'no benchmark script' if script is None else f'benchmarks/{script}.py draws no plot'}")
    failed = []
    for script, names in by_script.items():
        rc = subprocess.run([sys.executable, str(BENCHMARKS / f"{script}.py"), "--plot-only", *names], cwd=ROOT).returncode
        if rc:
            failed.append(script)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
