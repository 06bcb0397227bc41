"""Bring your own model: publish a recommendation snapshot from a user's trained towers and OverArch.

    silverrec publish --config publish.toml --out DIR      (a config with a [user_tower] table)

Instead of silverrec's own checkpoint, the config names the user's modules, each in one of three
forms (`UserModule`):

    path = "user.pt2"                      a torch.export program (torch.export.save)
    path = "user.ts"                       a TorchScript file (torch.jit.save)
    entry = "package.module:factory"       a Python factory (the config's directory is on sys.path
    path = "user_state.pt"                 while importing), `args` its keyword arguments, `path`
                                           the state dict (torch.save) loaded into what it returns

Interfaces (plain tensors; the model code needs no silverrec import):

    user tower  (values int64 [nnz], lengths int32 [F * B], dense float32 [B, Fd]) -> [B, D] | [B, T, D]
                a KeyedJaggedTensor's flat tensors, keys in this order (key-major, as KJT stores them):
                    hist_item      the user's last `history_len` items, oldest first
                    recent_item    the last `recent_len` of them
                    hist_<f>       value codes of item feature f of the history items (f in item_features)
                    user_<g>       value codes of categorical user feature g (g in user_features)
                items as `item_ids` says: "item_id" (the ids of items.parquet) or "pool_row" (their
                position in items.parquet); a value code is the value's position in its vocabulary + 1
                (0 = a value unknown to the vocabulary). dense: [log1p(history length), each numeric
                user feature standardised with its (mean, std)].
    item tower  (values int64 [nnz], lengths int32 [F * N], dense float32 [N, Fd]) -> [N, D]
                keys: "item" (id or pool row, one per item), then each of its item_features' codes;
                dense: its `dense` numeric item columns as they are. Run over the pool at publish in
                batches of `batch` (the last batch padded to full size), or, with no [item_tower],
                the items file's `embedding` column is used.
    OverArch    (user [B, T, D], cand [B, K, D], feats [B, K, F]) -> scores [B, K] | [B, K, T]
                (with `mask = true` a fourth argument, valid bool [B, K], False = padding slot:
                a list-wise model must keep padding out of its attention). feats: the `item_dense`
                columns of the items file (the embedding cache's features; the value model reads them
                by name). A [B, K] score stands for every task.

Vocabularies: the `vocab` JSON file ({"item_features": {f: [values]}, "user_features": {g: [...]},
"user_numeric": {g: [mean, std]}}: what the model was trained with); a feature it does not list
gets its values sorted (strings) from the data, a numeric one the users' mean and std.

Everything is checked at publish by running it (each module on a sample request built from the
logs, named errors for a bad shape, dtype or NaN) and exported into the one program with the rest
(silverrec/adapters.py gives the user's modules RecModel's interfaces). A module
torch.export cannot trace gets a `ByoError` naming the module and the first failing line of its
code; nothing is written. TorchScript (model.ts) is written where every module scripts (a
torch.export program cannot be scripted: the manifest's `torchscript` says why it was skipped).
A TorchScript item tower runs at publish only; a TorchScript user tower or OverArch would have to
go into model.pt2 too, and torch.export cannot trace a ScriptModule (torch's converter,
`TS2EPConverter`, was seen to specialise the batch size or fail on `prim::If`): a named error asks
for a .pt2 program or an entry point instead.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor, nn
from torch.export import Dim

import silverrec
from silverrec.publish.config import ConfigError, read_toml
from silverrec.publish.filtered_ivf import DYNAMIC as FILTER_DYNAMIC, build_filtered_ivf, pool_rows
from silverrec.publish.ivf import IVFConfig
from silverrec.publish.logs import Logs, read_logs
from silverrec.publish.pool import Pool, pool_from_table
from silverrec.publish.progress import bar, step
from silverrec.publish.calibrate import choose_nprobe
from silverrec.publish.rec import (PublishConfig, _bytes_per_item, compose_checked, record_composition, serving_config,
                                   value_formula)
from silverrec.publish.rec_files import Built, write_rec_files
from silverrec.compose import ModelParts
from silverrec.ranking.cache import EmbeddingCache
from silverrec.adapters import MaskedOverArchAdapter, OverArchAdapter, UserTowerAdapter
from silverrec.filtering.filter_program import FilterPlan
from silverrec.spec import ModelSpec
from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec, _csr, gather_csr
from silverrec.snapshot import export_program, write_snapshot

ITEM_INPUTS = ("item_id", "pool_row")
SAMPLE_USERS = 64


class ByoError(ConfigError):
    """A user's module cannot be loaded, run on a sample request, or exported (names the module)."""


@dataclass
class UserModule:
    """A user's trained module in one of the three forms (module docstring).

    role: what it is, for messages ("user tower", "item tower", "OverArch").
    path: the .pt2 / TorchScript file, or the entry point's state dict (optional for an entry point).
    entry: "package.module:factory"; args: the factory's keyword arguments.
    base: the directory relative paths and the entry point's package are found in.
    """

    role: str
    path: str = ""
    entry: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    base: str = "."

    def __post_init__(self):
        if not self.path and not self.entry:
            raise ByoError(f"{self.role}: give `path` (a .pt2 or TorchScript file) or `entry` (package.module:factory)")
        if self.entry and (self.entry.count(":") != 1 or not all(self.entry.split(":"))):
            raise ByoError(f"{self.role}: entry must be 'package.module:factory', got {self.entry!r}")

    @property
    def form(self) -> str:
        """"entry", "export" (.pt2) or "torchscript"."""
        if self.entry:
            return "entry"
        return "export" if self.path.endswith(".pt2") else "torchscript"

    @property
    def file(self) -> Optional[Path]:
        return (Path(self.base) / self.path).resolve() if self.path else None

    @property
    def source(self) -> str:
        return f"{self.role} ({self.entry + ' + ' if self.entry else ''}{self.path or 'no state dict'})"

    def load(self) -> nn.Module:
        """The module, ready to run (an entry point's module in eval mode)."""
        if self.file is not None and not self.file.is_file():
            raise ByoError(f"{self.source}: file {self.file} does not exist")
        try:
            if self.form == "export":
                return torch.export.load(self.file).module()
            if self.form == "torchscript":
                return torch.jit.load(str(self.file)).eval()
            module_name, factory = self.entry.split(":")
            sys.path.insert(0, str(Path(self.base).resolve()))
            try:
                made = getattr(importlib.import_module(module_name), factory)(**self.args)
            finally:
                sys.path.pop(0)
            if not isinstance(made, nn.Module):
                raise ByoError(f"{self.source}: {self.entry} returned {type(made).__name__}, not a torch.nn.Module")
            if self.file is not None:
                made.load_state_dict(torch.load(self.file, map_location="cpu", weights_only=True))
            return made.eval()
        except ByoError:
            raise
        except Exception as e:
            raise ByoError(f"cannot load {self.source} as {self.form}: {type(e).__name__}: {e}") from e


# ------------------------------------------------------------------------------------------------
# Config


@dataclass
class ByoConfig(PublishConfig):
    """publish.toml for a user's own modules: PublishConfig's retrieval / ranking keys, plus

    items / interactions / users: the generic logs (publish/logs.py); the pool is items.parquet.
    vocab: JSON file of the vocabularies the towers were trained with (module docstring).
    user_tower: {path | entry + args + path, history_len, recent_len, item_features, user_features,
        numeric, item_ids}.
    item_tower: {path | entry..., item_features, dense, item_ids, batch}; None: items.parquet's
        `embedding` column.
    overarch: {path | entry..., mask}, or None (the exact re-score ranks).
    item_dense: numeric item columns kept in the cache (OverArch features, value-model terms).
    task_names: names of the user tower's T tasks (default "task0", ...).
    """

    checkpoint: str = ""
    overarch: Any = None
    items: str = ""
    interactions: str = ""
    users: Optional[str] = None
    vocab: Optional[str] = None
    user_tower: Optional[dict[str, Any]] = None
    item_tower: Optional[dict[str, Any]] = None
    item_dense: list[str] = field(default_factory=list)
    task_names: Optional[list[str]] = None
    base: str = "."

    def __post_init__(self):
        super().__post_init__()
        for key in ("items", "interactions", "user_tower"):
            if not getattr(self, key):
                raise ConfigError(f"a bring-your-own-model config needs `{key}`")
        if self.checkpoint:
            raise ConfigError("give either `checkpoint` (silverrec's own towers) or [user_tower], not both")
        if self.sources != ["ann"]:
            raise ConfigError("sources other than 'ann' are not supported with a user's towers yet (publish/byo.py)")
        if self.overarch is not None and not isinstance(self.overarch, dict):
            raise ConfigError(f"[overarch] must name a user's module (a table), got {self.overarch!r}")
        self.user = _module_spec("user tower", self.user_tower, self.base, USER_KEYS)
        self.item = _module_spec("item tower", self.item_tower, self.base, ITEM_KEYS) if self.item_tower else None
        self.arch = _module_spec("OverArch", self.overarch, self.base, ARCH_KEYS) if self.overarch else None
        for spec, table in ((self.user, self.user_tower), (self.item, self.item_tower)):
            if spec is not None and table.get("item_ids", "item_id") not in ITEM_INPUTS:
                raise ConfigError(f"{spec.role}: item_ids must be one of {ITEM_INPUTS}, got {table['item_ids']!r}")

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> "ByoConfig":
        base = str(Path(path).resolve().parent)
        return read_toml(cls, path, path_keys=("items", "interactions", "users", "vocab"), base=base, **overrides)


MODULE_KEYS = ("path", "entry", "args")
USER_KEYS = MODULE_KEYS + ("history_len", "recent_len", "item_features", "user_features", "numeric", "item_ids")
ITEM_KEYS = MODULE_KEYS + ("item_features", "dense", "item_ids", "batch")
ARCH_KEYS = MODULE_KEYS + ("mask",)


def _module_spec(role: str, table: dict[str, Any], base: str, known: tuple[str, ...]) -> UserModule:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"[{role}]: unknown key {unknown[0]!r} (known: {', '.join(known)})")
    return UserModule(role, str(table.get("path", "")), str(table.get("entry", "")), dict(table.get("args", {})), base)


def is_byo_config(path: str | Path) -> bool:
    """Whether a publish.toml names a user's towers (a [user_tower] table)."""
    import tomllib

    try:
        return "user_tower" in tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False  # PublishConfig.from_toml names the problem


# ------------------------------------------------------------------------------------------------
# Running the modules at publish


def _first_failing_line(e: BaseException) -> str:
    """Where the user's code failed, as 'file:line `code`': the innermost traceback frame outside
    torch and silverrec along the exception chain, else the last user-code line torch.export's
    message quotes ('File "f.py", line 12, in forward'), else the message's first line."""
    torch_dir = str(Path(torch.__file__).parent)
    ours = tuple(str(Path(m.__file__).resolve().parent) + "/" for m in (sys.modules[__name__], silverrec))

    def user_code(filename: str) -> bool:
        return not filename.startswith((torch_dir, *ours, "<")) and "site-packages" not in filename

    chain, x = [], e
    while x is not None and x not in chain:
        chain.append(x)
        x = x.__cause__ or x.__context__
    for x in chain:
        frames = [f for f in traceback.extract_tb(x.__traceback__) if user_code(f.filename)]
        if frames:
            return f"{Path(frames[-1].filename).name}:{frames[-1].lineno} `{(frames[-1].line or '').strip()}`"
    quoted = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)', str(e))  # "The following call raised ..."
    quoted = [m for m in quoted + re.findall(r"File: (\S+):(\d+) in \w+, code: (.*)", str(e)) if user_code(m[0])]
    if quoted:
        return f"{Path(quoted[-1][0]).name}:{quoted[-1][1]} `{quoted[-1][2].strip()}`"
    return _first_line(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _run(what: str, fn, *args):
    """fn(*args) with a ByoError naming `what` and the failing line."""
    try:
        with torch.no_grad():
            return fn(*args)
    except ByoError:
        raise
    except Exception as e:
        raise ByoError(f"{what} failed on a sample request at {_first_failing_line(e)}: "
                       f"{type(e).__name__}: {_first_line(e)}") from e


def _check_output(what: str, out: Any, shapes: list[tuple], names: str) -> Tensor:
    """out must be a finite float tensor whose shape is one of `shapes` (None = any size)."""
    if not isinstance(out, Tensor) or not out.is_floating_point():
        raise ByoError(f"{what} must return a float tensor {names}, got {getattr(out, 'dtype', type(out).__name__)}")
    if not any(len(s) == out.dim() and all(a is None or a == b for a, b in zip(s, out.shape)) for s in shapes):
        raise ByoError(f"{what} returned shape {tuple(out.shape)}: expected {names}")
    if not bool(torch.isfinite(out).all()):
        raise ByoError(f"{what} returned NaN or Inf on a sample request")
    return out


def check_exportable(user: UserModule, module: nn.Module, example: tuple, dynamic: dict[str, Any]) -> None:
    """torch.export `module` (the adapter around `user`'s module) alone, non-strict with a dynamic
    batch, as the snapshot's export will: ByoError naming the module and the first failing line of
    the user's code."""
    what = user.source
    if user.form == "torchscript":
        raise ByoError(f"{what} is TorchScript, which torch.export cannot trace into the snapshot's program "
                       "(model.pt2): give it as a torch.export program (.pt2) or a package.module:factory entry point")
    try:
        export_program(module, example, dynamic)
    except Exception as e:
        guard = next((line.strip(" -") for line in str(e).splitlines() if "Not all values of" in line), None)
        if guard is not None:  # a shape guard, not an untraceable op
            raise ByoError(f"{what} cannot be exported with a dynamic batch: its code specialises the batch size "
                           f"({guard}). Python branches on a shape do this, and so does a 4-D "
                           "scaled_dot_product_attention whose mask is broadcast over the heads on torch < 2.13 "
                           "(fold the batch into the heads there: silverrec/attention.py)") from e
        raise ByoError(f"{what} cannot be exported with torch.export: the first failing op is at "
                       f"{_first_failing_line(e)} ({type(e).__name__}: {_first_line(e)}); make it traceable "
                       "(no data-dependent Python control flow, no .item() / .tolist() / numpy)") from e


def torchscript_problem(modules: list[tuple[UserModule, nn.Module]]) -> Optional[str]:
    """None when every module (an adapter around a user's module) scripts, else why the snapshot
    gets no model.ts."""
    for user, m in modules:
        what = user.source
        if user.form == "export":
            return f"{what} is a torch.export program, which TorchScript cannot hold"
        try:
            torch.jit.script(m)
        except Exception as e:
            return f"{what} does not script ({type(e).__name__} at {_first_failing_line(e)})"
    return None


class _Score(nn.Module):
    """`OverArchAdapter.score` as a forward, for its export check."""

    def __init__(self, arch: OverArchAdapter):
        super().__init__()
        self.arch = arch

    def train(self, mode: bool = True) -> "_Score":
        self.training = mode
        return self

    def forward(self, user: Tensor, cand: Tensor, item: Tensor, valid: Tensor) -> Tensor:
        return self.arch.score(user, cand, item, valid)


# ------------------------------------------------------------------------------------------------
# Inputs


def _vocabularies(cfg: ByoConfig, logs: Logs) -> dict[str, dict]:
    """{"item_features": {f: values}, "user_features": {g: values}, "user_numeric": {g: (mean, std)}}."""
    given: dict[str, dict] = {}
    if cfg.vocab:
        try:
            given = json.loads(Path(cfg.vocab).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read vocab {cfg.vocab}: {e}") from None

    def categorical(kind: str, names: list[str], columns: dict[str, list[list[str]]], where: str) -> dict:
        for f in names:
            if f not in columns:
                raise ConfigError(f"{kind[:-1].replace('_', ' ')} {f!r} is not a categorical column of {where} "
                                  f"(it has {sorted(columns) or 'none'})")
        return {f: list(given.get(kind, {}).get(f) or sorted({v for vals in columns[f] for v in vals})) for f in names}

    item_names = list(cfg.user_tower.get("item_features", [])) + list((cfg.item_tower or {}).get("item_features", []))
    out: dict[str, dict] = {
        "item_features": categorical("item_features", list(dict.fromkeys(item_names)), logs.item_features,
                                     Path(cfg.items).name),
        "user_features": categorical("user_features", list(cfg.user_tower.get("user_features", [])),
                                     logs.user_features, "the users file"),
        "user_numeric": {},
    }
    for g in cfg.user_tower.get("numeric", []):
        if g not in logs.user_numeric:
            raise ConfigError(f"numeric user feature {g!r} is not a numeric column of the users file "
                              f"(it has {sorted(logs.user_numeric) or 'none'})")
        x = logs.user_numeric[g]
        out["user_numeric"][g] = tuple(given.get("user_numeric", {}).get(g) or (float(x.mean()), float(x.std()) or 1.0))
    return out


def item_inputs(kind: str, logs: Logs) -> np.ndarray:
    """int64 [N] what a tower reads for each pool row: its item id or the row itself."""
    return logs.item_ids.astype(np.int64) if kind == "item_id" else np.arange(logs.num_items, dtype=np.int64)


def _numeric_columns(logs: Logs, names: list[str], where: str) -> np.ndarray:
    """float32 [N, len(names)] numeric item columns."""
    for f in names:
        if f not in logs.item_numeric:
            raise ConfigError(f"{where}: {f!r} is not a numeric column of the items file "
                              f"(it has {sorted(logs.item_numeric) or 'none'})")
    cols = [logs.item_numeric[f].astype(np.float32)[:, None] for f in names]
    return np.concatenate(cols, axis=1) if cols else np.zeros((logs.num_items, 0), np.float32)


@torch.no_grad()
def run_item_tower(cfg: ByoConfig, logs: Logs, vocabs: dict) -> np.ndarray:
    """float32 [N, D] item embeddings in pool order: the item tower over the pool in batches, or the
    items file's `embedding` column."""
    if cfg.item is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        name = Path(cfg.items).name
        try:
            table = pq.read_table(cfg.items, columns=["item_id", "embedding"])
        except (pa.ArrowInvalid, KeyError):
            raise ConfigError(f"the config has no [item_tower] and {name} has no `embedding` column to use instead") from None
        pool = pool_from_table(table, name)  # PoolError names a NaN, ragged or missing embedding
        if not np.array_equal(pool.item_ids, logs.item_ids):
            raise ConfigError(f"{Path(cfg.items).name}: the embedding column's ids are not in the items' order")
        return pool.embeddings.astype(np.float32)
    t = cfg.item_tower
    module = cfg.item.load()
    feats = list(t.get("item_features", []))
    csr = {f: _csr(logs.item_features[f], vocabs["item_features"][f]) for f in feats}
    ids = item_inputs(t.get("item_ids", "item_id"), logs)
    dense = torch.from_numpy(_numeric_columns(logs, list(t.get("dense", [])), "item tower dense"))
    n, batch = logs.num_items, int(t.get("batch", 4096))
    if batch < 1:
        raise ConfigError(f"item tower batch must be >= 1, got {batch}")
    out = []
    with bar(n, "item tower over the pool") as pbar:
        for start in range(0, n, batch):
            rows = np.arange(start, start + batch).clip(max=n - 1)  # the last batch padded to full size
            values = [ids[rows]] + [gather_csr(*csr[f], rows)[0] for f in feats]
            lengths = [np.ones(len(rows), np.int64)] + [gather_csr(*csr[f], rows)[1] for f in feats]
            args = (torch.from_numpy(np.concatenate(values)), torch.from_numpy(np.concatenate(lengths).astype(np.int32)),
                    dense[torch.from_numpy(rows)])
            emb = _run(cfg.item.source, module, *args)
            _check_output(cfg.item.source, emb, [(len(rows), None)], f"[N={len(rows)}, D]")
            out.append(emb[: min(batch, n - start)].float())
            pbar.update(min(batch, n - start))
    return torch.cat(out).numpy()


def _sample(logs: Logs, perm_inv: np.ndarray, n: int = SAMPLE_USERS) -> list[np.ndarray]:
    """Histories (canonical rows) of up to n users of the logs: the sample request."""
    return [perm_inv[logs.user_items(u)] for u in range(min(n, logs.num_users))]


# ------------------------------------------------------------------------------------------------
# Build and publish


def build_byo_model(cfg: ByoConfig) -> Built:
    """Compose the RecModel a bring-your-own-model config describes, every module checked on a
    sample request and for export."""
    logs = read_logs(cfg.interactions, cfg.items, cfg.users, seed=cfg.seed)
    vocabs = _vocabularies(cfg, logs)
    emb = run_item_tower(cfg, logs, vocabs)
    n, dim = emb.shape
    pool = Pool(logs.item_ids, emb, dict(logs.item_features))
    index, manifest = build_filtered_ivf(pool, IVFConfig(nlist=cfg.nlist, seed=cfg.seed))
    perm = pool_rows(pool, index.row_to_item).numpy()  # canonical row -> pool row
    perm_inv = np.empty_like(perm)
    perm_inv[perm] = np.arange(n)
    dense = _numeric_columns(logs, list(cfg.item_dense), "item_dense")
    cache = EmbeddingCache(torch.from_numpy(emb[perm]), torch.from_numpy(dense[perm]), list(cfg.item_dense))

    t = cfg.user_tower
    spec = UserFeatureSpec(num_items=n, history_len=int(t.get("history_len", 50)), recent_len=int(t.get("recent_len", 5)),
                           item_vocabs={f: vocabs["item_features"][f] for f in t.get("item_features", [])},
                           user_vocabs=vocabs["user_features"], user_numeric=vocabs["user_numeric"])
    item_csr = {f: _csr([logs.item_features[f][p] for p in perm.tolist()], spec.item_vocabs[f]) for f in spec.item_vocabs}
    encoder = FeatureEncoder.from_arrays(spec, item_csr)
    user_input = torch.from_numpy(item_inputs(t.get("item_ids", "item_id"), logs)[perm])
    user = UserTowerAdapter(cfg.user.load(), user_input)
    sample = encoder.encode(_sample(logs, perm_inv))
    B = sample[2].shape[0]
    _check_output(cfg.user.source, _run(cfg.user.source, user.module, user.user_values(*sample), *sample[1:]),
                  [(B, dim), (B, None, dim)], f"[B, D] or [B, T, D] with D = {dim} (the item embeddings' width)")
    u = _run(cfg.user.source, user, *sample)  # [B, T, D]
    tasks = list(cfg.task_names or ([f"task{i}" for i in range(u.shape[1])] if u.shape[1] > 1 else ["score"]))
    if len(tasks) != u.shape[1]:
        raise ConfigError(f"task_names lists {len(tasks)} names, the user tower gives {u.shape[1]} embeddings")
    batch = FILTER_DYNAMIC["queries"][0]
    check_exportable(cfg.user, user, sample, {"values": {0: Dim.DYNAMIC}, "lengths": {0: len(spec.keys) * batch},
                                                      "dense": {0: batch}})

    arch = None
    if cfg.arch is not None:
        cls = MaskedOverArchAdapter if cfg.overarch.get("mask", False) else OverArchAdapter
        arch = cls(cfg.arch.load(), dim, cache.feats.shape[1], len(tasks))
        K = min(7, n)
        rows = torch.from_numpy(np.stack([np.arange(K), (np.arange(K) + 1) % n]))[:B]
        cand, feats = cache.gather(rows)
        users = u[: rows.shape[0]]
        item = arch.item_side(cand, feats)
        valid = torch.ones(rows.shape, dtype=torch.bool)
        _check_output(cfg.arch.source, _run(cfg.arch.source, arch.score, users, cand, item, valid),
                      [(rows.shape[0], K, len(tasks))], f"[B, K] or [B, K, T] with T = {len(tasks)}")
        dyn = {"user": {0: batch}, "cand": {0: batch, 1: Dim.DYNAMIC}, "item": {0: batch, 1: Dim.DYNAMIC},
               "valid": {0: batch, 1: Dim.DYNAMIC}}
        check_exportable(cfg.arch, _Score(arch), (users, cand, item, valid), dyn)

    if cfg.nprobe is not None:
        manifest["default_nprobe"] = int(cfg.nprobe)
    else:
        manifest["default_nprobe"], manifest["calibration"] = choose_nprobe(
            index, u.reshape(-1, dim), cache.emb.float(), cfg.k0, cfg.min_recall)
    manifest["search"]["default_max_probe"] = max(int(manifest["default_nprobe"]), manifest["search"]["default_max_probe"])
    parts = ModelParts(user_tower=user, index=index, cache=cache, overarch=arch)
    extra: dict[str, Any] = {}
    if cfg.filter_template is not None:
        parts.filter_plan, parts.user_features = FilterPlan.from_config(manifest["filter"]), spec
        extra.update(template=cfg.filter_template, template_values=int(cfg.template_values))
    # a masked OverArch is list-wise: the predictor caps `rank` lists for it
    kind = None if arch is None else "listwise" if cfg.overarch.get("mask", False) else "user"
    model_spec = ModelSpec("byo", dim, index.nlist, tuple(tasks), cache=True, overarch=kind,
                           value_model=value_formula(cfg.value_model), merge=cfg.merge, overfetch=int(cfg.overfetch),
                           candidates=int(cfg.candidates), **extra)
    model = compose_checked(model_spec, parts)
    record_composition(manifest, model)
    modules = [(cfg.user, user)] + ([(cfg.arch, arch)] if arch is not None else [])
    manifest.update({
        **serving_config(cfg, spec, cache),
        "user_modules": {m.role: {"form": m.form, "source": m.source} for m in (cfg.user, cfg.item, cfg.arch) if m},
        "torchscript": torchscript_problem(modules) if cfg.torchscript else "not requested",
        "bytes_per_item": _bytes_per_item(parts, model, n),
    })
    users = {"user_ids": logs.user_ids.copy(), "offsets": logs.offsets.copy(), "item_ids": logs.item_ids[logs.items]}
    return Built(model, model_spec, parts, manifest, index.row_to_item.to(torch.int64).numpy(), item_csr, users)


def publish_byo(cfg: ByoConfig, out: str | Path, overwrite: bool = False) -> Path:
    """Build and write a recommendation snapshot from a user's modules, atomically (nothing is left
    behind when a module fails to load, run or export)."""
    built = build_byo_model(cfg)
    config = {k: v for k, v in asdict(cfg).items() if k not in ("base",)}
    built.manifest["publish_config"] = json.loads(json.dumps(config, default=str))
    built.manifest["item_feature_order"] = list(built.item_csr)
    script = built.manifest["torchscript"] is None
    with step("writing the snapshot"):
        return write_snapshot(out, kind="rec", config=built.manifest, item_count=len(built.row_to_item),
                              write_files=lambda tmp: write_rec_files(built, tmp, script), overwrite=overwrite)
