"""What a client request waiting on a server uses: the slice it sleeps in, the wake-up list of an
attachment, the line of requests waiting for one of its slots (first come, first served), and
``Gone``, which tells the client to re-attach.

numpy-free and torch-free; no shared memory here.
"""

from __future__ import annotations

import asyncio
import threading
import time

SLICE = 0.1  # seconds a waiter sleeps before checking that its server still serves


class Gone(Exception):
    """Internal: this attachment's server went away; re-attach and resubmit.

    Never reaches a caller: ``DecoderClient`` catches it and turns it into a retry, or into
    ``ServerUnavailableError`` at the deadline.
    """


class Wakeups:
    """Threads waiting for a change of the attachment (a slot of ours back, the last user
    gone), woken by whoever makes it. Every method is called with the attachment's lock held.

    Not ``threading.Condition``: its ``wait`` releases the lock it waits with and re-takes it
    in Python code, where a signal handler's exception can land between the two (after the
    release, before its ``try``; or in the re-take). The caller's ``with`` then releases the
    lock a second time, dropping another thread's hold under it (mutual exclusion gone, and
    that thread's own release raises ``RuntimeError``), or the lock ends up held by nobody.
    Here each waiter sleeps on a lock of its own, outside the attachment's lock, which is only
    ever taken with ``with``."""

    def __init__(self) -> None:
        self.waiters: list[threading.Lock] = []

    def add(self) -> threading.Lock:
        waiter = threading.Lock()
        waiter.acquire()  # released once, by the ``notify_all`` that takes it off the list
        self.waiters.append(waiter)
        return waiter

    def discard(self, waiter: threading.Lock) -> None:
        if waiter in self.waiters:
            self.waiters.remove(waiter)

    def notify_all(self) -> None:
        # Off the list first, then released: each waiter exactly once, even if this is cut
        # short (one not released yet wakes at its timeout, a slice at most).
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            waiter.release()


class Waiter:
    """One request (``seq``) in line for a slot of the attachment, until ``deadline``.

    A thread sleeps on a lock of its own (``lock``: held means "no wake-up pending"), a
    coroutine awaits ``future`` in its event loop ``loop``. ``wake`` is called with the
    attachment's lock held; a wake-up is never lost: the thread's next sleep returns at once,
    and a coroutine's future is renewed (``rearm``) only under that lock, before it looks for
    its slot again."""

    __slots__ = ("seq", "deadline", "lock", "loop", "future")

    def __init__(self, seq: int, deadline: float, loop: asyncio.AbstractEventLoop | None) -> None:
        self.seq, self.deadline, self.loop = seq, deadline, loop
        self.lock: threading.Lock | None = None
        self.future: asyncio.Future | None = None
        if loop is None:
            self.lock = threading.Lock()
            self.lock.acquire()  # released by ``wake``
        else:
            self.future = loop.create_future()

    def rearm(self) -> None:
        if self.future is not None and self.future.done():
            self.future = self.loop.create_future()  # type: ignore[union-attr]

    def wake(self) -> None:
        if self.lock is not None:
            if self.lock.locked():
                self.lock.release()
        elif not self.future.done():  # type: ignore[union-attr]
            try:
                self.loop.call_soon_threadsafe(_settle, self.future)  # type: ignore[union-attr]
            except RuntimeError:
                pass  # its event loop is closed: nobody awaits it


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class Line:
    """The requests waiting for a slot of the attachment, oldest first: a slot given back goes
    to the oldest live one (``first``), and nobody claims a slot ahead of it. Every method is
    called with the attachment's lock held.

    A waiter stays in its place across its slices, until it leaves with a slot or an error
    (``leave``). It is handed a slot by booking the slot to its request (``using[slot] = seq``,
    one store) and woken; it leaves the line when it finds the slot. Meanwhile ``first`` skips
    it, and a waiter whose deadline has passed (it is about to leave)."""

    def __init__(self) -> None:
        self.waiters: dict[int, Waiter] = {}  # seq -> its waiter, in the order they came

    def __bool__(self) -> bool:
        return bool(self.waiters)

    def get(self, seq: int) -> Waiter | None:
        return self.waiters.get(seq)

    def join(self, seq: int, deadline: float, loop: asyncio.AbstractEventLoop | None) -> Waiter:
        waiter = self.waiters.get(seq)
        if waiter is None:
            waiter = Waiter(seq, deadline, loop)
            self.waiters[seq] = waiter  # one store: in line, at the back
        return waiter

    def first(self, using: dict[int, int]) -> Waiter | None:
        """The oldest waiter whose deadline has not passed and that holds no slot (``using``:
        slot -> the request that has it), or None."""
        if not self.waiters:
            return None
        holding = set(using.values())
        now = time.monotonic()
        for waiter in self.waiters.values():
            if waiter.deadline > now and waiter.seq not in holding:
                return waiter
        return None

    def leave(self, seq: int) -> bool:
        """Take ``seq`` off the line; whether it was in it."""
        return self.waiters.pop(seq, None) is not None

    def wake_first(self, using: dict[int, int]) -> None:
        """Room for a claim came (a slot let go of, a claimer gone): the oldest may claim."""
        waiter = self.first(using)
        if waiter is not None:
            waiter.wake()

    def wake_all(self) -> None:
        for waiter in list(self.waiters.values()):
            waiter.wake()
