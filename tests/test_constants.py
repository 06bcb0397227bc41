"""The constants shared by Python, C++ and Triton are defined once (kernels/constants.py): the C++ header
kernels/csrc/constants.h is generated from the module, and is what the module generates today."""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gen_constants", REPO / "tools" / "gen_constants.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


def test_the_checked_in_header_is_the_generated_one():
    assert gen.HEADER.read_text() == gen.header(gen.load_constants()), \
        "kernels/csrc/constants.h is out of date: run python tools/gen_constants.py"


def test_every_constant_of_the_module_is_in_the_header():
    module = gen.load_constants()
    text = gen.HEADER.read_text()
    names = [n for n in vars(module) if n.isupper() and not n.startswith("_")]
    assert len(names) > 40
    for name in names:
        value = getattr(module, name)
        if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
            for i, field in enumerate(value):  # a layout: each field's position in its namespace
                assert f"constexpr int64_t {gen.camel(field)} = {i};" in text.split(f"namespace {name.lower()} {{")[1]
        else:
            assert re.search(rf"constexpr \w+ {gen.camel(name)}\b", text), name


def test_values_without_a_cpp_form_are_refused():
    with pytest.raises(TypeError, match="no C\\+\\+ form"):
        gen.declaration("NAMES", {"a": 1})
    with pytest.raises(TypeError, match="only ints or only names"):
        gen.declaration("MIXED", (1, "a"))


def test_the_cpp_sources_define_no_shared_constant_again():
    """No C++ source (but the generated header) defines a constant the header defines: a copy could drift."""
    defined = set(re.findall(r"^constexpr \w+ (k\w+)", gen.HEADER.read_text(), re.MULTILINE))
    assert {"kOpPush", "kModeAuto", "kRoutePosting", "kNoLists", "kEmptyKey", "kExactFloatRows"} <= defined
    for path in (REPO / "kernels" / "csrc").glob("*.[ch]*"):
        if path != gen.HEADER:
            again = defined & set(re.findall(r"constexpr\s+[\w:]+\s+(k\w+)", path.read_text()))
            assert not again, f"{path.name} defines {sorted(again)} again (constants.h has them)"
