"""Writing a RecModel snapshot's files, whatever its configuration: the programs (model.pt2, the
ranking entry point rank.pt2 where the model has one, model.ts), items.npz and users.npz.

    write_rec_files(Built(model, spec, parts, manifest, row_to_item, item_csr, users), directory)

Every publisher of a recommendation snapshot (publish/rec.py from a checkpoint, publish/byo.py from a
team's modules, publish/generative.py for the decode alone) composes its model with
`silverrec.compose.compose` and writes it here; `model_example` and `dynamic_shapes` are the export
example and dynamic shapes of RecModel.forward (one signature for every configuration).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.export import Dim

from silverrec import aoti
from silverrec.compose import ModelParts
from silverrec.publish.filtered_ivf import DYNAMIC as FILTER_DYNAMIC, example_programs
from silverrec.publish.progress import step
from silverrec.rec_model import RankEntry, RecModel
from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec
from silverrec.snapshot import EXPORT_FILE, SCRIPT_FILE, export_program, preferred_backend
from silverrec.spec import ModelSpec

RANK_FILE = "rank.pt2"
ITEMS_FILE = "items.npz"
USERS_FILE = "users.npz"


@dataclass
class Built:
    """A composed model, what it was composed from (`compose(spec, parts)`: a variant is
    `compose(spec.replace(...), replace(parts, ...))`) and everything the snapshot records beside it."""

    model: RecModel
    spec: ModelSpec
    parts: ModelParts
    manifest: dict[str, Any]
    row_to_item: np.ndarray  # int64 [N]
    item_csr: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    users: Optional[dict[str, np.ndarray]] = None


def example_request(features: UserFeatureSpec, n: int, nlist: int, bank_rows: int, n_lists: int) -> tuple:
    """Export example of RecModel.forward: batch 2, distinct ints so every dynamic size stays its own
    symbol; n items, nlist clusters (0: no index), a bank of `bank_rows` rows, `n_lists` posting lists."""
    csr = {f: (np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)) for f in features.item_vocabs}
    enc = FeatureEncoder.from_arrays(features, csr)
    values, lengths, dense = enc.encode([np.arange(min(3, n)), np.arange(min(2, n))])
    ops, rows, vops, vrows, lists = example_programs(bank_rows, n_lists)
    exclude = torch.tensor([[-1, 0, 1], [-1, -1, 2]], dtype=torch.int64).clamp_max(n - 1)
    mode = torch.zeros(2, dtype=torch.int64)
    history = torch.tensor([[-1, -1, 0, 1], [2, 0, 1, 2]], dtype=torch.int64).clamp_max(n - 1)
    sources = torch.ones(2, 2, dtype=torch.bool)
    nlist = nlist or 7  # without an index nprobe and max_probe are unread
    return (values, lengths, dense, exclude, ops, rows, vops, vrows, lists, mode, history, sources, 4, 6,
            min(5, nlist), min(7, nlist))


def model_example(model: RecModel, features: UserFeatureSpec, parts: ModelParts) -> tuple:
    """`example_request` for a composed model and its parts."""
    if parts.index is not None:
        idx = parts.index
        return example_request(features, idx.num_items, idx.nlist, idx.bits.shape[0], idx.post_offsets.numel() - 1)
    return example_request(features, parts.decode.trie.n_items, 0, parts.bank.shape[0], 0)


def dynamic_shapes(num_keys: int) -> dict[str, Any]:
    batch = FILTER_DYNAMIC["queries"][0]
    return {
        "values": {0: Dim.DYNAMIC},
        "lengths": {0: num_keys * batch},
        "dense": {0: batch},
        "exclude": {0: batch, 1: Dim.DYNAMIC},
        **{k: FILTER_DYNAMIC[k] for k in ("ops", "rows", "vops", "vrows", "lists", "mode")},
        "history": {0: batch, 1: Dim.DYNAMIC},
        "sources": {0: batch},
        "k": Dim.DYNAMIC, "k0": Dim.DYNAMIC, "nprobe": Dim.DYNAMIC, "max_probe": Dim.DYNAMIC,
    }


def scriptable(model: RecModel) -> torch.jit.ScriptModule:
    """TorchScript of the model, frozen: the TorchRec user tower is fx-traced first (torchrec's recipe);
    `torch.jit.freeze` (keeping the `rank` entry point) makes parameters and attributes constants, so
    the slices, transposes and casts of weights fold away at publish (MovieLens snapshot, 1 thread,
    alternated, load 10: 0.95x the unfrozen program's time at batch 1, 0.97x at 16; equal answers;
    optimize_for_inference on top measured no better)."""
    clone = copy.copy(model)
    clone._modules = dict(model._modules)
    clone._modules["user_tower"] = scriptable_tower(model.user_tower)
    return torch.jit.freeze(torch.jit.script(clone).eval(), preserved_attrs=["rank"] if model.spec.ranks else [])


def scriptable_tower(tower: torch.nn.Module) -> torch.jit.ScriptModule:
    """The user tower as TorchScript: silverrec's (TorchRec modules) fx-traced by torchrec first, a
    user's tower (publish/byo.py, `script_directly`) and a tower without TorchRec modules scripted as
    they are."""
    if not getattr(tower, "script_directly", False) and hasattr(tower, "ebc"):
        import torchrec.fx

        tower = torchrec.fx.symbolic_trace(tower)
    return torch.jit.script(tower)


def write_rec_files(built: Built, tmp: Path, torchscript: bool = True) -> None:
    model = built.model
    features = UserFeatureSpec.from_json(built.manifest["user_features"])
    example = model_example(model, features, built.parts)
    shapes = dynamic_shapes(len(features.keys))
    with step("exporting the model (torch.export)"):
        program = export_program(model, example, shapes)
        torch.export.save(program, tmp / EXPORT_FILE)
    if built.spec.ranks:
        rank_example = (*example[:3], torch.tensor([[0, -1, 1], [2, 3, -1]], dtype=torch.int64).clamp_max(len(built.row_to_item) - 1))
        rank_dynamic = {k: shapes[k] for k in ("values", "lengths", "dense")}
        rank_dynamic["rows"] = {0: rank_dynamic["dense"][0], 1: Dim.DYNAMIC}
        with step("exporting the ranking entry point (torch.export)"):
            torch.export.save(export_program(RankEntry(model), rank_example, rank_dynamic), tmp / RANK_FILE)
    programs = {"export": program.module()}
    if torchscript:
        with step("TorchScript"):
            programs["torchscript"] = scriptable(model)
            torch.jit.save(programs["torchscript"], str(tmp / SCRIPT_FILE))
    packages = {}
    if aoti.enabled():
        with step("AOTInductor packages"):
            packages = aoti.compile_packages(model, example, shapes, tmp, export_program)
        if (package := aoti.loaded_cpu_package(packages, tmp)) is not None:
            programs["aoti"] = package
    if len(programs) > 1:
        built.manifest["backend"] = preferred_backend(programs, example)
    if packages:
        built.manifest.setdefault("backend", {})["aoti"] = packages
    arrays = {"row_to_item": built.row_to_item}
    for i, (f, (off, codes)) in enumerate(built.item_csr.items()):
        arrays[f"offsets_{i}"], arrays[f"codes_{i}"] = off, codes
    np.savez(tmp / ITEMS_FILE, **arrays)
    if built.users is not None:
        np.savez(tmp / USERS_FILE, **built.users)
