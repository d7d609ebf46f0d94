"""The decoders in torch, one folder per codec, and the blocks they share.

    model/              what every codec shares: modules.py (Snake, weight-normalised convolutions,
                        residual units, the time mask), weights.py (checkpoint plumbing),
                        config_values, inputs, precision, random_weights, devices; registry.py
                        (which decoder class decodes each codec)
    model/bicodec/      BiCodec (Spark-TTS): ``BiCodecDecoder``, ``BiCodecConfig``, and
                        ``GraphedDecoder`` (CUDA graphs over the shape buckets of a ``BucketGrid``);
                        the encode path, ``BiCodecEncoder`` (waveforms -> ids)
    model/snac/         SNAC (Orpheus TTS): ``SNACDecoder``, ``SNACConfig``
    model/dac/          DAC (Dia, Parler-TTS): ``DACDecoder``, ``DACConfig``
    model/qwen3_tts/    Qwen3-TTS's 12 Hz speech tokenizer: ``Qwen3TTSDecoder``, ``Qwen3CodecConfig``;
                        its encode path, ``Qwen3TTSEncoder``, ``Qwen3EncoderConfig``

May import: ``codecs``, ``errors``, and ``protocol`` (the batch record a codec's adapter reads);
never the client, server, deploy or tools layers. Every decoder is exact under mixed-length
batching (by masking, or by being causal), and checked against its upstream implementation.

Importing this package imports no codec: the names below load on first access (PEP 562), so that
``model.registry`` names a codec without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BiCodecConfig": ".bicodec.config",
    "BiCodecDecoder": ".bicodec.decoder",
    "BiCodecEncoder": ".bicodec.tokenizer",
    "BucketGrid": ".bicodec.buckets",
    "DACConfig": ".dac",
    "DACDecoder": ".dac",
    "GraphedDecoder": ".bicodec.graphs",
    "Qwen3CodecConfig": ".qwen3_tts",
    "Qwen3EncoderConfig": ".qwen3_tts",
    "Qwen3TTSDecoder": ".qwen3_tts",
    "Qwen3TTSEncoder": ".qwen3_tts",
    "SNACConfig": ".snac",
    "SNACDecoder": ".snac",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
