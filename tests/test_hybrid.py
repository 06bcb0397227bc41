"""Hybrid retrieval (silverrec/generative/source.py): the ANN search and the generative decode in one
RecModel forward, their union ranked by one model.

References: Python sets (merge_sources; the union of the two sources run alone: the plain RecModel
with the same parts and the stand-alone GenerativeRetrieval with a caller-built bitmask), the exact
forward index (filters), `RecModel.rank` on the union (scores), the eager model against the
torch.export and TorchScript programs at batch 1 and 16. The model is the tiny synthetic one of
tests/rec_fixtures.py with a random decoder over random semantic IDs (the tests check how the
sources are composed, not how good the decoder is).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dataclasses

from silverrec.bitmask import pack_bits
from silverrec.candidates import FOUND_ANN, FOUND_GENERATIVE, SOURCES
from silverrec.compose import compose
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.generative.generative import GenerativeRetrieval
from silverrec.generative.source import merge_sources, request_tensors
from silverrec.generative.trie import ValidPathTrie
from silverrec.publish.rec_files import dynamic_shapes, model_example, scriptable
from silverrec.ranking.top_k import priority_tiers
from silverrec.rec_model import RecModel
from silverrec.retrieval.user_tower import UserFeatureSpec
from silverrec.snapshot import export_program
from silverrec.spec import PRIORITIES

from tests.rec_fixtures import K0, N_ITEMS, TASKS, rec_setup
from tests.reference_beam_search import random_decoder
from tests.test_rec_model import model_inputs, run, users

SIZES = [8, 8, 8]
W = 12  # beam width
T = len(TASKS)
FILTERS = [None, "cat = c1 OR tags = t2", "NOT cat = c0", "tags IN (t1, t3) AND NOT cat = c2", "cat = c99"]


def semantic_paths(n: int, sizes: list[int], seed: int = 0) -> torch.Tensor:
    """n distinct random paths int64 [n, L] (digits of distinct numbers in the mixed radix `sizes`)."""
    codes = torch.randperm(int(np.prod(sizes)), generator=torch.Generator().manual_seed(seed))[:n]
    digits = []
    for size in reversed(sizes):
        digits.append(codes % size)
        codes = codes // size
    return torch.stack(digits[::-1], dim=1)


def decode_module(rec, beam_width: int = W, top_k: int = 5) -> GenerativeRetrieval:
    """A random decoder over random semantic IDs of the fixture's pool (item ids of items.parquet)."""
    paths = semantic_paths(N_ITEMS, SIZES)
    trie = ValidPathTrie(paths, SIZES)
    ids = torch.from_numpy(rec.logs.item_ids)[trie.row_order]
    return GenerativeRetrieval(random_decoder(SIZES, seed=3), trie, ids, beam_width, top_k).eval()


def hybrid_model(rec, beam_width: int = W, weight: float = 0.0, priority: str = "none") -> RecModel:
    """The published composition with the decode as a second source, ranked by `weight` and `priority`."""
    built = rec.built
    spec = built.spec.replace(sources=SOURCES, generative_weight=weight, source_priority=priority)
    return compose(spec, dataclasses.replace(built.parts, decode=decode_module(rec, beam_width)))


def plain_model(rec) -> RecModel:
    """The published composition without OverArch and value model: the ANN's candidates by exact re-score."""
    built = rec.built
    return compose(built.spec.replace(overarch=None, value_model=None), dataclasses.replace(built.parts, overarch=None))


def hybrid_inputs(rec, handler, requests, *, k, sources=None, **kw):
    """RecModel's inputs (the predictor's encoding) with the history rows and source flags."""
    args = model_inputs(handler, requests, k=k, **kw)
    hist = [handler.rows(rec.logs.history(r["user_id"]) if "user_id" in r else r["history"], "history") for r in requests]
    history, flags = request_tensors(hist, [sources] * len(requests), SOURCES)
    return (*args[:10], history, flags, *args[12:])


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return rec_setup(tmp_path_factory)


@pytest.fixture(scope="module")
def hybrid(rec):
    return hybrid_model(rec)


def test_merge_sources_matches_python_sets():
    g = torch.Generator().manual_seed(0)
    B, K, Wd, N = 6, 9, 7, 25
    ann = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(B)])
    gen = torch.stack([torch.randperm(N, generator=g)[:Wd] for _ in range(B)])
    ann[ann % 4 == 0] = -1  # padding anywhere
    gen[:, -2:] = -1
    gen[0] = -1
    scores = torch.randn(B, Wd, generator=g)
    ann_lp = torch.randn(B, K, generator=g)
    rows, found, gscore = merge_sources(ann, ann_lp, gen, scores)
    assert rows.shape == found.shape == gscore.shape == (B, K + Wd)
    for b in range(B):
        a = {int(x): float(v) for x, v in zip(ann[b], ann_lp[b]) if x >= 0}
        s = {int(x): float(v) for x, v in zip(gen[b], scores[b]) if x >= 0}
        got = [int(x) for x in rows[b] if x >= 0]
        assert len(got) == len(set(got)) and set(got) == set(a) | set(s)
        for j, r in enumerate(rows[b].tolist()):
            if r < 0:
                assert found[b, j] == 0 and gscore[b, j] == float("-inf")
                continue
            assert int(found[b, j]) == (FOUND_ANN if r in a else 0) | (FOUND_GENERATIVE if r in s else 0)
            assert float(gscore[b, j]) == max(s.get(r, float("-inf")), a.get(r, float("-inf")))


def _gen_alone(hybrid, args):
    """The stand-alone decode of the same requests: GenerativeRetrieval with a caller-built bitmask
    (the exact forward index's filter, the history excluded), item ids -> canonical rows."""
    src = hybrid.sources.decode.generative
    exclude, vops, vrows, history = args[3], args[6], args[7], args[10]
    allowed = src.allowed_rows(hybrid.sources.ann.index.bits, vops, vrows, exclude)
    bitmask = pack_bits(allowed[:, src.trie_to_canon])
    with torch.inference_mode():
        ids, scores = src.retrieval(src.history_tokens(history), bitmask)
    return ids, scores


def _row_sets(rows):
    return [set(r[r >= 0].tolist()) for r in rows]


def test_union_equals_the_two_sources_run_alone(rec, hybrid):
    handler = rec.snap().rec_handler()
    requests = [{"user_id": u} for u in users(rec, 4, start=5)]
    requests[1]["filter"] = "NOT cat = c0"
    requests[2]["filter"] = "tags IN (t1, t3)"
    K1 = hybrid.spec.candidates or T * K0
    args = hybrid_inputs(rec, handler, requests, k=K1 + W, nprobe=2)
    ids, scores, tasks, rows, by, src_scores = run(hybrid, args)
    ann_rows = run(plain_model(rec), model_inputs(handler, requests, k=K1, nprobe=2))[3]
    gen_ids, gen_scores = _gen_alone(hybrid, args)
    row_of = {int(i): r for r, i in enumerate(rec.built.parts.index.row_to_item.tolist())}
    for b in range(len(requests)):
        a = set(ann_rows[b][ann_rows[b] >= 0].tolist())
        g = {row_of[int(i)]: float(s) for i, s in zip(gen_ids[b], gen_scores[b]) if i >= 0}
        assert a and g, "both sources found items"
        got = rows[b][rows[b] >= 0].tolist()
        assert len(got) == len(set(got)) and set(got) == a | set(g), f"request {b}"
        for j, r in enumerate(rows[b].tolist()):
            if r < 0:
                continue
            assert int(by[b, j]) == (FOUND_ANN if r in a else 0) | (FOUND_GENERATIVE if r in g else 0)
            if r in g:  # an ANN-only row's log-prob: tests/test_generative.py (exact or a bound)
                assert float(src_scores[b, j, 1]) == pytest.approx(g[r], abs=1e-5)
            assert float(src_scores[b, j, 1]) > float("-inf")
            assert (src_scores[b, j, 0] > float("-inf")) == (r in a)
    # each source alone through the hybrid's own switch gives that source's candidates
    only_ann = run(hybrid, hybrid_inputs(rec, handler, requests, k=K1 + W, nprobe=2, sources=["ann"]))
    only_gen = run(hybrid, hybrid_inputs(rec, handler, requests, k=K1 + W, nprobe=2, sources=["generative"]))
    assert _row_sets(only_ann[3]) == _row_sets(ann_rows)
    assert _row_sets(only_gen[3]) == [{row_of[int(i)] for i in g[g >= 0].tolist()} for g in gen_ids]
    assert bool((only_ann[4][only_ann[3] >= 0] == FOUND_ANN).all())
    assert bool((only_ann[5][:, :, 1] == float("-inf")).all()), "the decode switched off adds no log-prob"
    assert bool((only_gen[4][only_gen[3] >= 0] == FOUND_GENERATIVE).all())


def test_ranking_of_the_union_equals_rank_on_the_union(rec, hybrid):
    """The top-k is the best k of the union by the model's own value (RecModel.rank on those rows)."""
    handler = rec.snap().rec_handler()
    requests = [{"user_id": u} for u in users(rec, 3, start=11)]
    K1 = hybrid.spec.candidates or T * K0
    full = run(hybrid, hybrid_inputs(rec, handler, requests, k=K1 + W, nprobe=2))
    top = run(hybrid, hybrid_inputs(rec, handler, requests, k=10, nprobe=2))
    values, lengths, dense = model_inputs(handler, requests, k=10)[:3]
    with torch.inference_mode():
        value, task_scores = hybrid.rank(values, lengths, dense, full[3])
    for b in range(len(requests)):
        best = torch.sort(value[b], descending=True).values[:10]
        torch.testing.assert_close(top[1][b], best, rtol=1e-5, atol=1e-5)
        assert set(top[3][b].tolist()) <= set(full[3][b].tolist())


def test_generative_weight_ranks_by_value_plus_weighted_log_prob(rec, hybrid):
    """With generative_weight w the top-k is the best k of the union by value + w * the decoder's
    log-prob of each row (reference: numpy over the union run with w = 0, whose outputs give each
    candidate's value and log-prob)."""
    handler = rec.snap().rec_handler()
    requests = [{"user_id": u} for u in users(rec, 4, start=5)]
    K1 = hybrid.spec.candidates or T * K0
    full = run(hybrid, hybrid_inputs(rec, handler, requests, k=K1 + W, nprobe=2))
    weighted = hybrid_model(rec, weight=2.0)
    top = run(weighted, hybrid_inputs(rec, handler, requests, k=10, nprobe=2))
    value, rows, logp = full[1].numpy(), full[3].numpy(), full[5][:, :, 1].numpy()
    fused_any = False
    for b in range(len(requests)):
        real = rows[b] >= 0
        assert np.isfinite(logp[b][real]).all()
        fused = value[b][real] + 2.0 * logp[b][real]
        order = np.argsort(-fused, kind="stable")[:10]
        np.testing.assert_allclose(top[1][b].numpy()[: len(order)], fused[order], rtol=1e-5, atol=1e-4)
        assert set(top[3][b].tolist()) - {-1} <= set(rows[b][real].tolist())
        fused_any |= top[3][b].tolist() != full[3][b, :10].tolist()
    assert fused_any, "the weighted log-prob changed no request's top 10: the test cannot tell w from 0"


def test_every_returned_item_passes_its_filter_from_both_sources(rec, hybrid):
    handler = rec.snap().rec_handler()
    fwd = ForwardIndex.from_lists(rec.logs.features)  # pool rows = items.parquet order
    us = users(rec, len(FILTERS), start=20)
    requests = [{"user_id": u, "filter": f} for u, f in zip(us, FILTERS)]
    ids, _, _, rows, by, _ = run(hybrid, hybrid_inputs(rec, handler, requests, k=40, nprobe=2))
    seen = 0
    for b, (u, f) in enumerate(zip(us, FILTERS)):
        allowed = set(rec.logs.item_ids[fwd.evaluate(f).numpy()].tolist())
        got = ids[b][ids[b] >= 0].tolist()
        assert set(got) <= allowed, f"{f!r}: {sorted(set(got) - allowed)} fail the filter"
        assert not set(got) & set(rec.logs.history(u)), "history items are excluded from both sources"
        seen |= int(by[b].max())
        if f == "cat = c99":
            assert got == []
    assert seen == FOUND_ANN | FOUND_GENERATIVE, "both sources returned items"


@pytest.mark.parametrize("batch", [1, 16])
def test_export_and_torchscript_equal_eager(rec, hybrid, batch):
    handler = rec.snap().rec_handler()
    programs = _programs(rec, hybrid, UserFeatureSpec.from_json(handler.config["user_features"]))
    requests = [{"user_id": u, "filter": FILTERS[i % len(FILTERS)]} for i, u in enumerate(users(rec, batch, start=40))]
    args = hybrid_inputs(rec, handler, requests, k=15, nprobe=2)
    eager = run(hybrid, args)
    for name, module in programs.items():
        got = run(module, args)
        for e, g, what in zip(eager, got, ["ids", "scores", "task scores", "rows", "found_by", "source scores"]):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=f"{name} {what} at batch {batch}")
    assert bool((eager[0] >= 0).any())


_PROGRAMS = {}


def _programs(rec, hybrid, spec):
    """The hybrid exported (publish's RecModel example and shapes, extended) and scripted, once."""
    if not _PROGRAMS:
        example = model_example(hybrid, spec, rec.built.parts)
        _PROGRAMS["export"] = export_program(hybrid, example, dynamic_shapes(len(spec.keys))).module()
        _PROGRAMS["torchscript"] = scriptable(hybrid)
    return _PROGRAMS


def test_predictor_encodes_histories_and_sources(rec, hybrid):
    """RecHandler on a hybrid snapshot's config: the same answer as the forward on hand-built inputs;
    per-request sources; `sources` in the JSON; bad source names are named errors."""
    from silverrec.errors import QueryError
    from silverrec.serving.recommend import RecHandler

    snap_handler = rec.snap().rec_handler()
    cfg = dict(snap_handler.config, spec=hybrid.spec.to_json(), generative={"beam_width": W})
    handler = RecHandler(cfg, hybrid, snap_handler.row_to_item, _item_csr(rec), snap_handler.users)
    us = users(rec, 3, start=50)
    requests = [{"user_id": us[0]}, {"user_id": us[1], "sources": ["generative"], "filter": "NOT cat = c0"},
                {"history": rec.logs.history(us[2])[-5:], "sources": ["ann"]}]
    res = handler.recommend(requests, k=8, nprobe=2)
    want = [run(hybrid, hybrid_inputs(rec, handler, [r], k=8, nprobe=2, sources=r.get("sources"))) for r in requests]
    for b, w in enumerate(want):
        assert torch.equal(res.item_ids[b], w[0][0]) and torch.equal(res.found_by[b], w[4][0])
    assert set(res.found_by[1].tolist()) == {FOUND_GENERATIVE} and set(res.found_by[2].tolist()) == {FOUND_ANN}
    js = res.to_json()["sources"]
    assert js[1][0] == ["generative"] and js[2][0] == ["ann"]
    with pytest.raises(QueryError, match="request 0: sources"):
        handler.recommend([{"user_id": us[0], "sources": ["bm25"]}], k=5)
    with pytest.raises(QueryError, match="request 0: sources"):
        handler.recommend([{"user_id": us[0], "sources": []}], k=5)
    with pytest.raises(QueryError, match="one retrieval source"):
        snap_handler.recommend([{"user_id": us[0], "sources": ["generative"]}], k=5)


def _item_csr(rec):
    import numpy as np

    from silverrec.serving.recommend import ITEMS_FILE

    with np.load(rec.snap_dir / ITEMS_FILE, allow_pickle=False) as f:
        order = rec.snap().config["item_feature_order"]
        return {name: (f[f"offsets_{i}"], f[f"codes_{i}"]) for i, name in enumerate(order)}


def test_publish_config_names_the_sources(rec):
    from silverrec.publish.config import ConfigError
    from silverrec.publish.rec import PublishConfig

    assert PublishConfig(checkpoint="c").sources == ["ann"]
    PublishConfig(checkpoint="c", sources=["ann", "generative"], generative_checkpoint="g")
    for bad, match in [({"sources": ["generative"], "generative_checkpoint": "g"}, "sources must list 'ann'"),
                       ({"sources": ["ann", "bm25"]}, "sources must list"),
                       ({"sources": ["ann", "generative"]}, "go together"),
                       ({"generative_checkpoint": "g"}, "go together"),
                       ({"sources": ["ann", "generative"], "generative_checkpoint": "g", "beam_width": 0}, "beam_width"),
                       ({"source_priority": "first"}, "source_priority"),
                       ({"sources": ["ann", "generative"], "generative_checkpoint": "g", "validation_checkpoint": "v"},
                        "go together"),
                       ({"validation_checkpoint": "v", "validation_generative_checkpoint": "vg"}, "go together")]:
        with pytest.raises(ConfigError, match=match):
            PublishConfig(checkpoint="c", **bad)


def _fused(rec, weight, priority):
    """The hybrid composed with another fusion."""
    return hybrid_model(rec, weight=weight, priority=priority)


def _union(rec, hybrid, handler, requests):
    """publish/fusion.py's union tensors of `requests`, from the neutral fusion's forward (w 0, none)."""
    K1 = hybrid.spec.candidates or T * K0
    full = run(hybrid, hybrid_inputs(rec, handler, requests, k=K1 + W, nprobe=2))
    return {"item_ids": full[0], "value": full[1], "log_prob": full[5][:, :, 1], "found_by": full[4]}


def test_fusion_grid_ranks_as_the_forward_does(rec, hybrid):
    """publish/fusion.py ranks each grid point and each source alone from one neutral forward
    (fused_topk); it must return what the model with that fusion returns when asked for that source."""
    from silverrec.publish.fusion import fused_topk

    handler = rec.snap().rec_handler()
    requests = [{"user_id": u} for u in users(rec, 5, start=7)]
    u = _union(rec, hybrid, handler, requests)
    changed = set()
    for weight, priority in [(2.0, "none"), (0.5, "ann"), (1.0, "generative"), (4.0, "both")]:
        model = _fused(rec, weight, priority)
        for source, names in [("hybrid", None), ("ann", ["ann"]), ("generative", ["generative"])]:
            got = run(model, hybrid_inputs(rec, handler, requests, k=10, nprobe=2, sources=names))[0]
            want = fused_topk(u, source, weight, priority, k=10)
            assert torch.equal(got, want), (weight, priority, source)
            if source == "hybrid":
                changed.add(tuple(got.flatten().tolist()))
    assert len(changed) >= 3, "the fusions tried rank alike: the test cannot tell them apart"


def test_source_priority_ranks_a_source_first(rec, hybrid):
    """Priority "generative" returns the decode alone's top-k (k <= W) at every w, "ann" the ANN
    alone's at w = 0 (the ANN alone ranks by value) and the ANN's rows first at any w, "both" the rows
    both sources found first; scores stay value + w * log-prob (the order's key is not returned)."""
    handler = rec.snap().rec_handler()
    requests = [{"user_id": u} for u in users(rec, 6, start=30)]
    for weight, priority, alone in [(0.0, "ann", ["ann"]), (0.0, "generative", ["generative"]),
                                    (2.0, "generative", ["generative"])]:
        model = _fused(rec, weight, priority)
        got = run(model, hybrid_inputs(rec, handler, requests, k=10, nprobe=2))
        want = run(model, hybrid_inputs(rec, handler, requests, k=10, nprobe=2, sources=alone))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (weight, priority)
    ann_first = run(_fused(rec, 2.0, "ann"), hybrid_inputs(rec, handler, requests, k=10, nprobe=2))
    assert bool((ann_first[4] & FOUND_ANN != 0).all())
    both = run(_fused(rec, 2.0, "both"), hybrid_inputs(rec, handler, requests, k=10, nprobe=2))
    neutral = run(_fused(rec, 2.0, "none"), hybrid_inputs(rec, handler, requests, k=hybrid.spec.candidates + W, nprobe=2))
    for b in range(len(requests)):
        n_both = int((neutral[4][b] == FOUND_ANN | FOUND_GENERATIVE).sum())
        first = both[4][b][: min(n_both, 10)]
        assert bool((first == FOUND_ANN | FOUND_GENERATIVE).all())
    assert any(int((neutral[4][b] == 3).sum()) > 0 for b in range(len(requests))), "no row found by both sources"
    with pytest.raises(ValueError, match="source priority"):
        priority_tiers("first")


def test_choose_fusion_takes_the_best_validation_row_and_checks_its_checkpoints():
    from silverrec.publish.config import ConfigError
    from silverrec.publish.fusion import check_validation_checkpoints, choose

    grid = [{"weight": w, "priority": p, "hybrid": {"NDCG@10": v}} for w, p, v in
            [(0.0, "none", 0.02), (1.0, "none", 0.03), (1.0, "both", 0.03), (2.0, "ann", 0.01)]]
    assert (choose(grid)["weight"], choose(grid)["priority"]) == (1.0, "none")  # the first of equals
    check_validation_checkpoints({"config": {"stage": "valid", "seed": 1}}, {"train_config": {"stage": "valid", "seed": 1}}, "x")
    with pytest.raises(ConfigError, match="stage 'test'"):
        check_validation_checkpoints({"config": {"stage": "test", "seed": 1}}, {"train_config": {"stage": "valid", "seed": 1}}, "x")
    with pytest.raises(ConfigError, match="validation_generative_checkpoint was trained at stage 'test'"):
        check_validation_checkpoints({"config": {"stage": "valid", "seed": 1}}, {"train_config": {"stage": "test", "seed": 1}}, "x")
    with pytest.raises(ConfigError, match="different seeds"):
        check_validation_checkpoints({"config": {"stage": "valid", "seed": 1}}, {"train_config": {"stage": "valid", "seed": 2}}, "x")


def test_publish_chooses_the_fusion_on_held_out_validation_items(rec, tmp_path):
    """Publish with stage-"valid" checkpoints: the manifest's grid has every (w, priority), the chosen
    row is its best hybrid NDCG@10 and is >= each source alone's there, the model carries the choice,
    and the grid's ANN-alone figures equal a plain (ANN-only) RecModel of the validation checkpoint
    evaluated by publish/quality.py at stage "valid" (the independent reference)."""
    from silverrec.publish import fusion
    from silverrec.publish.logs import leave_one_out, read_logs
    from silverrec.publish.quality import evaluate_handler, handler_for
    from silverrec.publish.rec import build_rec_model
    from silverrec.publish.train import TrainConfig, train
    from silverrec.publish.train_generative import TrainConfig as GenConfig, train as train_generative

    tiny = dict(levels=2, codes=4, minutes=1e6, max_steps=20, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                ffn_hidden=32, max_history=4, eval_users=4, eval_beam=10)
    tt, gen = tmp_path / "tt_valid.ckpt", tmp_path / "gen_valid.ckpt"
    train(TrainConfig.from_toml(rec.train_toml, stage="valid"), tt, quiet_eval=True)
    train_generative(GenConfig(interactions=str(rec.inter_path), items=str(rec.items_path), embeddings=str(tt),
                               stage="valid", **tiny), gen)
    # (the snapshot's own decoder: any over the pool; the validation one saves a training)
    cfg = dataclasses.replace(rec.publish_cfg, sources=list(SOURCES), generative_checkpoint=str(gen), beam_width=W,
                              validation_checkpoint=str(tt), validation_generative_checkpoint=str(gen))
    built = build_rec_model(cfg)
    chosen = built.manifest["generative"]["fusion"]
    grid = chosen["grid"]
    assert len(grid) == len(fusion.WEIGHTS) * len(PRIORITIES) and chosen["chosen_on"] == "valid"
    best = max(r["hybrid"]["NDCG@10"] for r in grid)
    assert chosen["validation"]["hybrid"]["NDCG@10"] == best
    assert best >= max(chosen["validation"]["ann"]["NDCG@10"], chosen["validation"]["generative"]["NDCG@10"])
    assert built.spec.generative_weight == chosen["weight"] and built.spec.source_priority == chosen["priority"]
    assert torch.equal(built.model.top_k.tiers, priority_tiers(chosen["priority"]))
    plain = build_rec_model(dataclasses.replace(rec.publish_cfg, checkpoint=str(tt)))
    split = leave_one_out(read_logs(rec.inter_path, rec.items_path, seed=rec.train_cfg.seed))
    want = evaluate_handler(handler_for(plain), split, "valid")
    for key in ("HR@10", "NDCG@10", "HR@100"):
        assert grid[0]["ann"][key] == pytest.approx(want[key], abs=1e-5), key
    assert want["HR@100"] > 0, "the reference found no validation item: the comparison cannot fail"
