"""The HTTP request bodies of `silverrec serve` (pydantic models, strict types, unknown fields refused).

    POST /v1/search          SearchBody      queries [B, D], k, filter, nprobe or target_recall, max_probe, mode,
                                             deadline_ms
    POST /v1/recommend       RecommendBody   one user (UserBody fields) or requests: [UserBody, ...], k, k0, ...
    POST /v1/rank            RankBody        one user and items
    POST /v1/admin/reload    ReloadBody      path
"""

import functools
from typing import Any, NamedTuple, Optional, Union


class RequestModels(NamedTuple):
    """The body classes (module docstring), built by `request_models()`."""

    SearchBody: Any
    UserBody: Any
    RecommendBody: Any
    RankBody: Any
    ReloadBody: Any


@functools.lru_cache(maxsize=None)
def request_models() -> RequestModels:
    """The pydantic models, built on first use (so importing this module needs no pydantic)."""
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

    Value = Union[StrictStr, StrictInt]

    class SearchBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        queries: list[list[StrictFloat]] = Field(description="float query rows [B, D]")
        k: StrictInt = 10
        filter: Union[StrictStr, list[Optional[StrictStr]], None] = Field(
            None, description="one filter string for every row, or one string (or null) per row")
        nprobe: Optional[StrictInt] = None
        target_recall: Optional[StrictFloat] = Field(
            None, description="instead of nprobe: the recall@k wanted, mapped through the snapshot's calibration curve")
        max_probe: Optional[StrictInt] = None
        mode: Union[StrictStr, list[StrictStr], None] = None
        deadline_ms: Optional[float] = Field(None, gt=0, description="budget in ms from arrival; 504 after")

    class UserBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        user_id: Optional[StrictInt] = None
        history: Optional[list[StrictInt]] = None
        features: dict[str, Union[Value, list[Value]]] = Field(default_factory=dict)
        numeric: dict[str, StrictFloat] = Field(default_factory=dict)
        filter: Optional[StrictStr] = None
        exclude: list[StrictInt] = Field(default_factory=list)

    class RecommendBody(UserBody):
        requests: Optional[list[UserBody]] = Field(None, description="several users (else the top-level user fields)")
        k: StrictInt = 10
        k0: Optional[StrictInt] = None
        nprobe: Optional[StrictInt] = None
        target_recall: Optional[StrictFloat] = Field(None, description="instead of nprobe: the retrieval's recall wanted")
        max_probe: Optional[StrictInt] = None
        mode: StrictStr = "auto"
        exclude_history: Optional[StrictBool] = None
        deadline_ms: Optional[float] = Field(None, gt=0)

    class RankBody(UserBody):
        items: list[StrictInt] = Field(description="item ids to score, in the order of the answer")
        deadline_ms: Optional[float] = Field(None, gt=0)

    class ReloadBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        path: Optional[StrictStr] = Field(None, description="snapshot directory (default: reload the served path)")

    return RequestModels(SearchBody, UserBody, RecommendBody, RankBody, ReloadBody)

