"""The ranking stage of `RecModel`: embedding cache -> exact re-score -> OverArch -> value model.

    rows int64 [B, K] (-1 = padding) --EmbeddingCache--> emb [B, K, D], feats [B, K, F], scores [B, K, T]
    (user [B, T, D], emb, item side) --OverArch-------->  task scores [B, K, T]  (item side cached per item)
    (task scores, feats)             --ValueModel------>  values [B, K]   (caller masks padding, top-k)

Every module takes and returns plain tensors, has no host synchronisation in its forward, and
passes both torch.jit.script and torch.export (dynamic B and K).
"""

from silverrec.ranking.cache import EmbeddingCache
from silverrec.ranking.overarch import OVERARCHES, ListwiseOverArch, MLPOverArch, MoLOverArch, overarch_from_config
from silverrec.ranking.value_model import (
    ValueModel,
    ValueModelError,
    compile_value_model,
    evaluate_formula,
    formula_to_json,
    parse_formula,
)

__all__ = [
    "EmbeddingCache",
    "ListwiseOverArch",
    "MLPOverArch",
    "MoLOverArch",
    "OVERARCHES",
    "overarch_from_config",
    "ValueModel",
    "ValueModelError",
    "compile_value_model",
    "evaluate_formula",
    "formula_to_json",
    "parse_formula",
]
