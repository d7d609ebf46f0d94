"""Qwen3-TTS's 12 Hz speech tokenizer in torch: the decode path (``Qwen3TTSDecoder``,
``Qwen3CodecConfig``) and the encode path (``Qwen3TTSEncoder``, ``Qwen3EncoderConfig``).

Owns the codec's configs and presets, its convolutional blocks (``layers``), its sliding-window
transformer (``transformer``), its ``config.json`` + ``model.safetensors`` loader
(``checkpoint``: each path reads its own half of the folder), the decoder with upstream's chunk
schedule, the server's decode and encode adapters (``serving``), and the encoder: transformers'
``MimiModel`` as qwen-tts's ``Qwen3TTSTokenizerV2Model.encode`` runs it (24 kHz audio -> 16
codebooks at 12.5 Hz, ``ceil(samples / 1920)`` frames a row), each strided convolution's input
filled past every row's end so that a row of a padded batch gets its lone encode's codes
(``encoder``, ``encoder_config``, ``encoder_inputs``); checked against qwen-tts's ``encode``.

May import what every codec shares in ``model`` (``config_values``, ``inputs``, ``precision``,
``random_weights``, ``weights``), ``codecs`` (its torch-free layout), ``protocol.slot_io`` (the
batch its adapter reads) and ``errors``; never another codec's folder. The encode path imports
transformers (the ``qwen3-encoder`` extra) when an encoder is built, never on import.
"""

from .config import Qwen3CodecConfig
from .decoder import Qwen3TTSDecoder
from .encoder import Qwen3TTSCodes, Qwen3TTSEncoder
from .encoder_config import Qwen3EncoderConfig

__all__ = ["Qwen3CodecConfig", "Qwen3EncoderConfig", "Qwen3TTSCodes", "Qwen3TTSDecoder", "Qwen3TTSEncoder"]
