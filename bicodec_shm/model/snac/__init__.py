"""The SNAC decode path in torch (the codec of Orpheus TTS): ``SNACDecoder`` and ``SNACConfig``."""

from .config import SNACConfig
from .decoder import SNACDecoder
from .noise import DEFAULT_NOISE_SEED

__all__ = ["DEFAULT_NOISE_SEED", "SNACConfig", "SNACDecoder"]
