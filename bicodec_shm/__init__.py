"""bicodec-shm: one GPU-owning BiCodec decoder shared by many TTS processes.

Importing this package does not import torch. The client side (``DecoderClient``,
``BiCodecBatchDecoder``) uses numpy and posix_ipc only; ``BiCodecDecoder`` and
``DecoderServer`` load torch on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    BiCodecShmError,
    CheckpointError,
    ClientClosedError,
    DecodeError,
    DecodeTimeoutError,
    MissingExtraError,
    NoEncoderError,
    SegmentError,
    ServerAlreadyRunningError,
    ServerUnavailableError,
    SharedMemoryFullError,
    StreamFinishedError,
)

if TYPE_CHECKING:  # pragma: no cover
    from .model import BiCodecDecoder
    from .server.server import DecoderServer

from ._version import __version__

# Public names that import torch, loaded on first attribute access (PEP 562).
_LAZY = {
    "BiCodecDecoder": ".model.bicodec.decoder",
    "DecoderServer": ".server.server",
}

_EAGER = {
    "BiCodecBatchDecoder": ".integrations.batch_decoder",
    "DecodeStream": ".client.streaming",
    "DecoderClient": ".client.decoder_client",
    "EncodedAudio": ".codecs.audio",
    "StreamSettings": ".client.streaming",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name) or _EAGER.get(name)
    if module is None:
        raise AttributeError(f"module 'bicodec_shm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "BiCodecBatchDecoder",
    "BiCodecDecoder",
    "BiCodecShmError",
    "CheckpointError",
    "ClientClosedError",
    "DecodeError",
    "DecodeStream",
    "DecodeTimeoutError",
    "DecoderClient",
    "DecoderServer",
    "EncodedAudio",
    "MissingExtraError",
    "NoEncoderError",
    "SegmentError",
    "ServerAlreadyRunningError",
    "ServerUnavailableError",
    "SharedMemoryFullError",
    "StreamFinishedError",
    "StreamSettings",
    "__version__",
]
