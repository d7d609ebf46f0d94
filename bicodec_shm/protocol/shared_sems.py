"""Semaphores inside the segment itself, for a segment handed over a socket (handoff.py).

A segment served to other users of the group (``--mode 0o660``) lives in a sealed memfd that
nobody can truncate, and so must its doorbells: a named semaphore is a file in /dev/shm that
every process allowed to post it may also truncate (every process mapping it then dies with
SIGBUS). So such a segment keeps its semaphores in its last pages, as glibc's process-shared
``sem_t`` (``sem_init(sem, 1, 0)``), and every process reaches them through its own mapping.

Region layout (``Layout.sems_off``, one ``SEM_BYTES`` record each, page aligned)::

    index 0           ready
    index 1           free
    index 2 + I       req.I      (I < n_slots)
    index 2 + S + I   done.I
    index 2 + 2S + J  bell.J

``SharedSemaphore`` answers the calls the protocol makes of a ``posix_ipc.Semaphore``
(``acquire``, ``release``, ``value``, ``name``) and raises the same exceptions, so nothing above
the segment tells the two apart. Its region is a mapping of its own that every semaphore object
keeps alive: a thread still waiting on one when the segment closes waits on mapped memory,
never on freed memory. Like any byte of the segment, a semaphore can be scribbled on by a
process that maps it; nothing trusts a post (see segment.py), and every wait is timed.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import posix_ipc

from .layout import SEM_BYTES
from .semwait import _CLOCK, _clockwait, _now, _Timespec

_libc = ctypes.CDLL(None, use_errno=True)  # releases the GIL: waits may block
for _fn in ("sem_init", "sem_post", "sem_trywait", "sem_getvalue"):
    getattr(_libc, _fn).restype = ctypes.c_int
_libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_libc.sem_post.argtypes = [ctypes.c_void_p]
_libc.sem_trywait.argtypes = [ctypes.c_void_p]
_libc.sem_getvalue.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]


def kind_index(kind: str, index: int, n_slots: int) -> int:
    """The record index of semaphore ``kind`` (``ready``, ``free``, ``req``, ``done``,
    ``bell``) number ``index`` in a segment of ``n_slots`` slots."""
    if kind in ("ready", "free"):
        return 0 if kind == "ready" else 1
    base = {"req": 2, "done": 2 + n_slots, "bell": 2 + 2 * n_slots}[kind]
    if not 0 <= index < n_slots:
        raise IndexError(f"{kind}.{index}: a segment of {n_slots} slots")
    return base + index


class SemRegion:
    """A mapping of the segment's semaphore pages (from ``fd`` at page-aligned ``offset``)."""

    def __init__(self, fd: int, offset: int, count: int) -> None:
        self.count = count
        self._map = mmap.mmap(fd, _pages(count * SEM_BYTES), offset=offset)
        # Held for the region's life: it pins the mapping (mmap.close() refuses while it exists)
        # and gives the base address the semaphore calls take.
        self._pin = ctypes.c_char.from_buffer(self._map)
        self.base = ctypes.addressof(self._pin)

    def address(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise IndexError(index)
        return self.base + index * SEM_BYTES

    def init_all(self) -> None:
        """Make every record a process-shared semaphore of value 0 (the creating server only,
        before anyone else maps the segment)."""
        for i in range(self.count):
            if _libc.sem_init(self.address(i), 1, 0) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"sem_init: {os.strerror(err)}")


def _pages(n: int) -> int:
    return (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


class SharedSemaphore:
    """One ``sem_t`` of a ``SemRegion``, behaving as the ``posix_ipc.Semaphore`` calls used."""

    def __init__(self, region: SemRegion, index: int, name: str) -> None:
        self._region = region  # keeps the mapping alive for as long as this object is used
        self.address = region.address(index)
        self.name = name

    def acquire(self, timeout: float | None = None) -> None:
        """Take one post; wait up to ``timeout`` seconds (None: a day at a time, for ever).
        Raises ``posix_ipc.BusyError`` on a timeout and ``posix_ipc.SignalError`` when a
        signal interrupted the wait, as posix_ipc does."""
        if timeout is not None and timeout <= 0:
            if _libc.sem_trywait(self.address) == 0:
                return
            err = ctypes.get_errno()
            if err == errno.EAGAIN:
                raise posix_ipc.BusyError("semaphore is busy")
            raise _error(err, "sem_trywait")
        while True:
            deadline = _now() + (86400.0 if timeout is None else timeout)
            ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
            if _clockwait(self.address, _CLOCK, ctypes.byref(ts)) == 0:
                return
            err = ctypes.get_errno()
            if err == errno.ETIMEDOUT:
                if timeout is None:
                    continue
                raise posix_ipc.BusyError("semaphore is busy")
            if err == errno.EINTR:
                raise posix_ipc.SignalError("the wait was interrupted by a signal")
            raise _error(err, "sem_clockwait")

    def release(self) -> None:
        if _libc.sem_post(self.address) != 0:
            raise _error(ctypes.get_errno(), "sem_post")  # EOVERFLOW: a flood of posts

    @property
    def value(self) -> int:
        out = ctypes.c_int()
        if _libc.sem_getvalue(self.address, ctypes.byref(out)) != 0:
            raise _error(ctypes.get_errno(), "sem_getvalue")
        return max(0, out.value)

    def close(self) -> None:
        """Nothing to close: the region goes with the last object that uses it."""

    def unlink(self) -> None:
        """Nothing to unlink: the semaphore goes with its segment."""

    def __repr__(self) -> str:
        return f"<SharedSemaphore {self.name}>"


def _error(err: int, call: str) -> OSError:
    return OSError(err, f"{call}: {os.strerror(err)}")
