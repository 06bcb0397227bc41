"""Generic interaction logs (publish/logs.py): reading, validation, seeded tie order, leave-one-out.

References are plain Python loops over the rows the test wrote, not the module's own arrays.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from silverrec.errors import PoolError
from silverrec.publish.logs import leave_one_out, logs_from_arrays, read_logs

# A small pool with every kind of item column: string, list<string>, numeric, and an ignored embedding.
ITEMS = {
    "item_id": pa.array([10, 20, 30, 40, 7, 99], type=pa.int64()),
    "color": pa.array(["red", None, "blue", "red", "green", "blue"]),
    "tags": pa.array([["a", "b"], [], None, ["c"], ["a"], ["b", "c"]], type=pa.list_(pa.string())),
    "price": pa.array([1.5, 2.0, 3.25, 0.0, 9.0, 4.0], type=pa.float64()),
    "embedding": pa.array([[0.1, 0.2]] * 6, type=pa.list_(pa.float32())),
}

# Interactions in a shuffled file order with distinct timestamps per user.
INTER_ROWS = [  # (user_id, item_id, timestamp, rating, clicked)
    (5, 30, 100, 4.0, 1),
    (2, 10, 50, 3.5, 0),
    (5, 10, 90, 2.0, 1),
    (2, 99, 10, 5.0, 1),
    (9, 7, 1, 1.0, 0),
    (5, 40, 300, 3.0, 0),
    (2, 20, 40, 1.5, 1),
    (5, 7, 200, 4.5, 1),
    (9, 20, 3, 2.5, 0),
]


def _inter_table(rows=INTER_ROWS) -> dict:
    u, i, t, r, c = zip(*rows)
    return {
        "user_id": pa.array(u, type=pa.int64()),
        "item_id": pa.array(i, type=pa.int64()),
        "timestamp": pa.array(t, type=pa.int64()),
        "rating": pa.array(r, type=pa.float32()),
        "clicked": pa.array(c, type=pa.int64()),
    }


USERS = {
    "user_id": pa.array([9, 2, 77], type=pa.int64()),  # user 5 is absent, 77 has no interactions
    "country": pa.array(["FR", "US", "DE"]),
    "age": pa.array([31, 45, 20], type=pa.int32()),
}


def _write(tmp_path, inter=None, items=None, users=None):
    paths = {}
    for name, cols in (
        ("interactions", _inter_table() if inter is None else inter),
        ("items", ITEMS if items is None else items),
        ("users", users),
    ):
        if cols is None:
            continue
        paths[name] = tmp_path / f"{name}.parquet"
        table = cols if isinstance(cols, pa.Table) else pa.table(cols)
        pq.write_table(table, paths[name])
    return paths


def test_round_trip_from_parquet(tmp_path):
    p = _write(tmp_path, users=USERS)
    logs = read_logs(p["interactions"], p["items"], p["users"], seed=3)

    assert logs.item_ids.dtype == np.int64 and logs.item_ids.tolist() == [10, 20, 30, 40, 7, 99]
    assert set(logs.item_features) == {"color", "tags"}  # embedding ignored, price is numeric
    assert logs.item_features["color"] == [["red"], [], ["blue"], ["red"], ["green"], ["blue"]]
    assert logs.item_features["tags"] == [["a", "b"], [], [], ["c"], ["a"], ["b", "c"]]
    assert set(logs.item_numeric) == {"price"}
    assert logs.item_numeric["price"].dtype == np.float32
    assert logs.item_numeric["price"].tolist() == [1.5, 2.0, 3.25, 0.0, 9.0, 4.0]

    assert logs.user_ids.tolist() == [2, 5, 9]
    pool_row = {10: 0, 20: 1, 30: 2, 40: 3, 7: 4, 99: 5}
    for u, uid in enumerate([2, 5, 9]):
        expected = sorted((t, i, r, c) for (uu, i, t, r, c) in INTER_ROWS if uu == uid)
        sl = slice(logs.offsets[u], logs.offsets[u + 1])
        assert logs.items[sl].tolist() == [pool_row[i] for _, i, _, _ in expected]
        assert logs.timestamps[sl].tolist() == [t for t, _, _, _ in expected]
        assert logs.labels["rating"][sl].tolist() == [r for _, _, r, _ in expected]
        assert logs.labels["clicked"][sl].tolist() == [c for _, _, _, c in expected]
    assert logs.offsets.tolist() == [0, 3, 7, 9]
    assert logs.labels["rating"].dtype == np.float32 and logs.labels["clicked"].dtype == np.float32

    # users.parquet: per user index; user 5 is absent (-> [] and 0), user 77 has no interactions
    assert logs.user_features == {"country": [["US"], [], ["FR"]]}
    assert logs.user_numeric["age"].tolist() == [45.0, 0.0, 31.0]
    assert logs.user_numeric["age"].dtype == np.float32


def test_without_users_file(tmp_path):
    p = _write(tmp_path)
    logs = read_logs(p["interactions"], p["items"])
    assert logs.user_features == {} and logs.user_numeric == {}


def _same_second(n_users: int, per_user: int, seed: int):
    """n_users users, each with per_user interactions in one second, listed by ascending item id."""
    item_ids = np.arange(per_user, dtype=np.int64)
    user = np.repeat(np.arange(n_users, dtype=np.int64), per_user)
    item = np.tile(item_ids, n_users)
    return logs_from_arrays(item_ids, {}, user, item, np.full(len(user), 1_000, dtype=np.int64), seed=seed)


def test_ties_are_shuffled_with_the_seed_not_by_item_id():
    a, b, c = _same_second(3, 200, 0), _same_second(3, 200, 0), _same_second(3, 200, 1)
    np.testing.assert_array_equal(a.items, b.items)  # reproducible
    assert not np.array_equal(a.items, c.items)  # another seed, another order
    for u in range(3):
        seq = a.user_items(u)
        assert sorted(seq.tolist()) == list(range(200))  # a permutation of the user's items...
        assert not np.array_equal(seq, np.sort(seq))  # ...not in item-id (= file) order
        assert not np.array_equal(seq, np.sort(seq)[::-1])


def test_tie_break_is_a_fair_coin():
    # 2000 users with two same-second interactions, file order = ascending item id: the lower id
    # should come first about half of the time (file order would give 100%).
    logs = _same_second(2000, 2, 0)
    first_is_lower = np.mean(logs.items[logs.offsets[:-1]] == 0)
    assert 0.45 < first_is_lower < 0.55


def test_ties_do_not_cross_timestamps():
    # two same-second groups per user: the shuffle only reorders inside a group
    n = 50
    item_ids = np.arange(2 * n, dtype=np.int64)
    ts = np.r_[np.full(n, 7), np.full(n, 3)]  # the file lists the later group first
    logs = logs_from_arrays(item_ids, None, np.zeros(2 * n, dtype=np.int64), item_ids, ts, seed=5)
    assert set(logs.items[:n].tolist()) == set(range(n, 2 * n))
    assert logs.timestamps.tolist() == [3] * n + [7] * n


def _replace(cols: dict, name: str, array) -> dict:
    out = dict(cols)
    if array is None:
        out.pop(name)
    else:
        out[name] = array
    return out


BAD_FILES = [
    # (id, which file, columns, expected message)
    ("missing timestamp", "interactions", _replace(_inter_table(), "timestamp", None),
     r"interactions\.parquet has no column 'timestamp'"),
    ("missing item_id in items", "items", _replace(ITEMS, "item_id", None), r"items\.parquet has no column 'item_id'"),
    ("item_id is string", "items", _replace(ITEMS, "item_id", pa.array(["10", "20", "30", "40", "7", "99"])),
     r"items\.parquet column 'item_id' must be int64, got string"),
    ("timestamp is float", "interactions",
     _replace(_inter_table(), "timestamp", pa.array(np.arange(9, dtype=np.float64))),
     r"interactions\.parquet column 'timestamp' must be int64, got double"),
    ("null user_id", "interactions", _replace(_inter_table(), "user_id", pa.array([5, 2, 5, None, 9, 5, 2, 5, 9])),
     r"interactions\.parquet row 3: column 'user_id' is null"),
    ("null item_id in items", "items", _replace(ITEMS, "item_id", pa.array([10, 20, None, 40, 7, 99])),
     r"items\.parquet row 2: column 'item_id' is null"),
    ("duplicate item_id", "items", _replace(ITEMS, "item_id", pa.array([10, 20, 30, 40, 20, 99])),
     r"items\.parquet row 4: item_id 20 is duplicated \(first at row 1\)"),
    ("unknown item", "interactions",
     _replace(_inter_table(), "item_id", pa.array([30, 10, 10, 99, 7, 40, 20, 999, 20])),
     r"interactions\.parquet row 7: item_id 999 is not in items\.parquet"),
    ("empty interactions", "interactions", pa.table(_inter_table()).slice(0, 0), r"interactions\.parquet is empty"),
    ("empty items", "items", pa.table(ITEMS).slice(0, 0), r"items\.parquet is empty"),
    ("NaN label", "interactions",
     _replace(_inter_table(), "rating", pa.array([4, 3, 2, 5, 1, np.nan, 1, 4, 2], type=pa.float32())),
     r"interactions\.parquet row 5: column 'rating' is nan"),
    ("Inf label", "interactions",
     _replace(_inter_table(), "rating", pa.array([4, 3, 2, 5, 1, 3, 1, np.inf, 2], type=pa.float64())),
     r"interactions\.parquet row 7: column 'rating' is inf"),
    ("label overflows float32", "interactions",
     _replace(_inter_table(), "rating", pa.array([4, 1e300, 2, 5, 1, 3, 1, 4, 2], type=pa.float64())),
     r"interactions\.parquet row 1: column 'rating' is 1e\+300, not a finite float32"),
    ("null label", "interactions", _replace(_inter_table(), "clicked", pa.array([1, 0, None, 1, 0, 0, 1, 1, 0])),
     r"interactions\.parquet row 2: column 'clicked' is null"),
    ("string label", "interactions", _replace(_inter_table(), "comment", pa.array(["x"] * 9)),
     r"interactions\.parquet column 'comment' must be numeric"),
    ("float-list item feature", "items", _replace(ITEMS, "vec", pa.array([[1.0]] * 6)),
     r"items\.parquet column 'vec' must be string, list<string> or numeric"),
    ("null inside a list feature", "items", _replace(ITEMS, "tags", pa.array([["a"], [], ["b", None], [], [], []])),
     r"items\.parquet row 2: column 'tags' has a null inside its list"),
    ("NaN numeric item feature", "items", _replace(ITEMS, "price", pa.array([1, 2, 3, 4, np.nan, 6.0])),
     r"items\.parquet row 4: column 'price' is nan"),
]


@pytest.mark.parametrize("which, cols, message", [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_bad_files_name_file_column_and_row(tmp_path, which, cols, message):
    p = _write(tmp_path, **{("inter" if which == "interactions" else which): cols})
    with pytest.raises(PoolError, match=message):
        read_logs(p["interactions"], p["items"])


BAD_USERS = [
    ("duplicate user_id", _replace(USERS, "user_id", pa.array([9, 2, 9])),
     r"users\.parquet row 2: user_id 9 is duplicated"),
    ("missing user_id", _replace(USERS, "user_id", None), r"users\.parquet has no column 'user_id'"),
    ("empty users", pa.table(USERS).slice(0, 0), r"users\.parquet is empty"),
    ("user_id is float", _replace(USERS, "user_id", pa.array([9.0, 2.0, 77.0])),
     r"users\.parquet column 'user_id' must be int64"),
]


@pytest.mark.parametrize("cols, message", [c[1:] for c in BAD_USERS], ids=[c[0] for c in BAD_USERS])
def test_bad_users_file(tmp_path, cols, message):
    p = _write(tmp_path, users=cols)
    with pytest.raises(PoolError, match=message):
        read_logs(p["interactions"], p["items"], p["users"])


def test_missing_and_unreadable_files(tmp_path):
    p = _write(tmp_path)
    with pytest.raises(PoolError, match="does not exist"):
        read_logs(tmp_path / "nope.parquet", p["items"])
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(PoolError, match="cannot read .*junk.parquet as Parquet"):
        read_logs(p["interactions"], junk)


def test_arrays_get_the_same_validation():
    with pytest.raises(PoolError, match=r"interactions row 2: item_id 999 is not in items"):
        logs_from_arrays([1, 2, 3], {}, [0, 0, 1], [1, 2, 999], [1, 2, 3])
    with pytest.raises(PoolError, match=r"items column 'item_id' must be int64, got string"):
        logs_from_arrays(["a", "b"], {}, [0], [1], [1])
    with pytest.raises(PoolError, match=r"interactions row 1: column 'rating' is nan"):
        logs_from_arrays([1, 2], {}, [0, 0], [1, 2], [1, 2], {"rating": [1.0, np.nan]})


# ---------------------------------------------------------------------------------------------
# Leave-one-out


def test_leave_one_out():
    rng = np.random.default_rng(0)
    n_items = 30
    counts = {100: 1, 101: 2, 102: 3, 103: 7, 104: 12}  # user id -> number of interactions
    rows = []
    for uid, n in counts.items():
        items = rng.choice(n_items, size=n, replace=False)
        times = rng.choice(10_000, size=n, replace=False)  # distinct: the order is fixed
        rows += [(uid, int(i), int(t)) for i, t in zip(items, times)]
    rows = [rows[i] for i in rng.permutation(len(rows))]  # file order means nothing
    u, i, t = map(np.array, zip(*rows))
    item_ids = np.arange(n_items, dtype=np.int64) * 10 + 3  # pool row r holds item id 10r + 3
    split = leave_one_out(logs_from_arrays(item_ids, {}, u, item_ids[i], t))

    logs = split.logs
    by_time = {uid: [r for _, r in sorted((tt, ii) for uu, ii, tt in rows if uu == uid)] for uid in counts}
    assert logs.user_ids.tolist() == sorted(counts)
    assert split.eval_users.tolist() == [2, 3, 4]  # users 102, 103, 104 have >= 3 interactions
    for e, uidx in enumerate(split.eval_users):
        seq = by_time[int(logs.user_ids[uidx])]
        assert split.test_items[e] == seq[-1]
        assert split.valid_items[e] == seq[-2]
        assert split.history(uidx, "valid").tolist() == seq[:-2]
        assert split.history(uidx, "test").tolist() == seq[:-1]
        assert split.known("valid")[e].tolist() == sorted(seq[:-2])
        assert split.known("test")[e].tolist() == sorted(seq[:-1])
        assert split.train_end[uidx] == logs.offsets[uidx + 1] - 2
    for uidx in (0, 1):  # train-only
        seq = by_time[int(logs.user_ids[uidx])]
        assert split.train_end[uidx] == logs.offsets[uidx + 1]
        assert split.history(uidx, "valid").tolist() == seq == split.history(uidx, "test").tolist()
    np.testing.assert_array_equal(split.targets("valid"), split.valid_items)
    np.testing.assert_array_equal(split.targets("test"), split.test_items)

    for stage in ("valid", "test"):
        off, items = split.history_csr(stage)
        for uidx in range(logs.num_users):
            assert items[off[uidx] : off[uidx + 1]].tolist() == split.history(uidx, stage).tolist()
    with pytest.raises(ValueError, match="stage"):
        split.history(0, "train")


def test_split_follows_the_shuffled_tie_order():
    # the last two interactions of a same-second history are whatever the seeded shuffle put last
    logs = _same_second(1, 50, 4)
    split = leave_one_out(logs)
    assert split.test_items.tolist() == [logs.items[-1]]
    assert split.valid_items.tolist() == [logs.items[-2]]
    assert split.test_items[0] != 49  # not the highest item id, as file order would give
