"""`silverrec::mol_score`: the mixture-of-logits OverArch's pair scores for candidate rows of the embedding cache.

    scores = torch.ops.silverrec.mol_score(user, rows, emb, ranker, weights, dims)
    # user float32 [B, T, D], rows int64 [B, K] (-1 = padding), emb [N, D] and ranker [N, E] (the cache's
    # embeddings and the OverArch's item side, float32 or bfloat16), weights the float32 tensors of a
    # MoLOverArch (silverrec/ranking/overarch.py `op_weights`) in kernels/constants.py MOL_WEIGHTS order:
    # user_weight, user_bias, gate_in_weight, gate_weight, gate_bias, dot_scale, log_scale; dims its sizes
    # p_q, p_x, comp_dim, feat_dim (MOL_DIMS) -> float32 [B, K, T] (0 at padding)

The math is `MoLOverArch.score` on the gathered rows: `mol_pair_scores` below, the one place for it (the
module's `score` calls it too; kernels/ import nothing from the runtime). Why one
op: at batch 1 the torch form is some forty tensor ops over [T, B*K, H] intermediates (0.2 ms of a
0.65 ms MovieLens forward), at batch 16 half the forward; per (request, candidate) the arithmetic is
a few thousand multiply-adds. CPU: kernels/csrc/mol.cpp, one pass per pair with every intermediate in
a few hundred bytes; the torch form (`mol_score_torch`) is the CUDA kernel and the tests' reference. Results agree up to float32 summation order.
"""

from collections import namedtuple
from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor

from silverrec.kernels.constants import MOL_DIMS, MOL_WEIGHTS
from silverrec.kernels.search_args import unpack

MolWeights = namedtuple("MolWeights", MOL_WEIGHTS)
MolDims = namedtuple("MolDims", MOL_DIMS)


def mol_component_logits(user: Tensor, x: Tensor, user_weight: Tensor, user_bias: Tensor, p_q: int, p_x: int,
                         comp_dim: int, eye: Tensor) -> Tensor:
    """user [B, T, D], x [B, K, p_x * c] normalised item components, j-major (parameter dtype) ->
    l [B, K, T, P], P = p_q * p_x (i-major).

    One batched matmul for every (t, i, j): the user components go into a block-diagonal
    [B, p_x * c, T * P] matrix (column (t, i, j) holds q_ti in row block j), so x is read once
    and no per-component slices, stack or permute are needed (measured on MovieLens shapes,
    K = 256, 2 threads: the p_x separate bmms + stack cost more than the p_x times larger
    matmul). Einsum, or flattening x into [B, K * p_x, c], made export guard on K != 1."""
    b, t_count, pq, px, c = user.shape[0], user.shape[1], p_q, p_x, comp_dim
    # per-task projection, one batched matmul over the tasks: [T, B, D] x [T, D, p_q c] (a batch
    # over B, or einsum, made export guard on B != 1)
    q = torch.baddbmm(user_bias.unsqueeze(1), user.transpose(0, 1), user_weight.transpose(1, 2))
    q = F.normalize(q.unflatten(-1, [pq, c]), dim=-1)  # [T, B, p_q, c]
    eye = eye.to(q.dtype)
    # [B, j', c, T, p_q, j] = q[t, b, i, c] * (j == j')
    qbd = q.permute(1, 3, 0, 2)[:, None, :, :, :, None] * eye[None, :, None, None, None, :]
    logits = torch.bmm(x, qbd.reshape(b, px * c, t_count * pq * px))  # [B, K, T * P]
    return logits.unflatten(2, [t_count, pq * px])


def mol_pair_scores(user: Tensor, cand: Tensor, item: Tensor, user_weight: Tensor, user_bias: Tensor,
                    gate_in_weight: Tensor, gate_weight: Tensor, gate_bias: Tensor, dot_scale: Tensor,
                    log_scale: Tensor, p_q: int, p_x: int, comp_dim: int, feat_dim: int, eye: Tensor) -> Tensor:
    """MoLOverArch's pair scores (the formula in its docstring): user float32 [B, T, D], cand [B, K, D],
    item [B, K, E] (`item_side`), the module's weights -> float32 [B, K, T]. The one place of the
    math: the module's `score` and the torch form of `silverrec::mol_score` call it.

    The gate runs task-major, [T, B*K, .]: its hidden layer accumulates the logit columns onto
    (user part + item part) in place (one baddbmm_) and its T output layers are one batched
    matmul [T, B*K, H] x [T, H, P] (no block-diagonal [T*P, T*H] map that multiplies T-1 zero
    blocks, no copy of the hidden layer). Measured on MovieLens' MoL (B 16, K 256, 1 thread,
    TorchScript, alternated): 0.87x the block-diagonal version's time (0.82x at B 64, 0.89x at B 1).
    """
    w = gate_in_weight  # [H, 2D + F + P]
    d, f = user.shape[2], feat_dim
    user = user.to(w.dtype)
    cand = cand.to(w.dtype)
    item = item.to(w.dtype)
    b, k = item.shape[0], item.shape[1]
    t_count, n_p, hid = user.shape[1], p_q * p_x, w.shape[0]
    nx = p_x * comp_dim
    logits = mol_component_logits(user, item[:, :, :nx], user_weight, user_bias, p_q, p_x, comp_dim, eye)  # [B, K, T, P]
    lg = logits.reshape(b * k, t_count, n_p).transpose(0, 1)  # [T, B*K, P] (a strided view)
    # the user part per task, task-major: [T, B, H] contiguous, so that the sum below is
    # [T, B, K, H] contiguous (`.contiguous()` of a transpose guarded export on B != 1)
    hu = torch.bmm(user.transpose(0, 1), w[:, :d].t().unsqueeze(0).expand(t_count, d, hid))
    h = (hu.unsqueeze(2) + item[:, :, nx:].unsqueeze(0)).reshape(t_count, b * k, hid)
    # [T, B*K, H]; silu in place: no second [T, B*K, H] buffer (at batch 64 a fresh 8 MB one per call,
    # whose page faults made the score 1.5x slower)
    h = F.silu(h.baddbmm_(lg, w[:, 2 * d + f :].t().unsqueeze(0).expand(t_count, n_p, hid)), inplace=True)
    g = torch.baddbmm(gate_bias.to(h.dtype).unsqueeze(1), h, gate_weight.to(h.dtype).transpose(1, 2))
    mixed = (torch.softmax(g, dim=-1) * lg).sum(-1).reshape(t_count, b, k).permute(1, 2, 0)  # [B, K, T]
    dot = torch.bmm(cand, user.transpose(1, 2)) * dot_scale.to(w.dtype)  # [B, K, T]
    return (mixed * log_scale.exp().clamp(max=100.0) + dot).float()


def mol_row_scores(user: Tensor, rows: Tensor, emb: Tensor, ranker: Tensor, user_weight: Tensor, user_bias: Tensor,
                   gate_in_weight: Tensor, gate_weight: Tensor, gate_bias: Tensor, dot_scale: Tensor, log_scale: Tensor,
                   p_q: int, p_x: int, comp_dim: int, feat_dim: int, eye: Tensor) -> Tensor:
    """`mol_pair_scores` of cached rows: rows int64 [B, K] (-1 = padding) of emb [N, D] and ranker [N, E]
    gathered -> float32 [B, K, T], 0 at padding. The torch form of `silverrec::mol_score`
    (kernels/mol_score.py) and `score_rows` of a module whose weights are not float32."""
    flat = rows.clamp(min=0).reshape(-1)
    cand = emb.index_select(0, flat).reshape(rows.shape[0], rows.shape[1], emb.shape[1])
    item = ranker.index_select(0, flat).reshape(rows.shape[0], rows.shape[1], ranker.shape[1])
    scores = mol_pair_scores(user, cand, item, user_weight, user_bias, gate_in_weight, gate_weight, gate_bias,
                             dot_scale, log_scale, p_q, p_x, comp_dim, feat_dim, eye)
    return torch.where((rows >= 0).unsqueeze(-1), scores, torch.zeros_like(scores))


def mol_score_torch(user: Tensor, rows: Tensor, emb: Tensor, ranker: Tensor, weights: List[Tensor],
                    dims: List[int]) -> Tensor:
    """The reference (device-generic): the rows gathered, `mol_pair_scores`, 0 at padding (`mol_row_scores`)."""
    w = unpack(MolWeights, weights, "mol_score", "weights")
    d = unpack(MolDims, dims, "mol_score", "dims")
    eye = torch.eye(d.p_x, dtype=w.user_weight.dtype, device=w.user_weight.device)
    return mol_row_scores(user, rows, emb, ranker, *w, *d, eye)


torch.library.register_kernel("silverrec::mol_score", "cuda", mol_score_torch)
