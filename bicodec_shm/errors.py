"""The exception tree of bicodec-shm.

::

    Exception
    ├── ValueError                      bad input from the caller (raised before anything is written)
    │   ├── CheckpointError             a model folder that cannot be loaded
    │   └── StreamFinishedError         push()/finish() on a stream that already finished
    └── BiCodecShmError                 base of everything the shared decoder raises
        ├── DecodeError                 the server could not decode this one request
        │   └── NoEncoderError          an encode request to a server started without --encode
        ├── ServerUnavailableError      no live server behind the name (none yet, or it died)
        │   └── DecodeTimeoutError      the request's deadline passed (also a TimeoutError)
        ├── ClientClosedError           the handle was closed before or while the call ran
        ├── SegmentError                the name exists but is not a usable bicodec-shm segment
        ├── ServerAlreadyRunningError   ``serve`` under a name whose server is alive
        ├── SharedMemoryFullError       /dev/shm lacks room for the segment
        └── MissingExtraError           an optional feature's extra is not installed (also an ImportError)

Bad input is always a plain ``ValueError`` (or a subclass), so callers that already catch
``ValueError`` around an in-process decoder keep working.
"""

from __future__ import annotations


class StreamFinishedError(ValueError):
    """``push`` or ``finish`` was called on a ``DecodeStream`` that has already finished.

    Start a new stream for the next utterance.
    """


class BiCodecShmError(Exception):
    """Base class of every error raised by the shared decoder (not for bad input)."""


class CheckpointError(ValueError):
    """A model folder or checkpoint is missing, malformed, or does not fit the config."""


class DecodeError(BiCodecShmError):
    """The server failed this request; other requests in the same batch were not affected.

    ``code`` is the numeric status the server wrote into the slot (see
    ``bicodec_shm.protocol.layout.Status``) and ``detail`` is its human-readable message.
    """

    def __init__(self, message: str, *, code: int = 0, detail: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail


class ServerUnavailableError(BiCodecShmError):
    """No live decoder server answers under this name, and none came back in time."""


class DecodeTimeoutError(ServerUnavailableError, TimeoutError):
    """The request's timeout expired before its audio arrived (the server may be overloaded)."""


class NoEncoderError(DecodeError):
    """The server under this name decodes only: it was started without an encoder
    (``bicodec-shm serve --encode``, or ``DecoderServer(..., encoder=...)``)."""


class ClientClosedError(BiCodecShmError):
    """The ``DecoderClient`` was closed before or while this call ran; open a new handle."""


class SegmentError(BiCodecShmError):
    """The shared-memory name exists but is not a bicodec-shm segment of this layout version."""


class ServerAlreadyRunningError(BiCodecShmError):
    """A live server already owns this name; a second one refuses to start."""


class SharedMemoryFullError(BiCodecShmError):
    """/dev/shm has less free space than the segment needs."""


class MissingExtraError(BiCodecShmError, ImportError):
    """An optional feature needs a package extra that is not installed.

    The message names the ``pip install "bicodec-shm[EXTRA]"`` line that adds it (for example
    ``[metrics]`` for ``--metrics-port``).
    """
