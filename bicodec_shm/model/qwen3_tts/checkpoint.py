"""Reading and writing the 12 Hz tokenizer's folder: ``config.json`` and ``model.safetensors``, as
``Qwen/Qwen3-TTS-Tokenizer-12Hz`` publishes it, every Qwen3-TTS-12Hz model holds it (as
``speech_tokenizer/``), and qwen-tts's ``Qwen3TTSTokenizerV2Model.save_pretrained`` writes it::

    config.json         {"model_type": "qwen3_tts_tokenizer_12hz", "output_sample_rate": 24000,
                         "decode_upsample_rate": 1920, "decoder_config": {...}, "encoder_config": ...}
    model.safetensors   encoder.* (the encode path: transformers' Mimi encoder) and decoder.*
                        (the decode path)

Each path reads its own half: ``Qwen3TTSDecoder`` the ``decoder_config`` and ``decoder.*``,
``Qwen3TTSEncoder`` the ``encoder_config`` (with the top-level ``encoder_valid_num_quantizers``,
``encode_downsample_rate`` and ``input_sample_rate``) and ``encoder.*``. Neither has weight norm;
tensors are read as stored, then cast to the float32 the model loads in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ...errors import CheckpointError
from .. import weights as shared
from ..config_values import shown
from .config import Qwen3CodecConfig
from .encoder_config import TOP_LEVEL, Qwen3EncoderConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODEL_TYPE = "qwen3_tts_tokenizer_12hz"
SUBFOLDER = "speech_tokenizer"  # where a Qwen3-TTS model folder keeps its tokenizer


def find_folder(path: str | os.PathLike[str]) -> Path:
    """The tokenizer folder: ``path`` (or the folder of a file ``path``), or its ``speech_tokenizer/``."""
    folder = shared.existing_folder(path)
    if not (folder / CONFIG_FILE).is_file() and (folder / SUBFOLDER / CONFIG_FILE).is_file():
        folder = folder / SUBFOLDER
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise CheckpointError(
                f"{folder}: no {name}; expected a Qwen3-TTS-Tokenizer-12Hz folder (config.json and "
                f"model.safetensors) or a Qwen3-TTS model folder with one in {SUBFOLDER}/"
            )
    return folder


def codec_in(path: str | os.PathLike[str]) -> str | None:
    """``qwen3-tts-12hz`` if ``path`` is a 12 Hz tokenizer's folder (or a Qwen3-TTS model folder
    holding one), by its ``config.json``; None if it is not a readable one."""
    try:
        return read_config(find_folder(path)).codec_name
    except CheckpointError:
        return None


def read_config(folder: Path) -> Qwen3CodecConfig:
    """The decoder's config from ``config.json``; CheckpointError naming the file if it is not a
    12 Hz tokenizer's."""
    return shared.read_config_file(
        folder / CONFIG_FILE, json.loads, "JSON", (json.JSONDecodeError,), _from_doc
    )


def read_encoder_config(folder: Path) -> Qwen3EncoderConfig:
    """The encoder's config from ``config.json``; CheckpointError naming the file if it is not a
    12 Hz tokenizer's or has no ``encoder_config``."""
    return shared.read_config_file(
        folder / CONFIG_FILE, json.loads, "JSON", (json.JSONDecodeError,), _encoder_from_doc
    )


def _check_model_type(doc: Any) -> None:
    if not isinstance(doc, dict) or doc.get("model_type") != MODEL_TYPE:
        found = doc.get("model_type") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(
            f'expected "model_type": "{MODEL_TYPE}" (a Qwen3-TTS 12 Hz tokenizer), got {shown(found)}'
        )


def _encoder_from_doc(doc: Any) -> Qwen3EncoderConfig:
    _check_model_type(doc)
    encoder = doc.get("encoder_config")
    if not isinstance(encoder, dict):
        raise ValueError(f"encoder_config must be a mapping (the encode path's), got {shown(encoder)}")
    return Qwen3EncoderConfig.from_dict({**encoder, **{k: doc[k] for k in TOP_LEVEL if k in doc}})


def _from_doc(doc: Any) -> Qwen3CodecConfig:
    _check_model_type(doc)
    decoder = doc.get("decoder_config") or {}
    if not isinstance(decoder, dict):
        raise ValueError(f"decoder_config must be a mapping, got {type(decoder).__name__}")
    cfg = Qwen3CodecConfig.from_dict({**decoder, "output_sample_rate": doc.get("output_sample_rate", 24000)})
    stated = doc.get("decode_upsample_rate", cfg.samples_per_frame)
    if stated != cfg.samples_per_frame:
        raise ValueError(
            f"decode_upsample_rate={stated!r} but the decoder's rates multiply to {cfg.samples_per_frame}"
        )
    return cfg


def read_weights(folder: Path, model: nn.Module, *, part: str = "decode-path") -> dict[str, torch.Tensor]:
    """The tensors ``model`` needs (its ``part``: ``"decode-path"``, ``"encode-path"``), in
    float32; one CheckpointError lists every one missing or misshapen."""
    tensors = shared.read_state_dict(folder / WEIGHTS_FILE, model, part=part)
    return {k: t.float() for k, t in tensors.items()}


def write_folder(folder: Path, model: nn.Module) -> int:
    """Write ``model``'s config and decode-path weights as upstream lays them out; returns the
    number of tensors written."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg: Qwen3CodecConfig = model.config
    decoder = cfg.to_dict()
    sample_rate = decoder.pop("output_sample_rate")
    doc = {"model_type": MODEL_TYPE, "output_sample_rate": sample_rate, "input_sample_rate": sample_rate,
           "decode_upsample_rate": cfg.samples_per_frame, "decoder_config": decoder}  # fmt: skip
    (folder / CONFIG_FILE).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    tensors = shared.export_state_dict(model, "folded")
    save_file(tensors, str(folder / WEIGHTS_FILE))
    return len(tensors)
