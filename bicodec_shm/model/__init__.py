"""The BiCodec decode path in torch: ``BiCodecDecoder``, its typed ``BiCodecConfig``, and
``GraphedDecoder`` (CUDA graphs over the shape buckets of a ``BucketGrid``)."""

from .buckets import BucketGrid
from .config import BiCodecConfig
from .decoder import BiCodecDecoder
from .graphs import GraphedDecoder

__all__ = ["BiCodecConfig", "BiCodecDecoder", "BucketGrid", "GraphedDecoder"]
