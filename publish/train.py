"""`silverrec train`: the two-tower retrieval model and the OverArch rankers, from generic logs.

    silverrec train --config train.toml [--out model.ckpt] [--minutes M] [--seed S] [--stage test|valid]

The config (TOML, `TrainConfig`) names the logs (`interactions.parquet`, `items.parquet`, optional
`users.parquet`), the tasks (label columns and thresholds), the dimensions and the time budget.
Training follows the evaluation protocol (publish/logs.py, publish/evaluate.py): every user's last
interaction is held out; at stage "test" (default) the model is fitted on train + validation
items, at stage "valid" on the train items only (for choosing hyper-parameters).

1. Two-tower: user tower and item tower (publish/two_tower.py), sampled softmax over in-batch +
   uniform negatives with logQ correction, one loss per task over that task's positives. The user
   tower is `user_tower = "sequence"` (the default; silverrec/retrieval/sequence_tower.py, a
   causal transformer: every position of a window of the history predicts the next item; its
   targets are the train part only, and it stops early when NDCG@10 on the validation items (the
   valid-stage histories) has not improved for `patience` evaluations, keeping the best state) or
   `"bag"` (silverrec/retrieval/user_tower.py, TorchRec EBC over the history: one example per step
   and history; faster to train, below the sequential tower in quality).
2. OverArch rankers (MLP and/or mixture-of-logits): trained on the frozen two-tower's own top-K0
   candidates of training examples whose target is among them (hard negatives), softmax
   cross-entropy over the candidate list, one loss per task.
The checkpoint holds every state dict, the feature spec, the item embeddings and dense item
features that publish puts into the embedding cache, and the metrics measured at the end.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from silverrec.publish.config import ConfigError, read_toml
from silverrec.publish.logs import Logs, Split, leave_one_out, read_logs
from silverrec.publish.progress import bar, step
from silverrec.publish.two_tower import ItemTower, sampled_softmax_loss, target_log_q, user_embeddings, user_side
from silverrec.retrieval.sequence_tower import SequenceConfig, SequenceUserTower
from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec, UserTower
from silverrec.spec import OWN_TOWERS

SOFTMAX = ("auto", "full", "sampled")
# softmax = "auto": the full softmax up to this many pool rows, the sampled one above it: the full one
# measured ahead on MovieLens (9,742 items) and not on Video Games (23,715; docs/recommendation.md)
FULL_SOFTMAX_ITEMS = 20_000
USER_TOWERS = tuple(OWN_TOWERS)  # train.toml's user_tower: "bag" | "sequence"
# each tower's (minutes, batch) where train.toml leaves them out: the sequential tower's batch is the one
# its MovieLens figures were measured with, and its time is a cap that early stopping comes in under
# (docs/recommendation.md); the bag tower trains on one example per history, in a fixed budget
TOWER_DEFAULTS = {"bag": (1.5, 256), "sequence": (20.0, 64)}


@dataclass
class TaskSpec:
    """A task: positives are every interaction (no label) or those with `label >= min`."""

    name: str
    label: Optional[str] = None
    min: Optional[float] = None

    def positives(self, logs: Logs) -> np.ndarray:
        """bool [E]: which interactions are positives of this task."""
        if self.label is None:
            return np.ones(logs.items.shape[0], dtype=bool)
        if self.label not in logs.labels:
            raise ConfigError(f"task {self.name!r}: label column {self.label!r} is not in the interactions "
                              f"(numeric columns: {sorted(logs.labels) or 'none'})")
        threshold = -math.inf if self.min is None else float(self.min)
        return logs.labels[self.label] >= threshold


@dataclass
class TrainConfig:
    interactions: str
    items: str
    users: Optional[str] = None
    tasks: list[TaskSpec] = field(default_factory=lambda: [TaskSpec("interacted")])
    dim: int = 64
    history_len: int = 50
    recent_len: int = 5
    minutes: Optional[float] = None  # two-tower time cap (None: TOWER_DEFAULTS; "sequence" stops early before it)
    overarch_minutes: float = 0.5  # per OverArch kind
    overarch: list[str] = field(default_factory=lambda: ["mlp", "mol"])
    steps: Optional[int] = None  # fixed step counts instead of the time budgets (reproducible runs)
    overarch_steps: Optional[int] = None
    batch: Optional[int] = None  # examples per step (None: TOWER_DEFAULTS; "sequence": histories, each every position)
    negatives: Any = 1024  # uniform negatives per step, or "all": every item once (with in_batch_negatives 0, the full softmax)
    in_batch_negatives: int = 1024  # most of a step's targets that join the negatives (the bag tower's 256: all)
    lr: float = 2e-3
    temperature: float = 0.05
    k0: int = 200
    overarch_negatives: int = 63  # hard negatives per example, sampled from its top-k0 candidates
    max_dense_values: int = 32  # dense multi-hot columns per item feature (most frequent values)
    seed: int = 0
    stage: str = "test"
    # "sequence" (causal transformer over the ordered history: ahead of "bag" on both development data
    # sets, docs/recommendation.md) or "bag" (pooled history, TorchRec: trains in a minute, not 10 to 20)
    user_tower: str = "sequence"
    sequence: Any = None  # the [sequence] table: SequenceConfig's fields (model_dim: `dim` unless set)
    valid_every: int = 100  # sequential tower: steps between early-stopping evaluations
    patience: int = 5  # sequential tower: evaluations without a better validation NDCG@10 before stopping
    softmax: str = "auto"  # sequential tower's loss: "full" (every item), "sampled" (negatives above), "auto" (by pool size)

    def __post_init__(self):
        if self.user_tower not in USER_TOWERS:
            raise ConfigError(f"user_tower must be one of {USER_TOWERS}, got {self.user_tower!r}")
        minutes, batch = TOWER_DEFAULTS[self.user_tower]
        self.minutes = minutes if self.minutes is None else self.minutes
        self.batch = batch if self.batch is None else self.batch
        if not isinstance(self.sequence, SequenceConfig):
            table = self.sequence if self.sequence is not None else {}
            if not isinstance(table, dict):
                raise ConfigError(f"[sequence] must be a table, got {table!r}")
            try:  # the transformer's width is the item tower's unless the table says otherwise
                self.sequence = SequenceConfig(**{"model_dim": self.dim, **table})
            except TypeError as e:
                raise ConfigError(f"[sequence]: {e}") from None
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.user_tower == "sequence" and self.sequence.item_table == "tower" and self.dim != self.sequence.model_dim:
            raise ConfigError(f"sequence.item_table = 'tower' (the default) reads the item tower's outputs, so it needs "
                              f"dim = sequence.model_dim, got dim = {self.dim} and sequence.model_dim = "
                              f"{self.sequence.model_dim}: drop [sequence] model_dim (it follows dim) or set it to "
                              f"{self.dim}, or item_table = \"own\"")
        self.tasks = [t if isinstance(t, TaskSpec) else TaskSpec(**t) for t in self.tasks]
        if not self.tasks:
            raise ConfigError("config has no [[tasks]]")
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate task name in {names}")
        from silverrec.ranking.overarch import OVERARCHES

        bad = [k for k in self.overarch if k not in OVERARCHES]
        if bad:
            raise ConfigError(f"unknown overarch kind {bad[0]!r}: use one of {', '.join(OVERARCHES)}")
        if self.stage not in ("test", "valid"):
            raise ConfigError(f"stage must be 'test' or 'valid', got {self.stage!r}")
        for name in ("dim", "history_len", "recent_len", "batch", "k0", "valid_every", "patience"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.negatives != "all" and (isinstance(self.negatives, bool) or not isinstance(self.negatives, int)
                                        or self.negatives < 0):
            raise ConfigError(f"negatives must be an int >= 0 or \"all\", got {self.negatives!r}")
        if self.softmax not in SOFTMAX:
            raise ConfigError(f"softmax must be one of {SOFTMAX}, got {self.softmax!r}")
        if int(self.in_batch_negatives) < 0:
            raise ConfigError(f"in_batch_negatives must be >= 0, got {self.in_batch_negatives}")

    def full_softmax(self, num_items: int) -> bool:
        """Whether the sequential tower trains on the full softmax over `num_items` pool rows."""
        return self.softmax == "full" or (self.softmax == "auto" and num_items <= FULL_SOFTMAX_ITEMS)

    @property
    def uniform_negatives(self) -> Optional[int]:
        """`sampled_softmax_loss`'s num_uniform: None for "all"."""
        return None if self.negatives == "all" else int(self.negatives)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        return read_toml(cls, path, path_keys=("interactions", "items", "users"), **overrides)


def item_dense_features(logs: Logs, train_rows: np.ndarray, max_values: int) -> tuple[list[str], np.ndarray]:
    """Dense item features for the cache and the OverArch: float32 [N, F] with named columns.

    One 0/1 column "f=v" per item feature's `max_values` most frequent values, standardised numeric
    item columns, and "log_count": log1p of the item's training interactions, standardised.
    """
    n = logs.item_ids.shape[0]
    names, cols = [], []
    for f, lists in logs.item_features.items():
        counts: dict[str, int] = {}
        for vals in lists:
            for v in vals:
                counts[v] = counts.get(v, 0) + 1
        top = sorted(counts, key=lambda v: (-counts[v], v))[:max_values]
        index = {v: j for j, v in enumerate(top)}
        block = np.zeros((n, len(top)), dtype=np.float32)
        for i, vals in enumerate(lists):
            for v in vals:
                if v in index:
                    block[i, index[v]] = 1.0
        names += [f"{f}={v}" for v in top]
        cols.append(block)
    for f, x in logs.item_numeric.items():
        names.append(f)
        cols.append(((x - x.mean()) / (x.std() + 1e-6)).astype(np.float32)[:, None])
    pop = np.log1p(np.bincount(train_rows, minlength=n).astype(np.float32))
    names.append("log_count")
    cols.append(((pop - pop.mean()) / (pop.std() + 1e-6))[:, None])
    return names, np.concatenate(cols, axis=1)


def feature_spec(logs: Logs, cfg: TrainConfig, user_rows: np.ndarray) -> UserFeatureSpec:
    """Vocabularies (sorted values) of item and user features; numeric user features' mean/std."""
    item_vocabs = {f: sorted({v for vals in lists for v in vals}) for f, lists in logs.item_features.items()}
    user_vocabs = {g: sorted({v for vals in lists for v in vals}) for g, lists in logs.user_features.items()}
    numeric = {g: (float(x[user_rows].mean()), float(x[user_rows].std() + 1e-6)) for g, x in logs.user_numeric.items()}
    return UserFeatureSpec(num_items=logs.item_ids.shape[0], history_len=cfg.history_len, recent_len=cfg.recent_len,
                           item_vocabs=item_vocabs, user_vocabs=user_vocabs, user_numeric=numeric)


class Examples:
    """Training examples (user, position): predict the interaction at `position` from the ones
    before it, for every position after a user's first within that user's history at the stage."""

    def __init__(self, split: Split, stage: str, tasks: list[TaskSpec]):
        logs = split.logs
        end = split.history_end(stage)
        self.logs, self.end = logs, end
        starts = logs.offsets[:-1] + 1
        counts = np.maximum(end - starts, 0)
        self.user = np.repeat(np.arange(len(counts)), counts)
        self.pos = np.repeat(starts - np.r_[0, np.cumsum(counts)[:-1]], counts) + np.arange(counts.sum())
        self.targets = logs.items[self.pos]
        self.weights = np.stack([t.positives(logs)[self.pos] for t in tasks], axis=1).astype(np.float32)
        self.history_rows = split.history_csr(stage)[1]

    def __len__(self) -> int:
        return int(self.pos.shape[0])

    def histories(self, idx: np.ndarray) -> list[np.ndarray]:
        off, items = self.logs.offsets, self.logs.items
        return [items[off[u]:p] for u, p in zip(self.user[idx], self.pos[idx])]

    def user_inputs(self, encoder: FeatureEncoder, idx: np.ndarray):
        return encoder.encode(self.histories(idx), *user_side(self.logs, self.user[idx]))


def _cap(*limits: Optional[int]) -> Optional[int]:
    given = [int(x) for x in limits if x is not None]
    return min(given) if given else None


def _timed_loop(minutes: float, desc: str, step_fn, max_steps: int | None = None) -> int:
    """Call step_fn() until the budget is spent; a progress bar over the budget's seconds."""
    budget, t0, steps = minutes * 60.0, time.perf_counter(), 0
    with bar(int(budget) if math.isfinite(budget) else max_steps, desc) as pbar:
        last = 0
        while time.perf_counter() - t0 < budget and (max_steps is None or steps < max_steps):
            loss = step_fn()
            steps += 1
            now = int(time.perf_counter() - t0) if math.isfinite(budget) else steps
            if now > last:
                pbar.update(now - last)
                last = now
                pbar.set_postfix(loss=f"{loss:.3f}", steps=steps)
    return steps


def train_two_tower(cfg: TrainConfig, split: Split, ex: Examples, spec: UserFeatureSpec, encoder: FeatureEncoder,
                    max_steps: int | None = None) -> tuple[UserTower, ItemTower, dict]:
    logs = split.logs
    T = len(cfg.tasks)
    user = UserTower(spec, cfg.dim, T)
    item = ItemTower(spec, logs.item_features, cfg.dim)
    params = list(user.parameters()) + list(item.parameters())
    opt = torch.optim.Adam(params, lr=cfg.lr)
    log_q = target_log_q(ex.targets, spec.num_items)
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)

    def one_step() -> float:
        idx = rng.integers(0, len(ex), cfg.batch)
        u = user(*ex.user_inputs(encoder, idx))
        loss = sampled_softmax_loss(u, torch.from_numpy(ex.targets[idx]), item, log_q, cfg.uniform_negatives,
                                    cfg.temperature, torch.from_numpy(ex.weights[idx]), gen, cfg.in_batch_negatives)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    user.train(), item.train()
    t0 = time.perf_counter()
    steps = _timed_loop(math.inf if cfg.steps else cfg.minutes, "two-tower", one_step, _cap(cfg.steps, max_steps))
    user.eval(), item.eval()
    return user, item, {"steps": steps, "seconds": round(time.perf_counter() - t0, 1), "examples": len(ex)}


@torch.no_grad()
def exact_metrics(user: UserTower, encoder: FeatureEncoder, item_emb: torch.Tensor, split: Split, stage: str) -> dict:
    """Leave-one-out metrics of task 0's user embedding . every item embedding (full ranking)."""
    from silverrec.publish.evaluate import evaluate_scores

    u = user_embeddings(user, encoder, split.logs, split.eval_users, split.histories(split.eval_users, stage))
    pos = {int(x): i for i, x in enumerate(split.eval_users)}
    return evaluate_scores(lambda users, _: u[[pos[int(x)] for x in users], 0] @ item_emb.T, split, stage)


def build_overarch(kind: str, dim: int, feat_dim: int, tasks: int) -> torch.nn.Module:
    from silverrec.ranking.overarch import OVERARCHES

    return OVERARCHES[kind](dim, feat_dim, tasks)


def train_overarch(kind: str, cfg: TrainConfig, ex: Examples, user: UserTower, encoder: FeatureEncoder,
                   item_emb: torch.Tensor, item_feats: torch.Tensor, max_steps: int | None = None) -> tuple[torch.nn.Module, dict]:
    """OverArch on the two-tower's own top-K0 candidates (history items masked, as served): a pointwise
    kind sees the target and `overarch_negatives` of the others, a list-wise kind the whole list."""
    T = len(cfg.tasks)
    model = build_overarch(kind, item_emb.shape[1], item_feats.shape[1], T)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(cfg.seed + 1)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    cache_emb = item_emb.to(torch.bfloat16).float()  # what the served model sees
    kept = [0, 0]

    def one_step() -> float:
        idx = rng.integers(0, len(ex), cfg.batch)
        hist = ex.histories(idx)
        with torch.no_grad():
            u = user(*encoder.encode(hist, *user_side(ex.logs, ex.user[idx])))  # [B, T, D]
            scores = u[:, 0] @ cache_emb.T
            for b, h in enumerate(hist):
                scores[b, torch.from_numpy(h)] = float("-inf")
            cands = scores.topk(cfg.k0, dim=1).indices  # [B, K0]
            targets = torch.from_numpy(ex.targets[idx])
            hit = cands == targets[:, None]
            keep = hit.any(dim=1)
        kept[0] += int(keep.sum())
        kept[1] += len(idx)
        if not bool(keep.any()):
            return float("nan")
        cands, hit, u = cands[keep], hit[keep], u[keep]
        # the target first, then overarch_negatives of the other candidates, drawn at random (all of
        # them for a list-wise OverArch, whose scores depend on the list it sees)
        draw = torch.rand(cands.shape, generator=gen).masked_fill(hit, -1.0)
        size = cands.shape[1] if kind == "listwise" else min(cands.shape[1], cfg.overarch_negatives + 1)
        pick = draw.topk(size, dim=1, largest=False).indices
        cands = cands.gather(1, pick)
        w = torch.from_numpy(ex.weights[idx])[keep]  # [b, T]
        logits = model(u, cache_emb[cands], item_feats[cands])  # [b, 1 + negatives, T]
        label = torch.zeros(cands.shape[0], T, dtype=torch.int64)
        ce = torch.nn.functional.cross_entropy(logits, label, reduction="none")
        loss = (ce * w).sum() / w.sum().clamp_min(1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    model.train()
    t0 = time.perf_counter()
    steps = _timed_loop(math.inf if cfg.overarch_steps else cfg.overarch_minutes, f"overarch {kind}", one_step,
                        _cap(cfg.overarch_steps, max_steps))
    model.eval()
    return model, {"steps": steps, "seconds": round(time.perf_counter() - t0, 1),
                   "target_in_candidates": round(kept[0] / max(1, kept[1]), 4)}


def train(cfg: TrainConfig, out: str | Path | None = None, max_steps: int | None = None, quiet_eval: bool = False) -> dict:
    """Train everything the config names; save the checkpoint at `out`; return it."""
    torch.manual_seed(cfg.seed)
    with step("reading logs"):
        logs = read_logs(cfg.interactions, cfg.items, cfg.users, seed=cfg.seed)
    split = leave_one_out(logs)
    ex = Examples(split, cfg.stage, cfg.tasks)
    spec = feature_spec(logs, cfg, np.unique(ex.user))
    encoder = FeatureEncoder(spec, logs.item_features)
    print(f"[silverrec] {logs.item_ids.shape[0]:,} items, {logs.user_ids.shape[0]:,} users, {len(ex):,} training "
          f"examples (stage {cfg.stage}), tasks {[t.name for t in cfg.tasks]}", file=sys.stderr)
    if cfg.user_tower == "sequence":
        from silverrec.publish.train_sequence import train_sequence_tower

        positives = np.stack([t.positives(logs) for t in cfg.tasks], axis=1)
        user, item, tt_stats = train_sequence_tower(cfg, split, spec, encoder, positives, user_side, max_steps)
        tower_args = {"dim": cfg.dim, "tasks": len(cfg.tasks), "config": cfg.sequence.to_json()}
    else:
        user, item, tt_stats = train_two_tower(cfg, split, ex, spec, encoder, max_steps)
        tower_args = {"dim": cfg.dim, "tasks": len(cfg.tasks)}
    item_emb = item.embed_all(spec.num_items)
    names, dense = item_dense_features(logs, ex.history_rows, cfg.max_dense_values)
    feats = torch.from_numpy(dense)
    ckpt: dict[str, Any] = {
        "config": asdict(cfg),
        "spec": spec.to_json(),
        "tasks": [asdict(t) for t in cfg.tasks],
        "user_tower_kind": cfg.user_tower,
        "user_tower": user.state_dict(),
        "user_tower_args": tower_args,
        "item_ids": torch.from_numpy(logs.item_ids),
        "item_features": logs.item_features,
        "item_tower": item.state_dict(),
        "item_tower_args": {"dim": cfg.dim},
        "item_embeddings": item_emb,
        "users": _user_table(split, cfg.stage),
        "item_feature_names": names,
        "item_dense": feats,
        "overarch": {},
        "stats": {"two_tower": tt_stats},
    }
    for kind in cfg.overarch:
        model, stats = train_overarch(kind, cfg, ex, user, encoder, item_emb, feats, max_steps)
        ckpt["overarch"][kind] = {"config": model.config(), "state": model.state_dict()}
        ckpt["stats"][f"overarch_{kind}"] = stats
    if not quiet_eval:
        stage = cfg.stage
        ckpt["metrics"] = {"two_tower_exact": exact_metrics(user, encoder, item_emb, split, stage)}
        print(f"[silverrec] two-tower exact ({stage}): " + _fmt(ckpt["metrics"]["two_tower_exact"]), file=sys.stderr)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        torch.save(ckpt, tmp)
        tmp.replace(out)
    return ckpt


def _user_table(split: Split, stage: str) -> dict[str, Any]:
    """Every user's history at `stage` (item ids, oldest first) as CSR, for `recommend --user`."""
    offsets, rows = split.history_csr(stage)
    return {"user_ids": split.logs.user_ids.copy(), "offsets": offsets, "item_ids": split.logs.item_ids[rows]}


def _fmt(m: dict) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in m.items() if k.startswith(("HR", "NDCG")))


def load_checkpoint(path: str | Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"cannot read checkpoint {path}: {e}") from None


def rebuild_user_tower(ckpt: dict) -> UserTower | SequenceUserTower:
    """The checkpoint's user tower, in eval mode: the bag tower or (user_tower_kind "sequence") the sequential one."""
    spec = UserFeatureSpec.from_json(ckpt["spec"])
    if ckpt.get("user_tower_kind", "bag") == "sequence":
        args = dict(ckpt["user_tower_args"])
        user = SequenceUserTower(spec, args["dim"], args["tasks"], ckpt["item_features"], SequenceConfig(**args["config"]))
    else:
        user = UserTower(spec, **ckpt["user_tower_args"])
    user.load_state_dict(ckpt["user_tower"])
    return user.eval()


def rebuild_item_tower(ckpt: dict) -> ItemTower:
    spec = UserFeatureSpec.from_json(ckpt["spec"])
    item = ItemTower(spec, ckpt["item_features"], **ckpt["item_tower_args"])
    item.load_state_dict(ckpt["item_tower"])
    return item.eval()


def rebuild_overarch(ckpt: dict, kind: str) -> torch.nn.Module:
    from silverrec.ranking.overarch import overarch_from_config

    entry = ckpt["overarch"][kind]
    model = overarch_from_config(kind, entry["config"])
    model.load_state_dict(entry["state"])
    return model.eval()
