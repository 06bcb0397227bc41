"""The candidate pool: item ids, embeddings and categorical features, read from Parquet.

Parquet schema: `item_id` int64, `embedding` list<float32> (all the same length), and any number
of categorical feature columns (string, or list<string> for multi-valued features).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from silverrec.errors import PoolError

RESERVED = ("item_id", "embedding")
READ_BATCH_ROWS = 1 << 17  # rows per streamed batch / validation chunk: memory O(batch) beyond the float32 matrix


@dataclass
class Pool:
    """A validated candidate pool.

    item_ids: int64 [N] unique; embeddings: float32 [N, D] finite;
    features: name -> per-item list of string values (multi-valued allowed; empty = no value).
    """

    item_ids: np.ndarray
    embeddings: np.ndarray
    features: dict[str, list[list[str]]] = field(default_factory=dict)

    def __post_init__(self):
        validate(self)

    @property
    def size(self) -> int:
        return int(self.item_ids.shape[0])

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])


def validate(pool: Pool) -> None:
    """Raise PoolError naming the first offending row or column."""
    ids, emb = pool.item_ids, pool.embeddings
    if ids.ndim != 1 or ids.shape[0] == 0:
        raise PoolError("candidate pool is empty: no items to publish")
    if emb.ndim != 2 or emb.shape[0] != ids.shape[0]:
        raise PoolError(f"embeddings must be [{ids.shape[0]}, D], got {emb.shape}")
    if emb.shape[1] == 0:
        raise PoolError("column 'embedding' has length 0")
    bad = np.concatenate([~np.isfinite(emb[i : i + READ_BATCH_ROWS]).all(axis=1) for i in range(0, emb.shape[0], READ_BATCH_ROWS)])
    if bad.any():  # (checked a batch at a time: a whole-pool bool mask is N x D bytes)
        row = int(np.flatnonzero(bad)[0])
        raise PoolError(
            f"column 'embedding' has NaN or Inf at row {row} (item_id {int(ids[row])}); "
            f"{int(bad.sum())} rows affected"
        )
    order = np.argsort(ids, kind="stable")
    dup = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if dup.size:
        rows = sorted(int(r) for r in order[dup[0] : dup[0] + 2])
        raise PoolError(f"duplicate item_id {int(ids[order[dup[0]]])} at rows {rows[0]} and {rows[1]}")
    for name, values in pool.features.items():
        if name in RESERVED or not name:
            raise PoolError(f"feature name {name!r} is reserved")
        if len(values) != ids.shape[0]:
            raise PoolError(f"feature column {name!r} has {len(values)} rows, pool has {ids.shape[0]}")


def read_pool(path: str | Path) -> Pool:
    """Read and validate a pool Parquet file, streamed in batches of row groups: the embeddings go
    straight into one preallocated float32 [N, D] array (no whole Arrow table, no second copy), so
    the peak is the float32 pool plus one batch."""
    path = Path(path)
    if not path.is_file():
        raise PoolError(f"pool file {path} does not exist")
    # Arrow's default pool (mimalloc) and pre-buffering keep freed batches resident: at 1M x 96 they
    # added 0.6 GB to the 0.38 GB float32 matrix; unbuffered reads through the system pool add 0.16 GB.
    previous_pool = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        pf = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
        names = pf.schema_arrow.names
        for col in RESERVED:
            if col not in names:
                raise PoolError(f"{path} has no column {col!r} (columns: {names})")
        n = pf.metadata.num_rows
        if n == 0:
            raise PoolError(f"candidate pool {path} is empty: no items to publish")
        ids = np.empty(n, dtype=np.int64)
        emb = None
        features: dict[str, list[list[str]]] = {c: [] for c in names if c not in RESERVED}
        start = 0
        for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS):
            table = pa.Table.from_batches([batch])
            part_ids = _id_column(table.column("item_id"), start)
            part = _embedding_matrix(table.column("embedding"), part_ids, start)
            if emb is None:
                emb = np.empty((n, part.shape[1]), dtype=np.float32)
            elif part.shape[1] != emb.shape[1]:
                raise PoolError(
                    f"column 'embedding' is ragged: row {start} (item_id {int(part_ids[0])}) has length "
                    f"{part.shape[1]}, row 0 has {emb.shape[1]}"
                )
            stop = start + part.shape[0]
            ids[start:stop], emb[start:stop] = part_ids, part
            for name in features:
                features[name] += _feature_values(name, table.column(name))
            start = stop
            del table, part, batch
    except (pa.ArrowInvalid, OSError) as e:
        raise PoolError(f"cannot read {path} as Parquet: {e}") from None
    finally:
        pa.set_memory_pool(previous_pool)
    return Pool(ids, emb, features)


def _id_column(id_col: pa.ChunkedArray, base: int = 0) -> np.ndarray:
    if not pa.types.is_integer(id_col.type):
        raise PoolError(f"column 'item_id' must be int64, got {id_col.type}")
    if id_col.null_count:
        row = int(np.flatnonzero(id_col.is_null().to_numpy(zero_copy_only=False))[0])
        raise PoolError(f"column 'item_id' is null at row {base + row}")
    return id_col.to_numpy().astype(np.int64)


def pool_from_table(table: pa.Table, source: str = "pool") -> Pool:
    """Convert an Arrow table to a validated Pool."""
    for col in RESERVED:
        if col not in table.column_names:
            raise PoolError(f"{source} has no column {col!r} (columns: {table.column_names})")
    if table.num_rows == 0:
        raise PoolError(f"candidate pool {source} is empty: no items to publish")
    ids = _id_column(table.column("item_id"))
    embeddings = _embedding_matrix(table.column("embedding"), ids)
    features = {}
    for name in table.column_names:
        if name in RESERVED:
            continue
        features[name] = _feature_values(name, table.column(name))
    return Pool(ids, embeddings, features)


def _embedding_matrix(col: pa.ChunkedArray, ids: np.ndarray, base: int = 0) -> np.ndarray:
    """float32 [rows, D] of one batch; error messages give row numbers offset by `base`."""
    arr = col.combine_chunks()
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type)):
        raise PoolError(f"column 'embedding' must be a list of float32, got {arr.type}")
    if arr.null_count:
        row = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise PoolError(f"column 'embedding' is null at row {base + row} (item_id {int(ids[row])})")
    if pa.types.is_fixed_size_list(arr.type):
        lengths = np.full(len(arr), arr.type.list_size)
    else:
        lengths = arr.value_lengths().to_numpy(zero_copy_only=False)
    dim = int(lengths[0])
    ragged = np.flatnonzero(lengths != dim)
    if ragged.size:
        row = int(ragged[0])
        raise PoolError(
            f"column 'embedding' is ragged: row {base + row} (item_id {int(ids[row])}) has length "
            f"{int(lengths[row])}, row {base} has {dim}"
        )
    flat = arr.flatten()
    if not (pa.types.is_floating(flat.type) or pa.types.is_integer(flat.type)):
        raise PoolError(f"column 'embedding' must hold floats, got list<{flat.type}>")
    if flat.null_count:
        pos = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
        raise PoolError(f"column 'embedding' has a null value at row {base + pos // dim} (item_id {int(ids[pos // dim])})")
    values = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.float32)
    return values.reshape(len(arr), dim)


def _feature_values(name: str, col: pa.ChunkedArray) -> list[list[str]]:
    arr = col.combine_chunks()
    t = arr.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
        return [[] if v is None else [str(v)] for v in arr.to_pylist()]
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and (
        pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)
    ):
        out = []
        for row, v in enumerate(arr.to_pylist()):
            if v is None:
                out.append([])
            elif any(x is None for x in v):
                raise PoolError(f"feature column {name!r} has a null value inside the list at row {row}")
            else:
                out.append(list(v))
        return out
    raise PoolError(f"feature column {name!r} must be string or list<string>, got {t}")


def write_pool(path: str | Path, item_ids, embeddings, features: dict[str, list] | None = None) -> None:
    """Write a pool Parquet file (used by the demo, tests and benchmarks)."""
    emb = np.asarray(embeddings, dtype=np.float32)
    cols = {
        "item_id": pa.array(np.asarray(item_ids, dtype=np.int64)),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), emb.shape[1])
        if emb.ndim == 2 and emb.shape[1] > 0
        else pa.array([list(r) for r in emb], type=pa.list_(pa.float32())),
    }
    for name, values in (features or {}).items():
        cols[name] = pa.array(values)
    pq.write_table(pa.table(cols), path)
