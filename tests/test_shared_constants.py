"""Constants shared by Python and the C++ CPU kernels are defined twice; this test keeps them equal.

The C++ sources are parsed (not the compiled extension), so the check runs without a compiler.
"""

import re
from pathlib import Path

from silverrec.retrieval.filtered_ivf import MODE_AUTO, MODE_PROBED, MODE_UNPROBED
from silverrec.kernels import bloom_filter
from silverrec.kernels.filtered_topk import NO_LISTS

CSRC = Path(__file__).resolve().parents[1] / "kernels" / "csrc"


def _constexprs(text: str) -> dict[str, int]:
    return {name: int(value) for name, value in re.findall(r"\b(k\w+)\s*=\s*(-?\d+)\b", text)}


def test_search_modes_match_plan_cpp():
    c = _constexprs((CSRC / "plan.cpp").read_text())
    assert (c["kModeAuto"], c["kModeProbed"], c["kModeUnprobed"]) == (MODE_AUTO, MODE_PROBED, MODE_UNPROBED)


def test_no_lists_matches_scan_h():
    assert _constexprs((CSRC / "scan.h").read_text())["kNoLists"] == NO_LISTS


def test_program_opcodes_match_program_h():
    enum = re.search(r"enum Op : int64_t \{([^}]*)\}", (CSRC / "program.h").read_text()).group(1)
    names = [n.strip().split("=")[0].strip() for n in enum.split(",")]
    assert names[0] == "kNop" and "= 0" in enum.split(",")[0]
    cpp = {n: i for i, n in enumerate(names)}  # implicit enum values count up from 0
    py = {"kNop": bloom_filter.OP_NOP, "kPush": bloom_filter.OP_PUSH, "kAnd": bloom_filter.OP_AND, "kOr": bloom_filter.OP_OR,
          "kNot": bloom_filter.OP_NOT, "kFalse": bloom_filter.OP_FALSE, "kTrue": bloom_filter.OP_TRUE}
    assert cpp == py
