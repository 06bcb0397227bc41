"""`ModelSpec`: what a snapshot's root module holds, validated, in place of kind strings.

Every retrieval snapshot is one root module, `RecModel` (manifest kind "rec"); the spec names its
configuration, and the predictor answers from it:

    tower "query"      the request's dense tensor is the query embedding (a pure-ANN snapshot,
                       `silverrec publish --pool`): answers `search`; nlist 1 is the exact index
    tower "two_tower"  a trained user tower (`silverrec publish --config`): answers `recommend`
                       and `rank`
    tower "byo"        a user's own tower (publish/byo.py, a config with [user_tower]): the same

Stored as manifest["config"]["spec"]; `from_json` names the first bad field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from silverrec.errors import SnapshotError

TOWERS = ("query", "two_tower", "byo")


@dataclass(frozen=True)
class ModelSpec:
    """The stages of a `RecModel` snapshot.

    tower: "query" | "two_tower"; dim: item embedding width D; nlist: IVF clusters (1 = exact);
    tasks: task names (one user embedding each); cache: an embedding cache re-scores the candidates;
    overarch: the OverArch kind or None; value_model: a value formula combines the task scores;
    sources: retrieval sources ("ann").
    """

    tower: str
    dim: int
    nlist: int
    tasks: tuple[str, ...] = ("query",)
    cache: bool = False
    overarch: Optional[str] = None
    value_model: bool = False
    sources: tuple[str, ...] = ("ann",)

    def __post_init__(self):
        if self.tower not in TOWERS:
            raise SnapshotError(f"spec.tower must be one of {TOWERS}, got {self.tower!r}")
        for name in ("dim", "nlist"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SnapshotError(f"spec.{name} must be a positive int, got {v!r}")
        if not self.tasks:
            raise SnapshotError("spec.tasks must name at least one task")
        if self.tower == "query" and (self.cache or self.overarch or self.value_model or len(self.tasks) != 1):
            raise SnapshotError("a query-tower spec has one task and no cache, OverArch or value model")

    @classmethod
    def search(cls, dim: int, nlist: int) -> "ModelSpec":
        """The pure-ANN configuration."""
        return cls("query", int(dim), int(nlist))

    @property
    def answers_search(self) -> bool:
        return self.tower == "query"

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
                d[name] = tuple(d[name])
        return cls(**d)
