"""Reading and writing SNAC folders: ``config.json`` + ``pytorch_model.bin``, as published in
``hubertsiuzdak/snac_24khz`` (and ``_32khz``, ``_44khz``).

The published state dict is that of a whole ``snac.SNAC``: encoder, quantizer (``in_proj`` and
``out_proj``, ``codebook``) and decoder. Only the decode path is read; its weight-normalised
convolutions may be stored in any of the three forms ``..checkpoint.FORMS`` lists (snac >= 1.2
saves ``parametrizations.weight.original0/1``, older ones ``weight_g``/``weight_v``), and are
folded once. A ``model.safetensors`` with the same keys is read when there is no ``.bin``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ...errors import CheckpointError
from .. import weights as shared
from .config import SNACConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "pytorch_model.bin"
SAFETENSORS_FILE = "model.safetensors"


def find_folder(path: str | os.PathLike[str]) -> Path:
    """The folder holding ``config.json`` and the weights: ``path`` itself, or its parent when
    ``path`` is one of its files."""
    folder = shared.existing_folder(path)
    missing = []
    if not (folder / CONFIG_FILE).is_file():
        missing.append(str(folder / CONFIG_FILE))
    if not any((folder / name).is_file() for name in (WEIGHTS_FILE, SAFETENSORS_FILE)):
        missing.append(str(folder / WEIGHTS_FILE))
    if missing:
        raise CheckpointError(
            f"missing {' and '.join(missing)}: expected a SNAC folder ({CONFIG_FILE} + "
            f"{WEIGHTS_FILE}), e.g. a download of hubertsiuzdak/snac_24khz"
        )
    return folder


def codec_in(path: str | os.PathLike[str]) -> str | None:
    """The SNAC codec (``snac-24khz``, ...) whose folder ``path`` is, by its ``config.json``;
    None if it is not a readable SNAC folder."""
    try:
        return read_config(find_folder(path) / CONFIG_FILE).codec_name
    except CheckpointError:
        return None


def read_config(file: Path) -> SNACConfig:
    """Parse ``config.json``; raises CheckpointError on bad JSON or invalid fields."""
    return shared.read_config_file(file, json.loads, "JSON", (json.JSONDecodeError,), SNACConfig.from_dict)


def read_state_dict(folder: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The decode-path tensors ``model`` needs, from ``pytorch_model.bin`` (or safetensors),
    weight norm folded; one CheckpointError lists every missing or misshapen tensor."""
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        return shared.read_state_dict(folder / SAFETENSORS_FILE, model)  # shapes checked unread
    tensors = shared.load_pickled(file)  # a .bin is a pickle: tensors and plain data only
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise CheckpointError(f"{file}: expected a state dict (a mapping of names to tensors)")
    return shared.fold_state_dict(tensors, model, file)


def write_state_dict(file: Path, model: nn.Module, form: shared.Form = "parametrizations") -> int:
    """Write ``model``'s weights with snac's key names; returns the number of tensors written."""
    tensors = shared.export_state_dict(model, form)
    torch.save(tensors, file)
    return len(tensors)
