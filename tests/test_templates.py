"""Filter templates (silverrec/filtering/template.py): filled in the model from the request's user
features, they answer exactly what the same filter written out by hand for each user answers.

The reference is independent of the template code: the hand-written filter string of each user is
compiled by the normal request path (filter_program.compile_request) and run by the same model
without a template. The synthetic logs of tests/rec_fixtures.py get a users.parquet here: each
user's favourite category (`fav_cat`, values shared with the items' `cat`), a few allowed tags
(`ok_tags`, multi-valued, shared with the items' `tags`) and a numeric `age`.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from silverrec.errors import QueryError
from silverrec.filtering.filter_lang import FilterSyntaxError
from silverrec.filtering.filter_program import FilterPlan
from silverrec.filtering.template import TemplateError, compile_template
from silverrec.retrieval.user_tower import UserFeatureSpec
from tests.rec_fixtures import K0, NLIST, TRAIN_TOML, make_logs, publish_keeping_model, write_logs

TEMPLATE = "cat = $user.fav_cat AND tags IN $user.ok_tags AND NOT item_id IN $history"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Train once (with user features), compose the eager model once, publish once with TEMPLATE."""
    return template_snapshot(tmp_path_factory.mktemp("templates"))


def template_snapshot(root):
    """The trained model with user features, published in `root` with TEMPLATE (tests/test_predictor.py too)."""
    os.environ.setdefault("SILVERREC_QUIET", "1")
    from silverrec.publish.rec import PublishConfig
    from silverrec.publish.train import TrainConfig, train

    logs = make_logs()
    write_logs(logs, root)
    rng = np.random.default_rng(3)
    ok_tags = [sorted({f"t{x}" for x in rng.choice(8, rng.integers(1, 4), replace=False)}) for _ in logs.user_ids]
    pq.write_table(pa.table({
        "user_id": pa.array(logs.user_ids, pa.int64()),
        "fav_cat": pa.array([f"c{p}" for p in logs.prefs], pa.string()),
        "ok_tags": pa.array(ok_tags, pa.list_(pa.string())),
        "age": pa.array(rng.uniform(18, 70, len(logs.user_ids)).astype(np.float32)),
    }), root / "users.parquet")
    (root / "train.toml").write_text('users = "users.parquet"\n' + TRAIN_TOML.format(k0=K0, steps=15, overarch_steps=5))
    train(TrainConfig.from_toml(root / "train.toml"), root / "model.ckpt", max_steps=15)
    cfg = PublishConfig(checkpoint=str(root / "model.ckpt"), overarch="none", k0=K0, nlist=NLIST, filter_template=TEMPLATE)
    snap_dir, built = publish_keeping_model(cfg, root / "snap")
    users = [{"user_id": int(u), "features": {"fav_cat": f"c{p}", "ok_tags": t}}
             for u, p, t in zip(logs.user_ids, logs.prefs, ok_tags)]
    return {"built": built, "snap_dir": snap_dir, "users": users, "root": root, "cfg": cfg}


def handler(setup, template_text=None):
    """A RecHandler over the eager model with `template_text` compiled in (None: no template)."""
    from silverrec.serving.recommend import RecHandler

    from silverrec.compose import compose
    from silverrec.publish.rec import record_composition

    built = setup["built"]
    plan, features = plan_spec(setup) if template_text is not None else (None, None)
    model = compose(built.spec.replace(template=template_text),
                    dataclasses.replace(built.parts, filter_plan=plan, user_features=features))
    manifest = dict(built.manifest, item_feature_order=list(built.item_csr))
    record_composition(manifest, model)
    return RecHandler(manifest, model, built.row_to_item, built.item_csr, built.users)


def plan_spec(setup):
    m = setup["built"].manifest
    return FilterPlan.from_config(m["filter"]), UserFeatureSpec.from_json(m["user_features"])


def by_hand(users, fill, extra=None):
    """The same requests, each with its template written out as a filter string."""
    out = []
    for r in users:
        text = fill(r["features"])
        out.append({**r, "filter": text if extra is None else f"({text}) AND ({extra})"})
    return out


def fill_main(f):
    return f"cat = {f['fav_cat']} AND tags IN ({', '.join(f['ok_tags'])})"


def assert_same(a, b):
    assert torch.equal(a.item_ids, b.item_ids)
    torch.testing.assert_close(a.scores, b.scores)


def test_published_template_equals_hand_written_filter_per_user(setup):
    """48 users (batches of 16, and batch 1), both backends of the published snapshot."""
    import silverrec

    ref = handler(setup)
    users = setup["users"][:48]
    want = [ref.recommend(by_hand(users[i:i + 16], fill_main), k=10) for i in range(0, len(users), 16)]
    assert (torch.cat([w.item_ids for w in want]) >= 0).sum() > 100  # the filter leaves answers to compare
    for backend in ("export", "torchscript"):
        snap = silverrec.load(setup["snap_dir"], backend=backend)
        for j, i in enumerate(range(0, len(users), 16)):
            assert_same(snap.recommend(users[i:i + 16], k=10), want[j])
        assert_same(snap.recommend(users[5], k=10), ref.recommend(by_hand(users[5:6], fill_main), k=10))


def test_template_results_pass_the_filter_and_skip_history(setup):
    """Independent of any compiled program: every returned item has the user's category and one of
    the user's tags, and no history item comes back even with exclude_history=False."""
    logs = make_logs()
    row = {int(i): r for r, i in enumerate(logs.item_ids)}
    h = handler(setup, TEMPLATE)
    got = h.recommend(setup["users"], k=10, exclude_history=False).item_ids
    for r, ids in zip(setup["users"], got.tolist()):
        hist = set(logs.history(r["user_id"]))
        for i in [i for i in ids if i >= 0]:
            assert logs.features["cat"][row[i]] == [r["features"]["fav_cat"]]
            assert set(logs.features["tags"][row[i]]) & set(r["features"]["ok_tags"])
            assert i not in hist


@pytest.mark.parametrize("template, fill", [
    ("NOT cat = $user.fav_cat OR tags = t0", lambda f: f"NOT cat = {f['fav_cat']} OR tags = t0"),
    ("tags NOT IN $user.ok_tags", lambda f: f"tags NOT IN ({', '.join(f['ok_tags'])})"),
    ("cat = c1 AND cat != $user.fav_cat", lambda f: f"cat = c1 AND cat != {f['fav_cat']}"),
])
def test_template_shapes_equal_hand_written(setup, template, fill):
    """Negated placeholders (exact planes), OR, literal terms beside placeholders, eager model."""
    ref, h = handler(setup), handler(setup, template)
    users = setup["users"][:24]
    assert_same(h.recommend(users, k=10), ref.recommend(by_hand(users, fill), k=10))


def test_request_filter_is_anded_with_the_template(setup):
    """A request's own filter ANDed: equal to `(template by hand) AND (request filter)`; and a user
    value outside the item vocabulary matches nothing, like a literal unknown value."""
    ref, h = handler(setup), handler(setup, TEMPLATE)
    users = [dict(r, filter="tags != t2") for r in setup["users"][:24]]
    assert_same(h.recommend(users, k=10), ref.recommend(by_hand(setup["users"][:24], fill_main, "tags != t2"), k=10))
    odd = [{"user_id": setup["users"][0]["user_id"], "features": {"fav_cat": "zz", "ok_tags": ["t1"]}}]
    assert (h.recommend(odd, k=10).item_ids == -1).all()
    assert (ref.recommend(by_hand(odd, fill_main), k=10).item_ids == -1).all()


@pytest.mark.parametrize("template, message", [
    ("cat = $user.nope", "unbound placeholder \\$user.nope"),
    ("cat = $country", "unbound placeholder \\$country"),
    ("cat = $user.age", "type mismatch: \\$user.age is a numeric user feature"),
    ("cat = $user.ok_tags", "type mismatch: no value of user feature 'ok_tags' is a value of item feature 'cat'"),
    ("color = $user.fav_cat", "unknown item feature 'color'"),
    ("item_id IN $history", "\\$history is only supported as a top-level AND term"),
    ("cat IN (c1, $user.fav_cat)", "mixes a placeholder with other values"),
])
def test_bad_templates_are_named_errors_at_compile(setup, template, message):
    with pytest.raises(TemplateError, match=message):
        compile_template(template, *plan_spec(setup))


def test_bad_template_fails_the_publish(setup):
    from silverrec.publish.rec import build_rec_model

    with pytest.raises(TemplateError, match="unbound placeholder"):
        build_rec_model(dataclasses.replace(setup["cfg"], filter_template="cat = $user.fav_category"))
    with pytest.raises(FilterSyntaxError):
        compile_template("cat = = $user.fav_cat", *plan_spec(setup))


def test_request_missing_a_bound_feature_is_a_named_error(setup):
    snap = handler(setup, TEMPLATE)
    r = setup["users"][0]
    with pytest.raises(QueryError, match="binds \\$user.ok_tags .* no user feature 'ok_tags'"):
        snap.recommend([r, {"user_id": r["user_id"], "features": {"fav_cat": "c1"}}], k=5)
    with pytest.raises(QueryError, match="'fav_cat' has 2 values; the filter template binds one"):
        snap.recommend({"user_id": r["user_id"], "features": {"fav_cat": ["c1", "c2"], "ok_tags": "t1"}}, k=5)


@pytest.mark.parametrize("extra", [None, "tags = t2", "tags != t2"])
def test_filled_posting_lists_equal_hand_written(setup, extra):
    """The template's posting-list choice (the cheapest AND term, per user) is the one the normal
    compiler makes for the hand-written filter: same lists, or none on both sides."""
    from silverrec.filtering.filter_program import compile_request
    from silverrec.serving.recommend import RecRequest

    h = handler(setup, TEMPLATE)
    plan, _ = plan_spec(setup)
    users = setup["users"][:24]
    reqs = [RecRequest.coerce(dict(r, filter=extra), "r") for r in users]
    values, lengths, _, _ = h.encode(reqs, True, 8)
    ops, rows, vops, vrows, lists = compile_request([extra] * len(users), plan)
    got = h.module.filter_template(values, lengths, ops, rows, vops, vrows, lists)[4]
    want = compile_request([r["filter"] for r in by_hand(users, fill_main, extra)], plan)[4]
    for g, w in zip(got.tolist(), want.tolist()):
        assert (g[0] == -2) == (w[0] == -2)
        if w[0] != -2:
            assert sorted(x for x in g if x >= 0) == sorted(x for x in w if x >= 0)
