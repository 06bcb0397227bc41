"""Value model: compiled formulas vs the plain-Python reference, errors with JSON paths, export."""

import io
import math
import re

import pytest
import torch
from torch.export import Dim

from silverrec.errors import SilverrecError
from silverrec.kernels.constants import VALUE_OP_ADD, VALUE_OP_CONST, VALUE_OP_FEATURE, VALUE_OP_TASK
from silverrec.ranking.value_model import (
    OPERATORS,
    ValueModel,
    ValueModelError,
    compile_value_model,
    evaluate_formula,
    formula_to_json,
)
from silverrec.snapshot import export_program

TASKS = ["interacted", "rated_ge_4", "watch"]
FEATURES = ["is_new", "age", "price", "discount"]

FORMULAS = [
    {"weights": {"interacted": 0.7, "rated_ge_4": 0.3}},
    {"mul": [{"sigmoid": "task:interacted"}, {"add": [1, {"feature": "is_new"}, 0.5]}]},
    {"sub": [{"task": "rated_ge_4"}, "feature:price"]},
    {"div": ["feature:price", "feature:discount"]},  # discount is 0 for ~40% of candidates
    {"div": ["task:watch", {"sub": ["feature:age", 2]}]},
    {"min": ["task:interacted", "task:rated_ge_4", 0.2]},
    {"max": ["task:interacted", {"mul": [-1, "task:watch"]}]},
    {"min": ["task:watch"]},
    {"clamp": [{"mul": ["task:watch", 3]}, -1, {"feature": "age"}]},
    {"clamp": ["task:interacted", 2, {"feature": "age"}]},  # lo > hi for age < 2: hi wins
    {"pow": [{"sigmoid": "task:interacted"}, 2.5]},
    {"pow": ["task:rated_ge_4", 0.5]},  # negative bases -> 0
    {"pow": ["feature:discount", -1]},  # 0 ** -1 -> 0
    {"pow": ["task:watch", 3]},
    {"add": [{"gt": ["task:interacted", 0]}, {"ge": ["task:watch", 1]}, {"lt": ["task:rated_ge_4", "task:interacted"]},
             {"le": ["feature:age", 2]}, {"eq": ["feature:age", 3]}, {"eq": ["task:watch", "feature:age"]}]},
    {"and": [{"gt": ["task:interacted", 0]}, "feature:is_new"]},
    {"or": [{"gt": ["task:interacted", 1]}, "feature:is_new", {"lt": ["feature:price", 2]}]},
    {"and": ["feature:is_new"]},
    {"or": ["feature:discount"]},
    {"not": "feature:is_new"},
    {"not": {"sub": ["task:watch", 1]}},
    {"if": [{"ge": ["feature:age", 3]}, {"weights": {"interacted": 2, "watch": -1}},
            {"if": ["feature:is_new", 1.5, {"sigmoid": {"mul": ["task:rated_ge_4", 40]}}]}]},
    {"if": ["task:interacted", "task:watch", "task:rated_ge_4"]},
    2.5,
    "task:watch",
    "feature:price",
    '{"mul": [{"sigmoid": "task:interacted"}, {"max": [0.1, "feature:discount"]}]}',  # JSON text
]


def _random_inputs(b: int, k: int):
    scores = torch.randn(b, k, len(TASKS)) * 2
    scores[..., 2] = torch.randint(-1, 4, (b, k)).float()  # integer-valued "watch": eq can hold
    feats = torch.stack([
        torch.randint(0, 2, (b, k)).float(),                     # is_new
        torch.randint(0, 5, (b, k)).float(),                     # age (2 gives div by zero above)
        torch.rand(b, k) * 10,                                   # price
        torch.where(torch.rand(b, k) < 0.4, 0.0, torch.rand(b, k)),  # discount
    ], dim=-1)
    return scores, feats


def _reference(formula, scores, feats) -> torch.Tensor:
    out = torch.zeros(scores.shape[:2], dtype=torch.float64)
    for b in range(scores.shape[0]):
        for k in range(scores.shape[1]):
            tv = {n: float(scores[b, k, i]) for i, n in enumerate(TASKS)}
            fv = {n: float(feats[b, k, i]) for i, n in enumerate(FEATURES)}
            out[b, k] = evaluate_formula(formula, tv, fv)
    return out


def _operators(term) -> set:
    if isinstance(term, str) and ":" in term and not term.lstrip().startswith("{"):
        return {term.split(":")[0]}
    if isinstance(term, str):
        import json

        return _operators(json.loads(term))
    if isinstance(term, dict):
        ((op, arg),) = term.items()
        return {op} | (set().union(*map(_operators, arg)) if isinstance(arg, list) else
                       _operators(arg) if op not in ("weights", "task", "feature") else set())
    return set()


def test_formulas_cover_every_operator():
    assert set().union(*map(_operators, FORMULAS)) == set(OPERATORS)


@pytest.mark.parametrize("index", range(len(FORMULAS)))
def test_model_matches_reference(index):
    formula = FORMULAS[index]
    vm = compile_value_model(formula, TASKS, FEATURES)
    scores, feats = _random_inputs(5, 9)
    got = vm(scores, feats)
    assert got.shape == (5, 9) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(formula, scores, feats), rtol=1e-5, atol=1e-5)


def test_hand_computed_values():
    """Semantics pinned by hand, for the model and the reference alike."""
    tv = {"interacted": -2.0, "rated_ge_4": 0.5, "watch": 3.0}
    fv = {"is_new": 1.0, "age": 0.0, "price": 4.0, "discount": 0.0}
    cases = [
        ({"div": ["feature:price", "feature:discount"]}, 0.0),
        ({"div": ["feature:price", 8]}, 0.5),
        ({"pow": ["task:interacted", 0.5]}, 0.0),
        ({"pow": ["task:interacted", 2]}, 4.0),
        ({"pow": ["feature:age", -2]}, 0.0),
        ({"clamp": ["task:watch", 0, 1]}, 1.0),
        ({"clamp": ["task:interacted", -1, 1]}, -1.0),
        ({"clamp": ["task:watch", 5, 1]}, 1.0),  # min(max(x, lo), hi): hi wins when lo > hi
        ({"if": ["feature:age", 1, 2]}, 2.0),
        ({"if": ["task:interacted", 1, 2]}, 1.0),
        ({"and": ["task:interacted", "feature:is_new"]}, 1.0),
        ({"and": ["task:interacted", "feature:age"]}, 0.0),
        ({"or": ["feature:age", "feature:discount"]}, 0.0),
        ({"not": "feature:age"}, 1.0),
        ({"eq": ["task:watch", 3]}, 1.0),
        ({"ge": ["task:watch", 3]}, 1.0),
        ({"gt": ["task:watch", 3]}, 0.0),
        ({"weights": {"interacted": 0.5, "watch": 2}}, 5.0),
        ({"sigmoid": 0}, 0.5),
        ({"sub": [1, "task:watch"]}, -2.0),
    ]
    scores = torch.tensor([[[tv[n] for n in TASKS]]])
    feats = torch.tensor([[[fv[n] for n in FEATURES]]])
    for formula, want in cases:
        assert evaluate_formula(formula, tv, fv) == pytest.approx(want), formula
        got = float(compile_value_model(formula, TASKS, FEATURES)(scores, feats)[0, 0])
        assert got == pytest.approx(want), formula
    assert evaluate_formula({"sigmoid": -1000}, tv, fv) == 0.0  # no overflow in the reference


def _all_in_one():
    return {"add": [f for f in FORMULAS if not isinstance(f, str) or not f.startswith("{")]}


def test_script_and_export_equal_eager():
    vm = compile_value_model(_all_in_one(), TASKS, FEATURES)
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(vm), buf)
    buf.seek(0)
    scripted = torch.jit.load(buf)
    buf = io.BytesIO()
    torch.export.save(export_program(vm, _random_inputs(4, 5),
                                     {"task_scores": {0: Dim.DYNAMIC, 1: Dim.DYNAMIC},
                                      "feats": {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}}), buf)
    buf.seek(0)
    exported = torch.export.load(buf).module()
    for b, k in [(1, 1), (1, 7), (3, 1), (3, 7)]:
        scores, feats = _random_inputs(b, k)
        want = vm(scores, feats)
        torch.testing.assert_close(_reference(_all_in_one(), scores, feats), want.double(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(scripted(scores, feats), want, rtol=0, atol=0)
        torch.testing.assert_close(exported(scores, feats), want, rtol=1e-6, atol=1e-6)


def test_json_round_trip_and_config():
    for formula in FORMULAS:
        vm = compile_value_model(formula, TASKS, FEATURES)
        again = compile_value_model(formula_to_json(formula), TASKS, FEATURES)
        assert again.program == vm.program and again.formula == vm.formula
        assert compile_value_model(**vm.config()).program == vm.program
    assert compile_value_model("  task:watch ", TASKS).program == compile_value_model({"task": "watch"}, TASKS).program


BAD = [
    ({"add": [1, "task:clikc"]}, "value model term $.add[1]: unknown task 'clikc' (tasks: interacted, rated_ge_4, watch)"),
    ({"add": [1, {"task": "clikc"}]}, "value model term $.add[1]: unknown task 'clikc'"),
    ({"if": [1, 2]}, "value model term $.if: expects [cond, then, else], got 2 items"),
    ({"clamp": [1, 2, 3, 4]}, "value model term $.clamp: expects [x, lo, hi], got 4 items"),
    ({"sub": [1]}, "value model term $.sub: expects [x, y], got 1 item"),
    ({"gt": 1}, "value model term $.gt: expects [a, b], got 1"),
    ({"mul": [2, {"mull": [1, 2]}]}, "value model term $.mul[1]: unknown operator 'mull' (operators: add, and,"),
    ({"add": [1, "abc"]}, 'value model term $.add[1]: non-numeric constant "abc"'),
    ({"add": [True]}, "value model term $.add[0]: non-numeric constant true"),
    ({"max": [1, None]}, "value model term $.max[1]: non-numeric constant null"),
    ({"feature": "prize"}, "value model term $: unknown feature 'prize' (features: is_new, age, price, discount)"),
    ({"if": [{"gt": ["feature:prize", 0]}, 1, 0]}, "value model term $.if[0].gt[0]: unknown feature 'prize'"),
    ({"task": 3}, "value model term $: task name must be a string, got 3"),
    ('{"add": [1,', "value model formula is not valid JSON: Expecting value at line 1 column 12 (char 11)"),
    ('{"add": [NaN]}', "value model term $.add[0]: constant nan is not finite"),
    ({"pow": ["task:watch", "task:watch"]}, 'value model term $.pow[1]: the exponent must be a number, got "task:watch"'),
    ({"weights": {"interacted": "x"}}, 'value model term $.weights.interacted: non-numeric constant "x"'),
    ({"weights": {"nope": 1}}, "value model term $.weights.nope: unknown task 'nope'"),
    ({"weights": {"a b": 1}}, "value model term $.weights[\"a b\"]: unknown task 'a b'"),
    ({"weights": {}}, "value model term $.weights: expects a non-empty object {task: weight}, got {}"),
    ({"sigmoid": [1]}, "value model term $.sigmoid: a list is not a term"),
    ({"add": []}, "value model term $.add: expects a non-empty list of terms, got []"),
    ({"and": "task:watch"}, 'value model term $.and: expects a non-empty list of terms, got "task:watch"'),
    ({"add": [1], "mul": [2]}, "value model term $: a term is an object with exactly one operator, got 2 keys (add, mul)"),
    ({}, "value model term $: a term is an object with exactly one operator, got 0 keys (none)"),
    ([1, 2], "value model term $: a list is not a term"),
]


@pytest.mark.parametrize("formula, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_formulas_name_the_term(formula, message):
    with pytest.raises(ValueModelError, match="^" + re.escape(message)):
        compile_value_model(formula, TASKS, FEATURES)


def test_errors_are_silverrec_errors():
    assert issubclass(ValueModelError, SilverrecError)
    with pytest.raises(ValueModelError, match="duplicate task names: watch"):
        compile_value_model(1, ["watch", "watch"], [])
    with pytest.raises(ValueModelError, match="features: none"):
        compile_value_model("feature:price", TASKS, [])
    # hand-built programs are checked too (stack discipline, argument ranges)
    with pytest.raises(ValueModelError, match="instruction 1: stack underflow"):
        ValueModel([(VALUE_OP_CONST, 0, 1.0), (VALUE_OP_ADD, 0, 0.0)], TASKS, FEATURES, "1")
    with pytest.raises(ValueModelError, match="leaves 2 values"):
        ValueModel([(VALUE_OP_CONST, 0, 1.0), (VALUE_OP_TASK, 0, 0.0)], TASKS, FEATURES, "1")
    with pytest.raises(ValueModelError, match="argument 4 out of range"):
        ValueModel([(VALUE_OP_FEATURE, 4, 0.0)], TASKS, FEATURES, "1")


def test_padding_scores_do_not_break_other_candidates():
    vm = compile_value_model({"weights": {"interacted": 1, "watch": 0.5}}, TASKS, FEATURES)
    scores, feats = _random_inputs(2, 4)
    scores[0, 1] = -math.inf  # a padded candidate, as the cache's re-score reports it
    out = vm(scores, feats)
    assert out[0, 1] == -math.inf and bool(torch.isfinite(out[1]).all()) and bool(torch.isfinite(out[0, [0, 2, 3]]).all())


@pytest.mark.parametrize("formula, linear", [
    ({"weights": {"interacted": 1, "watch": 0.5}}, True),
    ({"add": [{"sub": [{"mul": [2, "task:watch"]}, {"div": ["feature:price", 4]}]}, 3]}, True),
    ({"div": ["task:watch", 0]}, True),  # safe division by a constant 0: 0
    ({"add": [1.5]}, True),
    ({"mul": ["task:watch", "feature:price"]}, False),
    ({"sigmoid": "task:watch"}, False),
])
def test_linear_formulas_fold_into_weights(formula, linear):
    """A linear formula runs as weights (one product per input), with the interpreted program's
    values and the reference's; padding (-inf on every task) stays non-finite only where a weight
    touches it."""
    vm = compile_value_model(formula, TASKS, FEATURES)
    assert vm.linear == linear
    scores, feats = _random_inputs(4, 7)
    got = vm(scores, feats)
    torch.testing.assert_close(got.double(), _reference(formula, scores, feats), rtol=1e-5, atol=1e-5)
    vm.linear = False  # the same module through its program
    torch.testing.assert_close(got, vm(scores, feats), rtol=1e-6, atol=1e-5)
    if linear:
        vm.linear = True
        scores[0, 2] = -math.inf
        out = vm(scores, feats)
        assert bool(torch.isfinite(out[1]).all()) and not bool(torch.isnan(out[0, 2]))


def test_folded_value_model_exports_for_any_batch():
    """The folded form under torch.export with dynamic batch and candidate dims (batch 1 included:
    no shape guard), equal to eager."""
    from torch.export import Dim

    vm = compile_value_model({"weights": {"interacted": 1, "watch": 0.5}}, TASKS, FEATURES)
    assert vm.linear
    scores, feats = _random_inputs(3, 5)
    prog = torch.export.export(vm, (scores, feats), dynamic_shapes=({0: Dim("b", max=64), 1: Dim("k", max=512)},
                                                                    {0: Dim("b", max=64), 1: Dim("k", max=512)}))
    for b in (1, 3):
        s, f = _random_inputs(b, 7)
        torch.testing.assert_close(prog.module()(s, f), vm(s, f))
