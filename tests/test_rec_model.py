"""RecModel (silverrec/rec_model.py) and its snapshot, against independent references.

References: the eager in-process model vs the torch.export and
TorchScript programs, a variant RecModel without OverArch / value model, the plain-Python
value-model evaluator (`evaluate_formula`), brute-force `user @ cache.T` scores, the exact forward
index (filters) and the generated logs themselves (histories). The model is the tiny synthetic one
of tests/rec_fixtures.py, trained and published once per session.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from silverrec.errors import QueryError
from silverrec.filtering.filter_program import compile_request
from silverrec.retrieval.filtered_ivf import MODES
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.ranking import ListwiseOverArch
from silverrec.ranking.value_model import evaluate_formula
import dataclasses

from silverrec.compose import compose
from silverrec.rec_model import RecModel
from silverrec.serving.recommend import RecRequest

from tests.rec_fixtures import FORMULA, K0, N_ITEMS, NLIST, TASKS, rec_setup

T = len(TASKS)


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return rec_setup(tmp_path_factory)


def model_inputs(handler, requests, *, k, k0=K0, nprobe=None, max_probe=None, mode="auto", exclude_history=True):
    """The forward's arguments for `requests`, built the way the predictor builds them."""
    reqs = [RecRequest.coerce(r, f"request {b}") for b, r in enumerate(requests)]
    limit = int(handler.config["exclude_limit"])
    values, lengths, dense, exclude = handler.encode(reqs, exclude_history, limit)
    filters = [r.filter for r in reqs]
    modes = torch.tensor([MODES["probed"] if f is None else MODES[mode] for f in filters], dtype=torch.int64)
    nprobe = int(handler.config["default_nprobe"]) if nprobe is None else nprobe
    max_probe = max(nprobe, int(handler.config["search"]["default_max_probe"])) if max_probe is None else max_probe
    # a model whose one source is the ANN reads no history and no source flags
    history, flags = torch.full((len(reqs), 1), -1, dtype=torch.int64), torch.ones(len(reqs), 2, dtype=torch.bool)
    return (values, lengths, dense, exclude, *compile_request(filters, handler.plan), modes, history, flags, k, k0,
            nprobe, max_probe)


def run(module, args):
    with torch.inference_mode():
        return [x.clone() for x in module(*args)]


def variant(built, kind=None, overarch=None, value_model=None) -> RecModel:
    """The published composition with another OverArch (`kind`, the module) / value model formula."""
    return compose(built.spec.replace(overarch=kind, value_model=value_model),
                   dataclasses.replace(built.parts, overarch=overarch))


def users(rec, n, start=0):
    return [int(u) for u in rec.logs.user_ids[start:start + n]]


def formula_value(task_scores: np.ndarray, feats: np.ndarray, names: list[str]) -> float:
    """The plain-Python value of one candidate (task scores [T], dense features [F])."""
    return evaluate_formula(FORMULA, {t: float(task_scores[i]) for i, t in enumerate(TASKS)},
                            {n: float(feats[j]) for j, n in enumerate(names)})


def assert_ranked_by(ids, scores, reference: dict[int, float], atol=1e-5):
    """ids/scores (one request, -1 padding dropped) are in non-increasing order of `reference`
    (id -> independently computed score) and their scores are those references (tie-tolerant)."""
    ref = np.asarray([reference[int(i)] for i in ids])
    np.testing.assert_allclose(np.asarray(scores, dtype=np.float64), ref, atol=atol, rtol=1e-5)
    assert np.all(np.diff(ref) <= atol), f"not sorted by the reference score: {ref}"


# ------------------------------------------------------------------ export == eager == TorchScript

def test_snapshot_side_files_match_the_published_model(rec):
    """items.npz maps the programs' rows to the same ids as the composition publish exported."""
    handler = rec.snap().rec_handler()
    np.testing.assert_array_equal(handler.row_to_item, rec.built.row_to_item)
    np.testing.assert_array_equal(handler.row_to_item, rec.built.parts.index.row_to_item.numpy())
    assert sorted(handler.row_to_item.tolist()) == sorted(rec.logs.item_ids.tolist())
    assert rec.snap().spec.tasks == tuple(TASKS) and rec.snap().spec.overarch == "mol"
    assert 1 <= int(rec.snap().config["default_nprobe"]) <= NLIST


def _three_way_cases(rec):
    u = users(rec, 4)
    hist = rec.logs.history(u[3])[:7]
    b1 = [{"user_id": u[0]}]
    b3 = [{"user_id": u[1]}, {"history": hist}, {"user_id": u[2], "exclude": rec.logs.history(u[0])[:3]}]
    f1 = [dict(b1[0], filter="cat = c1 OR tags = t2")]
    f3 = [dict(b3[0], filter="NOT cat = c0"), b3[1], dict(b3[2], filter="tags IN (t1, t3) AND NOT cat = c2")]
    return {"b1": b1, "b3": b3, "b1-filter": f1, "b3-filter": f3}


@pytest.mark.parametrize("case", ["b1", "b3", "b1-filter", "b3-filter"])
def test_export_equals_eager_equals_torchscript(rec, case):
    requests = _three_way_cases(rec)[case]
    handler = rec.snap().rec_handler()
    args = model_inputs(handler, requests, k=12, nprobe=2, max_probe=NLIST)
    eager = run(rec.built.model, args)
    exported = run(rec.snap().module, args)
    script = run(rec.snap("torchscript").module, args)
    B = len(requests)
    for name, got in (("export", exported), ("torchscript", script)):
        ids, scores, task_scores, rows, found_by, source_scores = got
        assert found_by.shape == (B, 0) and source_scores.shape == (B, 0, 2)  # one source
        assert ids.shape == (B, 12) and task_scores.shape[:2] == (B, 12) and task_scores.shape[2] >= T
        torch.testing.assert_close(ids, eager[0], rtol=0, atol=0, msg=f"{name} item ids")
        torch.testing.assert_close(rows, eager[3], rtol=0, atol=0, msg=f"{name} rows")
        torch.testing.assert_close(scores, eager[1], rtol=1e-5, atol=1e-5, msg=f"{name} scores")
        torch.testing.assert_close(task_scores[:, :, :T], eager[2][:, :, :T], rtol=1e-5, atol=1e-5)
    assert bool((eager[0] >= 0).any(dim=1).all()), "every request got items"


def test_candidate_cap_ranks_a_subset_of_the_union(rec):
    """candidates = K1 < T*k0: the ranking stage scores at most K1 rows, all of them from the
    uncapped union, taken rank by rank (each task's best rows are never cut before worse ones)."""
    built, handler = rec.built, rec.snap().rec_handler()
    m = built.model
    capped = compose(built.spec.replace(candidates=K0 // 2), built.parts)
    requests = [{"user_id": u} for u in users(rec, 3, start=2)]
    args = model_inputs(handler, requests, k=K0 // 2, nprobe=3)
    got = run(capped, args)
    full = run(m, model_inputs(handler, requests, k=T * K0, nprobe=3))
    for b in range(len(requests)):
        kept = set(got[0][b][got[0][b] >= 0].tolist())
        assert kept and kept <= set(full[0][b][full[0][b] >= 0].tolist())


@pytest.mark.parametrize("kind", ["listwise", "linear_value_model"])
def test_variant_exports_equal_to_eager(rec, kind):
    """A RecModel with a list-wise OverArch (attention over its padded candidate list), or with a
    linear value model (folded into weights, as the demo's), exports with the same dynamic shapes
    as the published one and answers as its eager self, at batch 1 too."""
    from silverrec.publish.rec_files import dynamic_shapes, model_example
    from silverrec.retrieval.user_tower import UserFeatureSpec
    from silverrec.snapshot import export_program

    if kind == "listwise":
        model = listwise_variant(rec.built)
    else:
        built = rec.built
        model = variant(built, built.spec.overarch, built.parts.overarch, '{"weights":{"interacted":1.0,"liked":0.5}}')
        assert model.value_model.value_model.linear
    spec = UserFeatureSpec.from_json(rec.built.manifest["user_features"])
    program = export_program(model, model_example(model, spec, rec.built.parts), dynamic_shapes(len(spec.keys))).module()
    handler = rec.snap().rec_handler()
    for case in ("b1", "b3-filter"):
        args = model_inputs(handler, _three_way_cases(rec)[case], k=12, nprobe=2, max_probe=NLIST)
        eager, got = run(model, args), run(program, args)
        torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], eager[1], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------- OverArch / value model reorder only

def listwise_variant(built) -> RecModel:
    """The published model with an (untrained, randomised) list-wise OverArch in place of its own."""
    cache = built.parts.cache
    arch = ListwiseOverArch(cache.dim, len(cache.feature_names), T, model_dim=16, heads=2, layers=1, ffn=16)
    with torch.no_grad():
        for p in arch.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    return variant(built, "listwise", arch.eval(), built.spec.value_model)


@pytest.mark.parametrize("ranker", ["published", "listwise"])
def test_overarch_only_reorders_the_candidates(rec, ranker):
    """With k = T*k0 (every candidate returned) the item set does not depend on the ranking
    stage; the order is the value model's score of each candidate, computed here in Python
    (for the list-wise OverArch: over the list of every returned candidate, in another order)."""
    built, handler = rec.built, rec.snap().rec_handler()
    model = built.model if ranker == "published" else listwise_variant(built)
    requests = [{"user_id": u} for u in users(rec, 3, start=5)] + [{"user_id": users(rec, 1, 9)[0], "filter": "tags = t4"}]
    k = T * K0
    args = model_inputs(handler, requests, k=k, nprobe=3)
    full = run(model, args)
    plain = run(variant(built), args)
    names = built.parts.cache.feature_names
    with torch.inference_mode():
        user = built.model.user_tower(*args[:3])
    for b in range(len(requests)):
        got, base = full[0][b], plain[0][b]
        assert set(got[got >= 0].tolist()) == set(base[base >= 0].tolist()), f"request {b}: candidate sets differ"
        assert int((got >= 0).sum()) > K0 // 2
        rows = full[3][b][full[3][b] >= 0]
        with torch.inference_mode():
            emb, feats = built.parts.cache.gather(rows[None])
            arch = model.overarch.overarch  # its item side, as the snapshot stores it (the cache's ranker dtype)
            item = arch.item_side(emb, feats).to(model.overarch.cache.ranker.dtype).float()
            ts = arch.score(user[b:b + 1], emb, item, rows[None] >= 0)[0].numpy()
        ref = {int(i): formula_value(ts[j], feats[0, j].numpy(), names)
               for j, i in enumerate(got[got >= 0].tolist())}
        assert_ranked_by(got[got >= 0].tolist(), full[1][b][got >= 0].tolist(), ref, atol=1e-4)


def test_value_model_equals_plain_python_formula(rec):
    """The snapshot's scores are FORMULA of its returned task scores and the cache's features."""
    snap, cache = rec.snap(), rec.built.parts.cache
    handler = snap.rec_handler()
    requests = [{"user_id": u} for u in users(rec, 4, start=12)]
    ids, scores, task_scores, rows = run(snap.module, model_inputs(handler, requests, k=15))[:4]
    feats = cache.feats.float()
    names = cache.feature_names
    assert "log_count" in names
    checked = 0
    for b in range(len(requests)):
        for j in range(ids.shape[1]):
            if int(rows[b, j]) < 0:
                continue
            want = formula_value(task_scores[b, j].numpy(), feats[int(rows[b, j])].numpy(), names)
            assert float(scores[b, j]) == pytest.approx(want, rel=1e-5, abs=1e-5)
            assert handler.row_to_item[int(rows[b, j])] == int(ids[b, j])
            checked += 1
    assert checked >= 40


# ------------------------------------------------------------------- early-stage ranking entry

@pytest.mark.parametrize("backend", ["export", "torchscript"])
def test_rank_scores_equal_recommend_scores(rec, backend):
    snap = rec.snap(backend)
    for u in users(rec, 3, start=20):
        res = snap.recommend({"user_id": u}, k=10)
        ids = res.item_ids[0][res.item_ids[0] >= 0]
        assert ids.numel() == 10
        order = np.random.default_rng(u).permutation(ids.numel())  # rank keeps the given order
        ranked = snap.rank({"user_id": u}, ids[order].tolist())
        assert ranked.item_ids[0].tolist() == ids[order].tolist()
        torch.testing.assert_close(ranked.scores[0], res.scores[0][:10][order], atol=1e-4, rtol=0)
        torch.testing.assert_close(ranked.task_scores[0], res.task_scores[0][:10][order], atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------- filtering

FILTERS = [
    "cat = c1",
    "cat IN (c0, c3) AND NOT tags = t2",
    "tags = t5 OR cat = c4",
    "NOT (cat = c2 OR tags = t1)",
    "cat != c5 AND tags NOT IN (t0, t6)",
    "(tags = t3 OR tags = t7) AND NOT cat IN (c0, c1)",
]


@pytest.mark.parametrize("mode", ["auto", "probed", "unprobed"])
def test_every_returned_item_passes_its_filter(rec, mode):
    snap = rec.snap()
    fwd = ForwardIndex.from_lists(rec.logs.features)  # pool rows = items.parquet order
    ids_of = rec.logs.item_ids
    us = users(rec, len(FILTERS), start=30)
    requests = [{"user_id": u, "filter": f} for u, f in zip(us, FILTERS)]
    res = snap.recommend(requests, k=10, mode=mode)  # one batch, a different filter per request
    for b, (u, f) in enumerate(zip(us, FILTERS)):
        allowed = set(ids_of[fwd.evaluate(f).numpy()].tolist())
        got = [i for i in res.item_ids[b].tolist() if i >= 0]
        bad = [i for i in got if i not in allowed]
        assert not bad, f"{f!r}: returned items {bad} fail the filter"
        assert not set(got) & set(rec.logs.history(u))
        eligible = len(allowed - set(rec.logs.history(u)))
        if mode != "probed":  # auto and unprobed find every match when there are few
            assert len(got) == min(10, eligible), (f, len(got), eligible)


def test_filter_on_an_unknown_value_returns_nothing(rec):
    res = rec.snap().recommend([{"user_id": users(rec, 1)[0], "filter": "cat = c99"},
                                {"user_id": users(rec, 1)[0], "filter": "NOT cat = c99"}], k=5)
    assert res.item_ids[0].tolist() == [-1] * 5
    assert bool(torch.isinf(res.scores[0]).all())
    assert bool((res.item_ids[1] >= 0).all())


# ---------------------------------------------------------------------------- history / exclude

def test_history_is_excluded_by_default_and_can_be_included(rec):
    snap = rec.snap()
    us = users(rec, 8, start=40)
    k = T * K0
    excluded = snap.recommend([{"user_id": u} for u in us], k=k, nprobe=NLIST)
    included = snap.recommend([{"user_id": u} for u in us], k=k, nprobe=NLIST, exclude_history=False)
    seen = 0
    for b, u in enumerate(us):
        hist = set(rec.logs.history(u))
        assert not set(excluded.item_ids[b].tolist()) & hist, f"user {u}: a history item returned"
        seen += len(set(included.item_ids[b].tolist()) & hist)
    # the users' histories are mostly their preferred category, which the model learnt
    assert seen > 0, "exclude_history=False never returned a history item"
    # an explicit history request behaves like the stored one (same batch: see the batch test below)
    h = snap.recommend([{"history": rec.logs.history(us[0])}] + [{"user_id": u} for u in us[1:]], k=k, nprobe=NLIST)
    assert h.item_ids.tolist() == excluded.item_ids.tolist()


def test_exclusion_slots_per_request_equal_a_plain_walk(rec):
    """Each request's exclusions are its exclude ids, then its distinct history rows newest first, at
    most exclude_limit in all, in no particular order; the tensor is as wide as the batch's longest
    list (-1 pads), whatever the neighbours hold. Reference: a plain-Python walk per request."""
    handler = rec.snap().rec_handler()
    lengths = {int(u): len(rec.logs.history(int(u))) for u in rec.logs.user_ids}
    short, long_ = min(lengths, key=lengths.get), max(lengths, key=lengths.get)
    hist = rec.logs.history(long_)
    dup = [int(i) for i in hist[:5]] * 3 + [int(i) for i in hist[2:9]]  # repeats: the newest copy counts
    reqs = [{"user_id": short}, {"history": dup, "exclude": [int(hist[3]), int(hist[-1]), int(hist[-1])]},
            {"user_id": long_}, {"history": rec.logs.item_ids[:250].tolist()}]

    def walk(r, limit):
        ids = list(rec.logs.history(r["user_id"])) if "user_id" in r else r["history"]
        out = list(dict.fromkeys(int(i) for i in r.get("exclude", [])))
        for i in reversed(ids):
            if len(out) < limit and int(i) not in out:
                out.append(int(i))
        return sorted(handler.rows(out, "test").tolist())

    for limit in (int(handler.config["exclude_limit"]), 6):
        for batch in ([reqs[0]], reqs):
            exclude = model_inputs_limit(handler, batch, limit)
            want = [walk(r, limit) for r in batch]
            assert exclude.shape == (len(batch), max(1, max(len(w) for w in want)))
            for row, w in zip(exclude, want):
                assert sorted(row[row >= 0].tolist()) == w and int((row == -1).sum()) == row.numel() - len(w)


def test_exclude_padding_does_not_change_the_answer(rec):
    """The search depth is k0 + the model's constant overfetch, not the exclusion count: more -1
    padding columns in exclude must not change a request's answer."""
    handler = rec.snap().rec_handler()
    lengths = {int(u): len(rec.logs.history(int(u))) for u in rec.logs.user_ids}
    u = min(lengths, key=lengths.get)
    args = list(model_inputs(handler, [{"user_id": u}], k=T * K0, nprobe=NLIST, max_probe=NLIST))
    plain = run(rec.built.model, args)
    args[3] = torch.cat([torch.full((1, 100), -1, dtype=torch.int64), args[3]], dim=1)
    padded = run(rec.built.model, args)
    assert padded[0].tolist() == plain[0].tolist()


def test_history_beyond_the_limit_keeps_the_newest_items(rec):
    handler = rec.snap().rec_handler()
    u = max(rec.logs.user_ids, key=lambda x: len(rec.logs.history(int(x))))
    hist = list(rec.logs.history(int(u)))
    exclude = model_inputs_limit(handler, [{"user_id": int(u)}], 5)[0]
    newest = []
    for i in reversed(hist):
        if i not in newest:
            newest.append(i)
    want = sorted(handler.rows(newest[:5], "test").tolist())
    assert sorted(exclude[exclude >= 0].tolist()) == want


def model_inputs_limit(handler, requests, limit):
    reqs = [RecRequest.coerce(r, f"request {b}") for b, r in enumerate(requests)]
    return handler.encode(reqs, True, limit)[3]


def test_a_request_does_not_depend_on_its_batch_neighbours(rec):
    snap = rec.snap()
    lengths = {int(u): len(rec.logs.history(int(u))) for u in rec.logs.user_ids}
    short = sorted(lengths, key=lengths.get)[:6]
    neighbour = {"history": rec.logs.item_ids[:250].tolist()}  # a long history: 250 exclusions
    alone = [snap.recommend({"user_id": u}, k=K0, nprobe=NLIST).item_ids[0].tolist() for u in short]
    batched = snap.recommend([{"user_id": u} for u in short] + [neighbour], k=K0, nprobe=NLIST)
    assert batched.item_ids[:len(short)].tolist() == alone


def test_explicit_exclude_is_never_returned(rec):
    snap = rec.snap()
    us = users(rec, 3, start=50)
    first = snap.recommend([{"user_id": u} for u in us], k=10)
    exclude = [first.item_ids[b][:4].tolist() + [int(rec.logs.item_ids[b])] for b in range(len(us))]
    for exclude_history in (True, False):
        again = snap.recommend([{"user_id": u, "exclude": e} for u, e in zip(us, exclude)], k=10,
                               exclude_history=exclude_history)
        for b, u in enumerate(us):
            got = set(again.item_ids[b].tolist())
            assert not got & set(exclude[b]), (u, got & set(exclude[b]))
            assert -1 not in got
            if exclude_history:
                assert not got & set(rec.logs.history(u))


# ------------------------------------------------------------------------- re-score sanity check

def test_full_probe_rescore_is_the_exact_top_k(rec):
    """nprobe = nlist, no OverArch, no value model: the IVF candidates re-scored from the bf16
    cache give the exact top-k of user_emb @ cache_emb.T with the history masked."""
    built, handler = rec.built, rec.snap().rec_handler()
    model = variant(built)
    us = users(rec, 6, start=60)
    k = 10
    args = model_inputs(handler, [{"user_id": u} for u in us], k=k, k0=3 * k, nprobe=NLIST, max_probe=NLIST)
    ids, scores, _, rows = run(model, args)[:4]
    with torch.inference_mode():
        user = model.user_tower(*args[:3])[:, 0]  # task 0 (no value model: the score is task 0's)
    exact = user @ built.parts.cache.emb.float().T  # [B, N]
    assert exact.shape[1] == N_ITEMS
    for b, u in enumerate(us):
        s = exact[b].clone()
        s[torch.from_numpy(handler.rows(rec.logs.history(u), "history"))] = float("-inf")
        top = torch.topk(s, k)
        # tie-tolerant: the returned items carry exactly the exact top-k scores, in order
        torch.testing.assert_close(scores[b], top.values, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s[rows[b]], scores[b], atol=1e-5, rtol=1e-5)
        assert len(set(ids[b].tolist())) == k


def test_request_encoding_equals_a_plain_one(rec):
    """The C++ request encoding (kernels/csrc/request.h, what both predictors run) == one written here over the
    trainer's FeatureEncoder: ids to rows by a dict, stored users' histories from the logs, the KJT values, lengths
    and dense features, and each request's exclusion set (its exclude ids, then its history's distinct rows newest
    first, up to the limit); stored users, sent histories with repeats, an empty one, histories beyond the limit,
    exclude ids; with and without exclude_history."""
    handler = rec.snap().rec_handler()
    row = {int(i): r for r, i in enumerate(handler.row_to_item)}
    lengths = {int(u): len(rec.logs.history(int(u))) for u in rec.logs.user_ids}
    long_ = max(lengths, key=lengths.get)
    hist = [int(i) for i in rec.logs.history(long_)]
    ids = rec.logs.item_ids[:300].tolist()
    reqs = [{"user_id": long_}, {"history": hist[:7] * 3 + hist[2:5], "exclude": ids[:3] + ids[:2]}, {"history": []},
            {"user_id": min(lengths, key=lengths.get), "exclude": hist[:1]}, {"history": ids}]
    for batch in (reqs, reqs[:1], reqs[2:3], reqs[1:2]):
        for exclude_history, limit in ((True, 6), (True, 4096), (False, 4096)):
            got = handler.encode([RecRequest.coerce(r, "r") for r in batch], exclude_history, limit)
            rows = [[row[i] for i in (rec.logs.history(r["user_id"]) if "user_id" in r else r["history"])] for r in batch]
            want = handler.encoder.encode([np.asarray(h, dtype=np.int64) for h in rows])
            for g, w in zip(got[:3], want):
                assert g.dtype == w.dtype and torch.equal(g, w)
            for r, h, g in zip(batch, rows, got[3].tolist()):
                excluded = list(dict.fromkeys(row[i] for i in r.get("exclude", [])))
                for x in (reversed(h) if exclude_history else ()):
                    if len(excluded) < limit and x not in excluded:
                        excluded.append(x)
                assert sorted(x for x in g if x >= 0) == sorted(excluded)
            assert got[3].shape[1] == max(1, max(len([x for x in g if x >= 0]) for g in got[3].tolist()))
    with pytest.raises(QueryError, match=r"request 1: 3 exclude ids exceed the exclusion limit 2"):
        handler.encode([RecRequest(history=hist[:2]), RecRequest(history=[], exclude=ids[:3])], True, 2)


def test_int8_user_tower_calls_the_tbe_directly_with_torchrecs_answers(rec):
    """int8 tables: `direct_tower` gives a DirectTBEUserTower (fbgemm's TBE without torchrec's KJT
    bookkeeping) whose user embeddings equal torchrec's quantised tower's bit for bit, eagerly, as
    TorchScript (publish's fx trace) and exported; the published snapshot holds it."""
    from torchrec.inference.modules import quantize_embeddings

    from silverrec.publish.rec_files import scriptable_tower
    from silverrec.publish.train import rebuild_user_tower
    from silverrec.retrieval.user_tower import DirectTBEUserTower, direct_tower

    tower = quantize_embeddings(rebuild_user_tower(rec.ckpt), dtype=torch.qint8, inplace=False).eval()
    direct = direct_tower(tower)
    assert isinstance(direct, DirectTBEUserTower)
    assert direct_tower(rebuild_user_tower(rec.ckpt)) is not direct  # float tables: unchanged
    assert not isinstance(direct_tower(rebuild_user_tower(rec.ckpt)), DirectTBEUserTower)
    handler = rec.snap().rec_handler()
    requests = [RecRequest(history=rec.logs.history(u)) for u in users(rec, 5)]
    values, lengths, dense, _ = handler.encode(requests, exclude_history=False, exclude_limit=1)
    with torch.inference_mode():
        want = tower(values, lengths, dense)
        assert torch.equal(direct(values, lengths, dense), want)
        assert torch.equal(scriptable_tower(direct)(values, lengths, dense), want)
        exported = torch.export.export(direct, (values, lengths, dense), strict=False).module()
        assert torch.equal(exported(values, lengths, dense), want)
    assert isinstance(rec.built.model.user_tower, DirectTBEUserTower) == (
        rec.snap().config["quantization_user_tower"]["tables"] == "int8")


def test_int8_user_tower_bounds_indices_as_fbgemms_check_does(rec):
    """Indices outside their key's table (negative, or past its rows) pool as row 0 of that table: what fbgemm's own
    bounds check (WARNING mode, which DirectTBEUserTower replaces by a pure function) makes of them."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torchrec.inference.modules import quantize_embeddings

    from silverrec.publish.rec import rebuild_user_tower
    from silverrec.retrieval.user_tower import direct_tower

    direct = direct_tower(quantize_embeddings(rebuild_user_tower(rec.ckpt), dtype=torch.qint8, inplace=False).eval())
    handler = rec.snap().rec_handler()
    values, lengths, dense, _ = handler.encode([RecRequest(history=rec.logs.history(u)) for u in users(rec, 3)],
                                               exclude_history=False, exclude_limit=1)
    rows = direct.rows_per_key.repeat_interleave(lengths.shape[0] // direct.rows_per_key.shape[0])
    bad = values.clone()
    starts = torch.cumsum(lengths.long(), 0) - lengths.long()
    firsts = starts[lengths > 0]
    bad[firsts[0::2]] = -3  # the first index of every other non-empty (key, request) list
    bad[firsts[1::2]] = rows[lengths > 0][1::2] + 5
    tbe = direct.ebc._emb_modules[0]
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths).to(values.dtype)
    with torch.inference_mode():
        tbe.bounds_check_mode_int = BoundsCheckMode.WARNING.value
        try:
            want = tbe(indices=bad.clone(), offsets=offsets.clone())
        finally:
            tbe.bounds_check_mode_int = BoundsCheckMode.NONE.value
        got = tbe(indices=direct.in_bounds(bad, lengths), offsets=offsets)
    assert torch.equal(got, want)
    fixed = direct.in_bounds(bad, lengths)
    assert torch.equal(fixed[firsts], torch.zeros_like(fixed[firsts])) and torch.equal(
        fixed[values == bad], values[values == bad])
