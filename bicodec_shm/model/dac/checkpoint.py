"""Reading and writing DAC checkpoints: one ``.pth`` file, as descript-audio-codec publishes them
(``weights.pth`` of its 44khz release, ``weights_24khz.pth``, ``weights_16khz.pth``).

The file is what ``dac.DAC.save(path, package=False)`` writes (audiotools' ``BaseModel.save``)::

    {"state_dict": {name: tensor, ...},            the whole codec: encoder, quantizer, decoder
     "metadata": {"kwargs": {"encoder_dim": 64, ...}}}   the arguments of dac.DAC(...)

Only the decode path is read: ``quantizer.quantizers.i.codebook`` / ``out_proj`` and
``decoder.model.*``. Its weight-normalised convolutions may be stored in any of the three forms
``..weights.FORMS`` lists (dac's ``torch.nn.utils.weight_norm`` saves ``weight_g`` /
``weight_v``; a model re-saved with torch's parametrizations has ``original0/1``; a converted one
folded weights), and are folded once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import CheckpointError
from .. import weights as shared
from ..config_values import shown
from .config import DACConfig

WEIGHTS_FILE = "weights.pth"


def find_file(path: str | os.PathLike[str]) -> Path:
    """The checkpoint file: ``path`` itself, or the one ``.pth`` file in the folder ``path``."""
    target = Path(path)
    if target.is_file():
        return target
    folder = shared.existing_folder(target)
    if (folder / WEIGHTS_FILE).is_file():
        return folder / WEIGHTS_FILE
    found = sorted(folder.glob("*.pth"))
    if len(found) == 1:
        return found[0]
    which = f"{len(found)} of them: {', '.join(f.name for f in found)}" if found else "none"
    raise CheckpointError(
        f"{folder}: expected one DAC weights file ({WEIGHTS_FILE}, or another single .pth as "
        f"descript-audio-codec downloads them), found {which}; pass the file itself"
    )


def codec_in(path: str | os.PathLike[str]) -> str | None:
    """The DAC codec (``dac-44khz``, ...) whose weights file ``path`` is or holds, by its
    metadata; None if there is no readable one. The tensors are mapped, not read."""
    try:
        file = find_file(path)
        return read_config(read_file(file, mmap=True)[0], file).codec_name
    except CheckpointError:
        return None


def read_file(file: Path, *, mmap: bool = False) -> tuple[Mapping[str, Any], dict[str, torch.Tensor]]:
    """``(kwargs, state_dict)`` of a dac weights file; CheckpointError if it is not one.
    ``mmap``: map the tensors' storage instead of reading it (to read the kwargs only)."""
    doc = shared.load_pickled(file, mmap=mmap)  # a .pth is a pickle: tensors and plain data only
    state = doc.get("state_dict") if isinstance(doc, Mapping) else None
    metadata = doc.get("metadata") if isinstance(doc, Mapping) else None
    kwargs = metadata.get("kwargs") if isinstance(metadata, Mapping) else None
    if not isinstance(state, Mapping) or not isinstance(kwargs, Mapping):
        got = f"keys {shown(list(doc))}" if isinstance(doc, Mapping) else type(doc).__name__
        raise CheckpointError(
            f"{file}: not a descript-audio-codec weights file: expected "
            f'{{"state_dict": ..., "metadata": {{"kwargs": ...}}}} (as dac.DAC.save writes), got {got}'
        )
    if not all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in state.items()):
        raise CheckpointError(f"{file}: its state_dict is not a mapping of names to tensors")
    return kwargs, dict(state)


def read_config(kwargs: Mapping[str, Any], file: Path) -> DACConfig:
    """The config of a checkpoint's kwargs; a bad one is a CheckpointError naming ``file``."""
    try:
        return DACConfig.from_dict(kwargs)
    except ValueError as exc:
        raise CheckpointError(f"{file}: metadata kwargs: {exc}") from exc


def fold(tensors: Mapping[str, torch.Tensor], model: nn.Module, file: Path) -> dict[str, torch.Tensor]:
    """The decode-path tensors ``model`` needs, weight norm folded; one CheckpointError lists
    every missing or misshapen tensor."""
    return shared.fold_state_dict(tensors, model, file)


def write_file(file: Path, model: nn.Module, form: shared.Form = "weight_norm") -> int:
    """Write ``model``'s weights in dac's file format; returns the number of tensors written."""
    tensors = shared.export_state_dict(model, form)
    torch.save({"state_dict": tensors, "metadata": {"kwargs": model.config.to_dict()}}, file)
    return len(tensors)
