"""The DAC decode path in torch (descript-audio-codec, the codec of Dia and Parler-TTS):
``DACDecoder`` and ``DACConfig``.

Owns DAC's config and presets, its blocks (``layers``), its ``weights.pth`` loader
(``checkpoint``), the decoder and its server adapter (``serving``). May import what every
codec shares in ``model`` (``modules``, ``config_values``, ``inputs``, ``precision``,
``random_weights``, ``weights``), ``codecs`` (its torch-free layout), ``protocol.slot_io`` (the
batch its adapter reads) and ``errors``; never another codec's folder.
"""

from .config import DACConfig
from .decoder import DACDecoder

__all__ = ["DACConfig", "DACDecoder"]
