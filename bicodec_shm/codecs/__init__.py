"""Torch-free descriptions of each codec's tokens (``CodecLayout``), and the token layouts of the
TTS models that emit them: Orpheus's (SNAC 24 kHz) and Dia's (DAC 44 kHz).

The client imports these to validate a request before it writes anything; the model package
has one decoder per codec (``model.BiCodecDecoder``, ``model.snac.SNACDecoder``,
``model.dac.DACDecoder``).
"""

from .dia import codes_to_dia, dia_to_codes
from .layout import (
    BICODEC,
    DAC_16KHZ,
    DAC_24KHZ,
    DAC_44KHZ,
    DEFAULT_NOISE_SEED,
    LAYOUTS,
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
    "LAYOUTS",
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
