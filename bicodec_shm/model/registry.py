"""Which decoder class decodes each codec: the one place a codec's model is registered.

``serve`` and ``bench`` build their models through :func:`decoder_class`; a third codec is its
layout (``codecs.layout``), its model module with a ``codec_adapter()`` (``adapters.py``), and one
line here.
"""

from __future__ import annotations

import importlib

from ..codecs.layout import get_layout

# codec -> (module, class); imported on demand, so that naming a codec costs no model import.
DECODERS = {
    "bicodec": ("bicodec_shm.model.bicodec.decoder", "BiCodecDecoder"),
    "snac-24khz": ("bicodec_shm.model.snac.decoder", "SNACDecoder"),
    "snac-32khz": ("bicodec_shm.model.snac.decoder", "SNACDecoder"),
    "snac-44khz": ("bicodec_shm.model.snac.decoder", "SNACDecoder"),
    **dict.fromkeys(("dac-44khz", "dac-24khz", "dac-16khz"), ("bicodec_shm.model.dac.decoder", "DACDecoder")),
    "qwen3-tts-12hz": ("bicodec_shm.model.qwen3_tts.decoder", "Qwen3TTSDecoder"),
}


# Each codec family's checkpoint module: its ``codec_in(path)`` names the codec a model folder
# (or a DAC weights file) holds, from its files and config alone.
CHECKPOINTS = (  # the most particular first: SNAC's config.json reader takes any JSON object
    "bicodec_shm.model.bicodec.checkpoint",
    "bicodec_shm.model.qwen3_tts.checkpoint",
    "bicodec_shm.model.snac.checkpoint",
    "bicodec_shm.model.dac.checkpoint",
)


def codec_in(path: str) -> str | None:
    """The codec whose model ``path`` holds (``"bicodec"``, ``"snac-24khz"``, ``"dac-16khz"``,
    ...), recognised by every codec's own file names and config; None if no codec's."""
    for module in CHECKPOINTS:
        found = importlib.import_module(module).codec_in(path)
        if found is not None:
            return found
    return None


def decoder_class(codec: str) -> type:
    """The decoder class of ``codec`` (``from_config``, ``from_pretrained``); raises ValueError
    for an unknown codec, naming the known ones."""
    get_layout(codec)  # an unknown codec: the layout's own message
    module, name = DECODERS[codec]
    return getattr(importlib.import_module(module), name)
