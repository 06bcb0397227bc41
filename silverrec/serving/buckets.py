"""Request shapes padded to a small closed set, so that a forward on a device replays a CUDA graph.

A CUDA graph replays one shape (silverrec/serving/cuda_graphs.py). A server's requests vary in every
dimension the forward sees: the batch, each request's feature values (a jagged KJT), its history,
its exclusions, its filter program, k. `BucketedForward` pads every call of a snapshot's root
forward before it reaches the device, so that the shapes form a small closed set captured once each
(at load by `warm_up`, or on first use) and replayed from then on:

- batch B: rows up to the next power of two, plus one padding row for a recommendation forward (it
  holds the jagged padding, below): the extra rows are inert (no features, no history, excluded
  nothing, unfiltered, the ANN source alone) and dropped from the answer;
- the KJT's values: `row_values` per row (a power of two, at least the batch's longest row),
  the surplus given to the padding row's first feature, so that values and lengths still agree
  (a team's tower may rely on nnz == sum(lengths));
- exclusions E and history length H: powers of EXCLUDE_BASE from MIN_EXCLUDE, powers of two from
  MIN_HISTORY (-1 padding: no row); filter programs: length L, operand width T and posting-list
  count T2 to powers of two (NOP instructions, the first operand repeated, NO_LIST);
- k: the next value of the 1-2-5 series (10, 20, 50, 100, 200, ...), at most the snapshot's
  largest k and k0, cut back to the request's k after the forward; k0 is taken as it is (a
  recommendation's k0 changes its candidates);
- nprobe and max_probe: the next power of two, at most nlist (the calibrated depth follows each
  batch's filters, so it takes many values): a padded search probes at least as deep.

The answer is the unpadded forward's for the same request: integer outputs equal, rows cut back
(tests/test_buckets.py). A search with a padded k or probe depth probes at least as deep: its answer
is at least as complete. On the CPU (device "cpu") nothing is padded: without graphs the
padding would only cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from silverrec.kernels.constants import MODE_PROBED, NO_LIST, NO_LISTS, NO_ROW, OP_NOP, OP_TRUE

MIN_PROGRAM = 8  # filter program length bucket floor (a filter of a few terms fits without a new shape)
MIN_OPERANDS = 4  # the AND of up to 4 bank rows per PUSH: an unfiltered and a filtered batch share a shape
MIN_LISTS = 2
MIN_EXCLUDE = 64
EXCLUDE_BASE = 4  # exclusions grow with a user's history: coarse buckets keep the shapes few
MIN_HISTORY = 16
MIN_ITEMS = 16  # items a rank call scores, bucket floor
ROW_VALUES = 256  # KJT values per request row before the bucket grows (history_len 50, ~2 features an item)
DEFAULT_WARM_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def ceil_pow(n: int, base: int = 2, minimum: int = 1) -> int:
    """The least minimum * base**j >= n."""
    out = max(1, int(minimum))
    while out < n:
        out *= base
    return out


def k_bucket(k: int) -> int:
    """The least value of the 1-2-5 series (1, 2, 5, 10, 20, 50, ...) >= k."""
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale >= k:
                return m * scale
        scale *= 10


@dataclass(frozen=True)
class Buckets:
    """The padding rules (module docstring) and the warm-up at load.

    warm_batches: batch sizes captured at load (`warm_up`), each at the snapshot's default k; () = none.
    warm_ks: other k captured at load beside the default.
    warm_histories: a recommendation snapshot's history lengths captured at load (their exclusion buckets).
    row_values: KJT values per request row before its bucket grows.
    max_graphs: CUDA graphs kept (each holds its memory pool): the closed set of shapes must fit.
    """

    warm_batches: tuple[int, ...] = DEFAULT_WARM_BATCHES
    warm_ks: tuple[int, ...] = ()
    warm_histories: tuple[int, ...] = (1, MIN_EXCLUDE + 1)
    row_values: int = ROW_VALUES
    max_graphs: int = 64

    @classmethod
    def coerce(cls, value: "Buckets | bool | None | dict") -> Optional["Buckets"]:
        """load()'s `buckets` argument: True / None = the defaults, False = no padding, a dict = the fields."""
        if value is None or value is True:
            return cls()
        if value is False:
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown bucket settings {sorted(unknown)}: use {sorted(cls.__dataclass_fields__)}")
            value = dict(value)
            for name in ("warm_batches", "warm_ks", "warm_histories"):
                if name in value:
                    value[name] = tuple(int(x) for x in value[name])
            return cls(**value)
        raise TypeError(f"buckets must be True, False, None, a dict or a Buckets, got {type(value).__name__}")


def pad_rows(x: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """x [B, ...] -> [rows, ...], the new rows `fill`."""
    if x.shape[0] == rows:
        return x
    out = x.new_full((rows, *x.shape[1:]), fill)
    out[: x.shape[0]] = x
    return out


def pad_dim1(x: torch.Tensor, size: int, fill, left: bool = False) -> torch.Tensor:
    """x [B, n, ...] -> [B, size, ...], the new columns `fill` (on the left with `left`)."""
    n = x.shape[1]
    if n == size:
        return x
    out = x.new_full((x.shape[0], size, *x.shape[2:]), fill)
    if left:
        out[:, size - n:] = x
    else:
        out[:, :n] = x
    return out


def pad_program(ops, rows, vops, vrows, lists, batch: int) -> tuple[torch.Tensor, ...]:
    """The B filter programs (filter_program.compile_request) in `batch` rows, lengths to their buckets;
    the new rows unfiltered (TRUE, no posting lists)."""
    L = ceil_pow(max(ops.shape[1], vops.shape[1]), 2, MIN_PROGRAM)
    T = ceil_pow(max(rows.shape[2], vrows.shape[2]), 2, MIN_OPERANDS)
    out = []
    for o, r in ((ops, rows), (vops, vrows)):
        o = pad_rows(pad_dim1(o, L, OP_NOP), batch, OP_NOP)
        if batch > ops.shape[0]:  # (never written into a request's own tensors: they may be cached, or views)
            o[ops.shape[0]:, 0] = OP_TRUE
        if r.shape[2] < T:  # the first operand repeated: an AND of the same row
            r = torch.cat([r, r[:, :, :1].expand(-1, -1, T - r.shape[2])], dim=2)
        out += [o, pad_rows(pad_dim1(r, L, 0), batch, 0)]
    lists = pad_rows(pad_dim1(lists, ceil_pow(lists.shape[1], 2, MIN_LISTS), NO_LIST), batch, NO_LIST)
    if batch > ops.shape[0]:
        lists[ops.shape[0]:, 0] = NO_LISTS
    return (*out, lists)


def pad_features(values: torch.Tensor, lengths: torch.Tensor, dense: torch.Tensor, batch: int,
                 row_values: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A KJT of B rows (values int64 [nnz], lengths int32 [F * B] key-major, dense [B, Fd]) as `batch` rows
    (batch > B) with nnz = (batch - 1) * row bucket: the new rows are empty but the last, whose first
    feature holds the surplus values (zeros)."""
    B = dense.shape[0]
    F = lengths.shape[0] // B if B else 0
    grid = lengths.reshape(F, B)
    per_row = int(grid.sum(0).max()) if B and F else 0
    nnz = (batch - 1) * ceil_pow(per_row, 2, row_values)
    padded = grid.new_zeros(F, batch)
    padded[:, :B] = grid
    if not F:
        return values, padded.reshape(-1), pad_rows(dense, batch, 0)
    padded[0, batch - 1] = nnz - values.shape[0]
    end = int(grid[0].sum())  # key-major: the first key's bags, then the next key's
    values = torch.cat([values[:end], values.new_zeros(nnz - values.shape[0]), values[end:]])
    return values, padded.reshape(-1), pad_rows(dense, batch, 0)


@dataclass
class BucketedForward:
    """A snapshot's root forward `module(values, lengths, dense, exclude, ops, rows, vops, vrows, lists, mode,
    history, flags, k, k0, nprobe, max_probe)` called with every request shape padded to its bucket.

    search: a pure-ANN snapshot (dense = the queries; values and lengths are constants, not per row).
    max_k: the largest k the forward takes (the pool, or a recommendation's candidates ranked).
    max_history: the longest history the handler sends (None: unbounded).
    Counts: `calls` and `shapes` (the padded keys seen) beside the graphs' own counters.
    """

    module: Any
    buckets: Buckets
    search: bool
    max_k: int
    max_history: Optional[int] = None  # the history rows the handler sends at most (a decode's max_items)
    nlist: Optional[int] = None  # the IVF's clusters: nprobe and max_probe are padded up to it at most
    calls: int = 0
    shapes: set = field(default_factory=set)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["module"], name)

    def pad(self, args: Sequence[Any]) -> tuple[tuple, int, int]:
        """The padded arguments, the batch and the k to cut the outputs back to."""
        values, lengths, dense, exclude, ops, rows, vops, vrows, lists, mode = args[:10]
        extra, (k, k0, nprobe, max_probe) = args[10:-4], args[-4:]
        B = dense.shape[0]
        kb = min(k_bucket(k), self.max_k) if self.search else min(k_bucket(k), self.max_k, k0)
        k0 = kb if self.search else k0
        if self.search:
            batch = ceil_pow(B)
        else:
            batch = ceil_pow(B) + 1
            values, lengths, dense = pad_features(values, lengths, dense, batch, self.buckets.row_values)
        dense = pad_rows(dense, batch, 0)
        exclude = pad_rows(pad_dim1(exclude, ceil_pow(exclude.shape[1], EXCLUDE_BASE, MIN_EXCLUDE), NO_ROW),
                           batch, NO_ROW)
        if extra:  # the decode's inputs: history rows [B, H] (-1 left padding; [B, 1]: none), sources bool [B, 2]
            history, flags = extra
            H = history.shape[1]
            if H > 1:  # no longer than the handler sends (the decoder reads no more)
                history = pad_dim1(history, max(H, min(ceil_pow(H, 2, MIN_HISTORY), self.max_history or 1 << 30)),
                                   NO_ROW, left=True)
            if batch > B:
                flags = pad_rows(flags, batch, False)
                flags[B:, 0] = True  # padding rows search the ANN alone
            extra = (pad_rows(history, batch, NO_ROW), flags)
        program = pad_program(ops, rows, vops, vrows, lists, batch)
        mode = pad_rows(mode, batch, MODE_PROBED)
        if self.nlist:
            nprobe, max_probe = (min(ceil_pow(int(p)), self.nlist) for p in (nprobe, max_probe))
        padded = (values, lengths, dense, exclude, *program, mode, *extra, kb, k0, nprobe, max_probe)
        return padded, B, k

    def __call__(self, *args):
        padded, B, k = self.pad(args)
        self.calls += 1
        self.shapes.add(shape_key(padded))
        out = self.module(*padded)
        return tuple(o[:B, :k] if o.dim() >= 2 and o.shape[1] else o[:B] for o in out)


@dataclass
class BucketedRank:
    """The rank program `module(values, lengths, dense, rows int64 [B, C]) -> (value [B, C], task scores [B, C, T])`
    called with the user's KJT padded like `BucketedForward`'s and the C items to a power of two (at least
    MIN_ITEMS; row 0 repeated, cut back), except for a list-wise OverArch, whose items attend to each other."""

    module: Any
    buckets: Buckets
    listwise: bool = False
    calls: int = 0
    shapes: set = field(default_factory=set)

    def __call__(self, values, lengths, dense, rows):
        B, C = rows.shape
        batch = ceil_pow(B) + 1
        values, lengths, dense = pad_features(values, lengths, dense, batch, self.buckets.row_values)
        if not self.listwise:
            rows = pad_dim1(rows, ceil_pow(C, 2, MIN_ITEMS), 0)
        padded = (values, lengths, dense, pad_rows(rows, batch, 0))
        self.calls += 1
        self.shapes.add(shape_key(padded))
        return tuple(o[:B, :C] for o in self.module(*padded))


def shape_key(args: Sequence[Any]) -> tuple:
    """The shapes and non-tensor arguments of a call (what a graph is keyed by)."""
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)


def warm_up(snap, buckets: Buckets) -> int:
    """Run the snapshot's entry point once per warm batch size, k (and history length) -> forwards run: their
    shapes captured before the first request.

    A pure-ANN snapshot searches zero queries; a recommendation snapshot recommends for histories of its
    first items (unfiltered: the filter programs' buckets hold a filter of a few terms too)."""
    spec = snap.spec
    if spec is None or not buckets.warm_batches:
        return 0
    runs = 0
    ks = sorted({min(10, int(snap.manifest["item_count"])), *buckets.warm_ks})
    warm = warm_filter(snap) if spec.answers_search else None
    for B in buckets.warm_batches:
        for k in ks:
            if spec.answers_search:  # unfiltered (max_probe = nprobe), then with a filter (the default max_probe)
                queries = torch.zeros(B, int(snap.config["dim"]))
                snap.search(queries, k)
                runs += 1
                if warm is not None:
                    snap.search(queries, k, filter=[warm] + [None] * (B - 1))
                    runs += 1
                continue
            handler = snap.rec_handler()
            ids = [int(x) for x in handler.row_to_item]
            for n in buckets.warm_histories:
                handler.recommend([{"history": (ids * (n // len(ids) + 1))[:n]}] * B, k=k, threads=None)
                runs += 1
    return runs


def warm_filter(snap) -> Optional[str]:
    """A filter on the snapshot's first feature value (None without a filter vocabulary)."""
    from silverrec.retrieval.filtered_search import filter_plan

    for feature, values in filter_plan(snap).vocab.items():
        for value in values:
            return f"{feature} = '{value}'"
    return None


def max_k(manifest: dict[str, Any]) -> int:
    """The largest k a "rec" snapshot's forward takes (RecHandler.recommend's check): the pool for a pure-ANN
    search, else the candidates it ranks (the ANN's, or the pool) plus the decode's beams."""
    from silverrec.spec import ModelSpec

    cfg, n = manifest["config"], int(manifest["item_count"])
    spec = ModelSpec.from_json(cfg.get("spec"))
    if spec.answers_search:
        return n
    ranked = (spec.candidates or n) if "ann" in spec.sources else 0
    beams = int(cfg["generative"]["beam_width"]) if "generative" in spec.sources else 0
    return min(n, ranked + beams)
