"""The client handle: write tokens into an owned slot, ring the server, read PCM back.

numpy and posix_ipc only: a worker that decodes through the server never imports torch.

How a handle uses the segment (see transport.py for the layout and slot states):

- At attach it claims ``slots`` slots for good, each guarded by an OFD lock that the kernel
  drops if this process dies; the hot path then needs no cross-process compare-and-swap.
- A synchronous request waits on its own slot's done semaphore, in short slices so that a
  dead server is noticed.
- Asynchronous requests ask the server to ring one *doorbell* semaphore instead (the done
  semaphore of one extra slot claimed for that purpose). One waiter thread per handle sleeps
  on it and resolves futures with ``loop.call_soon_threadsafe``: no thread per request, and
  the event loop never blocks.
- If the server dies, requests wait (in slices) until a new server appears under the same
  name, re-attach and resubmit — decoding is a pure function, so a retry is safe — or raise
  ``ServerUnavailableError`` when their timeout runs out.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import threading
import time
import weakref
from collections import deque
from typing import Any

import numpy as np
import posix_ipc

from .errors import (
    BiCodecShmError,
    DecodeError,
    DecodeTimeoutError,
    SegmentError,
    ServerUnavailableError,
)
from .transport import (
    CLAIMED,
    DONE,
    N_GLOBAL,
    READY,
    OutputDtype,
    Segment,
    SlotState,
    Status,
    drain,
    stats_from_header,
)
from .validation import as_token_array, output_dtype_code

_FLOAT32 = int(OutputDtype.FLOAT32)
DEFAULT_TIMEOUT = 30.0
DEFAULT_CLIENT_SLOTS = 4
_SLICE = 0.1  # seconds a waiter sleeps before checking that the server is still alive


class _ServerGone(Exception):
    """Internal: the attachment's server died; re-attach and resubmit."""


class _SlotPool:
    """The handle's free request slots, shared by its threads and coroutines (backpressure)."""

    def __init__(self, slots: list[int]) -> None:
        self._free = deque(slots)
        self._lock = threading.Lock()
        self._waiters: deque[Any] = deque()  # threading.Event or (loop, future)
        self.closed = False

    def take(self, deadline: float) -> int:
        while True:
            with self._lock:
                if self._free:
                    return self._free.popleft()
                event = threading.Event()
                self._waiters.append(event)
            # Wait in slices: if the server dies, the slots we wait for never come back.
            while not event.wait(min(_SLICE, max(0.0, deadline - time.monotonic()))):
                if self.closed or time.monotonic() >= deadline:
                    self._forget(event)
                    raise _ServerGone() if self.closed else _slots_timeout()

    def try_take(self) -> int | None:
        with self._lock:
            return self._free.popleft() if self._free else None

    async def take_async(self, deadline: float) -> int:
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._free:
                    return self._free.popleft()
                future = loop.create_future()
                entry = (loop, future)
                self._waiters.append(entry)
            try:
                while True:
                    left = max(0.0, deadline - time.monotonic())
                    try:
                        await asyncio.wait_for(asyncio.shield(future), min(_SLICE, left))
                        break
                    except asyncio.TimeoutError:
                        if self.closed:
                            raise _ServerGone() from None
                        if time.monotonic() >= deadline:
                            raise _slots_timeout() from None
            except BaseException:
                self._forget(entry)
                raise

    def close(self) -> None:
        """Wake every waiter: this pool's attachment is gone."""
        self.closed = True
        with self._lock:
            waiters, self._waiters = list(self._waiters), deque()
        for waiter in waiters:
            _wake(waiter)

    def give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)
            waiter = self._waiters.popleft() if self._waiters else None
        _wake(waiter)

    def _forget(self, waiter: Any) -> None:
        with self._lock:
            try:
                self._waiters.remove(waiter)
                return
            except ValueError:
                pass  # already woken: pass the wake-up on so that no free slot is stranded
            nxt = self._waiters.popleft() if self._waiters and self._free else None
        _wake(nxt)


def _wake(waiter: Any) -> None:
    if waiter is None:
        return
    if isinstance(waiter, threading.Event):
        waiter.set()
        return
    loop, future = waiter

    def resolve() -> None:
        if not future.done():
            future.set_result(None)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:
        pass  # that event loop is closed


def _slots_timeout() -> DecodeTimeoutError:
    return DecodeTimeoutError(
        "timed out waiting for a free slot of this handle: all its slots are busy "
        "(raise the handle's `slots` or the timeout)"
    )


class _Attachment:
    """One attachment to one server incarnation: the mapped segment and the slots owned in it.

    Replaced as a whole when the server is replaced or the process forks.
    """

    def __init__(self, name: str, n_slots: int) -> None:
        self.segment = Segment.attach(name)
        seg = self.segment
        try:
            if not seg.server_alive():
                raise ServerUnavailableError(
                    f"the segment {name!r} exists but its server (pid "
                    f"{int(seg.header['server_pid'])}) is not running"
                )
            header = seg.header
            # Limits the client validates against, read once.
            self.semantic_vocab = int(header["semantic_vocab"])
            self.global_vocab = int(header["global_vocab"])
            self.max_tokens = int(header["max_tokens"])
            self.owned: list[int] = []
            self.generation: dict[int, int] = {}
            self._claim(n_slots)
            if not self.owned:
                raise BiCodecShmError(
                    f"no free slot on {name!r}: all {seg.layout.n_slots} slots are owned by "
                    "other clients; start the server with more --slots"
                )
        except BaseException:
            self.close()
            raise
        self.pool = _SlotPool(list(self.owned))
        self.seq = itertools.count(1)
        self.doorbell: int | None = None
        self.pending: dict[int, tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.pending_lock = threading.Lock()
        self.waiter: threading.Thread | None = None
        self.closed = False
        # Threads inside a blocking wait on one of this attachment's semaphores. Closing a
        # semaphore that a thread is waiting on is undefined behaviour (it can crash), so
        # close() waits for this to drop to zero; every wait is at most one _SLICE long.
        self.waiting = 0
        self.idle = threading.Condition()

    def _claim(self, n: int) -> list[int]:
        """Claim up to ``n`` FREE slots; returns those claimed."""
        seg = self.segment
        total = seg.layout.n_slots
        start = random.randrange(total)  # spread clients over the table
        claimed: list[int] = []
        for k in range(total):
            if len(claimed) == n:
                break
            slot = (start + k) % total
            if seg.slots["state"][slot] != SlotState.FREE or not seg.try_lock_slot(slot):
                continue
            if seg.slots["state"][slot] != SlotState.FREE:  # reclaim raced us; not ours
                seg.unlock_slot(slot)
                continue
            seg.slots["owner_pid"][slot] = os.getpid()
            self.generation[slot] = int(seg.slots["generation"][slot])
            seg.slots["state"][slot] = SlotState.CLAIMED
            drain(seg.done[slot])
            claimed.append(slot)
        self.owned.extend(claimed)
        return claimed

    def server_alive(self) -> bool:
        # A replacement server creates a new segment; this mapping keeps the old one's header,
        # so "our server is alive" is exactly "the header's server is alive".
        return self.segment.server_alive()

    def submit(self, slot: int, seq: int, semantic: np.ndarray, global_ids: np.ndarray,
               dtype: int, notify: int) -> None:  # fmt: skip
        """Write request number ``seq`` into ``slot`` and ring the server."""
        seg = self.segment
        n = semantic.shape[0]
        seg.tokens[slot, :n] = semantic  # payload first ...
        seg.globals[slot] = global_ids
        slots = seg.field
        slots["n_tokens"][slot] = n
        slots["n_global"][slot] = N_GLOBAL
        slots["dtype"][slot] = dtype
        slots["notify"][slot] = notify
        slots["req_generation"][slot] = self.generation[slot]
        slots["request_seq"][slot] = seq
        slots["status"][slot] = Status.OK
        slots["t_submit_ns"][slot] = time.monotonic_ns()
        # Order matters: payload and fields above, then the state word, then the post.
        slots["state"][slot] = READY
        seg.ready.release()

    def result_ready(self, slot: int, seq: int) -> bool:
        f = self.segment.field
        return f["state"][slot] == DONE and f["result_seq"][slot] == seq

    def take_result(self, slot: int) -> np.ndarray:
        """Copy a DONE slot's PCM out (or raise its error) and hand the slot back to the pool."""
        seg = self.segment
        f = seg.field
        try:
            status = int(f["status"][slot])
            if status != Status.OK:
                detail = seg.error_text(slot)
                name = Status(status).name if status in tuple(Status) else str(status)
                raise DecodeError(f"server rejected the request ({name}): {detail}",
                                  code=status, detail=detail)  # fmt: skip
            n = int(f["n_samples"][slot])
            if f["dtype"][slot] == _FLOAT32:
                return seg.pcm_float32(slot, n).copy()
            return seg.pcm_int16(slot, n).copy()
        finally:
            f["state"][slot] = CLAIMED
            self.pool.give(slot)

    def abandon(self, slot: int, seq: int) -> None:
        """A request timed out on our side: keep its slot out of the pool until the server
        answers it, so that we never overwrite a slot the server may be reading. The waiter
        thread hands it back once the answer arrives."""
        with self.pending_lock:
            self.pending[slot] = (seq, None, None)  # type: ignore[assignment]
        self.ensure_waiter(doorbell=False)

    # -- the waiter thread (asyncio results and abandoned slots) ----------------------------

    def ensure_waiter(self, *, doorbell: bool = True) -> int | None:
        """Start the waiter thread if needed; returns the doorbell's slot index."""
        with self.pending_lock:
            if doorbell and self.doorbell is None:
                self.doorbell = self._take_doorbell()
            if self.waiter is None:
                self.waiter = threading.Thread(target=self._wait_loop, daemon=True,
                                               name="bicodec-shm-waiter")  # fmt: skip
                self.waiter.start()
            return self.doorbell

    def _take_doorbell(self) -> int:
        got = self._claim(1)
        if got:
            return got[0]
        if len(self.owned) > 1:
            slot = self.pool.try_take()
            if slot is not None:
                return slot  # give up a request slot for good
        raise BiCodecShmError(
            "async use needs a second slot for its doorbell and none is free; "
            "start the server with more --slots"
        )

    def _wait_loop(self) -> None:
        while not self.closed:
            bell = None if self.doorbell is None else self.segment.done[self.doorbell]
            woke = False
            try:
                if bell is None:
                    time.sleep(_SLICE)  # only abandoned slots to watch: a slow poll is enough
                else:
                    bell.acquire(_SLICE)
                    woke = True
            except posix_ipc.BusyError:
                pass
            except posix_ipc.Error:
                return  # the semaphore was closed under us: the attachment is going away
            if not woke and not self.closed and not self.server_alive():
                self._fail_all(_ServerGone())
            self._dispatch()
            with self.pending_lock:
                if self.closed or (self.doorbell is None and not self.pending):
                    self.waiter = None
                    return

    def _dispatch(self) -> None:
        with self.pending_lock:
            done = [(slot, entry) for slot, entry in self.pending.items()
                    if self.result_ready(slot, entry[0])]  # fmt: skip
            for slot, _ in done:
                del self.pending[slot]
        for slot, (_, loop, future) in done:
            if future is None:  # an abandoned request: just recycle its slot
                self.segment.slots["state"][slot] = SlotState.CLAIMED
                self.pool.give(slot)
                continue
            try:
                result: Any = self.take_result(slot)
                ok = True
            except DecodeError as exc:
                result, ok = exc, False
            _resolve(loop, future, result, ok)

    def _fail_all(self, exc: Exception) -> None:
        with self.pending_lock:
            entries, self.pending = list(self.pending.values()), {}
        for _, loop, future in entries:
            if future is not None:
                _resolve(loop, future, exc, False)

    def enter_wait(self) -> None:
        with self.idle:
            if self.closed:
                raise BiCodecShmError("this DecoderClient is closed")
            self.waiting += 1

    def exit_wait(self) -> None:
        with self.idle:
            self.waiting -= 1
            self.idle.notify_all()

    def close(self) -> None:
        """Give every idle slot back (FREE) and drop the locks; busy slots go to the reaper."""
        self.closed = True
        seg = self.segment
        if seg is None or seg.slots is None:
            return
        if hasattr(self, "pool"):
            self.pool.close()
        waiter = getattr(self, "waiter", None)
        if waiter is not None and waiter is not threading.current_thread():
            waiter.join()
        if hasattr(self, "idle"):
            with self.idle:
                self.idle.wait_for(lambda: self.waiting == 0, timeout=5 * _SLICE)
        for slot in getattr(self, "owned", []):
            if int(seg.slots["state"][slot]) in (SlotState.CLAIMED, SlotState.DONE):
                seg.slots["owner_pid"][slot] = 0
                seg.slots["state"][slot] = SlotState.FREE
        seg.close()  # closing the fd releases every OFD lock this attachment holds


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any, ok: bool) -> None:
    def apply() -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    try:
        loop.call_soon_threadsafe(apply)
    except RuntimeError:
        pass  # that event loop is closed


_live_clients: weakref.WeakSet[DecoderClient] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The child shares the parent's open file descriptions; keeping them open would keep the
    # parent's slot locks alive after the parent dies. Drop them; the child re-attaches lazily.
    for client in list(_live_clients):
        client._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DecoderClient:
    """A handle on the shared decoder served under ``name``.

    Args:
        name: the server's segment name (``bicodec-shm serve --name``).
        timeout: default seconds a request may take end to end (None: wait forever). On
            expiry it raises ``DecodeTimeoutError``, or ``ServerUnavailableError`` if the server
            died and none came back.
        slots: request slots this handle owns: how many of its requests can be in flight at
            once. More concurrent requests queue in the handle (backpressure).
        connect_timeout: seconds to wait for a server to appear at construction (0: fail at
            once with ``ServerUnavailableError``).

    Thread-safe and asyncio-safe; one handle can serve many threads and coroutines.
    """

    _att: _Attachment | None = None
    _last_error: Exception | None = None

    def __init__(
        self,
        name: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        slots: int = DEFAULT_CLIENT_SLOTS,
        connect_timeout: float = 0.0,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.name = name
        self.timeout = timeout
        self.n_slots = slots
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self._requests = 0
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
        Returns:
            (320·T,) int16 or float32 samples at 16 kHz.
        """
        request = self._prepare(semantic_ids, global_ids, dtype)
        deadline = self._deadline(timeout)
        while True:
            att = self._attachment(deadline)
            if att is None:
                time.sleep(_SLICE)
                continue
            slot = att.pool.take(deadline)
            try:
                return self._roundtrip(att, slot, request, deadline)
            except _ServerGone:
                self._replace(att)

    async def decode_async(self, semantic_ids: Any, global_ids: Any, *, dtype: str = "int16",
                           timeout: float | None = None) -> np.ndarray:  # fmt: skip
        """``decode`` for asyncio: never blocks the event loop, starts no thread per call."""
        request = self._prepare(semantic_ids, global_ids, dtype)
        deadline = self._deadline(timeout)
        while True:
            att = self._attachment(deadline)  # never sleeps
            if att is None:  # the server is being replaced: wait without blocking the loop
                await asyncio.sleep(_SLICE)
                continue
            bell = att.ensure_waiter()  # before taking a request slot: it may need one
            slot = await att.pool.take_async(deadline)
            try:
                return await self._roundtrip_async(att, slot, bell, request, deadline)
            except _ServerGone:
                self._replace(att)

    def get_stats(self) -> dict:
        """The server's live counters plus this handle's own, as a dict."""
        att = self._att
        stats: dict[str, Any] = {"name": self.name, "handle_requests": self._requests}
        if att is not None and att.segment.header is not None:
            stats.update(stats_from_header(att.segment.header))
            stats["handle_slots"] = len(att.owned)
        return stats

    def close(self) -> None:
        """Release this handle's slots. Safe to call twice, and after a failed __init__."""
        self._closed = True
        att, self._att = self._att, None
        if att is not None and self._pid == os.getpid():
            att.close()

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
        owned = len(att.owned) if att else 0
        return f"<DecoderClient {self.name!r} slots={owned} timeout={self.timeout}>"

    # -- request plumbing ---------------------------------------------------------------------

    def _prepare(self, semantic_ids: Any, global_ids: Any, dtype: str) -> tuple:
        if self._closed:
            raise BiCodecShmError("this DecoderClient is closed")
        # Limits of the current server (or of the last one, while it is being replaced).
        vocab, global_vocab, max_tokens = self._limits
        semantic = as_token_array(semantic_ids, what="semantic_ids", vocab=vocab, max_len=max_tokens)
        globals_ = as_token_array(global_ids, what="global_ids", vocab=global_vocab,
                                  max_len=N_GLOBAL, exact_len=N_GLOBAL)  # fmt: skip
        return semantic, globals_, output_dtype_code(dtype)

    def _deadline(self, timeout: float | None) -> float:
        timeout = self.timeout if timeout is None else timeout
        return float("inf") if timeout is None else time.monotonic() + timeout

    def _roundtrip(self, att: _Attachment, slot: int, request: tuple, deadline: float) -> np.ndarray:
        semantic, globals_, dtype = request
        seq = next(att.seq)
        att.submit(slot, seq, semantic, globals_, dtype, notify=slot)
        self._requests += 1
        done = att.segment.done[slot]
        while True:
            att.enter_wait()
            try:
                done.acquire(min(_SLICE, max(0.0, deadline - time.monotonic())))
            except posix_ipc.BusyError:
                pass
            finally:
                att.exit_wait()
            if att.result_ready(slot, seq):
                return att.take_result(slot)
            if not att.server_alive():
                raise _ServerGone()
            if time.monotonic() >= deadline:
                att.abandon(slot, seq)
                raise self._timeout_error(att)

    async def _roundtrip_async(self, att: _Attachment, slot: int, bell: int, request: tuple,
                               deadline: float) -> np.ndarray:  # fmt: skip
        semantic, globals_, dtype = request
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        seq = next(att.seq)
        # Register before submitting, so that the waiter can never miss the answer.
        with att.pending_lock:
            att.pending[slot] = (seq, loop, future)
        att.submit(slot, seq, semantic, globals_, dtype, notify=bell)
        self._requests += 1
        try:
            left = max(0.0, deadline - time.monotonic())
            return await asyncio.wait_for(asyncio.shield(future), None if left == float("inf") else left)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if not future.done():
                att.abandon(slot, seq)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._timeout_error(att) from None

    def _timeout_error(self, att: _Attachment) -> DecodeTimeoutError:
        return DecodeTimeoutError(
            f"no answer from the decoder server {self.name!r} within the timeout "
            f"(server pid {int(att.segment.header['server_pid'])} is "
            f"{'alive: it may be overloaded' if att.server_alive() else 'gone'})"
        )

    # -- attachment lifecycle -----------------------------------------------------------------

    def _connect(self, deadline: float) -> _Attachment:
        """Attach, retrying every slice until ``deadline`` while no live server is found."""
        while True:
            try:
                att = _Attachment(self.name, self.n_slots)
                self._limits = (att.semantic_vocab, att.global_vocab, att.max_tokens)
                return att
            except (ServerUnavailableError, SegmentError) as exc:
                # SegmentError too: a new server may be half way through creating the segment.
                if time.monotonic() >= deadline:
                    raise exc from None
            time.sleep(min(_SLICE, max(0.0, deadline - time.monotonic())))

    def _attachment(self, deadline: float) -> _Attachment | None:
        """The live attachment, re-attaching if needed; None if no server is there yet but the
        deadline has not passed (the caller waits a slice, in its own way, and asks again)."""
        if os.getpid() != self._pid:
            self._forked()
        att = self._att
        if att is not None and not att.closed:
            return att
        if self._closed:
            raise BiCodecShmError("this DecoderClient is closed")
        with self._lock:
            if self._att is None or self._att.closed:
                # One attempt, no sleeping here: asyncio callers must not block the loop.
                try:
                    self._att = self._connect(0.0)
                except (ServerUnavailableError, SegmentError) as exc:
                    self._last_error = exc
                    if time.monotonic() >= deadline:
                        raise self._gone_error() from None
                    return None
            return self._att

    def _gone_error(self) -> ServerUnavailableError:
        return ServerUnavailableError(
            f"the decoder server {self.name!r} is gone and no new one started before the "
            f"request's deadline ({self._last_error})"
        )

    def _replace(self, old: _Attachment) -> None:
        """Forget an attachment whose server died (the next call re-attaches)."""
        with self._lock:
            if self._att is old:
                old.closed = True
                old.pool.close()
                old._fail_all(_ServerGone())
        # The old segment is left mapped until garbage collection: other threads may still be
        # reading from it. Its server is dead and the new server unlinked its name.

    def _forked(self) -> None:
        """Called in a forked child: the parent's slots are not ours."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._lock = threading.Lock()
        att, self._att = self._att, None
        if att is not None:
            att.closed = True
            att.segment.drop_fd()

