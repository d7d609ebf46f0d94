"""Posts a server's semaphores as fast as one core allows, as a buggy or hostile client could.

Usage: python post_flooder.py NAME N_SLOTS [OWNER_UID]

Opens the server's ``ready`` doorbell and every slot's ``req`` and ``done`` semaphores (the
server's and its clients'), prints "flooding" after its first posts, then posts until it is
killed: ``ready`` mostly, every other one in turn. A semaphore at its maximum value refuses a
post (EOVERFLOW); the flood goes on. A server that shares its segment with its group hands it
over NAME.sock, semaphores inside: then the flooder attaches as a client does (trusting
OWNER_UID's server) and floods those.
"""

from __future__ import annotations

import os
import sys

import posix_ipc


def main() -> None:
    name, n_slots = sys.argv[1], int(sys.argv[2])
    if os.path.exists(f"/dev/shm/{name}.sock"):
        from bicodec_shm.protocol.segment import Segment

        seg = Segment.attach(name, owner_uid=int(sys.argv[3]) if len(sys.argv) > 3 else None)
        ready = seg.ready
        others = [sem for i in range(n_slots) for sem in (seg.req(i), seg.done(i))]
    else:
        ready = posix_ipc.Semaphore(f"/{name}.ready")
        others = [posix_ipc.Semaphore(f"/{name}.{kind}.{i}")
                  for i in range(n_slots) for kind in ("req", "done")]  # fmt: skip
    burst = range(256)
    first = True
    while True:
        for sem in others:
            for _ in burst:
                try:
                    ready.release()
                except OSError:
                    pass
            try:
                sem.release()
            except OSError:
                pass
        if first:
            print("flooding", flush=True)
            first = False


if __name__ == "__main__":
    main()
