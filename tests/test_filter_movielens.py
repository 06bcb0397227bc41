"""Filtered IVF search on real data: MovieLens PureSVD item factors with genres, decade and tags."""

import numpy as np
import torch

from silverrec.filtering.filter_program import FilterPlan
from silverrec.retrieval.filtered_ivf import MODE_AUTO
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.publish.filtered_ivf import build_filtered_ivf, pool_rows
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool

from tests.test_filter_ivf import _exact_filtered, _run


def test_movielens_real_data_filters():
    """Real pool: MovieLens PureSVD item factors, genres/decade/tags; recall vs exact filtered brute force."""
    from silverrec.publish.movielens import factorise, load_movies

    movies = load_movies()
    fac = factorise(dim=32)
    assert np.array_equal(fac.movie_ids, movies.movie_ids)
    feats = {"genre": movies.genres, "decade": [[d] for d in movies.decade], "tag": movies.tags}
    pool = Pool(movies.movie_ids, fac.item_factors, feats)
    module, manifest = build_filtered_ivf(pool, IVFConfig(nlist=64, seed=0))
    plan = FilterPlan.from_config(manifest["filter"])
    fwd = ForwardIndex.from_lists(pool.features).permute(pool_rows(pool, module.row_to_item))
    queries = torch.from_numpy(fac.user_factors[:16])
    filters = ["genre = Comedy AND NOT decade IN (1990s, 2000s)", "genre = Animation OR tag = 'pixar'", "genre = Horror AND decade = 1980s", "tag = 'dark comedy'"]
    for f in filters:
        truth = _exact_filtered(module, fwd, queries, [f] * 16, 50)
        _, ids = _run(module, plan, queries, [f] * 16, 50, 4, 32, MODE_AUTO)
        recall = np.mean([len(set(t) & set(ids[b].tolist())) / max(1, len(t)) for b, t in enumerate(truth)])
        assert recall >= 0.95, (f, recall)
        # no item outside the exact answer (default Bloom FP on MovieLens measures ~1e-6)
        allowed = set(int(module.row_to_item[r]) for r in fwd.evaluate(f).nonzero().reshape(-1))
        assert set(i for i in ids.reshape(-1).tolist() if i >= 0) <= allowed
