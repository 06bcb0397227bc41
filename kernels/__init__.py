"""silverrec's hot operators, one `torch.library` op per module (see kernels/README.md).

Importing this package registers every op; triton is imported lazily, only when a CUDA kernel runs.
"""

from silverrec.kernels import constants, ivf_scan  # noqa: F401
from silverrec.kernels import candidate_rows, mol_score, rescore_rows, rows_to_items  # noqa: F401  (defined before filtered_ivf_search loads the extension)
from silverrec.kernels import bloom_filter, centroid_probe, filter_plan, filtered_ivf_search, filtered_topk  # noqa: F401
from silverrec.kernels import beam_topk, merge_attention_states, staged_attention  # noqa: F401

__all__ = ["constants", "ivf_scan", "bloom_filter", "centroid_probe", "filtered_topk", "filter_plan", "filtered_ivf_search", "rows_to_items", "candidate_rows", "mol_score", "rescore_rows", "merge_attention_states", "staged_attention", "beam_topk"]
