"""Routing a group handle's requests: which member of a server group each request goes to.

The group object itself (its record, who owns it, ``read_group``) is protocol/group.py's.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np

from ..errors import BiCodecShmError, SegmentError, ServerUnavailableError
from ..protocol.attachment import Attachment
from ..protocol.group import GroupInfo, group_stats, read_group
from ..protocol.layout import BUSY, READY
from ..protocol.waiting import SLICE, Gone


class GroupRouter:
    """Chooses the member of a server group for each request of one ``DecoderClient``.

    It keeps one ``Attachment`` per member (attached on first need, each with the handle's
    ``slots`` as its own limit) and gives each request the live member with the fewest
    outstanding requests: other clients' READY and BUSY slots in the member's slot table, plus
    this handle's own requests there. The slot states are read without pairing (see
    protocol/segment.py, "Memory ordering"): a hint that may be a moment old, used only to choose;
    ties go to a random member, so that idle clients do not all pick member 0.

    A member that stops serving is skipped until it serves again (re-attached at most once a
    slice). Requests in flight on it notice within a slice (attachment.py), or at once when a
    pick finds it gone and retires its attachment; ``DecoderClient`` resubmits them through
    this router, so they go to another live member right away rather than wait for the dead
    one's restart.
    """

    def __init__(self, info: GroupInfo, *, max_slots: int, owner_uid: int | None) -> None:
        self.name = info.name
        self.epoch = info.epoch
        self.members = info.members
        self._checked_at = time.monotonic()
        self.max_slots = max_slots
        self.owner_uid = owner_uid
        self._lock = threading.Lock()
        self._atts: list[Attachment | None] = [None] * len(self.members)
        self._retry_at = [0.0] * len(self.members)  # monotonic time of the next attach attempt
        self._closed: BaseException | None = None
        self.last_error: Exception | None = None

    @classmethod
    def find(cls, name: str, *, max_slots: int, owner_uid: int | None) -> GroupRouter | None:
        """A router if a live group serves ``name``, else None (a single server, or nothing)."""
        info = read_group(name, owner_uid=owner_uid)
        if info is None or not info.alive:
            return None
        return cls(info, max_slots=max_slots, owner_uid=owner_uid)

    def outdated(self) -> bool:
        """True if the name no longer holds this live group (another epoch: a restarted
        supervisor, perhaps with other members; a single server; nothing). Looked up at most
        once a slice: the router's own member checks cover the time in between."""
        now = time.monotonic()
        if now - self._checked_at < SLICE:
            return False
        self._checked_at = now
        try:
            info = read_group(self.name, owner_uid=self.owner_uid)
        except SegmentError:
            return True
        return info is None or not info.alive or info.epoch != self.epoch

    def pick(self) -> Attachment | None:
        """The attachment of the least loaded live member, or None if no member serves."""
        with self._lock:
            if isinstance(self._closed, Gone):
                return None  # replaced (the group under the name changed): the caller looks again
            if self._closed is not None:
                raise type(self._closed)(str(self._closed))
            now = time.monotonic()
            best: list[Attachment] = []
            least = None
            for i in range(len(self.members)):
                att = self._live(i, now)
                load = None if att is None else _outstanding(att)
                if load is None:
                    continue
                if least is None or load < least:
                    best, least = [att], load
                elif load == least:
                    best.append(att)
            return random.choice(best) if best else None

    def max_tokens(self) -> int | None:
        """The least ``max_tokens`` of the members that serve now (attaching to those not
        attached), or None if none does: a request that fits it fits whichever is picked."""
        with self._lock:
            if self._closed is not None:
                return None
            now = time.monotonic()
            limits = [att.max_tokens for i in range(len(self.members)) if (att := self._live(i, now))]
            return min(limits, default=None)

    def connect(self) -> Attachment:
        """``pick``, or ``ServerUnavailableError`` if no member serves (a handle attaching)."""
        att = self.pick()
        if att is None:
            raise ServerUnavailableError(
                f"{self.name!r} is a server group, but none of its members "
                f"({', '.join(self.members)}) serves right now ({self.last_error})"
            )
        return att

    def _live(self, i: int, now: float) -> Attachment | None:
        att = self._atts[i]
        if att is not None and (att.retired is not None or not att.serving()):
            att.retire(Gone())  # its callers resubmit, and come back here for another member
            self._atts[i] = att = None
        if att is None and now >= self._retry_at[i]:
            try:
                att = Attachment(self.members[i], max_slots=self.max_slots, owner_uid=self.owner_uid)
            except (ServerUnavailableError, SegmentError) as exc:
                self.last_error = exc
                self._retry_at[i] = now + SLICE  # a member down stays skipped for a slice
                return None
            self._atts[i] = att
        return att

    def stats(self) -> dict:
        """``group_stats`` plus ``handle_slots`` (slots this handle owns) per member."""
        info = read_group(self.name, owner_uid=self.owner_uid)
        if info is None:
            return {"group": self.name, "supervisor_alive": False, "members": {}}
        stats = group_stats(info, owner_uid=self.owner_uid)
        for member, att in zip(self.members, list(self._atts)):
            if member in stats["members"]:
                stats["members"][member]["handle_slots"] = 0 if att is None else len(att.owned)
        return stats

    def close(self, reason: BaseException) -> None:
        """Fail every call in flight with ``reason`` and close every member's attachment."""
        with self._lock:
            self._closed = reason
            atts, self._atts = self._atts, [None] * len(self.members)
        atts = [att for att in atts if att is not None]
        for att in atts:
            att.retire(reason)  # all first: each close() below may wait for its callers
        for att in atts:
            att.close(reason)

    def forget_after_fork(self) -> None:
        """In a forked child: no attachment of the parent is ours (see decoder_client.py)."""
        self._lock = threading.Lock()
        atts, self._atts = self._atts, [None] * len(self.members)
        self._retry_at = [0.0] * len(self.members)
        for att in atts:
            if att is not None:
                att.forget_after_fork()

    def __repr__(self) -> str:
        up = sum(att is not None for att in self._atts)
        return f"<GroupRouter {self.name!r} members={len(self.members)} attached={up}>"


def _outstanding(att: Attachment) -> int | None:
    """Requests outstanding at ``att``'s member, or None if it went away.

    Other clients' slots that are READY or BUSY, read without pairing (only a hint), plus this
    attachment's own requests from taking a slot to copying the answer out.
    """
    try:
        with att.use() as seg:
            state, handle = seg.field["state"], seg.field["handle_id"]
            others = ((state == READY) | (state == BUSY)) & (handle != att.handle_id)
            queued = int(np.count_nonzero(others))
    except (Gone, BiCodecShmError):
        return None
    return queued + len(att.using) + att.claiming
