"""The BiCodec decode path in torch (the codec of Spark-TTS): ``BiCodecDecoder`` and its typed
``BiCodecConfig``; ``GraphedDecoder`` replays it from CUDA graphs over the shape buckets of a
``BucketGrid``. See docs on exactness: each row of a batch equals its lone, unpadded decode.

May import what ``model/`` shares, ``codecs`` and ``errors``.
"""
