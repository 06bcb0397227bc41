"""The snapshot's stored user histories as canonical rows, looked up once per process.

`users.npz` stores each training user's items as item ids in time order (CSR: user_ids sorted,
offsets, item_ids). A `user_id` request needs them as rows twice: the user tower's recent items
(in time order) and the exclusions (each item once, newest first). Doing that per request cost a
search of every history id among the pool's ids plus a sort: 0.78 ms of a 1.63 ms batch-1
`recommend` for a user with 2,697 items (cProfile, MovieLens demo snapshot). Both are fixed per
user, so they are computed here for all users at once, on first use, and a request slices them.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import numpy as np

from silverrec.errors import QueryError


def newest_unique_grouped(rows: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of rows in time order (CSR: group g is rows[offsets[g]:offsets[g + 1]], int64; -1
    entries skipped) -> (each group's rows once, newest occurrence first, int64; their offsets
    [G + 1]). One pass for every group: the stored users at once, or a request batch's histories.

    Each group is read newest first (a mirror of its positions), so a row's first occurrence by
    (group, row) key in that order is its newest: one stable sort of the keys (np.unique's) finds
    them, and a mask over the mirrored positions keeps them in order, without a second sort."""
    rows = np.asarray(rows, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    G = len(offsets) - 1
    owner = np.repeat(np.arange(G, dtype=np.int64), np.diff(offsets))
    mirror = offsets[:-1][owner] + offsets[1:][owner] - 1 - np.arange(rows.size)  # newest first per group
    rev = rows[mirror]
    n = np.int64(max(int(rows.max(initial=-1)) + 1, 1))
    valid = np.flatnonzero(rev >= 0)
    _, first = np.unique(owner[valid] * n + rev[valid], return_index=True)  # the first (newest) of each key
    keep = np.zeros(rows.size, dtype=bool)
    keep[valid[first]] = True
    newest_off = np.zeros(G + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner[keep], minlength=G), out=newest_off[1:])
    return rev[keep], newest_off


def newest_unique(rows: np.ndarray) -> np.ndarray:
    """Rows in time order -> each row once, newest occurrence first (int64)."""
    return newest_unique_grouped(rows, np.array([0, len(rows)]))[0]


class UserHistories:
    """Per-user rows of the stored histories (time order) and their exclusion order (unique, newest
    first), CSR over the users of `users.npz`.

    Args:
        users: {"user_ids" int64 [U] sorted, "offsets" int64 [U + 1], "item_ids" int64 [I]}.
        to_rows: item ids int64 [I] -> rows int64 [I], -1 where an id is not in the pool (an item
            deleted by an update since the histories were stored).
        raise_unknown: called with (item ids, where) for a history holding an id not in the pool:
            raises the predictor's QueryError naming it (the same error as before the lookup was cached).
    """

    def __init__(self, users: Mapping[str, np.ndarray], to_rows: Callable[[np.ndarray], np.ndarray],
                 raise_unknown: Callable[[np.ndarray, str], None]):
        self.user_ids = np.asarray(users["user_ids"], dtype=np.int64)
        self.offsets = np.asarray(users["offsets"], dtype=np.int64)
        self.item_ids = np.asarray(users["item_ids"], dtype=np.int64)
        self._to_rows = to_rows
        self._raise_unknown = raise_unknown
        self._built: Optional[tuple] = None

    def index(self, user_id: int, where: str) -> int:
        """The user's position; QueryError for a user the snapshot does not store."""
        i = int(np.searchsorted(self.user_ids, user_id))
        if i >= len(self.user_ids) or int(self.user_ids[i]) != int(user_id):
            raise QueryError(f"{where}: unknown user_id {user_id}: not a user of the snapshot's training logs")
        return i

    def ids(self, user_id: int, where: str) -> np.ndarray:
        """The user's item ids in time order (as stored)."""
        i = self.index(user_id, where)
        return self.item_ids[self.offsets[i]:self.offsets[i + 1]]

    def rows(self, user_id: int, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(rows in time order, rows once each newest first) of the user: int64 views, not copies."""
        rows, bad, newest, newest_off = self._build()
        i = self.index(user_id, where)
        if bad[i]:
            self._raise_unknown(self.item_ids[self.offsets[i]:self.offsets[i + 1]], where)
        return rows[self.offsets[i]:self.offsets[i + 1]], newest[newest_off[i]:newest_off[i + 1]]

    def _build(self) -> tuple:
        """All users at once: rows, users with an unknown item, newest-first unique rows and offsets."""
        if self._built is not None:
            return self._built
        U = len(self.user_ids)
        rows = self._to_rows(self.item_ids)
        owner = np.repeat(np.arange(U, dtype=np.int64), np.diff(self.offsets))
        bad = np.zeros(U, dtype=bool)
        bad[owner[rows < 0]] = True
        newest, newest_off = newest_unique_grouped(rows, self.offsets)
        self._built = (rows, bad, newest, newest_off)
        return self._built
