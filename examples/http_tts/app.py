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
import struct
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
CLAIM_LISTEN_S = 0.5  # how long a claim bound but not listened on may take to listen


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
    name (Linux; no file to clean up) listened on until this worker exits.

    Any user of the host may bind any abstract name, so a name already bound is a fellow
    worker's claim only if a process of this user listens on it (SO_PEERCRED, which the kernel
    fills in): another user who took the name first cannot silence the error, at worst each
    worker logs it."""
    address = f"\0bicodec-shm-http-bad-setting-{os.getppid()}"
    claim = socket.socket(socket.AF_UNIX)
    try:
        claim.bind(address)
        claim.listen()
    except OSError:
        claim.close()
        return not _claimed_by_this_user(address)
    _held.append(claim)
    return True


def _claimed_by_this_user(address: str) -> bool:
    """True if a process of this user listens on the abstract socket ``address``."""
    deadline = time.monotonic() + CLAIM_LISTEN_S
    while True:
        with socket.socket(socket.AF_UNIX) as peer:
            peer.settimeout(CLAIM_LISTEN_S)
            try:
                peer.connect(address)
                cred = peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            except ConnectionRefusedError:
                # Bound, not listening yet (a fellow worker between its bind and its listen),
                # or never (someone else's): ask again until the deadline.
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.01)
                continue
            except OSError:
                return False
        _pid, uid, _gid = _UCRED.unpack(cred)
        return uid == os.geteuid()


_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


_held: list[socket.socket] = []


app = app_from_env()
