"""`RecDecoder`: the small decoder-only transformer of a generative (semantic-ID) snapshot.

A Llama-style model (RoPE, RMSNorm, grouped-query attention, SwiGLU MLP, untied LM head),
numerically equivalent to Hugging Face `LlamaForCausalLM` with the same config and
`tie_word_embeddings=False` (see `llama_config` / `decoder_to_llama_state_dict`, tested against
transformers in tests/test_decoder.py). Weights are fused gpt-fast style (`wqkv`, `w13`) so a decode
step is two matmuls per block half.

Token vocabulary (the contract shared with publish/semantic_ids.py and the training script):

    PAD = 0, BOS = 1, then one block of codes per semantic-ID level l (L levels, the last one the
    disambiguation token, always present): token = level_offsets[l] + code,
    level_offsets[l] = 2 + sum(level_sizes[:l]), vocab_size = 2 + sum(level_sizes).

    A user's history is BOS followed by its items' L tokens each, oldest first. Batches are LEFT
    padded with PAD: history int64 [B, T]. PAD keys are masked, and position ids are
    cumsum(token != PAD) - 1 (so the BOS of every row sits at position 0).

Entry points:
    forward(tokens [B, T] int64) -> logits [B, T, vocab]     causal, PAD-aware (training, reference)
    prefill(tokens)   -> last-position logits + per-layer K/V  (the shared KV of a decode)
    decode(tokens [B, W], ...)  one token per beam against shared + unshared KV (GenerativeRetrieval)

Example:
    >>> cfg = DecoderConfig(vocab_size=vocab_size(level_sizes), dim=128, n_layers=2, n_heads=4,
    ...                     n_kv_heads=2, ffn_hidden=256, max_seq_len=512)
    >>> logits = RecDecoder(cfg)(history)                     # [B, T, vocab]
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import silverrec.kernels  # noqa: F401  (registers torch.ops.silverrec.staged_attention)
from silverrec.attention import SDPA_BATCH_IN_HEADS, masked_attention

PAD = 0
BOS = 1
N_SPECIAL = 2



def level_offsets(level_sizes: list[int]) -> list[int]:
    """First token id of each semantic-ID level: 2 + sum(level_sizes[:l])."""
    out, acc = [], N_SPECIAL
    for size in level_sizes:
        out.append(acc)
        acc += int(size)
    return out


def vocab_size(level_sizes: list[int]) -> int:
    """2 (PAD, BOS) + sum(level_sizes)."""
    return N_SPECIAL + sum(int(s) for s in level_sizes)


def paths_to_tokens(paths: torch.Tensor, level_sizes: list[int]) -> torch.Tensor:
    """Semantic-ID codes int64 [..., L] -> tokens int64 [..., L] (adds each level's offset)."""
    offsets = torch.tensor(level_offsets(level_sizes), dtype=torch.int64, device=paths.device)
    return paths.to(torch.int64) + offsets


@dataclass
class DecoderConfig:
    """Shape of a `RecDecoder`. Validated on construction; `to_dict`/`from_dict` round-trip JSON.

    Attributes:
        vocab_size: 2 + sum(level_sizes) (see module docstring).
        dim: model width; n_heads * head_dim.
        n_layers: transformer blocks.
        n_heads: query heads; n_kv_heads: key/value heads (GQA), divides n_heads.
        ffn_hidden: SwiGLU hidden width.
        max_seq_len: longest history + L the RoPE table covers.
        rope_theta: RoPE base; norm_eps: RMSNorm epsilon.
    """

    vocab_size: int
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 768
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        if self.vocab_size <= N_SPECIAL:
            raise ValueError(f"DecoderConfig.vocab_size must exceed {N_SPECIAL} (PAD, BOS), got {self.vocab_size}")
        if self.dim % self.n_heads:
            raise ValueError(f"DecoderConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"DecoderConfig.n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig head_dim={self.head_dim} must be even for RoPE")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"DecoderConfig.rope_theta must be positive, got {self.rope_theta!r}")
        if not (self.norm_eps > 0):
            raise ValueError(f"DecoderConfig.norm_eps must be positive, got {self.norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DecoderConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown DecoderConfig fields {unknown}")
        return cls(**d)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32 like LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32) if dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [max_seq_len, head_dim] in Llama's rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_seq_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., S, H, hd] rotated by cos/sin [..., S, 1, hd] (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in x's dtype: the weight [out, in] is cast to it (a no-op when they match), so
    bf16 stored weights can run float32 matmuls (`RecDecoder.set_compute_dtype`)."""
    return F.linear(x, weight.to(x.dtype))


def positions_from_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Position ids int64 [B, T] of a left-padded batch: cumsum(non-PAD) - 1, PADs clamped to 0."""
    return (torch.cumsum((tokens != 0).to(torch.int64), dim=1) - 1).clamp_min(0)  # 0 = PAD


class Attention(nn.Module):
    """Grouped-query self-attention with fused QKV projection. Head h uses KV head h // group."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.batch_in_heads: bool = SDPA_BATCH_IN_HEADS
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, dim] -> RoPE'd q [B, S, H, hd], k [B, S, KV, hd], and v [B, S, KV, hd]."""
        B, S = x.shape[0], x.shape[1]
        hd = self.head_dim
        q_size = self.n_heads * hd
        kv_size = self.n_kv_heads * hd
        q, k, v = linear(x, self.wqkv.weight).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(B, S, self.n_heads, hd), cos, sin)
        k = apply_rope(k.view(B, S, self.n_kv_heads, hd), cos, sin)
        return q, k, v.view(B, S, self.n_kv_heads, hd)

    def full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Masked self-attention over the whole sequence.

        Args:
            x: [B, T, dim]; cos/sin: [B, T, 1, hd]; mask: bool [B, 1, T, T] (True = attend).
        Returns:
            out [B, T, dim], and this layer's k, v as [B, KV, T, hd] (the shared-KV layout).
        """
        B, T = x.shape[0], x.shape[1]
        q, k, v = self.qkv(x, cos, sin)
        q = q.transpose(1, 2)  # [B, H, T, hd]
        k = k.transpose(1, 2)  # [B, KV, T, hd]
        v = v.transpose(1, 2)
        group = self.n_heads // self.n_kv_heads
        kx = k[:, :, None].expand(B, self.n_kv_heads, group, T, self.head_dim).reshape(B, self.n_heads, T, self.head_dim)
        vx = v[:, :, None].expand(B, self.n_kv_heads, group, T, self.head_dim).reshape(B, self.n_heads, T, self.head_dim)
        y = masked_attention(q, kx, vx, mask, self.batch_in_heads)  # batch folded into heads on torch < 2.13
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return linear(y, self.wo.weight), k, v


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(x W1) * x W3), W1/W3 fused into `w13`."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.hidden = cfg.ffn_hidden
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.w13.weight).split([self.hidden, self.hidden], dim=-1)
        return linear(F.silu(gate) * up, self.w2.weight)


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)


class RecDecoder(nn.Module):
    """Decoder-only transformer over semantic-ID tokens (see module docstring for the vocabulary).

    Parameters: tok_embeddings [V, dim]; per layer attention.wqkv [(H + 2 KV) hd, dim],
    attention.wo [dim, H hd], feed_forward.w13 [2 F, dim], feed_forward.w2 [dim, F], two RMSNorm
    weights; norm [dim]; output [V, dim]. Buffers (non-persistent): rope_cos, rope_sin float32
    [max_seq_len, head_dim].

    Compute runs in the parameters' dtype (float32 on CPU; float64 in exactness tests), or in the
    dtype given to `set_compute_dtype` (bf16 weights, float32 compute).
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.n_layers = cfg.n_layers
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.max_seq_len = cfg.max_seq_len
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("compute_marker", torch.zeros(0), persistent=False)  # see set_compute_dtype
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Llama-style init: normal(0, std) matrices, unit RMSNorm weights."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    def set_compute_dtype(self, dtype: torch.dtype | None) -> "RecDecoder":
        """Run activations and matmuls in `dtype` whatever the weights' dtype (weights are cast per
        use), or in the weights' dtype (None, the default). E.g. bf16 weights (half the snapshot)
        with float32 compute where float32 measures faster (CPUs without bf16 matmul units).
        Call after any `.to(dtype)` of the module (which casts this marker too)."""
        dtype = self.output.weight.dtype if dtype is None else dtype
        self.register_buffer("compute_marker", torch.zeros(0, dtype=dtype), persistent=False)
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.compute_marker.dtype

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 [...] -> embeddings [..., dim] in the compute dtype."""
        return self.tok_embeddings(tokens).to(self.compute_marker.dtype)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [B, S] -> cos, sin [B, S, 1, hd] in `dtype`."""
        cos = self.rope_cos[positions].to(dtype)[:, :, None, :]
        sin = self.rope_sin[positions].to(dtype)[:, :, None, :]
        return cos, sin

    def _trunk(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Causal PAD-aware pass: final-norm hidden [B, T, dim] and per-layer K, V [B, KV, T, hd]."""
        T = tokens.shape[1]
        valid = tokens != 0  # [B, T], 0 = PAD
        positions = positions_from_tokens(tokens)
        x = self._embed(tokens)
        cos, sin = self._rope(positions, x.dtype)
        idx = torch.arange(T, device=tokens.device)
        causal = idx[None, :] <= idx[:, None]  # [T(query), T(key)]
        # A PAD query attends to itself only, so no row is fully masked (its output is unused).
        mask = (causal[None] & valid[:, None, :]) | torch.eye(T, dtype=torch.bool, device=tokens.device)[None]
        mask = mask[:, None]  # [B, 1, T, T]
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for layer in self.layers:
            h, k, v = layer.attention.full(layer.attention_norm(x), cos, sin, mask)
            x = x + h
            x = x + layer.feed_forward(layer.ffn_norm(x))
            ks.append(k)
            vs.append(v)
        return self.norm(x), ks, vs

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 [B, T] (left-padded with PAD) -> logits [B, T, vocab] (parameter dtype)."""
        h, _, _ = self._trunk(tokens)
        return linear(h, self.output.weight)

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the history once; keep its KV as the shared cache of a decode.

        Args:
            tokens: int64 [B, T], left-padded (the last column is every row's newest token).
        Returns:
            logits [B, vocab] at the last position, and the shared cache
            k, v [n_layers, B, KV, T, hd] (PAD keys are masked by `tokens != PAD` at decode time).
        """
        h, ks, vs = self._trunk(tokens)
        return linear(h[:, -1], self.output.weight), torch.stack(ks), torch.stack(vs)

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        shared_k: torch.Tensor,
        shared_v: torch.Tensor,
        key_valid: torch.Tensor,
        unshared_k: torch.Tensor,
        unshared_v: torch.Tensor,
        slot: int,
    ) -> torch.Tensor:
        """One new token per beam, attending to the shared history KV and its own unshared KV.

        Args:
            tokens: int64 [B, W] one token per beam; positions: int64 [B] their position id.
            shared_k, shared_v: [n_layers, B, KV, T, hd] from `prefill` (stored once per request).
                Attention runs in their dtype (GenerativeRetrieval keeps them float32 when the
                weights are bf16: the matmuls run in bf16, the attention in float32).
            key_valid: bool [B, T], False at PAD keys.
            unshared_k, unshared_v: [n_layers, B*W, S, KV, hd] per-beam cache, slots < `slot` filled
                (already reordered to the current beams). This step's K/V is written at `slot`
                (in place).
            slot: static int in [0, S).
        Returns:
            logits [B, W, vocab].
        """
        B, W = tokens.shape[0], tokens.shape[1]
        x = self._embed(tokens)  # [B, W, dim]
        cos, sin = self._rope(positions[:, None].expand(B, W), x.dtype)  # [B, W, 1, hd]
        i = 0
        for layer in self.layers:
            attn = layer.attention
            q, k, v = attn.qkv(layer.attention_norm(x), cos, sin)  # [B, W, H|KV, hd]
            unshared_k[i, :, slot] = k.reshape(B * W, self.n_kv_heads, self.head_dim)
            unshared_v[i, :, slot] = v.reshape(B * W, self.n_kv_heads, self.head_dim)
            y = torch.ops.silverrec.staged_attention(
                q.to(shared_k.dtype), shared_k[i], shared_v[i], key_valid, unshared_k[i], unshared_v[i], slot + 1
            )  # [B, W, H, hd]
            x = x + linear(y.reshape(B, W, self.n_heads * self.head_dim).to(x.dtype), attn.wo.weight)
            x = x + layer.feed_forward(layer.ffn_norm(x))
            i += 1
        return linear(self.norm(x), self.output.weight)


def llama_config(cfg: DecoderConfig):
    """The transformers `LlamaConfig` equivalent to `cfg` (untied embeddings, no biases)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=None,
    )


def decoder_to_llama_state_dict(model: RecDecoder) -> dict[str, torch.Tensor]:
    """`LlamaForCausalLM` state dict with `model`'s weights (fused matrices split)."""
    cfg = model.config
    hd = cfg.head_dim
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.tok_embeddings.weight.detach().clone(),
        "model.norm.weight": model.norm.weight.detach().clone(),
        "lm_head.weight": model.output.weight.detach().clone(),
    }
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.attention.wqkv.weight.detach().split(
            [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd], dim=0
        )
        gate, up = layer.feed_forward.w13.weight.detach().split([cfg.ffn_hidden, cfg.ffn_hidden], dim=0)
        sd[p + "self_attn.q_proj.weight"] = q.clone()
        sd[p + "self_attn.k_proj.weight"] = k.clone()
        sd[p + "self_attn.v_proj.weight"] = v.clone()
        sd[p + "self_attn.o_proj.weight"] = layer.attention.wo.weight.detach().clone()
        sd[p + "mlp.gate_proj.weight"] = gate.clone()
        sd[p + "mlp.up_proj.weight"] = up.clone()
        sd[p + "mlp.down_proj.weight"] = layer.feed_forward.w2.weight.detach().clone()
        sd[p + "input_layernorm.weight"] = layer.attention_norm.weight.detach().clone()
        sd[p + "post_attention_layernorm.weight"] = layer.ffn_norm.weight.detach().clone()
    return sd


def to_llama(model: RecDecoder):
    """A `LlamaForCausalLM` (eval mode, same dtype) computing the same logits as `model`."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(llama_config(model.config))
    hf.load_state_dict(decoder_to_llama_state_dict(model), strict=True)
    return hf.to(model.output.weight.dtype).eval()
