"""Reading a header: the codec it names, the layout it describes, and its live counters.

Readers outside a mapping (``stats``, ``served``, a would-be client) read a private copy of the
record at the start of ``/dev/shm/NAME`` after probing its SERVING lock (see segment.py,
"Memory ordering").
"""

from __future__ import annotations

import os

import numpy as np
import posix_ipc

from ..codecs.layout import CodecLayout
from ..errors import SegmentError
from .layout import (
    BUSY,
    FREE,
    HEADER_DT,
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    MAX_LEVELS,
    READY,
    SERVING_BYTE,
    SLOT_DT,
    Layout,
    Phase,
    Status,
)
from .locks import held_elsewhere
from .names import validate_name


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
        "idle_slots_expired": int(h["expired"]),
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


def read_slot_owners(name: str) -> dict | None:
    """Who holds the slots of the segment ``name`` right now, from a private copy of its slot
    table: ``{"owned", "ready", "busy", "attached_clients"}`` (slots in every state but FREE,
    READY, BUSY; distinct client handles holding one). None if there is no valid segment.

    Handles are told by ``handle_id``, not ``owner_pid``: an idle handle's warm slot (let go
    of, ``owner_pid`` 0, until the reaper frees it) still counts for its handle.

    Read without pairing, like the counters: a snapshot for ``stats``, a moment old."""
    validate_name(name)
    try:
        shm = posix_ipc.SharedMemory(f"/{name}")
    except posix_ipc.Error:
        return None
    try:
        try:
            layout = _read_layout(name, shm.fd)
        except SegmentError:
            return None
        raw = os.pread(shm.fd, layout.n_slots * SLOT_DT.itemsize, layout.slots_off)
    finally:
        shm.close_fd()
    slots = np.frombuffer(raw, SLOT_DT, layout.n_slots)
    owned = slots["state"] != FREE
    holders = slots["handle_id"][owned]
    return {"owned": int(owned.sum()), "ready": int((slots["state"] == READY).sum()),
            "busy": int((slots["state"] == BUSY).sum()),
            "attached_clients": len(np.unique(holders[holders != 0]))}  # fmt: skip
