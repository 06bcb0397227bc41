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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Union

from silverrec.errors import QueryError

KEYWORDS = ("AND", "OR", "NOT", "IN")
MAX_LENGTH = 1 << 16


class FilterSyntaxError(QueryError):
    """A filter string that does not parse; `position` is the 0-based character offset."""

    def __init__(self, message: str, text: str, position: int):
        self.position = position
        self.text = text
        snippet, caret = _excerpt(text, position)
        super().__init__(f"filter syntax error at position {position}: {message}\n  {snippet}\n  {caret}")


def _excerpt(text: str, pos: int, width: int = 60) -> tuple[str, str]:
    lo = max(0, pos - width // 2)
    hi = min(len(text), lo + width)
    prefix = "..." if lo > 0 else ""
    snippet = prefix + text[lo:hi] + ("..." if hi < len(text) else "")
    return snippet, " " * (len(prefix) + pos - lo) + "^"


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


# ------------------------------------------------------------------------------------- tokens

_BARE = re.compile(r"[A-Za-z0-9_.:/+\-]+")
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class _Tok:
    kind: str  # NAME, STRING, KEYWORD, '(', ')', ',', '=', '!=', END
    text: str
    pos: int


def tokenize(text: str) -> list[_Tok]:
    """Split a filter string into tokens with their positions."""
    if len(text) > MAX_LENGTH:
        raise FilterSyntaxError(f"filter is longer than {MAX_LENGTH} characters", text[:80], 0)
    out: list[_Tok] = []
    i = 0
    while i < len(text):
        m = _SPACE.match(text, i)
        if m:
            i = m.end()
            continue
        c = text[i]
        if c in "(),=":
            out.append(_Tok(c, c, i))
            i += 1
        elif text.startswith("!=", i):
            out.append(_Tok("!=", "!=", i))
            i += 2
        elif c in "'\"":
            value, end = _read_quoted(text, i)
            out.append(_Tok("STRING", value, i))
            i = end
        else:
            m = _BARE.match(text, i)
            if not m:
                raise FilterSyntaxError(f"unexpected character {c!r}", text, i)
            word = m.group()
            kind = "KEYWORD" if word.upper() in KEYWORDS else "NAME"
            out.append(_Tok(kind, word.upper() if kind == "KEYWORD" else word, i))
            i = m.end()
    out.append(_Tok("END", "", len(text)))
    return out


def _read_quoted(text: str, start: int) -> tuple[str, int]:
    quote = text[start]
    chars = []
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            chars.append(text[i + 1])
            i += 2
        elif c == quote:
            return "".join(chars), i + 1
        else:
            chars.append(c)
            i += 1
    raise FilterSyntaxError(f"unterminated string starting with {quote}", text, start)


# ------------------------------------------------------------------------------------- parser


def parse(text: str) -> Node:
    """Parse a filter string into an AST. Raises FilterSyntaxError with the position."""
    if not isinstance(text, str):
        raise QueryError(f"filter must be a string, got {type(text).__name__}")
    parser = _Parser(text, tokenize(text))
    if parser.peek().kind == "END":
        raise FilterSyntaxError("empty filter", text, 0)
    node = parser.or_expr()
    tok = parser.peek()
    if tok.kind != "END":
        raise FilterSyntaxError(f"expected AND, OR or the end of the filter, found {_describe(tok)}", text, tok.pos)
    return node


def _describe(tok: _Tok) -> str:
    if tok.kind == "END":
        return "the end of the filter"
    if tok.kind == "STRING":
        return f"string {tok.text!r}"
    return repr(tok.text)


class _Parser:
    def __init__(self, text: str, toks: list[_Tok]):
        self.text, self.toks, self.i = text, toks, 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def expect(self, kind: str, what: str) -> _Tok:
        tok = self.peek()
        if tok.kind != kind:
            raise FilterSyntaxError(f"expected {what}, found {_describe(tok)}", self.text, tok.pos)
        return self.take()

    def keyword(self, word: str) -> bool:
        tok = self.peek()
        if tok.kind == "KEYWORD" and tok.text == word:
            self.i += 1
            return True
        return False

    def or_expr(self) -> Node:
        children = [self.and_expr()]
        while self.keyword("OR"):
            children.append(self.and_expr())
        return children[0] if len(children) == 1 else Or(tuple(children))

    def and_expr(self) -> Node:
        children = [self.not_expr()]
        while self.keyword("AND"):
            children.append(self.not_expr())
        return children[0] if len(children) == 1 else And(tuple(children))

    def not_expr(self) -> Node:
        if self.keyword("NOT"):
            return Not(self.not_expr())
        return self.primary()

    def primary(self) -> Node:
        tok = self.peek()
        if tok.kind == "(":
            self.take()
            node = self.or_expr()
            self.expect(")", "')'")
            return node
        if tok.kind not in ("NAME", "STRING"):
            raise FilterSyntaxError(f"expected a feature name, NOT or '(', found {_describe(tok)}", self.text, tok.pos)
        name = self.take()
        op = self.peek()
        if op.kind == "=":
            self.take()
            return Term(name.text, (self.value(),), name.pos)
        if op.kind == "!=":
            self.take()
            return Not(Term(name.text, (self.value(),), name.pos))
        if self.keyword("IN"):
            return Term(name.text, self.value_list(), name.pos)
        if op.kind == "KEYWORD" and op.text == "NOT":
            self.take()
            if not self.keyword("IN"):
                nxt = self.peek()
                raise FilterSyntaxError(f"expected IN after NOT, found {_describe(nxt)}", self.text, nxt.pos)
            return Not(Term(name.text, self.value_list(), name.pos))
        raise FilterSyntaxError(
            f"expected '=', '!=' or IN after feature {name.text!r}, found {_describe(op)}", self.text, op.pos
        )

    def value(self) -> str:
        tok = self.peek()
        if tok.kind in ("NAME", "STRING"):
            return self.take().text
        if tok.kind == "KEYWORD":
            raise FilterSyntaxError(f"expected a value, found keyword {tok.text} (quote it to use it as a value)", self.text, tok.pos)
        raise FilterSyntaxError(f"expected a value, found {_describe(tok)}", self.text, tok.pos)

    def value_list(self) -> tuple[str, ...]:
        self.expect("(", "'(' after IN")
        values = [self.value()]
        while self.peek().kind == ",":
            self.take()
            values.append(self.value())
        self.expect(")", "',' or ')' in the IN list")
        return tuple(dict.fromkeys(values))  # de-duplicated, order kept
