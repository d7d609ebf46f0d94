"""Drop-ins for other projects' serving code: their own calls, decoded by a shared server.

- ``orpheus_tts``: Orpheus TTS's streaming decoder (``orpheus_tts.decoder``'s ``tokens_decoder``
  and ``tokens_decoder_sync``) on a ``serve --codec snac-24khz`` server.
- ``spark_tts``: Spark-TTS's audio tokenizer (``BiCodecTokenizer.detokenize``) on a BiCodec
  server.

What this folder may import: the package's public client API only (``bicodec_shm``'s
``DecoderClient``, ``DecodeStream``, ``StreamSettings``, ``bicodec_shm.codecs``,
``bicodec_shm.errors``), numpy and the standard library. It imports no torch: tensors are
read by duck typing, so a worker that decodes through the server never loads it. Nothing in the
package imports this folder.
"""
