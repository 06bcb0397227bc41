"""`ModelSpec`: the validated specification a snapshot's root module is built from.

Every snapshot is one root module, `RecModel`, composed by `silverrec.compose.compose(spec, parts)`
from this spec (its stages and their parameters) and the trained parts (towers, index, cache,
OverArch, decoder). The spec is stored as manifest["config"]["spec"]; the predictor reads what a
snapshot answers from it:

    tower "query"      the request's dense tensor is the query embedding (a pure-ANN snapshot,
                       `silverrec publish --pool`): answers `search`; nlist 1 is the exact index
    tower "two_tower"  silverrec's bag user tower, pooled history bags (silverrec/retrieval/user_tower.py;
                       `silverrec publish --config`, train.toml `user_tower = "bag"`): answers
                       `recommend` and `rank`
    tower "sequence"   silverrec's sequential user tower, a causal transformer over the ordered
                       history (silverrec/retrieval/sequence_tower.py; train.toml
                       `user_tower = "sequence"`): the same
    tower "byo"        a user's own tower (publish/byo.py, a config with [user_tower]): the same
    tower "none"       no user embedding: the generative decode is the only source (`silverrec
                       publish --generative`): answers `recommend`

Stages (RecModel.forward, one module each): user tower -> filter template -> retrieval sources
("ann": the filtered int8 IVF search and, with a cache, each task's best k0 re-scored exactly and
the tasks merged; "generative": the beam decode; both: their union) -> OverArch (or the exact
re-score, or the source's own score) -> value model (or task 0's score) -> top k.

`ModelSpec(...)` refuses an inconsistent configuration with a SnapshotError naming the field;
`from_json` also names unknown, missing and mistyped fields.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Optional

from silverrec.candidates import SOURCES
from silverrec.errors import SnapshotError

TOWERS = ("query", "two_tower", "sequence", "byo", "none")
MERGES = ("union", "intersection")  # how the tasks' candidate lists combine
PRIORITIES = ("none", "ann", "generative", "both")  # which candidates of a union rank first (ranking/top_k.py)
TRAINED_TOWERS = ("two_tower", "sequence", "byo")
# silverrec's own user towers: train.toml's `user_tower` -> the spec's tower (the stage compose wires)
OWN_TOWERS = {"bag": "two_tower", "sequence": "sequence"}
# the decode's last step extends this many more prefixes, of the ANN's best candidates, beside its
# beams: the log-prob those candidates are ranked with is then exact, not a bound (on MovieLens:
# offline, 8, 16 and 32 gave what exact log-probs of every candidate give; in the forward, 4 and 8
# gave the same NDCG@10, and 4 costs half the extra rows in a step of 64)
EXTRA_PREFIXES = 4


@dataclass(frozen=True)
class ModelSpec:
    """The stages of a `RecModel` and their parameters.

    tower: one of TOWERS; dim: the item embedding width D (0 for tower "none"); nlist: IVF clusters
    (1 = exact; 0 without an "ann" source); tasks: task names (one user embedding and one score
    each); sources: retrieval sources, a non-empty ordered subset of SOURCES.
    cache: an embedding cache re-scores the ANN's candidates exactly (the ranking stages read it);
    overarch: the OverArch's kind ("mlp" | "mol" | "listwise", or "user" / "listwise" for a team's
    own module), None = the exact re-scores are the task scores; value_model: the value formula as
    compact JSON text (ranking/value_model.py), None = task 0's score.
    merge: "union" | "intersection" of the tasks' candidates; overfetch: rows searched per task
    beyond k0 (so that exclusions leave k0); candidates: K1, the most candidates ranked per request
    (0 = every task's k0); rescore: without a cache, the search re-scores its top rows with the float
    query (kernels/rescore_rows.py).
    template: a filter template (filtering/template.py) filled from the user's features, or None;
    template_values: the most values an `IN $user.<feature>` binds.
    generative_weight, source_priority: a union's ranking, value + w * log-prob with the priority's
    rows first (ranking/top_k.py); extra_prefixes: prefixes of the ANN's best candidates the decode's
    last step extends (generative/source.py); decode_history: the most history items fed to the
    decoder (None: as many as its RoPE table holds).
    transitions: M, the next-item transitions' successors per item (retrieval/transitions.py: the
    newest history item's M likeliest next items join the ANN's candidates), 0 = none;
    transition_weight: w in value + w * P(row | the newest history item) (ranking/stages.py).
    """

    tower: str
    dim: int
    nlist: int
    tasks: tuple[str, ...] = ("query",)
    sources: tuple[str, ...] = ("ann",)
    cache: bool = False
    overarch: Optional[str] = None
    value_model: Optional[str] = None
    merge: str = "union"
    overfetch: int = 256
    candidates: int = 0
    rescore: bool = False
    template: Optional[str] = None
    template_values: int = 8
    generative_weight: float = 0.0
    source_priority: str = "none"
    extra_prefixes: int = EXTRA_PREFIXES
    decode_history: Optional[int] = None
    transitions: int = 0
    transition_weight: float = 0.0

    def __post_init__(self):
        _one_of("tower", self.tower, TOWERS)
        if not isinstance(self.tasks, tuple) or not self.tasks or len(set(self.tasks)) != len(self.tasks) \
                or not all(isinstance(t, str) and t for t in self.tasks):
            raise SnapshotError(f"spec.tasks must name one or more distinct tasks, got {self.tasks!r}")
        if not isinstance(self.sources, tuple) or not self.sources or \
                tuple(s for s in SOURCES if s in self.sources) != self.sources:
            raise SnapshotError(f"spec.sources must be a non-empty ordered subset of {SOURCES}, got {self.sources!r}")
        _int("dim", self.dim, 0 if self.tower == "none" else 1)
        _int("nlist", self.nlist, 1 if "ann" in self.sources else 0)
        for name in ("cache", "rescore"):
            if not isinstance(getattr(self, name), bool):
                raise SnapshotError(f"spec.{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("overarch", "value_model", "template"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise SnapshotError(f"spec.{name} must be a non-empty string or null, got {v!r}")
        _one_of("merge", self.merge, MERGES)
        _one_of("source_priority", self.source_priority, PRIORITIES)
        for name, lo in (("overfetch", 0), ("candidates", 0), ("template_values", 1), ("extra_prefixes", 0),
                         ("transitions", 0)):
            _int(name, getattr(self, name), lo)
        if self.decode_history is not None:
            _int("decode_history", self.decode_history, 1)
        for name in ("generative_weight", "transition_weight"):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                raise SnapshotError(f"spec.{name} must be a finite number >= 0, got {w!r}")
        self._check_stages()

    def _check_stages(self) -> None:
        """The combinations the stages support."""
        ranked = self.cache or self.overarch is not None or self.value_model is not None
        if self.tower in ("query", "none"):
            source = "ann" if self.tower == "query" else "generative"
            if self.sources != (source,) or ranked or len(self.tasks) != 1 or self.template is not None:
                raise SnapshotError(f"a {self.tower!r}-tower spec has the one source {source!r}, one task, and no "
                                    "cache, OverArch, value model or filter template")
        else:
            if "ann" not in self.sources or not self.cache:
                raise SnapshotError(f"a {self.tower!r}-tower spec has the 'ann' source and an embedding cache")
        if (self.overarch is not None or self.value_model is not None) and not self.cache:
            raise SnapshotError("an OverArch or a value model ranks cached candidates: spec.cache must be true")
        if self.rescore and self.cache:
            raise SnapshotError("spec.rescore is for a model without an embedding cache (the cache re-scores exactly)")
        if self.transitions and (self.tower not in OWN_TOWERS.values() or self.sources != ("ann",)):
            raise SnapshotError("spec.transitions join the ANN's candidates of a recommendation model: silverrec's own "
                                f"tower ({', '.join(OWN_TOWERS.values())}, whose requests hold the history as pool rows) "
                                f"and the one source 'ann', got tower {self.tower!r}, sources {list(self.sources)}")
        if self.transition_weight and not self.transitions:
            raise SnapshotError("spec.transition_weight weighs the next-item transitions: spec.transitions must be >= 1")
        if self.sources != SOURCES and (self.generative_weight != 0 or self.source_priority != "none"):
            raise SnapshotError("spec.generative_weight and spec.source_priority rank a union of the two sources: "
                                f"spec.sources must be {list(SOURCES)}")

    @classmethod
    def search(cls, dim: int, nlist: int) -> "ModelSpec":
        """The pure-ANN configuration: the query is the user, the search ranks (re-scored)."""
        return cls("query", int(dim), int(nlist), overfetch=0, rescore=True)

    @property
    def answers_search(self) -> bool:
        return self.tower == "query"

    @property
    def ranks(self) -> bool:
        """Whether the model has the early-stage ranking entry point (`rank`): a trained user tower."""
        return self.tower in TRAINED_TOWERS

    @property
    def hybrid(self) -> bool:
        return self.sources == SOURCES

    def replace(self, **changes: Any) -> "ModelSpec":
        """A copy with `changes` (validated again)."""
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return d | {"tasks": list(self.tasks), "sources": list(self.sources)}

    @classmethod
    def from_json(cls, d: Any) -> "ModelSpec":
        if not isinstance(d, dict):
            raise SnapshotError(f"manifest config.spec must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SnapshotError(f"manifest config.spec has unknown field {unknown[0]!r} (known: {sorted(known)})")
        missing = [n for n in ("tower", "dim", "nlist") if n not in d]
        if missing:
            raise SnapshotError(f"manifest config.spec lacks field {missing[0]!r}")
        d = dict(d)
        for name in ("tasks", "sources"):
            if name in d:
                if not isinstance(d[name], list):
                    raise SnapshotError(f"manifest config.spec.{name} must be a list, got {d[name]!r}")
                d[name] = tuple(d[name])
        return cls(**d)


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise SnapshotError(f"spec.{name} must be one of {allowed}, got {value!r}")


def _int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise SnapshotError(f"spec.{name} must be an int >= {lo}, got {value!r}")
