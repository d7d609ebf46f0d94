"""The mapped segment (``Segment``): its views, its semaphores, and the slot state machine.

One POSIX shared-memory object holds everything a server and its clients exchange. Semaphores
are doorbells, never locks: a POSIX semaphore has no owner, so one held by a killed process
would wedge everyone. Ownership (of the name, of a slot, of a bell) uses open-file-description
(OFD) byte-range locks on the segment's inode instead, which the kernel drops the instant the
last descriptor of their open file description closes, e.g. when the owner dies. No pid is ever
trusted: liveness works across PID namespaces (a Kubernetes pod's containers, ``docker
--ipc=container:X``) and survives pid reuse.

Shared with the group (``--mode 0o660``), the segment is a sealed memfd handed over NAME.sock
instead, semaphores inside, each process locking its own open of it; the name keeps OWNER and
SERVING, and a client's liveness is its connection (handoff.py, shared_sems.py).

Slot states (``SlotState``), and who moves a slot from each::

    1. FREE    -> CLAIMED   client, holding the slot's lock; it bumps ``generation`` (the claim
                            epoch) and drains the slot's stale posts
    2. CLAIMED -> READY     client: payload, fields, request identity, state; then post req.I,
                            then post ready
    3. READY   -> BUSY      server, after taking req.I, when the slot joins a batch (if it is
                            still READY at the request's claim epoch)
    4. BUSY    -> DONE      server: PCM, status, answer identity, state (if it is still BUSY at
                            the request's epoch); then post done.I (and bell J), then the slot
                            leaves the batch's held set
    5. DONE    -> CLAIMED   client, after taking done.I and checking the answer's identity
    6. CLAIMED -> FREE      client, for a slot in state CLAIMED only (then unlock, post free)
    7. any     -> FREE      the server's reaper, holding the slot's lock after its owner died
                            or let go, for a slot no batch holds; it bumps ``generation``

Nobody else frees a slot. A client that lets go of a slot in any other state (closing with a
request READY, BUSY or DONE, or dying) only drops the slot's lock: the reaper frees it, and the
reaper never touches a slot that a batch holds, so every free is ordered after the server's
last write to the slot and its last post (``tests/test_protocol_model.py`` checks this rule,
and finds the cross-delivery that freeing a DONE slot on close caused). A buggy client that
frees its slot under a batch anyway loses only its own request: the epoch checks of 3 and 4
leave the slot to whoever claims it next (slot_io.py, ``moved_on``).

Memory ordering (the rule every reader follows). Plain stores to shared memory carry no ordering
on weakly ordered CPUs (aarch64: GH200, Grace): a reader may see a slot's state word change
before the payload written earlier. POSIX semaphore operations synchronise memory (POSIX.1
4.12), so:

- A process reads the fields another process wrote for a hand-off only after a semaphore
  operation paired with the writer's post *for that very slot*: the server reads a request only
  after taking ``req.I``; a client reads a result only after taking ``done.I``. A wake-up
  doorbell (``ready``, ``free``, a bell) only says "look"; what is then read is confirmed by
  the per-slot semaphore first. A state word read without that pairing is a hint, used only to
  choose which per-slot semaphore to try.
- After the pairing operation the reader checks the identity above, so a stale post (of a
  request abandoned at its timeout, or of a slot's earlier owner) is recognised and skipped,
  never mistaken for the answer.
- Handing a slot between owners (claim, give back, reap) and reading the header go through the
  kernel's file-lock code: a lock taken, released or probed (F_OFD_SETLK / GETLK) passes
  through the inode's lock-list spinlock, whose release/acquire order every store made before
  the call. So a claimer that wins a slot's lock sees the FREE its previous owner wrote before
  unlocking, and a client that sees SERVING held sees the header the server wrote before
  taking it.
- The live counters and histograms are read without pairing by ``stats`` and metrics: they
  are monotonic statistics, and a value a moment old is fine there.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import time
import weakref
from dataclasses import replace

import numpy as np
import posix_ipc

from ..codecs.layout import BICODEC, CodecLayout
from ..errors import (
    BiCodecShmError,
    SegmentError,
    ServerAlreadyRunningError,
    ServerUnavailableError,
)
from . import locks
from .handoff import Connection, Handoff, check_sealed, connect, create_sealed, is_socket, socket_path
from .handoff import remove_stale_socket as _remove_stale_socket
from .header import DESCRIPTION, _read_layout, description_digest, transport_of, write_codec
from .layout import (
    BELL_BYTE0,
    CODEC_NAME_BYTES,
    COUNTERS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MODE,
    FREE,
    FREE_BELL_CAP,
    HEADER_DT,
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    MAX_LEVELS,
    MAX_SLOTS,
    N_TIME_BINS,
    REQUEST_ID,
    RESULT_ID,
    SERVING_BYTE,
    SLOT_BYTE0,
    SLOT_DT,
    TIME_HISTOGRAMS,
    Layout,
    Phase,
    Transport,
    name_mode,
    shared_mode,
)
from .locks import _open_lock_fd, close_lock_fd, held_elsewhere, reopen_lock_fd, try_lock, unlock
from .names import (
    _own_name,
    _unlink_segment,
    _unlink_semaphores,
    check_free_space,
    reserve_space,
    semaphore_names,
    size_new_object,
    validate_name,
)
from .objects import closed_to_us, open_object
from .semwait import Waiter
from .shared_sems import SemRegion, SharedSemaphore, kind_index

log = logging.getLogger("bicodec_shm.protocol")

# What a client that may not attach can do about it (``open_object``'s message ends with it).
_ATTACH_REMEDY = ("a server creates it with mode 0o600 (its user only) unless started with --mode "
                  "0o660; pass owner_uid= to trust another user's server")  # fmt: skip

_live_segments: weakref.WeakSet[Segment] = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    for seg in list(_live_segments):
        seg._forget_locks_after_fork()


locks.after_close_in_child.append(_forget_locks_in_child)


class Segment:
    """A mapped segment: numpy views over the header, slot table and payload, plus its
    semaphores and locks.

    The server creates it (``Segment.create``), clients attach (``Segment.attach``).
    ``close()`` runs in every process; ``unlink()`` only in the server that created it. Views:

    - ``header``: 0-d structured array (``HEADER_DT``); ``counters``: its counters as (13,) u8;
      ``histograms``: queue, latency and decode histograms as one (3·N_TIME_BINS,) u8
    - ``slots``: (n_slots,) structured array (``SLOT_DT``); ``field[name]``: one field of it
    - ``tokens``: (n_slots, max_tokens·codes_per_frame) int32, every level's codes (see
      ``Layout.level_offset``); ``globals``: (n_slots, n_global) int32
    - ``codec``: the served codec's ``CodecLayout``
    - ``pcm16``: (n_slots, stride/2) int16 and ``pcm32``: (n_slots, stride/4) float32, the same
      bytes: slot i's samples start at row i

    Semaphores: ``ready``, ``free``, ``req(i)``, ``done(i)``, ``bell(j)`` (opened on first use
    by clients; created up front by the server).
    """

    # Class-level defaults keep close() safe after a failed __init__.
    _mmap: mmap.mmap | None = None
    _lock_fd: int = -1
    _sems: dict[str, posix_ipc.Semaphore] | None = None
    _per_slot: dict[str, list] = {}
    _creator: bool = False
    _description: np.ndarray | None = None  # the creator's copy of its header
    _waiter: Waiter = Waiter()  # replaced per instance; this one has nothing to close
    # A segment handed over a socket (``Transport.SOCKET``, handoff.py): the name's own object
    # (OWNER and SERVING locks, a copy of the header), the memfd (its creator keeps it to hand
    # over), the handoff, and a client's connection, whose end of file is its liveness signal.
    _name_fd: int = -1
    _memfd: int = -1
    _handoff: Handoff | None = None
    _conn: Connection | None = None
    _region: SemRegion | None = None
    transport: Transport = Transport.NAMED

    def __init__(self, name: str, lock_fd: int, layout: Layout, *, memfd: int = -1,
                 conn: Connection | None = None) -> None:  # fmt: skip
        self.name = name
        self.layout = layout
        self.codec = layout.codec
        self._lock_fd = lock_fd
        self._conn = conn
        self._sems = {}
        self._ready: posix_ipc.Semaphore | None = None
        self._per_slot = {kind: [None] * layout.n_slots for kind in ("req", "done", "bell")}
        self._waiter = Waiter()
        self.transport = Transport.SOCKET if memfd >= 0 else Transport.NAMED
        if memfd >= 0:
            self._mmap = mmap.mmap(memfd, layout.total_size)
            self._views()
            self._adopt_semaphores(SemRegion(memfd, layout.sems_off, layout.n_sems))
        else:
            self._map()
            self._views()
        _live_segments.add(self)

    def _map(self) -> None:
        # A separate open for the mapping: mmap dups the descriptor it maps, and that dup would
        # share the lock descriptor's open file description, and so its locks, with every
        # process that inherits it.
        b = os.fstat(self._lock_fd)
        try:
            fd = open_object(self.name, owner_uid=b.st_uid)
        except posix_ipc.ExistentialError:  # unlinked since our lock descriptor's open (a restart)
            raise ServerUnavailableError(f"{self.name!r} was removed while attaching") from None
        except SegmentError:  # something else has the name now (a link, another user's)
            raise ServerUnavailableError(f"{self.name!r} was replaced while attaching") from None
        try:
            a = os.fstat(fd)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                raise ServerUnavailableError(f"{self.name!r} was replaced while attaching")
            self._mmap = mmap.mmap(fd, self.layout.total_size)
        finally:
            os.close(fd)

    def _adopt_semaphores(self, region: SemRegion) -> None:
        """Every semaphore of a segment handed over a socket, from its own pages, at once."""
        self._region = region
        n = self.layout.n_slots
        for sem_name in semaphore_names(self.name, n):
            kind, index = _split(sem_name)
            sem = SharedSemaphore(region, kind_index(kind, index, n), sem_name)
            self._sems[sem_name] = sem
            self._waiter.adopt(sem_name, sem.address)
            if kind in self._per_slot:
                self._per_slot[kind][index] = sem
            elif kind == "ready":
                self._ready = sem

    def _views(self) -> None:
        buf, lay = self._mmap, self.layout
        self.header = np.ndarray((), HEADER_DT, buf, 0)
        self.counters = np.ndarray((len(COUNTERS),), "<u8", buf, HEADER_DT.fields[COUNTERS[0]][1])
        self.histograms = np.ndarray((3 * N_TIME_BINS,), "<u8", buf,
                                     HEADER_DT.fields[TIME_HISTOGRAMS[0]][1])  # fmt: skip
        self.slots = np.ndarray((lay.n_slots,), SLOT_DT, buf, lay.slots_off)
        # One (n_slots,) view per slot field, made once: building a field view per access
        # costs about a microsecond, and the hot path touches a dozen fields per request.
        self.field = {f: self.slots[f] for f in SLOT_DT.names}
        # The request's and the answer's identity, each as one (n_slots, 3) u8 view.
        self.request_id, self.result_id = (
            np.ndarray((lay.n_slots, 3), "<u8", buf, lay.slots_off + SLOT_DT.fields[ids[0]][1],
                       strides=(SLOT_DT.itemsize, 8))
            for ids in (REQUEST_ID, RESULT_ID)
        )  # fmt: skip
        self.tokens = np.ndarray((lay.n_slots, lay.codes_per_slot), np.int32, buf, lay.tokens_off)
        self.globals = np.ndarray((lay.n_slots, lay.codec.n_global), np.int32, buf, lay.globals_off)
        self.pcm16 = np.ndarray((lay.n_slots, lay.pcm_stride // 2), np.int16, buf, lay.pcm_off)
        self.pcm32 = np.ndarray((lay.n_slots, lay.pcm_stride // 4), np.float32, buf, lay.pcm_off)

    # -- construction (server) ------------------------------------------------------------

    @classmethod
    def create(
        cls,
        name: str,
        *,
        n_slots: int,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        mode: int = DEFAULT_MODE,
        semantic_vocab: int = 8192,
        global_vocab: int = 4096,
        max_batch: int = 0,
        lanes: int = 1,
        wait: float = 0.0,
        reserved: int | None = None,
        codec: CodecLayout | None = None, encode_min_samples: int = 0,
    ) -> Segment:
        """Own ``name`` exclusively and create a fresh segment and its semaphores under it.

        Leftovers of a dead server are taken over (their lock is free). A live server makes
        this raise ``ServerAlreadyRunningError``; one that is starting or stopping is waited
        for up to ``wait`` seconds (a rolling restart) before raising the same.
        The segment is complete when this returns, but not yet served: call
        ``start_serving()``.

        ``codec``: the served codec's token layout; None means BiCodec with ``semantic_vocab``
        and ``global_vocab``. ``encode_min_samples``: its encoder's shortest clip (0: none).
        """
        validate_name(name)
        if codec is None:
            codec = replace(BICODEC, level_vocab=(semantic_vocab,), global_vocab=global_vocab)
        if codec.n_levels > MAX_LEVELS or len(codec.name.encode()) > CODEC_NAME_BYTES:
            raise ValueError(f"a header holds at most {MAX_LEVELS} levels and a codec name of "
                             f"{CODEC_NAME_BYTES} bytes: {codec.describe()}")  # fmt: skip
        if not 1 <= n_slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {n_slots}")
        if not 1 <= max_tokens <= 100_000:
            raise ValueError(f"max_tokens must be in 1..100000, got {max_tokens}")
        layout = Layout(n_slots, max_tokens, codec, encode_min_samples)
        shared = shared_mode(mode)
        if not shared:
            check_free_space(layout.total_size)
        # The name: reserved earlier (``reserve_name``: held while the model loaded), or now.
        # Only its own user may ever open it: a group that may attach does so over the socket.
        own = name_mode(mode)
        name_fd = reserved if reserved is not None else _own_name(name, own, time.monotonic() + wait)
        memfd = lock_fd = -1
        try:
            os.fchmod(name_fd, own)  # the umask narrowed the mode given at creation
            if shared:
                size_new_object(name_fd, HEADER_SIZE)  # the header's copy (``_copy_header``)
                memfd = create_sealed(name, layout.total_size)
                lock_fd = reopen_lock_fd(memfd)
                seg = cls(name, lock_fd, layout, memfd=memfd)
                seg._name_fd, seg._memfd, seg._mode = name_fd, memfd, mode
                seg._region.init_all()  # type: ignore[union-attr]
            else:
                reserve_space(name_fd, layout.total_size, name)
                seg = cls(name, name_fd, layout)
        except BaseException:
            _unlink_segment(name)
            for fd in (lock_fd, name_fd):
                if fd >= 0:
                    close_lock_fd(fd)
            if memfd >= 0:
                os.close(memfd)
            raise
        seg._creator = True
        try:
            seg._create_semaphores(mode)
            h = seg.header
            h["version"] = LAYOUT_VERSION
            h["header_size"] = HEADER_SIZE
            h["n_slots"] = n_slots
            h["max_tokens"] = max_tokens
            h["n_global"] = codec.n_global
            h["slot_size"] = SLOT_DT.itemsize
            h["total_size"] = layout.total_size
            h["semantic_vocab"] = codec.level_vocab[0]
            write_codec(h, codec)  # global_vocab and n_global too
            h["encodes"], h["encode_min_samples"] = int(layout.encodes), encode_min_samples
            h["max_batch"] = max_batch
            h["lanes"] = lanes
            h["server_pid"] = os.getpid()
            h["server_uid"] = os.geteuid()
            h["server_epoch"] = secrets.randbits(63)
            h["phase"] = Phase.CREATING
            h["transport"] = seg.transport
            h["digest"] = description_digest(h)
            # Order matters: magic last, so that a reader never accepts a half-written header.
            h["magic"] = MAGIC
            seg._description = h.copy()  # the server's own copy (``restore_description``)
            seg._copy_header()
        except BaseException:
            seg.unlink()  # our own objects only: a foreign semaphore stays where it is
            seg.close()
            raise
        return seg

    def _create_semaphores(self, mode: int) -> None:
        # We own the name, so whatever semaphores of ours exist under it are a dead server's.
        stale = _unlink_semaphores(self.name)
        if stale:
            log.info("removed %d stale semaphore(s) of %r", stale, self.name)
        if self.transport == Transport.SOCKET:
            return  # its semaphores are in its own pages (``_adopt_semaphores``)
        for sem_name in semaphore_names(self.name, self.layout.n_slots):
            try:
                sem = posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX, mode, 0)
            except (posix_ipc.ExistentialError, posix_ipc.PermissionsError) as e:
                # Only someone else's object survives the unlink above: another user's (the
                # sticky /dev/shm keeps us from removing it), or one made in between.
                path = f"/dev/shm/sem.{sem_name[1:]}"
                try:
                    owner = f"uid {os.stat(path).st_uid}"
                except OSError:
                    owner = "another process"
                raise SegmentError(
                    f"cannot create the semaphore {path} of {self.name!r}: it already exists and "
                    f"belongs to {owner} ({e}); remove it, or choose another --name"
                ) from None
            self._sems[sem_name] = sem
            kind, index = _split(sem_name)
            if kind in self._per_slot:
                self._per_slot[kind][index] = sem
            elif kind == "ready":
                self._ready = sem
            # posix_ipc cannot fchmod a semaphore, and the umask narrowed it: on Linux each
            # one is the file /dev/shm/sem.NAME.
            path = f"/dev/shm/sem.{sem_name[1:]}"
            if os.path.exists(path):
                os.chmod(path, mode)

    def start_serving(self) -> None:
        """Take the SERVING lock: from now on clients see this server as alive. A segment
        shared with the group starts handing itself out on NAME.sock first."""
        self.header["phase"] = Phase.SERVING
        self.header["started_ns"] = time.monotonic_ns()
        if self.transport == Transport.SOCKET:
            self._copy_header()
            _remove_stale_socket(self.name)  # we own the name: one left there is a dead server's
            self._handoff = Handoff(self.name, self._memfd, self._mode)
        # Order matters: the header above, then the lock (see "Memory ordering").
        if not try_lock(self._liveness_fd, SERVING_BYTE):
            raise ServerAlreadyRunningError(f"could not take the serving lock of {self.name!r}")

    @property
    def _liveness_fd(self) -> int:
        """The descriptor holding the name's OWNER and SERVING locks."""
        return self._name_fd if self._name_fd >= 0 else self._lock_fd

    def _copy_header(self) -> None:
        """Write the header into the name's own object (a segment handed over a socket only):
        what the tools of the server's user read there (its magic, its phase), never what a
        client maps."""
        if self._name_fd >= 0 and self.header is not None:
            os.pwrite(self._name_fd, self.header.tobytes(), 0)

    def restore_description(self) -> None:
        """Write the segment's description back into the header from the server's own copy
        (the server only): a client may have overwritten it (see ``header.DESCRIPTION``)."""
        h, mine = self.header, self._description
        if h is None or mine is None:
            return
        for f in (*DESCRIPTION, "digest", "magic"):  # magic last, as at creation
            h[f] = mine[f]

    def mark_stopping(self) -> None:
        """This server has begun to stop: a successor started now waits for it (safe in a signal
        handler). Under --mode 0o660 a successor reads the phase in the name's own object."""
        if self.header is not None:
            self.header["phase"] = Phase.STOPPING
            self._copy_header()

    def stop_serving(self) -> None:
        """Release the SERVING lock: clients now resubmit what this server has not answered.
        A segment handed over a socket hangs up on every client too (their liveness signal)."""
        if self._lock_fd >= 0:
            self.mark_stopping()
            unlock(self._liveness_fd, SERVING_BYTE)
        handoff, self._handoff = self._handoff, None
        if handoff is not None:
            handoff.close()

    # -- attaching (clients) --------------------------------------------------------------

    @classmethod
    def attach(cls, name: str, *, owner_uid: int | None = None) -> Segment:
        """Map the segment a live server serves under ``name``, after checking its header.

        Args:
            owner_uid: the uid that must own the segment (default: this process's euid).

        Raises ``ServerUnavailableError`` if no live server serves the name (yet), and
        ``SegmentError`` if what is there is not a bicodec-shm segment of this layout version
        or is owned by an unexpected user.
        """
        validate_name(name)
        if is_socket(name):
            return cls._attach_over_socket(name, owner_uid)
        if closed_to_us(name, owner_uid):
            raise ServerUnavailableError(
                f"{name!r} is not served over {socket_path(name)} right now, and its own object is its "
                "user's alone (a server shares its segment with its group only with --mode 0o660)")
        try:
            # Only ``owner_uid``'s object (default: ours), checked on the descriptor itself.
            fd = _open_lock_fd(name, owner_uid=owner_uid, remedy=_ATTACH_REMEDY)
        except posix_ipc.ExistentialError:
            raise ServerUnavailableError(
                f"no bicodec-shm server is running under the name {name!r} "
                f"(/dev/shm/{name} does not exist); start one with `bicodec-shm serve --name {name}`"
            ) from None
        # ``fd`` becomes the lock descriptor; nothing else dups it.
        try:
            if not held_elsewhere(fd, SERVING_BYTE):
                raise ServerUnavailableError(
                    f"{name!r} exists but no server serves it right now (it is starting, "
                    "stopping, or died)"
                )
            if transport_of(fd) == Transport.SOCKET:  # its socket came or went just now
                raise ServerUnavailableError(f"{name!r} is served over {socket_path(name)}, not "
                                             "there right now (its server starts or stops)")  # fmt: skip
            layout = _read_layout(name, fd)  # ordered after the probe above
            return cls(name, fd, layout)
        except BaseException:
            close_lock_fd(fd)
            raise

    @classmethod
    def _attach_over_socket(cls, name: str, owner_uid: int | None) -> Segment:
        """Map the sealed segment the server of ``name`` hands over NAME.sock (handoff.py)."""
        conn, memfd = connect(name, owner_uid)
        lock_fd = -1
        try:
            layout = _read_layout(name, memfd)
            check_sealed(memfd, layout.total_size)
            lock_fd = reopen_lock_fd(memfd)
            return cls(name, lock_fd, layout, memfd=memfd, conn=conn)
        except BaseException:
            if lock_fd >= 0:
                close_lock_fd(lock_fd)
            conn.close()
            raise
        finally:
            os.close(memfd)  # the mappings hold the memory from here on

    # -- semaphores -------------------------------------------------------------------------

    def _sem(self, sem_name: str) -> posix_ipc.Semaphore:
        sems = self._sems
        sem = sems.get(sem_name)
        if sem is None:
            if sems is None or self._lock_fd < 0:
                raise ServerUnavailableError(f"the attachment to {self.name!r} is closed")
            try:
                sem = posix_ipc.Semaphore(sem_name)
            except posix_ipc.ExistentialError:
                raise ServerUnavailableError(f"{self.name!r} is gone (its semaphores are)") from None
            waited = sem_name.endswith(".free") or ".done." in sem_name  # see ``wait``
            try:
                if waited:
                    self._waiter.open(sem_name)
            except OSError:
                sem.close()
                raise ServerUnavailableError(f"{self.name!r} is gone (its semaphores are)") from None
            # The name may already belong to a newer server's semaphore. It is ours if our
            # server still serves: servers only unlink or create them while they own the name.
            if not self.serving():
                sem.close()
                self._waiter.close_one(sem_name)
                raise ServerUnavailableError(f"the server of {self.name!r} stopped")
            sems[sem_name] = sem
            if sem_name.endswith(".ready"):
                self._ready = sem
        return sem

    def _cached(self, kind: str, index: int) -> posix_ipc.Semaphore:
        """Open ``kind``.``index`` once; later calls find it in a list (the hot path)."""
        sem = self._sem(f"/{self.name}.{kind}.{index}")
        self._per_slot[kind][index] = sem
        return sem

    @property
    def ready(self) -> posix_ipc.Semaphore:
        return self._ready or self._sem(f"/{self.name}.ready")

    @property
    def free(self) -> posix_ipc.Semaphore:
        return self._sem(f"/{self.name}.free")

    def req(self, slot: int) -> posix_ipc.Semaphore:
        return self._per_slot["req"][slot] or self._cached("req", slot)

    def done(self, slot: int) -> posix_ipc.Semaphore:
        return self._per_slot["done"][slot] or self._cached("done", slot)

    def bell(self, index: int) -> posix_ipc.Semaphore:
        return self._per_slot["bell"][index] or self._cached("bell", index)

    def wait(self, sem: posix_ipc.Semaphore, timeout: float) -> bool:
        """Take one post of ``sem`` (one of ours), waiting up to ``timeout`` seconds; False on
        timeout or when a signal interrupted the wait. A signal handler's exception (Ctrl-C's
        ``KeyboardInterrupt``, a SIGALRM timeout) propagates from here, unlike from posix_ipc's
        own ``acquire`` (see semwait.py). For the client's blocking waits."""
        if self._lock_fd < 0:
            raise ServerUnavailableError(f"the attachment to {self.name!r} is closed")
        try:
            return self._waiter.wait(sem.name, timeout)
        except (OSError, KeyError) as exc:
            raise ServerUnavailableError(f"the attachment to {self.name!r} is closed ({exc})") from None

    def error_text(self, slot: int) -> str:
        return bytes(self.slots["error"][slot]).decode("utf-8", "replace")

    # -- locks ------------------------------------------------------------------------------

    def try_lock_slot(self, slot: int) -> bool:
        """Take the lock that marks ownership of ``slot``; False if someone holds it."""
        return try_lock(self._lock_fd, SLOT_BYTE0 + slot)

    def unlock_slot(self, slot: int) -> None:
        unlock(self._lock_fd, SLOT_BYTE0 + slot)

    def free_slot(self, slot: int) -> None:
        """Hand ``slot``, whose lock we hold, back to the table (transitions 6 and 7 above).

        Order matters: the owner fields and FREE first, then the unlock (the next claimer
        re-checks FREE under the lock, and the unlock orders these stores before it), then the
        ``free`` doorbell for anyone waiting to claim."""
        f = self.field
        f["owner_pid"][slot] = 0
        f["handle_id"][slot] = 0
        f["state"][slot] = FREE
        self.unlock_slot(slot)
        self.ring_free()

    def ring_free(self) -> None:
        """Post the ``free`` doorbell, unless it already holds ``FREE_BELL_CAP`` posts: the
        slot is free whether or not anyone hears of it, so a failed or skipped post costs a
        waiting claimer one slice at most. Never raises (a dead server's semaphore included)."""
        try:
            free = self.free
            if free.value < FREE_BELL_CAP:
                free.release()
        except (posix_ipc.Error, OSError, BiCodecShmError):
            pass

    def try_lock_bell(self, index: int) -> bool:
        return try_lock(self._lock_fd, BELL_BYTE0 + index)

    def unlock_bell(self, index: int) -> None:
        unlock(self._lock_fd, BELL_BYTE0 + index)

    def slot_owned_elsewhere(self, slot: int) -> bool:
        return held_elsewhere(self._lock_fd, SLOT_BYTE0 + slot)

    def serving(self) -> bool:
        """True while the server of *this* segment takes requests (one fcntl, no pids)."""
        fd = self._lock_fd
        if fd < 0:
            return False
        if self._creator:
            return self.header is not None and int(self.header["phase"]) == Phase.SERVING
        if self._conn is not None:
            return self._conn.alive()
        try:
            return held_elsewhere(fd, SERVING_BYTE)
        except OSError:
            return False

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Release this process's view, semaphores and locks (every process calls this).

        In the creating server, call ``unlink()`` first: closing drops the name's ownership.
        """
        _live_segments.discard(self)
        for sem in (self._sems or {}).values():
            try:
                sem.close()
            except posix_ipc.Error:
                pass
        self._sems, self._ready = None, None
        self._per_slot = {kind: [None] * self.layout.n_slots for kind in self._per_slot}
        self.header = self.counters = self.histograms = self.slots = None  # type: ignore[assignment]
        self.request_id = self.result_id = None  # type: ignore[assignment]
        self.tokens = self.globals = self.pcm16 = self.pcm32 = None  # type: ignore[assignment]
        self.field = {}
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # Someone still holds a view into the mapping; the kernel frees it at exit.
                log.debug("a view of %r outlived its segment; leaving it mapped", self.name)
            self._mmap = None
        self._waiter.close()
        self._region = None  # its mapping goes with the last semaphore object still in use
        if self._conn is not None:
            self._conn.close()
        handoff, self._handoff = self._handoff, None
        if handoff is not None:
            handoff.close()
        if self._memfd >= 0:
            os.close(self._memfd)
            self._memfd = -1
        if self._lock_fd >= 0:
            close_lock_fd(self._lock_fd)  # drops every lock taken through it
            self._lock_fd = -1
        if self._name_fd >= 0:
            close_lock_fd(self._name_fd)  # the name's OWNER and SERVING locks
            self._name_fd = -1

    def unlink(self) -> None:
        """Remove every named object of this segment (only its creator, owning the name)."""
        if not self._creator or self._lock_fd < 0:
            raise SegmentError(f"only the server that created {self.name!r} may unlink it")
        # Order matters: semaphores first, while the segment's name still keeps every other
        # would-be server out; then the segment itself. The name lock goes with close().
        # Only the semaphores we created: a name another user holds is not ours to remove.
        for sem in (self._sems or {}).values():
            try:
                sem.unlink()
            except posix_ipc.Error:
                pass
        handoff, self._handoff = self._handoff, None
        if handoff is not None:
            handoff.close()  # removes NAME.sock
        _unlink_segment(self.name)
        if self.header is not None:
            self.header["phase"] = Phase.STOPPED

    def _forget_locks_after_fork(self) -> None:
        # The descriptor itself was closed with every other lock descriptor (see
        # ``_close_lock_fds_in_child``); its number may be reused from now on.
        self._lock_fd = self._name_fd = -1
        self._creator = False
        self._handoff = None  # its thread is not in the child

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<Segment {self.name!r} slots={self.layout.n_slots} "
            f"max_tokens={self.layout.max_tokens} size={self.layout.total_size}>"
        )


def _split(sem_name: str) -> tuple[str, int]:
    """("req", 3) for "/NAME.req.3"; ("ready", -1) for "/NAME.ready"."""
    head, _, last = sem_name.rpartition(".")
    if last.isdigit():
        return head.rpartition(".")[2], int(last)
    return last, -1
