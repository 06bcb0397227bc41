"""Next-item transitions (silverrec/retrieval/transitions.py, publish/transitions.py).

- The tables equal a plain count of consecutive pairs (P, the order of successors, the tie rule).
- A model with transitions answers as a reference built here from the model without them: the
  union of its candidates and the newest history item's successors that pass the filter and are
  not excluded, each ranked by its value (the `rank` entry point) + w * P.
- Exported and scripted programs equal eager; publish chooses the weight on validation items and
  records it; a bad config or spec is refused, naming the field.

The model is the tiny trained one of tests/rec_fixtures.py."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

from silverrec.compose import CompositionError, compose
from silverrec.errors import SnapshotError
from silverrec.filtering.forward_index import ForwardIndex
from silverrec.publish.config import ConfigError
from silverrec.publish.quality import handler_for
from silverrec.publish.rec import stored_histories
from silverrec.publish.transitions import transition_tables, validation_histories
from silverrec.spec import ModelSpec

from tests.rec_fixtures import K0, N_ITEMS, TASKS, publish_keeping_model, rec_setup
from tests.test_rec_model import model_inputs, run, users

M = 6
W = 50.0  # large beside the tiny model's values, so that the successors reorder the lists


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return rec_setup(tmp_path_factory)


def plain_chain(histories: list[list[int]], window: int = 1, decay: float = 1.0
                ) -> tuple[dict[int, list[tuple[int, float]]], Counter]:
    """row -> [(successor, P)] sorted by P desc, then popularity desc, then row; and popularity. A
    successor is j at d <= window steps after i in one history, weighing decay ** (d - 1)."""
    weight: dict[tuple[int, int], float] = {}
    pop: Counter = Counter()
    for h in histories:
        pop.update(h)
        for e in range(len(h)):
            for d in range(1, window + 1):
                if e + d < len(h):
                    weight[(h[e], h[e + d])] = weight.get((h[e], h[e + d]), 0.0) + decay ** (d - 1)
    out: dict[int, list[tuple[int, float]]] = {}
    for (i, j), c in weight.items():
        out.setdefault(i, []).append((j, c))
    for i, succ in out.items():
        total = sum(c for _, c in succ)
        out[i] = sorted(((j, c / total) for j, c in succ), key=lambda x: (-x[1], -pop[x[0]], x[0]))
    return out, pop


@pytest.mark.parametrize("window, decay", [(1, 1.0), (3, 0.5)])
def test_tables_equal_a_plain_count_of_pairs(window, decay):
    rng = np.random.default_rng(3)
    n = 40
    histories = [rng.integers(0, n, rng.integers(0, 12)).tolist() for _ in range(60)]
    offsets = np.cumsum([0] + [len(h) for h in histories])
    flat = np.concatenate([np.asarray(h, dtype=np.int64) for h in histories])
    rows, prob = transition_tables(offsets, flat, n, 4, window, decay)
    chain, _ = plain_chain(histories, window, decay)
    assert rows.shape == (n, 4) and rows.dtype == torch.int64 and prob.dtype == torch.float32
    for i in range(n):
        want = chain.get(i, [])[:4]
        # (decay 0.5: every weight and sum is exact, so equal P are equal on both sides and the tie rule decides)
        assert rows[i].tolist() == [j for j, _ in want] + [-1] * (4 - len(want)), i
        np.testing.assert_allclose(prob[i].numpy(), [p for _, p in want] + [0.0] * (4 - len(want)), rtol=1e-6)
    with pytest.raises(ValueError, match="transitions must be >= 1"):
        transition_tables(offsets, flat, n, 0)
    with pytest.raises(ValueError, match="transition_window must be >= 1"):
        transition_tables(offsets, flat, n, 4, 0)


def test_validation_histories_hold_out_each_newest_item():
    offsets, rows = np.array([0, 3, 4, 4, 6]), np.array([5, 6, 7, 8, 9, 1])
    v_off, v_rows, targets = validation_histories(offsets, rows)
    assert v_off.tolist() == [0, 2, 2, 2, 3] and v_rows.tolist() == [5, 6, 9] and targets.tolist() == [7, -1, -1, 1]


def canonical_histories(rec) -> tuple[np.ndarray, np.ndarray]:
    """The checkpoint's stored histories as canonical rows, mapped here (plain dict lookups)."""
    row_of = {int(i): r for r, i in enumerate(rec.built.row_to_item.tolist())}
    users = rec.ckpt["users"]
    return np.asarray(users["offsets"], dtype=np.int64), np.asarray([row_of[int(i)] for i in users["item_ids"]])


def test_stored_histories_map_item_ids_to_canonical_rows(rec):
    offsets, rows = stored_histories(rec.ckpt["users"], rec.built.row_to_item)
    want_offsets, want_rows = canonical_histories(rec)
    assert offsets.tolist() == want_offsets.tolist() and rows.tolist() == want_rows.tolist()


@pytest.fixture(scope="module")
def chained(rec):
    """The published composition with M successors per item and weight W (tables fitted here)."""
    offsets, rows = canonical_histories(rec)
    tables = transition_tables(offsets, rows, N_ITEMS, M)
    parts = dataclasses.replace(rec.built.parts, transitions=tables)
    return compose(rec.built.spec.replace(transitions=M, transition_weight=W), parts), tables


def reference_answer(rec, tables, request: dict, k: int, allowed: set[int] | None) -> dict[int, float]:
    """item id -> score of the reference ranking: the model without transitions' candidates (all of
    them) plus the newest history row's successors that pass the filter and are not excluded, each
    scored by the `rank` entry point's value + W * P(row | newest row)."""
    handler = rec.snap().rec_handler()
    base = run(rec.built.model, model_inputs(handler, [request], k=len(TASKS) * K0))
    ann_rows = [r for r in base[3][0].tolist() if r >= 0]
    hist = request["history"] if "history" in request else rec.logs.history(request["user_id"])
    row_of = {int(i): r for r, i in enumerate(rec.built.row_to_item.tolist())}
    last = row_of[int(hist[-1])]
    known = {row_of[int(i)] for i in list(hist) + list(request.get("exclude", []))}
    succ = {int(j): float(p) for j, p in zip(tables[0][last].tolist(), tables[1][last].tolist()) if j >= 0}
    ids = rec.built.row_to_item
    extra = [j for j in succ if j not in ann_rows and j not in known and (allowed is None or int(ids[j]) in allowed)]
    cand = ann_rows + extra
    values, lengths, dense, _ = handler.encode([handler_request(request)], False, int(handler.config["exclude_limit"]))
    with torch.inference_mode():
        value, _ = rec.built.model.rank(values, lengths, dense, torch.tensor([cand]))
    return {int(ids[r]): float(v) + W * succ.get(r, 0.0) for r, v in zip(cand, value[0].tolist())}


def handler_request(request):
    from silverrec.serving.recommend import RecRequest

    return RecRequest.coerce({key: v for key, v in request.items() if key != "filter"}, "request")


def test_the_answer_is_the_union_ranked_by_value_plus_w_times_p(rec, chained):
    model, tables = chained
    handler = rec.snap().rec_handler()
    fwd = ForwardIndex.from_lists(rec.logs.features)
    us = users(rec, 6, start=10)
    requests = [{"user_id": us[0]}, {"history": rec.logs.history(us[1])[-9:]},
                {"user_id": us[2], "filter": "NOT cat = c0"}, {"user_id": us[3], "exclude": rec.logs.history(us[4])[:4]},
                {"history": rec.logs.history(us[5])[-3:], "filter": "tags IN (t1, t3) OR cat = c2"}]
    k = 15
    args = list(model_inputs(handler, requests, k=k))
    row_of = {int(i): r for r, i in enumerate(rec.built.row_to_item.tolist())}
    newest = [(r["history"] if "history" in r else rec.logs.history(r["user_id"]))[-1] for r in requests]
    args[10] = torch.tensor([[row_of[int(i)]] for i in newest])
    ids, scores = run(model, tuple(args))[:2]
    gained = 0
    for b, r in enumerate(requests):
        allowed = set(rec.logs.item_ids[fwd.evaluate(r["filter"]).numpy()].tolist()) if "filter" in r else None
        ref = reference_answer(rec, tables, r, k, allowed)
        got = [int(i) for i in ids[b].tolist() if i >= 0]
        want = sorted(ref, key=lambda i: -ref[i])[:k]
        np.testing.assert_allclose(scores[b][:len(got)].numpy(), [ref[i] for i in got], atol=1e-4, rtol=1e-5)
        assert len(got) == min(k, len(ref))
        # the same list up to ties: the k-th reference score bounds every returned one from below
        assert all(ref[i] >= ref[want[-1]] - 1e-4 for i in got), b
        gained += len(set(got) - set(run(rec.built.model, model_inputs(handler, [r], k=k))[0][0].tolist()))
    assert gained > 0  # the chain changed some list (else this test shows nothing)


def test_rank_scores_given_items_as_the_answer_ranks_them(rec, chained):
    """The `rank` entry point with transitions: the value of the model without them + W * P(item | the
    newest history item), P looked up here in the tables; a request without a history (no newest row)
    gets the value alone; and a recommended list ranked again gets the scores `forward` gave it."""
    model, tables = chained
    handler = rec.snap().rec_handler()
    row_of = {int(i): r for r, i in enumerate(rec.built.row_to_item.tolist())}
    us = users(rec, 3, start=20)
    requests = [{"user_id": us[0]}, {"history": rec.logs.history(us[1])[-4:]}, {"user_id": us[2]}]
    cand = torch.tensor([[row_of[int(i)] for i in rec.logs.item_ids[:30]]] * 3)
    last = [row_of[int((r["history"] if "history" in r else rec.logs.history(r["user_id"]))[-1])] for r in requests]
    cand[:, :3] = tables[0][last][:, :3]  # three successors of each newest item among the given rows
    cand[2, -1] = -1  # padding stays padding
    values, lengths, dense, _ = handler.encode([handler_request(r) for r in requests], False, 8)
    with torch.inference_mode():
        got = model.rank(values, lengths, dense, cand)[0]
        base = rec.built.model.rank(values, lengths, dense, cand)[0]
    gained = 0
    for b in range(3):
        succ = {int(j): float(p) for j, p in zip(tables[0][last[b]].tolist(), tables[1][last[b]].tolist()) if j >= 0}
        want = [float(v) + W * succ.get(int(r), 0.0) if r >= 0 else float("-inf")
                for r, v in zip(cand[b].tolist(), base[b].tolist())]
        np.testing.assert_allclose(got[b].numpy(), want, rtol=1e-5, atol=1e-4)
        gained += sum(int(r) in succ for r in cand[b].tolist())
    assert gained >= 9
    values, lengths, dense, _ = handler.encode([handler_request({"history": []})], False, 8)
    with torch.inference_mode():  # no history, no newest row: the value alone
        torch.testing.assert_close(model.rank(values, lengths, dense, cand[:1])[0],
                                   rec.built.model.rank(values, lengths, dense, cand[:1])[0])
    args = list(model_inputs(handler, requests[:1], k=10))
    args[10] = torch.tensor([[last[0]]])
    ids, scores = run(model, tuple(args))[:2]
    rows = torch.tensor([[row_of[int(i)] for i in ids[0].tolist() if i >= 0]])
    with torch.inference_mode():
        again = model.rank(*model_inputs(handler, requests[:1], k=10)[:3], rows)[0]
    np.testing.assert_allclose(again[0].numpy(), scores[0][:rows.shape[1]].numpy(), rtol=1e-5, atol=1e-4)


def test_no_history_means_the_value_alone(rec, chained):
    model, _ = chained
    handler = rec.snap().rec_handler()
    u = users(rec, 1, start=40)[0]
    args = model_inputs(handler, [{"user_id": u}], k=10)  # history column -1: no newest row
    with_chain, without = run(model, args), run(rec.built.model, args)
    torch.testing.assert_close(with_chain[0], without[0], rtol=0, atol=0)
    torch.testing.assert_close(with_chain[1], without[1], rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def published(rec, tmp_path_factory):
    from silverrec.publish.rec import PublishConfig

    cfg = PublishConfig(checkpoint=str(rec.ckpt_path), overarch="mol", value_model=rec.publish_cfg.value_model, k0=K0,
                        nlist=rec.publish_cfg.nlist, transitions=M)
    return publish_keeping_model(cfg, tmp_path_factory.mktemp("chain") / "snap")


def test_publish_chooses_the_weight_and_the_programs_equal_eager(rec, published):
    import silverrec

    snap_dir, built = published
    choice = built.manifest["transitions"]
    assert choice["per_item"] == M and choice["chosen_on"] == "validation"
    best = max(g["NDCG@10"] for g in choice["grid"])
    assert choice["weight"] in [g["weight"] for g in choice["grid"] if g["NDCG@10"] == best]
    tables = choice["tables"]  # window and decay "auto": each table's best, the chosen one the best of them
    assert [(t["window"], t["decay"]) for t in tables] == [(1, 1.0)] + [(w, d) for w in (2, 3, 5, 10, 20)
                                                                        for d in (0.5, 0.8, 1.0)]
    assert choice["NDCG@10"] == max(t["NDCG@10"] for t in tables)
    first = next(t for t in tables if t["NDCG@10"] == choice["NDCG@10"])
    assert (choice["window"], choice["decay"]) == (first["window"], first["decay"])
    assert built.spec.transitions == M and built.spec.transition_weight == pytest.approx(choice["weight"])
    us = users(rec, 3, start=50)
    requests = [{"user_id": us[0]}, {"history": rec.logs.history(us[1])[-5:], "filter": "NOT cat = c1"},
                {"user_id": us[2]}]
    eager = handler_for(built)  # the composition publish exported, run by the predictor's own code
    want = eager.recommend(requests, k=12)
    items = [int(i) for i in want.item_ids[0].tolist()[::-1]] + [int(rec.logs.item_ids[0])]  # its list, reordered
    ranked = eager.rank(requests[0], items)
    torch.testing.assert_close(ranked.scores[0, :12], want.scores[0].flip(0), rtol=1e-5, atol=1e-5)
    for backend in ("export", "torchscript"):
        snap = silverrec.load(snap_dir, backend=backend)
        res = snap.recommend(requests, k=12)
        torch.testing.assert_close(res.item_ids, want.item_ids, rtol=0, atol=0, msg=backend)
        torch.testing.assert_close(res.scores, want.scores, rtol=1e-5, atol=1e-5, msg=backend)
        torch.testing.assert_close(snap.rank(requests[0], items).scores, ranked.scores, rtol=1e-5, atol=1e-5,
                                   msg=backend)


def test_the_grid_figures_are_the_served_lists_figures(rec, published):
    """The choice reranks one forward's candidates per w: its figures for the chosen table at w = 0 and at
    the largest w of the grid equal those of the model composed with that table and w, served as a user
    would call it (top 100, the history excluded), NDCG@10 computed here."""
    from silverrec.publish.transitions import validation_users

    _, built = published
    choice = built.manifest["transitions"]
    offsets, rows = canonical_histories(rec)
    v_off, v_rows, targets = validation_histories(offsets, rows)
    us = validation_users(v_off, targets, rec.publish_cfg.seed)
    assert len(us) == choice["users"]
    tables = transition_tables(v_off, v_rows, N_ITEMS, M, choice["window"], choice["decay"])
    parts = dataclasses.replace(built.parts, transitions=tables)
    row_to_item = built.row_to_item
    for row in (choice["grid"][0], choice["grid"][-1]):
        model = compose(built.spec.replace(transition_weight=row["weight"]), parts)
        handler = handler_for(built, model)
        gains = []
        for u in us:
            hist = v_rows[v_off[u]:v_off[u + 1]]
            got = handler.recommend([{"history": row_to_item[hist].tolist()}], k=100,
                                    exclude_limit=len(set(hist.tolist()))).item_ids[0].tolist()
            target = int(row_to_item[targets[u]])
            gains.append(1 / np.log2(got.index(target) + 2) if target in got[:10] else 0.0)
        assert float(np.mean(gains)) == pytest.approx(row["NDCG@10"], abs=2e-5), row["weight"]


@pytest.mark.parametrize("changes, field", [
    ({"transitions": -1}, "spec.transitions"),
    ({"transition_weight": -0.5}, "spec.transition_weight"),
    ({"transition_weight": 1.0}, "spec.transitions must be >= 1"),
    ({"transitions": 4, "sources": ("ann", "generative")}, "the one source 'ann'"),
    ({"transitions": 4, "tower": "byo"}, "silverrec's own tower"),  # its requests may hold item ids, not rows
])
def test_spec_refuses_bad_transitions(changes, field):
    with pytest.raises(SnapshotError, match=field):
        ModelSpec(**{**dict(tower="two_tower", dim=16, nlist=8, tasks=("a",), cache=True), **changes})


def test_compose_and_config_name_the_bad_part(rec):
    from silverrec.publish.rec import PublishConfig

    spec, parts = rec.built.spec, rec.built.parts
    with pytest.raises(CompositionError, match="needs the part 'transitions'"):
        compose(spec.replace(transitions=M), parts)
    tables = transition_tables(*canonical_histories(rec), N_ITEMS, M)
    with pytest.raises(CompositionError, match="lists 6 next items per item, the spec says 5"):
        compose(spec.replace(transitions=5), dataclasses.replace(parts, transitions=tables))
    with pytest.raises(CompositionError, match="next_rows must be int64"):
        compose(spec.replace(transitions=M), dataclasses.replace(parts, transitions=(tables[0][:-1], tables[1][:-1])))
    for bad, match in [({"transitions": -2}, "transitions must be an int"),
                       ({"transitions": 4, "transition_weight": "big"}, "transition_weight must be"),
                       ({"transitions": 4, "transition_window": 0}, "transition_window must be"),
                       ({"transitions": 4, "transition_weight": 2.0}, "give the window and the decay too"),
                       ({"transitions": 4, "transition_weight": 2.0, "transition_window": 3},
                        "give the window and the decay too"),
                       ({"transitions": 4, "transition_decay": 1.5}, "transition_decay must be \"auto\" or a number in"),
                       ({"transitions": 4, "sources": ["ann", "generative"], "generative_checkpoint": "g"},
                        "one source is 'ann'")]:
        with pytest.raises(ConfigError, match=match):
            PublishConfig(checkpoint="c", **bad)
