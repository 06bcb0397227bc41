"""The bundled MovieLens ml-latest-small data (GroupLens; see data/movielens/README.txt).

Loaders for movies (title, genres, year, tags), ratings, per-user time-ordered sequences, and a
quick matrix factorisation (PureSVD) whose item factors make a real candidate pool and whose user factors
make real queries.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.csv as pacsv
import torch

DATA_DIR = Path(os.environ.get("SILVERREC_MOVIELENS", Path(__file__).resolve().parents[1] / "data" / "movielens"))
_YEAR = re.compile(r"\((\d{4})\)\s*$")


@dataclass
class Movies:
    """movie_ids int64 [M]; titles, genres (list per movie), decade ("1990s" or "unknown"),
    tags (lower-cased user tags per movie)."""

    movie_ids: np.ndarray
    titles: list[str]
    genres: list[list[str]]
    decade: list[str]
    tags: list[list[str]]


@dataclass
class Ratings:
    """Parallel arrays, one entry per rating: user_ids, movie_ids int64, ratings float32, timestamps int64."""

    user_ids: np.ndarray
    movie_ids: np.ndarray
    ratings: np.ndarray
    timestamps: np.ndarray


def _read(name: str):
    path = DATA_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"MovieLens file {path} is missing (set SILVERREC_MOVIELENS to its folder)")
    return pacsv.read_csv(path)


def load_movies() -> Movies:
    t = _read("movies.csv").to_pydict()
    ids = np.asarray(t["movieId"], dtype=np.int64)
    genres = [[] if g == "(no genres listed)" else g.split("|") for g in t["genres"]]
    decade = []
    for title in t["title"]:
        m = _YEAR.search(title.strip())
        decade.append(f"{int(m.group(1)) // 10 * 10}s" if m else "unknown")
    tags_t = _read("tags.csv").to_pydict()
    by_movie: dict[int, set[str]] = {}
    for mid, tag in zip(tags_t["movieId"], tags_t["tag"]):
        by_movie.setdefault(int(mid), set()).add(str(tag).strip().lower())
    tags = [sorted(by_movie.get(int(m), ())) for m in ids]
    return Movies(ids, list(t["title"]), genres, decade, tags)


def load_ratings() -> Ratings:
    t = _read("ratings.csv")
    return Ratings(
        t.column("userId").to_numpy().astype(np.int64),
        t.column("movieId").to_numpy().astype(np.int64),
        t.column("rating").to_numpy().astype(np.float32),
        t.column("timestamp").to_numpy().astype(np.int64),
    )


@dataclass
class Factorisation:
    """Inner-product factors: score(user, movie) = user_factors[u] . item_factors[m]."""

    user_ids: np.ndarray  # int64 [U]
    user_factors: np.ndarray  # float32 [U, dim]
    movie_ids: np.ndarray  # int64 [M] (every movie in movies.csv)
    item_factors: np.ndarray  # float32 [M, dim]


def interaction_matrix(ratings: Ratings, movie_ids: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """(user ids int64 [U], binary float32 [U, M] matrix: 1 where the user rated the movie)."""
    user_ids, u_idx = np.unique(ratings.user_ids, return_inverse=True)
    col = {int(m): i for i, m in enumerate(movie_ids)}
    try:
        i_idx = np.fromiter((col[int(m)] for m in ratings.movie_ids), dtype=np.int64, count=len(ratings.movie_ids))
    except KeyError as e:
        raise ValueError(f"rated movie id {e.args[0]} is not in the movie list") from None
    matrix = torch.zeros(len(user_ids), len(movie_ids))
    matrix[torch.from_numpy(u_idx), torch.from_numpy(i_idx)] = 1.0
    return user_ids, matrix


def factorise(dim: int = 32, ratings: Ratings | None = None, movie_ids: np.ndarray | None = None) -> Factorisation:
    """PureSVD of the implicit user x movie matrix (Cremonesi et al., RecSys 2010).

    R ~= U_d S_d V_d^T; items get V_d S_d^1/2 and users U_d S_d^1/2, so the inner product is the
    rank-d reconstruction r_u V_d V_d^T. Computed exactly from the small Gram matrix R R^T
    (users x users) in float64: deterministic (signs fixed) and about a second on a CPU.
    On a random 10% hold-out of ml-latest-small, recall@100 is 0.49 at d=32 vs 0.30 for popularity.
    """
    r = ratings or load_ratings()
    movie_ids = load_movies().movie_ids if movie_ids is None else movie_ids
    user_ids, matrix = interaction_matrix(r, movie_ids)
    R = matrix.double()
    evals, evecs = torch.linalg.eigh(R @ R.T)  # ascending
    top = torch.argsort(evals, descending=True)[:dim]
    s = evals[top].clamp_min(1e-12).sqrt()  # singular values
    u = evecs[:, top]
    u = u * torch.sign(u[u.abs().argmax(dim=0), torch.arange(u.shape[1])])  # deterministic signs
    v = (R.T @ u) / s  # [M, d]
    users = (u * s.sqrt()).float().numpy()
    items = (v * s.sqrt()).float().numpy()
    return Factorisation(user_ids, users, movie_ids, items)


def write_logs(out_dir: str | Path) -> tuple[Path, Path]:
    """Write the bundled ratings as generic logs (see publish/logs.py): (interactions, items) paths.

    ``interactions.parquet``: user_id, item_id (movieId), timestamp int64 and the ``rating`` label
    float32, in the file's order. ``items.parquet``: item_id, ``genre`` list<string> and ``decade``
    string for every movie in movies.csv (titles stay out: they are not categorical).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    movies, ratings = load_movies(), load_ratings()
    items_path, inter_path = out_dir / "items.parquet", out_dir / "interactions.parquet"
    pq.write_table(
        pa.table(
            {
                "item_id": pa.array(movies.movie_ids, type=pa.int64()),
                "genre": pa.array(movies.genres, type=pa.list_(pa.string())),
                "decade": pa.array(movies.decade, type=pa.string()),
            }
        ),
        items_path,
    )
    pq.write_table(
        pa.table(
            {
                "user_id": pa.array(ratings.user_ids, type=pa.int64()),
                "item_id": pa.array(ratings.movie_ids, type=pa.int64()),
                "timestamp": pa.array(ratings.timestamps, type=pa.int64()),
                "rating": pa.array(ratings.ratings, type=pa.float32()),
            }
        ),
        inter_path,
    )
    return inter_path, items_path
