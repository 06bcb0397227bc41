"""The composition root: `ModelSpec` (silverrec/spec.py) refuses configurations its stages do not
support, naming the field; `compose` (silverrec/compose.py) refuses parts that do not fit the spec,
naming the part; and the spec a snapshot records is the one its model was composed from (a model
re-composed from the stored spec and the same parts answers identically).

The parts are those of the tiny trained model of tests/rec_fixtures.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from silverrec.compose import CompositionError, compose
from silverrec.errors import SnapshotError
from silverrec.spec import ModelSpec

from tests.rec_fixtures import rec_setup
from tests.test_rec_model import model_inputs, run, users


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return rec_setup(tmp_path_factory)


BASE = dict(tower="two_tower", dim=16, nlist=8, tasks=("a", "b"), cache=True)


@pytest.mark.parametrize("changes, field", [
    ({"tower": "bert"}, "spec.tower"),
    ({"dim": 0}, "spec.dim"),
    ({"nlist": 0}, "spec.nlist"),
    ({"tasks": ()}, "spec.tasks"),
    ({"tasks": ("a", "a")}, "spec.tasks"),
    ({"sources": ("generative", "ann")}, "spec.sources"),
    ({"sources": ("bm25",)}, "spec.sources"),
    ({"merge": "sum"}, "spec.merge"),
    ({"overfetch": -1}, "spec.overfetch"),
    ({"source_priority": "first"}, "spec.source_priority"),
    ({"generative_weight": float("nan")}, "spec.generative_weight"),
    ({"cache": False}, "embedding cache"),  # a trained tower ranks cached candidates
    ({"rescore": True}, "spec.rescore"),
    ({"generative_weight": 1.0}, "spec.generative_weight"),  # a union's weight with one source
    ({"tower": "query", "tasks": ("q",)}, "'query'-tower"),  # a query tower with a cache
    ({"tower": "none", "dim": 0, "nlist": 1, "tasks": ("q",), "cache": False, "sources": ("ann",)}, "'none'-tower"),
    ({"template": ""}, "spec.template"),
])
def test_spec_refuses_what_no_stage_supports(changes, field):
    with pytest.raises(SnapshotError, match=field):
        ModelSpec(**{**BASE, **changes})


def test_spec_json_round_trip_and_named_errors():
    spec = ModelSpec(**BASE, sources=("ann", "generative"), overarch="mol", value_model='{"weights":{"a":1}}',
                     generative_weight=2.0, source_priority="both", template="genre = $user.g")
    assert ModelSpec.from_json(spec.to_json()) == spec
    assert ModelSpec.search(8, 1) == ModelSpec.from_json(ModelSpec.search(8, 1).to_json())
    for bad, match in [([], "must be an object"), ({**spec.to_json(), "color": 1}, "unknown field 'color'"),
                       ({"tower": "query", "dim": 8}, "lacks field 'nlist'"),
                       ({**spec.to_json(), "tasks": "a"}, "spec.tasks must be a list")]:
        with pytest.raises(SnapshotError, match=match):
            ModelSpec.from_json(bad)


def test_compose_names_a_part_the_spec_lacks_or_has_no_stage_for(rec):
    spec, parts = rec.built.spec, rec.built.parts
    with pytest.raises(CompositionError, match="needs the part 'index'"):
        compose(spec, dataclasses.replace(parts, index=None))
    with pytest.raises(CompositionError, match="the part 'overarch' has no stage"):
        compose(spec.replace(overarch=None), parts)  # an OverArch given, none in the spec
    with pytest.raises(CompositionError, match="needs the part 'decode'"):
        compose(spec.replace(sources=("ann", "generative")), parts)
    with pytest.raises(CompositionError, match="16-dimensional with 8 clusters, the spec says dim 32"):
        compose(spec.replace(dim=32), parts)
    with pytest.raises(CompositionError, match="nlist 4"):
        compose(spec.replace(nlist=4), parts)


def test_the_spec_chooses_the_user_tower_stage(rec):
    """tower "two_tower" is the bag tower and "sequence" the sequential one: a part of the other kind
    is refused, naming both; a byo spec takes any module."""
    from silverrec.retrieval.sequence_tower import SequenceUserTower
    from silverrec.retrieval.user_tower import UserFeatureSpec

    spec, parts = rec.built.spec, rec.built.parts
    assert spec.tower == "two_tower"
    with pytest.raises(CompositionError, match="tower 'sequence' is a SequenceUserTower; the part 'user_tower' is a"):
        compose(spec.replace(tower="sequence"), parts)
    features = UserFeatureSpec.from_json(rec.ckpt["spec"])
    sequential = SequenceUserTower(features, spec.dim, len(spec.tasks), rec.ckpt["item_features"])
    with pytest.raises(CompositionError, match="tower 'two_tower' is a UserTower or DirectTBEUserTower; the part "
                                               "'user_tower' is a SequenceUserTower"):
        compose(spec, dataclasses.replace(parts, user_tower=sequential))
    model = compose(spec.replace(tower="sequence"), dataclasses.replace(parts, user_tower=sequential))
    assert model.user_tower is sequential and model.spec.tower == "sequence"
    assert compose(spec.replace(tower="byo"), dataclasses.replace(parts, user_tower=sequential)).user_tower is sequential


def test_the_recorded_spec_recomposes_the_published_model(rec):
    """The snapshot's config.spec with the same parts composes a model that answers as the
    published snapshot does (the spec is what the model is built from, not a description of it)."""
    snap = rec.snap()
    again = compose(ModelSpec.from_json(snap.config["spec"]), rec.built.parts)
    args = model_inputs(snap.rec_handler(), [{"user_id": u} for u in users(rec, 3, start=7)], k=10)
    want, got = run(snap.module, args), run(again, args)
    assert torch.equal(got[0], want[0]) and bool((got[0] >= 0).all())
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
