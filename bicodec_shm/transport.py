"""The shared-memory segment: header, slot table, payload arrays, semaphores, slot locks.

One POSIX shared-memory object holds everything a server and its clients exchange. Semaphores
are doorbells, never locks: a POSIX semaphore has no owner, so one held by a killed process
would wedge everyone. Slot *ownership* uses open-file-description (OFD) byte-range locks on the
segment's fd instead, which the kernel drops the instant the owner dies.

Segment layout (all offsets are multiples of 64 bytes)::

    0                     HEADER_SIZE            slots_off            tokens_off
    +---------------------+----------------------+--------------------+-----------------+
    | header (HEADER_DT)  | padding to 4 KiB     | slot table         | semantic tokens |
    | magic, version,     |                      | n_slots x SLOT_DT  | n_slots x       |
    | sizes, server pid,  |                      | (state, gen, pid,  | max_tokens int32|
    | epoch, counters     |                      |  lengths, status,  |                 |
    +---------------------+----------------------+--------------------+-----------------+
    globals_off           pcm_off                                            total_size
    +---------------------+--------------------------------------------------+
    | global tokens       | PCM areas: n_slots x (max_tokens*320*4) bytes     |
    | n_slots x 32 int32  | int16 or float32 samples, written in place        |
    +---------------------+--------------------------------------------------+

Named objects (``NAME`` is validated: letters, digits, ``_`` and ``-``)::

    /dev/shm/NAME                 the segment
    /dev/shm/sem.NAME.ready       counting doorbell, clients -> server (one post per request)
    /dev/shm/sem.NAME.done.I      doorbell server -> client, one per slot I (the request's
                                  ``notify`` field names which one to ring)

Slot states (``SlotState``), and who moves a slot from each::

    1. FREE    -> CLAIMED   client, while holding the slot's OFD lock (claim at attach)
    2. CLAIMED -> READY     client: payload first, then header fields, then state, then post
    3. READY   -> BUSY      server, when the slot joins a batch
    4. BUSY    -> DONE      server: PCM and status first, then state, then post ``notify``
    5. DONE    -> CLAIMED   client, after copying its result out
    6. any     -> FREE      client on close (if CLAIMED/DONE), or the server's reaper once the
                            owner's lock is gone (bumping ``generation`` so that a late result
                            can never reach the slot's next owner)

Ordering: every cross-process hand-off ends in ``sem_post``; ``sem_post``/``sem_wait``
synchronise memory (POSIX 4.12), so stores made before a post are visible after the matching
wait. That is why each side writes the payload, *then* the state word, *then* posts.
"""

from __future__ import annotations

import enum
import fcntl
import mmap
import os
import re
import secrets
import struct
from dataclasses import dataclass

import numpy as np
import posix_ipc

from .errors import SegmentError, ServerUnavailableError, SharedMemoryFullError

MAGIC = 0x4D48535F43444342  # b"BCDC_SHM" little-endian
LAYOUT_VERSION = 1
HEADER_SIZE = 4096
HOP = 320  # samples per semantic token at 16 kHz
N_GLOBAL = 32
PCM_BYTES_PER_SAMPLE = 4  # sized for float32, the widest output dtype
ERROR_TEXT_BYTES = 200
HIST_BINS = 65  # batch-size histogram: bin b counts batches of b rows (bin 64 = 64 or more)
DEFAULT_MAX_TOKENS = 1500  # 30 s of audio
DEFAULT_SLOTS = 64
DEFAULT_MODE = 0o600
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class SlotState(enum.IntEnum):
    FREE = 0
    CLAIMED = 1
    READY = 2
    BUSY = 3
    DONE = 4


# Plain ints for the hot paths: comparing numpy arrays with IntEnum members costs several
# microseconds each (measured 8-16 us vs 2-4 us), which matters at ~100 us per round trip.
FREE, CLAIMED, READY, BUSY, DONE = (int(s) for s in SlotState)


class OutputDtype(enum.IntEnum):
    INT16 = 0
    FLOAT32 = 1


class Status(enum.IntEnum):
    """Result codes the server writes into a slot; the client turns non-zero into an error."""

    OK = 0
    BAD_LENGTH = 1
    BAD_SEMANTIC_ID = 2
    BAD_GLOBAL = 3
    BAD_DTYPE = 4
    BAD_STATE = 5
    STALE_GENERATION = 6
    BAD_NOTIFY = 7
    DECODE_FAILED = 8


HEADER_DT = np.dtype(
    [
        ("magic", "<u8"),
        ("version", "<u4"),
        ("header_size", "<u4"),
        ("n_slots", "<u4"),
        ("max_tokens", "<u4"),
        ("n_global", "<u4"),
        ("slot_size", "<u4"),
        ("total_size", "<u8"),
        ("semantic_vocab", "<u4"),
        ("global_vocab", "<u4"),
        ("server_pid", "<u8"),
        ("server_start", "<u8"),  # /proc/PID/stat start time: guards against pid reuse
        ("server_epoch", "<u8"),  # random per server start
        ("serving", "<u4"),  # 1 while serve_forever runs; 0 after a clean stop
        ("max_batch", "<u4"),
        # Live counters, written by the server only.
        ("requests", "<u8"),
        ("batches", "<u8"),
        ("failed", "<u8"),
        ("reclaimed", "<u8"),
        ("tokens", "<u8"),
        ("padded_tokens", "<u8"),
        ("queue_wait_ns", "<u8"),
        ("decode_ns", "<u8"),
        ("batch_hist", "<u8", (HIST_BINS,)),
    ],
    align=True,
)

# The counters, contiguous in the header so they can be viewed as one uint64 array.
COUNTERS = ("requests", "batches", "failed", "reclaimed", "tokens", "padded_tokens",
            "queue_wait_ns", "decode_ns")  # fmt: skip
(C_REQUESTS, C_BATCHES, C_FAILED, C_RECLAIMED, C_TOKENS, C_PADDED, C_QUEUE_WAIT,
 C_DECODE) = range(len(COUNTERS))  # fmt: skip
assert [HEADER_DT.fields[c][1] for c in COUNTERS] == [
    HEADER_DT.fields[COUNTERS[0]][1] + 8 * i for i in range(len(COUNTERS))
], "counters must be contiguous"

SLOT_DT = np.dtype(
    [
        ("state", "<u4"),
        ("dtype", "<u4"),  # OutputDtype
        ("generation", "<u8"),  # bumped by the server's reaper on reclaim
        ("req_generation", "<u8"),  # the generation the client believes it owns
        ("owner_pid", "<u8"),
        ("request_seq", "<u8"),  # client-chosen, echoed into result_seq with the result
        ("result_seq", "<u8"),
        ("n_tokens", "<u4"),
        ("n_global", "<u4"),
        ("notify", "<u4"),  # index of the done semaphore to post
        ("status", "<i4"),  # Status
        ("n_samples", "<u8"),
        ("t_submit_ns", "<u8"),  # CLOCK_MONOTONIC, shared by all processes on the host
        ("t_start_ns", "<u8"),
        ("t_done_ns", "<u8"),
        ("error", f"S{ERROR_TEXT_BYTES}"),
    ],
    align=True,
)


def drain(sem: posix_ipc.Semaphore) -> None:
    """Take every pending post of ``sem`` without blocking (stale doorbells of a slot)."""
    while True:
        try:
            sem.acquire(0)
        except posix_ipc.BusyError:
            return


def validate_name(name: str) -> str:
    """Return ``name`` if it is a usable segment name, else raise ``ValueError``."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid segment name {name!r}: use 1-128 characters from A-Z a-z 0-9 _ -"
        )
    return name


def random_name(prefix: str = "bcshm") -> str:
    """A fresh, collision-resistant segment name (for tests and private servers)."""
    return f"{prefix}-{secrets.token_hex(6)}"


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Layout:
    """Byte offsets of each region, derived from (n_slots, max_tokens) alone."""

    n_slots: int
    max_tokens: int

    @property
    def slots_off(self) -> int:
        return HEADER_SIZE

    @property
    def tokens_off(self) -> int:
        return _align(self.slots_off + self.n_slots * SLOT_DT.itemsize)

    @property
    def globals_off(self) -> int:
        return _align(self.tokens_off + self.n_slots * self.max_tokens * 4)

    @property
    def pcm_off(self) -> int:
        return _align(self.globals_off + self.n_slots * N_GLOBAL * 4, 4096)

    @property
    def pcm_stride(self) -> int:
        return _align(self.max_tokens * HOP * PCM_BYTES_PER_SAMPLE, 4096)

    @property
    def total_size(self) -> int:
        return self.pcm_off + self.n_slots * self.pcm_stride


def _proc_stat(pid: int) -> tuple[bytes, int] | None:
    """(state letter, start time in clock ticks since boot) of ``pid``, or None if none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0], int(fields[19])


def process_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot, or 0 if there is no such process."""
    stat = _proc_stat(pid)
    return 0 if stat is None else stat[1]


def process_alive(pid: int, start_time: int) -> bool:
    """True if ``pid`` runs and is the same process that recorded ``start_time``."""
    stat = _proc_stat(pid) if pid > 0 else None
    # A zombie still has a /proc entry, but will never serve again.
    return stat is not None and stat[0] not in (b"Z", b"X") and stat[1] == start_time


def header_server_alive(h: np.void | np.ndarray) -> bool:
    """True if the server that wrote header ``h`` is still running (pid reuse guarded)."""
    return process_alive(int(h["server_pid"]), int(h["server_start"]))


# struct flock on Linux (x86-64 and aarch64): short type, short whence, off_t start, off_t len,
# pid_t pid (must be 0 for OFD locks), padded to 32 bytes.
_FLOCK = struct.Struct("@hhqqi4x")


def _ofd_lock(fd: int, index: int, *, exclusive: bool = True) -> bool:
    """Try to take the OFD lock on byte ``index`` of ``fd`` without blocking."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, index, 1, 0))
    except OSError:
        return False
    return True


def _ofd_unlock(fd: int, index: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, index, 1, 0))


def object_names(name: str, n_slots: int) -> list[str]:
    """Every POSIX object name that a segment called ``name`` owns (for unlinking)."""
    return [f"/{name}", f"/{name}.ready"] + [f"/{name}.done.{i}" for i in range(n_slots)]


class Segment:
    """A mapped segment: numpy views over the header, the slot table and the payload areas.

    The server creates it (``Segment.create``); clients attach (``Segment.attach``). ``close()``
    runs in every process; ``unlink()`` only in the server. Views:

    - ``header``: 0-d structured array (``HEADER_DT``)
    - ``slots``: (n_slots,) structured array (``SLOT_DT``)
    - ``tokens``: (n_slots, max_tokens) int32
    - ``globals``: (n_slots, 32) int32
    - ``pcm_int16(i, n)`` / ``pcm_float32(i, n)``: the first n samples of slot i's PCM area
    """

    # Class-level defaults keep close() safe after a failed __init__.
    _shm: posix_ipc.SharedMemory | None = None
    _mmap: mmap.mmap | None = None
    ready: posix_ipc.Semaphore | None = None
    done: list[posix_ipc.Semaphore] = []

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, layout: Layout) -> None:
        self.name = name
        self.layout = layout
        self._shm = shm
        self._mmap = mmap.mmap(shm.fd, layout.total_size)
        buf = self._mmap
        self.header = np.ndarray((), HEADER_DT, buf, 0)
        self.slots = np.ndarray((layout.n_slots,), SLOT_DT, buf, layout.slots_off)
        self.tokens = np.ndarray(
            (layout.n_slots, layout.max_tokens), np.int32, buf, layout.tokens_off
        )
        self.globals = np.ndarray((layout.n_slots, N_GLOBAL), np.int32, buf, layout.globals_off)
        self._pcm = np.ndarray(
            (layout.n_slots, layout.pcm_stride), np.uint8, buf, layout.pcm_off
        )
        # One (n_slots,) view per slot field, made once: building a field view per access
        # costs about a microsecond, and the hot path touches a dozen fields per request.
        self.field = {name: self.slots[name] for name in SLOT_DT.names}
        # The live counters as one uint64 array (index with the C_* constants).
        self.counters = np.ndarray((len(COUNTERS),), "<u8", buf, HEADER_DT.fields[COUNTERS[0]][1])

    # -- construction -------------------------------------------------------------------

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
    ) -> Segment:
        """Create the segment and its semaphores with O_CREX (fails if the name exists)."""
        validate_name(name)
        if not 1 <= n_slots <= 4096:
            raise ValueError(f"slots must be in 1..4096, got {n_slots}")
        if not 1 <= max_tokens <= 100_000:
            raise ValueError(f"max_tokens must be in 1..100000, got {max_tokens}")
        layout = Layout(n_slots, max_tokens)
        check_free_space(layout.total_size)
        shm = posix_ipc.SharedMemory(
            f"/{name}", posix_ipc.O_CREX, mode=mode, size=layout.total_size
        )
        seg = cls(name, shm, layout)
        try:
            # Who is creating it, first: a creator killed before it writes the magic leaves a
            # segment that the next server recognises as stale by this pid.
            seg.header["server_pid"] = os.getpid()
            seg.header["server_start"] = process_start_time(os.getpid())
            # The umask narrows the mode given at creation: set it explicitly afterwards.
            os.fchmod(shm.fd, mode)
            seg.ready = posix_ipc.Semaphore(f"/{name}.ready", posix_ipc.O_CREX, mode, 0)
            seg.done = []
            for i in range(n_slots):
                seg.done.append(posix_ipc.Semaphore(f"/{name}.done.{i}", posix_ipc.O_CREX, mode, 0))
            _chmod_semaphores(name, n_slots, mode)
            h = seg.header
            h["version"] = LAYOUT_VERSION
            h["header_size"] = HEADER_SIZE
            h["n_slots"] = n_slots
            h["max_tokens"] = max_tokens
            h["n_global"] = N_GLOBAL
            h["slot_size"] = SLOT_DT.itemsize
            h["total_size"] = layout.total_size
            h["semantic_vocab"] = semantic_vocab
            h["global_vocab"] = global_vocab
            h["max_batch"] = max_batch
            # Order matters: magic last, so an attaching client never accepts a half-written
            # header (it checks magic first).
            h["magic"] = MAGIC
        except BaseException:
            seg.close()
            seg.unlink()
            raise
        return seg

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Open an existing segment by name without resizing it, and verify its header.

        Raises ``ServerUnavailableError`` if nothing exists under the name and ``SegmentError``
        if what exists is not a bicodec-shm segment of this layout version.
        """
        validate_name(name)
        try:
            shm = posix_ipc.SharedMemory(f"/{name}")  # no size: never re-truncate
        except posix_ipc.ExistentialError:
            raise ServerUnavailableError(
                f"no bicodec-shm server is running under the name {name!r} "
                f"(/dev/shm/{name} does not exist); start one with `bicodec-shm serve --name {name}`"
            ) from None
        except posix_ipc.PermissionsError as e:
            raise SegmentError(
                f"/dev/shm/{name} exists but this user may not open it ({e}); the server "
                "creates it with mode 0o600 (owner only) unless started with --mode 0o660"
            ) from None
        try:
            layout = _read_layout(name, shm)
            seg = cls(name, shm, layout)
        except BaseException:
            shm.close_fd()
            raise
        try:
            seg.ready = posix_ipc.Semaphore(f"/{name}.ready")
            seg.done = [posix_ipc.Semaphore(f"/{name}.done.{i}") for i in range(layout.n_slots)]
        except posix_ipc.ExistentialError:
            seg.close()
            raise ServerUnavailableError(
                f"the segment {name!r} exists but its semaphores are gone: its server is "
                "stopping or died while starting"
            ) from None
        return seg

    # -- payload views ------------------------------------------------------------------

    def pcm_int16(self, slot: int, n_samples: int) -> np.ndarray:
        """(n_samples,) int16 view into slot ``slot``'s PCM area."""
        return self._pcm[slot, : n_samples * 2].view(np.int16)

    def pcm_float32(self, slot: int, n_samples: int) -> np.ndarray:
        """(n_samples,) float32 view into slot ``slot``'s PCM area."""
        return self._pcm[slot, : n_samples * 4].view(np.float32)

    def error_text(self, slot: int) -> str:
        return bytes(self.slots["error"][slot]).decode("utf-8", "replace")

    # -- slot locks (ownership) ---------------------------------------------------------

    @property
    def fd(self) -> int:
        assert self._shm is not None
        return self._shm.fd

    def try_lock_slot(self, slot: int) -> bool:
        """Take the OFD lock that marks ownership of ``slot``; False if someone holds it."""
        return _ofd_lock(self.fd, slot)

    def unlock_slot(self, slot: int) -> None:
        _ofd_unlock(self.fd, slot)

    # -- server liveness ----------------------------------------------------------------

    def server_alive(self) -> bool:
        h = self.header
        return bool(h["serving"]) and header_server_alive(h)

    # -- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Release this process's view and handles (every process calls this)."""
        for sem in [self.ready, *self.done]:
            if sem is not None:
                try:
                    sem.close()
                except posix_ipc.Error:
                    pass
        self.ready, self.done = None, []
        self.header = self.slots = self.tokens = self.globals = self._pcm = None  # type: ignore[assignment]
        self.field, self.counters = {}, None  # type: ignore[assignment]
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A caller still holds a view into the mapping; the kernel frees it on exit.
                pass
            self._mmap = None
        if self._shm is not None:
            try:
                self._shm.close_fd()  # also drops every OFD lock taken through this fd
            except posix_ipc.Error:
                pass
            self._shm = None

    def drop_fd(self) -> None:
        """Close the fd without touching the mapping: used in a forked child so the child's
        copy of the fd no longer keeps the parent's slot locks alive."""
        if self._shm is not None:
            try:
                os.close(self._shm.fd)
            except OSError:
                pass
            self._shm = None

    def unlink(self) -> None:
        """Remove every named object of this segment (server only)."""
        unlink_all(self.name, self.layout.n_slots)

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<Segment {self.name!r} slots={self.layout.n_slots} "
            f"max_tokens={self.layout.max_tokens} size={self.layout.total_size}>"
        )


def check_free_space(needed: int, directory: str = "/dev/shm") -> None:
    """Raise ``SharedMemoryFullError`` unless ``directory`` has ``needed`` bytes free.

    tmpfs allocates pages lazily, so a too-small /dev/shm would otherwise fail later, with
    SIGBUS in whichever process first touches a missing page.
    """
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


def read_header(name: str) -> np.void | None:
    """A copy of the raw header of ``/dev/shm/NAME`` without validating it, or None if the
    name does not exist or is too small to hold a header."""
    validate_name(name)
    try:
        shm = posix_ipc.SharedMemory(f"/{name}")
    except posix_ipc.Error:
        return None
    try:
        if os.fstat(shm.fd).st_size < HEADER_SIZE:
            return None
        with mmap.mmap(shm.fd, HEADER_SIZE, prot=mmap.PROT_READ) as m:
            return np.frombuffer(m, HEADER_DT, 1)[0].copy()
    finally:
        shm.close_fd()


def stats_from_header(h: np.void) -> dict:
    """The live counters of a header as plain Python numbers (see ``bicodec-shm stats``)."""
    batches = int(h["batches"])
    requests = int(h["requests"])
    hist = [int(v) for v in h["batch_hist"]]
    rows = sum(b * n for b, n in enumerate(hist))
    return {
        "server_pid": int(h["server_pid"]),
        "server_epoch": int(h["server_epoch"]),
        "serving": bool(h["serving"]),
        "slots": int(h["n_slots"]),
        "max_tokens": int(h["max_tokens"]),
        "max_batch": int(h["max_batch"]),
        "requests": requests,
        "batches": batches,
        "failed": int(h["failed"]),
        "reclaimed": int(h["reclaimed"]),
        "tokens": int(h["tokens"]),
        "padded_tokens": int(h["padded_tokens"]),
        "avg_batch_size": rows / batches if batches else 0.0,
        "avg_queue_wait_ms": int(h["queue_wait_ns"]) / 1e6 / requests if requests else 0.0,
        "avg_batch_time_ms": int(h["decode_ns"]) / 1e6 / batches if batches else 0.0,
        "batch_size_histogram": {b: n for b, n in enumerate(hist) if n},
    }


def _chmod_semaphores(name: str, n_slots: int, mode: int) -> None:
    # posix_ipc cannot fchmod a semaphore; on Linux each lives at /dev/shm/sem.NAME.
    for obj in object_names(name, n_slots)[1:]:
        path = f"/dev/shm/sem.{obj[1:]}"
        if os.path.exists(path):
            os.chmod(path, mode)


def _read_layout(name: str, shm: posix_ipc.SharedMemory) -> Layout:
    size = os.fstat(shm.fd).st_size
    if size < HEADER_SIZE:
        raise SegmentError(
            f"/dev/shm/{name} is {size} bytes, too small to be a bicodec-shm segment "
            "(it is not ours, or its server died while creating it)"
        )
    with mmap.mmap(shm.fd, HEADER_SIZE, prot=mmap.PROT_READ) as m:
        h = np.frombuffer(m, HEADER_DT, 1)[0].copy()
    if int(h["magic"]) != MAGIC:
        raise SegmentError(f"/dev/shm/{name} is not a bicodec-shm segment (bad magic)")
    if int(h["version"]) != LAYOUT_VERSION:
        raise SegmentError(
            f"/dev/shm/{name} has layout version {int(h['version'])}, this client speaks "
            f"version {LAYOUT_VERSION}: upgrade the client or the server so they match"
        )
    layout = Layout(int(h["n_slots"]), int(h["max_tokens"]))
    if (
        int(h["header_size"]) != HEADER_SIZE
        or int(h["slot_size"]) != SLOT_DT.itemsize
        or int(h["n_global"]) != N_GLOBAL
        or int(h["total_size"]) != layout.total_size
        or size < layout.total_size
    ):
        raise SegmentError(
            f"/dev/shm/{name}: header sizes do not match the layout "
            f"(segment {size} bytes, header says {int(h['total_size'])})"
        )
    return layout


def unlink_all(name: str, n_slots: int | None = None) -> int:
    """Unlink the segment ``name`` and its semaphores; returns how many objects were removed.

    With ``n_slots`` None, every ``sem.NAME.done.*`` found in /dev/shm is removed.
    """
    removed = 0
    try:
        posix_ipc.unlink_shared_memory(f"/{name}")
        removed += 1
    except posix_ipc.ExistentialError:
        pass
    names = [f"/{name}.ready"]
    if n_slots is None:
        prefix = f"sem.{name}.done."
        try:
            names += ["/" + f[4:] for f in os.listdir("/dev/shm") if f.startswith(prefix)]
        except OSError:
            pass
    else:
        names += [f"/{name}.done.{i}" for i in range(n_slots)]
    for sem in names:
        try:
            posix_ipc.unlink_semaphore(sem)
            removed += 1
        except posix_ipc.ExistentialError:
            pass
    return removed


def leftover_objects(name: str) -> list[str]:
    """Entries of /dev/shm that belong to ``name`` (for tests and the soak's leak check)."""
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(
        e for e in entries if e == name or e.startswith(f"sem.{name}.")
    )

