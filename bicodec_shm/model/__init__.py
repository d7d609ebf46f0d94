"""The BiCodec decode path in torch: ``BiCodecDecoder`` and its typed ``BiCodecConfig``."""

from .config import BiCodecConfig
from .decoder import BiCodecDecoder

__all__ = ["BiCodecConfig", "BiCodecDecoder"]
