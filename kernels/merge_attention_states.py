"""`silverrec::merge_attention_states`: combine two partial attention results by log-sum-exp.

Attention of a query over keys K = K_a ∪ K_b can be computed in two stages (e.g. the shared
history KV of a request and a beam's own unshared KV) and merged exactly:

    s = logaddexp(s_a, s_b)
    v = v_a * exp(s_a - s) + v_b * exp(s_b - s)

    v, s = torch.ops.silverrec.merge_attention_states(v_a, s_a, v_b, s_b)
    # v_a, v_b float [N, H, D]: softmax-normalised outputs of each stage
    # s_a, s_b [N, H] (same dtype as v): natural-log sum of exp(scores) of each stage, -inf = empty
    # -> v [N, H, D], s [N, H]; both stages empty gives v = 0, s = -inf

CPU: the vectorised reference below. CUDA: `merge_attention_states_triton.py`.
"""

import torch


def _check(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> None:
    if v_a.dim() != 3 or v_a.shape != v_b.shape:
        raise ValueError(f"v_a, v_b must both be [N, H, D], got {tuple(v_a.shape)} and {tuple(v_b.shape)}")
    if s_a.shape != v_a.shape[:2] or s_b.shape != v_a.shape[:2]:
        raise ValueError(
            f"s_a, s_b must be [N, H] = {tuple(v_a.shape[:2])}, got {tuple(s_a.shape)} and {tuple(s_b.shape)}"
        )


def merge_states_reference(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch merge (see module docstring). Safe when either or both stages are empty."""
    m = torch.maximum(s_a, s_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a = torch.exp(s_a - m)
    w_b = torch.exp(s_b - m)
    total = w_a + w_b
    denom = torch.where(total > 0, total, torch.ones_like(total))
    v = (v_a * (w_a / denom)[..., None] + v_b * (w_b / denom)[..., None]).to(v_a.dtype)
    s = m + torch.log(total)  # log(0) = -inf for two empty stages
    return v, s.to(s_a.dtype)


@torch.library.custom_op("silverrec::merge_attention_states", mutates_args=())
def merge_attention_states(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU (reference and fast path). See module docstring."""
    _check(v_a, s_a, v_b, s_b)
    return merge_states_reference(v_a, s_a, v_b, s_b)


@merge_attention_states.register_fake
def _(v_a, s_a, v_b, s_b):
    return torch.empty_like(v_a), torch.empty_like(s_a)


@torch.library.register_kernel("silverrec::merge_attention_states", "cuda")
def _(v_a, s_a, v_b, s_b):
    from silverrec.kernels.merge_attention_states_triton import merge_states_triton

    _check(v_a, s_a, v_b, s_b)
    return merge_states_triton(v_a, s_a, v_b, s_b)
