"""The bundled MovieLens ml-latest-small data (GroupLens; see data/movielens/README.txt).

Loaders for movies (title, genres, year, tags), ratings, per-user time-ordered sequences, and a
quick matrix factorisation whose item factors make a real candidate pool and whose user factors
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


def user_sequences(ratings: Ratings | None = None) -> dict[int, np.ndarray]:
    """user id -> movie ids int64 ordered by rating time (ties by movie id)."""
    r = ratings or load_ratings()
    order = np.lexsort((r.movie_ids, r.timestamps, r.user_ids))
    users, movies = r.user_ids[order], r.movie_ids[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    ends = np.r_[starts[1:], len(users)]
    return {int(users[s]): movies[s:e] for s, e in zip(starts, ends)}


@dataclass
class Factorisation:
    """Inner-product factors: score(user, movie) ~= user_factors[u] . item_factors[m] (bias folded in)."""

    user_ids: np.ndarray  # int64 [U]
    user_factors: np.ndarray  # float32 [U, dim + 1]
    movie_ids: np.ndarray  # int64 [M] (every movie in movies.csv)
    item_factors: np.ndarray  # float32 [M, dim + 1]


def factorise(dim: int = 32, steps: int = 300, seed: int = 0, ratings: Ratings | None = None,
              movie_ids: np.ndarray | None = None) -> Factorisation:
    """Biased matrix factorisation of the ratings by full-batch Adam (a few seconds on a CPU).

    rating ~= mu + b_u + b_i + u.v; the item bias is folded into an extra item dimension (user side 1)
    so that ranking items for a user is a pure inner product.
    """
    r = ratings or load_ratings()
    movie_ids = load_movies().movie_ids if movie_ids is None else movie_ids
    user_ids, u_idx = np.unique(r.user_ids, return_inverse=True)
    m_pos = {int(m): i for i, m in enumerate(movie_ids)}
    i_idx = np.fromiter((m_pos[int(m)] for m in r.movie_ids), dtype=np.int64, count=len(r.movie_ids))
    g = torch.Generator().manual_seed(seed)
    U = (0.1 * torch.randn(len(user_ids), dim, generator=g)).requires_grad_()
    V = (0.1 * torch.randn(len(movie_ids), dim, generator=g)).requires_grad_()
    bu = torch.zeros(len(user_ids), requires_grad=True)
    bi = torch.zeros(len(movie_ids), requires_grad=True)
    u_t, i_t, y = torch.from_numpy(u_idx), torch.from_numpy(i_idx), torch.from_numpy(r.ratings)
    mu = y.mean()
    opt = torch.optim.Adam([U, V, bu, bi], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        pred = mu + bu[u_t] + bi[i_t] + (U[u_t] * V[i_t]).sum(1)
        loss = ((pred - y) ** 2).mean() + 0.05 * ((U**2).sum(1).mean() + (V[i_t] ** 2).sum(1).mean())
        loss.backward()
        opt.step()
    with torch.no_grad():
        users = torch.cat([U, torch.ones(len(user_ids), 1)], 1)
        items = torch.cat([V, bi[:, None]], 1)
    return Factorisation(user_ids, users.numpy().astype(np.float32), movie_ids, items.numpy().astype(np.float32))
