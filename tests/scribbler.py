"""A client process of the server's own user that writes where it should not, at random moments.

Usage: python scribbler.py NAME SEED

Attaches (a valid header is needed to map the segment), prints "scribbling", then until it is
killed, every few hundred microseconds at random, one of:

- random bytes over a random stretch of the segment's header (magic, sizes, codec, counters,
  anything);
- on a slot it owns (it claims FREE ones as a client does: the slot's lock, then FREE checked):
  random bytes over the slot's record, payload or audio; any state word (READY without a
  request, BUSY, DONE, a value no state has) at any moment; a plausible request made READY and
  posted, then freed, re-written or left while the server has it; the slot freed whatever its
  state (while the server decodes it, say), or let go of without freeing;
- bursts of posts on any semaphore of the server: ``ready``, ``free``, any slot's ``req`` and
  ``done``, any bell.

It never writes into a slot that another client owns (no protocol can keep a request whose
bytes another process of its user rewrites: see docs/deployment.md), and posts only: every
post is one a stale or hostile peer could make. Imports no torch.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import posix_ipc

from bicodec_shm.protocol.layout import FREE, HEADER_DT, READY, SLOT_DT
from bicodec_shm.protocol.segment import Segment


def main() -> None:
    name, seed = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(seed)
    seg = Segment.attach(name)
    n = seg.layout.n_slots
    header = np.ndarray((HEADER_DT.itemsize,), np.uint8, seg._mmap, 0)
    records = np.ndarray((n, SLOT_DT.itemsize), np.uint8, seg._mmap, seg.layout.slots_off)
    sems = [seg.ready, seg.free, *(seg.req(i) for i in range(n)), *(seg.done(i) for i in range(n)),
            *(seg.bell(i) for i in range(n))]  # fmt: skip
    mine: list[int] = []
    f = seg.field
    print("scribbling", flush=True)

    def claim() -> None:
        for slot in rng.permutation(np.flatnonzero(f["state"] == FREE)).tolist():
            if slot not in mine and seg.try_lock_slot(slot):
                if f["state"][slot] == FREE:
                    f["generation"][slot] += 1
                    f["state"][slot] = 1  # CLAIMED
                    mine.append(slot)
                    return
                seg.unlock_slot(slot)

    def request(slot: int) -> None:  # plausible, or nearly
        k = int(rng.integers(1, 40))
        seg.tokens[slot, :k] = rng.integers(0, 8192, k)
        seg.globals[slot] = rng.integers(0, 4096, seg.codec.n_global)
        f["n_tokens"][slot] = k if rng.random() < 0.8 else int(rng.integers(0, 2**32))
        f["n_global"][slot] = seg.codec.n_global
        f["dtype"][slot] = int(rng.integers(0, 3))
        f["notify"][slot] = 0xFFFFFFFF if rng.random() < 0.7 else int(rng.integers(0, 2 * n))
        stale = int(rng.integers(0, 2**63))
        f["req_generation"][slot] = f["generation"][slot] if rng.random() < 0.9 else stale
        f["request_seq"][slot] = int(rng.integers(1, 2**63))
        f["t_submit_ns"][slot] = int(rng.integers(0, 2**64, dtype=np.uint64))
        f["state"][slot] = READY
        seg.req(slot).release()
        seg.ready.release()

    def post_burst() -> None:
        sem = sems[int(rng.integers(len(sems)))]
        for _ in range(int(rng.integers(1, 2000))):
            try:
                sem.release()
            except OSError:
                break

    while True:
        action = rng.random()
        if action < 0.25:
            start = int(rng.integers(HEADER_DT.itemsize))
            stretch = int(rng.integers(1, 64))
            header[start : start + stretch] = rng.integers(0, 256, len(header[start : start + stretch]))
        elif action < 0.4:
            post_burst()
        elif not mine or (len(mine) < 2 and action < 0.45):
            claim()
        else:
            slot = mine[int(rng.integers(len(mine)))]
            what = int(rng.integers(8))
            if what == 0:
                records[slot] = rng.integers(0, 256, SLOT_DT.itemsize)
            elif what == 1:
                f["state"][slot] = int(rng.integers(0, 7))  # any state word, valid or not
            elif what in (2, 3):
                request(slot)
            elif what == 4:
                row = seg.tokens[slot]
                row[: int(rng.integers(1, len(row)))] = rng.integers(-(2**31), 2**31, 1)
                seg.pcm32[slot, : int(rng.integers(1, 1000))] = np.nan
            elif what == 5:
                seg.free_slot(slot)  # whatever its state: under a batch, say
                mine.remove(slot)
            elif what == 6:
                seg.unlock_slot(slot)  # let go of without freeing: the reaper's
                mine.remove(slot)
            else:
                try:
                    seg.done(slot).acquire(0)  # takes an answer's post, maybe
                except posix_ipc.BusyError:
                    pass
        time.sleep(float(rng.random()) * 0.0005)


if __name__ == "__main__":
    main()
