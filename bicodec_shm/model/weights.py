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

A model folder may come from anyone, so nothing it asks for is allocated before the file is
shown to hold it: ``from_pretrained`` builds the model on the meta device
(:func:`meta_model`, shapes without memory), checks every decode-path tensor's shape and dtype
in the file against it (:func:`read_state_dict`, :func:`fold_state_dict`), and only then builds
the real model. A config file is at most ``MAX_CONFIG_BYTES``, a pickle (``.pth``, ``.bin``) at
most ``MAX_PICKLE_BYTES``, and every message quotes the file through a bounded form.
"""

from __future__ import annotations

import itertools
import os
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import CheckpointError
from .config_values import clipped, shown
from .modules import WNConv1d, WNConvTranspose1d

Form = Literal["weight_norm", "parametrizations", "folded"]


FORMS: tuple[Form, ...] = ("weight_norm", "parametrizations", "folded")


_SUFFIXES: dict[Form, tuple[str, ...]] = {
    "weight_norm": ("weight_g", "weight_v"),
    "parametrizations": ("parametrizations.weight.original0", "parametrizations.weight.original1"),
    "folded": ("weight",),
}


Config = TypeVar("Config")

# A published config.yaml / config.json is 1-3 KB.
MAX_CONFIG_BYTES = 2**20
# The pickle inside a .pth / .bin (names, shapes, kwargs; the tensors are separate records) is
# about 100 KB for a published DAC or SNAC checkpoint.
MAX_PICKLE_BYTES = 64 * 2**20
# Weights a config may ask for (the decode path's parameters and buffers): 4 GiB in float32, 11x
# the largest published decode path (BiCodec's, 96 M).
MAX_ELEMENTS = 2**30
# Problems one CheckpointError lists before it only counts the rest.
MAX_LISTED = 40


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
    (the config's own checks), is a CheckpointError naming ``file``. A file over
    ``MAX_CONFIG_BYTES`` is refused unread."""
    try:
        with open(file, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read: {exc.strerror or exc}") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{file}: larger than {MAX_CONFIG_BYTES} bytes; not a model config")
    try:
        doc = parse(data.decode("utf-8"))
    # ValueError: an integer too long to convert; RecursionError: nesting deeper than the stack.
    except (*parse_errors, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{file}: not valid {language}: {clipped(str(exc))}") from exc
    try:
        return build(doc)
    except ValueError as exc:
        raise CheckpointError(f"{file}: {clipped(str(exc))}") from exc


def load_pickled(file: Path, *, mmap: bool = False) -> Any:
    """``torch.load(file, weights_only=True)`` (tensors and plain data only, nothing executed) of
    a file ``torch.save`` wrote; CheckpointError naming ``file`` if it cannot be read. ``mmap``:
    map the tensors' storage instead of reading it (to read the plain data only).

    Before unpickling, the archive must be as ``torch.save`` writes it: every record stored
    uncompressed (so that nothing read is larger than the file) and its pickle at most
    ``MAX_PICKLE_BYTES``.
    """
    try:
        _check_torch_archive(file)
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except CheckpointError:
        raise
    except Exception as exc:  # torch raises many types for a damaged or foreign file
        raise CheckpointError(f"{file}: cannot read the weights: {clipped(str(exc))}") from exc


def _check_torch_archive(file: Path) -> None:
    """Raise CheckpointError unless ``file`` is as torch.save writes it (see load_pickled)."""
    if not zipfile.is_zipfile(file):  # the legacy format: one pickle stream, then the storages
        if os.path.getsize(file) > MAX_PICKLE_BYTES:
            raise CheckpointError(f"{file}: a legacy (not zip) torch file larger than "
                                  f"{MAX_PICKLE_BYTES} bytes; save it again with torch.save")  # fmt: skip
        return
    with zipfile.ZipFile(file) as archive:
        for record in archive.infolist():
            name = shown(record.filename)
            if record.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(
                    f"{file}: record {name} is compressed; torch.save stores every record"
                )
            if record.filename.endswith(".pkl") and record.file_size > MAX_PICKLE_BYTES:
                raise CheckpointError(
                    f"{file}: pickle {name} has {record.file_size} bytes; a checkpoint's is at "
                    f"most {MAX_PICKLE_BYTES}"
                )


# Weight initialisation's fills, by name (torch.nn.init's and the tensor methods they call).
_INIT_FILLS = frozenset({"kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
                         "trunc_normal_", "normal_", "uniform_", "constant_", "ones_", "zeros_", "fill_",
                         "zero_"})  # fmt: skip


class _ParametersOnMeta(TorchFunctionMode):
    """Build a model's parameters on the meta device (shapes and dtypes, no memory).

    Only the factories that parameters are made with (``torch.empty``, ``ones``, ``zeros``,
    ``full``) go to the meta device, and weight initialisation's fills are skipped: a meta
    tensor has no values to fill. Buffers computed from ranges (a code table, rotary
    frequencies) are built as usual: they are small (the config's limits bound them), and torch's
    meta versions of their ops import ~800 modules (seconds) on first use.
    """

    FACTORIES = frozenset({torch.empty, torch.ones, torch.zeros, torch.full})

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self.FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        elif getattr(func, "__name__", "") in _INIT_FILLS:
            # Tensor.normal_(t, ...) passes t first; torch.nn.init.normal_(tensor=t, ...) by keyword.
            target = args[0] if args else kwargs.get("tensor")
            if getattr(target, "is_meta", False):
                return target
        return func(*args, **kwargs)


def meta_model(build: Callable[[Any], nn.Module], config: Any, source: Path) -> nn.Module:
    """``build(config)`` on the meta device: every tensor's shape and dtype, no memory.

    Raises CheckpointError naming ``source`` if the model would hold more than ``MAX_ELEMENTS``
    weights.
    """
    with _ParametersOnMeta():
        model = build(config)
    n = sum(t.numel() for t in itertools.chain(model.parameters(), model.buffers()))
    if n > MAX_ELEMENTS:
        raise CheckpointError(
            f"{source}: its config asks for {n} weights; a model folder may ask for at most "
            f"{MAX_ELEMENTS}"
        )
    return model


def read_state_dict(file: Path, model: nn.Module, *, part: str = "decode-path") -> dict[str, torch.Tensor]:
    """Load the tensors ``model`` needs from a safetensors file, folding weight norm.

    Every key of ``model`` is checked before any tensor is read; one CheckpointError lists every
    key that is missing, of the wrong shape, or not floating point, naming them ``part`` tensors
    (``"decode-path"``, ``"encode-path"``).
    """
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            meta = {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in slices.items()}
            plan = _plan(meta, model, file, part)
            tensors = {k: f.get_tensor(k) for keys in plan.values() for k in keys}
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise CheckpointError(f"{file}: cannot read safetensors: {clipped(str(exc))}") from exc
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
    meta: Mapping[str, tuple[tuple[int, ...], str]], model: nn.Module, file: Path, part: str = "decode-path"
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
                bad.append(f"{key}: expected {shape}, got {shown(meta[key][0])}")
            elif meta[key][1] not in _FLOAT_DTYPES:
                bad.append(f"{key}: expected a floating-point tensor, got dtype {shown(meta[key][1])}")
        plan[name] = keys
    if missing or bad:
        lines = [f"  missing: {k}" for k in missing] + [f"  wrong: {b}" for b in bad]
        if len(lines) > MAX_LISTED:
            lines[MAX_LISTED:] = [f"  ... and {len(lines) - MAX_LISTED} more"]
        note = ""
        if any(k.endswith(("weight_g", "weight_v")) for k in missing):
            note = (
                "\n(a weight-normalised NAME may instead be stored as "
                "NAME.parametrizations.weight.original0/1 or as a folded NAME.weight)"
            )
        raise CheckpointError(
            f"{file} does not fit its config: {len(missing)} {part} tensor(s) missing, "
            f"{len(bad)} of the wrong shape or dtype:\n" + "\n".join(lines) + note
        )
    return plan


def export_state_dict(model: nn.Module, form: Form) -> dict[str, torch.Tensor]:
    """``model``'s weights as contiguous CPU copies, its weight-normalised ones in ``form``."""
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    return convert_state_dict(state, weight_norm_prefixes(model), form)
