"""A server group: one ordinary server per device, found and used under one name.

``bicodec-shm serve --device cuda:0,cuda:1 --name N`` runs a supervisor (supervisor.py) that
starts one ``bicodec-shm serve`` per device, named ``N.0``, ``N.1``, ..., and publishes the
group under ``N`` itself, as a one-page object instead of a segment::

    /dev/shm/N      the group object (GROUP_DT): magic "BCDC_GRP", version, member count,
                    each member's device and restart count
    /dev/shm/N.K    member K: an ordinary segment and its semaphores (segment.py)
    /dev/shm/N.sock with ``--mode 0o660``: hands a snapshot of the group object, in a memfd
                    sealed against writes, to each client (handoff.py); N stays the user's alone

The group object is owned exactly like a segment (see locks.py): the supervisor
creates it O_CREX through ``names._own_name`` and holds its OWNER byte from creating the
name to unlinking it, and its SERVING byte from the moment every member has served once until
it starts to stop. So ``probe(N)`` tells a live group (SERVING) from one starting or stopping
(BUSY) and from a killed supervisor's leftovers (DEAD: the next supervisor, or a single server,
takes them over), across PID namespaces and with no pid trusted. A live group's name can be
neither taken nor unlinked: every path that creates or unlinks a name first takes its OWNER
lock.

Memory ordering: the supervisor writes the header (magic last) before it takes SERVING; a
reader probes SERVING first and reads the header after. The restart counters change later and
are read without pairing: statistics, like a segment's counters.

Clients: ``DecoderClient("N")`` finds the group (``read_group``) and lets a
``GroupRouter`` (client/router.py) choose the member of each request.
"""

from __future__ import annotations

import os
import re
import struct
import time
from dataclasses import dataclass

import numpy as np

from ..errors import SegmentError, ServerAlreadyRunningError
from .handoff import Handoff, remove_stale_socket, snapshot
from .header import read_record, stats_from_header
from .layout import (
    COUNTERS,
    DEFAULT_MODE,
    GROUP_MAGIC,
    HEADER_DT,
    MAGIC,
    SERVING_BYTE,
    name_mode,
    shared_mode,
)
from .locks import close_lock_fd, try_lock, unlock
from .names import ServerState, _own_name, _same_inode, _unlink_segment, probe, size_new_object, validate_name

GROUP_VERSION = 1
MAX_MEMBERS = 64
DEVICE_BYTES = 32
GROUP_SIZE = 4096  # one page: the header below, zero-padded

GROUP_DT = np.dtype(
    [
        ("magic", "<u8"),
        ("version", "<u4"),
        ("n_members", "<u4"),
        ("supervisor_pid", "<u8"),  # informational only: in the supervisor's PID namespace
        ("epoch", "<u8"),  # random per supervisor start
        ("started_ns", "<u8"),  # CLOCK_MONOTONIC when the supervisor created the group
        ("restarts", "<u4", (MAX_MEMBERS,)),  # written by the supervisor as members die
        ("devices", f"S{DEVICE_BYTES}", (MAX_MEMBERS,)),
    ],
    align=True,
)
assert GROUP_DT.itemsize <= GROUP_SIZE
_RESTARTS_OFF = GROUP_DT.fields["restarts"][1]
_MEMBER_SUFFIX_RE = re.compile(r"\.[0-9]{1,3}$")
# Counters summed over the members in a group's totals (the timing sums stay per member).
_SUMMED = ("requests", "batches", "failed", "reclaimed", "idle_slots_expired", "tokens", "padded_tokens")
assert set(_SUMMED) <= set(COUNTERS) | {"idle_slots_expired"}  # the stats name of ``expired``


def member_names(name: str, n: int) -> tuple[str, ...]:
    """The members of group ``name`` of ``n`` members: ``name.0`` ... ``name.(n-1)``."""
    return tuple(f"{name}.{i}" for i in range(n))


def validate_group_name(name: str) -> str:
    """Return ``name`` if a group may use it (a plain name: members add the ``.K``)."""
    validate_name(name)
    if _MEMBER_SUFFIX_RE.search(name):
        raise ValueError(
            f"a server group's --name cannot end in a member suffix like '.0' (got {name!r}): "
            "its members are named NAME.0, NAME.1, ..."
        )
    return name


# -- the group object, supervisor side ---------------------------------------------------------


class GroupObject:
    """The supervisor's ownership of ``/dev/shm/NAME`` for a group of ``len(devices)`` members.

    ``create`` owns the name (O_CREX and the OWNER lock; a dead owner's leftovers are taken
    over) and writes the header; ``start_serving`` makes the group visible to clients;
    ``stop_serving``, ``unlink`` and ``close`` end it, in that order.
    """

    # The lock descriptor; nothing else dups it (see segment.Segment). The header is written
    # with pwrite rather than through a mapping, because mmap would dup it, and a dup shares
    # the open file description and so the locks.
    _fd: int = -1

    # A group shared with the server's group (``--mode 0o660``) hands its record over
    # NAME.sock like a shared segment (handoff.py): a snapshot in a memfd sealed against any
    # write, per connection, so the name's own object stays the user's alone (no member can
    # take its locks) and no member can change the record another reads.
    _handoff: Handoff | None = None

    def __init__(self, name: str, fd: int, devices: tuple[str, ...], *, mode: int = DEFAULT_MODE) -> None:
        self.name = name
        self.devices = devices
        self._fd = fd
        self._mode = mode

    @classmethod
    def create(cls, name: str, devices: list[str] | tuple[str, ...], *, mode: int = DEFAULT_MODE,
               wait: float = 0.0) -> GroupObject:  # fmt: skip
        """Own ``name`` for a group on ``devices``; waits up to ``wait`` seconds for an owner
        that is starting or stopping. Raises ``ServerAlreadyRunningError`` if a live group or
        server has the name."""
        validate_group_name(name)
        devices = tuple(devices)
        if not 1 <= len(devices) <= MAX_MEMBERS:
            raise ValueError(f"a server group has 1 to {MAX_MEMBERS} members, got {len(devices)}")
        for device in devices:
            if not device or len(device.encode()) > DEVICE_BYTES:
                raise ValueError(f"device names must be 1 to {DEVICE_BYTES} bytes, got {device!r}")
        try:
            fd = _own_name(name, name_mode(mode), time.monotonic() + wait)
        except ServerAlreadyRunningError as exc:
            raise ServerAlreadyRunningError(_taken_message(name, exc)) from None
        group = cls(name, fd, devices, mode=mode)
        try:
            size_new_object(fd, GROUP_SIZE)
            os.fchmod(fd, name_mode(mode))  # the umask narrowed the mode given at creation
            h = np.zeros((), GROUP_DT)
            h["version"] = GROUP_VERSION
            h["n_members"] = len(devices)
            h["supervisor_pid"] = os.getpid()
            h["epoch"] = int.from_bytes(os.urandom(8), "little") >> 1
            h["started_ns"] = time.monotonic_ns()
            h["devices"][: len(devices)] = [d.encode() for d in devices]
            group._write(h.tobytes(), 0)
            # Order matters: the magic last, so that nobody accepts a half-written header.
            group._write(struct.pack("<Q", GROUP_MAGIC), 0)
        except BaseException:
            _unlink_segment(name)
            group.close()
            raise
        return group

    def _write(self, data: bytes, offset: int) -> None:
        os.pwrite(self._fd, data, offset)

    def _snapshot(self) -> int:
        return snapshot(self.name, os.pread(self._fd, GROUP_SIZE, 0))

    def set_restarts(self, index: int, count: int) -> None:
        """Publish member ``index``'s restart count (a statistic: read without pairing)."""
        self._write(struct.pack("<I", count), _RESTARTS_OFF + 4 * index)

    def start_serving(self) -> None:
        """Take the SERVING lock: from now on clients see the group (header written first).
        A group shared with the server's group starts handing its record out first."""
        if shared_mode(self._mode):
            remove_stale_socket(self.name)  # we own the name: one left there is a dead owner's
            self._handoff = Handoff(self.name, self._snapshot, self._mode)
        if not try_lock(self._fd, SERVING_BYTE):
            raise ServerAlreadyRunningError(f"could not take the serving lock of {self.name!r}")

    def stop_serving(self) -> None:
        if self._fd >= 0:
            unlock(self._fd, SERVING_BYTE)
        handoff, self._handoff = self._handoff, None
        if handoff is not None:
            handoff.close()

    def unlink(self) -> None:
        """Remove ``/dev/shm/NAME``; we hold its OWNER lock, so it is still ours."""
        if self._fd >= 0 and _same_inode(self._fd, self.name):
            _unlink_segment(self.name)

    def close(self) -> None:
        """Release the name (closing the lock descriptor drops both locks)."""
        handoff, self._handoff = self._handoff, None
        if handoff is not None:
            handoff.close()
        if self._fd >= 0:
            close_lock_fd(self._fd)
            self._fd = -1

    def __enter__(self) -> GroupObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<GroupObject {self.name!r} members={len(self.devices)} size={GROUP_SIZE}>"


def _taken_message(name: str, exc: Exception) -> str:
    if probe(name) is not ServerState.SERVING:
        return str(exc)  # starting or stopping: the segment's message says so
    info = read_group(name)
    if info is not None:
        return (f"a bicodec-shm server group already serves {name!r} (members "
                f"{', '.join(info.members)}; supervisor pid {info.supervisor_pid}): stop it "
                "first (SIGTERM its supervisor) or choose another --name")  # fmt: skip
    return (f"a bicodec-shm server already serves {name!r} (a single server, not a group): "
            "stop it first or choose another --name")  # fmt: skip


# -- the group object, reader side -------------------------------------------------------------


@dataclass(frozen=True)
class GroupInfo:
    """What ``/dev/shm/NAME`` says about a group."""

    name: str
    devices: tuple[str, ...]
    restarts: tuple[int, ...]
    supervisor_pid: int  # in the supervisor's own PID namespace
    epoch: int
    alive: bool  # the supervisor holds SERVING: the group is up

    @property
    def members(self) -> tuple[str, ...]:
        return member_names(self.name, len(self.devices))


def read_group(name: str, *, owner_uid: int | None = None) -> GroupInfo | None:
    """The group under ``name``, or None if ``name`` is not a group object (absent, or a
    single server's segment). A dead or starting group comes back with ``alive`` False.

    Raises ``SegmentError`` for a group object of another version, and for an object that is
    not ``owner_uid``'s (default: this process's euid).
    """
    record = read_record(name, GROUP_DT, owner_uid=owner_uid)
    if record is None:
        return None
    h, alive = record
    if int(h["magic"]) != GROUP_MAGIC:
        return None
    if int(h["version"]) != GROUP_VERSION:
        raise SegmentError(
            f"/dev/shm/{name} is a server group of version {int(h['version'])}; this client "
            f"speaks version {GROUP_VERSION}: upgrade the client or the server so they match"
        )
    n = int(h["n_members"])
    if not 1 <= n <= MAX_MEMBERS:
        raise SegmentError(f"/dev/shm/{name}: a server group of {n} members is not valid")
    return GroupInfo(
        name=name,
        devices=tuple(bytes(d).decode("utf-8", "replace") for d in h["devices"][:n]),
        restarts=tuple(int(r) for r in h["restarts"][:n]),
        supervisor_pid=int(h["supervisor_pid"]),
        epoch=int(h["epoch"]),
        alive=alive,
    )


def member_stats(name: str, *, owner_uid: int | None = None) -> dict | None:
    """``stats_from_header`` of the segment ``name`` plus ``server_alive``; None if there is
    no complete segment of ours under ``name`` (the member is down or starting, or another
    user's object has its name)."""
    try:
        record = read_record(name, HEADER_DT, owner_uid=owner_uid)
    except SegmentError:
        return None
    if record is None or int(record[0]["magic"]) != MAGIC:
        return None
    header, serving = record
    return stats_from_header(header) | {"server_alive": serving}


def group_stats(info: GroupInfo, *, owner_uid: int | None = None) -> dict:
    """The group's members side by side (``bicodec-shm stats N``, ``DecoderClient.get_stats``).

    Returns ``{"group", "supervisor_pid", "supervisor_alive", "members": {member: dict}}`` plus
    the group's totals over the members up now (``totals``). A member that is down has
    ``server_alive`` False and no counters. Counters restart at 0 with each member restart.
    """
    members: dict[str, dict] = {}
    for member, device, restarts in zip(info.members, info.devices, info.restarts):
        entry: dict = {"device": device, "restarts": restarts}
        stats = member_stats(member, owner_uid=owner_uid)
        entry |= stats if stats is not None else {"server_alive": False}
        members[member] = entry
    return {"group": info.name, "supervisor_pid": info.supervisor_pid,
            "supervisor_alive": info.alive, **totals(members.values()), "members": members}  # fmt: skip


def totals(members) -> dict:
    """The keys of ``stats_from_header`` that make sense for a whole group, over ``members``
    (an iterable of member stats; those without counters are down and left out): counters and
    the batch-size histogram summed, averages weighted, slots summed, max_tokens the least."""
    # Up means served now: a dead member's leftover segment still has counters, but is down.
    up = [m for m in members if "requests" in m and m.get("server_alive")]
    out: dict = {key: sum(m[key] for m in up) for key in _SUMMED}
    hist: dict[int, int] = {}
    for m in up:
        for size, n in m["batch_size_histogram"].items():
            hist[size] = hist.get(size, 0) + n
    rows = sum(size * n for size, n in hist.items())
    batches, completed = out["batches"], out["requests"] - out["failed"]

    def weighted(key: str, by: str, total: int) -> float:
        return sum(m[key] * m[by] for m in up) / total if total else 0.0

    out |= {
        "slots": sum(m["slots"] for m in up),
        "max_tokens": min((m["max_tokens"] for m in up), default=0),
        "avg_batch_size": rows / batches if batches else 0.0,
        "avg_batch_time_ms": weighted("avg_batch_time_ms", "batches", batches),
        "completed": completed,
        "avg_queue_wait_ms": weighted("avg_queue_wait_ms", "completed", completed),
        "avg_latency_ms": weighted("avg_latency_ms", "completed", completed),
        "batch_size_histogram": dict(sorted(hist.items())),
        "members_up": len(up),
    }
    return out


# -- the client side ---------------------------------------------------------------------------
