"""Torch-free descriptions of each codec's tokens: the lowest layer, which every other imports.

    layout.py       ``CodecLayout``: each codec's levels, rates, vocabularies, samples per frame,
                    sample rate; the registry of known layouts (``LAYOUTS``)
    validation.py   token arrays from what callers pass (lists, numpy, torch tensors without
                    importing torch), checked before anything is written
    orpheus.py      Orpheus TTS's audio-token ids and ``<custom_token_N>`` text <-> SNAC codes
    dia.py          Dia's delayed audio tokens <-> DAC 44 kHz codes
    audio.py        the encode direction: a clip checked before it is written, the codes back
    resample.py     a clip at another rate brought to the codec's as its upstream does (soxr)

The client imports these to validate a request before it writes anything; the model package has
one decoder per codec (``model/bicodec/``, ``model/snac/``, ``model/dac/``, ``model/qwen3_tts/``).

May import: ``errors`` only (and numpy; soxr where a clip is resampled). Never torch.
"""

from .audio import EncodedAudio
from .dia import codes_to_dia, dia_to_codes
from .layout import (
    BICODEC,
    DAC_16KHZ,
    DAC_24KHZ,
    DAC_44KHZ,
    DEFAULT_NOISE_SEED,
    LAYOUTS,
    QWEN3_TTS_12HZ,
    SNAC_24KHZ,
    SNAC_32KHZ,
    SNAC_44KHZ,
    CodecLayout,
    check_noise_seed,
    check_request,
    check_start_frame,
    get_layout,
)
from .orpheus import codes_to_orpheus, custom_token_numbers, orpheus_to_codes

__all__ = [
    "BICODEC",
    "DAC_16KHZ",
    "DAC_24KHZ",
    "DAC_44KHZ",
    "DEFAULT_NOISE_SEED",
    "EncodedAudio",
    "LAYOUTS",
    "QWEN3_TTS_12HZ",
    "SNAC_24KHZ",
    "SNAC_32KHZ",
    "SNAC_44KHZ",
    "CodecLayout",
    "check_noise_seed",
    "check_request",
    "check_start_frame",
    "codes_to_dia",
    "codes_to_orpheus",
    "custom_token_numbers",
    "dia_to_codes",
    "get_layout",
    "orpheus_to_codes",
]
