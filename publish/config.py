"""TOML configs (`train.toml`, `publish.toml`) read into validated dataclasses, one way for all."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Sequence, TypeVar

from silverrec.errors import SilverrecError

T = TypeVar("T")


class ConfigError(SilverrecError):
    """A training or publish config is invalid (unknown key, wrong type, unknown label column)."""


def read_toml(cls: type[T], path: str | Path, path_keys: Sequence[str] = (), required: Sequence[str] = (),
              **overrides: Any) -> T:
    """`cls(**table)` from a TOML file, with named errors.

    Unknown keys are refused (naming the known ones); `path_keys` hold file paths, resolved relative
    to the config file; `overrides` that are not None replace the file's values; a missing
    `required` key or a bad value (the dataclass's own checks) is a ConfigError naming the file.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from None
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"config {path}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    for key in path_keys:
        if data.get(key) is not None and not Path(data[key]).is_absolute():
            data[key] = str((path.parent / data[key]).resolve())
    data.update({k: v for k, v in overrides.items() if v is not None})
    missing = [k for k in required if k not in data]
    if missing:
        raise ConfigError(f"config {path} names no {missing[0]}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ConfigError(f"config {path}: {e}") from None
