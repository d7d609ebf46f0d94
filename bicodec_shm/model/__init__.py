"""The decode paths in torch: ``BiCodecDecoder`` and its typed ``BiCodecConfig``, ``GraphedDecoder``
(CUDA graphs over the shape buckets of a ``BucketGrid``), and SNAC's ``SNACDecoder`` and
``SNACConfig`` (``model.snac``)."""

from .buckets import BucketGrid
from .config import BiCodecConfig
from .decoder import BiCodecDecoder
from .graphs import GraphedDecoder
from .snac import SNACConfig, SNACDecoder

__all__ = ["BiCodecConfig", "BiCodecDecoder", "BucketGrid", "GraphedDecoder", "SNACConfig", "SNACDecoder"]
