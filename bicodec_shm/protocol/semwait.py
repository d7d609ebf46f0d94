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

Fork safety: ``sem_open`` and ``sem_close`` hold glibc's process-wide ``sem_mappings_lock``
while they search its registry of mapped semaphores, and glibc does not reset that lock in a
forked child. A fork that lands while another thread is inside one of them leaves the lock held
in the child for ever, and the child's next ``sem_open``/``sem_close`` (the at-fork hook's
``Segment.close`` is one) never returns. So those two go through ``ctypes.PyDLL``, which keeps
the GIL for the call: ``os.fork`` runs with the GIL held, so no other thread of ours can be
inside them at that instant (posix_ipc keeps the GIL for its own calls too). Only the wait,
which touches no registry, releases the GIL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import time

_LIBC = ctypes.util.find_library("c") or "libc.so.6"
_libc = ctypes.CDLL(_LIBC, use_errno=True)  # releases the GIL: only for the wait
_libc_gil = ctypes.PyDLL(_LIBC, use_errno=True)  # keeps the GIL: atomic with respect to fork


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_sem_open = _libc_gil.sem_open
_sem_open.restype = ctypes.c_void_p
_sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
_sem_close = _libc_gil.sem_close
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
        self._adopted: set[str] = set()  # in-segment semaphores (shared_sems.py): never closed

    def adopt(self, name: str, address: int) -> None:
        """Wait on the process-shared semaphore at ``address`` under ``name`` (one of a
        segment's own, shared_sems.py; its mapping outlives this ``Waiter``)."""
        self._handles[name] = address
        self._adopted.add(name)

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
        if sem is not None and name not in self._adopted:
            _sem_close(sem)
        self._adopted.discard(name)

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
        adopted, self._adopted = self._adopted, set()
        for name, sem in handles.items():
            if name not in adopted:
                _sem_close(sem)
