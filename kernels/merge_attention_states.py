"""`silverrec::merge_attention_states`: combine two partial attention results by log-sum-exp.

Attention of a query over keys K = K_a ∪ K_b can be computed in two stages (e.g. the shared
history KV of a request and a beam's own unshared KV) and merged exactly:

    s = logaddexp(s_a, s_b)
    v = v_a * exp(s_a - s) + v_b * exp(s_b - s)

    v, s = torch.ops.silverrec.merge_attention_states(v_a, s_a, v_b, s_b)
    # v_a, v_b float [N, H, D]: softmax-normalised outputs of each stage
    # s_a, s_b [N, H] (same dtype as v): natural-log sum of exp(scores) of each stage, -inf = empty
    # -> v [N, H, D], s [N, H]; both stages empty gives v = 0, s = -inf

CPU: kernels/csrc/attention.cpp (ATen calls). CUDA: `merge_attention_states_triton.py`.
"""

import torch


def _check(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> None:
    if v_a.dim() != 3 or v_a.shape != v_b.shape:
        raise ValueError(f"v_a, v_b must both be [N, H, D], got {tuple(v_a.shape)} and {tuple(v_b.shape)}")
    if s_a.shape != v_a.shape[:2] or s_b.shape != v_a.shape[:2]:
        raise ValueError(
            f"s_a, s_b must be [N, H] = {tuple(v_a.shape[:2])}, got {tuple(s_a.shape)} and {tuple(s_b.shape)}"
        )


@torch.library.register_kernel("silverrec::merge_attention_states", "cuda")
def _(v_a, s_a, v_b, s_b):
    from silverrec.kernels.merge_attention_states_triton import merge_states_triton

    _check(v_a, s_a, v_b, s_b)
    return merge_states_triton(v_a, s_a, v_b, s_b)
