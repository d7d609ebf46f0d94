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
from .group import GroupRouter, read_group
from .served import describe_served
from .transport import N_GLOBAL, NO_BELL, ServerState, probe, stats_from_header, validate_name
from .validation import as_token_array, output_dtype_code

DEFAULT_TIMEOUT = 30.0
DEFAULT_CLIENT_SLOTS = 8
# After a server stopped on purpose, how long requests wait for a successor to take the name
# before they fail with ServerUnavailableError (a crashed server is waited for until the
# request's own deadline: a supervisor restarts it). A rolling restart's new `serve` takes the
# name before it loads its model, but only once its interpreter is up: 0.5 s here when idle,
# over 2 s on a loaded 2-core machine (the 10-minute soak failed 88% of its requests at 2 s).
STOP_GRACE = 5.0

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
        stop_grace: seconds requests wait for a successor after their server stopped on
            purpose (SIGTERM, Ctrl-C) before failing with ``ServerUnavailableError``; raise
            it where a rolling restart's new server takes long to start.

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
        stop_grace: float = STOP_GRACE,
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
        self.stop_grace = stop_grace
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._requests = 0
        self._last_error: Exception | None = None
        self._stopped_at: float | None = None  # when a server that stopped on purpose went away
        self._closed = False
        self._t_asked = time.monotonic()
        att = self._connect(self._t_asked + connect_timeout)
        if self._group is None:
            self._att = att
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
            semantic, globals_ = _fit(att, semantic, globals_)
            try:
                slot, seq = att.take_slot(deadline)
            except Gone:
                self._drop(att)
                continue
            try:
                att.submit(slot, seq, semantic, globals_, code, NO_BELL)
                self._requests += 1
                return att.wait_result(slot, seq, deadline)
            except Gone:
                self._drop(att)
            except BaseException:
                # Ctrl-C, a signal handler's exception (a SIGALRM timeout), a timeout, an
                # error answer: the slot goes back, or is let go of if the server may still
                # have the request (see attachment.py). Never kept out of use.
                att.done_with(slot, seq)
                raise

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
            semantic, globals_ = _fit(att, semantic, globals_)
            try:
                slot, seq = await att.take_slot_async(deadline)
            except Gone:
                self._drop(att)
                continue
            future = loop.create_future()
            try:
                bell = att.register(slot, seq, loop, future)
                att.submit(slot, seq, semantic, globals_, code, bell)
                self._requests += 1
                left = deadline - time.monotonic()
                try:
                    return await asyncio.wait_for(
                        asyncio.shield(future), None if left == float("inf") else max(0.0, left)
                    )
                except asyncio.TimeoutError:
                    if not att.serving():
                        raise Gone() from None
                    att.forget_pending(slot, seq)
                    raise att.timeout_error() from None
            except Gone:
                _discard(future)
                att.forget_pending(slot, seq)
                self._drop(att)
            except BaseException:  # cancelled, or an error answer: see ``decode``
                _discard(future)
                att.forget_pending(slot, seq)
                att.done_with(slot, seq)
                raise

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
        with self._lock:  # no attachment made by a call in flight can slip in after this
            self._closed = True
            att, self._att = self._att, None
            group = self._group
        if group is not None and self._pid == os.getpid():
            group.close(self._closed_error())
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
        """Validate against the limits of the server last attached (``_fit`` checks again
        against the attachment a request actually uses: a server may have been replaced by
        one with other limits, or a group's members may differ)."""
        if self._closed:
            raise self._closed_error()
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
        """Attach to whatever serves the name now (a server, or a group's member), retrying
        every slice until ``deadline`` while nothing does."""
        while True:
            try:
                att = self._connect_once()
                self._limits = (att.semantic_vocab, att.global_vocab, att.max_tokens)
                return att
            except ServerUnavailableError as exc:
                self._last_error = exc
            if time.monotonic() >= deadline:
                waited = "" if deadline <= self._t_asked else " before the deadline"
                raise ServerUnavailableError(
                    f"no decoder server serves {self.name!r}{waited} ({self._last_error})"
                    f"{_served_hint(self.name)}"
                ) from None
            if not block:
                return None
            time.sleep(min(SLICE, max(0.0, deadline - time.monotonic())))

    def _connect_once(self) -> Attachment:
        if self._group is None:
            info = read_group(self.name)
            if info is not None and not info.alive:  # a group starting, stopping or dead
                raise ServerUnavailableError(f"the server group {self.name!r} is not up")
            if info is not None:
                self._group = GroupRouter(info, max_slots=self.max_slots, owner_uid=self.owner_uid)
        if self._group is not None:
            return self._group.connect()
        return Attachment(self.name, max_slots=self.max_slots, owner_uid=self.owner_uid)

    def _attachment(self, deadline: float, *, block: bool = True) -> Attachment | None:
        """The live attachment, attaching again if the last one was dropped. With ``block``
        False, None means "no server yet; ask again after a slice" (asyncio must not sleep).

        Raises ``ServerUnavailableError`` at ``deadline``, or sooner when the server stopped on
        purpose (SIGTERM, Ctrl-C) and no new one has claimed the name within ``STOP_GRACE``
        seconds: a rolling restart's successor claims it well within that, and is waited for
        as long as it is starting."""
        if os.getpid() != self._pid:
            self._forked()
        while True:
            if self._closed:
                raise self._closed_error()
            group = self._group
            if group is not None:
                # A group: the router picks a member per request. If no member serves, or the
                # group under the name changed, find out again what serves the name.
                att = None if group.outdated() else group.pick()
                if att is not None:
                    return att
                self._regroup(group)
            else:
                att = self._att
                if att is not None and att.retired is None:
                    return att
            with self._lock:
                if self._closed:
                    continue
                if self._att is not None and self._att.retired is None:
                    return self._att
                try:
                    new = self._connect(0.0, block=False)
                except ServerUnavailableError:
                    new = None
                if new is not None:
                    if self._group is None:
                        self._att = new
                    self._stopped_at = None
                    return new
            self._give_up_if_stopped(deadline)
            if not block:
                return None
            time.sleep(min(SLICE, max(0.0, deadline - time.monotonic())))

    def _give_up_if_stopped(self, deadline: float) -> None:
        now = time.monotonic()
        stopped = self._stopped_at
        if now >= deadline:
            raise ServerUnavailableError(
                f"the decoder server {self.name!r} is gone and no new one started before the "
                f"request's deadline ({self._last_error}){_served_hint(self.name)}"
            )
        if stopped is not None and now >= stopped + self.stop_grace:
            if probe(self.name) is ServerState.BUSY:
                self._stopped_at = now  # a successor is starting (it owns the name): wait on
                return
            raise ServerUnavailableError(
                f"the decoder server {self.name!r} stopped (SIGTERM or Ctrl-C) and no new server "
                f"took the name within {self.stop_grace:g} s{_served_hint(self.name)}"
            )

    def _regroup(self, group: GroupRouter) -> None:
        """Forget a group router whose group no longer serves the name as it did (a member
        set or epoch change, a single server in its place): its calls in flight resubmit."""
        with self._lock:
            if self._group is not group:
                return
            self._group = None
            self._att = None
        group.close(Gone())

    def _drop(self, att: Attachment) -> None:
        """Forget an attachment whose server went away; the next call attaches afresh."""
        att.retire(Gone())
        with self._lock:
            if self._att is att:
                self._att = None
                if att.stopped_cleanly and self._stopped_at is None:
                    self._stopped_at = time.monotonic()
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


def _fit(att: Attachment, semantic: np.ndarray, globals_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Check a validated request against the limits of the server that will decode it, before
    anything is written (a restarted server may have a smaller --max-tokens)."""
    if (
        semantic.shape[0] > att.max_tokens
        or int(semantic.max()) >= att.semantic_vocab
        or int(globals_.max()) >= att.global_vocab
    ):
        semantic = as_token_array(semantic, what="semantic_ids", vocab=att.semantic_vocab,
                                  max_len=att.max_tokens)  # fmt: skip
        globals_ = as_token_array(globals_, what="global_ids", vocab=att.global_vocab,
                                  max_len=N_GLOBAL, exact_len=N_GLOBAL)  # fmt: skip
    return semantic, globals_


def _discard(future: asyncio.Future) -> None:
    """A future nobody will await: cancel it, or mark its exception as retrieved, so that
    asyncio never logs "Future exception was never retrieved" for it."""
    if not future.cancel() and not future.cancelled():
        future.exception()


def _served_hint(name: str) -> str:
    """"; served now: 'a', 'b'" for an error about a name nobody serves (a typo, say)."""
    return "; " + describe_served(exclude=name)
