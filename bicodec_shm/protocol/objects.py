"""Opening the object under a name: only a regular file of the expected owner, never a link.

``/dev/shm`` is shared by every user of the host (an IPC namespace), and anybody may create a
name there while it is free: a file of their own (mode 0666 or 0600), or a symbolic link. What
such an object says (a header with a magic, a server pid, a slot count, a lock held on its
SERVING byte) is theirs to write, so nothing of ours reads it, locks it or removes it: every
open of a name goes through ``open_object``, which refuses it with one line.

The owner is read from the opened descriptor (``fstat``), not from the name, so the object
checked is the object held (a name re-pointed in between changes nothing); ``O_NOFOLLOW``
refuses a symbolic link at the name itself, as glibc's ``shm_open`` does.
"""

from __future__ import annotations

import errno
import os
import stat

import posix_ipc

from ..errors import SegmentError
from .layout import DEFAULT_MODE

SHM_DIR = "/dev/shm"
REMEDY = "remove it (as its owner) or choose another name"


def open_object(name: str, flags: int = 0, mode: int = DEFAULT_MODE, *, owner_uid: int | None = None,
                remedy: str = REMEDY) -> int:  # fmt: skip
    """Open ``/dev/shm/NAME`` read-write and return its descriptor (close-on-exec), if it is a
    regular file that ``owner_uid`` (default: this process's effective uid) owns.

    ``flags``: ``os.O_CREAT | os.O_EXCL`` creates it with ``mode`` (narrowed by the umask).
    Raises ``posix_ipc.ExistentialError`` where ``shm_open`` would (nothing has the name; with
    O_EXCL, something has), and ``SegmentError`` (one line, ending in ``remedy``) for anything
    else: another user's object, a symbolic link, not a file, one this user may not open.
    """
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | flags, mode)
    except (FileNotFoundError, FileExistsError) as exc:
        raise posix_ipc.ExistentialError(f"{path}: {exc.strerror}") from None
    except OSError as exc:
        raise SegmentError(f"{_unopenable(path, exc)}: refusing it; {remedy}") from None
    try:
        st = os.fstat(fd)
        expected = os.geteuid() if owner_uid is None else owner_uid
        if not stat.S_ISREG(st.st_mode):
            raise SegmentError(f"{path} is not a shared-memory object (uid {st.st_uid}'s); {remedy}")
        if st.st_uid != expected:
            raise SegmentError(f"{path} belongs to uid {st.st_uid}, not to uid {expected}: refusing "
                               f"another user's object; {remedy}")  # fmt: skip
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unopenable(path: str, exc: OSError) -> str:
    """Why ``path`` could not be opened, with its owner where it can be told (a hint only: no
    decision is made on a name's stat)."""
    try:
        owner = f"uid {os.lstat(path).st_uid}'s"
    except OSError:
        owner = "someone's"
    if exc.errno == errno.ELOOP:
        return f"{path} is a symbolic link ({owner}), not a shared-memory object"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{path} exists ({owner}) and this user may not open it"
    return f"{path} cannot be opened ({owner}: {exc.strerror})"


def closed_to_us(name: str, owner_uid: int | None = None) -> bool:
    """True if ``/dev/shm/NAME`` is a regular file of ``owner_uid``'s (default: this process's
    euid) that this process may not open: the name's own object of a server that shares its
    segment with its group over NAME.sock (handoff.py), seen by a member while the socket is
    not there (the server is starting, stopping or died), or a server this user may not use.
    A hint from ``lstat``: only which error to raise is decided on it."""
    path = os.path.join(SHM_DIR, name)
    try:
        st = os.lstat(path)
    except OSError:
        return False
    expected = os.geteuid() if owner_uid is None else owner_uid
    return (stat.S_ISREG(st.st_mode) and st.st_uid == expected
            and not os.access(path, os.R_OK | os.W_OK, effective_ids=True))  # fmt: skip
