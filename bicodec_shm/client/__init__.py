"""What a TTS worker process holds: the client handle and what is built on it. Torch-free.

    decoder_client.py   ``DecoderClient``: sync and asyncio decodes through one server or group
    requests.py         a validated request, checked again against the attachment that sends it
    router.py           which member of a server group each request goes to
    streaming.py        ``DecodeStream``: audio while the tokens still arrive
    long_requests.py    an utterance longer than the server's slots, as exact overlapping windows

May import: ``protocol``, ``codecs`` and ``errors``. Never torch, and never the model, server,
deploy or tools layers (tests/test_layers.py checks both).
"""
