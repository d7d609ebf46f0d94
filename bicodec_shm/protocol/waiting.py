"""What a client thread waiting on a server uses: the slice it sleeps in, the wake-up list of an
attachment, and ``Gone``, which tells the client to re-attach.

numpy-free and torch-free; no shared memory here.
"""

from __future__ import annotations

import threading

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
