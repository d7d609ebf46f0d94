"""Timed semaphore waits that let a signal handler's exception reach the caller.

posix_ipc's ``Semaphore.acquire(timeout)`` runs Python's signal handlers itself when the wait is
interrupted (EINTR), throws away whatever the handler raised, and raises its own
``SignalError``. So a ``KeyboardInterrupt``, a SIGALRM-based timeout or Celery's soft time limit
raised by a handler while a client waits would vanish, and the caller's own timeout would never
fire (measured with posix_ipc 1.3.2; see tests/test_review_findings.py).

Here the wait is glibc's ``sem_clockwait`` (``sem_timedwait`` before glibc 2.30) called through
ctypes on the same named semaphore. ctypes releases the GIL for the call and runs no handler;
on EINTR the call returns, and the interpreter runs the pending handler at the next bytecode,
so its exception propagates from the wait like from any other Python call.

Each name is opened once per ``Waiter``, right after posix_ipc opened it (glibc maps a named
semaphore's inode once per process and counts its opens, so this shares posix_ipc's mapping),
and closed with the ``Waiter``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import time

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_sem_open = _libc.sem_open
_sem_open.restype = ctypes.c_void_p
_sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
_sem_close = _libc.sem_close
_sem_close.argtypes = [ctypes.c_void_p]
_SEM_FAILED = ctypes.c_void_p(0).value  # glibc's SEM_FAILED is ((sem_t *) 0)

try:
    _clockwait = _libc.sem_clockwait  # glibc >= 2.30: a monotonic deadline
    _clockwait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Timespec)]
    _CLOCK, _now = time.CLOCK_MONOTONIC, time.monotonic
except AttributeError:  # older glibc: CLOCK_REALTIME, which a clock step can stretch
    _timedwait = _libc.sem_timedwait
    _timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]

    def _clockwait(sem, clock, ts):  # type: ignore[no-redef]
        return _timedwait(sem, ts)

    _CLOCK, _now = time.CLOCK_REALTIME, time.time


class Waiter:
    """Opens named semaphores for timed waits; ``close()`` releases them."""

    def __init__(self) -> None:
        self._handles: dict[str, int] = {}

    def open(self, name: str) -> None:
        """Open the semaphore ``name`` (a posix_ipc name such as ``/x.done.3``) for waits.
        Open it while the name is known to be the right object: a name reused later by
        another owner would be a different semaphore."""
        if name not in self._handles:
            sem = _sem_open(name.encode(), 0)
            if sem is None or sem == _SEM_FAILED:
                err = ctypes.get_errno()
                raise OSError(err, f"sem_open({name!r}): {os.strerror(err)}")
            self._handles[name] = sem

    def close_one(self, name: str) -> None:
        sem = self._handles.pop(name, None)
        if sem is not None:
            _sem_close(sem)

    def wait(self, name: str, timeout: float) -> bool:
        """Take one post of the semaphore ``name`` (opened with ``open``), waiting up to
        ``timeout`` seconds. False on timeout, or if a signal interrupted the wait (the
        signal's handler runs right after this returns, and may raise)."""
        sem = self._handles[name]
        deadline = _now() + max(0.0, timeout)
        ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        if _clockwait(sem, _CLOCK, ctypes.byref(ts)) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.ETIMEDOUT, errno.EINTR):
            return False
        raise OSError(err, f"sem_clockwait({name!r}): {os.strerror(err)}")

    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for sem in handles.values():
            _sem_close(sem)
