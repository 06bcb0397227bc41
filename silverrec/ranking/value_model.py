"""The value model: a JSON formula over task scores and item features, compiled into tensor ops.

The ranking stage's last step turns each candidate's T task scores (from the OverArch) and its
dense item features (from the cache) into one value, by which candidates are ordered. Product
owners write that as a formula; `compile_value_model` checks it against the snapshot's task and
feature names at publish and compiles it into a fixed postfix program that `ValueModel.forward`
runs on a tensor stack (one [B, K] tensor per stack slot, every op elementwise over candidates).

Grammar (JSON; a formula is one term):

    NUMBER                               a constant (int or float, finite; true/false/null refused)
    {"task": "NAME"}     "task:NAME"     the task's score
    {"feature": "NAME"}  "feature:NAME"  the dense item feature
    {"sigmoid": X}                       1 / (1 + exp(-X))
    {"add": [X, ...]}  {"mul": [X, ...]}  {"min": [X, ...]}  {"max": [X, ...]}   (1 or more terms)
    {"sub": [X, Y]}                      X - Y
    {"div": [X, Y]}                      X / Y, and 0 where Y == 0 (safe division)
    {"clamp": [X, LO, HI]}               min(max(X, LO), HI): LO, HI are terms too; HI wins if LO > HI
    {"pow": [X, NUMBER]}                 X ** NUMBER, and 0 where that is undefined or infinite
                                         (negative X with a fractional power, 0 ** negative)
    {"gt"|"ge"|"lt"|"le"|"eq": [X, Y]}   1.0 where X > Y (>=, <, <=, ==) else 0.0
    {"and": [X, ...]}  {"or": [X, ...]}  1.0 / 0.0; a term is true where it is non-zero
    {"not": X}                           1.0 where X == 0 else 0.0
    {"if": [COND, THEN, ELSE]}           THEN where COND is non-zero, else ELSE
    {"weights": {"TASK": NUMBER, ...}}   sum of NUMBER * the task's score (1 or more tasks)

A formula may also be given as JSON text (a string), or as a bare number. Every error is a
`ValueModelError` naming the bad term by its JSON path from the root `$`, e.g.
`value model term $.add[1]: unknown task 'clikc' (tasks: interacted, rated_ge_4)`.

A formula that is linear in the task scores and features (weights, add, sub, constants, mul / div
by constants) is folded at compile time into weights: the forward is then one weighted sum per
input instead of one tensor op per instruction (`linear_form`; the same values up to
float32 rounding order).

Arithmetic is float32. Task scores of padded candidates are -inf; the value computed for them is
meaningless (it can be NaN) and the caller masks padded candidates after the value model.

`evaluate_formula` is the plain-Python reference (float64, recursive over the JSON, no tensors).

Example:
    >>> vm = compile_value_model({"mul": [{"sigmoid": "task:click"}, {"add": [1, "feature:boost"]}]},
    ...                          tasks=["click", "like"], features=["boost"])
    >>> vm(torch.randn(2, 5, 2), torch.rand(2, 5, 1)).shape                     # [B, K]
    torch.Size([2, 5])
"""


import json
import math
import re
from typing import Any, Dict, List, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from silverrec.errors import SilverrecError
from silverrec.kernels import constants as K  # K.VALUE_OP_*: TorchScript reads module attributes, not plain globals

Formula = Union[dict, str, float, int]


class ValueModelError(SilverrecError):
    """A value model formula is invalid (bad JSON, unknown operator / task / feature, arity...)."""


# The postfix program: (opcode, argument index, constant), opcodes VALUE_OP_* of kernels/constants.py.
_NARY = {"add": K.VALUE_OP_ADD, "mul": K.VALUE_OP_MUL, "min": K.VALUE_OP_MIN, "max": K.VALUE_OP_MAX, "and": K.VALUE_OP_AND,
         "or": K.VALUE_OP_OR}
_BINARY = {"sub": K.VALUE_OP_SUB, "div": K.VALUE_OP_DIV, "gt": K.VALUE_OP_GT, "ge": K.VALUE_OP_GE, "lt": K.VALUE_OP_LT,
           "le": K.VALUE_OP_LE, "eq": K.VALUE_OP_EQ}
_UNARY = {"sigmoid": K.VALUE_OP_SIGMOID, "not": K.VALUE_OP_NOT}
OPERATORS = sorted([*_NARY, *_BINARY, *_UNARY, "task", "feature", "clamp", "pow", "if", "weights"])
# stack effect of each opcode (pushes - pops)
_STACK_EFFECT = {K.VALUE_OP_CONST: 1, K.VALUE_OP_TASK: 1, K.VALUE_OP_FEATURE: 1, K.VALUE_OP_SIGMOID: 0, K.VALUE_OP_NOT: 0,
                 K.VALUE_OP_BOOL: 0, K.VALUE_OP_POW: 0, K.VALUE_OP_CLAMP: -2, K.VALUE_OP_IF: -2,
                 **{op: -1 for op in range(K.VALUE_OP_ADD, K.VALUE_OP_OR + 1)}}

Program = List[Tuple[int, int, float]]


# ------------------------------------------------------------------------------------ the module
class ValueModel(nn.Module):
    """Runs a compiled value model formula (see the module docstring for the grammar).

    Args:
        program: postfix instructions (opcode, argument index, constant) from `compile_value_model`.
        tasks: the T task names, in the order of task_scores' last dimension.
        features: the F feature names, in the order of feats' last dimension.
        formula: the formula as compact JSON text (recorded in the manifest).
    """

    program: List[Tuple[int, int, float]]
    tasks: List[str]
    features: List[str]
    formula: str
    __constants__ = ["linear", "linear_tasks", "linear_features", "bias"]

    def __init__(self, program: Program, tasks: Sequence[str], features: Sequence[str], formula: str) -> None:
        super().__init__()
        depth = 0
        for i, (op, arg, _) in enumerate(program):
            if op not in _STACK_EFFECT:
                raise ValueModelError(f"value model program instruction {i}: unknown opcode {op}")
            if (op == K.VALUE_OP_TASK and not 0 <= arg < len(tasks)) or (op == K.VALUE_OP_FEATURE and not 0 <= arg < len(features)):
                raise ValueModelError(f"value model program instruction {i}: argument {arg} out of range")
            depth += _STACK_EFFECT[op]
            if depth < 1:
                raise ValueModelError(f"value model program instruction {i}: stack underflow")
        if depth != 1:
            raise ValueModelError(f"value model program leaves {depth} values on the stack, not 1")
        self.program = [(int(op), int(arg), float(c)) for op, arg, c in program]
        self.tasks = list(tasks)
        self.features = list(features)
        self.formula = formula
        folded = linear_form(self.program, len(self.tasks), len(self.features))
        self.linear = folded is not None
        coef, self.bias = folded if folded is not None else ([0.0] * (len(tasks) + len(features)), 0.0)
        # the terms with a non-zero weight only: a padded candidate's -inf times a zero weight would be NaN
        t_used = [i for i in range(len(tasks)) if coef[i] != 0.0]
        f_used = [j for j in range(len(features)) if coef[len(tasks) + j] != 0.0]
        self.linear_tasks = len(t_used) > 0
        self.linear_features = len(f_used) > 0
        self.register_buffer("task_columns", torch.tensor(t_used, dtype=torch.int64), persistent=False)
        self.register_buffer("task_weights", torch.tensor([coef[i] for i in t_used], dtype=torch.float32), persistent=False)
        self.register_buffer("feature_columns", torch.tensor(f_used, dtype=torch.int64), persistent=False)
        self.register_buffer("feature_weights", torch.tensor([coef[len(tasks) + j] for j in f_used], dtype=torch.float32),
                             persistent=False)

    def config(self) -> Dict[str, Any]:
        """JSON-able description: `compile_value_model(**vm.config())` rebuilds the same module."""
        return {"formula": json.loads(self.formula), "tasks": list(self.tasks), "features": list(self.features)}

    def forward(self, task_scores: Tensor, feats: Tensor) -> Tensor:
        """task_scores float32 [B, K, T], feats float32 [B, K, F] -> values float32 [B, K].

        Opcodes appear as literals (TorchScript cannot read module globals); comments name them.
        """
        task_scores = task_scores.float()
        feats = feats.float()
        if self.linear:  # folded at compile time (linear_form)
            out = task_scores.new_full([task_scores.shape[0], task_scores.shape[1]], self.bias)
            # weighted sums as multiply + sum (a matmul with the [B, K, T] input guarded export on B != 1)
            if self.linear_tasks:
                used = task_scores if self.task_columns.shape[0] == task_scores.shape[2] else \
                    task_scores.index_select(2, self.task_columns)
                out = out + (used * self.task_weights).sum(2)
            if self.linear_features:
                out = out + (feats.index_select(2, self.feature_columns) * self.feature_weights).sum(2)
            return out
        zero = task_scores.new_zeros([task_scores.shape[0], task_scores.shape[1]])  # [B, K]
        stack: List[Tensor] = []
        for ins in self.program:
            op, arg, c = ins
            if op == K.VALUE_OP_CONST:
                stack.append(zero + c)
            elif op == K.VALUE_OP_TASK:
                stack.append(task_scores[:, :, arg])
            elif op == K.VALUE_OP_FEATURE:
                stack.append(feats[:, :, arg])
            elif op <= K.VALUE_OP_POW:  # unary: K.VALUE_OP_SIGMOID .. K.VALUE_OP_POW
                x = stack.pop()
                if op == K.VALUE_OP_SIGMOID:
                    stack.append(torch.sigmoid(x))
                elif op == K.VALUE_OP_NOT:
                    stack.append((x == 0).float())
                elif op == K.VALUE_OP_BOOL:
                    stack.append((x != 0).float())
                else:  # K.VALUE_OP_POW
                    r = torch.pow(x, c)
                    stack.append(torch.where(torch.isfinite(r), r, zero))
            elif op <= K.VALUE_OP_OR:  # binary: K.VALUE_OP_ADD .. K.VALUE_OP_OR
                b = stack.pop()
                a = stack.pop()
                if op == K.VALUE_OP_ADD:
                    stack.append(a + b)
                elif op == K.VALUE_OP_MUL:
                    stack.append(a * b)
                elif op == K.VALUE_OP_SUB:
                    stack.append(a - b)
                elif op == K.VALUE_OP_DIV:
                    nz = b != 0
                    stack.append(torch.where(nz, a / torch.where(nz, b, zero + 1.0), zero))
                elif op == K.VALUE_OP_MIN:
                    stack.append(torch.minimum(a, b))
                elif op == K.VALUE_OP_MAX:
                    stack.append(torch.maximum(a, b))
                elif op == K.VALUE_OP_GT:
                    stack.append((a > b).float())
                elif op == K.VALUE_OP_GE:
                    stack.append((a >= b).float())
                elif op == K.VALUE_OP_LT:
                    stack.append((a < b).float())
                elif op == K.VALUE_OP_LE:
                    stack.append((a <= b).float())
                elif op == K.VALUE_OP_EQ:
                    stack.append((a == b).float())
                elif op == K.VALUE_OP_AND:
                    stack.append(((a != 0) & (b != 0)).float())
                else:  # K.VALUE_OP_OR
                    stack.append(((a != 0) | (b != 0)).float())
            elif op == K.VALUE_OP_CLAMP:
                hi = stack.pop()
                lo = stack.pop()
                x = stack.pop()
                stack.append(torch.minimum(torch.maximum(x, lo), hi))
            else:  # K.VALUE_OP_IF
                e = stack.pop()
                t = stack.pop()
                cond = stack.pop()
                stack.append(torch.where(cond != 0, t, e))
        return stack[0]


def linear_form(program: Program, tasks: int, features: int) -> Union[Tuple[List[float], float], None]:
    """The program as weights (T task weights then F feature weights) and a constant, when it is
    linear in its inputs (constants, tasks, features, add, sub, mul or div where one side is a
    constant); None otherwise. Evaluated symbolically on the same stack as the forward."""
    width = tasks + features
    stack: List[Tuple[List[float], float]] = []  # (coefficients, constant) per stack slot

    def constant(x: Tuple[List[float], float]) -> bool:
        return not any(x[0])

    for op, arg, c in program:
        if op == K.VALUE_OP_CONST:
            stack.append(([0.0] * width, c))
        elif op in (K.VALUE_OP_TASK, K.VALUE_OP_FEATURE):
            coef = [0.0] * width
            coef[arg if op == K.VALUE_OP_TASK else tasks + arg] = 1.0
            stack.append((coef, 0.0))
        elif op in (K.VALUE_OP_ADD, K.VALUE_OP_SUB, K.VALUE_OP_MUL, K.VALUE_OP_DIV):
            b, a = stack.pop(), stack.pop()
            if op in (K.VALUE_OP_ADD, K.VALUE_OP_SUB):
                sign = 1.0 if op == K.VALUE_OP_ADD else -1.0
                stack.append(([x + sign * y for x, y in zip(a[0], b[0])], a[1] + sign * b[1]))
            elif op == K.VALUE_OP_MUL and (constant(a) or constant(b)):
                k, v = (a[1], b) if constant(a) else (b[1], a)
                stack.append(([x * k for x in v[0]], v[1] * k))
            elif op == K.VALUE_OP_DIV and constant(b):  # x / 0 is 0 (safe division)
                k = 0.0 if b[1] == 0.0 else 1.0 / b[1]
                stack.append(([x * k for x in a[0]], a[1] * k))
            else:
                return None
        else:
            return None
    return stack[0]


# ------------------------------------------------------------------------------------ the compile
def parse_formula(formula: Formula) -> Any:
    """A formula as a JSON value: dicts/numbers pass through; a string is JSON text or a shorthand."""
    if isinstance(formula, str):
        text = formula.strip()
        if text.startswith(("task:", "feature:")):
            return text
        try:
            return json.loads(formula)
        except json.JSONDecodeError as e:
            raise ValueModelError(
                f"value model formula is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})"
            ) from None
    return formula


def formula_to_json(formula: Formula) -> str:
    """Compact JSON text of a formula (what the manifest stores); `parse_formula` reads it back."""
    return json.dumps(parse_formula(formula), separators=(",", ":"), allow_nan=False)


def compile_value_model(formula: Formula, tasks: Sequence[str], features: Sequence[str] = ()) -> ValueModel:
    """Check `formula` against the task and feature names and compile it into a ValueModel.

    Args:
        formula: a JSON value (dict / number / shorthand string) or JSON text; grammar above.
        tasks: task names, in the order of the OverArch's score columns.
        features: dense item feature names, in the order of the cache's feature columns.
    Raises:
        ValueModelError naming the bad term by its JSON path.
    """
    tasks, features = list(tasks), list(features)
    for what, names in (("task", tasks), ("feature", features)):
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueModelError(f"duplicate {what} names: {', '.join(map(str, dupes))}")
    term = parse_formula(formula)
    program: Program = []
    _Compiler(tasks, features, program).emit(term, "$")
    try:
        text = json.dumps(term, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:  # unreachable for a formula that compiled; kept explicit
        raise ValueModelError(f"value model formula cannot be written as JSON: {e}") from None
    return ValueModel(program, tasks, features, text)


class _Compiler:
    def __init__(self, tasks: List[str], features: List[str], out: Program) -> None:
        self.tasks = {n: i for i, n in enumerate(tasks)}
        self.features = {n: i for i, n in enumerate(features)}
        self.out = out

    def emit(self, term: Any, path: str) -> None:
        if isinstance(term, bool) or term is None:
            raise _error(path, f"non-numeric constant {_show(term)}")
        if isinstance(term, (int, float)):
            self.out.append((K.VALUE_OP_CONST, 0, _constant(term, path)))
        elif isinstance(term, str):
            if term.startswith("task:"):
                self._name("task", term[len("task:"):], path)
            elif term.startswith("feature:"):
                self._name("feature", term[len("feature:"):], path)
            else:
                raise _error(path, f"non-numeric constant {_show(term)} (a string term is 'task:NAME' or 'feature:NAME')")
        elif isinstance(term, list):
            raise _error(path, f"a list is not a term, got {_show(term)} "
                               '(operands go inside an operator, e.g. {"add": [...]})')
        elif isinstance(term, dict):
            if len(term) != 1:
                keys = ", ".join(map(str, term)) or "none"
                raise _error(path, f"a term is an object with exactly one operator, got {len(term)} keys ({keys})")
            ((op, arg),) = term.items()
            if op not in OPERATORS:
                raise _error(path, f"unknown operator {op!r} (operators: {', '.join(OPERATORS)})")
            if op in ("task", "feature"):  # a leaf: errors name the term itself
                self._name(op, arg, path)
            else:
                self._operator(op, arg, _child(path, op))
        else:
            raise _error(path, f"non-numeric constant of type {type(term).__name__}")

    def _name(self, kind: str, name: Any, path: str) -> None:
        table = self.tasks if kind == "task" else self.features
        if not isinstance(name, str):
            raise _error(path, f"{kind} name must be a string, got {_show(name)}")
        if name not in table:
            known = ", ".join(table) or "none"
            raise _error(path, f"unknown {kind} {name!r} ({kind}s: {known})")
        self.out.append((K.VALUE_OP_TASK if kind == "task" else K.VALUE_OP_FEATURE, table[name], 0.0))

    def _operator(self, op: str, arg: Any, path: str) -> None:
        if op in _UNARY:
            self.emit(arg, path)
            self.out.append((_UNARY[op], 0, 0.0))
        elif op in _NARY:
            items = _items(arg, path, op, None)
            self.emit(items[0], f"{path}[0]")
            if len(items) == 1 and op in ("and", "or"):
                self.out.append((K.VALUE_OP_BOOL, 0, 0.0))
            for i in range(1, len(items)):
                self.emit(items[i], f"{path}[{i}]")
                self.out.append((_NARY[op], 0, 0.0))
        elif op in _BINARY or op in ("clamp", "if"):
            n = 3 if op in ("clamp", "if") else 2
            items = _items(arg, path, op, n)
            for i, item in enumerate(items):
                self.emit(item, f"{path}[{i}]")
            self.out.append((_BINARY.get(op, K.VALUE_OP_CLAMP if op == "clamp" else K.VALUE_OP_IF), 0, 0.0))
        elif op == "pow":
            x, p = _items(arg, path, op, 2)
            if isinstance(p, bool) or not isinstance(p, (int, float)):
                raise _error(f"{path}[1]", f"the exponent must be a number, got {_show(p)}")
            exponent = _constant(p, f"{path}[1]")
            self.emit(x, f"{path}[0]")
            self.out.append((K.VALUE_OP_POW, 0, exponent))
        elif op == "weights":
            if not isinstance(arg, dict) or not arg:
                raise _error(path, f"expects a non-empty object {{task: weight}}, got {_show(arg)}")
            for i, (name, w) in enumerate(arg.items()):
                wpath = _child(path, name)
                if isinstance(w, bool) or not isinstance(w, (int, float)):
                    raise _error(wpath, f"non-numeric constant {_show(w)}")
                self._name("task", name, wpath)
                self.out.append((K.VALUE_OP_CONST, 0, _constant(w, wpath)))
                self.out.append((K.VALUE_OP_MUL, 0, 0.0))
                if i:
                    self.out.append((K.VALUE_OP_ADD, 0, 0.0))


_SIGNATURES = {"sub": "[x, y]", "div": "[x, y]", "pow": "[x, exponent]", "clamp": "[x, lo, hi]",
               "if": "[cond, then, else]", **{op: "[a, b]" for op in ("gt", "ge", "lt", "le", "eq")}}


def _items(arg: Any, path: str, op: str, n: int | None) -> list:
    if n is None:
        if not isinstance(arg, list) or not arg:
            raise _error(path, f"expects a non-empty list of terms, got {_show(arg)}")
        return arg
    if not isinstance(arg, list):
        raise _error(path, f"expects {_SIGNATURES[op]}, got {_show(arg)}")
    if len(arg) != n:
        raise _error(path, f"expects {_SIGNATURES[op]}, got {len(arg)} item{'s' * (len(arg) != 1)}")
    return arg


def _constant(x: float, path: str) -> float:
    v = float(x)
    if not math.isfinite(v):
        raise _error(path, f"constant {x} is not finite")
    return v


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _child(path: str, key: Any) -> str:
    key = str(key)
    return f"{path}.{key}" if _IDENT.match(key) else f"{path}[{json.dumps(key)}]"


def _show(x: Any, limit: int = 60) -> str:
    try:
        s = json.dumps(x)
    except (TypeError, ValueError):
        s = repr(x)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _error(path: str, message: str) -> ValueModelError:
    return ValueModelError(f"value model term {path}: {message}")


# ------------------------------------------------------------------------------------ the reference
def evaluate_formula(formula: Formula, task_values: Dict[str, float], feature_values: Dict[str, float]) -> float:
    """Plain-Python reference evaluator (float64, recursive over the JSON; no tensors, no program).

    Same semantics as `ValueModel` (safe division, pow 0 where undefined/infinite, comparisons and
    logic to 1.0 / 0.0). Assumes the formula is valid: run `compile_value_model` for the checks.
    """

    def ev(t: Any) -> float:
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            return float(t)
        if isinstance(t, str):
            kind, _, name = t.partition(":")
            return float(task_values[name] if kind == "task" else feature_values[name])
        if not isinstance(t, dict) or len(t) != 1:
            raise ValueModelError(f"cannot evaluate term {_show(t)}")
        ((op, a),) = t.items()
        if op == "task":
            return float(task_values[a])
        if op == "feature":
            return float(feature_values[a])
        if op == "weights":
            return sum(float(w) * float(task_values[n]) for n, w in a.items())
        if op == "sigmoid":
            x = ev(a)
            return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
        if op == "not":
            return 1.0 if ev(a) == 0 else 0.0
        if op == "pow":
            x, p = ev(a[0]), float(a[1])
            try:
                r = math.pow(x, p)
            except (ValueError, OverflowError, ZeroDivisionError):
                return 0.0
            return r if math.isfinite(r) else 0.0
        if op == "if":
            return ev(a[1]) if ev(a[0]) != 0 else ev(a[2])
        vals = [ev(x) for x in a]
        if op == "add":
            return sum(vals)
        if op == "mul":
            return math.prod(vals)
        if op == "min":
            return min(vals)
        if op == "max":
            return max(vals)
        if op == "and":
            return 1.0 if all(v != 0 for v in vals) else 0.0
        if op == "or":
            return 1.0 if any(v != 0 for v in vals) else 0.0
        if op == "clamp":
            return min(max(vals[0], vals[1]), vals[2])
        x, y = vals
        if op == "sub":
            return x - y
        if op == "div":
            return 0.0 if y == 0 else x / y
        return float({"gt": x > y, "ge": x >= y, "lt": x < y, "le": x <= y, "eq": x == y}[op])

    return ev(parse_formula(formula))
