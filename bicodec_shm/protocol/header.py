"""Reading a header: the codec it names, the layout it describes, and its live counters.

Readers outside a mapping (``stats``, ``served``, a would-be client) read a private copy of the
record at the start of ``/dev/shm/NAME`` after probing its SERVING lock (see segment.py,
"Memory ordering"), or of the memfd a server that shares its segment with its group hands over
NAME.sock (handoff.py: the socket's messages order the server's writes before the reads).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator

import numpy as np
import posix_ipc

from ..codecs.layout import MAX_FRAMES, CodecLayout
from ..errors import SegmentError, ServerUnavailableError
from .handoff import handed_over, is_socket
from .layout import (
    BUSY,
    CREATING_MAGIC,
    FREE,
    GROUP_MAGIC,
    HEADER_DT,
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    MAX_LEVELS,
    MAX_SLOTS,
    READY,
    SERVING_BYTE,
    SLOT_DT,
    Layout,
    Phase,
    Status,
    Transport,
)
from .locks import held_elsewhere
from .names import validate_name
from .objects import closed_to_us, open_object

_TRANSPORT_OFF = HEADER_DT.fields["transport"][1]


def transport_of(fd: int) -> int:
    """The ``transport`` a named object's header says (a hint, read without pairing)."""
    raw = os.pread(fd, 4, _TRANSPORT_OFF)
    return int.from_bytes(raw, "little") if len(raw) == 4 else Transport.NAMED


def _read_layout(name: str, fd: int) -> Layout:
    size = os.fstat(fd).st_size
    if size < HEADER_SIZE:
        raise SegmentError(f"/dev/shm/{name} is {size} bytes, too small to be a bicodec-shm segment")
    h = np.frombuffer(os.pread(fd, HEADER_DT.itemsize, 0), HEADER_DT, 1)[0]
    magic = int(h["magic"])
    if magic in (GROUP_MAGIC, CREATING_MAGIC):
        # A group (or a server) took the name between the caller's look and this read: a
        # moment of a restart, not a foreign object. The caller looks again.
        what = "a server group's" if magic == GROUP_MAGIC else "a segment still being created"
        raise ServerUnavailableError(f"/dev/shm/{name} is {what} right now; looking again")
    if magic != MAGIC:
        raise SegmentError(f"/dev/shm/{name} is not a bicodec-shm segment (bad magic)")
    if int(h["version"]) != LAYOUT_VERSION:
        raise SegmentError(
            f"/dev/shm/{name} has layout version {int(h['version'])}, this client speaks "
            f"version {LAYOUT_VERSION}: upgrade the client or the server so they match"
        )
    if int(h["digest"]) != description_digest(h):
        raise SegmentError(
            f"/dev/shm/{name}: its header was overwritten (its description does not match its "
            "digest), by a client that writes where it should not; the server restores it "
            "within a reap interval: attach again"
        )
    try:
        codec = read_codec(h)
    except ValueError as exc:
        raise SegmentError(f"/dev/shm/{name}: the header's codec layout is invalid ({exc})") from None
    # What a reader allocates or maps is bounded by the layout's own limits (those a server
    # is created with) and by the object's real size, never by a header field alone: anyone
    # who may write the header (a buggy client) could claim millions of slots.
    n_slots, max_tokens = int(h["n_slots"]), int(h["max_tokens"])
    if not (1 <= n_slots <= MAX_SLOTS and 1 <= max_tokens <= MAX_FRAMES):
        raise SegmentError(
            f"/dev/shm/{name}: its header says {n_slots} slots of {max_tokens} frames; a segment "
            f"has 1..{MAX_SLOTS} slots of 1..{MAX_FRAMES} frames"
        )
    encodes, min_samples = int(h["encodes"]), int(h["encode_min_samples"])
    if (encodes not in (0, 1) or (encodes == 1) != (min_samples > 0)
            or min_samples > max_tokens * codec.samples_per_frame):  # fmt: skip
        raise SegmentError(f"/dev/shm/{name}: its header says encodes={encodes} with "
                           f"encode_min_samples={min_samples}")  # fmt: skip
    layout = Layout(n_slots, max_tokens, codec, min_samples)
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


# The header fields that describe the segment: fixed once the server wrote them, and what a
# client attaching relies on. Every client can write the header, so the server keeps its own
# copy of them (``Segment.restore_description``, at each reap) and a digest of them in
# ``digest``: a client attaching to a header that someone overwrote gets a clear error (and
# attaches correctly once the server restored it), never a segment it reads wrong.
DESCRIPTION = ("version", "header_size", "n_slots", "max_tokens", "n_global", "slot_size", "total_size",
               "semantic_vocab", "global_vocab", "server_epoch", "server_uid", "max_batch", "codec",
               "n_levels", "level_rates", "level_vocab", "samples_per_frame", "sample_rate",
               "end_trim", "encodes", "encode_min_samples")  # fmt: skip


def description_digest(h: np.void | np.ndarray) -> int:
    """The 64-bit digest of a header's ``DESCRIPTION`` fields (a 0-d HEADER_DT array or a void)."""
    h = np.asarray(h)  # a void's bytes fields would lose their trailing NULs
    data = b"".join(h[f].tobytes() for f in DESCRIPTION)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


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
    h["end_trim"] = codec.end_trim


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
        end_trim=int(h["end_trim"]),
    )


def codec_name(h: np.void | np.ndarray) -> str:
    """The name of the codec a header names, or "unknown" if its layout is not valid."""
    try:
        return read_codec(h).name
    except ValueError:
        return "unknown"


def read_record(name: str, dtype: np.dtype, *, owner_uid: int | None = None) -> tuple[np.void, bool] | None:
    """A private copy of the ``dtype`` record at the start of ``/dev/shm/NAME``, unvalidated,
    and whether a live process holds the object's SERVING lock; None if the name does not
    exist or is too small. (A segment's header, or a server group's record: group.py.)

    Raises ``SegmentError`` for an object that is not ``owner_uid``'s (default: this
    process's euid; see ``objects.open_object``): its record and its locks say nothing.

    The lock is probed before the record is read: its holder wrote the record before taking
    the lock (see "Memory ordering")."""
    validate_name(name)
    if is_socket(name):  # a segment shared with the group: the live one is the memfd handed over
        try:
            with handed_over(name, owner_uid) as fd:
                record = _pread_record(fd, dtype)
                return None if record is None else (record, True)
        except ServerUnavailableError:
            pass  # nobody listens (starting, stopping or died): the name's own object says which
    if closed_to_us(name, owner_uid):
        return None  # a server's own object, which only it and its user read
    try:
        fd = open_object(name, owner_uid=owner_uid)
    except posix_ipc.ExistentialError:
        return None
    try:
        serving = held_elsewhere(fd, SERVING_BYTE)
        record = _pread_record(fd, dtype)
        return None if record is None else (record, serving)
    finally:
        os.close(fd)


def _pread_record(fd: int, dtype: np.dtype) -> np.void | None:
    if os.fstat(fd).st_size < dtype.itemsize:
        return None
    return np.frombuffer(os.pread(fd, dtype.itemsize, 0), dtype, 1)[0].copy()


@contextlib.contextmanager
def _segment_fd(name: str) -> Iterator[int | None]:
    """A descriptor of the segment under ``name`` (its memfd if handed over a socket), or
    None if nothing has the name."""
    if is_socket(name):
        with handed_over(name) as fd:
            yield fd
            return
    try:
        fd = open_object(name)
    except posix_ipc.ExistentialError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


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
        # 0: started without --encode; else the shortest audio (samples) an encode may carry
        "encode_min_samples": int(h["encode_min_samples"]) if int(h["encodes"]) else 0,
        "requests": requests,
        "batches": batches,
        "failed": int(h["failed"]),
        "completed": completed,
        "failed_by_status": failed,
        "reclaimed": int(h["reclaimed"]),
        "idle_slots_expired": int(h["expired"]),
        "dropped_answers": int(h["dropped"]),
        "tokens": tokens,
        "padded_tokens": padded,
        "padding_share": (padded - tokens) / padded if padded else 0.0,
        "avg_batch_size": rows / batches if batches else 0.0,
        "avg_queue_wait_ms": int(h["queue_wait_ns"]) / 1e6 / completed if completed else 0.0,
        "avg_latency_ms": int(h["latency_ns"]) / 1e6 / completed if completed else 0.0,
        "avg_batch_time_ms": int(h["decode_ns"]) / 1e6 / batches if batches else 0.0,
        "host_gap_ms": int(h["host_gap_ns"]) / 1e6,
        "waited_ms": int(h["waited_ns"]) / 1e6,
        "lane_busy_ms": int(h["lane_busy_ns"]) / 1e6,
        "batch_size_histogram": {b: n for b, n in enumerate(hist) if n},
    }


def read_slot_owners(name: str) -> dict | None:
    """Who holds the slots of the segment ``name`` right now, from a private copy of its slot
    table: ``{"owned", "ready", "busy", "attached_clients"}`` (slots in every state but FREE,
    READY, BUSY; distinct client handles holding one). None if nothing has the name; raises
    ``SegmentError`` if what has it is not a valid segment of ours (``_read_layout``).

    Handles are told by ``handle_id``, not ``owner_pid``: an idle handle's warm slot (let go
    of, ``owner_pid`` 0, until the reaper frees it) still counts for its handle.

    Read without pairing, like the counters: a snapshot for ``stats``, a moment old."""
    validate_name(name)
    try:
        with _segment_fd(name) as fd:
            if fd is None:
                return None
            layout = _read_layout(name, fd)
            raw = os.pread(fd, layout.n_slots * SLOT_DT.itemsize, layout.slots_off)
    except ServerUnavailableError:
        return None
    slots = np.frombuffer(raw, SLOT_DT, layout.n_slots)
    owned = slots["state"] != FREE
    holders = slots["handle_id"][owned]
    return {"owned": int(owned.sum()), "ready": int((slots["state"] == READY).sum()),
            "busy": int((slots["state"] == BUSY).sum()),
            "attached_clients": len(np.unique(holders[holders != 0]))}  # fmt: skip
