"""Named objects and who may create, take over and remove them.

Named objects (``NAME``: letters, digits, ``_`` and ``-``, optionally a ``.K`` group suffix)::

    /dev/shm/NAME              the segment; the server creates it O_CREX, reserves it with
                               posix_fallocate, and is the only one who ever unlinks it
    /dev/shm/sem.NAME.ready    clients -> server: "some slot is READY" (wake-up only)
    /dev/shm/sem.NAME.free     -> clients waiting to claim: "some slot became FREE"
    /dev/shm/sem.NAME.req.I    client -> server, slot I: pairs the server's reads of the request
    /dev/shm/sem.NAME.done.I   server -> client, slot I: pairs the client's reads of the result
    /dev/shm/sem.NAME.bell.J   server -> one client handle's asyncio waiter (bell J): wake-up only

Every one of them is created mode 0o600: only the server's own user may open it. A server that
shares its segment with its group (``--mode 0o660``) keeps the segment and its semaphores in a
sealed memfd instead, which nobody can truncate or link, and names only (handoff.py)::

    /dev/shm/NAME              the name's OWNER and SERVING locks and a copy of the header
                               (mode 0o600: no member can take the locks or keep it allocated)
    /dev/shm/NAME.sock         the socket that hands the memfd over (mode ``--mode``)

A server group (group.py) puts a small object of its own under NAME instead of a segment
(magic ``GROUP_MAGIC``, the same OWNER and SERVING lock bytes); its members are NAME.0, NAME.1...

Every path that creates or unlinks a name holds the OWNER lock of the inode the name points to
(``_own_name``, ``remove_dead``), so two servers started together never both serve, and nobody
unlinks a live server's objects.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import re
import secrets
import stat
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager

import posix_ipc

from ..errors import BiCodecShmError, SegmentError, ServerAlreadyRunningError, SharedMemoryFullError
from .handoff import handed_over, is_socket, remove_stale_socket, socket_path
from .layout import (
    CREATING_MAGIC,
    DEFAULT_MODE,
    GROUP_MAGIC,
    HEADER_DT,
    MAGIC,
    OWNER_BYTE,
    SERVING_BYTE,
    Phase,
    name_mode,
)
from .locks import _lock_fds, _open_lock_fd, close_lock_fd, held_elsewhere, try_lock
from .objects import open_object

log = logging.getLogger("bicodec_shm.protocol")

# Names: a base of letters, digits, _ and -, and for members of a server group a ".K" suffix.
# Matched whole (``fullmatch``): "$" would also match before a trailing newline.
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,120}(\.[0-9]{1,3})?")
# What follows "sem.NAME." for the semaphores of NAME (and of no other name).
_SEM_SUFFIX_RE = re.compile(r"^(ready|free|(req|done|bell)\.[0-9]+)$")


def validate_name(name: str) -> str:
    """Return ``name`` if it is a usable segment name, else raise ``ValueError``."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid segment name {name!r}: use 1-120 characters from A-Z a-z 0-9 _ - "
            "(optionally followed by a group member suffix .0 to .999)"
        )
    return name


def random_name(prefix: str = "bcshm") -> str:
    """A fresh, collision-resistant segment name (for tests and private servers)."""
    return f"{prefix}-{secrets.token_hex(6)}"


def semaphore_names(name: str, n_slots: int) -> list[str]:
    """Every semaphore a segment ``name`` of ``n_slots`` slots owns, as posix_ipc names."""
    per_slot = [f"/{name}.{kind}.{i}" for kind in ("req", "done", "bell") for i in range(n_slots)]
    return [f"/{name}.ready", f"/{name}.free", *per_slot]


def leftover_objects(name: str) -> list[str]:
    """Entries of /dev/shm that belong to ``name`` (for tests, ``cleanup`` and leak checks)."""
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return []
    prefix = f"sem.{name}."
    return sorted(
        e for e in entries
        if e in (name, f"{name}.sock") or (e.startswith(prefix) and _SEM_SUFFIX_RE.match(e[len(prefix):]))
    )  # fmt: skip


def _unlink_semaphores(name: str) -> int:
    removed = 0
    for entry in leftover_objects(name):
        if entry.startswith("sem."):
            try:
                posix_ipc.unlink_semaphore("/" + entry[4:])
                removed += 1
            except posix_ipc.ExistentialError:
                pass
            except posix_ipc.PermissionsError:
                pass  # another user's, in the sticky /dev/shm: not ours to remove (create says so)
    return removed


def _unlink_segment(name: str) -> int:
    """Unlink ``/dev/shm/NAME``, and ``NAME.sock`` if it is a socket of ours (a server that
    shared its segment with its group left it); returns how many were removed."""
    removed = 0
    try:
        posix_ipc.unlink_shared_memory(f"/{name}")
        removed = 1
    except posix_ipc.ExistentialError:
        pass
    try:
        removed += remove_stale_socket(name)
    except SegmentError:
        pass  # another user's: not ours to remove (a server starting says so)
    return removed


def reserve_name(name: str, *, mode: int = DEFAULT_MODE, wait: float = 0.0) -> int:
    """Own ``name`` now, before a model that takes seconds to load: returns the lock
    descriptor to hand to ``Segment.create(reserved=...)`` (or to ``release_name``).

    While reserved the name probes BUSY (its OWNER lock is held, SERVING is not), so clients
    whose server just stopped keep waiting for this successor instead of giving up, and a
    second would-be server waits or is refused. Waits up to ``wait`` seconds for a server
    that is starting or stopping; raises ``ServerAlreadyRunningError`` for a live one."""
    validate_name(name)
    before = set(_lock_fds)
    try:
        return _own_name(name, name_mode(mode), time.monotonic() + wait)
    except BaseException:
        # Also an exception from a signal handler (Ctrl-C while a server starts), which may
        # land between creating the name and returning it: leave no descriptor of ours open,
        # and no fresh (empty) reservation that nobody owns.
        for fd in set(_lock_fds) - before:
            if _same_inode(fd, name) or os.fstat(fd).st_nlink == 0:  # (not another thread's)
                close_lock_fd(fd)
        _remove_unowned_reservation(name)
        raise


def _remove_unowned_reservation(name: str) -> None:
    try:
        fd = _open_lock_fd(name)
    except (posix_ipc.Error, BiCodecShmError):  # gone, or not ours: nothing of ours to remove
        return
    try:
        if try_lock(fd, OWNER_BYTE) and os.fstat(fd).st_size == 0 and _same_inode(fd, name):
            _unlink_segment(name)
    finally:
        close_lock_fd(fd)


def release_name(fd: int, name: str) -> None:
    """Give up a reservation that never became a segment (the model failed to load, say)."""
    try:
        if _same_inode(fd, name):
            _unlink_segment(name)
    finally:
        close_lock_fd(fd)


@contextmanager
def released_on_failure(reserved: int | None, name: str) -> Iterator[None]:
    """Release ``reserved`` (``reserve_name``; None: nothing) if the block raises: until a
    segment takes the reservation over, nothing else would, and the name would read as a
    server starting."""
    try:
        yield
    except BaseException:
        if reserved is not None:
            release_name(reserved, name)
        raise


def remove_dead(name: str) -> int:
    """Unlink what a dead server (or group supervisor) left under ``name``; returns how many
    objects were removed. Raises ``ServerAlreadyRunningError`` if a live one owns the name.

    Like a takeover (``_own_name``), it holds the name's OWNER lock, on the inode the name
    still points to, while it unlinks: a server that starts meanwhile is never robbed of its
    fresh objects."""
    validate_name(name)
    try:
        fd = _open_lock_fd(name)
    except posix_ipc.ExistentialError:
        return _unlink_semaphores(name)  # orphaned semaphores: no segment, so no owner
    try:
        if not try_lock(fd, OWNER_BYTE):
            raise ServerAlreadyRunningError(f"a server of {name!r} is alive; stop it instead")
        if not _same_inode(fd, name):
            return 0  # replaced meanwhile: whatever is there now is someone else's
        _check_takeover(name, fd)
        return _unlink_semaphores(name) + _unlink_segment(name)
    finally:
        close_lock_fd(fd)


def sweep_dead(prefix: str, directory: str = "/dev/shm") -> int:
    """``remove_dead`` for every name starting with ``prefix`` whose owner died (private
    servers' random names, which nobody would otherwise ever clean up)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for entry in entries:
        if entry.startswith(prefix) and _NAME_RE.fullmatch(entry) and probe(entry) is ServerState.DEAD:
            try:
                removed += remove_dead(entry)
            except (BiCodecShmError, OSError, posix_ipc.Error):
                pass  # taken over or alive meanwhile
    return removed


def is_stopping(name: str) -> bool:
    """True if the server under ``name`` has begun to stop (it may still finish batches)."""
    try:
        fd = open_object(validate_name(name))
    except (posix_ipc.Error, BiCodecShmError):  # gone, or not ours
        return False
    try:
        return _stopping(fd)
    finally:
        os.close(fd)


def unlink_all(name: str) -> int:
    """Unlink the segment ``name``, its semaphores and its socket, whoever made them (where this
    user may: root, or their owner); returns the count.

    For test clean-up and ``bicodec-shm cleanup`` only: callers check first that no live server
    holds the name (``probe``). Servers remove their own objects with ``Segment.unlink``.
    """
    return _unlink_semaphores(name) + _unlink_segment(name) + _unlink_any_socket(name)


def _unlink_any_socket(name: str) -> int:
    path = socket_path(name)
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
            return 1
    except OSError:
        pass  # gone, or not ours to remove (the sticky /dev/shm)
    return 0


def _same_inode(fd: int, name: str) -> bool:
    """True if ``/dev/shm/NAME`` still names the inode open as ``fd``."""
    try:
        other = open_object(name, owner_uid=os.fstat(fd).st_uid)
    except (posix_ipc.Error, BiCodecShmError):  # gone, or something else (a link, another's)
        return False
    try:
        a, b = os.fstat(fd), os.fstat(other)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    finally:
        os.close(other)


class ServerState(enum.Enum):
    """What ``probe`` finds under a name."""

    ABSENT = "absent"  # nothing, or not a segment of ours (another user's object, a link)
    SERVING = "serving"  # a live server takes requests
    BUSY = "busy"  # a live server is starting or stopping (it holds the name, not SERVING)
    DEAD = "dead"  # leftovers of a server that died: the next server takes them over


def probe(name: str, *, owner_uid: int | None = None) -> ServerState:
    """Find out, by its locks, whether a server lives under ``name`` (no pids involved).

    Only an object of ``owner_uid`` (default: this process's euid, whom clients trust by
    default) counts: another user's, whose locks anybody may hold, is ABSENT."""
    validate_name(name)
    try:
        fd = open_object(name, owner_uid=owner_uid)
    except (posix_ipc.Error, BiCodecShmError):
        # Not ours to open: a member of the group of a server that shares its segment over
        # NAME.sock asks the socket (whose peer must be ``owner_uid``'s).
        return _probe_socket(name, owner_uid)
    try:
        if held_elsewhere(fd, SERVING_BYTE):
            return ServerState.SERVING
        if held_elsewhere(fd, OWNER_BYTE):
            return ServerState.BUSY
        return ServerState.DEAD
    finally:
        os.close(fd)


def _probe_socket(name: str, owner_uid: int | None) -> ServerState:
    if not is_socket(name):
        return ServerState.ABSENT
    try:
        with handed_over(name, owner_uid):
            return ServerState.SERVING
    except BiCodecShmError:  # nobody listens, or another user does
        return ServerState.ABSENT


def _own_name(name: str, mode: int, deadline: float) -> int:
    """Become the only owner of ``name``; returns the lock descriptor of a fresh, empty
    segment whose OWNER lock it holds.

    Every path that creates or unlinks the name holds the OWNER lock of the inode the name
    points to and checks, after locking, that the name still points there. So two servers
    started together never both serve, and nobody unlinks a live server's objects.
    """
    while True:
        created = True
        try:
            fd = _open_lock_fd(name, os.O_CREAT | os.O_EXCL, mode)
        except posix_ipc.ExistentialError:
            created = False
            try:
                fd = _open_lock_fd(name, remedy="remove it (as its owner) or choose another --name")
            except posix_ipc.ExistentialError:
                continue  # unlinked in between: try to create it again
        if not try_lock(fd, OWNER_BYTE):
            # A server that serves but has begun to stop (it finishes its running batches
            # first) is waited for like one starting: a rolling restart's successor.
            serving = held_elsewhere(fd, SERVING_BYTE) and not _stopping(fd)
            close_lock_fd(fd)
            if serving:
                raise ServerAlreadyRunningError(
                    f"a bicodec-shm server is already serving {name!r}; stop it first or "
                    "choose another --name"
                )
            if time.monotonic() >= deadline:
                raise ServerAlreadyRunningError(
                    f"another bicodec-shm server is starting or stopping under {name!r}; "
                    "wait for it or choose another --name"
                )
            time.sleep(0.05)
            continue
        if not _same_inode(fd, name):
            close_lock_fd(fd)  # replaced under us: the name is someone else's now
            continue
        if created:
            return fd
        try:
            _check_takeover(name, fd)
        except BaseException:
            close_lock_fd(fd)
            raise
        log.warning("taking over %r, left behind by a server that died", name)
        _unlink_semaphores(name)
        _unlink_segment(name)
        close_lock_fd(fd)


_PHASE_OFF = HEADER_DT.fields["phase"][1]


def _stopping(fd: int) -> bool:
    """True if the segment open as ``fd`` says its server has begun to stop (a hint, read
    without pairing: it only decides whether a would-be successor waits or gives up)."""
    try:
        head = os.pread(fd, _PHASE_OFF + 4, 0)
    except OSError:
        return False
    if len(head) < _PHASE_OFF + 4 or struct.unpack_from("<Q", head)[0] != MAGIC:
        return False
    return struct.unpack_from("<I", head, _PHASE_OFF)[0] >= Phase.STOPPING


def _check_takeover(name: str, fd: int) -> None:
    """Refuse to remove something under ``name`` that is not a bicodec-shm segment."""
    size = os.fstat(fd).st_size
    if size == 0:
        return  # its creator died before sizing it
    if size >= 8:
        magic = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
        if magic in (CREATING_MAGIC, MAGIC, GROUP_MAGIC):
            return
    raise SegmentError(
        f"/dev/shm/{name} exists and is not a bicodec-shm segment (its first bytes are not one "
        f"of our magics); refusing to remove it: remove it yourself if it is stale, or choose "
        f"another --name"
    )


def size_new_object(fd: int, size: int) -> None:
    """Size a freshly created object and mark it as ours at once (``CREATING_MAGIC``), so that
    the leftovers of a creator that dies from here on can be taken over."""
    os.ftruncate(fd, size)
    os.pwrite(fd, struct.pack("<Q", CREATING_MAGIC), 0)


def reserve_space(fd: int, size: int, name: str) -> None:
    """Size the new segment and reserve its pages now, so that a full /dev/shm is an error at
    start rather than a SIGBUS in whichever process first touches a missing page later."""
    size_new_object(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise SharedMemoryFullError(
                f"/dev/shm has no room to reserve the segment of {name!r} "
                f"({size / 2**20:.1f} MiB): lower --slots or --max-tokens, or give the container "
                "more shared memory (docker run --ipc=host, or --shm-size=1g)"
            ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def check_free_space(needed: int, directory: str = "/dev/shm") -> None:
    """Raise ``SharedMemoryFullError`` unless ``directory`` has ``needed`` bytes free."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise SharedMemoryFullError(
            f"{directory} has {free / 2**20:.1f} MiB free but the segment needs "
            f"{needed / 2**20:.1f} MiB: lower --slots or --max-tokens, or give the container "
            "more shared memory (docker run --ipc=host, or --shm-size=1g)"
        )
