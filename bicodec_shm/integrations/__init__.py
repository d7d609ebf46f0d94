"""Drop-ins for code written against another decoder: the change a user makes is one line.

    batch_decoder.py    ``BiCodecBatchDecoder``: the calls of an in-process batcher, served by
                        a shared server (or by a private one it starts in this process)
    orpheus_tts.py      Orpheus TTS's streaming decoder (``orpheus_tts.decoder``'s
                        ``tokens_decoder`` and ``tokens_decoder_sync``) on a ``serve --codec
                        snac-24khz`` server
    spark_tts.py        Spark-TTS's audio tokenizer (``BiCodecTokenizer.detokenize``, and with
                        ``install()`` its ``tokenize`` too, no model loaded) on a BiCodec server
    qwen3_tts.py        Qwen3-TTS's speech tokenizer (``Qwen3TTSTokenizer.decode``, and
                        ``encode`` for voice cloning) on a ``serve --codec qwen3-tts-12hz``
                        server
    inputs.py           what they share: one client per server name, reading upstream's arrays

May import: ``client``, ``codecs``, ``protocol`` and ``errors``; and, only when asked to start a
private server in the calling process, ``server`` and ``model``. ``orpheus_tts`` and
``spark_tts`` import only what the package exports (``DecoderClient`` and ``DecodeStream`` from
the client layer, ``codecs``' exports, ``errors``), the client's ``decode_any_length`` and
``inputs`` (itself torch-free).
Importing it imports no torch: tensors are read by duck typing, so a worker that decodes through
the server never loads it.
"""
