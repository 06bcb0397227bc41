"""The filter language: attribute filters on categorical item features, parsed into an AST.

Grammar (keywords case-insensitive, values bare or quoted with '...' or "..."):

    filter   := or_expr
    or_expr  := and_expr ( OR and_expr )*
    and_expr := not_expr ( AND not_expr )*
    not_expr := NOT not_expr | primary
    primary  := '(' or_expr ')'
              | NAME '=' VALUE            # item has value VALUE for feature NAME
              | NAME '!=' VALUE           # sugar for NOT NAME = VALUE
              | NAME IN '(' VALUE ( ',' VALUE )* ')'
              | NAME NOT IN '(' ... ')'   # sugar for NOT NAME IN (...)

A multi-valued feature matches `NAME = VALUE` when any of the item's values equals VALUE.
Example:

    >>> parse("country = US AND (lang IN (EN, 'es')) AND NOT genre = \"Film-Noir\"")
    And(children=(Term('country', ('US',)), Term('lang', ('EN', 'es')), Not(Term('genre', ...))))

`FilterSyntaxError` names the 0-based character position of the problem and quotes the string
with a caret under it. Feature names are checked later, against a snapshot's vocabulary
(`silverrec.filtering.filter_program`).

The parser is C++ (kernels/csrc/filter_compiler.h, which silverrec-predictor runs too):
`parse` calls it (`silverrec_host.parse_filter`) and builds this module's AST from its flattened
nodes. This module holds the AST's types and the printer (`to_string`) that Python code uses to
build filters (publish/calibrate.py) and to hand ASTs back to the compiler (`flatten`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Union

from silverrec.errors import QueryError
from silverrec.kernels.constants import FILTER_MAX_LENGTH as MAX_LENGTH  # noqa: F401  (the parser's limit)
from silverrec.kernels.constants import FILTER_NODE_AND, FILTER_NODE_NOT, FILTER_NODE_OR, FILTER_NODE_TERM

KEYWORDS = ("AND", "OR", "NOT", "IN")


class FilterSyntaxError(QueryError):
    """A filter string that does not parse; `position` is the 0-based character offset. The message
    (the parser's, C++) names the position and quotes the string with a caret under it."""

    def __init__(self, message: str, text: str, position: int):
        self.position = position
        self.text = text
        super().__init__(message)


_SYNTAX = re.compile(r"filter syntax error at position (\d+):")


def query_error(message: str, text: object = None) -> QueryError:
    """The C++ filter code's error message (a bad filter) as the QueryError it stands for: a
    FilterSyntaxError when the filter does not parse (`text`: the filter, when one is known)."""
    m = _SYNTAX.match(message)
    if m:
        return FilterSyntaxError(message, text if isinstance(text, str) else None, int(m.group(1)))
    return QueryError(message)


# ----------------------------------------------------------------------------------------- AST


@dataclass(frozen=True)
class Term:
    """`feature = value` (one value) or `feature IN (values...)` (any of them)."""

    feature: str
    values: tuple[str, ...]
    position: int = field(default=0, compare=False)  # where the feature name starts in the filter

    def __repr__(self) -> str:
        return f"Term({self.feature!r}, {self.values!r})"


@dataclass(frozen=True)
class Not:
    child: "Node"


@dataclass(frozen=True)
class And:
    children: tuple["Node", ...]


@dataclass(frozen=True)
class Or:
    children: tuple["Node", ...]


Node = Union[Term, Not, And, Or]


def terms(node: Node) -> list[Term]:
    """All Term leaves of `node`, left to right."""
    if isinstance(node, Term):
        return [node]
    if isinstance(node, Not):
        return terms(node.child)
    return [t for c in node.children for t in terms(c)]


def to_string(node: Node) -> str:
    """A canonical filter string that parses back to `node`."""
    if isinstance(node, Term):
        if len(node.values) == 1:
            return f"{node.feature} = {_quote(node.values[0])}"
        return f"{node.feature} IN ({', '.join(_quote(v) for v in node.values)})"
    if isinstance(node, Not):
        return f"NOT {_wrap(node.child)}"
    op = " AND " if isinstance(node, And) else " OR "
    return op.join(_wrap(c) for c in node.children)


def _wrap(node: Node) -> str:
    return to_string(node) if isinstance(node, (Term, Not)) else f"({to_string(node)})"


def _quote(value: str) -> str:
    if _BARE.fullmatch(value) and value.upper() not in KEYWORDS:
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


_BARE = re.compile(r"[A-Za-z0-9_.:/+\-]+")  # what the parser reads unquoted (the printer quotes the rest)


# ------------------------------------------------------------------------------------- parser


def parse(text: str) -> Node:
    """Parse a filter string into an AST. Raises FilterSyntaxError with the position."""
    if not isinstance(text, str):
        raise QueryError(f"filter must be a string, got {type(text).__name__}")
    from silverrec.kernels import library

    nodes, strings, error = library.host().parse_filter(text)
    if error:
        raise query_error(error, text)
    return unflatten(nodes, strings)


def unflatten(nodes: list[int], strings: list[str]) -> Node:
    """The AST of the parser's flattened form: int triples [kind, n, position] in prefix order
    (kinds: FILTER_NODE_*; n: a term's values, a node's children) and each term's feature, then values."""
    at = [0, 0]

    def node() -> Node:
        kind, n, position = nodes[at[0]:at[0] + 3]
        at[0] += 3
        if kind == FILTER_NODE_TERM:
            s = at[1]
            at[1] += 1 + n
            return Term(strings[s], tuple(strings[s + 1:s + 1 + n]), position)
        children = tuple(node() for _ in range(n))
        return Not(children[0]) if kind == FILTER_NODE_NOT else And(children) if kind == FILTER_NODE_AND else Or(children)

    return node()


def flatten(node: Node) -> tuple[list[int], list[str]]:
    """`unflatten`'s inverse: an AST as the C++ compiler reads it (filter_program.py)."""
    nodes: list[int] = []
    strings: list[str] = []

    def visit(x: Node) -> None:
        if isinstance(x, Term):
            nodes.extend((FILTER_NODE_TERM, len(x.values), x.position))
            strings.append(x.feature)
            strings.extend(x.values)
        elif isinstance(x, Not):
            nodes.extend((FILTER_NODE_NOT, 1, 0))
            visit(x.child)
        else:
            nodes.extend((FILTER_NODE_AND if isinstance(x, And) else FILTER_NODE_OR, len(x.children), 0))
            for c in x.children:
                visit(c)

    visit(node)
    return nodes, strings
