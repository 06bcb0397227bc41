"""OverArch: the ranking stage's scorer of (user, candidate) pairs, one score per task.

Both kinds share one signature, so a snapshot spec can pick either:

    forward(user float32 [B, T, D], cand float32 [B, K, D], feats float32 [B, K, F]) -> float32 [B, K, T]

`user[b, t]` is the user's embedding for task t; `cand[b, k]` and `feats[b, k]` the k-th
candidate's cached embedding and dense features (`EmbeddingCache.gather`). Padded candidates get
some finite score: the caller masks them. Inputs are cast to the parameters' dtype (so a
`.to(torch.bfloat16)` module takes the float32 tensors the cache produces) and scores come back
as float32. Scores are logits meant for a softmax cross-entropy over each candidate list.

Each kind splits into an item side and a pair side, `forward = score(user, cand, item_side(cand,
feats))`: `item_side` [.., E] depends on the item alone, so a snapshot computes it once per item at
publish and keeps it in the embedding cache (BAT's reuse of item-side work across users), and a
request pays only for `score`, the part that needs the user.

`config()` returns the constructor arguments (JSON-able); `overarch_from_config(kind, config)`
rebuilds an untrained module of the same shape, to load a state dict into.

- MLPOverArch: x_t = [u_t, v, u_t * v, feats] -> shared ReLU MLP trunk -> per-task linear head.
- MoLOverArch: mixture of logits (Zhai et al., KDD 2023, "Revisiting Neural Retrieval on
  Accelerators"): gated sum of cosine similarities between user and item components.
- ListwiseOverArch: a small transformer over the whole candidate list with the user's T task
  embeddings as extra tokens, so a candidate's score depends on the other candidates.

`score` takes `valid` bool [B, K] (False = padding slot): the list-wise kind masks padding out of
its attention; the pointwise kinds ignore it (their padded scores are masked by the caller).
"""


import math
from typing import Any, Dict, List, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from silverrec.attention import PreLNBlock
from silverrec.kernels.mol_score import mol_pair_scores, mol_row_scores


class MLPOverArch(nn.Module):
    """MLP over [u_t, v, u_t * v, feats] with a shared trunk and one linear head per task.

    For task t and candidate v:  x_t = [u_t, v, u_t * v, feats]          (3D + F)
        h_t = ReLU(W_L ... ReLU(W_1 x_t + b_1) ... + b_L)                  (trunk, shared by tasks)
        score_t = <w_t, h_t> + c_t + s_t <u_t, v>                          (head t: row t of a
                                                                            [T, hidden[-1]] weight)
    The residual s_t <u_t, v> (s_t learned, initially `dot_scale`, the retrieval model's inverse
    temperature) starts the ranker at the retrieval model's order, so that the MLP learns a
    correction of it rather than the whole score from scratch.
    The trunk is shared so that tasks learn from each other's data; the heads are T separate
    linear maps stored as one `[T, H]` parameter. The first layer is applied as the sum of its
    four column blocks (user part once per (b, t), item part once per item: `item_side`), which
    is the same map as the concatenation without building a `[B, K, T, 3D + F]` tensor.

    Args:
        dim: D, the embedding size of users and items.
        feat_dim: F, the number of dense item features (0 allowed).
        tasks: T, the number of tasks (scores per candidate).
        hidden: trunk layer widths (at least one).
    """

    kind = "mlp"

    def __init__(self, dim: int, feat_dim: int, tasks: int, hidden: Sequence[int] = (256, 128),
                 dot_scale: float = 20.0) -> None:
        super().__init__()
        hidden = [int(h) for h in hidden]
        _check_dims(dim=dim, feat_dim=feat_dim, tasks=tasks)
        if not hidden or min(hidden) < 1:
            raise ValueError(f"hidden must list at least one positive width, got {hidden}")
        self.dim, self.feat_dim, self.tasks, self.hidden = int(dim), int(feat_dim), int(tasks), hidden
        self.first = nn.Linear(3 * dim + feat_dim, hidden[0])
        self.rest = nn.ModuleList(nn.Linear(a, b) for a, b in zip(hidden[:-1], hidden[1:]))
        self.head_weight = nn.Parameter(torch.empty(tasks, hidden[-1]))
        self.head_bias = nn.Parameter(torch.zeros(tasks))
        self.dot_scale = nn.Parameter(torch.full((tasks,), float(dot_scale)))
        nn.init.uniform_(self.head_weight, -1.0 / math.sqrt(hidden[-1]), 1.0 / math.sqrt(hidden[-1]))

    def config(self) -> Dict[str, Any]:
        return {"dim": self.dim, "feat_dim": self.feat_dim, "tasks": self.tasks, "hidden": list(self.hidden),
                "dot_scale": float(self.dot_scale.detach()[0])}

    @property
    def item_width(self) -> int:
        """E, the width of `item_side`."""
        return self.hidden[0]

    @torch.jit.export
    def item_side(self, cand: Tensor, feats: Tensor) -> Tensor:
        """cand [.., D], feats [.., F] -> the first layer's item part W_v v + W_f f + b1 [.., H0]."""
        w = self.first.weight  # [H0, 3D + F]
        d = self.dim
        return F.linear(cand.to(w.dtype), w[:, d : 2 * d]) + F.linear(feats.to(w.dtype), w[:, 3 * d :], self.first.bias)

    def score(self, user: Tensor, cand: Tensor, item: Tensor, valid: Tensor) -> Tensor:
        """user float32 [B, T, D], cand [B, K, D], item [B, K, H0] (`item_side`), valid (unused) ->
        float32 [B, K, T]."""
        w = self.first.weight
        d = self.dim
        user = user.to(w.dtype)
        cand = cand.to(w.dtype)
        hu = F.linear(user, w[:, :d])  # [B, T, H0]
        # W_uv (u_t * v) = (W_uv diag(u_t)) v: one [H0, D] matrix per (b, t), applied by one bmm
        # (never a [B, K, T, D] product tensor)
        per_user = w[:, 2 * d : 3 * d] * user.unsqueeze(2)  # [B, T, H0, D]
        huv = torch.bmm(cand, per_user.flatten(1, 2).transpose(1, 2)).unflatten(2, [self.tasks, -1])  # [B, K, T, H0]
        h = torch.relu(huv + (hu.unsqueeze(1) + item.to(w.dtype).unsqueeze(2)))
        for layer in self.rest:
            h = torch.relu(layer(h))
        dot = torch.bmm(cand, user.transpose(1, 2)) * self.dot_scale.to(w.dtype)  # [B, K, T]
        return ((h * self.head_weight).sum(-1) + self.head_bias + dot).float()  # [B, K, T]

    def forward(self, user: Tensor, cand: Tensor, feats: Tensor) -> Tensor:
        """user float32 [B, T, D], cand float32 [B, K, D], feats float32 [B, K, F] -> float32 [B, K, T]."""
        return self.score(user, cand, self.item_side(cand, feats), _all_valid(cand))


class MoLOverArch(nn.Module):
    """Mixture of logits (MoL): a gated sum of P = p_q * p_x component cosine similarities.

    For task t, user embedding u = u_t, candidate v with features f:
        q_i  = normalize(slice_i(A_t u + a_t))       i < p_q   (per-task user projection A_t)
        x_j  = normalize(slice_j(B v + b))           j < p_x   (item projection, shared by tasks)
        l_ij = <q_i, x_j>                             (P logits in [-1, 1], flattened i-major)
        pi   = softmax_P(G_t SiLU(W [u, v, f, l] + c) + g_t)   (gate MLP: shared hidden layer over
                                                               user-side, item-side and logit
                                                               features; per-task output layer G_t)
        score_t = s_t * sum_ij pi_ij l_ij             s_t = exp(log_scale_t), learned (init `scale`)
                  + r_t <u_t, v>                      or fixed (learn_scale=False), capped at 100
    The residual r_t <u_t, v> (r_t learned, initially `dot_scale`; 0 switches it off at init) starts
    the ranker at the retrieval model's order, as in MLPOverArch: with the few hundred steps a
    ranker gets here, a mixture learned from scratch was seen to fall below the retrieval order.
    The temperature s_t makes the bounded mixture usable as a softmax cross-entropy logit.
    User projections are per task because the components a task attends to differ; the item
    projection is shared so an item's components are computed once per item (`item_side`, with the
    gate's item columns). The gate's first layer is applied as the sum of its column blocks (same
    map as the concatenation).

    Args:
        dim: D; feat_dim: F (0 allowed); tasks: T.
        p_q, p_x: user / item component counts. comp_dim: component size.
        gate_hidden: width of the gate MLP's hidden layer.
        scale: initial (or fixed) temperature multiplier. learn_scale: learn it per task.
    """

    kind = "mol"

    def __init__(
        self,
        dim: int,
        feat_dim: int,
        tasks: int,
        p_q: int = 4,
        p_x: int = 4,
        comp_dim: int = 32,
        gate_hidden: int = 64,
        scale: float = 20.0,
        learn_scale: bool = True,
        dot_scale: float = 20.0,
    ) -> None:
        super().__init__()
        _check_dims(dim=dim, feat_dim=feat_dim, tasks=tasks)
        for name, v in (("p_q", p_q), ("p_x", p_x), ("comp_dim", comp_dim), ("gate_hidden", gate_hidden)):
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not (0.0 < float(scale) <= 100.0):
            raise ValueError(f"scale must be in (0, 100], got {scale}")
        self.dim, self.feat_dim, self.tasks = int(dim), int(feat_dim), int(tasks)
        self.p_q, self.p_x, self.comp_dim, self.gate_hidden = int(p_q), int(p_x), int(comp_dim), int(gate_hidden)
        self.scale_init, self.learn_scale = float(scale), bool(learn_scale)
        n_p = self.p_q * self.p_x
        bound = 1.0 / math.sqrt(dim)
        self.user_weight = nn.Parameter(torch.empty(tasks, self.p_q * comp_dim, dim).uniform_(-bound, bound))
        self.user_bias = nn.Parameter(torch.empty(tasks, self.p_q * comp_dim).uniform_(-bound, bound))
        self.item_proj = nn.Linear(dim, self.p_x * comp_dim)
        self.gate_in = nn.Linear(2 * dim + feat_dim + n_p, gate_hidden)
        gb = 1.0 / math.sqrt(gate_hidden)
        self.gate_weight = nn.Parameter(torch.empty(tasks, n_p, gate_hidden).uniform_(-gb, gb))
        self.gate_bias = nn.Parameter(torch.zeros(tasks, n_p))
        self.dot_scale = nn.Parameter(torch.full((tasks,), float(dot_scale)))
        log_scale = torch.full((tasks,), math.log(float(scale)))
        self.register_buffer("component_eye", torch.eye(self.p_x), persistent=False)  # component_logits' block mask
        if self.learn_scale:
            self.log_scale = nn.Parameter(log_scale)
        else:
            self.register_buffer("log_scale", log_scale)

    def config(self) -> Dict[str, Any]:
        return {
            "dim": self.dim, "feat_dim": self.feat_dim, "tasks": self.tasks, "p_q": self.p_q, "p_x": self.p_x,
            "comp_dim": self.comp_dim, "gate_hidden": self.gate_hidden, "scale": self.scale_init,
            "learn_scale": self.learn_scale, "dot_scale": float(self.dot_scale.detach()[0]),
        }

    @property
    def item_width(self) -> int:
        """E, the width of `item_side`: p_x * comp_dim normalised item components + gate_hidden."""
        return self.p_x * self.comp_dim + self.gate_hidden

    @torch.jit.export
    def item_side(self, cand: Tensor, feats: Tensor) -> Tensor:
        """cand [.., D], feats [.., F] -> [.., E]: the item components x_j (normalised, j-major) and
        the gate's item part W_v v + W_f f + c."""
        w = self.gate_in.weight  # [H, 2D + F + P]
        d, f = self.dim, self.feat_dim
        cand = cand.to(w.dtype)
        x = F.normalize(self.item_proj(cand).unflatten(-1, [self.p_x, self.comp_dim]), dim=-1).flatten(-2)
        hv = F.linear(cand, w[:, d : 2 * d]) + F.linear(feats.to(w.dtype), w[:, 2 * d : 2 * d + f], self.gate_in.bias)
        return torch.cat([x, hv], dim=-1)

    def score(self, user: Tensor, cand: Tensor, item: Tensor, valid: Tensor) -> Tensor:
        """user float32 [B, T, D], cand [B, K, D], item [B, K, E] (`item_side`), valid (unused) ->
        float32 [B, K, T] (`mol_pair_scores`)."""
        return mol_pair_scores(user, cand, item, self.user_weight, self.user_bias, self.gate_in.weight, self.gate_weight,
                               self.gate_bias, self.dot_scale, self.log_scale, self.p_q, self.p_x, self.comp_dim,
                               self.feat_dim, self.component_eye)

    @torch.jit.export
    def score_rows(self, user: Tensor, rows: Tensor, emb: Tensor, ranker: Tensor) -> Tensor:
        """`score` of cached candidates: user float32 [B, T, D], rows int64 [B, K] (-1 = padding) of the
        embedding cache's emb [N, D] and ranker [N, E] (this OverArch's `item_side`) -> float32
        [B, K, T], 0 at padding: one op, `silverrec::mol_score` (kernels/mol_score.py), for float32
        weights; a bfloat16 module gathers and scores."""
        if self.gate_in.weight.dtype == torch.float32:
            return torch.ops.silverrec.mol_score(user.float(), rows, emb, ranker, self.op_weights(),
                                                 [self.p_q, self.p_x, self.comp_dim, self.feat_dim])
        return mol_row_scores(user, rows, emb, ranker, self.user_weight, self.user_bias, self.gate_in.weight,
                              self.gate_weight, self.gate_bias, self.dot_scale, self.log_scale, self.p_q, self.p_x,
                              self.comp_dim, self.feat_dim, self.component_eye)

    def op_weights(self) -> List[Tensor]:
        """The weights `silverrec::mol_score` takes, in kernels/constants.py MOL_WEIGHTS order (its dims: p_q,
        p_x, comp_dim, feat_dim, MOL_DIMS)."""
        return [self.user_weight, self.user_bias, self.gate_in.weight, self.gate_weight, self.gate_bias,
                self.dot_scale, self.log_scale]

    def forward(self, user: Tensor, cand: Tensor, feats: Tensor) -> Tensor:
        """user float32 [B, T, D], cand float32 [B, K, D], feats float32 [B, K, F] -> float32 [B, K, T]."""
        return self.score(user, cand, self.item_side(cand, feats), _all_valid(cand))


class ListwiseOverArch(nn.Module):
    """A pre-LN transformer over [T user tokens, K candidate tokens]; scores read off the candidates.

        item token  x_k = W_i [v_k, f_k] + b_i                 (`item_side`, once per item)
        user tokens z_t = W_u u_t + b_u + e_t                  (e_t: a learned token per task)
        S = [z_1..z_T, x_1..x_K] -> `layers` x (S += MHA(LN S), padding masked; S += FFN(LN S))
        score_t(k) = <w_t, LN(S_{T+k})> + c_t + r_t <u_t, v_k>

    Every candidate attends to the user tokens and to the other valid candidates, so the model can
    learn list-level effects (redundancy, the list's spread) that pointwise scorers cannot. The
    residual r_t <u_t, v_k> (initially `dot_scale`) starts it at the retrieval order, as in the
    other kinds. Attention is quadratic in the list length: it ranks retrieved candidate lists
    (K0 per task), not whole pools.

    Args:
        dim: D; feat_dim: F (0 allowed); tasks: T.
        model_dim: token width M (divisible by heads); heads; layers; ffn: hidden width of the FFN.
    """

    kind = "listwise"

    def __init__(self, dim: int, feat_dim: int, tasks: int, model_dim: int = 64, heads: int = 4, layers: int = 2,
                 ffn: int = 128, dot_scale: float = 20.0) -> None:
        super().__init__()
        _check_dims(dim=dim, feat_dim=feat_dim, tasks=tasks)
        for name, v in (("model_dim", model_dim), ("heads", heads), ("layers", layers), ("ffn", ffn)):
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if model_dim % heads:
            raise ValueError(f"model_dim ({model_dim}) must be divisible by heads ({heads})")
        self.dim, self.feat_dim, self.tasks = int(dim), int(feat_dim), int(tasks)
        self.model_dim, self.heads, self.layers, self.ffn = int(model_dim), int(heads), int(layers), int(ffn)
        self.item_in = nn.Linear(dim + feat_dim, model_dim)
        self.user_in = nn.Linear(dim, model_dim)
        self.task_token = nn.Parameter(torch.randn(tasks, model_dim) * 0.02)
        self.blocks = nn.ModuleList(PreLNBlock(model_dim, heads, ffn) for _ in range(layers))
        self.out_norm = nn.LayerNorm(model_dim)
        self.head_weight = nn.Parameter(torch.empty(tasks, model_dim).uniform_(-1.0 / math.sqrt(model_dim),
                                                                               1.0 / math.sqrt(model_dim)))
        self.head_bias = nn.Parameter(torch.zeros(tasks))
        self.dot_scale = nn.Parameter(torch.full((tasks,), float(dot_scale)))

    def config(self) -> Dict[str, Any]:
        return {"dim": self.dim, "feat_dim": self.feat_dim, "tasks": self.tasks, "model_dim": self.model_dim,
                "heads": self.heads, "layers": self.layers, "ffn": self.ffn,
                "dot_scale": float(self.dot_scale.detach()[0])}

    @property
    def item_width(self) -> int:
        return self.model_dim

    @torch.jit.export
    def item_side(self, cand: Tensor, feats: Tensor) -> Tensor:
        """cand [.., D], feats [.., F] -> item tokens [.., M]."""
        w = self.item_in.weight
        return F.linear(cand.to(w.dtype), w[:, : self.dim]) + F.linear(feats.to(w.dtype), w[:, self.dim :], self.item_in.bias)

    def score(self, user: Tensor, cand: Tensor, item: Tensor, valid: Tensor) -> Tensor:
        """user float32 [B, T, D], cand [B, K, D], item [B, K, M] (`item_side`), valid bool [B, K]
        -> float32 [B, K, T]."""
        w = self.user_in.weight
        user = user.to(w.dtype)
        cand = cand.to(w.dtype)
        tokens = torch.cat([self.user_in(user) + self.task_token.to(w.dtype), item.to(w.dtype)], dim=1)  # [B, T+K, M]
        # keys a token may attend to: every user token, the valid candidates
        users = torch.ones(valid.shape[0], self.tasks, dtype=torch.bool, device=valid.device)
        keep = torch.cat([users, valid], dim=1)  # [B, T+K]
        mask = keep[:, None, None, :]  # [B, 1, 1, T+K]
        for block in self.blocks:
            tokens = block(tokens, mask)
        h = self.out_norm(tokens[:, self.tasks :])  # [B, K, M]
        dot = torch.bmm(cand, user.transpose(1, 2)) * self.dot_scale.to(w.dtype)  # [B, K, T]
        return (F.linear(h, self.head_weight, self.head_bias) + dot).float()

    def forward(self, user: Tensor, cand: Tensor, feats: Tensor) -> Tensor:
        """user float32 [B, T, D], cand float32 [B, K, D], feats float32 [B, K, F] -> float32 [B, K, T]
        (every candidate valid)."""
        return self.score(user, cand, self.item_side(cand, feats), _all_valid(cand))


def _all_valid(cand: Tensor) -> Tensor:
    """bool [B, K] of True for cand [B, K, D]."""
    return torch.ones(cand.shape[:2], dtype=torch.bool, device=cand.device)


OVERARCHES = {"mlp": MLPOverArch, "mol": MoLOverArch, "listwise": ListwiseOverArch}


def overarch_from_config(kind: str, config: Dict[str, Any]) -> nn.Module:
    """Rebuild an (untrained) OverArch from its kind ("mlp" | "mol" | "listwise") and `config()`."""
    if kind not in OVERARCHES:
        raise ValueError(f"unknown OverArch kind {kind!r} (known: {', '.join(OVERARCHES)})")
    return OVERARCHES[kind](**config)


def _check_dims(**dims: int) -> None:
    for name, v in dims.items():
        lo = 0 if name == "feat_dim" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")

