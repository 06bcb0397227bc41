"""`silverrec train --generative`: the generative (semantic-ID) decoder, from generic logs.

    silverrec train --generative --config generative.toml --out generative.ckpt [--minutes M] [--seed S]
                    [--stage test|valid]

Data: the same `interactions.parquet` / `items.parquet` as the two-tower trainer, read with
`publish/logs.py` `read_logs` and split with `leave_one_out` (the same protocol: each user's last
interaction is the test item, the one before it the validation item). At stage "test" (default)
the decoder is fitted on every user's history at "test" (train + validation items), at stage
"valid" on the train items only; the held-out targets of the stage are evaluated.

Semantic IDs: residual k-means (publish/semantic_ids.py) over an item embedding of the pool, named
by the config's `embeddings`:
  * a `silverrec train` checkpoint (the default in a config: its two-tower item tower's embedding of
    every pool item, `ckpt["item_embeddings"]`, computed by the item tower at the end of training);
  * a Parquet file with `item_id` and `embedding` columns (e.g. items.parquet itself);
  * "svd": collaborative item factors computed here, V * S of the rank-`svd_dim` truncated SVD of the
    binary user x item matrix of the stage's training histories (PureSVD; nothing held out is seen);
  * "items": one token per item instead of semantic IDs (the SASRec-style reference: a full softmax
    over items, `semantic_ids.item_token_ids`).
Every pool item needs an embedding (a named PoolError otherwise).

Training: causal next-token cross-entropy over windows of at most `max_history + 1` items, BOS +
their L tokens each, left-padded; every item token of the window is a target, so one window trains
every history length up to `max_history`. The softmax of each target runs over the valid next
tokens only (`ValidNext`: the children of the item's prefix in the trie the decode walks), so the
model spends no steps learning which code paths exist (with one token per item: every item, i.e.
the full softmax). AdamW, linear warm-up then
cosine decay over the wall-clock budget (`minutes`, or `max_steps` for reproducible runs).

Evaluation (the project's protocol, publish/evaluate.py): HR@10 and NDCG@10 of the beam decode's
top list (`GenerativeRetrieval`, beam `eval_beam`), the user's history items excluded during the
decode through the item bitmask, the rank of the held-out target in that list (`ranks_from_topk`);
beside the popularity baseline. With one token per item the decode of beam >= 10 is the exact top
of the full softmax, i.e. full ranking.

Checkpoint API (stable, publish/generative_checkpoint.py; the publish step and the hybrid RecModel build on it):
    save_checkpoint(path, decoder, sids, cfg, metrics)
    decoder, sids, meta = load_checkpoint(path)   # RecDecoder (eval), SemanticIds,
                                                  # {"train_config": dict, "metrics": dict}
`meta["train_config"]["max_history"]` is the history length the decoder was trained on.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from silverrec.bitmask import pack_bits
from silverrec.errors import PoolError
from silverrec.generative.decoder import N_SPECIAL, DecoderConfig, RecDecoder
from silverrec.generative.generative import GenerativeRetrieval
from silverrec.generative.trie import ValidPathTrie
from silverrec.publish.config import ConfigError, read_toml
from silverrec.publish.evaluate import metrics_from_ranks, ranks_from_topk
from silverrec.publish.generative import build_generative
from silverrec.publish.generative_checkpoint import save_checkpoint
from silverrec.publish.logs import Split, leave_one_out, read_logs
from silverrec.publish.progress import quiet, step
from silverrec.publish.semantic_ids import SemanticIds, build_semantic_ids, history_tokens, item_token_ids
from silverrec.threads import num_threads

ITEM_TOKENS = "items"  # `embeddings` value: one token per item (the reference), no semantic IDs
SVD = "svd"  # `embeddings` value: item factors of a truncated SVD of the training interactions


@dataclass
class TrainConfig:
    """One generative training run (a TOML file, `TrainConfig.from_toml`, or keyword arguments).

    interactions, items: the generic logs (publish/logs.py). embeddings: a `silverrec train`
        checkpoint, a Parquet file with item_id + embedding, "svd" or "items" (module docstring).
    levels, codes: residual k-means levels and codes per level of the semantic IDs (default one
        level of 256 clusters + the item's popularity rank in its cluster: 2 tokens per item; on
        MovieLens 0.95x the item-token decoder's HR@10 at equal steps, 3 x 256 + 1 scored 0.62x
        with 4 tokens per item, benchmarks/results/generative_quality_400steps*.json; the last
        level has as many codes as the largest cluster has items, so raise codes for big pools).
    disambiguation: order of the items sharing a code path in the last level: "popular" (most
        training interactions first: the last token then means "the k-th most popular item of this
        path" under every path) or "nearest" (to the path's reconstruction first).
    svd_dim: rank of the "svd" item factors.
    minutes: wall-clock budget of the optimisation loop; max_steps: optional step cap.
    max_history: items of history the model sees (training windows and serving truncation).
    eval_beam: beam width (and per-beam top_k) of the evaluation decode, >= 10.
    eval_users: evaluate only the first n eval users (None: all).
    stage: "test" (fit on train + validation items, evaluate test) or "valid".
    threads: torch intra-op threads while training (1 by default: on the shared 2-core machine a
        step took 1.4 s with 1 thread vs 4.9 s with 2, the second thread mostly waiting).
    """

    interactions: Optional[str] = None
    items: Optional[str] = None
    embeddings: Optional[str] = None
    levels: int = 1
    codes: int = 256
    disambiguation: str = "popular"
    svd_dim: int = 64
    minutes: float = 3.0
    max_steps: Optional[int] = None
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 384
    max_history: int = 20
    batch_size: int = 32
    lr: float = 5e-3
    weight_decay: float = 0.05
    warmup_steps: int = 30
    seed: int = 0
    eval_beam: int = 20
    eval_users: Optional[int] = None
    stage: str = "test"
    threads: Optional[int] = 1

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ConfigError(f"minutes must be positive, got {self.minutes}")
        for name in ("levels", "codes", "max_history", "batch_size", "dim", "n_layers"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_beam < 10:
            raise ConfigError(f"eval_beam must be >= 10 (HR@10), got {self.eval_beam}")
        if self.disambiguation not in ("nearest", "popular"):
            raise ConfigError(f"disambiguation must be 'nearest' or 'popular', got {self.disambiguation!r}")
        if self.stage not in ("test", "valid"):
            raise ConfigError(f"stage must be 'test' or 'valid', got {self.stage!r}")

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        cfg = read_toml(cls, path, path_keys=("interactions", "items", "embeddings"),
                        required=("interactions", "items", "embeddings"), **overrides)
        if Path(cfg.embeddings).name in (ITEM_TOKENS, SVD) and not Path(cfg.embeddings).exists():
            cfg.embeddings = Path(cfg.embeddings).name  # the keyword, not a file next to the config
        return cfg


@dataclass
class Metrics:
    """Training statistics and held-out metrics of a run (eval users of the stage)."""

    steps: int = 0
    train_seconds: float = 0.0
    train_loss: float = float("nan")
    heldout_loss: float = float("nan")  # mean NLL (nats) per target item of the stage (`target_loss`)
    users: int = 0
    eval_beam: int = 0
    model: dict[str, float] = field(default_factory=dict)
    popularity: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        def fmt(d: dict[str, float]) -> str:
            return ", ".join(f"{k} {v:.4f}" for k, v in sorted(d.items()))

        return (
            f"{self.steps} steps in {self.train_seconds:.0f}s, train loss {self.train_loss:.3f}, "
            f"held-out loss {self.heldout_loss:.3f}; {self.users} eval users, beam {self.eval_beam}\n"
            f"  model      {fmt(self.model)}\n  popularity {fmt(self.popularity)}"
        )


@dataclass
class Sequences:
    """What one stage of the split trains and evaluates on; items are pool rows (int64), oldest first."""

    train: list[np.ndarray]  # every user's history at the stage (the training sequences)
    eval_history: list[np.ndarray]  # per eval user, the history the model sees
    eval_target: np.ndarray  # int64 [U'] the held-out pool row

    @classmethod
    def from_split(cls, split: Split, stage: str) -> "Sequences":
        offsets, rows = split.history_csr(stage)
        train = [rows[offsets[u] : offsets[u + 1]] for u in range(len(offsets) - 1)]
        return cls(train, split.histories(split.eval_users, stage), split.targets(stage).copy())


# ---------------------------------------------------------------------------------- embeddings


def item_embeddings(source: str, item_ids: np.ndarray) -> np.ndarray:
    """float32 [N, D] embedding of each pool item (item_ids int64 [N]) from `source`: a `silverrec
    train` checkpoint (its item tower's `item_embeddings`) or a Parquet file with item_id + embedding.

    Raises PoolError naming the first pool item the source has no embedding for."""
    path = Path(source)
    if not path.is_file():
        raise PoolError(f"embeddings source {source} does not exist (a silverrec train checkpoint, a Parquet "
                        f"file with item_id and embedding, or {ITEM_TOKENS!r})")
    if path.suffix == ".parquet":
        from silverrec.publish.pool import read_pool

        pool = read_pool(path)
        ids, emb = pool.item_ids, pool.embeddings
    else:
        from silverrec.publish.train import load_checkpoint as load_two_tower

        ckpt = load_two_tower(path)
        if not isinstance(ckpt, dict) or "item_embeddings" not in ckpt or "item_ids" not in ckpt:
            raise PoolError(f"{source} is not a silverrec train checkpoint (no item_embeddings)")
        ids = np.asarray(ckpt["item_ids"], dtype=np.int64)
        emb = torch.as_tensor(ckpt["item_embeddings"]).float().numpy()
    order = np.argsort(ids, kind="stable")
    pos = np.searchsorted(ids[order], item_ids).clip(0, len(ids) - 1)
    missing = np.flatnonzero(ids[order][pos] != item_ids)
    if missing.size:
        raise PoolError(f"item {int(item_ids[missing[0]])} of the logs has no embedding in {path.name} "
                        f"({missing.size} such items)")
    return np.ascontiguousarray(emb[order[pos]], dtype=np.float32)


def svd_item_embeddings(train: list[np.ndarray], n_items: int, dim: int, seed: int = 0) -> np.ndarray:
    """float32 [n_items, dim]: V * S of the rank-`dim` truncated SVD of the binary user x item matrix
    of `train` (per user, pool rows int64), by `torch.svd_lowrank` (randomised, 16 extra columns of
    oversampling). Items no user has get zero rows; columns past min(users, items) are zero."""
    users = np.repeat(np.arange(len(train)), [len(t) for t in train])
    cells = np.unique(users * n_items + np.concatenate(train).astype(np.int64)) if users.size else np.zeros(0, np.int64)
    index = torch.from_numpy(np.stack([cells // n_items, cells % n_items]))
    matrix = torch.sparse_coo_tensor(index, torch.ones(cells.size), (len(train), n_items), check_invariants=True)
    rank = min(dim, len(train), n_items)
    torch.manual_seed(seed)
    _, s, v = torch.svd_lowrank(matrix.coalesce(), q=min(rank + 16, len(train), n_items), niter=6)
    out = np.zeros((n_items, dim), np.float32)
    out[:, :rank] = (v[:, :rank] * s[:rank]).numpy()
    return out


def semantic_ids_for(cfg: TrainConfig, item_ids: np.ndarray, train: list[np.ndarray] | None = None) -> SemanticIds:
    """The item vocabulary of a run: semantic IDs of `cfg.embeddings`, or one token per item.
    train: the training histories (pool rows), needed by embeddings "svd" and disambiguation "popular"."""
    if cfg.embeddings == ITEM_TOKENS:
        return item_token_ids(item_ids)
    if cfg.embeddings is None:
        raise ConfigError("embeddings is not set: a silverrec train checkpoint, a Parquet file with item_id and "
                          f"embedding, {SVD!r} or {ITEM_TOKENS!r}")
    if cfg.embeddings == SVD:
        if train is None:
            raise ConfigError(f"embeddings {SVD!r} needs the training histories (semantic_ids_for(..., train=))")
        emb = svd_item_embeddings(train, len(item_ids), cfg.svd_dim, cfg.seed)
    else:
        emb = item_embeddings(cfg.embeddings, item_ids)
    order = None
    if cfg.disambiguation == "popular":
        if train is None:
            raise ConfigError("disambiguation 'popular' needs the training histories (semantic_ids_for(..., train=))")
        order = -np.bincount(np.concatenate(train), minlength=len(item_ids)).astype(np.float64)
    with step(f"semantic IDs (residual k-means, {cfg.levels} x {cfg.codes}, over {emb.shape[1]}-d embeddings)"):
        return build_semantic_ids(emb, item_ids, levels=cfg.levels, codes=cfg.codes, seed=cfg.seed, order=order)


# ------------------------------------------------------------------------------------ training


def left_pad(histories: list[np.ndarray], item_tokens: torch.Tensor, max_items: int) -> torch.Tensor:
    """BOS + the L tokens of the last `max_items` items of each history (pool rows, oldest first),
    left-padded with PAD: int64 [B, T] (semantic_ids.history_tokens with rows as ids)."""
    return history_tokens(histories, np.arange(item_tokens.shape[0]), item_tokens.numpy(), max_items)


def training_windows(train: list[np.ndarray], max_history: int) -> list[tuple[int, int, int]]:
    """(user, start, end) windows of at most max_history + 1 items, stride max_history // 2, covering
    every training item as a target at least once (sequences of one item have no target)."""
    size = max_history + 1
    stride = max(1, size // 2)
    out = []
    for u, seq in enumerate(train):
        n = len(seq)
        if n < 2:
            continue
        ends = list(range(min(size, n), n + 1, stride))
        if ends[-1] != n:
            ends.append(n)
        out.extend((u, max(0, e - size), e) for e in ends)
    return out


def decoder_config(sids: SemanticIds, cfg: TrainConfig, serve_tokens: int = 2048) -> DecoderConfig:
    """Decoder shape for `sids`; the RoPE table covers max(training windows, serve_tokens) + L."""
    L = sids.depth
    return DecoderConfig(
        vocab_size=sids.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads, ffn_hidden=cfg.ffn_hidden,
        max_seq_len=max(1 + L * (cfg.max_history + 1), serve_tokens) + L,
    )


class ValidNext:
    """The valid next tokens of every item token: the children of its prefix in the trie of `sids`.

    parents: int64 [N, L], the trie node of each pool row's level-l prefix (column 0: the root);
    allowed: bool [n_internal, vocab], the decoder tokens of each internal node's children
    (`ValidPathTrie.child_tokens`). With one token per item: every item token after any history.
    """

    def __init__(self, sids: SemanticIds):
        trie = ValidPathTrie(torch.from_numpy(sids.paths), sids.level_sizes)
        self.parents = torch.empty(len(sids.item_ids), sids.depth, dtype=torch.int64)
        self.parents[trie.row_order] = trie.path_nodes()[:, : sids.depth]
        self.allowed = trie.child_tokens(sids.level_offsets, sids.vocab_size)

    def mask(self, histories: list[np.ndarray], max_items: int) -> torch.Tensor:
        """bool [B, T, vocab] for the tokens `left_pad(histories, ., max_items)` builds: row t allows
        the valid values of token t; every token at BOS / PAD columns (not targets)."""
        item = left_pad(histories, torch.full_like(self.parents, 2), max_items) == 2  # not BOS (1) / PAD (0)
        nodes = left_pad(histories, self.parents, max_items).masked_fill(~item, 0)  # the tokens' layout
        return self.allowed[nodes] | ~item[:, :, None]


def lm_loss(model: RecDecoder, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy over the item-token targets (not PAD / BOS) of tokens int64
    [B, T]; valid: bool [B, T, vocab] (`ValidNext.mask`) restricts each target's softmax, or None."""
    logits = model(tokens[:, :-1]).float()
    if valid is not None:
        logits = logits.masked_fill(~valid[:, 1:], float("-inf"))
    target = tokens[:, 1:].masked_fill(tokens[:, 1:] < N_SPECIAL, -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)


def train_decoder(sids: SemanticIds, data: Sequences, cfg: TrainConfig) -> tuple[RecDecoder, Metrics]:
    """Train a `RecDecoder` on data.train within the budget; returns it (eval mode) and metrics
    (steps, losses; the ranking metrics are filled by `evaluate_all`)."""
    torch.manual_seed(cfg.seed)
    with num_threads(cfg.threads):
        return _train(sids, data, cfg, np.random.default_rng(cfg.seed))


def _train(sids: SemanticIds, data: Sequences, cfg: TrainConfig, rng: np.random.Generator) -> tuple[RecDecoder, Metrics]:
    item_tokens = torch.from_numpy(sids.tokens())
    valid_next = ValidNext(sids)
    model = RecDecoder(decoder_config(sids, cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    windows = training_windows(data.train, cfg.max_history)
    if not windows:
        raise PoolError("no user has 2 or more training interactions: nothing to train on")
    budget = cfg.minutes * 60.0
    metrics = Metrics()
    t0 = time.perf_counter()
    steps, ema, perm, cursor = 0, None, rng.permutation(len(windows)), 0
    model.train()
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed >= budget or (cfg.max_steps is not None and steps >= cfg.max_steps):
            break
        if cursor + cfg.batch_size > len(perm):
            perm, cursor = rng.permutation(len(windows)), 0
        batch = [windows[i] for i in perm[cursor : cursor + cfg.batch_size]]
        cursor += cfg.batch_size
        windows_b = [data.train[u][a:e] for u, a, e in batch]
        tokens = left_pad(windows_b, item_tokens, cfg.max_history + 1)
        frac = elapsed / budget if cfg.max_steps is None else max(elapsed / budget, steps / cfg.max_steps)
        lr = cfg.lr * min(1.0, (steps + 1) / cfg.warmup_steps) * 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = lm_loss(model, tokens, valid_next.mask(windows_b, cfg.max_history + 1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        value = float(loss.detach())
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        if not quiet() and steps % 50 == 0:
            print(f"[silverrec] step {steps} loss {ema:.3f} lr {lr:.2e} ({elapsed:.0f}s)", file=sys.stderr, flush=True)
    metrics.steps, metrics.train_seconds, metrics.train_loss = steps, time.perf_counter() - t0, float(ema or "nan")
    model.eval()
    metrics.heldout_loss = target_loss(model, data.eval_history, data.eval_target, item_tokens, cfg.max_history, valid_next)
    return model, metrics


@torch.no_grad()
def target_loss(model: RecDecoder, histories: list[np.ndarray], targets: np.ndarray, item_tokens: torch.Tensor,
                max_items: int, valid_next: ValidNext, batch: int = 64) -> float:
    """Mean negative log-likelihood (nats) of each target item given its history: the sum of its L
    tokens' cross-entropies, each over its valid next tokens, so comparable across vocabularies."""
    total = 0.0
    L = item_tokens.shape[1]
    for s in range(0, len(histories), batch):
        rows = torch.from_numpy(targets[s : s + batch])
        hist = left_pad(histories[s : s + batch], item_tokens, max_items)
        tokens = torch.cat([hist, item_tokens[rows]], dim=1)
        logits = model(tokens[:, :-1])[:, -L:].float()
        logits = logits.masked_fill(~valid_next.allowed[valid_next.parents[rows]], float("-inf"))
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, -L:].reshape(-1), reduction="sum"))
    return total / max(len(histories), 1)


# ---------------------------------------------------------------------------------- evaluation


def exclusion_bitmask(histories: list[np.ndarray], trie: ValidPathTrie) -> torch.Tensor:
    """Packed item bitmask int64 [B, ceil(N/64)] (trie leaf order) allowing every item except each
    history's items (pool rows)."""
    leaf_of = torch.empty(trie.n_items, dtype=torch.int64)
    leaf_of[trie.row_order] = torch.arange(trie.n_items)
    allowed = torch.ones(len(histories), trie.n_items, dtype=torch.bool)
    for b, h in enumerate(histories):
        allowed[b, leaf_of[torch.from_numpy(np.asarray(h, dtype=np.int64))]] = False
    return pack_bits(allowed)


def keep_top(metrics: dict[str, float], depth: int) -> dict[str, float]:
    """The metrics of `metrics_from_ranks` a top-`depth` list measures exactly (@K with K <= depth)."""
    return {k: v for k, v in metrics.items() if int(k.split("@")[1]) <= depth}


@torch.no_grad()
def decode_rows(module: GenerativeRetrieval, sids: SemanticIds, histories: list[np.ndarray], max_items: int,
                exclude_history: bool = True, batch: int = 32) -> np.ndarray:
    """Pool rows int64 [U, W] of the beam decode's list per history (-1 = none), best first."""
    item_tokens = torch.from_numpy(sids.tokens())
    order = np.argsort(sids.item_ids, kind="stable")
    out = []
    for s in range(0, len(histories), batch):
        hs = histories[s : s + batch]
        mask = exclusion_bitmask(hs, module.trie) if exclude_history else None
        ids = module(left_pad(hs, item_tokens, max_items), mask)[0].numpy()
        rows = order[np.searchsorted(sids.item_ids[order], ids).clip(0, len(order) - 1)]
        out.append(np.where(ids >= 0, rows, -1))
    return np.concatenate(out)


def popularity_rows(train: list[np.ndarray], histories: list[np.ndarray], n_items: int, k: int) -> np.ndarray:
    """The k most frequent training items (ties: lower row) not in each history: int64 [U, k]."""
    counts = np.bincount(np.concatenate(train), minlength=n_items) if train else np.zeros(n_items, np.int64)
    order = np.argsort(-counts, kind="stable")
    out = np.full((len(histories), k), -1, np.int64)
    for b, h in enumerate(histories):
        top = order[: k + len(h)]
        top = top[~np.isin(top, h)][:k]
        out[b, : top.size] = top
    return out


def evaluate_all(decoder: RecDecoder, sids: SemanticIds, data: Sequences, cfg: TrainConfig, metrics: Metrics) -> Metrics:
    """Fill metrics.model / metrics.popularity (HR@10, NDCG@10, history excluded) on the eval users."""
    n = len(data.eval_history) if cfg.eval_users is None else min(cfg.eval_users, len(data.eval_history))
    hist, tgt = data.eval_history[:n], torch.from_numpy(data.eval_target[:n])
    module = build_module(decoder, sids, cfg.eval_beam)
    rows = decode_rows(module, sids, hist, cfg.max_history)
    metrics.users, metrics.eval_beam = n, cfg.eval_beam
    metrics.model = keep_top(metrics_from_ranks(ranks_from_topk(torch.from_numpy(rows), tgt)), cfg.eval_beam)
    pop = popularity_rows(data.train, hist, len(sids.item_ids), cfg.eval_beam)
    metrics.popularity = keep_top(metrics_from_ranks(ranks_from_topk(torch.from_numpy(pop), tgt)), cfg.eval_beam)
    return metrics


def build_module(decoder: RecDecoder, sids: SemanticIds, beam_width: int) -> GenerativeRetrieval:
    """The float32 decode of `sids` with beam `beam_width` (= per-beam top_k)."""
    return build_generative(decoder, sids, beam_width)


# ------------------------------------------------------------------------------------ the run


def train(cfg: TrainConfig, out: str | Path | None = None) -> tuple[RecDecoder, SemanticIds, Metrics]:
    """Read the logs, split, build the item vocabulary, train, evaluate; save at `out` if given."""
    with step("reading logs"):
        logs = read_logs(cfg.interactions, cfg.items, seed=cfg.seed)
    data = Sequences.from_split(leave_one_out(logs), cfg.stage)
    sids = semantic_ids_for(cfg, logs.item_ids, data.train)
    if not quiet():
        print(f"[silverrec] {logs.num_items:,} items, {logs.num_users:,} users, {len(data.eval_target):,} eval users "
              f"(stage {cfg.stage}); {sids.stats.summary()}", file=sys.stderr)
    with step(f"training decoder ({cfg.minutes:g} min budget)"):
        decoder, metrics = train_decoder(sids, data, cfg)
    with step("evaluating on held-out users"), num_threads(cfg.threads):
        evaluate_all(decoder, sids, data, cfg, metrics)
    if not quiet():
        print(f"[silverrec] {metrics.summary()}", file=sys.stderr)
    if out is not None:
        save_checkpoint(out, decoder, sids, cfg, metrics)
    return decoder, sids, metrics
