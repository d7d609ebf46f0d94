"""A drop-in for an in-process ``BiCodecBatchDecoder``, backed by the shared server.

Code written against the in-process batcher runs unchanged but for the construction line::

    batch_decoder = BiCodecBatchDecoder("tts-decoder")   # a running `bicodec-shm serve`
    # or: BiCodecBatchDecoder(BiCodecDecoder.from_pretrained(path), max_batch=16, timeout_ms=10)
    batch_decoder.start()
    audio_bytes = await batch_decoder.decode_async(semantic_ids, global_ids)
    batch_decoder.stop()

Given a segment name it connects to that server. Given a decoder object it starts a private
server for it in a background thread of this process (under a random name), so the old
single-process setup keeps working and other processes can still attach by ``.name``.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from ..client.decoder_client import DecoderClient
from ..client.long_requests import decode_any_length_async
from ..errors import BiCodecShmError
from ..protocol.names import random_name, sweep_dead

PRIVATE_PREFIX = "bcshm-dropin"  # private servers' names: PRIVATE_PREFIX-<random hex>


class BiCodecBatchDecoder:
    """An in-process ``BiCodecBatchDecoder``'s calls, served through shared memory.

    Args:
        bicodec_decoder: a server's segment name (str), a model folder (``os.PathLike``), or a
            decoder object with ``detokenize(semantic_ids, global_ids, lengths)``.
        max_batch: most requests per forward pass (only used for a private server).
        timeout_ms: how long a batch may wait to fill (the private server's ``max_wait_ms``).
        request_timeout: seconds one ``decode_async`` may take before it raises.
    """

    def __init__(
        self,
        bicodec_decoder: Any,
        max_batch: int = 16,
        timeout_ms: float = 10.0,
        *,
        request_timeout: float | None = 30.0,
        slots: int = 16,
    ) -> None:
        self.decoder = bicodec_decoder
        self.max_batch = max_batch
        self.timeout_ms = timeout_ms
        self.request_timeout = request_timeout
        self.slots = slots
        self.name = bicodec_decoder if isinstance(bicodec_decoder, str) else random_name(PRIVATE_PREFIX)
        self._server: Any = None
        self._finalizer: weakref.finalize | None = None
        self._client: DecoderClient | None = None

    def start(self) -> None:
        """Connect to the server, starting a private one first if given a decoder."""
        if self._client is not None:
            return
        if not isinstance(self.decoder, str):
            from ..server.server import DecoderServer  # imports torch: only on this path

            # A process killed by a signal (SIGKILL, or SIGTERM's default action) runs no
            # finalizer: its private server's objects stay under a random name nobody knows.
            # Each new private server removes those of dead ones (their locks are gone).
            sweep_dead(PRIVATE_PREFIX + "-")
            decoder = self.decoder
            if isinstance(decoder, os.PathLike):
                from ..model import BiCodecDecoder

                decoder = BiCodecDecoder.from_pretrained(decoder)
            self._server = DecoderServer(
                decoder,
                self.name,
                slots=max(self.slots + 1, self.max_batch + 1),
                max_batch=self.max_batch,
                max_wait_ms=self.timeout_ms,
            )
            self._server.start_thread()
            # A process that exits without stop() must not leave the segment in /dev/shm: the
            # finalizer runs at interpreter exit too. It holds the server, never ``self``.
            self._finalizer = weakref.finalize(self, _close_private_server, self._server, os.getpid())
        self._client = DecoderClient(self.name, timeout=self.request_timeout, slots=self.slots)

    def stop(self) -> None:
        """Disconnect, and stop the private server if this object started one."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
        self._server = None
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer()  # stops and joins the serving thread, then unlinks

    async def decode_async(self, semantic_ids: Any, global_ids: Any) -> bytes:
        """Decode one request; returns little-endian int16 PCM bytes (320 samples per token).
        A request longer than the server's ``--max-tokens`` is decoded as overlapping windows
        sent together (client/long_requests.py), within one int16 step of the whole decode.

        Unlike an in-process batcher, a failure raises (``ValueError`` for bad input, ``DecodeError`` for a
        server-side failure) instead of hanging or returning None, and never affects other
        requests in the same batch.
        """
        if self._client is None:
            raise BiCodecShmError("call start() before decode_async()")
        pcm = await decode_any_length_async(self._client, semantic_ids, global_ids)
        return pcm.astype("<i2", copy=False).tobytes()

    def get_stats(self) -> dict:
        """An in-process batcher's keys: total_batches, total_requests, avg_batch_size, avg_batch_time_ms."""
        stats = self._client.get_stats() if self._client is not None else {}
        return {
            "total_batches": stats.get("batches", 0),
            "total_requests": stats.get("requests", 0),
            "avg_batch_size": round(stats.get("avg_batch_size", 0.0), 1),
            "avg_batch_time_ms": round(stats.get("avg_batch_time_ms", 0.0), 1),
        }

    def __repr__(self) -> str:
        return f"<BiCodecBatchDecoder name={self.name!r} started={self._client is not None}>"


def _close_private_server(server: Any, pid: int) -> None:
    """Stop a private server, in the process that started it only: a forked child inherits
    the finalizer, but neither the server's thread nor its name is the child's."""
    if os.getpid() == pid:
        server.close()
