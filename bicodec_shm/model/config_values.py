"""Checked config values and preset lookup, shared by every codec's config (``BiCodecConfig``,
``SNACConfig``): a config file's values are plain JSON/YAML, refused with one wording for all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

Config = TypeVar("Config")


def as_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"'{key}' must be true or false, got {value!r}")
    return value


def as_int(key: str, value: Any) -> int:
    """An int, bools refused (YAML and JSON would make ``true`` a 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'{key}' must be an integer, got {value!r}")
    return value


def as_ints(key: str, value: Any) -> tuple[int, ...]:
    """A list of ints as a tuple (frozen configs hold tuples)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"'{key}' must be a list of integers, got {value!r}")
    return tuple(as_int(key, v) for v in value)


def require_positive(values: Mapping[str, int]) -> None:
    """Raise one ValueError naming every field of ``values`` below 1."""
    bad = [f"{k}={v}" for k, v in values.items() if v < 1]
    if bad:
        raise ValueError(f"these must be >= 1: {', '.join(bad)}")


def plain(value: Any) -> Any:
    """A config value as the file has it: tuples back to lists."""
    return list(value) if isinstance(value, tuple) else value


def from_preset(cls: type[Config], presets: Mapping[str, Mapping[str, Any]], name: str) -> Config:
    """``cls.from_dict(presets[name])``; raises ValueError naming the known presets."""
    try:
        mapping = presets[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(presets)}") from None
    return cls.from_dict(mapping)  # type: ignore[attr-defined]


def as_config(cfg: Any, cls: type[Config]) -> Config:
    """A ``cls`` as is, a preset name (``cls.preset``) or a mapping (``cls.from_dict``)."""
    if isinstance(cfg, cls):
        return cfg
    if isinstance(cfg, str):
        return cls.preset(cfg)  # type: ignore[attr-defined]
    if isinstance(cfg, Mapping):
        return cls.from_dict(cfg)  # type: ignore[attr-defined]
    raise TypeError(f"cfg must be a {cls.__name__}, a mapping or a preset name, got {type(cfg)}")
