"""Reading and writing BiCodec folders: ``config.yaml`` + ``model.safetensors`` in Spark-TTS layout.

The weights may be stored in any of the weight-norm forms of ``model/weights.py``; loading folds
them once. Keys the decode path does not use (encoder, postnet, ...) are ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from safetensors.torch import save_file
from torch import nn

from ...errors import CheckpointError
from ..weights import Form, existing_folder, export_state_dict, read_config_file
from .config import BiCodecConfig
from .encode_config import BiCodecEncodeConfig

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
SUBFOLDER = "BiCodec"


def find_folder(path: str | os.PathLike[str]) -> Path:
    """The BiCodec folder for ``path``: itself, or its ``BiCodec/`` subfolder (a model folder)."""
    folder = existing_folder(path)
    # A Spark-TTS model folder has a config.yaml of its own (sample rate, reference clip) beside
    # BiCodec/: without weights of its own, BiCodec/ is the one.
    if not (folder / WEIGHTS_FILE).exists() and (folder / SUBFOLDER).is_dir():
        folder = folder / SUBFOLDER
    missing = [str(folder / n) for n in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(
            f"missing {' and '.join(missing)}: expected a BiCodec folder ({CONFIG_FILE} + "
            f"{WEIGHTS_FILE}) or a model folder containing {SUBFOLDER}/"
        )
    return folder


def codec_in(path: str | os.PathLike[str]) -> str | None:
    """``"bicodec"`` if ``path`` is a BiCodec folder or a model folder holding one, else None."""
    try:
        find_folder(path)
    except CheckpointError:
        return None
    return "bicodec"


class NoAliasLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases (``*name``, and so ``<<: *name`` merges).

    A model config never needs one, and an alias tree of a few hundred bytes stands for a value
    with billions of leaves: cheap to load, but not to check or to quote in a message.
    """

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"found an alias (*{str(event.anchor)[:40]}); a model config may not "
                "use YAML anchors and aliases: write each value out", event.start_mark)  # fmt: skip
        return super().compose_node(parent, index)


def _load_yaml(text: str) -> Any:
    loader = NoAliasLoader(text)  # a SafeLoader: plain data only (what yaml.load(text, it) does)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_config(file: Path) -> BiCodecConfig:
    """Parse ``config.yaml`` (anchors and aliases refused); raises CheckpointError on bad YAML or
    missing/invalid fields."""
    return read_config_file(file, _load_yaml, "YAML", (yaml.YAMLError,), _audio_tokenizer)


def _audio_tokenizer(doc: Any) -> BiCodecConfig:
    section = doc.get("audio_tokenizer") if isinstance(doc, Mapping) else None
    if not isinstance(section, Mapping):
        raise ValueError("no 'audio_tokenizer' mapping at the top level")
    return BiCodecConfig.from_dict(section)


def write_config(file: Path, config: BiCodecConfig) -> None:
    """Write ``config.yaml`` with one top-level key, ``audio_tokenizer``."""
    text = yaml.safe_dump({"audio_tokenizer": config.to_dict()}, sort_keys=False)
    file.write_text(text, encoding="utf-8")


def write_state_dict(file: Path, model: nn.Module, form: Form = "weight_norm") -> int:
    """Write ``model``'s weights in Spark-TTS key layout; returns the number of tensors written."""
    tensors = export_state_dict(model, form)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return len(tensors)


MODEL_CONFIG_FILE = "config.yaml"  # a Spark-TTS model folder's own, beside BiCodec/


def read_encode_config(folder: Path, model_folder: Path | None) -> BiCodecEncodeConfig:
    """The encode path's ``BiCodecEncodeConfig`` from ``folder/config.yaml`` (BiCodec's) and
    ``model_folder/config.yaml`` (the tokenizer's: reference clip, volume normalisation; the
    released model's values when None or absent). CheckpointError names a bad file."""
    model_doc = None
    if model_folder is not None and (model_folder / MODEL_CONFIG_FILE).is_file():
        model_doc = read_config_file(model_folder / MODEL_CONFIG_FILE, _load_yaml, "YAML",
                                     (yaml.YAMLError,), _mapping)  # fmt: skip
    return read_config_file(folder / CONFIG_FILE, _load_yaml, "YAML", (yaml.YAMLError,),
                            lambda doc: BiCodecEncodeConfig.from_dict(_mapping(doc), model_doc))  # fmt: skip


def _mapping(doc: Any) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise ValueError(f"expected a mapping at the top level, got {type(doc).__name__}")
    return doc
