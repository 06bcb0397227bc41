"""UserHistories (silverrec/serving/histories.py): the stored histories as rows, computed for every
user at once, against a plain walk of each user's items."""

import numpy as np
import pytest

from silverrec.errors import QueryError
from silverrec.serving.histories import UserHistories, newest_unique


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
