"""BiCodec in torch (the codec of Spark-TTS).

Decode: ``BiCodecDecoder`` and its typed ``BiCodecConfig``; ``GraphedDecoder`` replays it from
CUDA graphs over the shape buckets of a ``BucketGrid``. Each row of a batch equals its lone,
unpadded decode.

Encode: ``BiCodecEncoder`` (tokenizer.py) and ``BiCodecEncodeConfig``: 16 kHz waveforms ->
semantic and global ids as Spark-TTS's ``BiCodecTokenizer.tokenize`` computes them (volume
normalisation and the reference clip in waveforms.py, wav2vec2 features, the feature encoder
and quantiser in encoder.py, the mel in mel.py, the speaker path in speaker.py); checked
against upstream's own code by a recorded fixture. Each row of a padded batch gets exactly its
lone encode's ids.

May import what ``model/`` shares, ``codecs`` and ``errors``.
"""
