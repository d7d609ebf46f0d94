"""Checked config values and preset lookup, shared by every codec's config (``BiCodecConfig``,
``SNACConfig``, ``DACConfig``): a config file's values are plain JSON/YAML (or a checkpoint's
pickled kwargs), refused with one wording for all.

A config comes from a file anyone may hand the server, so what it may ask for is capped before a
model is built (docs/codecs.md, "Limits of a model folder"): every width, vocabulary, kernel and
rate at most ``MAX_DIM``, every list at most ``MAX_LIST`` long (the protocol's ``MAX_LEVELS``),
and a message quotes a bad value through :func:`shown`, never its whole ``repr()`` (a YAML alias
or pickle memo tree of a few bytes has a repr of gigabytes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, TypeVar

from ..protocol.layout import MAX_LEVELS

Config = TypeVar("Config")

# Every width, channel count, codebook size, kernel, rate and level of a config: 8x the largest
# a published codec uses (8192, BiCodec's codebook; 32x its widest layer, 2048).
MAX_DIM = 2**16
# Every list (rates, kernel sizes, FSQ levels, VQ strides, codebook widths) and layer count: what a
# segment header can describe (protocol.layout.MAX_LEVELS); published codecs use at most 32.
MAX_LIST = MAX_LEVELS
# An int a config may hold at all (sample rates included); larger ones are refused unread.
MAX_INT = 2**31 - 1
# Characters of a value quoted in a message, and how deep into a nested value it looks.
SHOWN_CHARS = 80
_SHOWN_DEPTH = 3


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """A bounded ``repr`` of ``value`` for a message: at most about ``limit`` characters, built
    without formatting more than that (a shared-reference tree's full repr is exponential)."""
    out: list[str] = []
    budget = [limit]

    def emit(text: str) -> bool:
        out.append(text[: max(budget[0], 0)])
        budget[0] -= len(text)
        return budget[0] > 0

    def walk(v: Any, depth: int) -> bool:
        if isinstance(v, (bool, float)) or v is None:
            return emit(repr(v))
        if isinstance(v, int):
            return emit(repr(v) if abs(v) < 10**30 else f"<an integer of {v.bit_length()} bits>")
        if isinstance(v, (str, bytes)):
            return emit(repr(v[: budget[0] + 1]))
        if isinstance(v, Mapping):
            items, opening, closing = v.items(), "{", "}"
        elif isinstance(v, (list, tuple, set, frozenset)):
            items, opening = v, "[" if isinstance(v, list) else "("
            closing = "]" if isinstance(v, list) else ")"
        else:
            return emit(f"<{type(v).__name__}>")
        if depth >= _SHOWN_DEPTH:
            return emit(f"{opening}...{closing}")
        if not emit(opening):
            return False
        for i, item in enumerate(items):
            if i and not emit(", "):
                return False
            pair = item if isinstance(v, Mapping) else None
            if pair is not None:
                if not (walk(pair[0], depth + 1) and emit(": ") and walk(pair[1], depth + 1)):
                    return False
            elif not walk(item, depth + 1):
                return False
        if isinstance(v, tuple) and len(v) == 1 and not emit(","):
            return False
        return emit(closing)

    complete = walk(value, 0)
    text = "".join(out)
    return text if complete else text[:limit] + "..."


def clipped(text: str, limit: int = 1000) -> str:
    """``text`` cut to ``limit`` characters (an error message of a library quoting a file)."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def as_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"'{key}' must be true or false, got {shown(value)}")
    return value


def as_int(key: str, value: Any) -> int:
    """An int in ``[-MAX_INT, MAX_INT]``, bools refused (YAML and JSON would make ``true`` a 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'{key}' must be an integer, got {shown(value)}")
    if abs(value) > MAX_INT:
        raise ValueError(f"'{key}' must be at most {MAX_INT}, got {shown(value)}")
    return value


def as_ints(key: str, value: Any) -> tuple[int, ...]:
    """A list of at most ``MAX_LIST`` ints as a tuple (frozen configs hold tuples)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"'{key}' must be a list of integers, got {shown(value)}")
    if len(value) > MAX_LIST:
        raise ValueError(f"'{key}' may list at most {MAX_LIST} integers, got {len(value)}")
    return tuple(as_int(key, v) for v in value)


def as_float(key: str, value: Any) -> float:
    """A number (int or float, bools refused) as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"'{key}' must be a number, got {shown(value)}")
    return float(value)


def given_fields(cls: type, mapping: Mapping[str, Any],
                 convert: Callable[[str, Any], Any]) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """The fields of the dataclass ``cls`` that ``mapping`` gives, each through ``convert(name,
    value)``, and one message for each it refuses. ``head_dim: null`` counts as not given
    (transformers' configs say so for "hidden_size / heads")."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    for f in fields(cls):
        if f.name in mapping and not (f.name == "head_dim" and mapping[f.name] is None):
            try:
                values[f.name] = convert(f.name, mapping[f.name])
            except ValueError as exc:
                problems.append(str(exc))
    return values, problems


def require_positive(values: Mapping[str, int]) -> None:
    """Raise one ValueError naming every field of ``values`` below 1."""
    bad = [f"{k}={v}" for k, v in values.items() if v < 1]
    if bad:
        raise ValueError(f"these must be >= 1: {', '.join(bad)}")


def require_at_most(values: Mapping[str, int | tuple[int, ...]], limit: int) -> None:
    """Raise one ValueError naming every field of ``values`` (an int, or a list's largest entry)
    above ``limit``: what a config may ask the model to allocate."""
    bad = []
    for k, v in values.items():
        largest = max(v, default=0) if isinstance(v, tuple) else v
        if largest > limit:
            bad.append(f"{k}={shown(v)}")
    if bad:
        raise ValueError(f"these must be at most {limit} (a model folder's limit): {', '.join(bad)}")


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
