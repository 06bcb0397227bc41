"""silverrec's hot operators (see kernels/README.md).

Importing this package loads the operator library (kernels/library.py: every op's schema, CPU and Meta kernel,
in C++) and registers the CUDA kernels written in Python (triton is imported lazily, only when one runs).
"""

from silverrec.kernels import library

library.load()

from silverrec.kernels import constants, ivf_scan  # noqa: E402,F401
from silverrec.kernels import candidate_rows, mol_score, rescore_rows, rows_to_items  # noqa: E402,F401
from silverrec.kernels import bloom_filter, centroid_probe, filter_plan, filtered_ivf_search, filtered_topk  # noqa: E402,F401
from silverrec.kernels import beam_topk, merge_attention_states, staged_attention  # noqa: E402,F401

__all__ = ["library", "constants", "ivf_scan", "bloom_filter", "centroid_probe", "filtered_topk", "filter_plan", "filtered_ivf_search", "rows_to_items", "candidate_rows", "mol_score", "rescore_rows", "merge_attention_states", "staged_attention", "beam_topk"]
