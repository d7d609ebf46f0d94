"""Qwen3-TTS's 12 Hz speech tokenizer's decode path in torch: ``Qwen3TTSDecoder`` and
``Qwen3CodecConfig``.

Owns the codec's config and presets, its convolutional blocks (``layers``), its sliding-window
transformer (``transformer``), its ``config.json`` + ``model.safetensors`` loader
(``checkpoint``), the decoder with upstream's chunk schedule and its server adapter
(``serving``). May import what every codec shares in ``model`` (``config_values``, ``inputs``,
``precision``, ``random_weights``, ``weights``), ``codecs`` (its torch-free layout),
``protocol.slot_io`` (the batch its adapter reads) and ``errors``; never another codec's folder.
"""

from .config import Qwen3CodecConfig
from .decoder import Qwen3TTSDecoder

__all__ = ["Qwen3CodecConfig", "Qwen3TTSDecoder"]
