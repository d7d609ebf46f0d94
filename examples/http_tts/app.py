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

import logging
import os
import socket
import time

from starlette.applications import Starlette

from examples.decode_api import (
    MAX_STREAM_TOKENS,
    STREAM_LIMIT,
    ConfigError,
    Settings,
    create_app,
    streaming_wav_header,
)

__all__ = ["MAX_STREAM_TOKENS", "STREAM_LIMIT", "ConfigError", "Settings", "app", "create_app",
           "streaming_wav_header"]  # fmt: skip

log = logging.getLogger("uvicorn.error")
# uvicorn's exit code for "this worker cannot start" (uvicorn.config.STARTUP_FAILURE): since 0.50
# its multiprocess master stops when a worker exits with it, instead of restarting it forever.
STARTUP_FAILURE = 3
CLAIM_HOLD_S = 2.0


def app_from_env() -> Starlette:
    """The app uvicorn imports. A bad setting ends this worker with uvicorn's STARTUP_FAILURE
    exit code (3) after one log line, no traceback: uvicorn >= 0.50 then stops its master at
    once, where any other failure would make it restart the worker forever (every worker would
    fail the same way)."""
    try:
        return create_app()
    except ConfigError as exc:
        if _first_to_fail():
            log.error("bicodec-shm HTTP example: bad setting %s", exc)
            # Hold the claim while the other workers (started at the same moment) reach this
            # point and exit silently; the first of them to exit makes the master stop us all.
            time.sleep(CLAIM_HOLD_S)
        raise SystemExit(STARTUP_FAILURE) from None


def _first_to_fail() -> bool:
    """True in the first of the workers of one uvicorn master to get here: they all read the
    same environment, so one line says it for all of them. The claim is an abstract Unix socket
    name (Linux; no file to clean up) held until this worker exits."""
    claim = socket.socket(socket.AF_UNIX)
    try:
        claim.bind(f"\0bicodec-shm-http-bad-setting-{os.getppid()}")
    except OSError:
        claim.close()
        return False
    _held.append(claim)
    return True


_held: list[socket.socket] = []


app = app_from_env()
