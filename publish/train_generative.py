"""Train the generative retrieval decoder on the bundled MovieLens user sequences.

    python -m silverrec.publish.train_generative --minutes 3 --out generative.ckpt

Data: every user's movies in rating-time order (`movielens.user_sequences`). Leave-last-item-out:
the last item of each user is the test target (history = everything before it), the second-to-last
the validation target (history = everything before it); the rest is training data. Item
embeddings for the semantic IDs come from the training ratings only (no held-out interaction leaks
into the codes): matrix-factorisation item factors, concatenated with genre one-hots scaled to the
same mean norm (`--no-genres` to drop them; see `movielens_item_embeddings`).

Training: causal next-token cross-entropy (full vocabulary) over windows of at most
`max_history + 1` items, BOS + their L tokens each, left-padded; every item token of the window is a
target, so one window trains every history length up to `max_history`. AdamW, linear warm-up then
cosine decay over the wall-clock budget.

Evaluation on held-out users: validation loss (mean cross-entropy per target token), and
recall@10 / NDCG@10 of the `GenerativeRetrieval` beam decode (beam width >= 10, the top 10 of the
beam) vs a popularity baseline, both with and without excluding the user's history items (the
model excludes them through the per-request item bitmask, i.e. during decoding).

The checkpoint (`torch.save`, loadable with `weights_only=True`) holds the decoder config and
weights, the semantic IDs (item ids, paths, level sizes, statistics) and the metrics.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from silverrec.generative.decoder import PAD, DecoderConfig, RecDecoder
from silverrec.errors import PoolError
from silverrec.generative.generative import GenerativeRetrieval
from silverrec.serving.predictor import history_tokens
from silverrec.publish import movielens
from silverrec.publish.generative import build_generative
from silverrec.publish.progress import quiet, step
from silverrec.publish.semantic_ids import SemanticIds, SemanticIdStats, build_semantic_ids
from silverrec.bitmask import pack_bits
from silverrec.generative.trie import ValidPathTrie


@dataclass
class TrainConfig:
    """Model shape, optimiser and budget of one training run.

    minutes: wall-clock budget of the optimisation loop; max_steps: optional step cap (tests).
    max_history: items of history the model sees (training windows and serving truncation).
    eval_beam: beam width (and per-beam top_k) of the evaluation decode, >= 10.
    threads: torch intra-op threads while training (1 by default: on this shared 2-core machine a
        step took 1.4 s with 1 thread vs 4.9 s with 2, the second thread mostly waiting).
    """

    minutes: float = 3.0
    max_steps: int | None = None
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
    eval_users: int | None = None
    threads: int | None = 1

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"TrainConfig.minutes must be positive, got {self.minutes}")
        if self.max_history < 1:
            raise ValueError(f"TrainConfig.max_history must be >= 1, got {self.max_history}")
        if self.eval_beam < 10:
            raise ValueError(f"TrainConfig.eval_beam must be >= 10 (recall@10), got {self.eval_beam}")


@dataclass
class Split:
    """Leave-last-item-out split; items are pool rows (int64), histories oldest first."""

    user_ids: np.ndarray  # int64 [U]
    train: list[np.ndarray]  # per user: all items but the last two
    valid_history: list[np.ndarray]
    valid_target: np.ndarray  # int64 [U]
    test_history: list[np.ndarray]
    test_target: np.ndarray  # int64 [U]


@dataclass
class Metrics:
    """Held-out metrics of a trained model (test users unless stated)."""

    steps: int = 0
    train_seconds: float = 0.0
    train_loss: float = float("nan")
    valid_loss: float = float("nan")
    users: int = 0
    model: dict[str, float] = field(default_factory=dict)
    popularity: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        def fmt(d: dict[str, float]) -> str:
            return ", ".join(f"{k} {v:.4f}" for k, v in sorted(d.items()))

        return (
            f"{self.steps} steps in {self.train_seconds:.0f}s, train loss {self.train_loss:.3f}, "
            f"valid loss {self.valid_loss:.3f}; {self.users} test users\n"
            f"  model      {fmt(self.model)}\n  popularity {fmt(self.popularity)}"
        )


# ---------------------------------------------------------------------------------------- data


def split_sequences(sequences: dict[int, np.ndarray], item_ids: np.ndarray) -> Split:
    """Map each user's item ids to pool rows (items outside the pool dropped) and hold out the last
    two. Users with fewer than 3 pool items are skipped."""
    order = np.argsort(item_ids)
    sorted_ids = item_ids[order]
    users, train, vh, vt, th, tt = [], [], [], [], [], []
    for user, seq in sequences.items():
        pos = np.searchsorted(sorted_ids, seq).clip(0, len(sorted_ids) - 1)
        rows = order[pos][sorted_ids[pos] == seq].astype(np.int64)
        if rows.size < 3:
            continue
        users.append(user)
        train.append(rows[:-2])
        vh.append(rows[:-2])
        vt.append(rows[-2])
        th.append(rows[:-1])
        tt.append(rows[-1])
    if not users:
        raise PoolError("no user has 3 or more items of the pool: nothing to train on")
    return Split(np.asarray(users, np.int64), train, vh, np.asarray(vt, np.int64), th, np.asarray(tt, np.int64))


def left_pad(histories: list[np.ndarray], item_tokens: torch.Tensor, max_items: int) -> torch.Tensor:
    """BOS + the L tokens of the last `max_items` items of each history (item rows, oldest first),
    left-padded with PAD: int64 [B, T] (the predictor's `history_tokens` with rows as ids)."""
    return history_tokens(histories, np.arange(item_tokens.shape[0]), item_tokens.numpy(), max_items)


def training_windows(train: list[np.ndarray], max_history: int) -> list[tuple[int, int, int]]:
    """(user, start, end) windows of at most max_history + 1 items, stride max_history // 2, covering
    every training item as a target at least once."""
    size = max_history + 1
    stride = max(1, size // 2)
    out = []
    for u, seq in enumerate(train):
        n = len(seq)
        if n == 0:
            continue
        ends = list(range(min(size, n), n + 1, stride))
        if ends[-1] != n:
            ends.append(n)
        out.extend((u, max(0, e - size), e) for e in ends)
    return out


def movielens_item_embeddings(split_users: dict[int, np.ndarray] | None = None, *, genres: bool = True,
                              dim: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Item embeddings for semantic IDs: PureSVD item factors (+ genre one-hots) of every movie.

    Args:
        split_users: user -> time-ordered movie ids whose last two items are held out; their ratings
            are excluded from the factorisation (no leak into the codes). None = use all ratings.
        genres: append genre one-hots, scaled so their mean row norm equals the factors' (the
            factors alone put unrated movies on the zero vector and movies rated by one user on
            near-identical vectors; genres separate them and cut code-path collisions).
        dim: factorisation rank.
    Returns:
        movie ids int64 [M] and embeddings float32 [M, D].
    """
    ratings = movielens.load_ratings()
    if split_users is not None:
        held = {(u, int(m)) for u, seq in split_users.items() for m in seq[-2:]}
        keep = np.fromiter(((int(u), int(m)) not in held for u, m in zip(ratings.user_ids, ratings.movie_ids)),
                           dtype=bool, count=len(ratings.user_ids))
        ratings = movielens.Ratings(ratings.user_ids[keep], ratings.movie_ids[keep], ratings.ratings[keep],
                                    ratings.timestamps[keep])
    movies = movielens.load_movies()
    fac = movielens.factorise(dim=dim, ratings=ratings, movie_ids=movies.movie_ids)
    emb = fac.item_factors
    if genres:
        names = sorted({g for gs in movies.genres for g in gs})
        col = {g: i for i, g in enumerate(names)}
        onehot = np.zeros((len(movies.movie_ids), len(names)), np.float32)
        for i, gs in enumerate(movies.genres):
            onehot[i, [col[g] for g in gs]] = 1.0
        norms = np.linalg.norm(onehot, axis=1)
        scale = np.linalg.norm(emb, axis=1).mean() / max(norms[norms > 0].mean(), 1e-12)
        emb = np.concatenate([emb, scale * onehot], axis=1)
    return movies.movie_ids, emb.astype(np.float32)


# ------------------------------------------------------------------------------------ training


def decoder_config(sids: SemanticIds, cfg: TrainConfig, serve_tokens: int = 2048) -> DecoderConfig:
    """Decoder shape for `sids`; the RoPE table covers max(training windows, serve_tokens) + L."""
    L = sids.depth
    return DecoderConfig(
        vocab_size=sids.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads, ffn_hidden=cfg.ffn_hidden,
        max_seq_len=max(1 + L * (cfg.max_history + 1), serve_tokens) + L,
    )


def lm_loss(model: RecDecoder, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the non-PAD targets of tokens int64 [B, T]."""
    logits = model(tokens[:, :-1])
    target = tokens[:, 1:].masked_fill(tokens[:, 1:] == PAD, -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100)


def train_decoder(sids: SemanticIds, split: Split, cfg: TrainConfig) -> tuple[RecDecoder, Metrics]:
    """Train a `RecDecoder` on split.train within the budget; returns it (eval mode) and metrics."""
    torch.manual_seed(cfg.seed)
    with torch_threads(cfg.threads):
        return _train(sids, split, cfg, np.random.default_rng(cfg.seed))


def _train(sids: SemanticIds, split: Split, cfg: TrainConfig, rng: np.random.Generator) -> tuple[RecDecoder, Metrics]:
    item_tokens = torch.from_numpy(sids.tokens())
    model = RecDecoder(decoder_config(sids, cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    windows = training_windows(split.train, cfg.max_history)
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
        tokens = left_pad([split.train[u][a:e] for u, a, e in batch], item_tokens, cfg.max_history + 1)
        frac = elapsed / budget if cfg.max_steps is None else max(elapsed / budget, steps / cfg.max_steps)
        lr = cfg.lr * min(1.0, (steps + 1) / cfg.warmup_steps) * 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = lm_loss(model, tokens)
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
    metrics.valid_loss = target_loss(model, split.valid_history, split.valid_target, item_tokens, cfg.max_history)
    return model, metrics


@torch.no_grad()
def target_loss(model: RecDecoder, histories: list[np.ndarray], targets: np.ndarray, item_tokens: torch.Tensor,
                max_items: int, batch: int = 64) -> float:
    """Mean cross-entropy per token of each target item's L tokens given its history."""
    total, count = 0.0, 0
    for s in range(0, len(histories), batch):
        hist = left_pad(histories[s : s + batch], item_tokens, max_items)
        tokens = torch.cat([hist, item_tokens[torch.from_numpy(targets[s : s + batch])]], dim=1)
        L = item_tokens.shape[1]
        logits = model(tokens[:, :-1])[:, -L:].float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, -L:].reshape(-1), reduction="sum"))
        count += tokens.shape[0] * L
    return total / max(count, 1)


# ---------------------------------------------------------------------------------- evaluation


def exclusion_bitmask(histories: list[np.ndarray], trie: ValidPathTrie) -> torch.Tensor:
    """Packed item bitmask int64 [B, ceil(N/64)] allowing every item except each history's items."""
    leaf_of = torch.empty(trie.n_items, dtype=torch.int64)
    leaf_of[trie.row_order] = torch.arange(trie.n_items)
    allowed = torch.ones(len(histories), trie.n_items, dtype=torch.bool)
    for b, h in enumerate(histories):
        allowed[b, leaf_of[torch.from_numpy(np.asarray(h, dtype=np.int64))]] = False
    return pack_bits(allowed)


def ranking_metrics(ranked: np.ndarray, targets: np.ndarray, k: int = 10) -> dict[str, float]:
    """recall@k and NDCG@k of one held-out target per row; ranked int64 [U, >= k]."""
    hit = ranked[:, :k] == targets[:, None]
    rank = np.where(hit.any(1), hit.argmax(1), -1)
    ndcg = np.where(rank >= 0, 1.0 / np.log2(np.maximum(rank, 0) + 2.0), 0.0)
    return {f"recall@{k}": float(hit.any(1).mean()), f"ndcg@{k}": float(ndcg.mean())}


@torch.no_grad()
def evaluate(module: GenerativeRetrieval, sids: SemanticIds, histories: list[np.ndarray], targets: np.ndarray,
             max_items: int, exclude_seen: bool, batch: int = 32) -> dict[str, float]:
    """recall@10 / NDCG@10 of the beam decode's top 10 (items as external ids)."""
    item_tokens = torch.from_numpy(sids.tokens())
    ranked = []
    for s in range(0, len(histories), batch):
        hs = histories[s : s + batch]
        mask = exclusion_bitmask(hs, module.trie) if exclude_seen else None
        ids, _ = module(left_pad(hs, item_tokens, max_items), mask)
        ranked.append(ids[:, :10].numpy())
    return ranking_metrics(np.concatenate(ranked), sids.item_ids[targets])


def popularity_metrics(split: Split, histories: list[np.ndarray], targets: np.ndarray, n_items: int,
                       exclude_seen: bool) -> dict[str, float]:
    """The same metrics for the most frequent training items (ties: lower row)."""
    counts = np.bincount(np.concatenate(split.train), minlength=n_items)
    order = np.argsort(-counts, kind="stable")
    ranked = np.empty((len(histories), 10), np.int64)
    for b, h in enumerate(histories):
        top = order[: 10 + len(h)]
        if exclude_seen:
            top = top[~np.isin(top, h)]
        ranked[b] = top[:10]
    return ranking_metrics(ranked, targets)


def evaluate_all(decoder: RecDecoder, sids: SemanticIds, split: Split, cfg: TrainConfig, metrics: Metrics) -> Metrics:
    """Fill metrics.model / metrics.popularity on the (first eval_users) test users."""
    n = len(split.test_history) if cfg.eval_users is None else min(cfg.eval_users, len(split.test_history))
    hist, tgt = split.test_history[:n], split.test_target[:n]
    module = build_generative(decoder, sids, cfg.eval_beam)
    metrics.users = n
    for exclude in (True, False):
        tag = "" if exclude else " (seen allowed)"
        for key, v in evaluate(module, sids, hist, tgt, cfg.max_history, exclude).items():
            metrics.model[key + tag] = v
        for key, v in popularity_metrics(split, hist, tgt, len(sids.item_ids), exclude).items():
            metrics.popularity[key + tag] = v
    return metrics


# ---------------------------------------------------------------------------------- checkpoint


def save_checkpoint(path: str | Path, decoder: RecDecoder, sids: SemanticIds, cfg: TrainConfig, metrics: Metrics) -> Path:
    """Write decoder config + weights, semantic IDs and metrics (torch.save, weights_only-loadable)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({
        "format": "silverrec-generative-checkpoint-1",
        "decoder_config": decoder.config.to_dict(),
        "state_dict": {k: v.detach().clone() for k, v in decoder.state_dict().items()},
        "item_ids": torch.from_numpy(sids.item_ids),
        "paths": torch.from_numpy(sids.paths),
        "level_sizes": list(sids.level_sizes),
        "semantic_id_stats": sids.stats.to_dict(),
        "train_config": asdict(cfg),
        "metrics": asdict(metrics),
    }, path)
    return path


def load_checkpoint(path: str | Path) -> tuple[RecDecoder, SemanticIds, dict[str, Any]]:
    """Inverse of `save_checkpoint`: (decoder in eval mode, semantic IDs, {train_config, metrics})."""
    path = Path(path)
    if not path.is_file():
        raise PoolError(f"generative checkpoint {path} does not exist")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise PoolError(f"cannot read generative checkpoint {path}: {type(e).__name__}: {e}") from None
    if not isinstance(ck, dict) or ck.get("format") != "silverrec-generative-checkpoint-1":
        raise PoolError(f"{path} is not a silverrec generative checkpoint")
    decoder = RecDecoder(DecoderConfig.from_dict(ck["decoder_config"]))
    decoder.load_state_dict(ck["state_dict"])
    sids = SemanticIds(ck["item_ids"].numpy(), ck["paths"].numpy(), [], list(ck["level_sizes"]),
                       SemanticIdStats(**ck["semantic_id_stats"]))
    return decoder.eval(), sids, {"train_config": ck["train_config"], "metrics": ck["metrics"]}


def train_movielens(cfg: TrainConfig, *, genres: bool = True, levels: int = 3, codes: int = 256,
                    sids: SemanticIds | None = None) -> tuple[RecDecoder, SemanticIds, Split, Metrics]:
    """The whole run: split, item embeddings, semantic IDs (unless given), training, evaluation."""
    sequences = movielens.user_sequences()
    if sids is None:
        with step("item embeddings (PureSVD of the training ratings)"):
            ids, emb = movielens_item_embeddings(sequences, genres=genres)
        with step("semantic IDs (residual k-means)"):
            sids = build_semantic_ids(emb, ids, levels=levels, codes=codes, seed=cfg.seed)
    if not quiet():
        print(f"[silverrec] {sids.stats.summary()}", file=sys.stderr)
    split = split_sequences(sequences, sids.item_ids)
    with step(f"training decoder ({cfg.minutes:g} min budget)"):
        decoder, metrics = train_decoder(sids, split, cfg)
    with step("evaluating on held-out users"), torch_threads(cfg.threads):
        evaluate_all(decoder, sids, split, cfg, metrics)
    return decoder, sids, split, metrics


@contextmanager
def torch_threads(n: int | None):
    """Temporarily set torch's intra-op thread count (None: leave it)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m silverrec.publish.train_generative", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="training wall-clock budget (default 3)")
    p.add_argument("--out", default="generative.ckpt", help="checkpoint path to write")
    p.add_argument("--no-genres", action="store_true", help="item embeddings = MF factors only")
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--codes", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-history", type=int, default=20)
    p.add_argument("--eval-beam", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = TrainConfig(minutes=args.minutes, dim=args.dim, n_layers=args.layers, max_history=args.max_history,
                      eval_beam=args.eval_beam, seed=args.seed)
    decoder, sids, _, metrics = train_movielens(cfg, genres=not args.no_genres, levels=args.levels, codes=args.codes)
    print(sids.stats.summary())
    print(metrics.summary())
    print(f"wrote {save_checkpoint(args.out, decoder, sids, cfg, metrics)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
