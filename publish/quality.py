"""Quality of recommendation models under the evaluation protocol (publish/evaluate.py).

`evaluate_handler` runs a loaded snapshot (or an in-process `RecModel`) the way a user calls it:
one request per eval user with its history at the stage, the history excluded, top-100 items,
and ranks the held-out item in that list (`ranks_from_topk`: absent = a miss).
`quality_table` gives the rows of the demo's table, each stage of the model added in turn:

    popularity, PureSVD, EASE, Markov,
    Markov + EASE                             non-neural peers (publish/baselines.py)
    two-tower exact                           float user tower . float item embeddings, full ranking
    IVF                                       int8 IVF scan of task 0, its top-100
    IVF + re-score                            candidates re-scored exactly from the embedding cache
    + OverArch MLP / + MoL / + list-wise      the OverArch's task-0 score over the same candidates
    multi-task + value model                  the published configuration's OverArch and value model
    + next-item transitions                   the published configuration, with its transitions
                                              (retrieval/transitions.py), where it has them
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Optional

import numpy as np
import torch

from silverrec.compose import compose
from silverrec.publish.evaluate import metrics_from_ranks, ranks_from_topk
from silverrec.publish.logs import Split
from silverrec.rec_model import RecModel
from silverrec.retrieval.filtered_ivf import FilteredIVFIndex
from silverrec.serving.recommend import RecHandler

K_EVAL = 100


def handler_for(built, model: Optional[RecModel] = None) -> RecHandler:
    """A predictor over an in-process `publish.rec.Built` (no snapshot written), or over `model`, a
    variant composed from its parts."""
    model = built.model if model is None else model
    config = {**built.manifest, "spec": model.spec.to_json()}
    return RecHandler(config, model, built.row_to_item, built.item_csr, built.users, model.rank)


def evaluate_handler(handler: RecHandler, split: Split, stage: str = "test", **options: Any) -> dict[str, float]:
    """HR/NDCG of the handler's top-100 for every eval user (its whole history excluded, as the
    protocol masks every known item)."""
    return metrics_from_ranks(handler_ranks(handler, split, stage, **options))


def handler_ranks(handler: RecHandler, split: Split, stage: str = "test", **options: Any) -> torch.Tensor:
    """One request per eval user, every known item excluded (exclusion slots = its history), as
    served otherwise (k0 + the snapshot's overfetch rows searched per task)."""
    ids = split.logs.item_ids
    targets = ids[split.targets(stage)]
    out = []
    for u, h, t in zip(split.eval_users, split.histories(split.eval_users, stage), targets):
        res = handler.recommend([{"history": ids[h]}], k=K_EVAL, exclude_limit=max(1, len(np.unique(h))), **options)
        out.append(ranks_from_topk(res.item_ids, torch.tensor([t])))
    return torch.cat(out)


def ivf_only_ranks(handler: RecHandler, index: FilteredIVFIndex, split: Split, stage: str = "test", batch: int = 64,
                   nprobe: Optional[int] = None) -> torch.Tensor:
    """The int8 IVF search alone (`index`, task 0's user embedding, no re-score), known items dropped."""
    model: RecModel = handler.module
    ids = split.logs.item_ids
    targets = ids[split.targets(stage)]
    nprobe = int(handler.config["default_nprobe"]) if nprobe is None else nprobe
    out = []
    for s in range(0, len(split.eval_users), batch):
        users = split.eval_users[s:s + batch]
        hist = [handler.rows(ids[h], "history") for h in split.histories(users, stage)]
        with torch.inference_mode():
            values, lengths, dense = handler.encoder.encode(hist)
            q = model.user_tower(values, lengths, dense)[:, 0]
            E = max(len(np.unique(h)) for h in hist)
            _, found = index.scan(q, index.probe(q, nprobe), K_EVAL + E)  # item ids
        found = found.numpy()
        item_ids = np.full((len(users), K_EVAL), -1, dtype=np.int64)
        for b, h in enumerate(hist):
            keep = found[b][(found[b] >= 0) & ~np.isin(found[b], handler.row_to_item[h])][:K_EVAL]
            item_ids[b, :len(keep)] = keep
        out.append(ranks_from_topk(torch.from_numpy(item_ids), torch.from_numpy(targets[s:s + batch])))
    return torch.cat(out)


def two_tower_exact(ckpt: dict, split: Split, stage: str = "test") -> dict[str, float]:
    """Float user tower . float item embeddings over the whole pool (the retrieval model's ceiling)."""
    from silverrec.publish.train import exact_metrics, rebuild_user_tower
    from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec

    enc = FeatureEncoder(UserFeatureSpec.from_json(ckpt["spec"]), ckpt["item_features"])
    return exact_metrics(rebuild_user_tower(ckpt), enc, ckpt["item_embeddings"], split, stage)


def quality_table(ckpt: dict, built, split: Split, stage: str = "test", baselines: bool = True,
                  log=lambda msg: print(msg, file=sys.stderr)) -> dict[str, dict[str, float]]:
    """Every row of the table (module docstring) -> metrics; `built` is the published composition."""
    from silverrec.publish.baselines import run_baselines
    from silverrec.ranking.overarch import overarch_from_config

    rows: dict[str, dict[str, float]] = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        rows[name] = fn()
        log(f"[silverrec] quality: {name:<28} HR@10 {rows[name]['HR@10']:.4f}  NDCG@10 {rows[name]['NDCG@10']:.4f}  "
            f"({time.perf_counter() - t0:.1f}s)")

    if baselines:
        for name, m in run_baselines(split).items():
            rows[name] = m
            log(f"[silverrec] quality: {name:<28} HR@10 {m['HR@10']:.4f}  NDCG@10 {m['NDCG@10']:.4f}")
    timed("two-tower exact", lambda: two_tower_exact(ckpt, split, stage))
    handler = handler_for(built)
    timed("IVF", lambda: metrics_from_ranks(ivf_only_ranks(handler, built.parts.index, split, stage)))

    def variant(kind: Optional[str], arch, value_model: Optional[str] = None) -> RecHandler:
        """The published composition with another OverArch (or none), the value model given and no
        transitions."""
        spec = built.spec.replace(overarch=kind, value_model=value_model, transitions=0, transition_weight=0.0)
        return handler_for(built, compose(spec, dataclasses.replace(built.parts, overarch=arch, transitions=None)))

    timed("IVF + re-score", lambda: evaluate_handler(variant(None, None), split, stage))
    for kind, label in (("mlp", "+ OverArch MLP"), ("mol", "+ MoL"), ("listwise", "+ list-wise OverArch")):
        if kind in ckpt["overarch"]:
            entry = ckpt["overarch"][kind]
            arch = overarch_from_config(kind, entry["config"])
            arch.load_state_dict(entry["state"])
            timed(label, lambda: evaluate_handler(variant(kind, arch.eval()), split, stage))
    final = handler
    if built.spec.transitions:
        final = variant(built.spec.overarch, built.parts.overarch, built.spec.value_model)
    if built.spec.value_model is not None:
        timed(f"multi-task + value model ({built.spec.overarch or 'none'})", lambda: evaluate_handler(final, split, stage))
    if built.spec.transitions:
        timed("+ next-item transitions", lambda: evaluate_handler(handler, split, stage))
    return rows


def format_table(rows: dict[str, dict[str, float]]) -> str:
    cols = ["HR@10", "HR@50", "HR@100", "NDCG@10", "NDCG@100"]
    lines = [f"{'model':<40}" + "".join(f"{c:>10}" for c in cols)]
    for name, m in rows.items():
        lines.append(f"{name:<40}" + "".join(f"{m[c]:>10.4f}" for c in cols))
    return "\n".join(lines)
