"""Publish a recommendation snapshot (kind "rec"): compose `RecModel` from a trained checkpoint.

    silverrec publish --config publish.toml --out DIR

1. The item tower runs over the pool in batches (progress bar) -> item embeddings.
2. Int8 IVF + Bloom bank + exact planes + posting lists over them (publish/filtered_ivf.py), rows
   cluster-major: this order is the snapshot's canonical row space.
3. Embedding cache (bf16 embeddings + dense item features) in canonical row order.
4. The user tower with its item table permuted into canonical order (so request histories are
   canonical rows); its tables int8 (torchrec `quantize_embeddings`) when the int8 tower's top-100
   agrees with the float one's on sampled users (`quantization` in the manifest says what held).
5. OverArch (the config names one the checkpoint holds, or none) and the value model formula.
6. model.pt2 (forward), rank.pt2 (early-stage ranking), model.ts (both methods), items.npz
   (row -> item id, item feature codes for the request encoder), users.npz (histories of the
   training users, for `recommend --user`): publish/rec_files.py.
"""

from __future__ import annotations

import dataclasses
import math
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from silverrec.candidates import SOURCES
from silverrec.compose import CompositionError, ModelParts, compose
from silverrec.publish.calibrate import choose_nprobe
from silverrec.publish.config import ConfigError, read_toml
from silverrec.publish.filtered_ivf import build_filtered_ivf, pool_rows
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool
from silverrec.publish.progress import bar, step
from silverrec.publish.rec_files import Built, write_rec_files
from silverrec.publish.train import load_checkpoint, rebuild_item_tower, rebuild_user_tower
from silverrec.ranking.cache import EmbeddingCache
from silverrec.ranking.overarch import overarch_from_config
from silverrec.ranking.value_model import formula_to_json
from silverrec.filtering.filter_program import FilterPlan
from silverrec.rec_model import RecModel
from silverrec.spec import MERGES, OWN_TOWERS, PRIORITIES, ModelSpec
from silverrec.snapshot import write_snapshot
from silverrec.retrieval.user_tower import UserFeatureSpec, _csr, direct_tower



@dataclass
class PublishConfig:
    """What a recommendation snapshot holds (TOML keys of the same names)."""

    checkpoint: str
    overarch: str = "mol"  # a kind the checkpoint trained, or "none"
    value_model: Any = None  # formula (JSON object or text); None = task 0's score
    merge: str = "union"
    k0: int = 200  # candidates per task
    candidates: int = 0  # K1: most candidates ranked per request (tasks' lists merged rank by rank); 0 = T * k0
    exclude_limit: int = 4096  # exclusion slots per request (history newest first; cheap: a sorted search)
    overfetch: int = 256  # rows per task searched beyond k0, so that exclusions still leave k0
    mlp_dtype: str = "fp32"  # user-tower MLP: "fp32", "bf16" (where its top-100 agrees), "auto" (bf16 where also faster)
    nlist: Optional[int] = None
    nprobe: Optional[int] = None  # None: the smallest that reaches min_recall (measured at publish)
    min_recall: float = 0.97  # IVF recall@k0 against the exact cache scores, on sampled users
    seed: int = 0
    quantize: str = "auto"  # user tower tables: "auto" (int8 where quality holds), "int8", "none"
    min_overlap: float = 0.95  # auto: mean top-100 overlap of int8 vs float user embeddings
    torchscript: bool = True
    # filled per request from the user's features, ANDed with its filter (silverrec/filtering/template.py)
    filter_template: Optional[str] = None
    template_values: int = 8  # most values of a user feature bound with `IN $user.<feature>`
    # retrieval sources: "ann" (always), "generative" (the beam decode of `generative_checkpoint`, a
    # publish/train_generative.py checkpoint over the same pool; silverrec/generative/source.py)
    sources: list = field(default_factory=lambda: ["ann"])
    generative_checkpoint: Optional[str] = None
    beam_width: int = 64  # the decode's beams = its candidates per request
    beam_top_k: int = 0  # per-beam candidates before the global top W (0 = beam_width)
    # hybrid ranking: value + generative_weight * the decode's log-prob, source_priority's rows first
    # (ranking/top_k.py fuse_sources); with validation_checkpoint and validation_generative_checkpoint (the same
    # trainings at stage "valid") both are chosen on the validation split instead (publish/fusion.py).
    # Defaults: the best MovieLens validation NDCG@10 averaged over 3 seeds with 4,000-step decoders
    # (0.0560; the decode alone at its best w 0.0547, ANN alone 0.0461; on test 0.0519 vs 0.0515 / 0.0452:
    # benchmarks/results/generative_quality_hybrid_exact.json)
    generative_weight: float = 1.0
    source_priority: str = "none"
    validation_checkpoint: Optional[str] = None
    validation_generative_checkpoint: Optional[str] = None
    # next-item transitions (publish/transitions.py): the newest history item's `transitions` likeliest
    # next items join the ANN's candidates, ranked by value + transition_weight * P(item | newest item);
    # 0 = none; "auto": the weight chosen on the validation items
    transitions: int = 0
    transition_weight: Any = "auto"
    # j counts as a successor of i up to transition_window steps after it, weighing transition_decay^(steps - 1)
    # (window 1: the first-order Markov chain); "auto": the window and decay of publish/transitions.py's
    # WINDOWS x DECAYS that the validation items favour, chosen with the weight
    transition_window: Any = "auto"
    transition_decay: Any = "auto"

    def __post_init__(self):
        if self.merge not in MERGES:
            raise ConfigError(f"merge must be one of {MERGES}, got {self.merge!r}")
        if self.quantize not in ("auto", "int8", "none"):
            raise ConfigError(f"quantize must be 'auto', 'int8' or 'none', got {self.quantize!r}")
        if int(self.k0) <= 0:
            raise ConfigError(f"k0 must be positive, got {self.k0}")
        if int(self.candidates) < 0:
            raise ConfigError(f"candidates must be >= 0 (0 = every task's k0 candidates), got {self.candidates}")
        if int(self.overfetch) < 0:
            raise ConfigError(f"overfetch must be >= 0, got {self.overfetch}")
        if int(self.exclude_limit) <= 0:
            raise ConfigError(f"exclude_limit must be positive, got {self.exclude_limit}")
        if not set(self.sources) <= set(SOURCES) or "ann" not in self.sources:
            raise ConfigError(f"sources must list 'ann' and optionally 'generative', got {self.sources!r}")
        if ("generative" in self.sources) != (self.generative_checkpoint is not None):
            raise ConfigError("sources = ['ann', 'generative'] and generative_checkpoint go together")
        if not (math.isfinite(float(self.generative_weight)) and float(self.generative_weight) >= 0):
            raise ConfigError(f"generative_weight must be a finite number >= 0, got {self.generative_weight!r}")
        if self.source_priority not in PRIORITIES:
            raise ConfigError(f"source_priority must be one of {PRIORITIES}, got {self.source_priority!r}")
        if (self.validation_checkpoint is None) != (self.validation_generative_checkpoint is None) or (
                self.validation_checkpoint is not None and "generative" not in self.sources):
            raise ConfigError("validation_checkpoint and validation_generative_checkpoint go together, with "
                              "sources = ['ann', 'generative']")
        if int(self.beam_width) <= 0 or int(self.beam_top_k) < 0:
            raise ConfigError(f"beam_width must be positive and beam_top_k >= 0, got {self.beam_width}, {self.beam_top_k}")
        if isinstance(self.transitions, bool) or not isinstance(self.transitions, int) or self.transitions < 0:
            raise ConfigError(f"transitions must be an int >= 0 (0 = none), got {self.transitions!r}")
        if self.transitions and "generative" in self.sources:
            raise ConfigError("transitions join the ANN's candidates of a snapshot whose one source is 'ann'; "
                              "this config also has 'generative'")
        v = self.transition_window
        if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"transition_window must be \"auto\" or an int >= 1, got {v!r}")
        d = self.transition_decay
        if d != "auto" and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1):
            raise ConfigError(f"transition_decay must be \"auto\" or a number in (0, 1], got {d!r}")
        w = self.transition_weight
        if w != "auto" and (isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0):
            raise ConfigError(f"transition_weight must be \"auto\" or a finite number >= 0, got {w!r}")
        if "auto" in (v, d) and self.transitions and self.transition_weight != "auto":
            raise ConfigError("transition_window and transition_decay \"auto\" are chosen with the weight on the "
                              "validation items: with a fixed transition_weight, give the window and the decay too")
        if self.mlp_dtype not in ("fp32", "bf16", "auto"):
            raise ConfigError(f"mlp_dtype must be 'fp32', 'bf16' or 'auto', got {self.mlp_dtype!r}")

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> "PublishConfig":
        return read_toml(cls, path, path_keys=("checkpoint", "generative_checkpoint", "validation_checkpoint",
                                                    "validation_generative_checkpoint"), required=("checkpoint",), **overrides)


def permute_item_table(user_tower: torch.nn.Module, perm: torch.Tensor) -> None:
    """Reorder the user tower's item table so that row r holds pool row perm[r] (canonical order);
    a tower with per-item tables of its own (the sequential one) reorders them itself."""
    if hasattr(user_tower, "permute_items"):
        user_tower.permute_items(perm)
        return
    table = user_tower.ebc.embedding_bags["item"]
    with torch.no_grad():
        table.weight.copy_(table.weight[perm])


SAMPLE_USERS = 256  # training users whose histories check the int8 user tower


def stored_histories(users: dict[str, Any], row_to_item: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The checkpoint's stored histories (`users`: offsets, item ids) as canonical rows -> (offsets
    int64 [U + 1], rows int64 [nnz]); row_to_item int64 [N] the item id of each canonical row."""
    offsets = np.asarray(users["offsets"], dtype=np.int64)
    ids = np.asarray(users["item_ids"], dtype=np.int64)
    order = np.argsort(row_to_item)
    rows = order[np.searchsorted(row_to_item, ids, sorter=order).clip(0, len(order) - 1)]
    if not np.array_equal(row_to_item[rows], ids):
        raise ConfigError("the checkpoint's stored histories name items outside its pool")
    return offsets, rows


def quantize_user_tower(user_tower, encoder, histories, cache_emb: torch.Tensor, mode: str, min_overlap: float,
                        mlp_dtype: str = "fp32"):
    """int8 tables where quality holds: (tower, report). The report gives the measured top-100
    overlap and cosine between the float and the int8 tower's user embeddings, and table bytes."""
    from torchrec.inference.modules import quantize_embeddings

    def table_bytes(m):
        return int(sum(t.numel() * t.element_size() for t in m.state_dict().values()))

    report: dict[str, Any] = {"tables": "fp32", "mlp": "fp32", "fp32_bytes": table_bytes(user_tower)}
    if mode == "none" or not hasattr(user_tower, "ebc"):  # int8 tables are TorchRec's: the bag tower's
        return user_tower, report
    q = quantize_embeddings(user_tower, dtype=torch.qint8, inplace=False)
    top = min(100, cache_emb.shape[0])
    with torch.no_grad():
        inputs = encoder.encode(histories)
        a, b = user_tower(*inputs), q(*inputs)
        ta = (a[:, 0] @ cache_emb.T).topk(top, dim=1).indices
        tb = (b[:, 0] @ cache_emb.T).topk(top, dim=1).indices
    overlap = float(np.mean([len(set(x.tolist()) & set(y.tolist())) / top for x, y in zip(ta, tb)]))
    cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())
    report.update({"int8_top100_overlap": round(overlap, 4), "int8_cosine": round(cosine, 6), "int8_bytes": table_bytes(q)})
    tower = user_tower
    if mode == "int8" or overlap >= min_overlap:
        report["tables"] = "int8"
        tower = q
    # bf16 MLP, measured and recorded; used per `mlp_dtype` (never where its top-100 disagrees)
    import copy
    import time

    bf = copy.deepcopy(tower)
    bf.mlp.to(torch.bfloat16)
    bf.heads.to(torch.bfloat16)

    def timed(m) -> float:
        best = float("inf")
        with torch.no_grad():
            for _ in range(5):
                t0 = time.perf_counter()
                m(*inputs)
                best = min(best, time.perf_counter() - t0)
        return best

    with torch.no_grad():
        tc = (bf(*inputs)[:, 0] @ cache_emb.T).topk(top, dim=1).indices
    base = (tower(*inputs)[:, 0] @ cache_emb.T).topk(top, dim=1).indices if tower is q else ta
    bf_overlap = float(np.mean([len(set(x.tolist()) & set(y.tolist())) / top for x, y in zip(base, tc)]))
    t_fp32, t_bf16 = timed(tower), timed(bf)
    report.update({"bf16_mlp_top100_overlap": round(bf_overlap, 4), "fp32_mlp_ms": round(t_fp32 * 1e3, 3),
                   "bf16_mlp_ms": round(t_bf16 * 1e3, 3), "batch": int(len(histories))})
    if mlp_dtype == "bf16" and bf_overlap >= min_overlap or mlp_dtype == "auto" and bf_overlap >= min_overlap and t_bf16 < t_fp32:
        report["mlp"] = "bf16"
        tower = bf
    return direct_tower(tower), report  # int8 tables: the TBE called without torchrec's KJT bookkeeping


def build_rec_model(cfg: PublishConfig, ckpt: Optional[dict] = None, overarch: Optional[str] = None,
                    value_model: Any = "config") -> Built:
    """Compose the RecModel a config describes (overarch / value_model override the config's:
    the demo's quality table builds variants this way)."""
    ckpt = ckpt if ckpt is not None else load_checkpoint(cfg.checkpoint)
    spec = UserFeatureSpec.from_json(ckpt["spec"])
    tasks = [t["name"] for t in ckpt["tasks"]]
    item_ids = ckpt["item_ids"].numpy()
    n = item_ids.shape[0]
    item_tower = rebuild_item_tower(ckpt)
    with bar(n, "item tower over the pool") as pbar:
        emb = item_tower.embed_all(n, progress=pbar)
    pool = Pool(item_ids, emb.numpy(), {f: list(v) for f, v in ckpt["item_features"].items()})
    index, manifest = build_filtered_ivf(pool, IVFConfig(nlist=cfg.nlist, seed=cfg.seed))
    perm = pool_rows(pool, index.row_to_item)  # canonical row -> pool row
    cache = EmbeddingCache(emb[perm], ckpt["item_dense"][perm], ckpt["item_feature_names"])
    user = rebuild_user_tower(ckpt)
    permute_item_table(user, perm)
    if hasattr(user, "fold_item_features"):  # the sequential tower: item features summed into its item table once
        user.fold_item_features()
    item_csr = {f: _csr([ckpt["item_features"][f][p] for p in perm.tolist()], spec.item_vocabs[f]) for f in spec.item_vocabs}
    from silverrec.retrieval.user_tower import FeatureEncoder

    encoder = FeatureEncoder.from_arrays(spec, item_csr)
    row_to_item = index.row_to_item.to(torch.int64).numpy()
    histories = off, rows = stored_histories(ckpt["users"], row_to_item)
    sample = [rows[off[u]:off[u + 1]] for u in range(min(SAMPLE_USERS, len(off) - 1))]  # for the quantisation check
    user, quant = quantize_user_tower(user, encoder, sample, cache.emb.float(), cfg.quantize, cfg.min_overlap,
                                      cfg.mlp_dtype)
    if cfg.nprobe is not None:
        manifest["default_nprobe"] = int(cfg.nprobe)
    else:
        with torch.no_grad():
            queries = user(*encoder.encode(sample)).reshape(-1, cache.dim)
        manifest["default_nprobe"], manifest["calibration"] = choose_nprobe(
            index, queries, cache.emb.float(), cfg.k0, cfg.min_recall)
    manifest["search"]["default_max_probe"] = max(int(manifest["default_nprobe"]), manifest["search"]["default_max_probe"])
    kind = cfg.overarch if overarch is None else overarch
    arch = None
    if kind != "none":
        if kind not in ckpt["overarch"]:
            raise ConfigError(f"overarch {kind!r} is not in checkpoint {cfg.checkpoint} (it has {sorted(ckpt['overarch']) or 'none'})")
        entry = ckpt["overarch"][kind]
        arch = overarch_from_config(kind, entry["config"])
        arch.load_state_dict(entry["state"])
        arch.eval()
    formula = cfg.value_model if value_model == "config" else value_model
    parts = ModelParts(user_tower=user, index=index, cache=cache, overarch=arch)
    extra: dict[str, Any] = {}
    if cfg.filter_template is not None:
        parts.filter_plan, parts.user_features = FilterPlan.from_config(manifest["filter"]), spec
        extra.update(template=cfg.filter_template, template_values=int(cfg.template_values))
    if "generative" in cfg.sources:  # hybrid: the beam decode beside the IVF search
        parts.decode, manifest["generative"], extra["decode_history"] = load_generative(cfg)
        fusion = {"weight": float(cfg.generative_weight), "priority": cfg.source_priority, "chosen_on": "config"}
        if cfg.validation_checkpoint is not None:
            from silverrec.publish.fusion import choose_fusion

            with step("choosing the fusion on the validation split"):
                fusion = choose_fusion(cfg, build_rec_model)
        extra.update(generative_weight=fusion["weight"], source_priority=fusion["priority"])
        manifest["generative"]["weight"], manifest["generative"]["fusion"] = fusion["weight"], fusion
    model_spec = ModelSpec(OWN_TOWERS[ckpt.get("user_tower_kind", "bag")], cache.dim, index.nlist, tuple(tasks), tuple(cfg.sources), cache=True,
                           overarch=None if arch is None else kind, value_model=value_formula(formula),
                           merge=cfg.merge, overfetch=int(cfg.overfetch), candidates=int(cfg.candidates), **extra)
    if cfg.transitions:
        model_spec = add_transitions(cfg, ckpt, model_spec, parts, manifest, row_to_item, histories, item_csr)
    model = compose_checked(model_spec, parts, cfg.generative_checkpoint)
    record_composition(manifest, model)
    manifest.update({
        **serving_config(cfg, spec, cache),
        "quantization_user_tower": quant,
        "bytes_per_item": _bytes_per_item(parts, model, n),
        "training": ckpt.get("stats", {}),
        "training_metrics": ckpt.get("metrics", {}),
    })
    users = None
    if "users" in ckpt:
        users = {k: np.asarray(v) for k, v in ckpt["users"].items()}
    return Built(model, model_spec, parts, manifest, row_to_item, item_csr, users)


def add_transitions(cfg: PublishConfig, ckpt: dict, spec: ModelSpec, parts: ModelParts, manifest: dict[str, Any],
                    row_to_item: np.ndarray, histories: tuple[np.ndarray, np.ndarray], item_csr) -> ModelSpec:
    """The next-item transitions (publish/transitions.py): the serving tables from the checkpoint's
    stored histories (`stored_histories`) into `parts`, the weight (the config's, or chosen with the
    window and decay on the validation items) into the returned spec, the choice into
    manifest["transitions"]."""
    from silverrec.publish.quality import handler_for
    from silverrec.publish.transitions import choose, transition_tables

    offsets, rows = histories
    n, m = len(row_to_item), int(cfg.transitions)
    spec = spec.replace(transitions=m)
    if cfg.transition_weight != "auto":
        choice = {"window": int(cfg.transition_window), "decay": float(cfg.transition_decay),
                  "weight": float(cfg.transition_weight), "chosen_on": "config"}
    else:
        config = {**manifest, **serving_config(cfg, UserFeatureSpec.from_json(ckpt["spec"]), parts.cache)}

        def handler_with(tables):
            v_parts = dataclasses.replace(parts, transitions=tables)
            model = compose_checked(spec.replace(transition_weight=0.0), v_parts)
            return handler_for(Built(model, model.spec, v_parts, config, row_to_item, item_csr, None))

        with step("choosing the transitions' table and weight on the validation items"):
            choice = choose(handler_with, row_to_item, offsets, rows, m, cfg.seed, cfg.transition_window,
                            cfg.transition_decay)
    parts.transitions = transition_tables(offsets, rows, n, m, choice["window"], choice["decay"])
    manifest["transitions"] = {"per_item": m, **choice}
    return spec.replace(transition_weight=float(choice["weight"]))


def value_formula(formula: Any) -> Optional[str]:
    """A config's value model formula (JSON object, text or number; None) as the spec holds it."""
    return None if formula is None else formula_to_json(formula)


def compose_checked(spec: ModelSpec, parts: ModelParts, generative_checkpoint: Optional[str] = None) -> RecModel:
    """`compose`, its part mismatches (a decoder over another pool) as ConfigError."""
    try:
        return compose(spec, parts)
    except CompositionError as e:
        where = f"generative_checkpoint {generative_checkpoint}: " if generative_checkpoint else ""
        raise ConfigError(f"{where}{e}") from None


def record_composition(manifest: dict[str, Any], model: RecModel) -> None:
    """What the predictor reads of a composed model: its spec, the filled filter template's bindings
    and, with a decode, the history length it reads."""
    manifest["spec"] = model.spec.to_json()
    template = model.filter_template
    manifest["filter_template"] = template.config() if template.text else None
    if "generative" in model.spec.sources:
        manifest["generative"]["max_items"] = decode_stage(model).generative.max_items


def decode_stage(model: RecModel):
    """The model's DecodeSource (alone, or beside the ANN in HybridSources)."""
    return model.sources.decode if model.spec.hybrid else model.sources


def serving_config(cfg: Any, features: UserFeatureSpec, cache: EmbeddingCache) -> dict[str, Any]:
    """The manifest keys beside the spec of every recommendation snapshot (silverrec's own towers
    here, a user's in publish/byo.py): what the tower reads (the request encoder's spec), request
    defaults and the cache's feature columns."""
    return {
        "index": "rec",
        "user_features": features.to_json(),
        "item_feature_names": cache.feature_names,
        "default_k0": int(cfg.k0),
        "exclude_limit": int(cfg.exclude_limit),
    }


def load_generative(cfg: PublishConfig):
    """The generative checkpoint's decode, its manifest entry and the decoder's history length
    (its training `max_history`, None if unrecorded)."""
    from silverrec.publish.generative import build_generative
    from silverrec.publish.generative_checkpoint import load_checkpoint as load_generative_checkpoint

    decoder, sids, info = load_generative_checkpoint(cfg.generative_checkpoint)
    top_k = int(cfg.beam_top_k) or int(cfg.beam_width)
    decode = build_generative(decoder, sids, int(cfg.beam_width), top_k)
    return decode, {"beam_width": int(cfg.beam_width), "top_k": top_k, "level_sizes": list(sids.level_sizes),
                    "decoder": decoder.config.to_dict(), "training_metrics": info.get("metrics")}, \
        (info.get("train_config") or {}).get("max_history")


def _bytes_per_item(parts: ModelParts, model: RecModel, n: int) -> dict[str, float]:
    """Snapshot tensor bytes per item, by part."""
    def size(m) -> int:
        return int(sum(t.numel() * t.element_size() for t in m.state_dict().values()))

    idx = parts.index
    parts = {
        "ivf_codes": idx.codes.numel() * idx.codes.element_size(),
        "filter_bank": idx.bits.numel() * 8,
        "posting_lists": idx.post_rows.numel() * 4 + idx.post_offsets.numel() * 8,
        "cache": size(model.overarch.cache),  # every OverArch stage of a model with a cache reads it
        "user_tower": size(parts.user_tower),
    }
    return {k: round(v / n, 2) for k, v in parts.items()} | {"total": round(sum(parts.values()) / n, 2)}


def publish_rec(cfg: PublishConfig, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Build and write a recommendation snapshot (kind "rec") atomically."""
    built = build_rec_model(cfg)
    built.manifest["publish_config"] = json.loads(json.dumps(asdict(cfg), default=str))
    built.manifest["item_feature_order"] = list(built.item_csr)
    return write_snapshot(out, kind="rec", config=built.manifest, item_count=len(built.row_to_item),
                          write_files=lambda tmp: write_rec_files(built, tmp, cfg.torchscript), overwrite=overwrite)
