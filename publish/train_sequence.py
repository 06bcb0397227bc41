"""Training the sequential user tower on every position (`user_tower = "sequence"` in train.toml).

Each step takes `batch` windows of training histories; every valid position j of a window, having
seen the window's items up to j (causal mask), predicts item j + 1 (teacher forcing) against the
item tower, which stays the candidate side, one loss per task over its positives. The loss
(`softmax`): "full", the cross-entropy over every item of the pool (`full_softmax_loss`: the item
tower runs over the whole pool once per step), or "sampled", the bag tower's sampled softmax
(in-batch + uniform negatives with logQ correction, `sampled_softmax_loss`); "auto" takes the full
one up to train.FULL_SOFTMAX_ITEMS items. Targets come from the train part of every history (the
validation and test items are never targets), so the validation items give early stopping: every
`valid_every` steps NDCG@10 of the validation items (valid-stage histories, full ranking, history
masked; at most VALID_USERS users, a seeded sample) is measured; after `patience` evaluations
without improvement, or at the budget, both towers return to their best state.

Windows (`Windows`): an epoch cuts every history into windows of `history_len` items ending at its
newest training item and every `history_len` items before it, shifted by a random offset per
epoch (so window starts move between epochs; the newest window is always whole), batches windows
of similar length together (padding trimmed per batch), and shuffles the batches.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, Optional

import numpy as np
import torch

from silverrec.publish.config import ConfigError
from silverrec.publish.evaluate import evaluate_scores
from silverrec.publish.logs import Split
from silverrec.publish.progress import bar
from silverrec.publish.two_tower import ItemTower, full_softmax_loss, sampled_softmax_loss, target_log_q, user_embeddings
from silverrec.retrieval.sequence_tower import SequenceUserTower
from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec

VALID_USERS = 4096  # most validation users an early-stopping evaluation scores (a seeded sample)


class Windows:
    """Windows of training histories (module docstring), as the tower's training inputs.

    end: int64 [U], the end of each user's training part (Split.history_end("valid")).
    """

    def __init__(self, split: Split, end: np.ndarray, length: int, positives: np.ndarray, encoder: FeatureEncoder,
                 user_side, rng: np.random.Generator):
        logs = split.logs
        self.logs, self.length, self.positives, self.encoder, self.user_side = logs, int(length), positives, encoder, user_side
        self.start = logs.offsets[:-1]
        self.end = np.asarray(end, dtype=np.int64)
        self.users = np.flatnonzero(self.end - self.start >= 2)  # at least one (history, target) pair
        self.rng = rng
        self.targets = int(np.maximum(self.end - self.start - 1, 0).sum())

    def epoch(self, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """One epoch's batches, each (user indices, anchors): the anchor is the window's last target."""
        L = self.length
        users, start, end = self.users, self.start[self.users], self.end[self.users]
        shift = self.rng.integers(0, L, len(users))
        # anchors end - 1 (the newest window) and end - 1 - shift - k L for k >= 0 while > start
        count = 1 + np.maximum(0, (end - 1 - shift - start - 1) // L + 1)
        owner = np.repeat(np.arange(len(users)), count)
        k = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        anchor = np.where(k == 0, end[owner] - 1, end[owner] - 1 - shift[owner] - (k - 1) * L)
        keep = anchor > start[owner]
        owner, anchor = owner[keep], anchor[keep]
        size = np.minimum(anchor - start[owner], L)  # valid positions of the window
        order = np.lexsort((self.rng.random(len(anchor)), size))  # similar lengths together, ties shuffled
        batches = [order[i:i + batch] for i in range(0, len(order), batch)]
        self.rng.shuffle(batches)
        return [(users[owner[b]], anchor[b]) for b in batches]

    def inputs(self, users: np.ndarray, anchors: np.ndarray) -> dict[str, torch.Tensor]:
        """The windows' tensors, trimmed to the batch's longest: rows int64 [B, W] (left-padded),
        valid bool [B, W], targets int64 [B, W] (the next item), weights float32 [B, W, T] (a
        position's target is a positive of task t), dense float32 [B, W, Fd] (log1p of the history
        length at that position, then the user's numeric features), user-feature KJT parts."""
        L = self.length
        start = self.start[users]
        width = int(min(L, (anchors - start).max()))
        g = anchors[:, None] - width + np.arange(width)[None, :]  # index of each position's input item
        valid = g >= start[:, None]
        rows = np.where(valid, self.logs.items[np.where(valid, g, 0)], 0)
        targets = np.where(valid, self.logs.items[np.where(valid, g + 1, 0)], 0)
        weights = self.positives[np.where(valid, g + 1, 0)] * valid[:, :, None]
        cats, nums = self.user_side(self.logs, users)
        user_values, user_lengths, dense_user = self.encoder.user_part(anchors - start, cats, nums)
        dense = np.repeat(dense_user[:, None, :], width, axis=1)
        dense[:, :, 0] = np.log1p(np.maximum(g - start[:, None] + 1, 0))
        values = np.concatenate(user_values) if user_values else np.zeros(0, dtype=np.int64)
        lengths = np.concatenate(user_lengths) if user_lengths else np.zeros(0, dtype=np.int64)
        return {"rows": torch.from_numpy(rows), "valid": torch.from_numpy(valid), "targets": torch.from_numpy(targets),
                "weights": torch.from_numpy(weights.astype(np.float32)), "dense": torch.from_numpy(dense),
                "user_values": torch.from_numpy(values.astype(np.int64)),
                "user_lengths": torch.from_numpy(lengths.astype(np.int32))}


def validation_ndcg(user: SequenceUserTower, item: ItemTower, encoder: FeatureEncoder, split: Split, users: np.ndarray,
                    user_side, tower_inputs: bool = False) -> float:
    """NDCG@10 of the validation items of `users` (eval-user positions) from the valid-stage histories
    (item_table "tower": the tower's item table set to the item tower's outputs first, as served)."""
    user.eval(), item.eval()
    with torch.no_grad():
        emb = item.embed_all(split.logs.num_items)
        if tower_inputs:
            user.items.weight.copy_(emb)
        u = user_embeddings(user, encoder, split.logs, split.eval_users[users], split.histories(split.eval_users[users], "valid"))
    pos = {int(x): i for i, x in enumerate(split.eval_users[users])}
    m = evaluate_scores(lambda us, _: u[[pos[int(x)] for x in us], 0] @ emb.T, split, "valid", sample=users)
    user.train(), item.train()
    return m["NDCG@10"]


def train_sequence_tower(cfg, split: Split, spec: UserFeatureSpec, encoder: FeatureEncoder, positives: np.ndarray,
                         user_side, max_steps: Optional[int] = None) -> tuple[SequenceUserTower, ItemTower, dict[str, Any]]:
    """Both towers, trained on every position with early stopping (module docstring); cfg is a
    publish.train.TrainConfig; positives bool [E, T] per interaction and task."""
    logs = split.logs
    T = len(cfg.tasks)
    user = SequenceUserTower(spec, cfg.dim, T, logs.item_features, cfg.sequence)
    item = ItemTower(spec, logs.item_features, cfg.dim)
    table = cfg.sequence.item_table
    if table == "shared":  # one item-id table for both towers
        shared = item.ebc.embedding_bags["item_id"].weight
        if shared.shape != user.items.weight.shape:
            raise ConfigError(f"sequence.item_table = 'shared' needs the item tower's id width {shared.shape[1]} "
                              f"as sequence.model_dim, got {user.items.weight.shape[1]}")
        user.items.weight = shared
    params = {id(q): q for q in [*user.parameters(), *item.parameters()]}
    opt = torch.optim.Adam(list(params.values()), lr=cfg.lr)
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    end = split.history_end("valid")
    windows = Windows(split, end, spec.history_len, positives, encoder, user_side, rng)
    owner = np.repeat(np.arange(logs.num_users), np.diff(logs.offsets))
    at = np.arange(logs.items.shape[0])
    log_q = target_log_q(logs.items[(at > logs.offsets[owner]) & (at < end[owner])], spec.num_items)
    valid_users = np.sort(rng.permutation(len(split.eval_users))[:VALID_USERS])
    cap = [int(x) for x in (cfg.steps, max_steps) if x is not None]
    limit = min(cap) if cap else None
    budget = math.inf if cfg.steps else cfg.minutes * 60.0
    state = {"best": -1.0, "best_step": 0, "since": 0, "evals": [], "saved": None}
    batches: list = []

    def evaluate(steps: int) -> bool:
        """Early-stopping check after `steps` steps: False when training should stop."""
        score = validation_ndcg(user, item, encoder, split, valid_users, user_side, table == "tower")
        state["evals"].append([steps, round(score, 5)])
        if score > state["best"]:
            state.update(best=score, best_step=steps, since=0,
                         saved=(copy.deepcopy(user.state_dict()), copy.deepcopy(item.state_dict())))
        else:
            state["since"] += 1
        return state["since"] < cfg.patience

    full = cfg.full_softmax(spec.num_items)
    pool = torch.arange(spec.num_items)
    user.train(), item.train()
    t0 = time.perf_counter()
    steps, positions, loss_value = 0, 0, float("nan")
    with bar(limit if budget == math.inf else int(budget), "two-tower (sequence)") as pbar:
        last = 0
        while time.perf_counter() - t0 < budget and (limit is None or steps < limit):
            if not batches:
                batches = windows.epoch(cfg.batch)
            x = windows.inputs(*batches.pop())
            users_pooled = user.user_features(x["user_values"], x["user_lengths"], x["rows"].shape[0], 0)
            inputs, every = None, None
            if full:  # the item tower over the whole pool, once per step: the softmax's candidates
                every = item(pool)
            if table == "tower":  # the input vectors are the item tower's outputs, once per distinct row
                if every is not None:
                    inputs = every[x["rows"]]
                else:
                    rows, where = torch.unique(x["rows"], return_inverse=True)
                    inputs = item(rows)[where]
            u = user.position_embeddings(x["rows"], x["valid"], users_pooled, x["dense"], inputs)  # [B, W, T, D]
            sel = x["valid"]
            if full:
                loss = full_softmax_loss(u[sel], x["targets"][sel], every, cfg.temperature, x["weights"][sel])
            else:
                loss = sampled_softmax_loss(u[sel], x["targets"][sel], item, log_q, cfg.uniform_negatives,
                                            cfg.temperature, x["weights"][sel], gen, cfg.in_batch_negatives)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
            positions += int(sel.sum())
            loss_value = float(loss.detach())
            go_on = steps % cfg.valid_every != 0 or evaluate(steps)
            now = steps if budget == math.inf else int(time.perf_counter() - t0)
            if now > last:
                pbar.update(now - last)
                last = now
                pbar.set_postfix(loss=f"{loss_value:.3f}", steps=steps, valid_ndcg10=f"{max(state['best'], 0):.4f}")
            if not go_on:
                break
    if not state["evals"] or state["evals"][-1][0] != steps:
        evaluate(steps)
    user.load_state_dict(state["saved"][0])
    item.load_state_dict(state["saved"][1])
    user.eval(), item.eval()
    if table == "tower":  # the tower's item table: the inputs it was trained with, the item tower's outputs
        with torch.no_grad():
            user.items.weight.copy_(item.embed_all(spec.num_items))
    return user, item, {"steps": steps, "seconds": round(time.perf_counter() - t0, 1), "positions": positions,
                        "targets": windows.targets, "best_step": state["best_step"],
                        "valid_NDCG@10": round(state["best"], 5), "valid_users": int(len(valid_users)),
                        "softmax": "full" if full else "sampled",
                        "evaluations": state["evals"], "stopped_early": state["since"] >= cfg.patience}
