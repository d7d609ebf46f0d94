"""A multi-worker HTTP front end for one shared BiCodec decoder (Starlette, run by uvicorn).

Run from the repository root, beside ``bicodec-shm serve``::

    uvicorn examples.http_tts.app:app --workers 4 --host 127.0.0.1 --port 8000

Every uvicorn worker process holds one ``DecoderClient``, attached when the worker starts
(lifespan) and closed when it stops; all workers' requests meet in the one decoder server,
which batches them. The routes, errors and settings (``BICODEC_SHM_NAME``,
``BICODEC_SHM_TIMEOUT``, ``BICODEC_SHM_CLIENT_SLOTS``, read once per worker) are those of
``examples/decode_api.py``, which ``examples/ray_serve`` serves too.
"""

from __future__ import annotations

from examples.decode_api import Settings, create_app, streaming_wav_header

__all__ = ["Settings", "app", "create_app", "streaming_wav_header"]

app = create_app()
