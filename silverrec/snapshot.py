"""The snapshot format: one directory per model version, written atomically.

    DIR/manifest.json   format version, the versions that built it (`build`: python, torch,
                        torchrec, fbgemm_gpu, silverrec), kind, config, item count, creation
                        time, and {file: {sha256, bytes}} for every other file
    DIR/model.pt2       torch.export program (dynamic batch dimension)
    DIR/model.ts        TorchScript of the same module (optional)
    DIR/model.cpu.pt2   the same program compiled by AOTInductor for the CPU (and model.cuda.pt2 for CUDA, on a
                        GPU machine): config.backend.aoti names each with the torch that built it (silverrec/aoti.py)
    DIR/tensors.pt      (pure-ANN snapshots) the programs' state tensors, stored once (torch.save,
                        loaded by mmap); the two programs then hold placeholders of the same shapes
    DIR/...             kind-specific files (a "rec" snapshot: rank.pt2, items.npz, users.npz)

`write_snapshot` builds the directory under a temporary sibling and renames it into place, so a
reader never sees a half-written snapshot. `read_manifest` verifies format version, sizes and
checksums before anything is deserialised.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from silverrec.errors import SnapshotError

# 2: filtered_ivf models take posting lists; 3: "rec" snapshots (RecModel, rank.pt2, items.npz);
# 4: one root module: the kinds "exact", "ivf" and "filtered_ivf" became RecModel configurations (config.spec)
# 5: a program's state tensors may live apart, in tensors.pt (an older reader would run the placeholders)
# 6: the search ops take the index as a tensor list and an int list (kernels/search_args.py)
# 7: one composition (silverrec/compose.py): the root module's stages are modules, its forward takes the
#    history rows and source flags, config.spec is the spec it was built from; the kind "generative"
#    became a RecModel whose only source is the decode
# 8: an AOTInductor package may be the preferred program (config.backend: "aoti"; an older reader cannot load it)
FORMAT_VERSION = 8
MIN_FORMAT_VERSION = 7  # older programs call ops, or take inputs, or hold modules, this silverrec no longer has
MANIFEST = "manifest.json"
EXPORT_FILE = "model.pt2"
SCRIPT_FILE = "model.ts"
TENSORS_FILE = "tensors.pt"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_snapshot(
    out_dir: str | os.PathLike,
    *,
    kind: str,
    config: dict[str, Any],
    item_count: int,
    write_files: Callable[[Path], None],
    overwrite: bool = False,
) -> Path:
    """Write a snapshot atomically.

    Args:
        out_dir: final directory. Must not exist unless `overwrite`.
        kind: the root module: "rec" (RecModel; config.spec is the spec it was composed from) or
            "sharded" (a top manifest); the predictor dispatches on kind and spec.
        config: JSON-serialisable description the predictor needs (dims, feature vocabularies...).
        item_count: number of items in the candidate pool.
        write_files: called with the temporary directory; writes model.pt2 / model.ts / extras.
    Returns:
        The final path.
    """
    out = Path(out_dir).resolve()
    if out.exists() and not overwrite:
        raise SnapshotError(f"{out} already exists; choose a new version directory or pass overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_files(tmp)
        files = {}
        for p in sorted(tmp.iterdir()):
            if p.is_file():
                files[p.name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        if EXPORT_FILE not in files:
            raise SnapshotError(f"snapshot writer produced no {EXPORT_FILE}")
        manifest = {
            "format_version": FORMAT_VERSION,
            "silverrec_version": _silverrec_version(),
            "torch_version": torch.__version__,
            "build": build_versions(),
            "kind": kind,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "item_count": int(item_count),
            "config": config,
            "files": files,
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory `tmp` to `out` (a sibling); an existing `out` is swapped out
    first and removed after, so a reader sees the old version or the new one, never a mix."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / "snap")
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def read_manifest(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """Read and verify a snapshot's manifest (format version, file sizes, sha256)."""
    root = Path(path)
    if not root.is_dir():
        raise SnapshotError(f"{root} is not a snapshot directory")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise SnapshotError(f"{root} has no {MANIFEST}: not a snapshot, or an unfinished write")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise SnapshotError(f"{mpath} is not valid JSON ({e.msg} at line {e.lineno})") from None
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise SnapshotError(f"{mpath} has no integer format_version")
    if version > FORMAT_VERSION:
        raise SnapshotError(
            f"snapshot {root} has format version {version}, written by silverrec "
            f"{manifest.get('silverrec_version', '?')}; this silverrec {_silverrec_version()} "
            f"reads format versions <= {FORMAT_VERSION}: upgrade silverrec"
        )
    if version < MIN_FORMAT_VERSION:
        raise SnapshotError(
            f"snapshot {root} has format version {version} (kind {manifest.get('kind')!r}); this silverrec "
            f"{_silverrec_version()} reads format versions {MIN_FORMAT_VERSION}..{FORMAT_VERSION}: since format 7 "
            "every snapshot is one recommendation model composed from its spec (the kind 'generative' became its "
            "decode-only configuration, and the model's inputs changed; format 6: the search ops' narrow "
            "interface), so re-publish it with this silverrec"
        )
    if verify:
        verify_files(root, manifest)
    return manifest


def verify_files(root: Path, manifest: dict[str, Any]) -> None:
    """Check every file the manifest lists: present, its size, its sha256 (SnapshotError if not)."""
    for name, meta in manifest.get("files", {}).items():
        p = root / name
        if not p.is_file():
            raise SnapshotError(f"snapshot {root} is missing {name}")
        size = p.stat().st_size
        if size != meta["bytes"]:
            raise SnapshotError(
                f"{p} is truncated or altered: {size} bytes, manifest says {meta['bytes']}"
            )
        digest = sha256_file(p)
        if digest != meta["sha256"]:
            raise SnapshotError(f"{p} checksum mismatch: sha256 {digest[:12]}..., manifest says {meta['sha256'][:12]}...")


# What a loader must match, by package: the major.minor of the version that built the snapshot.
# torch: the program's serialisation and operator schemas; silverrec: its own ops' schemas;
# torchrec / fbgemm_gpu (snapshots with a TorchRec user tower): the fbgemm ops in the program.
BUILD_PACKAGES = {"torch": "torch", "silverrec": "silverrec", "torchrec": "torchrec", "fbgemm_gpu": "fbgemm-gpu-cpu"}
_NEEDS_TORCHREC = ("rec",)


def needs_torchrec(manifest: dict[str, Any]) -> bool:
    """Whether a snapshot's program holds TorchRec / fbgemm ops: a recommendation model with
    silverrec's own (TorchRec) user tower. A query tower or none holds none, and a team's own
    plain-PyTorch tower (byo) needs neither package (one that does use them loads where they are
    installed)."""
    tower = manifest.get("config", {}).get("spec", {}).get("tower")
    return manifest.get("kind") in _NEEDS_TORCHREC and tower == "two_tower"


def build_versions() -> dict[str, str]:
    """The versions of Python and of BUILD_PACKAGES in this process (those installed)."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__, "silverrec": _silverrec_version()}
    for key, dist in (("torchrec", "torchrec"), ("fbgemm_gpu", "fbgemm-gpu-cpu"), ("fbgemm_gpu", "fbgemm-gpu")):
        if key not in out:
            try:
                out[key] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
    return out


def check_build(manifest: dict[str, Any], path: str | os.PathLike = "snapshot") -> list[str]:
    """Refuse a snapshot this process cannot run: SnapshotError naming the package, the version that
    built the snapshot and the one installed here, when their major.minor differ. Checks torch and
    silverrec always, torchrec and fbgemm_gpu for kinds whose program holds TorchRec modules.
    Returns what it checked (for `silverrec inspect`), e.g. ["torch 2.13.0 == 2.13.0", ...]."""
    built = dict(manifest.get("build") or {})
    built.setdefault("torch", manifest.get("torch_version"))  # format 3 snapshots before `build`
    built.setdefault("silverrec", manifest.get("silverrec_version"))
    here = build_versions()
    wanted = ["torch", "silverrec"] + (["torchrec", "fbgemm_gpu"] if needs_torchrec(manifest) else [])
    checked = []
    for pkg in wanted:
        theirs, ours = built.get(pkg), here.get(pkg)
        if theirs is None:
            continue  # not recorded by the writer: nothing to compare
        if ours is None:
            raise SnapshotError(f"snapshot {path} was built with {pkg} {theirs}, which is not installed here "
                                f"(install {BUILD_PACKAGES[pkg]}=={theirs})")
        if _major_minor(theirs) != _major_minor(ours):
            raise SnapshotError(f"snapshot {path} was built with {pkg} {theirs}; this process has {pkg} {ours}: "
                                f"{pkg} major.minor must match to load its program (checked: torch, silverrec"
                                f"{', torchrec, fbgemm_gpu' if len(wanted) > 2 else ''}). Republish it, or install "
                                f"{BUILD_PACKAGES[pkg]}=={theirs}")
        checked.append(f"{pkg} {theirs} ~ {ours}")
    return checked


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def export_program(module: torch.nn.Module, example_args: tuple, dynamic_shapes: dict[str, Any]):
    """torch.export (non-strict) with backed size-oblivious shapes.

    Without `backed_size_oblivious`, export specialises dynamic sizes and int inputs away from 0/1
    (e.g. a guard `k != 1`), so a snapshot exported with k=2 would reject k=1 or batch 1.
    Int arguments (k, nprobe) are made dynamic with `Dim.DYNAMIC`.
    """
    import torch.fx.experimental._config as fx_config

    module = module.eval()
    own_empty_buffers(module)
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(module, example_args, dynamic_shapes=dynamic_shapes, strict=False)


def own_empty_buffers(module: torch.nn.Module) -> None:
    """Give every empty buffer and parameter of `module` a fresh empty tensor, in place. An empty tensor made from
    numpy (or sliced from a larger one) has data_ptr 0 over a non-null storage; torch.export.save
    takes it for a view of that storage and computes its extent as 0 - storage_ptr ("numel:
    integer multiplication overflow"). A fresh empty tensor has a null storage and saves whole."""
    for name, buf in list(module.named_buffers()):
        if buf.numel() == 0 and buf.untyped_storage().data_ptr() != 0:
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = torch.empty(buf.shape, dtype=buf.dtype, device=buf.device)
    for name, p in list(module.named_parameters()):
        if p.numel() == 0 and p.untyped_storage().data_ptr() != 0:
            owner, _, leaf = name.rpartition(".")
            fresh = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            module.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(fresh, requires_grad=p.requires_grad)


def export_module(
    module: torch.nn.Module,
    example_args: tuple,
    dynamic_shapes: dict[str, Any],
    directory: Path,
    torchscript: bool = True,
    tensors_apart: bool = False,
    time_backends: bool = True,
    timing_args: Optional[tuple] = None,
    aoti: Optional[bool] = None,
) -> Optional[dict[str, Any]]:
    """Save `module` as model.pt2 (torch.export, non-strict), optionally model.ts, and AOTInductor packages
    (`aoti`; None: `silverrec.aoti.enabled()`); with two programs or more and `time_backends`, return
    `preferred_backend` of them on `timing_args` (default: the example), for config.backend, with the packages'
    entries under "aoti" (without timing: {"aoti": ...} alone, or None when there is nothing to record).

    tensors_apart: the module's state (buffers, parameters) goes once into tensors.pt and the
    programs hold stride-0 placeholders of the same shapes and dtypes (`load_program` puts the
    tensors back). A 1M x 96 pool's 100 MB were written twice (model.pt2 and model.ts) and
    torch.export.save alone took 0.46 s of them; the loader maps the file instead of reading it."""
    from silverrec import aoti as aot

    program = export_program(module, example_args, dynamic_shapes)
    state = dict(program.state_dict) if tensors_apart else {}
    if tensors_apart:
        torch.save(state, directory / TENSORS_FILE)
    with _swapped(program.state_dict.__setitem__, state), warnings.catch_warnings():
        # torch.export.save looks for a tensor covering each storage: a placeholder's covers one element
        warnings.filterwarnings("ignore", message="No complete tensor found in the group")
        torch.export.save(program, directory / EXPORT_FILE)
    programs: dict[str, Any] = {"export": program.module()}
    if torchscript:
        scripted = torch.jit.script(module.eval())
        with _swapped(lambda name, t: _set_path(scripted, name, t), state):
            torch.jit.save(scripted, str(directory / SCRIPT_FILE))
        programs["torchscript"] = scripted
    packages = aot.compile_packages(module, example_args, dynamic_shapes, directory, export_program) if (
        aot.enabled() if aoti is None else aoti) else {}
    if (package := aot.loaded_cpu_package(packages, directory)) is not None:
        programs["aoti"] = package
    if not time_backends or len(programs) < 2:
        return {"aoti": packages} if packages else None
    backend = preferred_backend(programs, timing_args or example_args)
    return {**backend, "aoti": packages} if packages else backend


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's shape and dtype over one element (stride 0): saved, it costs no bytes."""
    return t if t.numel() == 0 else torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)


@contextmanager
def _swapped(setter: Callable[[str, torch.Tensor], None], state: dict[str, torch.Tensor]):
    """Placeholders in place of `state`'s tensors (set by name with `setter`) for the duration."""
    for name, t in state.items():
        setter(name, _placeholder(t))
    try:
        yield
    finally:
        for name, t in state.items():
            setter(name, t)


def _set_path(module, name: str, value: torch.Tensor) -> None:
    """module.<dotted name> = value (a ScriptModule has no get_submodule)."""
    *owners, leaf = name.split(".")
    for part in owners:
        module = getattr(module, part)
    setattr(module, leaf, value)


def read_tensors(root: Path, manifest: dict[str, Any], map_location=None) -> dict[str, torch.Tensor]:
    """A snapshot's tensors.pt by name (memory-mapped); {} for a snapshot that stores none apart."""
    if TENSORS_FILE not in manifest.get("files", {}):
        return {}
    return torch.load(root / TENSORS_FILE, mmap=True, weights_only=True, map_location=map_location)


def attach_tensors(names_to_placeholders: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                   setter: Callable[[str, torch.Tensor], None], root: Path) -> None:
    """Put each stored tensor in place of its placeholder; SnapshotError if the two disagree."""
    for name, t in tensors.items():
        held = names_to_placeholders.get(name)
        if held is None or held.shape != t.shape or held.dtype != t.dtype:
            want = "nothing" if held is None else f"{tuple(held.shape)} {held.dtype}"
            raise SnapshotError(f"{root / TENSORS_FILE}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, the program holds {want}")
        setter(name, t)


def load_exported(root: Path, manifest: dict[str, Any]):
    """model.pt2 as an ExportedProgram with its state (from tensors.pt where stored apart)."""
    import silverrec.kernels  # noqa: F401  (the program's torch.ops.silverrec.* must exist before it loads)

    program = torch.export.load(root / EXPORT_FILE)
    attach_tensors(program.state_dict, read_tensors(root, manifest), program.state_dict.__setitem__, root)
    return program


def load_scripted(root: Path, manifest: dict[str, Any], map_location=None):
    """model.ts as a ScriptModule with its state (from tensors.pt where stored apart)."""
    import silverrec.kernels  # noqa: F401  (the program's torch.ops.silverrec.* must exist before it loads)

    module = torch.jit.load(str(root / SCRIPT_FILE), map_location=map_location)
    tensors = read_tensors(root, manifest, map_location)
    if tensors:
        attach_tensors(module.state_dict(), tensors, lambda name, t: _set_path(module, name, t), root)
    return module


def preferred_backend(programs: dict[str, Any], example: tuple, repeat: int = 20) -> dict[str, Any]:
    """Time each program on `example` (best of `repeat`, the programs interleaved): `load(backend="auto")` runs
    the fastest.
    The programs differ by a fixed cost per call, so a light call shows it best (a pure-ANN index's
    export example filters the whole pool: 13.6 vs 14.0 ms at 1M x 96 picked the exported program,
    whose wrapper then cost 0.19 ms more on each selective search, 0.40 against 0.21 ms). TorchScript
    was measured 2.3x faster than the exported program's Python wrapper at batch 1 on MovieLens (3.4 vs
    7.9 ms), and 1.5-2.3x on a 100k-item pure-ANN index (0.2 vs 0.5 ms)."""
    import time

    best = {name: float("inf") for name in programs}
    with torch.inference_mode():
        for fn in programs.values():
            fn(*example)
        for _ in range(repeat):  # interleaved: a slow spell of the machine costs every program alike
            for name, fn in programs.items():
                t0 = time.perf_counter()
                fn(*example)
                best[name] = min(best[name], time.perf_counter() - t0)
    preferred = min(best, key=best.get)
    return {"preferred": preferred, **{f"{k}_ms": round(v * 1e3, 3) for k, v in best.items()}}


def _silverrec_version() -> str:
    from silverrec import __version__

    return __version__
