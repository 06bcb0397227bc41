"""A pool whose default probe is too shallow: a noisy, long-tailed mixture of normalised embeddings with
three categorical features, and held-out queries drawn from the same process.

    from noisy_pool import noisy_pool        (benchmarks/ on sys.path)
    pool = noisy_pool(1_000_000)             # NoisyPool: x float32 [N, 96] (unit rows), features, queries()

What makes it hard for an IVF index, as a new user's embeddings would be:
- cluster sizes follow a power law (exponent `SIZE_EXPONENT`): a few clusters hold many items, most few;
- each cluster has its own spread (log-normal), and the noise is as large as the centre: items of a
  cluster are scattered far from its centre and clusters overlap;
- `BACKGROUND` of the items belong to no cluster (uniform on the sphere).

Features (categorical, one value per item):
- category (CATEGORIES values): correlated with the cluster (each cluster has a main category, held by
  `CATEGORY_LOYALTY` of its items; the rest draw one by popularity): a filter on it is clustered in space;
- region (REGIONS values, mildly skewed popularity), independent of the embedding;
- brand (BRANDS values, Zipf 1.1 popularity: many rare values), independent of the embedding.

Queries come from the same mixture (fresh draws, not pool items): held out from anything publish sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DIM = 96
ITEMS_PER_CLUSTER = 500  # mixture components per item: 2,000 at 1M
SIZE_EXPONENT = 0.8  # component weight ~ rank ** -SIZE_EXPONENT
NOISE = 1.2  # noise norm / centre norm (each component scales it by its own log-normal spread)
SPREAD_SIGMA = 0.35  # log-normal sigma of the per-component spread
BACKGROUND = 0.05  # share of items drawn uniformly on the sphere
CATEGORIES, CATEGORY_LOYALTY = 40, 0.6
REGIONS, BRANDS = 12, 5000


@dataclass
class NoisyPool:
    """x float32 [N, D] unit rows; features {name: (vocabulary list[str], codes int32 [N])}; the generator's
    parameters for `queries`."""

    x: np.ndarray
    features: dict
    centres: np.ndarray
    weights: np.ndarray
    spread: np.ndarray
    seed: int

    def queries(self, n: int, seed: int = 1) -> np.ndarray:
        """n query embeddings float32 [n, D] from the same mixture (a different seed than the pool's)."""
        rng = np.random.default_rng([self.seed, seed, 7])
        return draw(rng, n, self.centres, self.weights, self.spread)[0]

    def feature_strings(self) -> dict:
        """{name: list of N value strings} (the Pool's categorical columns)."""
        return {name: np.asarray(vocab, dtype=object)[codes].tolist() for name, (vocab, codes) in self.features.items()}


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def draw(rng, n: int, centres: np.ndarray, weights: np.ndarray, spread: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """n rows of the mixture (float32 [n, D] unit rows, component int64 [n], -1 = background)."""
    c, d = centres.shape
    comp = rng.choice(c, size=n, p=weights)
    comp[rng.random(n) < BACKGROUND] = -1
    x = np.empty((n, d), dtype=np.float32)
    for start in range(0, n, 1 << 16):  # chunks: float64 temporaries stay small at 10M
        cc = comp[start : start + (1 << 16)]
        noise = rng.standard_normal((cc.size, d)) / np.sqrt(d)
        fg = cc >= 0
        rows = noise.copy()
        rows[fg] = centres[cc[fg]] + NOISE * spread[cc[fg], None] * noise[fg]
        x[start : start + cc.size] = unit(rows)
    return x, comp


def noisy_pool(n: int, d: int = DIM, seed: int = 0) -> NoisyPool:
    """The pool (module docstring), deterministic in (n, d, seed)."""
    rng = np.random.default_rng(seed)
    c = max(16, n // ITEMS_PER_CLUSTER)
    centres = unit(rng.standard_normal((c, d)))
    weights = np.arange(1, c + 1, dtype=np.float64) ** -SIZE_EXPONENT
    weights = rng.permutation(weights / weights.sum())
    spread = np.exp(SPREAD_SIGMA * rng.standard_normal(c))
    x, comp = draw(rng, n, centres, weights, spread)
    cat_pop = np.arange(1, CATEGORIES + 1, dtype=np.float64) ** -1.0
    cat_pop /= cat_pop.sum()
    main = rng.choice(CATEGORIES, size=c, p=cat_pop)  # each component's main category
    category = rng.choice(CATEGORIES, size=n, p=cat_pop)
    loyal = (comp >= 0) & (rng.random(n) < CATEGORY_LOYALTY)
    category[loyal] = main[comp[loyal]]
    reg_pop = np.arange(1, REGIONS + 1, dtype=np.float64) ** -0.5
    region = rng.choice(REGIONS, size=n, p=reg_pop / reg_pop.sum())
    brand_pop = np.arange(1, BRANDS + 1, dtype=np.float64) ** -1.1
    brand = rng.choice(BRANDS, size=n, p=brand_pop / brand_pop.sum())
    features = {"category": ([f"c{i}" for i in range(CATEGORIES)], category.astype(np.int32)),
                "region": ([f"r{i}" for i in range(REGIONS)], region.astype(np.int32)),
                "brand": ([f"b{i}" for i in range(BRANDS)], brand.astype(np.int32))}
    return NoisyPool(x, features, centres, weights, spread, seed)


def publish_noisy(pool: NoisyPool, out, features: bool = False):
    """Publish the pool as `silverrec publish --pool` does, with the defaults (calibration included):
    -> (loaded snapshot, publish seconds). Item ids are the pool rows."""
    import time

    import silverrec
    from silverrec.publish.filtered_ivf import publish_index
    from silverrec.publish.pool import Pool

    n = pool.x.shape[0]
    feats = {name: [[v] for v in vals] for name, vals in pool.feature_strings().items()} if features else {}
    t0 = time.perf_counter()
    publish_index(Pool(np.arange(n, dtype=np.int64), pool.x.copy(), feats), out, overwrite=True, release_embeddings=True)
    return silverrec.load(out), time.perf_counter() - t0


def faiss_ivf_sq8(x: np.ndarray, nlist: int):
    """Faiss IVF-SQ8 for inner product as a Faiss user builds it (`index_factory`: its own k-means, spherical
    for inner product, its defaults) on the same nlist: -> (index, build seconds). Ids are the pool rows."""
    import time

    import faiss

    t0 = time.perf_counter()
    index = faiss.index_factory(x.shape[1], f"IVF{nlist},SQ8", faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add(x)
    return index, time.perf_counter() - t0


def smallest_reaching(recall_at, nprobes, target: float):
    """(the smallest of `nprobes` (ascending) whose recall_at(nprobe) reaches `target`, or the last, its
    recall, {nprobe: recall} of every one measured)."""
    seen = {}
    for p in nprobes:
        seen[p] = recall_at(p)
        if seen[p] >= target:
            return p, seen[p], seen
    return p, seen[p], seen
