"""Every codec's checkpoint plumbing: weight norm in the forms upstream saves, and the checks of a
state dict against a model.

A weight-normalised convolution ``NAME`` may be stored in any of three forms (``FORMS``)::

    "weight_norm"       NAME.weight_g (d0, 1, 1)  and NAME.weight_v (= weight shape)
    "parametrizations"  NAME.parametrizations.weight.original0 (g)  and  ...original1 (v)
    "folded"            NAME.weight

``w = g · v / ‖v‖``, the norm taken over every dim but 0 (output channels for Conv1d, input
channels for ConvTranspose1d). Loading folds once; the model only ever holds plain weights.
Keys the decode path does not use (encoder, postnet, ...) are ignored. Each codec's
``checkpoint.py`` reads its own folder layout through these.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from ..errors import CheckpointError
from .modules import WNConv1d, WNConvTranspose1d

Form = Literal["weight_norm", "parametrizations", "folded"]


FORMS: tuple[Form, ...] = ("weight_norm", "parametrizations", "folded")


_SUFFIXES: dict[Form, tuple[str, ...]] = {
    "weight_norm": ("weight_g", "weight_v"),
    "parametrizations": ("parametrizations.weight.original0", "parametrizations.weight.original1"),
    "folded": ("weight",),
}


Config = TypeVar("Config")


_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


_DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}


def weight_norm_prefixes(model: nn.Module) -> frozenset[str]:
    """Names of the modules that checkpoints store weight-normalised (``decoder.model.0``, ...)."""
    return frozenset(
        name for name, m in model.named_modules() if isinstance(m, (WNConv1d, WNConvTranspose1d))
    )


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``g · v / ‖v‖``, norm over all dims but 0: g (d0, 1, ...), v (d0, ...) -> (d0, ...).

    Computed in float64; the result is float32 or wider.
    """
    v64 = v.double()
    norm = v64.flatten(1).norm(dim=1).clamp_min(1e-300).view(-1, *([1] * (v.dim() - 1)))
    dtype = torch.promote_types(v.dtype, torch.float32)
    return (g.double().reshape(norm.shape) * v64 / norm).to(dtype)


def split_weight_norm(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A folded weight w (d0, ...) -> (g (d0, 1, ...), v = w), so that folding gives w back."""
    g = w.double().flatten(1).norm(dim=1).view(-1, *([1] * (w.dim() - 1)))
    return g.to(w.dtype), w.clone()


def convert_state_dict(
    state_dict: Mapping[str, torch.Tensor], wn_prefixes: frozenset[str], form: Form
) -> dict[str, torch.Tensor]:
    """Re-express a folded state dict with its weight-normalised weights in ``form``."""
    if form not in FORMS:
        raise ValueError(f"unknown weight-norm form {form!r}; expected one of {FORMS}")
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        prefix = key.removesuffix(".weight")
        if prefix == key or prefix not in wn_prefixes or form == "folded":
            out[key] = value
            continue
        g_key, v_key = _SUFFIXES[form]
        out[f"{prefix}.{g_key}"], out[f"{prefix}.{v_key}"] = split_weight_norm(value)
    return out


def existing_folder(path: str | os.PathLike[str]) -> Path:
    """``path`` if it is a folder, its parent if it is a file; CheckpointError if neither."""
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"{folder}: no such file or directory")
    return folder.parent if folder.is_file() else folder


def read_config_file(file: Path, parse: Callable[[str], Any], language: str,
                     parse_errors: tuple[type[Exception], ...],
                     build: Callable[[Any], Config]) -> Config:  # fmt: skip
    """``build(parse(text of file))``; a file ``parse`` cannot read, or a ValueError of ``build``
    (the config's own checks), is a CheckpointError naming ``file``."""
    try:
        doc = parse(file.read_text(encoding="utf-8"))
    except (*parse_errors, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid {language}: {exc}") from exc
    try:
        return build(doc)
    except ValueError as exc:
        raise CheckpointError(f"{file}: {exc}") from exc


def read_state_dict(file: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """Load the tensors ``model`` needs from a safetensors file, folding weight norm.

    Every decode-path key is checked before any tensor is read; one CheckpointError lists every
    key that is missing, of the wrong shape, or not floating point.
    """
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            meta = {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in slices.items()}
            plan = _plan(meta, model, file)
            tensors = {k: f.get_tensor(k) for keys in plan.values() for k in keys}
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise CheckpointError(f"{file}: cannot read safetensors: {exc}") from exc
    return _fold(plan, tensors)


def fold_state_dict(
    tensors: Mapping[str, torch.Tensor], model: nn.Module, source: Path
) -> dict[str, torch.Tensor]:
    """The state dict ``model`` needs from ``tensors`` (a loaded checkpoint), weight norm folded.

    Same checks as :func:`read_state_dict`: one CheckpointError, naming ``source``, lists every
    decode-path key that is missing, of the wrong shape, or not floating point.
    """
    meta = {k: (tuple(t.shape), _DTYPE_NAMES.get(t.dtype, str(t.dtype))) for k, t in tensors.items()}
    return _fold(_plan(meta, model, source), tensors)


def _fold(
    plan: Mapping[str, tuple[str, ...]], tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    return {
        name: fold_weight_norm(*(tensors[k] for k in keys)) if len(keys) == 2 else tensors[keys[0]]
        for name, keys in plan.items()
    }


def _plan(
    meta: Mapping[str, tuple[tuple[int, ...], str]], model: nn.Module, file: Path
) -> dict[str, tuple[str, ...]]:
    """For each model key, the stored key(s) to read; raises CheckpointError listing problems."""
    wn = weight_norm_prefixes(model)
    missing: list[str] = []
    bad: list[str] = []
    plan: dict[str, tuple[str, ...]] = {}
    for name, ref in model.state_dict().items():
        prefix = name.removesuffix(".weight")
        if prefix != name and prefix in wn:
            g_shape = (ref.shape[0],) + (1,) * (ref.dim() - 1)
            forms = [
                tuple(f"{prefix}.{suffix}" for suffix in _SUFFIXES[form])
                for form in ("folded", "weight_norm", "parametrizations")
            ]
            # The first form with any key present; with none, report the weight_g/weight_v pair.
            keys = next((k for k in forms if any(key in meta for key in k)), forms[1])
            shapes = [tuple(ref.shape)] if len(keys) == 1 else [g_shape, tuple(ref.shape)]
        else:
            keys, shapes = (name,), [tuple(ref.shape)]
        for key, shape in zip(keys, shapes, strict=True):
            if key not in meta:
                missing.append(key)
            elif meta[key][0] != shape:
                bad.append(f"{key}: expected {shape}, got {meta[key][0]}")
            elif meta[key][1] not in _FLOAT_DTYPES:
                bad.append(f"{key}: expected a floating-point tensor, got dtype {meta[key][1]}")
        plan[name] = keys
    if missing or bad:
        lines = [f"  missing: {k}" for k in missing] + [f"  wrong: {b}" for b in bad]
        note = ""
        if any(k.endswith(("weight_g", "weight_v")) for k in missing):
            note = (
                "\n(a weight-normalised NAME may instead be stored as "
                "NAME.parametrizations.weight.original0/1 or as a folded NAME.weight)"
            )
        raise CheckpointError(
            f"{file} does not fit its config: {len(missing)} decode-path tensor(s) missing, "
            f"{len(bad)} of the wrong shape or dtype:\n" + "\n".join(lines) + note
        )
    return plan


def export_state_dict(model: nn.Module, form: Form) -> dict[str, torch.Tensor]:
    """``model``'s weights as contiguous CPU copies, its weight-normalised ones in ``form``."""
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    return convert_state_dict(state, weight_norm_prefixes(model), form)
