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
   training users, for `recommend --user`).
"""

from __future__ import annotations

import math
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.export import Dim

from silverrec.publish.config import ConfigError, read_toml
from silverrec.publish.filtered_ivf import DYNAMIC as FILTER_DYNAMIC, build_filtered_ivf, example_inputs, pool_rows
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.pool import Pool
from silverrec.publish.progress import bar, step
from silverrec.publish.train import load_checkpoint, rebuild_item_tower, rebuild_user_tower
from silverrec.ranking.cache import EmbeddingCache
from silverrec.ranking.overarch import overarch_from_config
from silverrec.ranking.value_model import compile_value_model
from silverrec.filtering.filter_program import FilterPlan
from silverrec.filtering.template import compile_template
from silverrec.rec_model import MERGES, RankEntry, RecModel
from silverrec.generative import source as generative_source
from silverrec.generative.source import PRIORITIES, SOURCES, HybridRecModel
from silverrec.spec import ModelSpec
from silverrec.snapshot import EXPORT_FILE, SCRIPT_FILE, export_program, preferred_backend, write_snapshot
from silverrec.retrieval.user_tower import UserFeatureSpec, _csr, direct_tower

RANK_FILE = "rank.pt2"
ITEMS_FILE = "items.npz"
USERS_FILE = "users.npz"


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
    # (source.fuse_sources); with validation_checkpoint and validation_generative_checkpoint (the same
    # trainings at stage "valid") both are chosen on the validation split instead (publish/fusion.py).
    # Defaults: the best MovieLens validation NDCG@10 averaged over 3 seeds with 4,000-step decoders
    # (0.0560; the decode alone at its best w 0.0547, ANN alone 0.0461; on test 0.0519 vs 0.0515 / 0.0452:
    # benchmarks/results/generative_quality_hybrid_exact.json)
    generative_weight: float = 1.0
    source_priority: str = "none"
    validation_checkpoint: Optional[str] = None
    validation_generative_checkpoint: Optional[str] = None

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
        if self.mlp_dtype not in ("fp32", "bf16", "auto"):
            raise ConfigError(f"mlp_dtype must be 'fp32', 'bf16' or 'auto', got {self.mlp_dtype!r}")

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> "PublishConfig":
        return read_toml(cls, path, path_keys=("checkpoint", "generative_checkpoint", "validation_checkpoint",
                                                    "validation_generative_checkpoint"), required=("checkpoint",), **overrides)


@dataclass
class Built:
    """A composed model and everything the snapshot records beside it."""

    model: RecModel
    manifest: dict[str, Any]
    row_to_item: np.ndarray  # int64 [N]
    item_csr: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    users: Optional[dict[str, np.ndarray]] = None


def permute_item_table(user_tower: torch.nn.Module, perm: torch.Tensor) -> None:
    """Reorder the user tower's item table so that row r holds pool row perm[r] (canonical order)."""
    table = user_tower.ebc.embedding_bags["item"]
    with torch.no_grad():
        table.weight.copy_(table.weight[perm])


def _sample_requests(ckpt: dict, perm_inv: np.ndarray, n: int = 256) -> list[np.ndarray]:
    """Histories (canonical rows) of up to n training users, for the quantisation check."""
    users = ckpt["users"]
    row_of = {int(i): int(perm_inv[p]) for p, i in enumerate(ckpt["item_ids"].tolist())}
    off, ids = users["offsets"], users["item_ids"]
    out = []
    for u in range(min(n, len(off) - 1)):
        out.append(np.asarray([row_of[int(i)] for i in ids[off[u]:off[u + 1]]], dtype=np.int64))
    return out


def quantize_user_tower(user_tower, encoder, histories, cache_emb: torch.Tensor, mode: str, min_overlap: float,
                        mlp_dtype: str = "fp32"):
    """int8 tables where quality holds: (tower, report). The report gives the measured top-100
    overlap and cosine between the float and the int8 tower's user embeddings, and table bytes."""
    from torchrec.inference.modules import quantize_embeddings

    def table_bytes(m):
        return int(sum(t.numel() * t.element_size() for t in m.state_dict().values()))

    report: dict[str, Any] = {"tables": "fp32", "mlp": "fp32", "fp32_bytes": table_bytes(user_tower)}
    if mode == "none":
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


@torch.no_grad()
def choose_nprobe(index, users: torch.Tensor, cache_emb: torch.Tensor, k0: int, min_recall: float) -> tuple[int, dict]:
    """The smallest nprobe of nlist/16, /8, /4, /2, nlist whose IVF top-k0 holds `min_recall` of the
    exact top-k0 (cache embeddings) for the sampled user embeddings `users` [U, D]: (nprobe, recalls)."""
    nlist = index.nlist
    k0 = min(k0, index.num_items)
    exact = index.row_to_item[(users @ cache_emb.T).topk(k0, dim=1).indices].to(torch.int64)
    recalls = {}
    for p in sorted({max(1, nlist // d) for d in (16, 8, 4, 2, 1)}):
        _, found = index.scan(users, index.probe(users, p), k0)
        hits = (found[:, :, None] == exact[:, None, :]).any(dim=2).sum(dim=1)
        recalls[p] = round(float(hits.double().mean()) / k0, 4)
        if recalls[p] >= min_recall:
            return p, recalls
    return nlist, recalls


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
    perm_inv = torch.empty_like(perm)
    perm_inv[perm] = torch.arange(n)
    cache = EmbeddingCache(emb[perm], ckpt["item_dense"][perm], ckpt["item_feature_names"])
    user = rebuild_user_tower(ckpt)
    permute_item_table(user, perm)
    item_csr = {f: _csr([ckpt["item_features"][f][p] for p in perm.tolist()], spec.item_vocabs[f]) for f in spec.item_vocabs}
    from silverrec.retrieval.user_tower import FeatureEncoder

    encoder = FeatureEncoder.from_arrays(spec, item_csr)
    sample = _sample_requests(ckpt, perm_inv.numpy())
    user, quant = quantize_user_tower(user, encoder, sample, cache.emb.float(), cfg.quantize, cfg.min_overlap,
                                      cfg.mlp_dtype)
    if cfg.nprobe is not None:
        manifest["default_nprobe"] = int(cfg.nprobe)
    else:
        with torch.no_grad():
            queries = user(*encoder.encode(sample)).reshape(-1, cache.dim)
        manifest["default_nprobe"], manifest["nprobe_recall_at_k0"] = choose_nprobe(
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
    vm = compile_value_model(formula, tasks, cache.feature_names) if formula is not None else None
    template = None if cfg.filter_template is None else compile_template(
        cfg.filter_template, FilterPlan.from_config(manifest["filter"]), spec, cfg.template_values)
    extra, kind_of_model = {}, RecModel
    if "generative" in cfg.sources:  # hybrid: the beam decode beside the IVF search
        extra["generative"], manifest["generative"] = load_generative_source(cfg, index.row_to_item)
        fusion = {"weight": float(cfg.generative_weight), "priority": cfg.source_priority, "chosen_on": "config"}
        if cfg.validation_checkpoint is not None:
            from silverrec.publish.fusion import choose_fusion

            with step("choosing the fusion on the validation split"):
                fusion = choose_fusion(cfg, build_rec_model)
        extra["generative_weight"], extra["source_priority"] = fusion["weight"], fusion["priority"]
        manifest["generative"]["weight"], manifest["generative"]["fusion"] = fusion["weight"], fusion
        kind_of_model = HybridRecModel
    manifest["sources"] = list(cfg.sources)
    model = kind_of_model(user, index, cache, arch, vm, tasks=len(tasks), merge=cfg.merge, overfetch=cfg.overfetch,
                          candidates=cfg.candidates, template=template, **extra).eval()
    manifest["filter_template"] = None if template is None else template.config()
    manifest.update({
        **serving_config(cfg, spec, tasks, cache, kind, vm),
        "quantization_user_tower": quant,
        "bytes_per_item": _bytes_per_item(model, n),
        "training": ckpt.get("stats", {}),
        "training_metrics": ckpt.get("metrics", {}),
    })
    users = None
    if "users" in ckpt:
        users = {k: np.asarray(v) for k, v in ckpt["users"].items()}
    return Built(model, manifest, index.row_to_item.to(torch.int64).numpy(), item_csr, users)


def serving_config(cfg: PublishConfig, spec: UserFeatureSpec, tasks: list[str], cache: EmbeddingCache, overarch: str,
                   vm: Any) -> dict[str, Any]:
    """The manifest keys the predictor reads to encode and answer requests, for every recommendation
    snapshot (silverrec's own towers here, a user's in publish/byo.py)."""
    return {
        "index": "rec",
        "tasks": tasks,
        "user_features": spec.to_json(),
        "item_feature_names": cache.feature_names,
        "overarch": overarch,
        "value_model": None if vm is None else vm.config()["formula"],
        "merge": cfg.merge,
        "default_k0": int(cfg.k0),
        "candidates": int(cfg.candidates),
        "exclude_limit": int(cfg.exclude_limit),
        "overfetch": int(cfg.overfetch),
    }


def load_generative_source(cfg: PublishConfig, row_to_item: torch.Tensor):
    """The generative checkpoint as a `GenerativeSource` over the index's rows, and its manifest entry."""
    from silverrec.publish.generative import build_generative
    from silverrec.publish.generative_checkpoint import load_checkpoint as load_generative

    decoder, sids, info = load_generative(cfg.generative_checkpoint)
    top_k = int(cfg.beam_top_k) or int(cfg.beam_width)
    try:
        source = generative_source.GenerativeSource(build_generative(decoder, sids, int(cfg.beam_width), top_k), row_to_item,
                                                    (info.get("train_config") or {}).get("max_history"))
    except ValueError as e:
        raise ConfigError(f"generative_checkpoint {cfg.generative_checkpoint}: {e}") from None
    return source, {"beam_width": int(cfg.beam_width), "top_k": top_k, "level_sizes": list(sids.level_sizes),
                    "max_items": source.max_items, "decoder": decoder.config.to_dict(),
                    "training_metrics": info.get("metrics")}


def _bytes_per_item(model: RecModel, n: int) -> dict[str, float]:
    """Snapshot tensor bytes per item, by part."""
    def size(m) -> int:
        return int(sum(t.numel() * t.element_size() for t in m.state_dict().values()))

    idx = model.index
    parts = {
        "ivf_codes": idx.codes.numel() * idx.codes.element_size(),
        "filter_bank": idx.bits.numel() * 8,
        "posting_lists": idx.post_rows.numel() * 4 + idx.post_offsets.numel() * 8,
        "cache": size(model.cache),
        "user_tower": size(model.user_tower),
    }
    return {k: round(v / n, 2) for k, v in parts.items()} | {"total": round(sum(parts.values()) / n, 2)}


def example_request(model: RecModel, spec: UserFeatureSpec, dim: int) -> tuple:
    """Export example: batch 2, distinct ints so every dynamic size stays its own symbol."""
    from silverrec.retrieval.user_tower import FeatureEncoder

    n = model.index.num_items
    csr = {f: (np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)) for f in spec.item_vocabs}
    enc = FeatureEncoder.from_arrays(spec, csr)
    values, lengths, dense = enc.encode([np.arange(min(3, n)), np.arange(min(2, n))])
    f_args = example_inputs(model.index, dim)
    ops, rows, vops, vrows, lists = f_args[3:8]
    exclude = torch.tensor([[-1, 0, 1], [-1, -1, 2]], dtype=torch.int64).clamp_max(n - 1)
    mode = torch.zeros(2, dtype=torch.int64)
    nlist = model.index.nlist
    return (values, lengths, dense, exclude, ops, rows, vops, vrows, lists, mode, 4, 6, min(5, nlist), min(7, nlist))


def dynamic_shapes(num_keys: int) -> dict[str, Any]:
    batch = FILTER_DYNAMIC["queries"][0]
    return {
        "values": {0: Dim.DYNAMIC},
        "lengths": {0: num_keys * batch},
        "dense": {0: batch},
        "exclude": {0: batch, 1: Dim.DYNAMIC},
        **{k: FILTER_DYNAMIC[k] for k in ("ops", "rows", "vops", "vrows", "lists", "mode")},
        "k": Dim.DYNAMIC, "k0": Dim.DYNAMIC, "nprobe": Dim.DYNAMIC, "max_probe": Dim.DYNAMIC,
    }


def scriptable(model: RecModel) -> torch.jit.ScriptModule:
    """TorchScript of the model, frozen: the TorchRec user tower is fx-traced first (torchrec's recipe);
    `torch.jit.freeze` (keeping the `rank` entry point) makes parameters and attributes constants, so
    the slices, transposes and casts of weights fold away at publish (MovieLens snapshot, 1 thread,
    alternated, load 10: 0.95x the unfrozen program's time at batch 1, 0.97x at 16; equal answers;
    optimize_for_inference on top measured no better)."""
    import copy

    clone = copy.copy(model)
    clone._modules = dict(model._modules)
    clone._modules["user_tower"] = scriptable_tower(model.user_tower)
    return torch.jit.freeze(torch.jit.script(clone).eval(), preserved_attrs=["rank"])


def scriptable_tower(tower: torch.nn.Module) -> torch.jit.ScriptModule:
    """The user tower as TorchScript: silverrec's (TorchRec modules) fx-traced by torchrec first, a
    user's tower (publish/byo.py, `script_directly`) scripted as it is."""
    if not getattr(tower, "script_directly", False):
        import torchrec.fx

        tower = torchrec.fx.symbolic_trace(tower)
    return torch.jit.script(tower)


def rec_spec(model: RecModel, manifest: dict) -> ModelSpec:
    """The configuration (silverrec/spec.py) of a recommendation snapshot: silverrec's towers or a
    user's (publish/byo.py), the OverArch and value model it holds, its retrieval sources."""
    from silverrec.adapters import UserTowerAdapter

    return ModelSpec("byo" if isinstance(model.user_tower, UserTowerAdapter) else "two_tower", model.cache.dim,
                     model.index.nlist, tuple(manifest["tasks"]), cache=True,
                     overarch=manifest["overarch"] if model.has_overarch else None,
                     value_model=model.has_value_model, sources=tuple(manifest.get("sources", ["ann"])))


def write_rec_files(built: Built, tmp: Path, torchscript: bool = True) -> None:
    model = built.model
    built.manifest["spec"] = rec_spec(model, built.manifest).to_json()
    spec = UserFeatureSpec.from_json(built.manifest["user_features"])
    example = example_request(model, spec, model.cache.dim)
    shapes = dynamic_shapes(len(spec.keys))
    if isinstance(model, HybridRecModel):  # + the history rows and the source flags
        example, shapes = generative_source.example_inputs(example, model.index.num_items), generative_source.dynamic_shapes(shapes)
    with step("exporting the model (torch.export)"):
        program = export_program(model, example, shapes)
        torch.export.save(program, tmp / EXPORT_FILE)
    rank_example = (*example[:3], torch.tensor([[0, -1, 1], [2, 3, -1]], dtype=torch.int64).clamp_max(model.index.num_items - 1))
    rank_dynamic = {k: dynamic_shapes(len(spec.keys))[k] for k in ("values", "lengths", "dense")}
    rank_dynamic["rows"] = {0: rank_dynamic["dense"][0], 1: Dim.DYNAMIC}
    with step("exporting the ranking entry point (torch.export)"):
        torch.export.save(export_program(RankEntry(model), rank_example, rank_dynamic), tmp / RANK_FILE)
    if torchscript:
        with step("TorchScript"):
            scripted = scriptable(model)
            torch.jit.save(scripted, str(tmp / SCRIPT_FILE))
        built.manifest["backend"] = preferred_backend({"export": program.module(), "torchscript": scripted}, example)
    arrays = {"row_to_item": built.row_to_item}
    for i, (f, (off, codes)) in enumerate(built.item_csr.items()):
        arrays[f"offsets_{i}"], arrays[f"codes_{i}"] = off, codes
    np.savez(tmp / ITEMS_FILE, **arrays)
    if built.users is not None:
        np.savez(tmp / USERS_FILE, **built.users)


def publish_rec(cfg: PublishConfig, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Build and write a recommendation snapshot (kind "rec") atomically."""
    built = build_rec_model(cfg)
    built.manifest["publish_config"] = json.loads(json.dumps(asdict(cfg), default=str))
    built.manifest["item_feature_order"] = list(built.item_csr)
    return write_snapshot(out, kind="rec", config=built.manifest, item_count=len(built.row_to_item),
                          write_files=lambda tmp: write_rec_files(built, tmp, cfg.torchscript), overwrite=overwrite)
