"""The hybrid snapshot's fusion, chosen on the validation split at publish.

A hybrid `RecModel` ranks the union of the ANN's and the decode's candidates by
`silverrec.ranking.top_k.fuse_sources`: value + w x the decode's log-prob, with a source
priority (which rows rank first). Publish picks (w, priority) from a small grid, `WEIGHTS` x
`PRIORITIES`, by the hybrid's NDCG@10 on the validation split, when the publish config names
validation checkpoints: the same two-tower and generative training, at stage "valid" (fitted on the
train items only, so the validation items are held out; the snapshot's own checkpoints, at stage
"test", were fitted on them: on MovieLens their validation NDCG@10 was ~3x their test NDCG@10).

One forward per request over the validation model with the neutral fusion (w 0, no priority: the
score is the value) and k = every candidate gives each candidate's value, log-prob and sources;
every grid point, and each source alone (the same snapshot asked for one source: its rows only),
is then ranked from those tensors by `fuse_sources` itself. (w 0, "ann") ranks as the ANN alone
does and (w, "generative") as the decode alone with that w, so the chosen fusion is never below the
better source on validation.
The grid, the choice and the per-source figures go to the manifest (`generative.fusion`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch

from silverrec.candidates import FOUND_ANN, FOUND_GENERATIVE, SOURCES
from silverrec.ranking.top_k import fuse_sources, priority_tiers
from silverrec.spec import PRIORITIES
from silverrec.publish.config import ConfigError
from silverrec.publish.evaluate import metrics_from_ranks, ranks_from_topk
from silverrec.publish.logs import Split, leave_one_out, read_logs
from silverrec.publish.quality import K_EVAL  # the protocol's top list

WEIGHTS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)  # the log-prob weights tried (log-probs of MovieLens beams: -11 .. -3)
METRIC = "NDCG@10"


@torch.no_grad()
def union_tensors(handler, split: Split, stage: str = "valid", batch: int = 32) -> dict[str, torch.Tensor]:
    """Every candidate of the hybrid `handler` (fusion w 0, priority none) for one request per eval
    user, its known items excluded -> item_ids int64 [U, C] (-1 = none), value float32 [U, C],
    log_prob float32 [U, C] (the decoder's log-prob the forward ranks with: exact, or a first-code
    bound; `fuse_sources`), found_by int64 [U, C], targets int64 [U] (item ids)."""
    cfg = handler.config
    k = min(int(handler.model_spec.candidates or len(handler.row_to_item)) + int(cfg["generative"]["beam_width"]),
            len(handler.row_to_item))
    ids = split.logs.item_ids
    hists = split.histories(split.eval_users, stage)
    parts: dict[str, list] = {"item_ids": [], "value": [], "log_prob": [], "found_by": []}
    for s in range(0, len(hists), batch):
        hs = hists[s:s + batch]
        res = handler.recommend([{"history": ids[h]} for h in hs], k=k,
                                exclude_limit=max(1, max(len(np.unique(h)) for h in hs)))
        for name, t in zip(parts, (res.item_ids, res.scores, res.source_scores[:, :, 1], res.found_by)):
            parts[name].append(t)
    out = {name: torch.cat(t) for name, t in parts.items()}
    out["targets"] = torch.from_numpy(ids[split.targets(stage)])
    return out


def fused_topk(u: dict[str, torch.Tensor], source: str, weight: float, priority: str = "none",
               k: int = K_EVAL) -> torch.Tensor:
    """The item ids int64 [U, k] (-1 = none) the snapshot with fusion (weight, priority) returns when
    asked for `source`: "ann", "generative" (that source's rows of the union `u` only, as the
    forward drops a switched-off source's rows) or "hybrid"; `u` as `union_tensors` returns it."""
    found_by = u["found_by"]
    keep = u["item_ids"] >= 0
    log_prob = u["log_prob"]
    if source == "ann":
        keep = keep & ((found_by & FOUND_ANN) != 0)
        log_prob = torch.full_like(log_prob, float("-inf"))
        found_by = found_by & FOUND_ANN
    elif source == "generative":
        keep = keep & ((found_by & FOUND_GENERATIVE) != 0)
        found_by = found_by & FOUND_GENERATIVE
    elif source != "hybrid":
        raise ValueError(f"source must be 'ann', 'generative' or 'hybrid', got {source!r}")
    value = torch.where(keep, u["value"], torch.full_like(u["value"], float("-inf")))
    log_prob = torch.where(keep, log_prob, torch.full_like(log_prob, float("-inf")))
    _, key = fuse_sources(value, log_prob, torch.where(keep, found_by, torch.zeros_like(found_by)), weight,
                          priority_tiers(priority))
    top = key.topk(min(k, key.shape[1]), dim=1)
    return torch.where(top.values > float("-inf"), u["item_ids"].gather(1, top.indices), -1)


def fusion_grid(u: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Per (weight, priority) of the grid: HR@10, NDCG@10, HR@100 of the hybrid and of each source
    alone under that fusion (the ANN alone does not depend on it)."""
    def metrics(source: str, w: float, p: str = "none") -> dict[str, float]:
        m = metrics_from_ranks(ranks_from_topk(fused_topk(u, source, w, p), u["targets"]))
        return {k: round(m[k], 5) for k in ("HR@10", METRIC, "HR@100")}

    ann = metrics("ann", 0.0)
    rows = []
    for w in WEIGHTS:
        gen = metrics("generative", w)
        rows += [{"weight": w, "priority": p, "hybrid": metrics("hybrid", w, p), "ann": ann, "generative": gen}
                 for p in PRIORITIES]
    return rows


def choose(grid: list[dict[str, Any]]) -> dict[str, Any]:
    """The grid row with the best hybrid METRIC (the first of equals: grid order, smaller w first)."""
    return max(grid, key=lambda r: (r["hybrid"][METRIC], -grid.index(r)))


def check_validation_checkpoints(ckpt: dict, gen_meta: dict, where: str) -> None:
    """Both validation checkpoints trained at stage "valid" with one seed (the split's tie-break)."""
    tt, gen = ckpt.get("config") or {}, gen_meta.get("train_config") or {}
    for name, c in (("validation_checkpoint", tt), ("validation_generative_checkpoint", gen)):
        if c.get("stage") != "valid":
            raise ConfigError(f"{where}: {name} was trained at stage {c.get('stage')!r}; the fusion is chosen on "
                              "validation items, so it needs a model that did not train on them (stage = 'valid')")
    if tt.get("seed") != gen.get("seed"):
        raise ConfigError(f"{where}: the validation checkpoints split the logs with different seeds "
                          f"({tt.get('seed')} and {gen.get('seed')}): train both with one seed")


def choose_fusion(cfg, build_rec_model: Callable[..., Any]) -> dict[str, Any]:
    """`publish.rec.PublishConfig` with validation checkpoints -> the manifest's fusion entry:
    {"weight", "priority", "chosen_on", "validation": the chosen row's figures, "grid": every row}.
    `build_rec_model(cfg, ckpt)` (publish/rec.py, which calls this) builds the neutral model the grid is
    measured on."""
    from silverrec.publish.quality import handler_for
    from silverrec.publish.train import load_checkpoint
    from silverrec.publish.generative_checkpoint import load_checkpoint as load_generative

    ckpt = load_checkpoint(cfg.validation_checkpoint)
    check_validation_checkpoints(ckpt, load_generative(cfg.validation_generative_checkpoint)[2], "publish")
    tt = ckpt["config"]
    neutral = dataclasses.replace(cfg, checkpoint=cfg.validation_checkpoint, sources=list(SOURCES),
                                  generative_checkpoint=cfg.validation_generative_checkpoint, generative_weight=0.0,
                                  source_priority="none", validation_checkpoint=None,
                                  validation_generative_checkpoint=None, torchscript=False)
    handler = handler_for(build_rec_model(neutral, ckpt))
    split = leave_one_out(read_logs(tt["interactions"], tt["items"], tt.get("users"), seed=tt["seed"]))
    grid = fusion_grid(union_tensors(handler, split, "valid"))
    best = choose(grid)
    return {"weight": best["weight"], "priority": best["priority"], "chosen_on": "valid", "metric": METRIC,
            "validation": {k: best[k] for k in ("hybrid", "ann", "generative")},
            "checkpoints": [str(cfg.validation_checkpoint), str(cfg.validation_generative_checkpoint)], "grid": grid}
