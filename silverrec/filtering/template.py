"""Filter templates: a filter compiled once at publish, its placeholders filled in the forward.

A publish config may hold a template in the filter language with placeholders:

    genre = $user.favourite_genre AND rating IN $user.allowed_ratings AND NOT item_id IN $history

- `f = $user.g` binds the request's value of the categorical user feature `g` (one value);
  `f IN $user.g` binds all its values (at most `max_values`). `g` is a feature the user tower
  reads (a `user_<g>` key of the request's KJT); the user's values are matched to the item
  feature `f`'s values by string, at publish (the vocabularies are separate): a user value that
  is no value of `f` matches nothing, like a literal value outside the vocabulary.
- `NOT item_id IN $history`, a top-level AND term, makes every request exclude its history
  (the model's `exclude` rows), whatever the request's `exclude_history` says.

`compile_template` checks the template against the snapshot (`TemplateError` for an unbound
placeholder or a type mismatch) and builds `FilterTemplate`, whose forward turns the request's KJT
into filled programs and ANDs them with the request's own filter programs: table lookups and
gathers with static shapes, no strings and no host work per request.

Program layout (filter_program.py: ops int64 [L], rows int64 [L, T] per query, postfix): the
template is lowered to postfix once, literal subtrees by the normal compiler; a placeholder term
becomes one NOP-padded *fragment* per bound value position (ORed), and the fragment of every user
value code is precompiled (code 0: no value, or a value outside the item vocabulary -> FALSE).
The forward reads each instruction from one table (`_tables`: the Bloom and the verify program
together, fixed instructions in entry 0), then appends the request's program and AND. Posting
lists: the cheapest of the template's top-level AND terms that have lists (literal terms, `=`
placeholders per value) and the request's own, as `posting_lists` picks an AND's child.

Example (the demo's MovieLens items have `genre`; users.parquet a `fav_genre`):

    >>> t = compile_template("genre = $user.fav_genre AND NOT item_id IN $history", plan, spec, 8, index.post_sizes)
    >>> ops, rows, vops, vrows, lists = t(values, lengths, *compile_request(filters, plan))
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from silverrec.errors import SilverrecError
from silverrec.filtering.filter_lang import And, Node, Not, Term, parse, terms
from silverrec.filtering.filter_program import FilterPlan, compile_filter, posting_lists
from silverrec.kernels.constants import OP_AND, OP_FALSE, OP_NOP, OP_NOT, OP_OR, OP_TRUE
from silverrec.kernels.constants import NO_LISTS

_MARK = "\x00"  # placeholders become quoted values starting with this (no filter value holds it)
_MANY = _MARK + "*"  # ... and this when bound with IN (every value of the user feature)
_PLACEHOLDER = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)")
_IN_PLACEHOLDER = re.compile(r"(?i)\bIN\s+\$([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)")
_NO_LIST_SIZE = 1 << 62  # "no posting-list superset": never the cheapest


class TemplateError(SilverrecError):
    """A filter template that does not fit the snapshot: unbound placeholder, type mismatch, bad form."""


@dataclass(frozen=True)
class Binding:
    """Placeholder `$user.<user_feature>` of a term on `item_feature`; `many`: bound with IN."""

    user_feature: str
    item_feature: str
    many: bool


def _substitute(text: str) -> str:
    """`IN $x` -> `IN ('\\0x')` and `$x` -> `'\\0x'`, so that the filter parser reads placeholders as values."""
    text = _IN_PLACEHOLDER.sub(lambda m: f"IN ('{_MANY}{m.group(1)}')", text)
    return re.sub(r"(?<!')" + _PLACEHOLDER.pattern, lambda m: f"'{_MARK}{m.group(1)}'", text)


def _placeholder(term: Term) -> Optional[str]:
    """The placeholder name of a template term (`user.g`, `history`), None for a literal term."""
    names = [v[2:] if v.startswith(_MANY) else v[1:] for v in term.values if v.startswith(_MARK)]
    if not names:
        return None
    if len(term.values) != 1:
        raise TemplateError(f"template term on {term.feature!r} mixes a placeholder with other values: "
                            "a placeholder must be the term's only value")
    return names[0]


def _is_history(node: Node) -> bool:
    return (isinstance(node, Not) and isinstance(node.child, Term) and node.child.feature == "item_id"
            and _placeholder(node.child) == "history")


def parse_template(text: str) -> tuple[Node | None, bool]:
    """Template text -> (AST with placeholder values, excludes_history). The AST is None when the
    template is only `NOT item_id IN $history`."""
    if not isinstance(text, str) or not text.strip():
        raise TemplateError("filter_template must be a non-empty string")
    node = parse(_substitute(text))
    parts = list(node.children) if isinstance(node, And) else [node]
    history = [p for p in parts if _is_history(p)]
    rest = [p for p in parts if not _is_history(p)]
    return (None if not rest else rest[0] if len(rest) == 1 else And(tuple(rest))), bool(history)


# ------------------------------------------------------------------------------------ compile


def _lower(node: Node, plan: FilterPlan, spec, negated: bool, verify: bool, slots: list, max_values: int) -> list:
    """Postfix items: ("ins", op, rows) fixed instructions and ("slot", i, j) fragment holes."""
    if not any(_placeholder(t) for t in terms(node)):  # a literal subtree: the normal compiler
        if negated:  # compiled as NOT of the negated child, so negated terms use the exact planes
            prog = compile_filter(Not(node), plan, exact_positive=verify) + [(OP_NOT, [])]
        else:
            prog = compile_filter(node, plan, exact_positive=verify)
        return [("ins", op, rows) for op, rows in prog]
    if isinstance(node, Term):
        name = _placeholder(node)
        i = _bind(node, name, plan, spec, slots, max_values, negated)
        out = [("slot", i, 0)]
        for j in range(1, slots[i][1]):
            out += [("slot", i, j), ("ins", OP_OR, [])]
        return out
    if isinstance(node, Not):
        return _lower(node.child, plan, spec, not negated, verify, slots, max_values) + [("ins", OP_NOT, [])]
    op = OP_AND if isinstance(node, And) else OP_OR
    out = _lower(node.children[0], plan, spec, negated, verify, slots, max_values)
    for c in node.children[1:]:
        out += _lower(c, plan, spec, negated, verify, slots, max_values) + [("ins", op, [])]
    return out


def _bind(term: Term, name: str, plan: FilterPlan, spec, slots: list, max_values: int, negated: bool) -> int:
    """Check one placeholder term and append it to `slots` [(Binding, value positions, negated)];
    returns its index."""
    if name == "history":
        raise TemplateError("$history is only supported as a top-level AND term `NOT item_id IN $history`")
    if not name.startswith("user."):
        raise TemplateError(f"unbound placeholder ${name}: placeholders are $user.<feature> and $history")
    g = name[5:]
    if g in spec.user_numeric:
        raise TemplateError(f"type mismatch: ${name} is a numeric user feature; a term on item feature "
                            f"{term.feature!r} needs a categorical one")
    if g not in spec.user_vocabs:
        raise TemplateError(f"unbound placeholder ${name}: the user tower reads the categorical user features "
                            f"{sorted(spec.user_vocabs) or 'none'}")
    if term.feature not in plan.vocab:
        raise TemplateError(f"template term on unknown item feature {term.feature!r} (at position {term.position}): "
                            f"this snapshot can filter on {sorted(plan.vocab) or 'no features'}")
    if not set(spec.user_vocabs[g]) & set(plan.vocab[term.feature]):
        raise TemplateError(f"type mismatch: no value of user feature {g!r} is a value of item feature "
                            f"{term.feature!r} (e.g. {spec.user_vocabs[g][:3]} vs {list(plan.vocab[term.feature])[:3]})")
    many = term.values[0].startswith(_MANY)
    slots.append((Binding(g, term.feature, many), max_values if many else 1, negated))
    return len(slots) - 1


def _fragment(binding: Binding, value: Optional[str], plan: FilterPlan, negated: bool, verify: bool) -> list:
    """One bound value's postfix program (FALSE for no value or a value outside the item vocabulary)."""
    if value is None or value not in plan.vocab[binding.item_feature]:
        return [(OP_FALSE, [])]
    term = Term(binding.item_feature, (value,))
    if negated:
        return compile_filter(Not(term), plan, exact_positive=verify) + [(OP_NOT, [])]
    return compile_filter(term, plan, exact_positive=verify)


def _pad_rows(rows: list[int], width: int) -> list[int]:
    return (list(rows) + [rows[0]] * (width - len(rows))) if rows else [0] * width


def _program(node: Node, plan: FilterPlan, spec, verify: bool, max_values: int, user_values: list) -> tuple[list, list]:
    """One program of the template: (positions, fragments).

    positions: per postfix instruction, ("ins", op, rows) or ("slot", i, j, o): offset o of the
    fragment of slot i's j-th user value; fragments[i][code]: the instructions of user value code
    `code` of slot i (code 0: no value -> FALSE), all NOP-padded to one length per program.
    """
    slots: list = []
    items = _lower(node, plan, spec, False, verify, slots, max_values)
    frags = [[_fragment(b, v, plan, negated, verify) for v in user_values[i]] for i, (b, _, negated) in enumerate(slots)]
    lf = max([len(f) for s in frags for f in s] + [1])
    frags = [[f + [(OP_NOP, [])] * (lf - len(f)) for f in s] for s in frags]
    positions = []
    for it in items:
        positions += [it] if it[0] == "ins" else [("slot", it[1], it[2], o) for o in range(lf)]
    return positions, frags


def compile_template(text: str, plan: FilterPlan, spec, max_values: int = 8,
                     post_sizes: Optional[Tensor] = None) -> "FilterTemplate":
    """Check a template against a snapshot and build its FilterTemplate.

    Args:
        text: the template (module docstring).
        plan: the snapshot's FilterPlan (item features, vocabularies, row bank).
        spec: the user tower's UserFeatureSpec (categorical user features and their vocabularies).
        max_values: most values of a user feature bound with IN (a request with more is refused).
        post_sizes: int64 [V + 1] the index's posting-list sizes (`FilteredIVFIndex.post_sizes`: the
            cheapest list is picked per request); None = no posting lists.
    Raises:
        TemplateError: an unbound placeholder, a type mismatch (numeric user feature, or no value in
            common with the item feature), an unknown item feature, a placeholder mixed with values.
        FilterSyntaxError: the template does not parse.
    """
    if int(max_values) < 1:
        raise TemplateError(f"max_values must be >= 1, got {max_values}")
    node, excludes_history = parse_template(text)
    if node is None:
        return FilterTemplate.empty(text, excludes_history)
    slots: list = []
    _lower(node, plan, spec, False, False, slots, max_values)  # binds and checks every placeholder
    bindings = [b for b, _, _ in slots]
    caps = [cap for _, cap, _ in slots]
    user_values = [[None] + list(spec.user_vocabs[b.user_feature]) for b in bindings]
    programs = [_program(node, plan, spec, verify, max_values, user_values) for verify in (False, True)]
    keys = list(spec.keys)
    tables = _tables(programs, [keys.index(f"user_{b.user_feature}") for b in bindings], caps)
    lists = _list_candidates(node, plan, bindings, user_values)
    return FilterTemplate(text, excludes_history, bindings, len(keys), max_values, tables, lists, post_sizes)


_NEVER = 1 << 40  # a value position no request reaches: the column's code is always 0


def _tables(programs: list, keys: list[int], caps: list[int]) -> dict[str, np.ndarray]:
    """Both programs (Bloom, verify) as one lookup: instruction p of a request = table entry
    `entry[b, column[p]]` at `offset[p]`.

    Entry 0 holds every fixed instruction (at its own position); then, per program and slot, one
    entry per user value code. Column 0 always reads entry 0; column c of (program, slot i, value j)
    reads entry base + the user's j-th code of slot i's feature (`FilterTemplate.entries`).
    """
    lengths = [len(pos) for pos, _ in programs]
    frag_len = max([len(s[0]) for _, frags in programs for s in frags] + [1])
    width = max([len(r) for pos, _ in programs for it in pos if it[0] == "ins" for r in [it[2]]]
                + [len(r) for _, frags in programs for s in frags for f in s for _, r in f] + [1])
    span = max(sum(lengths), frag_len)
    col_key, col_index, col_base = [0], [_NEVER], [0]
    entries_ops = [[OP_NOP] * span]
    entries_rows = [[[0] * width for _ in range(span)]]
    column, offset, slot_col = [], [], []
    start = 0
    for pos, frags in programs:
        col_of = {}
        for i, s in enumerate(frags):
            base = len(entries_ops)
            for frag in s:
                entries_ops.append([op for op, _ in frag] + [OP_NOP] * (span - len(frag)))
                entries_rows.append([_pad_rows(r, width) for _, r in frag] + [[0] * width] * (span - len(frag)))
            for j in range(caps[i]):
                col_of[(i, j)] = len(col_key)
                col_key.append(keys[i])
                col_index.append(j)
                col_base.append(base)
        for p, it in enumerate(pos):
            if it[0] == "ins":
                entries_ops[0][start + p] = it[1]
                entries_rows[0][start + p] = _pad_rows(it[2], width)
                column.append(0)
                offset.append(start + p)
            else:
                column.append(col_of[(it[1], it[2])])
                offset.append(it[3])
        start += len(pos)
        slot_col = slot_col or [col_of[(i, 0)] for i in range(len(frags))]  # the Bloom program's
    a = np.asarray
    return {"col_key": a(col_key, np.int64), "col_index": a(col_index, np.int64), "col_base": a(col_base, np.int64),
            "column": a(column, np.int64), "offset": a(offset, np.int64), "table_ops": a(entries_ops, np.int64),
            "table_rows": a(entries_rows, np.int64).reshape(len(entries_ops), span, width),
            "bloom_length": a(lengths[0]), "slot_col": a(slot_col, np.int64)}


def _list_candidates(node: Node, plan: FilterPlan, bindings: list[Binding], user_values) -> dict[str, np.ndarray]:
    """Posting-list candidates: each top-level AND term that has lists (a literal term, or an `=`
    placeholder per user value; one whose values never have lists is left out) -> lists table
    int64 [E2, W2] (-1 padded, NO_LISTS row: none), sizes int64 [E2], and per candidate its slot
    (-1: fixed) and first table row."""
    parts = list(node.children) if isinstance(node, And) else [node]
    holes = [t for t in terms(node) if _placeholder(t)]  # in slot order (`_lower` binds left to right)
    rows: list[Optional[tuple]] = []
    slot, base = [], []
    for p in parts:
        if not any(_placeholder(t) for t in terms(p)):
            found = posting_lists(p, plan)
            if found is not None:
                slot.append(-1)
                base.append(len(rows))
                rows.append(found)
        elif isinstance(p, Term) and not bindings[holes.index(p)].many:
            i = holes.index(p)
            f = bindings[i].item_feature
            per_value = [posting_lists(Term(f, (v,)), plan) if v in plan.vocab[f] else ((), 0)
                         for v in user_values[i] if v is not None]
            if all(r is None for r in per_value):
                continue
            slot.append(i)
            base.append(len(rows))
            rows += [((), 0)] + per_value  # code 0 (no value) matches nothing
    width = max([len(r[0]) for r in rows if r is not None] + [1])
    table = np.full((max(len(rows), 1), width), -1, dtype=np.int64)
    sizes = np.full(max(len(rows), 1), _NO_LIST_SIZE, dtype=np.int64)
    for n, r in enumerate(rows):
        if r is None:
            table[n, 0] = NO_LISTS
        else:
            table[n, : len(r[0])] = r[0]
            sizes[n] = r[1]
    return {"lists_table": table, "list_sizes": sizes, "list_slot": np.asarray(slot, np.int64),
            "list_base": np.asarray(base, np.int64)}


# ------------------------------------------------------------------------------------ forward


class FilterTemplate(nn.Module):
    """The compiled template (module docstring). An empty one (no template) passes programs through.

    forward(values int64 [nnz], lengths int32 [F*B] (the request's KJT), ops int64 [B, L],
            rows int64 [B, L, T], vops, vrows (the verify program, same layout), lists int64 [B, T2])
        -> (ops [B, Lb + L + 1], rows [B, Lb + L + 1, W + T], vops, vrows (alike), lists [B, W2 + T2]
           or the request's lists when the template has no posting-list candidates):
           the filled template AND the request's filter, as postfix programs.
    """

    def __init__(self, text: str, excludes_history: bool, bindings: list[Binding], num_keys: int, max_values: int,
                 tables: dict[str, np.ndarray], lists: dict[str, np.ndarray], post_sizes: Optional[Tensor] = None):
        super().__init__()
        # the index's posting-list sizes (the same tensor), with the trailing 0 of an unused slot
        self.register_buffer("post_sizes", torch.zeros(1, dtype=torch.int64) if post_sizes is None else post_sizes)
        self.text = text
        self.excludes_history = bool(excludes_history)
        self.bindings = bindings
        self.max_values = int(max_values)
        self.active = bool(bindings) or len(tables["column"]) > 0
        self.num_keys = int(num_keys)
        self.bloom_length = int(tables["bloom_length"])
        for name in ("col_key", "col_index", "col_base", "column", "offset", "table_ops", "table_rows"):
            self.register_buffer(name, torch.as_tensor(tables[name]))
        slot = lists["list_slot"]
        self.num_candidates = int(len(slot))
        # the column of each candidate's first user value (column 0, code always 0, for fixed ones)
        list_col = [int(tables["slot_col"][i]) if i >= 0 else 0 for i in slot]
        self.register_buffer("list_col", torch.as_tensor(list_col, dtype=torch.int64))
        self.register_buffer("list_fixed", torch.as_tensor(slot < 0))
        self.register_buffer("list_base", torch.as_tensor(lists["list_base"]))
        self.register_buffer("lists_table", torch.as_tensor(lists["lists_table"]))
        self.register_buffer("list_sizes", torch.as_tensor(lists["list_sizes"]))
        self.op_and, self.no_lists, self.no_list_size = OP_AND, NO_LISTS, _NO_LIST_SIZE  # TorchScript reads no globals

    @classmethod
    def empty(cls, text: str = "", excludes_history: bool = False) -> "FilterTemplate":
        """No template: forward returns the request's programs unchanged."""
        tables = _tables([([("ins", OP_TRUE, [])], [])], [], [])
        none = {"lists_table": np.full((1, 1), NO_LISTS, np.int64), "list_sizes": np.full(1, _NO_LIST_SIZE, np.int64),
                "list_slot": np.zeros(0, np.int64), "list_base": np.zeros(0, np.int64)}
        m = cls(text, excludes_history, [], 1, 1, tables, none)
        m.active = False
        return m

    def config(self) -> dict[str, Any]:
        """What the manifest records (the predictor checks requests against it)."""
        return {"text": self.text, "excludes_history": self.excludes_history, "max_values": self.max_values,
                "bindings": [{"user_feature": b.user_feature, "item_feature": b.item_feature, "many": b.many}
                             for b in self.bindings]}

    def entries(self, values: Tensor, lengths: Tensor) -> Tensor:
        """int64 [B, C]: per request and column, the table entry it reads: the column's base + the
        user's code at the column's value position (0 when the user has no value there)."""
        B = lengths.shape[0] // self.num_keys
        lens = lengths.to(torch.int64)
        at = self.col_key[None, :] * B + torch.arange(B, device=values.device)[:, None]  # [B, C]
        n = lens[at]
        pos = torch.cumsum(lens, 0)[at] - n + self.col_index[None, :]
        code = torch.cat([values, values.new_zeros(1)])[pos.clamp(0, values.shape[0])]
        return self.col_base[None, :] + torch.where(self.col_index[None, :] < n, code, torch.zeros_like(code))

    def forward(self, values: Tensor, lengths: Tensor, ops: Tensor, rows: Tensor, vops: Tensor, vrows: Tensor,
                lists: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        if not self.active:
            return ops, rows, vops, vrows, lists
        entry = self.entries(values, lengths)
        e = entry[:, self.column]  # [B, Lb + Lv]
        t_ops = self.table_ops[e, self.offset[None, :]]
        t_rows = self.table_rows[e, self.offset[None, :]]
        Lb = self.bloom_length
        out_ops, out_rows = self._and(t_ops[:, :Lb], t_rows[:, :Lb], ops, rows)
        out_vops, out_vrows = self._and(t_ops[:, Lb:], t_rows[:, Lb:], vops, vrows)
        return out_ops, out_rows, out_vops, out_vrows, self._lists(entry, lists)

    def _lists(self, entry: Tensor, lists: Tensor) -> Tensor:
        """The cheapest posting-list superset: the template's candidates first, then the request's
        (ties to the first, as `posting_lists` picks an AND's child)."""
        if self.num_candidates == 0:
            return lists
        B = lists.shape[0]
        post_sizes = self.post_sizes
        n_lists = post_sizes.shape[0] - 1
        req_size = post_sizes[torch.where(lists >= 0, lists, torch.full_like(lists, n_lists))].sum(dim=1)
        req_size = torch.where(lists[:, 0] == self.no_lists, torch.full_like(req_size, self.no_list_size), req_size)
        width = self.lists_table.shape[1] + lists.shape[1]
        pad_req = torch.cat([lists, torch.full((B, self.lists_table.shape[1]), -1, dtype=lists.dtype, device=lists.device)], 1)
        code = entry[:, self.list_col] - self.col_base[self.list_col][None, :]
        e = self.list_base[None, :] + torch.where(self.list_fixed[None, :], torch.zeros_like(code), code)  # [B, C]
        sizes = torch.cat([self.list_sizes[e], req_size[:, None]], dim=1)  # [B, C + 1]
        cand = torch.cat([self.lists_table[e], torch.full((B, e.shape[1], lists.shape[1]), -1, dtype=lists.dtype,
                                                          device=lists.device)], dim=2)  # [B, C, width]
        cand = torch.cat([cand, pad_req[:, None, :]], dim=1)
        best = torch.argmin(sizes, dim=1)
        return cand.gather(1, best[:, None, None].expand(B, 1, width)).squeeze(1)

    def _and(self, t_ops: Tensor, t_rows: Tensor, ops: Tensor, rows: Tensor) -> Tuple[Tensor, Tensor]:
        """Postfix `template request AND`; rows widened to W + T by repeating each row's first operand."""
        B, W, T = t_ops.shape[0], t_rows.shape[2], rows.shape[2]
        t_rows = torch.cat([t_rows, t_rows[:, :, :1].expand(B, t_rows.shape[1], T)], dim=2)
        rows = torch.cat([rows, rows[:, :, :1].expand(B, rows.shape[1], W)], dim=2)
        out_ops = torch.cat([t_ops, ops, torch.full((B, 1), self.op_and, dtype=ops.dtype, device=ops.device)], dim=1)
        out_rows = torch.cat([t_rows, rows, rows[:, :1]], dim=1)  # the AND's operand slot: any row, unread
        return out_ops, out_rows


def check_request_features(cfg: dict[str, Any], features: list[dict[str, Any]]) -> None:
    """Predictor-side check of the requests' user features against a manifest's `filter_template`
    (`FilterTemplate.config()`): every bound feature present, one value for `=`, at most
    `max_values` for IN. Raises QueryError naming the request and the feature."""
    from silverrec.errors import QueryError

    for b, feats in enumerate(features):
        for bind in cfg["bindings"]:
            g = bind["user_feature"]
            raw = feats.get(g)
            n = 0 if raw is None else 1 if isinstance(raw, str) else len(list(raw))
            if n == 0:
                raise QueryError(f"request {b}: the snapshot's filter template binds $user.{g} (item feature "
                                 f"{bind['item_feature']!r}), but the request has no user feature {g!r}")
            cap = cfg["max_values"] if bind["many"] else 1
            if n > cap:
                raise QueryError(f"request {b}: user feature {g!r} has {n} values; the filter template binds "
                                 f"{'at most ' + str(cap) if bind['many'] else 'one (with =)'}")
