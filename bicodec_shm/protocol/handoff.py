"""Handing a sealed segment to the processes allowed to attach: a Unix socket per name.

A segment shared with the server's group (``--mode 0o660``) is not a named object, because
every process that may open a named object read-write may also truncate it (all who map it
then die with SIGBUS), take its liveness locks, or hard-link it so that it outlives its server.
Instead the server keeps the segment in a memfd sealed against shrinking and growing, and hands
a descriptor of it to whoever connects to::

    /dev/shm/NAME.sock   a listening Unix socket, mode ``--mode`` (the group may connect)

The socket's file permissions are the access control, as the named object's were. A client
checks the peer's uid (``SO_PEERCRED``, which nobody can forge) against the uid it trusts and
the descriptor's seals, then keeps the connection open for as long as it is attached: the
server's end closes when the server stops or dies, whoever else holds what, so an end of file
on it is the client's liveness signal (``Connection.alive``), where a named segment's clients
probe a lock that any member could take.

Message (server -> client, once per connection)::

    b"BCSHM-SEGMENT\\n" with SCM_RIGHTS: one descriptor, the memfd (read-write)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import selectors
import socket
import stat
import struct
import threading
import weakref
from collections.abc import Callable, Iterator

from ..errors import SegmentError, ServerUnavailableError
from .objects import SHM_DIR

GREETING = b"BCSHM-SEGMENT\n"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Connections the server keeps at once (each an attached client handle, or a probe). A process
# that opens more only keeps itself out of the newest slots; the server's descriptors stay bounded.
MAX_CONNECTIONS = 4096
_POLL_S = 0.25


def socket_path(name: str) -> str:
    return os.path.join(SHM_DIR, f"{name}.sock")


def is_socket(name: str) -> bool:
    """True if ``NAME.sock`` exists and is a socket (whoever made it: ``connect`` checks that)."""
    try:
        return stat.S_ISSOCK(os.lstat(socket_path(name)).st_mode)
    except OSError:
        return False


def remove_stale_socket(name: str) -> int:
    """Remove ``NAME.sock`` if it is a socket of this user's (a dead server's: call only while
    owning the name); 1 if one was removed. Refuses another user's with ``SegmentError``."""
    path = socket_path(name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if st.st_uid != os.geteuid() or not stat.S_ISSOCK(st.st_mode):
        raise SegmentError(f"{path} exists and is not a socket of this user's (uid {st.st_uid}'s): "
                           "refusing it; remove it (as its owner) or choose another --name")  # fmt: skip
    try:
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return 1


def create_sealed(name: str, size: int) -> int:
    """A memfd of ``size`` bytes, its pages reserved, sealed against any change of size."""
    return _sealed(name, size, SEALS)


def snapshot(name: str, data: bytes) -> int:
    """A memfd holding ``data``, sealed against every change (a record handed out to read)."""
    return _sealed(name, len(data), SEALS | fcntl.F_SEAL_WRITE, data)


def _sealed(name: str, size: int, seals: int, data: bytes = b"") -> int:
    fd = os.memfd_create(f"bicodec-shm:{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise
        if data:
            os.pwrite(fd, data, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_sealed(fd: int, size: int) -> None:
    """Refuse a descriptor that is not a sealed segment of at least ``size`` bytes."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    st = os.fstat(fd)
    if seals & SEALS != SEALS or not stat.S_ISREG(st.st_mode) or st.st_size < size:
        raise SegmentError("the descriptor handed over is not a sealed bicodec-shm segment")


_live_handoffs: weakref.WeakSet[Handoff] = weakref.WeakSet()


def _hang_up_in_child() -> None:
    # A child forked from a server's process has copies of the listener and of every client's
    # connection, but not the thread that serves them: were it to keep them, the clients would
    # see their server alive for as long as the child lives, after the server itself died. (The
    # lock descriptors go the same way: locks.py.)
    for handoff in list(_live_handoffs):
        handoff._forget_in_child()


os.register_at_fork(after_in_child=_hang_up_in_child)


class Handoff:
    """The server's side: listens on ``NAME.sock`` and hands ``memfd`` to each connection,
    which it keeps open until the client hangs up or ``close()`` (the clients' liveness).

    ``memfd`` is a descriptor to hand to every client (a segment), or a callable returning a
    fresh one per client, closed once sent (a snapshot of a record, ``snapshot``)."""

    def __init__(self, name: str, memfd: int | Callable[[], int], mode: int) -> None:
        self.path = socket_path(name)
        self._memfd = memfd
        self._conns: set[socket.socket] = set()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._bind(mode)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            raise
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"bicodec-shm-handoff:{name}")
        self._thread.start()
        _live_handoffs.add(self)

    def _forget_in_child(self) -> None:
        self._stop.set()
        for sock in (self._listener, *self._conns):
            try:
                sock.close()
            except OSError:
                pass
        self._conns = set()
        self.path = ""  # the socket's name is the parent's to remove

    def _bind(self, mode: int) -> None:
        old = os.umask(0o777 & ~mode)  # never a moment with wider access than ``mode``
        try:
            self._listener.bind(self.path)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise SegmentError(f"cannot create {self.path}: something else has the name ({exc.strerror}); "
                               "remove it (as its owner) or choose another --name") from None  # fmt: skip
        finally:
            os.umask(old)
        os.chmod(self.path, mode)
        self._listener.listen(128)

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in sel.select(_POLL_S):
                    if key.fileobj is self._listener:
                        self._accept(sel)
                    else:
                        self._hung_up_or_chatty(sel, key.fileobj)  # type: ignore[arg-type]
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError:
            return  # out of descriptors, say: the client retries
        if len(self._conns) >= MAX_CONNECTIONS:
            conn.close()
            return
        fresh = callable(self._memfd)
        try:
            fd = self._memfd() if fresh else self._memfd  # type: ignore[operator]
        except OSError:
            conn.close()
            return
        try:
            conn.setblocking(False)
            socket.send_fds(conn, [GREETING], [fd])
        except OSError:
            conn.close()
            return
        finally:
            if fresh:
                os.close(fd)
        self._conns.add(conn)
        sel.register(conn, selectors.EVENT_READ)

    def _hung_up_or_chatty(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client hung up; a client never sends, so anything else is dropped
            sel.unregister(conn)
            self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop handing out the segment, hang up on every client, and remove the socket."""
        self._stop.set()
        _live_handoffs.discard(self)
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(5)
        self._listener.close()
        if not self.path:
            return
        try:
            st = os.lstat(self.path)
            if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(self.path)
        except OSError:
            pass


class Connection:
    """A client's connection to the server that handed it the segment."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def alive(self) -> bool:
        """False once the server's end closed (it stopped or died): one non-blocking peek."""
        sock = self.sock
        if sock is None:
            return False
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


@contextlib.contextmanager
def handed_over(name: str, owner_uid: int | None = None, timeout: float = 2.0) -> Iterator[int]:
    """The segment's memfd for the duration of the block (a reader's private look at it, as
    ``stats`` takes): connects, yields the descriptor, then closes both."""
    conn, fd = connect(name, owner_uid, timeout)
    try:
        yield fd
    finally:
        os.close(fd)
        conn.close()


def connect(name: str, owner_uid: int | None = None, timeout: float = 5.0) -> tuple[Connection, int]:
    """Connect to the server of ``name`` and receive its segment: ``(connection, memfd)``.

    Raises ``ServerUnavailableError`` if nothing listens there (yet, or any more), and
    ``SegmentError`` if the process listening is not ``owner_uid``'s (default: this process's
    euid) or hands over something that is not a sealed segment."""
    expected = os.geteuid() if owner_uid is None else owner_uid
    path = socket_path(name)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise ServerUnavailableError(f"no bicodec-shm server listens on {path} right now") from None
        except PermissionError:
            raise SegmentError(f"{path} exists and this user may not connect to it: a server shares "
                               "its segment with its group only with --mode 0o660") from None  # fmt: skip
        except OSError as exc:
            raise ServerUnavailableError(f"cannot connect to {path}: {exc.strerror}") from None
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != expected:
            raise SegmentError(f"{path} is served by uid {uid}, not by uid {expected}: refusing another "
                               "user's server; pass owner_uid= to trust it")  # fmt: skip
        try:
            msg, fds, _, _ = socket.recv_fds(sock, len(GREETING), 1, socket.MSG_CMSG_CLOEXEC)
        except (TimeoutError, OSError):
            raise ServerUnavailableError(f"the server on {path} handed over no segment") from None
        if msg != GREETING or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ServerUnavailableError(f"the server on {path} handed over no segment")
        sock.setblocking(False)
        return Connection(sock), fds[0]
    except BaseException:
        sock.close()
        raise
