"""Reclaiming the slots of clients that are gone.

A live owner holds its slot's lock for as long as it owns the slot (protocol/locks.py). If the
server can take that lock, the owner is gone (the kernel dropped the lock when it died), or let
the slot go without freeing it (an idle client's warm slot, a request that timed out). Slots
held by a planned or running batch are left alone until their result is published.

Two counters tell these apart. An idle handle's warm slot (CLAIMED, ``owner_pid`` 0: the
client zeroes it as it lets go, attachment.py) is an *expiry*: routine under healthy traffic,
counted in ``expired`` and logged at DEBUG. Every other slot freed here is *reclaimed*: its
client died holding it, or gave up on a request (a timeout, a cancelled coroutine, Ctrl-C).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from ..protocol.layout import CLAIMED, DONE, FREE, Status
from ..protocol.posts import drain
from ..protocol.segment import Segment
from .counters import Counters

log = logging.getLogger("bicodec_shm.server")


def slot_wanted(seg: Segment) -> int:
    """The header's ``slot_wanted``: a claimer that found no free slot changed it (and posted
    ``ready``), so a reap is due now. Client-written and read without pairing: only compared."""
    return int(seg.header["slot_wanted"])


def reap_dead_owners(seg: Segment, held_lock: threading.Lock, held: dict[int, int], confirmed: dict[int, int],
                     *, answer_failure: Callable[..., None], counters: Counters,
                     asked: bool = False) -> int:  # fmt: skip
    """Free every slot nobody holds; returns how many were freed (reclaimed and expired).

    Args:
        held_lock, held: the server's slots in planned or running batches (slot -> the seen ns
            of the request that holds it), and their lock.
        confirmed: the server's confirmed requests (slot -> seen ns); a reclaimed slot leaves it.
        answer_failure: ``answer_failure(slot, status, message)`` answers a slot with an error.
        asked: a claimer asked for a slot (reclaims logged at DEBUG too: routine under many
            idle handles).
    """
    f = seg.field
    with held_lock:
        held_now = set(held)
    # Unknown state words come only from a buggy or hostile client: answer them here, at
    # the reaper's pace, rather than scan for them on every request.
    for slot in (f["state"] > DONE).nonzero()[0].tolist():
        if slot not in held_now:
            state = int(f["state"][slot])
            answer_failure(slot, Status.BAD_STATE, f"slot {slot} has unknown state value {state}")
    reclaimed = expired = 0
    # Under the held lock throughout: a lane answers a held slot (DONE, post) and lets go
    # of it in one step under this lock (``_release_and_ring``), so every slot freed here
    # has had its last write and post from the server.
    with held_lock:
        for slot in np.flatnonzero(f["state"] != FREE).tolist():
            if slot in held or not seg.try_lock_slot(slot):
                continue  # in a batch, or its owner is alive
            state = int(f["state"][slot])
            if state == FREE:
                seg.unlock_slot(slot)  # given back between the scan and the lock
                continue
            # Read under its lock, before free_slot zeroes it: an idle handle zeroed it as it
            # let go of the slot warm; a client that held it (alive or dead) left its pid.
            idle = state == CLAIMED and int(f["owner_pid"][slot]) == 0
            f["generation"][slot] += 1  # a late result can never match the next owner
            confirmed.pop(slot, None)
            try:
                # The last owner's posts should not wake the next one (bounded: a flood of
                # posts must not keep us here under the held lock; any left fail the identity).
                drain(seg.req(slot))
                drain(seg.done(slot))
            finally:
                seg.free_slot(slot)
            if idle:
                expired += 1
            else:
                reclaimed += 1
    if reclaimed:
        counters.count_reclaimed(seg, reclaimed)
        log.log(logging.DEBUG if asked else logging.INFO,
                "reclaimed %d slot(s) of clients that died or gave up on a request", reclaimed)
    if expired:
        counters.count_expired(seg, expired)
        log.debug("%d idle handle(s)' warm slot(s) expired", expired)
    return reclaimed + expired
