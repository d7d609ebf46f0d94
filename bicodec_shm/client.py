"""The client handle: validate a request, send it through the current attachment, and carry it
across server restarts, forks and ``close()``.

numpy and posix_ipc only: a worker that decodes through the server never imports torch. The
per-incarnation machinery (slots, semaphores, the asyncio waiter) is in attachment.py; this
module decides *which* attachment a request uses and what the caller sees:

- The handle attaches at construction (waiting up to ``connect_timeout``) but claims no slot
  until a request needs one.
- If the server goes away (crash, SIGKILL, SIGTERM, a rolling restart), every request in flight
  or waiting for a slot wakes at once, the old attachment is dropped whole (its slots, the
  abandoned ones too, and its mapping), and the requests re-attach to the next server under the
  same name and resubmit (decoding is a pure function, so a retry is safe), or raise
  ``ServerUnavailableError`` when their timeout runs out.
- ``close()`` ends every call in flight within a second with ``ClientClosedError``.
- In a forked child the handle notices the new pid and attaches afresh; it never shares the
  parent's slots (transport.py closes the child's copies of every lock descriptor at fork).

Every exception a caller sees is a ``ValueError`` (bad input) or a ``BiCodecShmError``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

from .attachment import SLICE, Attachment, Gone
from .errors import BiCodecShmError, ClientClosedError, ServerUnavailableError
from .group import GroupRouter
from .transport import N_GLOBAL, NO_BELL, stats_from_header, validate_name
from .validation import as_token_array, output_dtype_code

DEFAULT_TIMEOUT = 30.0
DEFAULT_CLIENT_SLOTS = 8

_live_clients: weakref.WeakSet[DecoderClient] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_live_clients):
        client._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DecoderClient:
    """A handle on the shared decoder served under ``name``.

    Args:
        name: the server's segment name (``bicodec-shm serve --name``; default "bicodec-shm").
        timeout: default seconds a request may take end to end, waiting for a slot and for a
            restarted server included (None: wait forever). On expiry it raises
            ``DecodeTimeoutError``, or ``ServerUnavailableError`` if no server came back.
        slots: most requests of this handle in flight at once; each claims a shared-memory
            slot on demand. More concurrent requests wait in the handle (backpressure).
        connect_timeout: seconds to wait for a server at construction (0: fail at once with
            ``ServerUnavailableError``).
        owner_uid: the uid that must own the server's segment (default: this process's).

    Thread-safe and asyncio-safe; one handle can serve many threads and coroutines.

    If ``name`` is a server group (``bicodec-shm serve --device cuda:0,cuda:1``), each request
    goes to the member with the fewest outstanding requests, and to another live member if its
    own dies (group.py); ``slots`` then applies to each member.
    """

    _att: Attachment | None = None
    _group: GroupRouter | None = None  # set when ``name`` is a server group
    _closed = True

    def __init__(
        self,
        name: str = "bicodec-shm",
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        slots: int = DEFAULT_CLIENT_SLOTS,
        connect_timeout: float = 0.0,
        owner_uid: int | None = None,
    ) -> None:
        validate_name(name)
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
        self.name = name
        self.timeout = timeout
        self.max_slots = slots
        self.owner_uid = owner_uid
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._requests = 0
        self._last_error: Exception | None = None
        self._closed = False
        self._att = self._connect(time.monotonic() + connect_timeout)
        _live_clients.add(self)

    # -- public API ---------------------------------------------------------------------------

    def decode(self, semantic_ids: Any, global_ids: Any, *, dtype: str = "int16",
               timeout: float | None = None) -> np.ndarray:  # fmt: skip
        """Decode one utterance; blocks the calling thread.

        Args:
            semantic_ids: (T,) ints in [0, 8192): list, numpy array or tensor.
            global_ids: (32,) ints in [0, 4096).
            dtype: "int16" (the seed's PCM conversion) or "float32" (the model's output).
            timeout: seconds for this call (default: the handle's).
        Returns:
            (320·T,) int16 or float32 samples at 16 kHz.
        """
        semantic, globals_, code = self._prepare(semantic_ids, global_ids, dtype)
        deadline = self._deadline(timeout)
        while True:
            att = self._attachment(deadline)
            try:
                slot = att.take_slot(deadline)
                seq = next(att.seq)
                att.submit(slot, seq, semantic, globals_, code, NO_BELL)
                self._requests += 1
                return att.wait_result(slot, seq, deadline)
            except Gone:
                self._drop(att)

    async def decode_async(self, semantic_ids: Any, global_ids: Any, *, dtype: str = "int16",
                           timeout: float | None = None) -> np.ndarray:  # fmt: skip
        """``decode`` for asyncio: never blocks the event loop, starts no thread per call."""
        semantic, globals_, code = self._prepare(semantic_ids, global_ids, dtype)
        deadline = self._deadline(timeout)
        loop = asyncio.get_running_loop()
        while True:
            att = self._attachment(deadline, block=False)
            if att is None:  # the server is being replaced: wait without blocking the loop
                await asyncio.sleep(SLICE)
                continue
            try:
                slot = await att.take_slot_async(deadline)
                seq = next(att.seq)
                future = loop.create_future()
                bell = att.register(slot, seq, loop, future)
                try:
                    att.submit(slot, seq, semantic, globals_, code, bell)
                except BaseException:
                    future.cancel()  # nobody will await it: no "exception never retrieved"
                    raise
                self._requests += 1
                try:
                    left = deadline - time.monotonic()
                    return await asyncio.wait_for(
                        asyncio.shield(future), None if left == float("inf") else max(0.0, left)
                    )
                except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
                    att.forget_pending(slot, seq)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    if not att.serving():
                        raise Gone() from None
                    raise att.timeout_error() from None
            except Gone:
                self._drop(att)

    def get_stats(self) -> dict:
        """The server's live counters plus this handle's own, as a dict."""
        stats: dict[str, Any] = {"name": self.name, "handle_requests": self._requests}
        if self._group is not None:
            return stats | self._group.stats()
        att = self._att
        if att is not None:
            try:
                with att.use() as seg:
                    stats.update(stats_from_header(seg.header))
                    stats["handle_slots"] = len(att.owned)
            except (Gone, BiCodecShmError):
                pass
        return stats

    def close(self) -> None:
        """End every call in flight (``ClientClosedError``) and give this handle's slots back.

        Safe to call twice, from any thread, and after a failed ``__init__``.
        """
        self._closed = True
        att, self._att = self._att, None
        if self._group is not None and self._pid == os.getpid():
            self._group.close(self._closed_error())
        if att is not None and self._pid == os.getpid():
            att.close(self._closed_error())

    def __enter__(self) -> DecoderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        att = self._att
        owned = len(att.owned) if att is not None else 0
        return f"<DecoderClient {self.name!r} slots={owned}/{self.max_slots} timeout={self.timeout}>"

    def _closed_error(self) -> ClientClosedError:
        """A fresh one per caller (one instance raised in several threads would garble its
        traceback)."""
        return ClientClosedError(f"this DecoderClient of {self.name!r} is closed")

    # -- request plumbing ---------------------------------------------------------------------

    def _prepare(self, semantic_ids: Any, global_ids: Any, dtype: str) -> tuple:
        if self._closed:
            raise self._closed_error()
        # Limits of the current server (or of the last one, while it is being replaced).
        vocab, global_vocab, max_tokens = self._limits
        semantic = as_token_array(semantic_ids, what="semantic_ids", vocab=vocab, max_len=max_tokens)
        globals_ = as_token_array(global_ids, what="global_ids", vocab=global_vocab,
                                  max_len=N_GLOBAL, exact_len=N_GLOBAL)  # fmt: skip
        return semantic, globals_, output_dtype_code(dtype)

    def _deadline(self, timeout: float | None) -> float:
        timeout = self.timeout if timeout is None else timeout
        return float("inf") if timeout is None else time.monotonic() + timeout

    # -- attachment lifecycle -----------------------------------------------------------------

    def _connect(self, deadline: float, *, block: bool = True) -> Attachment | None:
        """Attach, retrying every slice until ``deadline`` while no server serves the name."""
        while True:
            try:
                if self._group is None:
                    self._group = GroupRouter.find(self.name, max_slots=self.max_slots,
                                                   owner_uid=self.owner_uid)  # fmt: skip
                if self._group is not None:
                    att = self._group.connect()
                else:
                    att = Attachment(self.name, max_slots=self.max_slots, owner_uid=self.owner_uid)
                self._limits = (att.semantic_vocab, att.global_vocab, att.max_tokens)
                return att
            except ServerUnavailableError as exc:
                self._last_error = exc
            if time.monotonic() >= deadline:
                raise ServerUnavailableError(
                    f"no decoder server serves {self.name!r} and none started before the "
                    f"deadline ({self._last_error})"
                ) from None
            if not block:
                return None
            time.sleep(min(SLICE, max(0.0, deadline - time.monotonic())))

    def _attachment(self, deadline: float, *, block: bool = True) -> Attachment | None:
        """The live attachment, attaching again if the last one was dropped. With ``block``
        False, None means "no server yet; ask again after a slice" (asyncio must not sleep)."""
        if os.getpid() != self._pid:
            self._forked()
        if self._group is not None:  # a server group: the router picks a member per request
            if self._closed:
                raise self._closed_error()
            return self._group.attachment(deadline, block=block)
        while True:
            if self._closed:
                raise self._closed_error()
            att = self._att
            if att is not None and att.retired is None:
                return att
            with self._lock:
                if self._closed or (self._att is not None and self._att.retired is None):
                    continue
                try:
                    new = self._connect(0.0, block=False)
                except ServerUnavailableError:
                    if time.monotonic() >= deadline:
                        raise ServerUnavailableError(
                            f"the decoder server {self.name!r} is gone and no new one started "
                            f"before the request's deadline ({self._last_error})"
                        ) from None
                    new = None
                if new is not None:
                    self._att = new
                    return new
            if not block:
                return None
            time.sleep(min(SLICE, max(0.0, deadline - time.monotonic())))

    def _drop(self, att: Attachment) -> None:
        """Forget an attachment whose server went away; the next call attaches afresh."""
        att.retire(Gone())
        with self._lock:
            if self._att is att:
                self._att = None
        if self._closed:
            raise self._closed_error()

    def _forked(self) -> None:
        """In a forked child: the parent's attachment (and its slots) are not ours."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._lock = threading.Lock()
        att, self._att = self._att, None
        if att is not None:
            att.forget_after_fork()
        if self._group is not None:
            self._group.forget_after_fork()
