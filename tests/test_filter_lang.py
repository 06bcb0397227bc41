"""Filter language: parsing, errors with positions, compile to programs (against the exact evaluator)."""

import pytest
import torch

from silverrec.errors import QueryError
from silverrec.filtering.filter_lang import And, FilterSyntaxError, Not, Or, Term, parse, to_string
from silverrec.filtering.filter_program import FilterPlan, compile_batch, compile_filter, normalize_filters
from silverrec.bitmask import unpack_bits
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.kernels.bloom_filter import bloom_filter_reference
from silverrec.kernels.constants import OP_FALSE, OP_NOT, OP_PUSH
from silverrec.publish.bloom import BloomConfig, build_filter_bank


def test_parse_precedence_and_sugar():
    ast = parse("country = US AND (lang IN (EN, 'es') OR lang = \"pt BR\") AND NOT genre = Horror")
    assert ast == And(
        (
            Term("country", ("US",)),
            Or((Term("lang", ("EN", "es")), Term("lang", ("pt BR",)))),
            Not(Term("genre", ("Horror",))),
        )
    )
    # AND binds tighter than OR; NOT tighter than AND; keywords case-insensitive
    assert parse("a = 1 or b = 2 and not c = 3") == Or(
        (Term("a", ("1",)), And((Term("b", ("2",)), Not(Term("c", ("3",))))))
    )
    assert parse("a != x") == Not(Term("a", ("x",)))
    assert parse("a NOT IN (x, y, x)") == Not(Term("a", ("x", "y")))
    assert parse("'my feature' = 'it\\'s'") == Term("my feature", ("it's",))
    assert parse("a = 'AND'") == Term("a", ("AND",))


@pytest.mark.parametrize(
    "text",
    ["a = b", "a IN (x, 'y z')", "NOT (a = b OR c = d) AND e != f", "x = 'OR' AND y IN (\"1\", 2)"],
)
def test_to_string_round_trips(text):
    ast = parse(text)
    assert parse(to_string(ast)) == ast


@pytest.mark.parametrize(
    "text, position, words",
    [
        ("", 0, "empty filter"),
        ("a = ", 4, "expected a value"),
        ("a = b AND", 9, "expected a feature name"),
        ("(a = b", 6, "expected ')'"),
        ("a b", 2, "after feature 'a'"),
        ("a IN (x,", 8, "expected a value"),
        ("a IN x", 5, "'(' after IN"),
        ("a = b c = d", 6, "expected AND, OR"),
        ("country = US AND lang = 'EN", 24, "unterminated string"),
        ("a = b ; drop", 6, "unexpected character"),
        ("a = AND", 4, "keyword AND"),
        ("a NOT b", 6, "expected IN after NOT"),
    ],
)
def test_syntax_errors_name_the_position(text, position, words):
    with pytest.raises(FilterSyntaxError) as e:
        parse(text)
    assert e.value.position == position
    assert f"position {position}" in str(e.value) and words in str(e.value)
    assert isinstance(e.value, QueryError)


FEATURES = {
    "genre": [["Drama"], ["Comedy", "Drama"], [], ["Horror"], ["Comedy"], ["Drama", "Horror", "Comedy"]] * 20,
    "lang": [["EN"], ["ES"], ["EN"], ["FR"], ["ES"], ["EN"]] * 20,
}


@pytest.fixture(scope="module")
def small_bank():
    fwd = ForwardIndex.from_lists(FEATURES)
    bank, cfg = build_filter_bank(fwd, BloomConfig(bits=256, hashes=5))
    return fwd, bank, FilterPlan.from_config(cfg)


def test_unknown_feature_is_an_error_naming_it(small_bank):
    _, _, plan = small_bank
    with pytest.raises(QueryError, match=r"unknown feature 'langauge' in filter at position 17"):
        compile_filter("genre = Drama OR langauge = EN", plan)


def test_unknown_value_matches_nothing_exactly(small_bank):
    fwd, bank, plan = small_bank
    assert compile_filter("genre = Western", plan) == [(OP_FALSE, [])]
    # IN drops unknown values; NOT of an unknown value matches everything
    assert compile_filter("genre IN (Western, Drama)", plan) == compile_filter("genre = Drama", plan)
    ops, rows = compile_batch(["genre = Western", "NOT genre = Western", "genre = Western OR lang = FR"], plan)
    w = bank.shape[1]
    mask = bloom_filter_reference(bank, ops, rows, torch.zeros(3, 1, dtype=torch.int64), w)[:, 0]
    got = unpack_bits(mask, fwd.size)
    assert not got[0].any() and got[1].all()
    assert torch.equal(got[2], fwd.evaluate("lang = FR"))  # 256 bits, 3 tokens: no FP at this size


def test_negated_terms_compile_to_exact_planes(small_bank):
    _, _, plan = small_bank
    prog = compile_filter("NOT genre = Drama", plan)
    assert prog[-1] == (OP_NOT, [])
    planes = plan.exact["genre"]
    pushed = [r for op, r in prog if op == OP_PUSH]
    assert len(pushed) == planes.slots  # one exact push per slot, no Bloom rows
    assert all(abs(x if x >= 0 else ~x) >= plan.bloom_bits for r in pushed for x in r)
    # double negation is positive again: Bloom rows
    prog2 = compile_filter("NOT NOT genre = Drama", plan)
    assert prog2 == compile_filter("genre = Drama", plan)


def test_programs_match_exact_evaluator(small_bank):
    fwd, bank, plan = small_bank
    filters = [
        "genre = Drama",
        "genre IN (Comedy, Horror) AND lang = EN",
        "NOT (genre = Drama OR lang = ES)",
        "genre != Comedy AND NOT lang IN (FR, EN)",
        "(genre = Drama AND NOT genre = Horror) OR (lang = FR AND NOT genre = Comedy)",
        None,
    ]
    ops, rows = compile_batch(filters, plan)
    assert ops.shape[0] == len(filters) and rows.shape[:2] == ops.shape
    mask = torch.ops.silverrec.bloom_filter(bank, ops, rows, torch.zeros(len(filters), 1, dtype=torch.int64), bank.shape[1])
    got = unpack_bits(mask[:, 0], fwd.size)
    want = fwd.evaluate_batch(filters)
    assert torch.equal(got, want)  # 256 bits for <= 4 tokens per item: measured FP-free


def test_normalize_filters():
    assert normalize_filters(None, 3) is None
    assert normalize_filters("a = b", 2) == ["a = b", "a = b"]
    assert normalize_filters([None, None], 2) is None
    with pytest.raises(QueryError, match="2 filters for 3 query rows"):
        normalize_filters(["a = b", None], 3)
