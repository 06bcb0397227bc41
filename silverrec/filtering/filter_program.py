"""Compile filter strings into postfix programs of tensors (the predictor's "plan" step).

The compile uses only the snapshot manifest (`FilterPlan.from_config(manifest["config"]["filter"])`):
feature names, their value vocabularies, the Bloom size M, hash count K and seed, and where each
feature's exact value-code planes live in the model's row bank.

Program tensors, one program per query, padded to a common length L with NOP:

    ops  int64 [B, L]      opcode per instruction (kernels/bloom_filter.py: NOP PUSH AND OR NOT FALSE TRUE)
    rows int64 [B, L, T]   for PUSH: the row-bank rows ANDed together (r >= 0: row r; r < 0: ~row ~r);
                           shorter lists are padded by repeating their first row (AND is idempotent)

Semantics (documented in docs/filtering.md):
- A positive term `f = v` (under an even number of NOTs) is a Bloom test: the AND of v's K hashed
  bit rows. It can pass items without the value (false positives, rate estimated at publish,
  <= 1% by default) but never drops an item that has it.
- A negated term (under an odd number of NOTs) is evaluated exactly when the feature has exact
  value-code planes (`exact` in the manifest; every feature whose slots x code bits <= 64): the
  item's value code in each slot is compared bit by bit, so `NOT f = v` never drops a true match.
  Features without planes (very wide multi-valued ones) fall back to NOT of the Bloom test, which
  can drop true matches at the false-positive rate; `FilterPlan.approximate_not` lists them.
  Together: the filter result is a superset of the exact answer (no false negatives) whenever no
  negated term touches an approximate feature.
- The verify program (`exact_positive=True`) evaluates positive terms with the exact planes too;
  the search uses it to drop Bloom false positives from its results and for the unprobed
  (filter-then-exact-scan) mask, so results are exact for filters over features with planes.
- A value held by more items than the posting limit (no posting list) has its own exact bit plane
  (`planes` in the manifest): its term is one row, exact, in both programs.
- A value not in the feature's vocabulary matches nothing, exactly (compiled to FALSE; a Bloom
  test of an unseen value could otherwise false-positive). `f IN (...)` drops unknown values.
- An unknown feature name is a QueryError naming it and its position.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from silverrec.filtering.bloom_hash import token_positions
from silverrec.errors import QueryError
from silverrec.filtering.filter_lang import And, Node, Not, Term, parse
from silverrec.kernels.constants import OP_AND, OP_FALSE, OP_NOT, OP_OR, OP_PUSH, OP_TRUE
from silverrec.kernels.constants import NO_LISTS  # lists[b, 0]: no posting-list superset


@dataclass(frozen=True)
class ExactPlanes:
    """Exact value codes of one feature, bit-sliced: `slots` x `bits` rows starting at `row`.

    Item value j of the feature (0-based in the vocabulary) has code j + 1; slot s of an item holds
    the code of its s-th value (0 = no value). Row `row + s * bits + b` holds bit b of slot s.
    """

    row: int
    slots: int
    bits: int


@dataclass
class FilterPlan:
    """What a predictor needs to compile filters for one snapshot (all from its manifest)."""

    bloom_bits: int
    bloom_hashes: int
    seed: int
    vocab: dict[str, dict[str, int]]  # feature -> value -> index in the vocabulary
    exact: dict[str, Optional[ExactPlanes]]
    total_rows: int
    # feature -> per value (vocabulary order): its posting list id (-1 = none stored) and item count
    postings: dict[str, list[int]] = field(default_factory=dict)
    counts: dict[str, list[int]] = field(default_factory=dict)
    # feature -> per value: the bank row of its bit plane (publish/filtered_ivf.py value_planes:
    # values without a posting list), -1 = none; and the pool size
    planes: dict[str, list[int]] = field(default_factory=dict)
    num_items: int = 0
    _cache: dict = field(default_factory=dict, repr=False)
    # LRU caches of compiled programs: (filter text, exact_positive) -> (ops int64 [L], rows int64
    # [L, T]) numpy arrays, and (tuple of filters, exact_positive) -> batch tensors (ops, rows).
    # Requests repeat a few filter strings, so the predictor's compile is usually a dictionary hit.
    _programs: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _batches: OrderedDict = field(default_factory=OrderedDict, repr=False)
    program_cache_size: int = field(default=4096, repr=False)
    batch_cache_size: int = field(default=256, repr=False)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "FilterPlan":
        bloom = cfg["bloom"]
        vocab, exact, postings, counts, planes = {}, {}, {}, {}, {}
        for name, meta in cfg["features"].items():
            planes[name] = [int(r) for r in meta.get("planes", [-1] * len(meta["values"]))]
            vocab[name] = {v: i for i, v in enumerate(meta["values"])}
            e = meta.get("exact")
            exact[name] = ExactPlanes(int(e["row"]), int(e["slots"]), int(e["bits"])) if e else None
            postings[name] = [int(i) for i in meta.get("postings", [-1] * len(meta["values"]))]
            counts[name] = [int(c) for c in meta.get("counts", [0] * len(meta["values"]))]
        return cls(int(bloom["bits"]), int(bloom["hashes"]), int(bloom["seed"]), vocab, exact, int(cfg["rows"]), postings, counts,
                   planes, int(cfg.get("items", 0)))

    def cached_batch(self, key):
        """The batch LRU's entry for `key` (a request's compiled tensors or route decisions), or None."""
        return _lru_get(self._batches, key)

    def cache_batch(self, key, value) -> None:
        """Remember `value` for `key` in the batch LRU (the least recently used entry goes)."""
        _lru_put(self._batches, key, value, self.batch_cache_size)

    @property
    def approximate_not(self) -> list[str]:
        """Features whose negation falls back to NOT of the Bloom test (may drop true matches)."""
        return sorted(f for f, e in self.exact.items() if e is None)

    def bloom_rows(self, feature: str, value: str) -> list[int]:
        key = (feature, value)
        rows = self._cache.get(key)
        if rows is None:
            rows = token_positions(feature, value, self.bloom_bits, self.bloom_hashes, self.seed)
            self._cache[key] = rows
        return rows

    def exact_slot_rows(self, feature: str, value: str) -> list[list[int]]:
        """Per slot, the signed rows whose AND is 1 exactly where that slot holds `value`."""
        planes = self.exact[feature]
        code = self.vocab[feature][value] + 1
        out = []
        for s in range(planes.slots):
            base = planes.row + s * planes.bits
            out.append([base + b if (code >> b) & 1 else ~(base + b) for b in range(planes.bits)])
        return out


# ------------------------------------------------------------------------------ intermediate form
# ("push", rows) | ("false",) | ("true",) | ("not", x) | ("and", a, b) | ("or", a, b)

_FALSE = ("false",)
_TRUE = ("true",)


def _balanced(op: str, items: list[tuple]) -> tuple:
    """Fold a list with a binary op as a balanced tree (shallow stacks), with constant folding."""
    absorbing, neutral = (_FALSE, _TRUE) if op == "and" else (_TRUE, _FALSE)
    items = [x for x in items if x != neutral]
    if any(x == absorbing for x in items):
        return absorbing
    if not items:
        return neutral
    while len(items) > 1:
        nxt = [(op, items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
        if len(items) % 2:
            nxt.append(items[-1])
        items = nxt
    return items[0]


def _negate(x: tuple) -> tuple:
    if x == _TRUE:
        return _FALSE
    if x == _FALSE:
        return _TRUE
    if x[0] == "not":
        return x[1]
    return ("not", x)


def _lower(node: Node, plan: FilterPlan, negated: bool, exact_positive: bool = False) -> tuple:
    if isinstance(node, Term):
        if node.feature not in plan.vocab:
            raise QueryError(
                f"unknown feature {node.feature!r} in filter at position {node.position}; "
                f"this snapshot can filter on {sorted(plan.vocab) or 'no features'}"
            )
        known = [v for v in node.values if v in plan.vocab[node.feature]]
        pushes = []
        for v in known:
            plane = plan.planes.get(node.feature, ())
            row = plane[plan.vocab[node.feature][v]] if plane else -1
            if row >= 0:  # the value's own bit plane: one exact row
                pushes.append(("push", [row]))
            elif (negated or exact_positive) and plan.exact[node.feature] is not None:
                pushes += [("push", r) for r in plan.exact_slot_rows(node.feature, v)]
            else:
                pushes.append(("push", plan.bloom_rows(node.feature, v)))
        return _balanced("or", pushes)
    if isinstance(node, Not):
        return _negate(_lower(node.child, plan, not negated, exact_positive))
    op = "and" if isinstance(node, And) else "or"
    return _balanced(op, [_lower(c, plan, negated, exact_positive) for c in node.children])


def _emit(x: tuple, out: list[tuple[int, list[int]]]) -> None:
    kind = x[0]
    if kind == "push":
        out.append((OP_PUSH, list(x[1])))
    elif kind == "false":
        out.append((OP_FALSE, []))
    elif kind == "true":
        out.append((OP_TRUE, []))
    elif kind == "not":
        _emit(x[1], out)
        out.append((OP_NOT, []))
    else:
        _emit(x[1], out)
        _emit(x[2], out)
        out.append((OP_AND if kind == "and" else OP_OR, []))


def compile_filter(
    text_or_ast: Union[str, Node, None], plan: FilterPlan, exact_positive: bool = False
) -> list[tuple[int, list[int]]]:
    """One filter -> postfix instructions [(opcode, signed rows)]. None means "all items".

    exact_positive: also evaluate positive terms with the exact planes where the feature has them
    (the "verify" program: exact for filters over such features, a Bloom superset otherwise).
    """
    if text_or_ast is None:
        return [(OP_TRUE, [])]
    node = parse(text_or_ast) if isinstance(text_or_ast, str) else text_or_ast
    out: list[tuple[int, list[int]]] = []
    _emit(_lower(node, plan, False, exact_positive), out)
    return out


def _lru_get(cache: OrderedDict, key):
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
    return hit


def _lru_put(cache: OrderedDict, key, value, size: int) -> None:
    cache[key] = value
    if len(cache) > size:
        cache.popitem(last=False)


def _program_arrays(
    f: Union[str, Node, None], plan: FilterPlan, exact_positive: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One filter -> (ops int64 [L], rows int64 [L, T]) with PUSH operand lists padded by their first
    row (other instructions: zeros); cached per filter string in the plan (LRU)."""
    key = (f, exact_positive) if not isinstance(f, Node) else None
    if key is not None:
        hit = _lru_get(plan._programs, key)
        if hit is not None:
            return hit
    prog = compile_filter(f, plan, exact_positive)
    width = max([len(r) for _, r in prog] + [1])
    ops = np.array([op for op, _ in prog], dtype=np.int64)
    rows = np.zeros((len(prog), width), dtype=np.int64)
    for i, (_, r) in enumerate(prog):
        if r:
            rows[i, : len(r)] = r
            rows[i, len(r) :] = r[0]
    if key is not None:
        ops.flags.writeable = rows.flags.writeable = False
        _lru_put(plan._programs, key, (ops, rows), plan.program_cache_size)
    return ops, rows


def compile_batch(
    filters: Sequence[Union[str, Node, None]], plan: FilterPlan, exact_positive: bool = False, cache: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compile one filter per query into padded program tensors (ops int64 [B, L], rows int64 [B, L, T]).

    Compiled programs are cached per filter string and per batch of strings in `plan` (LRU; the
    returned tensors are fresh copies). cache=False compiles from scratch (benchmarks)."""
    filters = list(filters)
    if not filters:
        raise QueryError("no filters to compile")
    bkey = None
    if cache and all(f is None or isinstance(f, str) for f in filters):
        bkey = (tuple(filters), exact_positive)
        hit = plan.cached_batch(bkey)
        if hit is not None:
            return hit[0].clone(), hit[1].clone()
    if cache:
        programs = [_program_arrays(f, plan, exact_positive) for f in filters]
    else:
        programs = [_program_arrays(f if isinstance(f, Node) or f is None else parse(f), plan, exact_positive) for f in filters]
    length = max(len(o) for o, _ in programs)
    width = max(r.shape[1] for _, r in programs)
    ops = np.zeros((len(programs), length), dtype=np.int64)
    rows = np.zeros((len(programs), length, width), dtype=np.int64)
    for b, (o, r) in enumerate(programs):
        n, t = r.shape
        ops[b, :n] = o
        rows[b, :n, :t] = r
        rows[b, :n, t:] = r[:, :1]
    ops_t, rows_t = torch.from_numpy(ops), torch.from_numpy(rows)
    if bkey is not None:
        plan.cache_batch(bkey, (ops_t, rows_t))
        return ops_t.clone(), rows_t.clone()
    return ops_t, rows_t


def posting_lists(node: Node, plan: FilterPlan) -> Optional[tuple[tuple[int, ...], int]]:
    """Posting lists whose union holds every item `node` passes, and their total length; None when
    the filter has no such superset (a term whose value is too frequent to have a list, a NOT).

    AND takes its cheapest child, OR needs every child and unites them; a term unites its values'
    lists (values outside the vocabulary match nothing and need no list)."""
    if isinstance(node, Term):
        f = node.feature
        values = [plan.vocab[f][v] for v in node.values if v in plan.vocab[f]]
        lists = {plan.postings[f][i]: plan.counts[f][i] for i in values}
        if any(i < 0 for i in lists):
            return None
        return tuple(sorted(lists)), sum(lists.values())
    if isinstance(node, Not):
        return posting_lists(node.child.child, plan) if isinstance(node.child, Not) else None
    parts = [posting_lists(c, plan) for c in node.children]
    if isinstance(node, And):
        known = [p for p in parts if p is not None]
        return min(known, key=lambda p: p[1]) if known else None
    if any(p is None for p in parts):
        return None
    ids = sorted({i for p in parts for i in p[0]})
    return tuple(ids), sum(p[1] for p in parts)  # an upper bound when children share lists


def estimate_matches(node: Optional[Node], plan: FilterPlan) -> float:
    """Estimated items passing `node`, from the manifest's per-value counts with independent
    features: a term sums its values' counts (exact for single-valued features), NOT is the
    complement, AND multiplies fractions, OR is 1 - the product of the complements."""
    n = float(max(plan.num_items, 1))
    if node is None:
        return n
    if isinstance(node, Term):
        idx = [plan.vocab[node.feature][v] for v in node.values if v in plan.vocab.get(node.feature, {})]
        return min(n, float(sum(plan.counts[node.feature][i] for i in idx)))
    if isinstance(node, Not):
        return n - estimate_matches(node.child, plan)
    fracs = [estimate_matches(c, plan) / n for c in node.children]
    if isinstance(node, And):
        return n * float(np.prod(fracs))
    return n * (1.0 - float(np.prod([1.0 - f for f in fracs])))


def compile_estimates(filters: Sequence[Union[str, Node, None]], plan: FilterPlan) -> np.ndarray:
    """float64 [B]: `estimate_matches` of each filter (cached per filter string)."""
    out = np.empty(len(filters), dtype=np.float64)
    for b, f in enumerate(filters):
        key = (f, "estimate") if isinstance(f, str) else None
        hit = _lru_get(plan._programs, key) if key else None
        if hit is None:
            hit = (estimate_matches(None if f is None else (parse(f) if isinstance(f, str) else f), plan),)
            if key:
                _lru_put(plan._programs, key, hit, plan.program_cache_size)
        out[b] = hit[0]
    return out


def compile_lists(filters: Sequence[Union[str, Node, None]], plan: FilterPlan) -> torch.Tensor:
    """int64 [B, T2]: each filter's posting lists (-1 padded), or NO_LISTS in column 0 when it has
    none (no filter, or no posting-list superset). Run after compile_batch (which reports errors)."""
    found = []
    for f in filters:
        key = (f, "lists") if isinstance(f, str) else None
        hit = _lru_get(plan._programs, key) if key else None
        if hit is None:
            node = None if f is None else (parse(f) if isinstance(f, str) else f)
            hit = (None if node is None else posting_lists(node, plan),)
            if key:
                _lru_put(plan._programs, key, hit, plan.program_cache_size)
        found.append(hit[0])
    width = max([len(p[0]) for p in found if p is not None] + [1])
    out = np.full((len(found), width), -1, dtype=np.int64)
    for b, p in enumerate(found):
        if p is None:
            out[b, 0] = NO_LISTS
        else:
            out[b, : len(p[0])] = p[0]
    return torch.from_numpy(out)


def compile_request(filters: Sequence[Union[str, Node, None]], plan: FilterPlan) -> tuple[torch.Tensor, ...]:
    """The filter inputs of `FilteredIVFIndex.forward`, in order: (ops, rows) the Bloom programs,
    (vops, vrows) the verify programs (exact_positive) and lists (compile_lists).

    A batch of filter strings seen before is one LRU hit returning the same tensors: treat them as
    read-only (the model never writes its inputs)."""
    filters = list(filters)
    key = (tuple(filters), "request") if all(f is None or isinstance(f, str) for f in filters) else None
    hit = _lru_get(plan._batches, key) if key is not None else None
    if hit is not None:
        return hit
    ops, rows = compile_batch(filters, plan)
    vops, vrows = compile_batch(filters, plan, exact_positive=True)
    out = (ops, rows, vops, vrows, compile_lists(filters, plan))
    if key is not None:
        _lru_put(plan._batches, key, out, plan.batch_cache_size)
    return out


def normalize_filters(filt: Union[str, Sequence[Optional[str]], None], batch: int) -> Optional[list[Optional[str]]]:
    """A request's `filter` option -> one filter (or None) per query row; None if nothing filters."""
    if filt is None:
        return None
    if isinstance(filt, str):
        return [filt] * batch
    filters = list(filt)
    if len(filters) != batch:
        raise QueryError(f"got {len(filters)} filters for {batch} query rows: give one per row, or one string for all")
    if all(f is None for f in filters):
        return None
    return filters
