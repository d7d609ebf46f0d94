"""qwen-tts's own 12 Hz tokenizer modules, importable without qwen-tts's other dependencies.

``import qwen_tts`` runs its ``__init__``, which imports the TTS inference code (librosa,
soundfile, sox, onnxruntime, torchaudio, accelerate; torchaudio pins another torch release), and
``qwen_tts.core``'s imports the 25 Hz tokenizer too. CI installs ``qwen-tts`` with ``--no-deps``
and the ``transformers`` release it names (the test extra), and this module loads the two files
of ``qwen_tts/core/tokenizer_12hz/`` as they are, under empty stand-ins for the parent packages
(``qwen_tts``, ``qwen_tts.core``) whose ``__init__`` would run that code.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

PACKAGE = "qwen_tts.core.tokenizer_12hz"
_LOADED: dict[str, Any] = {}


def upstream() -> types.SimpleNamespace:
    """``modeling`` and ``configuration``: qwen-tts's modules for the 12 Hz tokenizer."""
    if not _LOADED:
        spec = importlib.util.find_spec("qwen_tts")  # finds the package without running its __init__
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("qwen-tts is not installed: pip install --no-deps qwen-tts==0.1.1 "
                              "(see the README's test command)")  # fmt: skip
        root = Path(spec.submodule_search_locations[0])
        for name, path in (
            ("qwen_tts", root),
            ("qwen_tts.core", root / "core"),
            (PACKAGE, root / "core" / "tokenizer_12hz"),
        ):
            if name in sys.modules and getattr(sys.modules[name], "__file__", None):
                raise RuntimeError(f"{name} was imported already: load it through this module")
            module = types.ModuleType(name)
            module.__path__ = [str(path)]
            sys.modules[name] = module
        _LOADED["modeling"] = importlib.import_module(f"{PACKAGE}.modeling_qwen3_tts_tokenizer_v2")
        _LOADED["configuration"] = importlib.import_module(f"{PACKAGE}.configuration_qwen3_tts_tokenizer_v2")
    return types.SimpleNamespace(**_LOADED)


# A Mimi encoder of a few thousand weights: qwen-tts's model always builds one, the decode path
# never runs it.
TINY_ENCODER = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                "head_dim": 8, "intermediate_size": 32, "codebook_dim": 16, "num_filters": 2,
                "upsample_groups": 16, "codebook_size": 2048}  # fmt: skip


# The top-level keys of config.json that qwen-tts's encode reads beside encoder_config.
ENCODE_KEYS = ("encoder_valid_num_quantizers", "encode_downsample_rate", "input_sample_rate")


def make_tokenizer(decoder_config: dict[str, Any], encoder_config: dict[str, Any] | None = None) -> Any:
    """``Qwen3TTSTokenizerV2Model`` of ``decoder_config`` (our decoder config's ``to_dict()``) and
    ``encoder_config`` (our encoder config's ``to_dict()``, top-level keys included; None: the
    never-run ``TINY_ENCODER``), random weights, eval mode."""
    up = upstream()
    decoder = dict(decoder_config)
    sample_rate = decoder.pop("output_sample_rate", 24000)
    encoder = dict(encoder_config or TINY_ENCODER)
    top = {k: encoder.pop(k) for k in ENCODE_KEYS if k in encoder}
    if encoder_config is not None:  # MimiModel builds its grouped upsampling, which encode never runs
        encoder["upsample_groups"] = encoder["hidden_size"]
    config = up.configuration.Qwen3TTSTokenizerV2Config(
        encoder_config=encoder, decoder_config=decoder, output_sample_rate=sample_rate,
        **{"input_sample_rate": sample_rate, **top},
    )  # fmt: skip
    return up.modeling.Qwen3TTSTokenizerV2Model(config).eval()
