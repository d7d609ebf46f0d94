"""Ownership without pids: open-file-description (OFD) byte-range locks on the segment's inode.

Locks: bytes of the segment's inode, taken with F_OFD_SETLK through a descriptor that nothing
else duplicates (``Segment._lock_fd``; the mapping uses a separate open, because ``mmap`` dups
the descriptor it maps and a dup shares the open file description and so its locks)::

    byte OWNER_BYTE            the server, from creating the name to unlinking it (exclusivity)
    byte SERVING_BYTE          the server, from a complete header until it stops taking work;
                               clients probe it with F_OFD_GETLK: held = alive
    byte SLOT_BYTE0 + I        the client handle that owns slot I
    byte BELL_BYTE0 + J        the client handle that owns bell J

A forked child closes its copy of every lock descriptor at once (``os.register_at_fork``), so a
child never keeps its parent's slots, bells or server locks alive.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from collections.abc import Callable

from .layout import DEFAULT_MODE
from .objects import REMEDY, open_object

# struct flock on Linux (x86-64 and aarch64): short type, short whence, off_t start, off_t len,
# pid_t pid (must be 0 for OFD locks), padded to 32 bytes.
_FLOCK = struct.Struct("@hhqqi4x")


def try_lock(fd: int, byte: int) -> bool:
    """Take the exclusive OFD lock on ``byte`` of ``fd`` without blocking; False if held."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, byte: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, byte, 1, 0))


def held_elsewhere(fd: int, byte: int) -> bool:
    """True if another open file description holds a lock on ``byte`` (F_OFD_GETLK)."""
    out = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return _FLOCK.unpack(out)[0] != fcntl.F_UNLCK


# Every lock descriptor of this process, from the moment it is opened. Registering it in the
# same critical section as the open, and holding that section across fork(), leaves no window
# in which a fork (by another thread, during an attach or a create) could copy a descriptor the
# child then never closes: the child would keep the parent's locks for as long as it lives.
_lock_fds: set[int] = set()
_fork_guard = threading.Lock()
# What else a child must forget of the descriptors just closed (segment.py registers its
# segments' bookkeeping), run inside the same hook: before any later at-fork hook may use them.
after_close_in_child: list[Callable[[], None]] = []


def _open_lock_fd(name: str, flags: int = 0, mode: int = DEFAULT_MODE, *, owner_uid: int | None = None,
                  remedy: str = REMEDY) -> int:  # fmt: skip
    """Open ``/dev/shm/NAME`` for a lock descriptor of ours: only ``owner_uid``'s object (see
    ``objects.open_object``, whose errors propagate)."""
    with _fork_guard:
        fd = open_object(name, flags, mode, owner_uid=owner_uid, remedy=remedy)
        _lock_fds.add(fd)
    return fd


def reopen_lock_fd(fd: int) -> int:
    """A lock descriptor of our own on the file open as ``fd`` (a segment's memfd): a new open
    file description, so that its locks are this process's alone (``fd`` may be a descriptor
    another process passed us, sharing that process's description and so its locks)."""
    with _fork_guard:
        lock_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        _lock_fds.add(lock_fd)
    return lock_fd


def close_lock_fd(fd: int) -> None:
    """Close a descriptor from ``_open_lock_fd``: every lock taken through it drops."""
    with _fork_guard:
        _lock_fds.discard(fd)
        os.close(fd)


def _close_lock_fds_in_child() -> None:
    # The child inherited every lock descriptor, and with them the parent's locks: a dead
    # parent's slots would stay owned for as long as the child lives. Close the child's copies
    # (each is the only descriptor of its lock's open file description: see Segment).
    for fd in _lock_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _lock_fds.clear()
    for forget in after_close_in_child:
        forget()
    _fork_guard.release()  # taken by the thread that forked, which is this child's only thread


os.register_at_fork(before=_fork_guard.acquire, after_in_parent=_fork_guard.release,
                    after_in_child=_close_lock_fds_in_child)  # fmt: skip
