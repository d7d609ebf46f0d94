"""asyncio requests of an attachment: one waiter thread and one bell per attachment.

An asyncio request asks the server to ring the attachment's *bell* besides the slot's ``done``.
One waiter thread per attachment sleeps on the bell, then takes ``done`` of each pending slot
(the pairing read) and resolves the futures with ``loop.call_soon_threadsafe``: no thread per
request, and the event loop never blocks. The bell and the thread go away when idle.

``AsyncAnswers`` is a part of ``Attachment`` (attachment.py), kept apart because it is a
protocol of its own: it uses the attachment's lock, its ``use()`` of the mapping, its
``pending`` table, ``is_answer``/``take_result``, ``let_go`` and ``retire_gone``.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

import posix_ipc

from ..errors import BiCodecShmError, DecodeError
from .layout import NO_BELL
from .posts import drain
from .waiting import SLICE, Gone

_BELL_IDLE = 2.0  # seconds without async requests before the waiter thread and bell go away


class AsyncAnswers:
    """The asyncio half of ``Attachment``: registering a request's future, the waiter thread
    that sleeps on the bell, and resolving the futures (see the module docstring)."""

    def _claim_bell(self) -> int:
        with self.use() as seg:
            with self.lock:
                if self.bell is not None:
                    return self.bell
                for index in random.sample(range(self.n_slots), self.n_slots):
                    if seg.try_lock_bell(index):
                        drain(seg.bell(index))
                        self.bell = index
                        return index
                # Every bell is taken: the waiter polls instead (rare). Recorded, so that it
                # polls at its short interval while requests are pending (see _sleep_on_bell);
                # it forgets NO_BELL when it goes idle, and the next request tries again.
                self.bell = NO_BELL
                return NO_BELL

    def register(self, slot: int, seq: int, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> int:
        """Expect the answer to asyncio request ``seq`` in ``slot``; returns the bell the
        server must ring. The bell is claimed before the request is registered, so a failure
        (the server gone) leaves no future behind; registered before the waiter is started,
        so that the waiter thread (which only goes idle with nothing pending) cannot give the
        bell back under us."""
        bell = self.bell
        if bell is None:
            bell = self._claim_bell()
        with self.lock:
            if self.retired is not None:
                raise self._retired_error()
            self.pending[slot] = (seq, loop, future)
            bell = self.bell if self.bell is not None else bell
        self._ensure_waiter()
        return bell

    def forget_pending(self, slot: int, seq: int) -> None:
        """An asyncio request was cancelled or timed out: let go of its slot, unless its
        answer was already taken (then the slot went back with it)."""
        with self.lock:
            entry = self.pending.get(slot)
            if entry is None or entry[0] != seq:
                return
            del self.pending[slot]
        self.let_go(slot, seq)

    def _ensure_waiter(self) -> None:
        with self.lock:
            if self.retired is not None or (self.waiter is not None and self.waiter.is_alive()):
                return
            self.waiter = threading.Thread(target=self._wait_loop, daemon=True,
                                           name=f"bicodec-shm-waiter:{self.name}")  # fmt: skip
            self.waiter.start()

    def _wait_loop(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self.lock:
                if self.retired is not None:
                    return
                if self.pending:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > _BELL_IDLE:
                    # Give the bell back under the lock, so that a new request cannot claim
                    # the same bell in between and then lose it to this unlock.
                    if self.bell not in (None, NO_BELL) and self.segment is not None:
                        self.segment.unlock_bell(self.bell)
                    self.bell = None
                    self.waiter = None
                    return
                bell = self.bell
            try:
                woke = self._sleep_on_bell(bell)
                self._collect()
            except Gone:
                self.retire_gone()
                return
            except BiCodecShmError:
                # Retired (closed) after the check above and before the sleep took the
                # mapping: ``retire`` already failed every pending future, nothing is left.
                if self.retired is not None:
                    return
                raise
            if not woke and not self.serving():
                self.retire_gone()
                return

    def _sleep_on_bell(self, bell: int | None) -> bool:
        if bell in (None, NO_BELL):
            # No request pending, or no bell to be had: a slow poll is enough.
            time.sleep(SLICE if bell is None else SLICE / 10)
            return False
        with self.use() as seg:
            try:
                seg.bell(bell).acquire(SLICE)  # a worker thread: no signal handler runs here
                return True
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                return False

    def _collect(self) -> None:
        """Take the answer of every pending slot whose ``done`` was posted."""
        with self.lock:
            watched = list(self.pending.items())
        if not watched:
            return
        with self.use() as seg:
            for slot, (seq, loop, future) in watched:
                try:
                    seg.done(slot).acquire(0)
                except posix_ipc.BusyError:
                    continue
                if not self.is_answer(seg, slot, seq):
                    continue  # a stale post; the real answer is still to come
                with self.lock:
                    if self.pending.get(slot, (None,))[0] != seq:
                        continue  # let go of meanwhile (cancelled): its slot is not ours
                    del self.pending[slot]
                try:
                    resolve(loop, future, self.take_result(seg, slot, seq), True)
                except DecodeError as exc:
                    resolve(loop, future, exc, False)


def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any, ok: bool) -> None:
    """Settle ``future`` in its own event loop's thread (a no-op once it is done, or once its
    loop is closed)."""

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
