"""A client that speaks the slot protocol by hand and SIGKILLs itself at a chosen stage.

Usage: python kill_at_stage.py NAME STAGE

Stages: claimed (owns a slot, nothing written), writing (half the payload written),
rung (READY and posted), waiting (READY, posted, then sleeps until killed by the test),
done_unread (waits for DONE, dies before reading). Prints "SLOT <i>" once it owns its slot.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from bicodec_shm.protocol.layout import N_GLOBAL, NO_BELL, SlotState
from bicodec_shm.protocol.segment import Segment


def main(name: str, stage: str) -> None:
    seg = Segment.attach(name)
    slot = next(i for i in range(seg.layout.n_slots)
                if seg.slots["state"][i] == SlotState.FREE and seg.try_lock_slot(i))  # fmt: skip
    s = seg.slots
    s["owner_pid"][slot] = os.getpid()
    s["state"][slot] = SlotState.CLAIMED
    print(f"SLOT {slot}", flush=True)
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if stage == "claimed":
        die()
    seg.tokens[slot, :50] = 7
    if stage == "writing":
        die()
    seg.globals[slot] = 3
    s["n_tokens"][slot], s["n_global"][slot], s["dtype"][slot] = 50, N_GLOBAL, 0
    s["notify"][slot], s["req_generation"][slot] = NO_BELL, s["generation"][slot]
    s["request_seq"][slot] = 1
    s["t_submit_ns"][slot] = time.monotonic_ns()
    s["state"][slot] = SlotState.READY
    seg.req(slot).release()
    seg.ready.release()
    if stage == "rung":
        die()
    if stage == "waiting":
        time.sleep(60)
    seg.done(slot).acquire(30)
    die()  # done_unread


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
