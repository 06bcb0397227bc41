"""The predictor's host-side lookups against plain walks: UserHistories and newest_unique_grouped
(silverrec/serving/histories.py: the stored histories as rows, computed for every user at once, and
a batch's sent histories newest first), ItemRows (silverrec/retrieval/item_ids.py: item id -> row,
dense table or binary search)."""

import numpy as np
import pytest

from silverrec.errors import QueryError
from silverrec.retrieval.item_ids import ItemRows
from silverrec.serving.histories import UserHistories, newest_unique, newest_unique_grouped


def _store(seed=0, users=40, pool=60):
    rng = np.random.default_rng(seed)
    item_ids = rng.permutation(np.arange(1000, 1000 + 3 * pool))[:pool]  # the pool's ids
    row_of = {int(i): r for r, i in enumerate(rng.permutation(item_ids))}  # id -> canonical row
    lengths = rng.integers(0, 30, users)
    lengths[3] = 0
    hist = [rng.choice(item_ids, n) for n in lengths]  # repeats on purpose
    store = {"user_ids": np.sort(rng.choice(10_000, users, replace=False)).astype(np.int64),
             "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
             "item_ids": np.concatenate(hist).astype(np.int64)}
    return store, row_of, hist


def _to_rows(row_of):
    return lambda ids: np.asarray([row_of.get(int(i), -1) for i in ids], dtype=np.int64)


def _refuse(ids, where):
    bad = next(int(i) for i in ids if int(i) < 0)
    raise QueryError(f"{where}: unknown item id {bad}")


def test_rows_and_newest_first_exclusions_equal_a_walk():
    store, row_of, hist = _store()
    h = UserHistories(store, _to_rows(row_of), _refuse)
    for u, items in zip(store["user_ids"], hist):
        rows, newest = h.rows(int(u), "test")
        assert rows.tolist() == [row_of[int(i)] for i in items]
        want = []
        for i in reversed(items.tolist()):
            if row_of[i] not in want:
                want.append(row_of[i])
        assert newest.tolist() == want
        assert newest.tolist() == newest_unique(rows).tolist()
        assert h.ids(int(u), "test").tolist() == items.tolist()


def test_unknown_user_and_an_item_no_longer_in_the_pool_are_named_errors():
    store, row_of, hist = _store(seed=1)
    gone = int(hist[5][0])
    del row_of[gone]  # deleted from the pool by an update after the histories were stored
    store["item_ids"] = np.where(store["item_ids"] == gone, -7, store["item_ids"])  # the id the refusal sees
    h = UserHistories(store, _to_rows(row_of), _refuse)
    with pytest.raises(QueryError, match="request 2: unknown item id -7"):
        h.rows(int(store["user_ids"][5]), "request 2")
    with pytest.raises(QueryError, match="unknown user_id 10001"):
        h.rows(10_001, "request 0")
    others = [u for j, u in enumerate(store["user_ids"]) if all(int(i) != -7 for i in store["item_ids"][store["offsets"][j]:store["offsets"][j + 1]])]
    assert len(h.rows(int(others[0]), "request 0")[0]) >= 0  # users without the deleted item still answer


def test_newest_unique_grouped_equals_a_walk():
    """Groups with repeats, -1 entries and empty groups: each group's rows once, newest first."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(0, 25, 30)
    lengths[[0, 7, 29]] = 0
    rows = rng.integers(-1, 12, int(lengths.sum()))  # a small row space: many repeats; -1 skipped
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    got, got_off = newest_unique_grouped(rows, offsets)
    for g in range(len(lengths)):
        want = []
        for r in reversed(rows[offsets[g]:offsets[g + 1]].tolist()):
            if r >= 0 and r not in want:
                want.append(r)
        assert got[got_off[g]:got_off[g + 1]].tolist() == want, g
    assert newest_unique_grouped(np.zeros(0, np.int64), np.zeros(1, np.int64))[0].size == 0


@pytest.mark.parametrize("ids", [np.arange(50, 5000, 7), np.array([3, 2**40, 17, 2**62]), np.array([-5, 0, 9])])
def test_item_rows_equal_a_dict(ids):
    """Compact ids (a dense table), sparse ones (binary search), negative ones: rows of known ids,
    -1 for unknown, negative and out-of-range ones."""
    rng = np.random.default_rng(1)
    ids = rng.permutation(ids).astype(np.int64)
    lookup = ItemRows(ids)
    assert (lookup.table is not None) == (ids.min() >= 0 and ids.max() < 2**20)
    row_of = {int(i): r for r, i in enumerate(ids)}
    queries = np.concatenate([ids, rng.choice(ids, 20), [-1, -2**40, int(ids.max()) + 1, int(ids.max()) + 2, 2**62 + 1, 4]])
    got = lookup.rows_or_minus_one(queries.astype(np.int64))
    assert got.dtype == np.int64
    assert got.tolist() == [row_of.get(int(q), -1) for q in queries]


def test_native_lookup_ids_equals_item_rows():
    """kernels/csrc/encode.cpp `lookup_ids` (the predictor's C++ lookup of sent histories) == ItemRows'
    numpy lookup, list by list; the first list with an unknown id is reported."""
    from silverrec.kernels.library import lookup_ids
    rng = np.random.default_rng(2)
    ids = rng.permutation(np.arange(10, 4000, 3)).astype(np.int64)
    lookup = ItemRows(ids)
    lists = [rng.choice(ids, 7).tolist(), [], rng.choice(ids, 30).tolist()]
    rows, off, bad = lookup_ids(lists, lookup.torch_table)
    assert bad == -1 and off.tolist() == [0, 7, 7, 37]
    assert rows.tolist() == lookup.rows_or_minus_one(np.asarray(sum(lists, []), dtype=np.int64)).tolist()
    for unknown in (11, -1, 3998 + 3, 2**62):
        _, _, bad = lookup_ids([lists[0], [int(ids[0]), unknown], [unknown]], lookup.torch_table)
        assert bad == 1, unknown
