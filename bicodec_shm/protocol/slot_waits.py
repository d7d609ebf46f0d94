"""A request waiting for a slot of an attachment: in line behind the requests that came first
(the handle's own slots), or for the segment to have a FREE slot (every slot of the server
taken).

``SlotWaits`` is a part of ``Attachment`` (attachment.py), kept apart because it is the waiting,
not the bookkeeping: it uses the attachment's lock, its ``line`` (waiting.py), ``_take_or_claim``,
``give``, ``use()`` and ``check_alive``. Requests are served first come, first served, sync and
asyncio alike: a slot given back goes straight to the oldest live waiter (``Attachment.give``),
nobody claims ahead of it, and a waiter keeps its place across its slices.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from ..errors import DecodeTimeoutError
from .posts import post
from .segment import Segment
from .waiting import SLICE


class SlotWaits:
    """Taking a slot for a request, waiting in line or for the segment (see the module
    docstring)."""

    def take_slot(self, deadline: float, seq: int | None = None) -> tuple[int, int]:
        """(slot, seq): an owned slot for request ``seq`` (a new number if None); blocks (in
        slices) until one is free. Requests that wait are served in the order they came (see
        ``give``), sync and asyncio alike."""
        if seq is None:
            seq = self.new_seq()
        try:
            while True:
                slot, claimed = self._take_or_claim(seq, deadline, None)
                if slot is not None:
                    return slot, seq
                if claimed:  # the segment had no FREE slot
                    self._wait_for_segment_slot(deadline)
                else:
                    self._sleep_in_line(seq, min(SLICE, max(0.0, deadline - time.monotonic())))
                self._check_slot_wait(deadline)
        except BaseException:
            self._leave_line(seq, passing_on=True)
            raise

    def _sleep_in_line(self, seq: int, timeout: float) -> None:
        """Sleep on the waiter's own lock until it is woken or ``timeout``: outside the
        attachment's lock, so that an exception from a signal handler here leaves that lock as
        it was (see ``Wakeups``)."""
        with self.lock:
            waiter = self.line.get(seq)
        if waiter is not None and waiter.lock is not None:
            waiter.lock.acquire(timeout=timeout)

    async def take_slot_async(self, deadline: float, seq: int | None = None) -> tuple[int, int]:
        """``take_slot`` for asyncio: never blocks the event loop."""
        loop = asyncio.get_running_loop()
        if seq is None:
            seq = self.new_seq()
        try:
            while True:
                slot, claimed = self._take_or_claim(seq, deadline, loop)
                if slot is not None:
                    return slot, seq
                left = max(0.0, deadline - time.monotonic())
                if claimed:  # no FREE slot in the segment: look again shortly (only under exhaustion)
                    with self.use() as seg:
                        self.asked.append(_ask_for_a_slot(seg))
                    await asyncio.sleep(min(0.02, left))
                else:
                    with self.lock:
                        waiter = self.line.get(seq)
                    if waiter is not None and waiter.future is not None:
                        try:
                            await asyncio.wait_for(asyncio.shield(waiter.future), min(SLICE, left))
                        except asyncio.TimeoutError:
                            pass
                self._check_slot_wait(deadline)
        except BaseException:
            self._leave_line(seq, passing_on=True)
            raise

    def _leave_line(self, seq: int, *, passing_on: bool) -> None:
        """Request ``seq`` leaves the line: with its slot, or (``passing_on``) with an error,
        when a slot handed to it goes to the next waiter. The one now first is woken: it may
        claim where this one could have."""
        with self.lock:
            was_in_line = self.line.leave(seq)
            handed = [slot for slot, holder in self.using.items() if holder == seq]
            handed = handed if passing_on else []
            if was_in_line or handed:
                self.line.wake_first(self.using)
        for slot in handed:
            self.give(slot, seq)

    def _check_slot_wait(self, deadline: float) -> None:
        self.check_alive()
        if time.monotonic() >= deadline:
            raise DecodeTimeoutError(
                f"timed out waiting for a free slot on {self.name!r}: this handle's "
                f"{self.max_slots} slots, or all {self.n_slots} of the server, are busy "
                "(raise the handle's `slots`, the server's --slots, or the timeout)"
            )

    def _wait_for_segment_slot(self, deadline: float) -> None:
        """Sleep until some client or the reaper posts ``free``, or one slice passes."""
        left = max(0.0, deadline - time.monotonic())
        # With requests of our own in flight, one of our slots may come back sooner.
        timeout = min(SLICE / 5 if self.using else SLICE, left)
        with self.use() as seg:
            self.asked.append(_ask_for_a_slot(seg))
            seg.wait(seg.free, timeout)  # a timeout, or a signal: the caller looks again


def _ask_for_a_slot(seg: Segment) -> int:
    """Tell the server, and every other handle, that a claimer found no FREE slot: the server
    reaps at once (idle handles' warm slots come back only through the reaper) instead of at
    its next tick, and a busy handle gives its next slot back to the segment instead of to its
    own next request (``Attachment.give``). Returns the value stored, which the asking
    attachment remembers as its own.

    A fresh random value each time, not a count: whatever way several claimers' stores
    interleave, the last one differs from what the server last acted on. Then ``ready`` wakes
    the server (a wake-up only; the server reads the value after draining it)."""
    value = secrets.randbits(63) | 1
    seg.header["slot_wanted"] = value
    post(seg.ready)  # a flood may have filled it: no error (posts.post)
    return value
