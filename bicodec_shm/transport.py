"""The shared-memory segment: layout, semaphores, locks, and who may create, attach and unlink.

One POSIX shared-memory object holds everything a server and its clients exchange. Semaphores
are doorbells, never locks: a POSIX semaphore has no owner, so one held by a killed process
would wedge everyone. Ownership (of the name, of a slot, of a bell) uses open-file-description
(OFD) byte-range locks on the segment's inode instead, which the kernel drops the instant the
last descriptor of their open file description closes, e.g. when the owner dies. No pid is ever
trusted: liveness works across PID namespaces (a Kubernetes pod's containers, ``docker
--ipc=container:X``) and survives pid reuse.

Segment layout (all offsets are multiples of 64 bytes)::

    0                     HEADER_SIZE            slots_off            tokens_off
    +---------------------+----------------------+--------------------+-----------------+
    | header (HEADER_DT)  | padding to 4 KiB     | slot table         | codes           |
    | magic, version,     |                      | n_slots x SLOT_DT  | n_slots x       |
    | sizes, codec layout,|                      | (state, epoch,     | max_tokens x    |
    | counters, histos    |                      |  identities, lens, | codes_per_frame |
    |                     |                      |  status)           | int32           |
    +---------------------+----------------------+--------------------+-----------------+
    globals_off           pcm_off                                            total_size
    +---------------------+--------------------------------------------------+
    | global tokens       | PCM areas: n_slots x (max_tokens*spf*4) bytes     |
    | n_slots x n_global  | int16 or float32 samples, written in place        |
    +---------------------+--------------------------------------------------+

The codec seam. A server serves one codec, named in the header with its token layout
(``codecs.CodecLayout``: levels, codes per frame at each level, vocabularies, samples per frame
``spf``, sample rate, global ids). ``max_tokens`` counts *frames* (BiCodec: semantic tokens).
A slot's codes row holds level ``i`` at columns ``[max_tokens·P_i, max_tokens·P_(i+1))``, with
``P_i`` the sum of the rates of the levels before ``i``; a request of ``n`` frames fills the
first ``n·rate_i`` of them. BiCodec (one level, rate 1, 32 globals, spf 320) has exactly the
areas of layout version 3; SNAC (no global ids) has an empty global area. A slot's
``noise_seed`` (and ``flags`` bit ``FLAG_NO_NOISE``, and ``start_frame`` for a streaming window)
make a SNAC decode a pure function of its request; BiCodec ignores them.

Named objects (``NAME``: letters, digits, ``_`` and ``-``, optionally a ``.K`` group suffix)::

    /dev/shm/NAME              the segment; the server creates it O_CREX, reserves it with
                               posix_fallocate, and is the only one who ever unlinks it
    /dev/shm/sem.NAME.ready    clients -> server: "some slot is READY" (wake-up only)
    /dev/shm/sem.NAME.free     -> clients waiting to claim: "some slot became FREE"
    /dev/shm/sem.NAME.req.I    client -> server, slot I: pairs the server's reads of the request
    /dev/shm/sem.NAME.done.I   server -> client, slot I: pairs the client's reads of the result
    /dev/shm/sem.NAME.bell.J   server -> one client handle's asyncio waiter (bell J): wake-up only

A server group (group.py) puts a small object of its own under NAME instead of a segment
(magic ``GROUP_MAGIC``, the same OWNER and SERVING lock bytes); its members are NAME.0, NAME.1...

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

Slot states (``SlotState``), and who moves a slot from each::

    1. FREE    -> CLAIMED   client, holding the slot's lock; it bumps ``generation`` (the claim
                            epoch) and drains the slot's stale posts
    2. CLAIMED -> READY     client: payload, fields, request identity, state; then post req.I,
                            then post ready
    3. READY   -> BUSY      server, after taking req.I, when the slot joins a batch
    4. BUSY    -> DONE      server: PCM, status, answer identity, state; then post done.I (and
                            bell J), then the slot leaves the batch's held set
    5. DONE    -> CLAIMED   client, after taking done.I and checking the answer's identity
    6. CLAIMED -> FREE      client, for a slot in state CLAIMED only (then unlock, post free)
    7. any     -> FREE      the server's reaper, holding the slot's lock after its owner died
                            or let go, for a slot no batch holds; it bumps ``generation``

Nobody else frees a slot. A client that lets go of a slot in any other state (closing with a
request READY, BUSY or DONE, or dying) only drops the slot's lock: the reaper frees it, and the
reaper never touches a slot that a batch holds, so every free is ordered after the server's
last write to the slot and its last post (``tests/test_protocol_model.py`` checks this rule,
and finds the cross-delivery that freeing a DONE slot on close caused).

Identity (an answer names its request). A request carries ``(handle_id, req_generation,
request_seq)``: the attachment's random 64-bit id, the claim epoch of the slot, and the
attachment's sequence number. The server copies the three into ``(result_handle,
result_generation, result_seq)`` with the answer, from its private copy of the request header.
A client takes an answer only if all three match the request it waits for, whatever the
semaphore counts say: so a stale post, a slot handed on to another client, a restarted
sequence counter or a new server incarnation can never deliver another request's audio. The
server refuses a request whose ``req_generation`` is not the slot's ``generation`` (the slot was
reclaimed under it).

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

import enum
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import time
import weakref
from dataclasses import dataclass, replace

import numpy as np
import posix_ipc

from .codecs.layout import BICODEC, CodecLayout
from .semwait import Waiter
from .errors import (
    BiCodecShmError,
    SegmentError,
    ServerAlreadyRunningError,
    ServerUnavailableError,
    SharedMemoryFullError,
)

log = logging.getLogger("bicodec_shm.transport")

MAGIC = 0x4D48535F43444342  # b"BCDC_SHM" little-endian
# The magic of a server group's small object under the group's name (group.py). Defined here
# so that the takeover of a dead owner's leftovers (``_check_takeover``) knows it as ours.
GROUP_MAGIC = 0x5052475F43444342  # b"BCDC_GRP" little-endian
# The first 8 bytes of a name's object from its sizing until its real magic is written: a
# server that dies in between leaves something ``_check_takeover`` still knows as ours. (An
# object of zeros is not: it may be anybody's.)
CREATING_MAGIC = 0x5745_4E5F_4344_4342  # b"BCDC_NEW" little-endian
# 3: answers carry their request's identity; 4: the codec seam; 5: a SNAC request's start frame
LAYOUT_VERSION = 5
HEADER_SIZE = 4096
HOP = 320  # samples per semantic token at 16 kHz
N_GLOBAL = 32
PCM_BYTES_PER_SAMPLE = 4  # sized for float32, the widest output dtype
ERROR_TEXT_BYTES = 200
HIST_BINS = 65  # batch-size histogram: bin b counts batches of b rows (bin 64 = 64 or more)
DEFAULT_MAX_TOKENS = 1500  # 30 s of audio
DEFAULT_SLOTS = 64
MAX_SLOTS = 4096
DEFAULT_MODE = 0o600
DEFAULT_START_WAIT = 30.0  # seconds a new server waits for one stopping under its name
MAX_LEVELS = 8  # code levels a header can describe
CODEC_NAME_BYTES = 32
FLAG_NO_NOISE = 1  # slot ``flags``: decode without the codec's noise (SNAC's noise=False)
NO_BELL = 0xFFFFFFFF  # ``notify`` of a synchronous request: ring no bell
# The ``free`` doorbell is posted on every give-back but taken only by claimers that wait:
# without a bound its count would grow until sem_post fails with EOVERFLOW. A few posts are
# enough to wake every claimer that waits (each re-scans the table after waking).
FREE_BELL_CAP = 64

# Lock bytes of the segment's inode (see the module docstring).
OWNER_BYTE = 0
SERVING_BYTE = 1
SLOT_BYTE0 = 64
BELL_BYTE0 = SLOT_BYTE0 + MAX_SLOTS

# Upper bounds (seconds) of the latency histograms, Prometheus style (+Inf is the last bin).
# From 1 ms (a GPU batch of short rows) to 60 s (a long utterance on a loaded CPU server).
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)  # fmt: skip
N_TIME_BINS = len(TIME_BUCKETS) + 1

# Names: a base of letters, digits, _ and -, and for members of a server group a ".K" suffix.
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,120}(\.[0-9]{1,3})?$")
# What follows "sem.NAME." for the semaphores of NAME (and of no other name).
_SEM_SUFFIX_RE = re.compile(r"^(ready|free|(req|done|bell)\.[0-9]+)$")


class SlotState(enum.IntEnum):
    FREE = 0
    CLAIMED = 1
    READY = 2
    BUSY = 3
    DONE = 4


# Plain ints for the hot paths: comparing numpy arrays with IntEnum members costs several
# microseconds each (measured 8-16 us vs 2-4 us), which matters at ~100 us per round trip.
FREE, CLAIMED, READY, BUSY, DONE = (int(s) for s in SlotState)


class Phase(enum.IntEnum):
    """The server's life, in the header (informational: liveness is the SERVING lock)."""

    CREATING = 0
    SERVING = 1
    STOPPING = 2
    STOPPED = 3


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


N_STATUS = 16  # room in the header's failed-by-status counters

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
        ("server_pid", "<u8"),  # informational only: in the server's own PID namespace
        ("server_epoch", "<u8"),  # random per server start
        ("server_uid", "<u4"),
        ("phase", "<u4"),  # Phase
        ("max_batch", "<u4"),
        ("lanes", "<u4"),  # decode lanes of the server
        ("busy_lanes", "<u4"),
        ("started_ns", "<u8"),  # CLOCK_MONOTONIC when serving began
        # Live counters, written by the server only (contiguous: viewed as one uint64 array).
        ("requests", "<u8"),
        ("batches", "<u8"),
        ("failed", "<u8"),
        ("reclaimed", "<u8"),
        ("tokens", "<u8"),
        ("padded_tokens", "<u8"),
        ("queue_wait_ns", "<u8"),
        ("decode_ns", "<u8"),
        ("latency_ns", "<u8"),  # submit -> result published, summed over requests
        ("host_gap_ns", "<u8"),  # a lane idle while decodable work waited for the host
        ("lane_busy_ns", "<u8"),  # lanes' time inside the decoder, summed over lanes
        ("batch_hist", "<u8", (HIST_BINS,)),
        ("failed_by_status", "<u8", (N_STATUS,)),
        ("queue_hist", "<u8", (N_TIME_BINS,)),  # per request, TIME_BUCKETS
        ("latency_hist", "<u8", (N_TIME_BINS,)),  # per request
        ("decode_hist", "<u8", (N_TIME_BINS,)),  # per batch
        # The codec's token layout (codecs.CodecLayout); fixed before the magic is written.
        ("codec", f"S{CODEC_NAME_BYTES}"),
        ("n_levels", "<u4"),
        ("level_rates", "<u4", (MAX_LEVELS,)),
        ("level_vocab", "<u4", (MAX_LEVELS,)),
        ("samples_per_frame", "<u4"),
        ("sample_rate", "<u4"),
    ],
    align=True,
)

COUNTERS = ("requests", "batches", "failed", "reclaimed", "tokens", "padded_tokens",
            "queue_wait_ns", "decode_ns", "latency_ns", "host_gap_ns", "lane_busy_ns")  # fmt: skip
(C_REQUESTS, C_BATCHES, C_FAILED, C_RECLAIMED, C_TOKENS, C_PADDED, C_QUEUE_WAIT, C_DECODE,
 C_LATENCY, C_HOST_GAP, C_LANE_BUSY) = range(len(COUNTERS))  # fmt: skip
assert [HEADER_DT.fields[c][1] for c in COUNTERS] == [
    HEADER_DT.fields[COUNTERS[0]][1] + 8 * i for i in range(len(COUNTERS))
], "counters must be contiguous"
# The per-request and per-batch time histograms, contiguous too: one (3, N_TIME_BINS) view.
TIME_HISTOGRAMS = ("queue_hist", "latency_hist", "decode_hist")
assert [HEADER_DT.fields[h][1] for h in TIME_HISTOGRAMS] == [
    HEADER_DT.fields[TIME_HISTOGRAMS[0]][1] + 8 * N_TIME_BINS * i for i in range(3)
], "time histograms must be contiguous"

SLOT_DT = np.dtype(
    [
        ("state", "<u4"),
        ("dtype", "<u4"),  # OutputDtype
        # The claim epoch: bumped by every claimer (under the slot's lock) and by the reaper.
        ("generation", "<u8"),
        # The request's identity, written by its client (contiguous: viewed as (n_slots, 3)):
        ("handle_id", "<u8"),  # random per client attachment
        ("req_generation", "<u8"),  # the claim epoch the client owns
        ("request_seq", "<u8"),  # per attachment, from 1
        # The answer's identity: the server copies the request's identity here with the result.
        ("result_handle", "<u8"),
        ("result_generation", "<u8"),
        ("result_seq", "<u8"),
        ("owner_pid", "<u8"),  # informational only: in the owner's own PID namespace
        ("n_tokens", "<u4"),
        ("n_global", "<u4"),
        ("notify", "<u4"),  # bell to ring besides done.I, or NO_BELL
        ("status", "<i4"),  # Status
        ("n_samples", "<u8"),
        ("t_submit_ns", "<u8"),  # CLOCK_MONOTONIC, client-written: clamped before any use
        ("t_start_ns", "<u8"),
        ("t_done_ns", "<u8"),
        ("noise_seed", "<u8"),  # SNAC: the request's noise (codecs.DEFAULT_NOISE_SEED if unnamed)
        ("flags", "<u4"),  # FLAG_NO_NOISE
        ("error", f"S{ERROR_TEXT_BYTES}"),
        # SNAC: the frame at which a streaming window starts in its utterance, so that it draws
        # the full decode's noise there (0 for a whole utterance). Last, in what was the
        # record's tail padding: every other field keeps its offset and the record its size.
        ("start_frame", "<u4"),
    ],
    align=True,
)
REQUEST_ID = ("handle_id", "req_generation", "request_seq")
RESULT_ID = ("result_handle", "result_generation", "result_seq")
for _id in (REQUEST_ID, RESULT_ID):
    assert [SLOT_DT.fields[f][1] for f in _id] == [SLOT_DT.fields[_id[0]][1] + 8 * i for i in range(3)], (
        "identity fields must be contiguous"
    )


def drain(sem: posix_ipc.Semaphore) -> int:
    """Take every pending post of ``sem`` without blocking; returns how many there were."""
    n = 0
    while True:
        try:
            sem.acquire(0)
        except posix_ipc.BusyError:
            return n
        n += 1


def validate_name(name: str) -> str:
    """Return ``name`` if it is a usable segment name, else raise ``ValueError``."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid segment name {name!r}: use 1-120 characters from A-Z a-z 0-9 _ - "
            "(optionally followed by a group member suffix .0 to .999)"
        )
    return name


def random_name(prefix: str = "bcshm") -> str:
    """A fresh, collision-resistant segment name (for tests and private servers)."""
    return f"{prefix}-{secrets.token_hex(6)}"


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Layout:
    """Byte offsets of each region, derived from (n_slots, max_tokens, codec) alone.

    ``max_tokens`` counts frames; ``codec`` (BiCodec by default) sizes the areas per frame."""

    n_slots: int
    max_tokens: int
    codec: CodecLayout = BICODEC

    @property
    def codes_per_slot(self) -> int:
        """int32 columns of a slot's codes row: every level's codes of the longest request."""
        return self.max_tokens * self.codec.codes_per_frame

    def level_offset(self, level: int) -> int:
        """First column of ``level`` in a slot's codes row (levels laid out one after another)."""
        return self.max_tokens * sum(self.codec.level_rates[:level])

    @property
    def slots_off(self) -> int:
        return HEADER_SIZE

    @property
    def tokens_off(self) -> int:
        return _align(self.slots_off + self.n_slots * SLOT_DT.itemsize)

    @property
    def globals_off(self) -> int:
        return _align(self.tokens_off + self.n_slots * self.codes_per_slot * 4)

    @property
    def pcm_off(self) -> int:
        return _align(self.globals_off + self.n_slots * self.codec.n_global * 4, 4096)

    @property
    def pcm_stride(self) -> int:
        return _align(self.max_tokens * self.codec.samples_per_frame * PCM_BYTES_PER_SAMPLE, 4096)

    @property
    def total_size(self) -> int:
        return self.pcm_off + self.n_slots * self.pcm_stride


# -- OFD locks --------------------------------------------------------------------------------

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


# -- objects by name --------------------------------------------------------------------------


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
        if e == name or (e.startswith(prefix) and _SEM_SUFFIX_RE.match(e[len(prefix):]))
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
    try:
        posix_ipc.unlink_shared_memory(f"/{name}")
        return 1
    except posix_ipc.ExistentialError:
        return 0


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
        return _own_name(name, mode, time.monotonic() + wait)
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
    except posix_ipc.Error:
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
        if entry.startswith(prefix) and _NAME_RE.match(entry) and probe(entry) is ServerState.DEAD:
            try:
                removed += remove_dead(entry)
            except (BiCodecShmError, OSError, posix_ipc.Error):
                pass  # taken over or alive meanwhile
    return removed


def is_stopping(name: str) -> bool:
    """True if the server under ``name`` has begun to stop (it may still finish batches)."""
    try:
        fd = posix_ipc.SharedMemory(f"/{validate_name(name)}").fd
    except posix_ipc.Error:
        return False
    try:
        return _stopping(fd)
    finally:
        os.close(fd)


def unlink_all(name: str) -> int:
    """Unlink the segment ``name`` and its semaphores, whoever made them; returns the count.

    For test clean-up and ``bicodec-shm cleanup`` only: callers check first that no live server
    holds the name (``probe``). Servers remove their own objects with ``Segment.unlink``.
    """
    return _unlink_semaphores(name) + _unlink_segment(name)


def _same_inode(fd: int, name: str) -> bool:
    """True if ``/dev/shm/NAME`` still names the inode open as ``fd``."""
    try:
        other = posix_ipc.SharedMemory(f"/{name}")
    except posix_ipc.Error:
        return False
    try:
        a, b = os.fstat(fd), os.fstat(other.fd)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    finally:
        other.close_fd()


class ServerState(enum.Enum):
    """What ``probe`` finds under a name."""

    ABSENT = "absent"  # nothing, or not a segment of ours
    SERVING = "serving"  # a live server takes requests
    BUSY = "busy"  # a live server is starting or stopping (it holds the name, not SERVING)
    DEAD = "dead"  # leftovers of a server that died: the next server takes them over


def probe(name: str) -> ServerState:
    """Find out, by its locks, whether a server lives under ``name`` (no pids involved)."""
    validate_name(name)
    try:
        shm = posix_ipc.SharedMemory(f"/{name}")
    except posix_ipc.Error:
        return ServerState.ABSENT
    try:
        if held_elsewhere(shm.fd, SERVING_BYTE):
            return ServerState.SERVING
        if held_elsewhere(shm.fd, OWNER_BYTE):
            return ServerState.BUSY
        return ServerState.DEAD
    finally:
        shm.close_fd()


# -- the segment ------------------------------------------------------------------------------

_live_segments: weakref.WeakSet[Segment] = weakref.WeakSet()
# Every lock descriptor of this process, from the moment it is opened. Registering it in the
# same critical section as the open, and holding that section across fork(), leaves no window
# in which a fork (by another thread, during an attach or a create) could copy a descriptor the
# child then never closes: the child would keep the parent's locks for as long as it lives.
_lock_fds: set[int] = set()
_fork_guard = threading.Lock()


def _open_lock_fd(name: str, flags: int = 0, mode: int = DEFAULT_MODE) -> int:
    """Open ``/dev/shm/NAME`` for a lock descriptor of ours (posix_ipc errors propagate)."""
    with _fork_guard:
        fd = posix_ipc.SharedMemory(f"/{name}", flags, mode=mode, size=0).fd
        _lock_fds.add(fd)
    return fd


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
    for seg in list(_live_segments):
        seg._forget_locks_after_fork()
    _fork_guard.release()  # taken by the thread that forked, which is this child's only thread


os.register_at_fork(before=_fork_guard.acquire, after_in_parent=_fork_guard.release,
                    after_in_child=_close_lock_fds_in_child)  # fmt: skip


class Segment:
    """A mapped segment: numpy views over the header, slot table and payload, plus its
    semaphores and locks.

    The server creates it (``Segment.create``), clients attach (``Segment.attach``).
    ``close()`` runs in every process; ``unlink()`` only in the server that created it. Views:

    - ``header``: 0-d structured array (``HEADER_DT``); ``counters``: its counters as (11,) u8;
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
    _waiter: Waiter = Waiter()  # replaced per instance; this one has nothing to close

    def __init__(self, name: str, lock_fd: int, layout: Layout) -> None:
        self.name = name
        self.layout = layout
        self.codec = layout.codec
        self._lock_fd = lock_fd
        self._sems = {}
        self._ready: posix_ipc.Semaphore | None = None
        self._per_slot = {kind: [None] * layout.n_slots for kind in ("req", "done", "bell")}
        self._waiter = Waiter()
        self._map()
        _live_segments.add(self)

    def _map(self) -> None:
        # A separate open for the mapping: mmap dups the descriptor it maps, and that dup would
        # share the lock descriptor's open file description, and so its locks, with every
        # process that inherits it.
        shm = posix_ipc.SharedMemory(f"/{self.name}")
        try:
            a, b = os.fstat(shm.fd), os.fstat(self._lock_fd)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                raise ServerUnavailableError(f"{self.name!r} was replaced while attaching")
            self._mmap = mmap.mmap(shm.fd, self.layout.total_size)
        finally:
            shm.close_fd()
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
        codec: CodecLayout | None = None,
    ) -> Segment:
        """Own ``name`` exclusively and create a fresh segment and its semaphores under it.

        Leftovers of a dead server are taken over (their lock is free). A live server makes
        this raise ``ServerAlreadyRunningError``; one that is starting or stopping is waited
        for up to ``wait`` seconds (a rolling restart) before raising the same.
        The segment is complete when this returns, but not yet served: call
        ``start_serving()``.

        ``codec``: the served codec's token layout; None means BiCodec with ``semantic_vocab``
        and ``global_vocab``.
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
        layout = Layout(n_slots, max_tokens, codec)
        check_free_space(layout.total_size)
        # The name: reserved earlier (``reserve_name``: held while the model loaded), or now.
        lock_fd = reserved if reserved is not None else _own_name(name, mode, time.monotonic() + wait)
        try:
            _reserve(lock_fd, layout.total_size, name)
            os.fchmod(lock_fd, mode)  # the umask narrowed the mode given at creation
            seg = cls(name, lock_fd, layout)
        except BaseException:
            _unlink_segment(name)
            close_lock_fd(lock_fd)
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
            h["global_vocab"] = codec.global_vocab
            write_codec(h, codec)
            h["max_batch"] = max_batch
            h["lanes"] = lanes
            h["server_pid"] = os.getpid()
            h["server_uid"] = os.geteuid()
            h["server_epoch"] = secrets.randbits(63)
            h["phase"] = Phase.CREATING
            # Order matters: magic last, so that a reader never accepts a half-written header.
            h["magic"] = MAGIC
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
        """Take the SERVING lock: from now on clients see this server as alive."""
        self.header["phase"] = Phase.SERVING
        self.header["started_ns"] = time.monotonic_ns()
        # Order matters: the header above, then the lock (see "Memory ordering").
        if not try_lock(self._lock_fd, SERVING_BYTE):
            raise ServerAlreadyRunningError(f"could not take the serving lock of {self.name!r}")

    def stop_serving(self) -> None:
        """Release the SERVING lock: clients now resubmit what this server has not answered."""
        if self._lock_fd >= 0:
            self.header["phase"] = Phase.STOPPING
            unlock(self._lock_fd, SERVING_BYTE)

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
        try:
            fd = _open_lock_fd(name)  # no size: never re-truncate
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
        # ``fd`` becomes the lock descriptor; nothing else dups it.
        try:
            expected = os.geteuid() if owner_uid is None else owner_uid
            owner = os.fstat(fd).st_uid
            if owner != expected:
                raise SegmentError(
                    f"/dev/shm/{name} belongs to uid {owner}, not to uid {expected}: refusing "
                    "to attach (pass owner_uid= / --server-uid to trust that user's server)"
                )
            if not held_elsewhere(fd, SERVING_BYTE):
                raise ServerUnavailableError(
                    f"{name!r} exists but no server serves it right now (it is starting, "
                    "stopping, or died)"
                )
            layout = _read_layout(name, fd)  # ordered after the probe above
            return cls(name, fd, layout)
        except BaseException:
            close_lock_fd(fd)
            raise

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
        if self._lock_fd >= 0:
            close_lock_fd(self._lock_fd)  # drops every lock taken through it
            self._lock_fd = -1

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
        _unlink_segment(self.name)
        if self.header is not None:
            self.header["phase"] = Phase.STOPPED

    def _forget_locks_after_fork(self) -> None:
        # The descriptor itself was closed with every other lock descriptor (see
        # ``_close_lock_fds_in_child``); its number may be reused from now on.
        self._lock_fd = -1
        self._creator = False

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
            fd = _open_lock_fd(name, posix_ipc.O_CREX, mode)
        except posix_ipc.ExistentialError:
            created = False
            try:
                fd = _open_lock_fd(name)
            except posix_ipc.ExistentialError:
                continue  # unlinked in between: try to create it again
            except posix_ipc.PermissionsError as e:
                raise SegmentError(f"/dev/shm/{name} exists and this user may not open it ({e})") from None
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


def _reserve(fd: int, size: int, name: str) -> None:
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


def _read_layout(name: str, fd: int) -> Layout:
    size = os.fstat(fd).st_size
    if size < HEADER_SIZE:
        raise SegmentError(f"/dev/shm/{name} is {size} bytes, too small to be a bicodec-shm segment")
    h = np.frombuffer(os.pread(fd, HEADER_DT.itemsize, 0), HEADER_DT, 1)[0]
    if int(h["magic"]) != MAGIC:
        raise SegmentError(f"/dev/shm/{name} is not a bicodec-shm segment (bad magic)")
    if int(h["version"]) != LAYOUT_VERSION:
        raise SegmentError(
            f"/dev/shm/{name} has layout version {int(h['version'])}, this client speaks "
            f"version {LAYOUT_VERSION}: upgrade the client or the server so they match"
        )
    try:
        codec = read_codec(h)
    except ValueError as exc:
        raise SegmentError(f"/dev/shm/{name}: the header's codec layout is invalid ({exc})") from None
    layout = Layout(int(h["n_slots"]), int(h["max_tokens"]), codec)
    if (
        int(h["header_size"]) != HEADER_SIZE
        or int(h["slot_size"]) != SLOT_DT.itemsize
        or int(h["total_size"]) != layout.total_size
        or size < layout.total_size
    ):
        raise SegmentError(
            f"/dev/shm/{name}: header sizes do not match the layout "
            f"(segment {size} bytes, header says {int(h['total_size'])})"
        )
    return layout


def write_codec(h: np.ndarray, codec: CodecLayout) -> None:
    """Write ``codec`` into a header (0-d HEADER_DT array); its ``n_global``/``global_vocab``
    are the header's own fields, shared with version 3."""
    h["codec"] = codec.name.encode()
    h["n_levels"] = codec.n_levels
    h["level_rates"] = list(codec.level_rates) + [0] * (MAX_LEVELS - codec.n_levels)
    h["level_vocab"] = list(codec.level_vocab) + [0] * (MAX_LEVELS - codec.n_levels)
    h["samples_per_frame"] = codec.samples_per_frame
    h["sample_rate"] = codec.sample_rate
    h["n_global"] = codec.n_global
    h["global_vocab"] = codec.global_vocab


def read_codec(h: np.void | np.ndarray) -> CodecLayout:
    """The codec layout a header names; raises ValueError if it is not a valid one."""
    n = int(h["n_levels"])
    if not 1 <= n <= MAX_LEVELS:
        raise ValueError(f"{n} code levels")
    return CodecLayout(
        name=np.asarray(h["codec"]).item().decode("utf-8", "replace"),
        level_rates=tuple(int(v) for v in h["level_rates"][:n]),
        level_vocab=tuple(int(v) for v in h["level_vocab"][:n]),
        samples_per_frame=int(h["samples_per_frame"]),
        sample_rate=int(h["sample_rate"]),
        n_global=int(h["n_global"]),
        global_vocab=int(h["global_vocab"]),
    )


def codec_name(h: np.void | np.ndarray) -> str:
    """The name of the codec a header names, or "unknown" if its layout is not valid."""
    try:
        return read_codec(h).name
    except ValueError:
        return "unknown"


def read_record(name: str, dtype: np.dtype) -> tuple[np.void, bool] | None:
    """A private copy of the ``dtype`` record at the start of ``/dev/shm/NAME``, unvalidated,
    and whether a live process holds the object's SERVING lock; None if the name does not
    exist or is too small. (A segment's header, or a server group's record: group.py.)

    The lock is probed before the record is read: its holder wrote the record before taking
    the lock (see "Memory ordering")."""
    validate_name(name)
    try:
        shm = posix_ipc.SharedMemory(f"/{name}")
    except posix_ipc.Error:
        return None
    try:
        serving = held_elsewhere(shm.fd, SERVING_BYTE)
        if os.fstat(shm.fd).st_size < dtype.itemsize:
            return None
        return np.frombuffer(os.pread(shm.fd, dtype.itemsize, 0), dtype, 1)[0].copy(), serving
    finally:
        shm.close_fd()


def read_header(name: str) -> np.void | None:
    """A copy of the raw header of ``/dev/shm/NAME`` without validating it, or None if the
    name does not exist or is too small to hold a header."""
    record = read_record(name, HEADER_DT)
    return None if record is None else record[0]


def stats_from_header(h: np.void | np.ndarray) -> dict:
    """The live counters of a header as plain Python numbers (see ``bicodec-shm stats``)."""
    batches = int(h["batches"])
    requests = int(h["requests"])
    completed = requests - int(h["failed"])  # the times below are summed over these only
    tokens, padded = int(h["tokens"]), int(h["padded_tokens"])
    hist = [int(v) for v in h["batch_hist"]]
    rows = sum(b * n for b, n in enumerate(hist))
    failed = {Status(i).name: int(n) for i, n in enumerate(h["failed_by_status"]) if n and i in
              Status._value2member_map_}  # fmt: skip
    return {
        "codec": codec_name(h),
        "server_pid": int(h["server_pid"]),
        "server_epoch": int(h["server_epoch"]),
        "phase": Phase(int(h["phase"])).name.lower() if int(h["phase"]) < 4 else "unknown",
        "slots": int(h["n_slots"]),
        "max_tokens": int(h["max_tokens"]),
        "max_batch": int(h["max_batch"]),
        "lanes": int(h["lanes"]),
        "busy_lanes": int(h["busy_lanes"]),
        "requests": requests,
        "batches": batches,
        "failed": int(h["failed"]),
        "completed": completed,
        "failed_by_status": failed,
        "reclaimed": int(h["reclaimed"]),
        "tokens": tokens,
        "padded_tokens": padded,
        "padding_share": (padded - tokens) / padded if padded else 0.0,
        "avg_batch_size": rows / batches if batches else 0.0,
        "avg_queue_wait_ms": int(h["queue_wait_ns"]) / 1e6 / completed if completed else 0.0,
        "avg_latency_ms": int(h["latency_ns"]) / 1e6 / completed if completed else 0.0,
        "avg_batch_time_ms": int(h["decode_ns"]) / 1e6 / batches if batches else 0.0,
        "host_gap_ms": int(h["host_gap_ns"]) / 1e6,
        "lane_busy_ms": int(h["lane_busy_ns"]) / 1e6,
        "batch_size_histogram": {b: n for b, n in enumerate(hist) if n},
    }
