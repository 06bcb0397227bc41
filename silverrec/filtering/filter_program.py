"""Compile filter strings into postfix programs of tensors (the predictor's "plan" step).

The compiler is C++ (kernels/csrc/filter_compiler.h: the one implementation, which silverrec-predictor
runs too); this module builds it from the manifest (`FilterPlan.native`, a
silverrec_host.FilterCompiler), calls it and keeps the batch cache of Python's serving.

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

from silverrec.errors import QueryError
from silverrec.filtering.bloom_hash import seed_int64
from silverrec.filtering.filter_lang import Node, flatten, query_error
from silverrec.kernels.constants import OP_TRUE


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
    """What a predictor needs to compile filters for one snapshot (all from its manifest), and the
    compiler built from it (`native`: C++, caching compiled programs per filter string)."""

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
    # LRU of a request's compiled tensors (and filtered_search's route decisions) per batch of filter
    # strings: requests repeat a few filters, so Python's predictor skips even the call to the compiler
    _batches: OrderedDict = field(default_factory=OrderedDict, repr=False)
    batch_cache_size: int = field(default=256, repr=False)
    _native: Any = field(default=None, repr=False)

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

    @property
    def native(self):
        """The C++ compiler of this plan (silverrec_host.FilterCompiler), built on first use."""
        if self._native is None:
            from silverrec.kernels import library

            names = list(self.vocab)
            planes = [self.exact[f] for f in names]
            exact = [x for e in planes for x in ((e.row, e.slots, e.bits) if e else (-1, 0, 0))]
            flat = lambda table: [int(x) for f in names for x in table.get(f, [])]  # noqa: E731
            library.load()
            self._native = torch.classes.silverrec_host.FilterCompiler(
                self.bloom_bits, self.bloom_hashes, seed_int64(self.seed), self.total_rows, self.num_items, names,
                [len(self.vocab[f]) for f in names], [v for f in names for v in self.vocab[f]], exact,
                flat(self.postings), flat(self.counts), flat(self.planes))
        return self._native

    def cached_batch(self, key):
        """The batch LRU's entry for `key` (a request's compiled tensors or route decisions), or None."""
        hit = self._batches.get(key)
        if hit is not None:
            self._batches.move_to_end(key)
        return hit

    def cache_batch(self, key, value) -> None:
        """Remember `value` for `key` in the batch LRU (the least recently used entry goes)."""
        self._batches[key] = value
        if len(self._batches) > self.batch_cache_size:
            self._batches.popitem(last=False)

    @property
    def approximate_not(self) -> list[str]:
        """Features whose negation falls back to NOT of the Bloom test (may drop true matches)."""
        return sorted(f for f, e in self.exact.items() if e is None)


def _call(fn, *args, text: object = None):
    """fn(*args) without its error slot (the compiler returns a bad filter's message as the last element of its
    result, "" for none), the error raised as its QueryError."""
    *out, error = fn(*args)
    if error:
        raise query_error(error, text)
    return out[0] if len(out) == 1 else out


def _present(filters: Sequence[Optional[str]]) -> tuple[list[str], list[int]]:
    bad = next((f for f in filters if f is not None and not isinstance(f, str)), None)
    if bad is not None:
        raise QueryError(f"filter must be a string, got {type(bad).__name__}")
    return ["" if f is None else f for f in filters], [0 if f is None else 1 for f in filters]


def compile_filter(
    text_or_ast: Union[str, Node, None], plan: FilterPlan, exact_positive: bool = False
) -> list[tuple[int, list[int]]]:
    """One filter -> postfix instructions [(opcode, signed rows)]. None means "all items".

    exact_positive: also evaluate positive terms with the exact planes where the feature has them
    (the "verify" program: exact for filters over such features, a Bloom superset otherwise).
    """
    if text_or_ast is None:
        return [(OP_TRUE, [])]
    if isinstance(text_or_ast, str):
        ops, rows, widths = _call(plan.native.program, text_or_ast, bool(exact_positive), text=text_or_ast)
    else:
        ops, rows, widths = _call(plan.native.program_ast, *flatten(text_or_ast), bool(exact_positive))
    return [(int(o), r[:w]) for o, r, w in zip(ops.tolist(), rows.tolist(), widths.tolist())]


def compile_batch(
    filters: Sequence[Union[str, None]], plan: FilterPlan, exact_positive: bool = False, cache: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compile one filter per query into padded program tensors (ops int64 [B, L], rows int64 [B, L, T]):
    the Bloom programs, or the verify programs with exact_positive. cache=False: compiled from scratch,
    past the compiler's cache of programs per filter string (benchmarks)."""
    filters = list(filters)
    if not filters:
        raise QueryError("no filters to compile")
    ops, rows, vops, vrows, _ = _request(filters, plan, cache)
    return (vops, vrows) if exact_positive else (ops, rows)


def _request(filters: list, plan: FilterPlan, cache: bool = True) -> tuple[torch.Tensor, ...]:
    """The compiler's (ops, rows, vops, vrows, lists) for a batch; QueryError for the first bad filter."""
    texts, present = _present(filters)
    return _call(plan.native.request, texts, present, bool(cache))


def posting_lists(node: Node, plan: FilterPlan) -> Optional[tuple[tuple[int, ...], int]]:
    """Posting lists whose union holds every item `node` passes, and their total length; None when
    the filter has no such superset (a term whose value is too frequent to have a list, a NOT).

    AND takes its cheapest child, OR needs every child and unites them; a term unites its values'
    lists (values outside the vocabulary match nothing and need no list)."""
    ids, total, found = _call(plan.native.lists_ast, *flatten(node))
    return (tuple(ids), int(total)) if found else None


def compile_estimates(filters: Sequence[Optional[str]], plan: FilterPlan) -> np.ndarray:
    """float64 [B]: the estimated items each filter passes, from the manifest's per-value counts with
    independent features: a term sums its values' counts, NOT is the complement, AND multiplies
    fractions, OR is 1 - the product of the complements (no filter: the whole pool)."""
    texts, present = _present(filters)
    return np.asarray(_call(plan.native.estimates, texts, present), dtype=np.float64)


def compile_lists(filters: Sequence[Optional[str]], plan: FilterPlan) -> torch.Tensor:
    """int64 [B, T2]: each filter's posting lists (-1 padded), or NO_LISTS in column 0 when it has
    none (no filter, or no posting-list superset)."""
    return _request(list(filters), plan)[4]


def compile_request(filters: Sequence[Optional[str]], plan: FilterPlan) -> tuple[torch.Tensor, ...]:
    """The filter inputs of `FilteredIVFIndex.forward`, in order: (ops, rows) the Bloom programs,
    (vops, vrows) the verify programs (exact_positive) and lists (compile_lists).

    A batch of filter strings seen before is one LRU hit returning the same tensors: treat them as
    read-only (the model never writes its inputs)."""
    filters = list(filters)
    key = (tuple(filters), "request") if all(f is None or isinstance(f, str) for f in filters) else None
    hit = plan.cached_batch(key) if key is not None else None
    if hit is not None:
        return hit
    if not filters:
        raise QueryError("no filters to compile")
    out = tuple(_request(filters, plan))
    if key is not None:
        plan.cache_batch(key, out)
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
