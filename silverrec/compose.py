"""`compose(spec, parts)`: the one place a `RecModel` is built, its stages chosen by a `ModelSpec`.

    >>> model = compose(ModelSpec("two_tower", 64, 128, ("interacted", "liked"), cache=True, overarch="mol",
    ...                           value_model='{"weights":{"interacted":1,"liked":0.5}}'),
    ...                 ModelParts(user_tower=tower, index=index, cache=cache, overarch=mol))

The spec names the stages and their parameters; the parts are what training and the publish
steps built (towers, index, cache, OverArch, decoder). compose checks that the two agree (every
part the spec needs is given, no part is left without a stage, sizes match), compiles what the
spec holds as text (the value model formula, the filter template), and wires the stages:

    stage            pure-ANN index   recommendation     hybrid               decode alone
    user_tower       QueryTower       the tower part     the tower part       NoTower
                                      (tower "two_tower": a bag UserTower; "sequence": a
                                      SequenceUserTower; "byo": the team's module)
    filter_template  (empty)          the template       the template         (empty)
    sources          AnnSearch        AnnSource          HybridSources        DecodeSource
                                      (+ next-item transitions: TransitionSource)
    overarch         SourceScores     ExactScores | RowOverArch | PairOverArch  SourceScores
    value_model      SourceValue      ValueStage | FirstTask                  SourceValue
                                      (+ transitions: TransitionValue around it)
    top_k            Ranked           TopK               FusedTopK            Ranked

The OverArch's item side is computed once per item here (`EmbeddingCache.with_ranker`); every
stage that reads the cache reads that one module (stored once in both programs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import Tensor, nn

from silverrec.errors import SilverrecError
from silverrec.filtering.filter_program import FilterPlan
from silverrec.filtering.template import FilterTemplate, compile_template
from silverrec.generative.generative import GenerativeRetrieval
from silverrec.generative.source import DecodeSource, GenerativeSource, HybridSources
from silverrec.ranking.cache import EmbeddingCache
from silverrec.ranking.stages import (ExactScores, FirstTask, PairOverArch, RowOverArch, SourceScores, SourceValue,
                                      TransitionValue, ValueStage)
from silverrec.ranking.top_k import FusedTopK, Ranked, TopK
from silverrec.ranking.value_model import compile_value_model
from silverrec.rec_model import RecModel
from silverrec.retrieval.filtered_ivf import FilteredIVFIndex
from silverrec.retrieval.query_tower import NoTower, QueryTower
from silverrec.retrieval.sequence_tower import SequenceUserTower
from silverrec.retrieval.sources import AnnSearch, AnnSource
from silverrec.retrieval.transitions import TransitionSource
from silverrec.retrieval.user_tower import DirectTBEUserTower, UserFeatureSpec, UserTower
from silverrec.spec import TRAINED_TOWERS, ModelSpec


# the modules of silverrec's own user towers, by spec.tower (the bag tower's int8 form: DirectTBEUserTower)
OWN_TOWER_MODULES = {"two_tower": (UserTower, DirectTBEUserTower), "sequence": (SequenceUserTower,)}


class CompositionError(SilverrecError):
    """Parts that do not fit a spec: one it needs is missing, one has no stage, sizes disagree."""


@dataclass
class ModelParts:
    """What a spec's stages are made of.

    user_tower: (values, lengths, dense) -> float32 [B, T, D], for a trained tower: a UserTower for
        "two_tower" (or its int8 DirectTBEUserTower), a SequenceUserTower for "sequence", any module for "byo";
    index: the filtered int8 IVF (canonical rows), for source "ann";
    cache: the embedding cache in the index's row order, for spec.cache (without an OverArch's item
        side: compose computes it);
    overarch: the OverArch module, for spec.overarch;
    decode: the beam decode (`GenerativeRetrieval`), for source "generative";
    bank: int64 [R, ceil(N / 64)] the filter row bank of the decode alone (beside the ANN it uses the
        index's), rows in the decode's trie order;
    filter_plan, user_features: the snapshot's FilterPlan and the tower's UserFeatureSpec, for
        spec.template;
    transitions: (next_rows int64 [N, M], next_prob float32 [N, M]) in canonical rows, for
        spec.transitions (retrieval/transitions.py; publish/transitions.py builds them).
    """

    user_tower: Optional[nn.Module] = None
    index: Optional[FilteredIVFIndex] = None
    cache: Optional[EmbeddingCache] = None
    overarch: Optional[nn.Module] = None
    decode: Optional[GenerativeRetrieval] = None
    bank: Optional[Tensor] = None
    filter_plan: Optional[FilterPlan] = None
    user_features: Optional[UserFeatureSpec] = None
    transitions: Optional[tuple[Tensor, Tensor]] = None


def compose(spec: ModelSpec, parts: ModelParts) -> RecModel:
    """The RecModel `spec` describes, from `parts` (module docstring), in eval mode.

    Raises CompositionError naming a part the spec needs and lacks, a part it has no stage for, or a
    size that disagrees; ValueModelError / TemplateError for a formula / template that does not fit."""
    check_parts(spec, parts)
    index, overarch = parts.index, parts.overarch
    cache = parts.cache.with_ranker(overarch.item_side) if overarch is not None else parts.cache
    if spec.tower == "query":
        tower: nn.Module = QueryTower(spec.dim)
    elif spec.tower == "none":
        tower = NoTower()
    else:
        tower = parts.user_tower
    template = FilterTemplate.empty() if spec.template is None else compile_template(
        spec.template, parts.filter_plan, parts.user_features, spec.template_values, index.post_sizes)
    if spec.tower == "query":
        sources: nn.Module = AnnSearch(index, spec.overfetch, spec.rescore)
    elif spec.tower == "none":
        decode = parts.decode
        sources = DecodeSource(_generative(spec, decode, decode.row_to_item), parts.bank, decode.row_to_item)
    else:
        sources = AnnSource(index, cache, len(spec.tasks), spec.merge == "intersection", spec.overfetch,
                            spec.candidates)
        if spec.hybrid:
            decode = DecodeSource(_generative(spec, parts.decode, index.row_to_item), index.bits, index.row_to_item)
            sources = HybridSources(sources, decode)
        elif spec.transitions:
            try:
                sources = TransitionSource(sources, *parts.transitions)
            except ValueError as e:
                raise CompositionError(f"the part 'transitions': {e}") from None
    if cache is None:
        scores: nn.Module = SourceScores()
    elif overarch is None:
        scores = ExactScores(cache)
    elif hasattr(overarch, "score_rows"):  # reads the cache's rows itself (MoL: one op)
        scores = RowOverArch(cache, overarch)
    else:
        scores = PairOverArch(cache, overarch)
    if spec.value_model is not None:
        value: nn.Module = ValueStage(compile_value_model(spec.value_model, spec.tasks, cache.feature_names), cache)
    elif cache is not None:
        value = FirstTask()
    else:
        value = SourceValue()
    if spec.transitions:
        value = TransitionValue(value, spec.transition_weight)
    if cache is None:
        top_k: nn.Module = Ranked(decode=spec.tower == "none")
    elif spec.hybrid:
        top_k = FusedTopK(cache, index.row_to_item, spec.generative_weight, spec.source_priority)
    else:
        top_k = TopK(index.row_to_item)
    return RecModel(tower, template, sources, scores, value, top_k, spec).eval()


def check_parts(spec: ModelSpec, parts: ModelParts) -> None:
    """Every part `spec` needs is given and no other; the sizes agree (CompositionError naming the part)."""
    needs = {
        "user_tower": spec.tower in TRAINED_TOWERS,
        "index": "ann" in spec.sources,
        "cache": spec.cache,
        "overarch": spec.overarch is not None,
        "decode": "generative" in spec.sources,
        "bank": spec.tower == "none",
        "filter_plan": spec.template is not None,
        "user_features": spec.template is not None,
        "transitions": spec.transitions > 0,
    }
    for name, needed in needs.items():
        given = getattr(parts, name) is not None
        if needed and not given:
            raise CompositionError(f"the spec (tower {spec.tower!r}, sources {list(spec.sources)}) needs the part {name!r}")
        if given and not needed:
            raise CompositionError(f"the part {name!r} has no stage in the spec (tower {spec.tower!r}, sources "
                             f"{list(spec.sources)}, cache {spec.cache}, overarch {spec.overarch!r}, "
                             f"template {spec.template!r})")
    kinds = OWN_TOWER_MODULES.get(spec.tower)
    if kinds is not None and not isinstance(parts.user_tower, kinds):
        raise CompositionError(f"the spec's tower {spec.tower!r} is a {' or '.join(k.__name__ for k in kinds)}; the "
                               f"part 'user_tower' is a {type(parts.user_tower).__name__}")
    index, cache = parts.index, parts.cache
    if parts.transitions is not None and parts.transitions[0].shape[1] != spec.transitions:
        raise CompositionError(f"the part 'transitions' lists {parts.transitions[0].shape[1]} next items per item, the "
                               f"spec says {spec.transitions}")
    if index is not None:
        if index.codes.shape[1] != spec.dim or index.nlist != spec.nlist:
            raise CompositionError(f"the index is {index.codes.shape[1]}-dimensional with {index.nlist} clusters, the spec "
                             f"says dim {spec.dim}, nlist {spec.nlist}")
        if cache is not None and (cache.dim != spec.dim or cache.num_items != index.num_items):
            raise CompositionError(f"the cache holds {cache.num_items} rows of width {cache.dim}, the index "
                             f"{index.num_items} of width {spec.dim}")


def _generative(spec: ModelSpec, decode: GenerativeRetrieval, row_to_item: Tensor) -> GenerativeSource:
    """The decode over the canonical rows `row_to_item` (the index's, or its own trie order); a decode
    over another pool, or a history longer than its RoPE table, is a CompositionError."""
    try:
        return GenerativeSource(decode, row_to_item, spec.decode_history, spec.extra_prefixes)
    except ValueError as e:
        raise CompositionError(f"the decode: {e}") from None
