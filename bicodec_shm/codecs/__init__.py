"""Torch-free descriptions of each codec's tokens (``CodecLayout``) and the Orpheus token layout.

The client imports these to validate a request before it writes anything; the model package
has one decoder per codec (``model.BiCodecDecoder``, ``model.snac.SNACDecoder``).
"""

from .layout import (
    BICODEC,
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
    "DEFAULT_NOISE_SEED",
    "LAYOUTS",
    "SNAC_24KHZ",
    "SNAC_32KHZ",
    "SNAC_44KHZ",
    "CodecLayout",
    "check_noise_seed",
    "check_request",
    "check_start_frame",
    "codes_to_orpheus",
    "custom_token_numbers",
    "get_layout",
    "orpheus_to_codes",
]
