"""Generic interaction logs: read and validate them, order each user's interactions in time, split.

Input files (Parquet, read with pyarrow), the same for every data set (nothing here knows MovieLens):

- ``interactions.parquet``: ``user_id`` int64, ``item_id`` int64, ``timestamp`` int64, and any number
  of numeric label columns (float, int or bool, e.g. ``rating``) that later define tasks.
- ``items.parquet``: ``item_id`` int64, unique: the item pool, in file order ("pool rows" are
  positions in it). Categorical feature columns (string or list<string>) and numeric ones (float or
  int). An ``embedding`` column (a publish input) is ignored here.
- ``users.parquet`` (optional): ``user_id`` int64, unique, plus categorical or numeric user features.

Every problem raises :class:`silverrec.errors.PoolError` naming the file, the column and the first
offending row or value, e.g. ``interactions.parquet row 17: item_id 999 is not in items.parquet``.

Time order (docs/architecture.md, "Evaluation", trap 1): interactions are sorted by (user, timestamp) and
timestamp ties are broken by a seeded random shuffle, never by file order or item id. MovieLens
lists same-second ratings by ascending item id; a sequential model trained on that order learns
the id order instead of the user.

The leave-one-out split (:func:`leave_one_out`) holds out each user's last interaction for test and
the one before it for validation; users with fewer than 3 interactions are train-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from silverrec.errors import PoolError

STAGES = ("valid", "test")
_IGNORED_ITEM_COLUMNS = ("embedding",)


@dataclass
class Logs:
    """Validated interaction logs, grouped per user in time order (CSR).

    Pool rows index ``item_ids``; user indices index ``user_ids``.
    """

    item_ids: np.ndarray  # int64 [N], the pool in items.parquet order
    item_features: dict[str, list[list[str]]]  # categorical, per pool row; [] = no value
    item_numeric: dict[str, np.ndarray]  # float32 [N] per numeric item column
    user_ids: np.ndarray  # int64 [U] ascending: every user with >= 1 interaction
    offsets: np.ndarray  # int64 [U + 1]: user u's interactions are [offsets[u], offsets[u + 1])
    items: np.ndarray  # int64 [E] pool row of each interaction, per user in time order
    timestamps: np.ndarray  # int64 [E]
    labels: dict[str, np.ndarray] = field(default_factory=dict)  # float32 [E] per label column
    user_features: dict[str, list[list[str]]] = field(default_factory=dict)  # per user index
    user_numeric: dict[str, np.ndarray] = field(default_factory=dict)  # float32 [U], missing users 0

    @property
    def num_items(self) -> int:
        return int(self.item_ids.shape[0])

    @property
    def num_users(self) -> int:
        return int(self.user_ids.shape[0])

    def user_items(self, u: int) -> np.ndarray:
        """Pool rows int64 of user index ``u``'s interactions, oldest first."""
        return self.items[self.offsets[u] : self.offsets[u + 1]]


# ----------------------------------------------------------------------------------------------
# Reading


def read_logs(
    interactions: str | Path,
    items: str | Path,
    users: str | Path | None = None,
    *,
    seed: int = 0,
) -> Logs:
    """Read and validate ``interactions.parquet``, ``items.parquet`` and optional ``users.parquet``.

    Args:
        interactions, items, users: Parquet file paths (messages name them by file name).
        seed: seeds the shuffle that breaks timestamp ties inside a user's history.

    Returns:
        :class:`Logs`.

    Raises:
        PoolError: a missing/unreadable/empty file, a missing column, a wrong type, a null, a
        duplicate id, an interaction with an item not in the pool, a NaN/Inf label, ...
    """
    inter_t, inter_name = _read_table(interactions)
    items_t, items_name = _read_table(items)
    users_t, users_name = _read_table(users) if users is not None else (None, "users.parquet")
    return _build(inter_t, items_t, users_t, (inter_name, items_name, users_name), seed)


def logs_from_arrays(
    item_ids,
    item_features: dict[str, list] | None,
    user_id,
    item_id,
    timestamp,
    labels: dict[str, object] | None = None,
    *,
    item_numeric: dict[str, object] | None = None,
    user_table: pa.Table | dict[str, object] | None = None,
    seed: int = 0,
) -> Logs:
    """The same as :func:`read_logs`, from in-memory columns (tests, demos).

    Args:
        item_ids: int64 [N] pool item ids. item_features: name -> per-row str or list[str].
        user_id, item_id, timestamp: int64 [E] interaction columns. labels: name -> numeric [E].
        item_numeric: name -> numeric [N]. user_table: columns (``user_id`` + features) as a dict
            or a pyarrow Table, like users.parquet.
        seed: as in :func:`read_logs`.

    Columns go through ``pyarrow.array`` so wrong types are caught exactly as in files; messages
    name the sources "interactions", "items" and "users".
    """
    items_cols = {"item_id": _arrow(item_ids)}
    for name, values in (item_features or {}).items():
        items_cols[name] = _arrow(values)
    for name, values in (item_numeric or {}).items():
        items_cols[name] = _arrow(values)
    inter_cols = {"user_id": _arrow(user_id), "item_id": _arrow(item_id), "timestamp": _arrow(timestamp)}
    for name, values in (labels or {}).items():
        inter_cols[name] = _arrow(values)
    users_t = None
    if user_table is not None:
        users_t = user_table
        if not isinstance(user_table, pa.Table):
            users_t = pa.table({k: _arrow(v) for k, v in user_table.items()})
    return _build(pa.table(inter_cols), pa.table(items_cols), users_t, ("interactions", "items", "users"), seed)


def _arrow(values) -> pa.Array:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values
    if isinstance(values, np.ndarray):
        return pa.array(values)
    return pa.array(list(values))


def _read_table(path: str | Path) -> tuple[pa.Table, str]:
    path = Path(path)
    if not path.is_file():
        raise PoolError(f"{path} does not exist")
    try:
        return pq.read_table(path), path.name
    except (pa.ArrowInvalid, OSError) as e:
        raise PoolError(f"cannot read {path} as Parquet: {e}") from None


def _build(inter: pa.Table, items: pa.Table, users: pa.Table | None, names: tuple[str, str, str], seed: int) -> Logs:
    inter_name, items_name, users_name = names

    # --- items: the pool
    _require(items, ("item_id",), items_name)
    item_ids = _int_column(items, "item_id", items_name)
    _check_unique(item_ids, items_name, "item_id")
    item_features, item_numeric = _feature_columns(items, items_name, "item_id", _IGNORED_ITEM_COLUMNS)

    # --- interactions
    _require(inter, ("user_id", "item_id", "timestamp"), inter_name)
    uid = _int_column(inter, "user_id", inter_name)
    iid = _int_column(inter, "item_id", inter_name)
    ts = _int_column(inter, "timestamp", inter_name)
    labels = {}
    for name in inter.column_names:
        if name in ("user_id", "item_id", "timestamp"):
            continue
        if not _is_numeric(inter.schema.field(name).type):
            raise PoolError(
                f"{inter_name} column {name!r} must be numeric (a label: float, int or bool), "
                f"got {inter.schema.field(name).type}"
            )
        labels[name] = _numeric_column(inter, name, inter_name)
    rows = _pool_rows(item_ids, iid, inter_name, items_name)

    # --- per-user time order, ties shuffled with the seed
    user_ids, uidx = np.unique(uid, return_inverse=True)
    uidx = uidx.reshape(-1).astype(np.int64)
    tie = np.random.default_rng(seed).permutation(len(uid))
    order = np.lexsort((tie, ts, uidx))
    offsets = np.zeros(len(user_ids) + 1, dtype=np.int64)
    np.cumsum(np.bincount(uidx, minlength=len(user_ids)), out=offsets[1:])

    # --- users (optional)
    user_features, user_numeric = {}, {}
    if users is not None:
        user_features, user_numeric = _user_columns(users, users_name, user_ids)

    return Logs(
        item_ids=item_ids,
        item_features=item_features,
        item_numeric=item_numeric,
        user_ids=user_ids.astype(np.int64),
        offsets=offsets,
        items=rows[order],
        timestamps=ts[order],
        labels={k: v[order] for k, v in labels.items()},
        user_features=user_features,
        user_numeric=user_numeric,
    )


def _user_columns(users: pa.Table, name: str, user_ids: np.ndarray):
    """Per user index (``user_ids`` order) features; users absent from the table get [] / 0."""
    _require(users, ("user_id",), name)
    ids = _int_column(users, "user_id", name)
    _check_unique(ids, name, "user_id")
    cat, num = _feature_columns(users, name, "user_id", ())
    sorter = np.argsort(ids, kind="stable")
    pos = np.minimum(np.searchsorted(ids[sorter], user_ids), len(ids) - 1)
    found = ids[sorter][pos] == user_ids
    src = np.where(found, sorter[pos], -1)  # row of users.parquet per user index, -1 = absent
    features = {k: [list(v[r]) if r >= 0 else [] for r in src] for k, v in cat.items()}
    numeric = {k: np.where(found, v[np.maximum(src, 0)], 0).astype(np.float32) for k, v in num.items()}
    return features, numeric


# ----------------------------------------------------------------------------------------------
# Column checks


def _require(table: pa.Table, columns: tuple[str, ...], name: str) -> None:
    for col in columns:
        if col not in table.column_names:
            raise PoolError(f"{name} has no column {col!r} (columns: {table.column_names})")
    if table.num_rows == 0:
        raise PoolError(f"{name} is empty: it has no rows")


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _nulls(col: pa.ChunkedArray) -> np.ndarray:
    return col.is_null().to_numpy(zero_copy_only=False)


def _int_column(table: pa.Table, col: str, name: str) -> np.ndarray:
    """An integer id/time column as int64 [rows]; rejects other types and nulls."""
    c = table.column(col)
    if not pa.types.is_integer(c.type):
        raise PoolError(f"{name} column {col!r} must be int64, got {c.type}")
    if c.null_count:
        raise PoolError(f"{name} row {_first(_nulls(c))}: column {col!r} is null")
    values = c.to_numpy()
    if pa.types.is_uint64(c.type) and values.size and values.max() > np.iinfo(np.int64).max:
        raise PoolError(f"{name} row {_first(values > np.iinfo(np.int64).max)}: {col} {values.max()} exceeds int64")
    return values.astype(np.int64)


def _check_unique(ids: np.ndarray, name: str, col: str) -> None:
    order = np.argsort(ids, kind="stable")
    dup = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if dup.size:
        first, second = sorted(int(r) for r in order[dup[0] : dup[0] + 2])
        raise PoolError(f"{name} row {second}: {col} {int(ids[second])} is duplicated (first at row {first})")


def _is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_categorical(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        v = t.value_type
        return pa.types.is_string(v) or pa.types.is_large_string(v) or pa.types.is_null(v)
    return False


def _numeric_column(table: pa.Table, col: str, name: str) -> np.ndarray:
    """A numeric column as float32 [rows]: no nulls, finite (also after the cast to float32)."""
    c = table.column(col)
    if c.null_count:
        raise PoolError(f"{name} row {_first(_nulls(c))}: column {col!r} is null")
    raw = c.to_numpy()
    with np.errstate(over="ignore"):
        values = raw.astype(np.float32)
    bad = ~np.isfinite(values)
    if bad.any():
        row = _first(bad)
        raise PoolError(f"{name} row {row}: column {col!r} is {raw[row].item()!r}, not a finite float32")
    return values


def _categorical_column(table: pa.Table, col: str, name: str) -> list[list[str]]:
    out = []
    for row, v in enumerate(table.column(col).to_pylist()):
        if v is None:
            out.append([])
        elif isinstance(v, str):
            out.append([v])
        elif any(x is None for x in v):
            raise PoolError(f"{name} row {row}: column {col!r} has a null inside its list")
        else:
            out.append(list(v))
    return out


def _feature_columns(table: pa.Table, name: str, key: str, ignore: tuple[str, ...]):
    """(categorical name -> list[list[str]], numeric name -> float32) for every non-key column."""
    cat, num = {}, {}
    for col in table.column_names:
        if col == key or col in ignore:
            continue
        t = table.schema.field(col).type
        if _is_categorical(t):
            cat[col] = _categorical_column(table, col, name)
        elif _is_numeric(t):
            num[col] = _numeric_column(table, col, name)
        else:
            raise PoolError(f"{name} column {col!r} must be string, list<string> or numeric, got {t}")
    return cat, num


def _pool_rows(item_ids: np.ndarray, iid: np.ndarray, inter_name: str, items_name: str) -> np.ndarray:
    """Pool row int64 of each interaction's item id; an id not in the pool is an error."""
    sorter = np.argsort(item_ids, kind="stable")
    sorted_ids = item_ids[sorter]
    pos = np.minimum(np.searchsorted(sorted_ids, iid), len(sorted_ids) - 1)
    missing = sorted_ids[pos] != iid
    if missing.any():
        row = _first(missing)
        raise PoolError(
            f"{inter_name} row {row}: item_id {int(iid[row])} is not in {items_name} "
            f"({int(missing.sum())} interactions affected)"
        )
    return sorter[pos].astype(np.int64)


# ----------------------------------------------------------------------------------------------
# Leave-one-out split


@dataclass
class Split:
    """Leave-one-out by time over :class:`Logs`.

    ``eval_users`` (users with >= 3 interactions) have their last interaction as the test item and
    the one before it as the validation item; every other user is train-only. "History" at a stage
    is what a model may see: at "valid" the train part, at "test" the train part + the validation
    item (the protocol refits on train + valid before test). Train-only users' histories are all
    of their interactions at both stages.
    """

    logs: Logs
    train_end: np.ndarray  # int64 [U]: train interactions of u are [offsets[u], train_end[u])
    eval_users: np.ndarray  # int64 [U'] user indices with >= 3 interactions
    valid_items: np.ndarray  # int64 [U'] pool row of each eval user's second-to-last interaction
    test_items: np.ndarray  # int64 [U'] pool row of the last interaction
    _ends: dict[str, np.ndarray] = field(init=False, repr=False)

    def __post_init__(self):
        test_end = self.train_end.copy()
        test_end[self.eval_users] += 1
        self._ends = {"valid": self.train_end, "test": test_end}

    def history_end(self, stage: str) -> np.ndarray:
        """int64 [U]: user u's history at ``stage`` is interactions [offsets[u], end[u])."""
        if stage not in self._ends:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        return self._ends[stage]

    def history(self, u: int, stage: str) -> np.ndarray:
        """Pool rows int64 the model may see for user index ``u`` at ``stage``, oldest first."""
        end = self.history_end(stage)
        return self.logs.items[self.logs.offsets[u] : end[u]]

    def histories(self, users: np.ndarray, stage: str) -> list[np.ndarray]:
        """:meth:`history` of each user index in ``users``."""
        end, off, items = self.history_end(stage), self.logs.offsets, self.logs.items
        return [items[off[u] : end[u]] for u in np.asarray(users, dtype=np.int64)]

    def targets(self, stage: str) -> np.ndarray:
        """int64 [U']: the held-out pool row of each eval user at ``stage``."""
        self.history_end(stage)
        return self.valid_items if stage == "valid" else self.test_items

    def known(self, stage: str) -> list[np.ndarray]:
        """Per eval user, the sorted unique pool rows of its history at ``stage``: masked at ranking
        (the ranking never masks the target itself, see evaluate.target_ranks)."""
        return [np.unique(h) for h in self.histories(self.eval_users, stage)]

    def history_csr(self, stage: str) -> tuple[np.ndarray, np.ndarray]:
        """Every user's history at ``stage`` as CSR: (offsets int64 [U + 1], pool rows int64 [nnz]).

        This is the training data of a model evaluated at ``stage`` (train-only users included).
        """
        end, off = self.history_end(stage), self.logs.offsets
        lengths = end - off[:-1]
        new_off = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=new_off[1:])
        # entry i of user u's slice comes from logs position off[u] + (i - new_off[u])
        pos = np.repeat(off[:-1] - new_off[:-1], lengths) + np.arange(new_off[-1])
        return new_off, self.logs.items[pos]


def leave_one_out(logs: Logs) -> Split:
    """Hold out each user's last interaction (test) and the one before it (validation).

    Users with fewer than 3 interactions are train-only (``train_end[u] = offsets[u + 1]``), so
    every eval user keeps at least one training interaction.
    """
    off = logs.offsets
    counts = np.diff(off)
    eval_users = np.flatnonzero(counts >= 3).astype(np.int64)
    train_end = off[1:].copy()
    train_end[eval_users] -= 2
    last = off[eval_users + 1] - 1
    return Split(
        logs=logs,
        train_end=train_end,
        eval_users=eval_users,
        valid_items=logs.items[last - 1].copy(),
        test_items=logs.items[last].copy(),
    )
