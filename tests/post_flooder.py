"""Posts a server's semaphores as fast as one core allows, as a buggy or hostile client could.

Usage: python post_flooder.py NAME N_SLOTS

Opens the server's ``ready`` doorbell and every slot's ``req`` and ``done`` semaphores (the
server's and its clients'), prints "flooding" after its first posts, then posts until it is
killed: ``ready`` mostly, every other one in turn. A semaphore at its maximum value refuses a
post (EOVERFLOW); the flood goes on. Imports posix_ipc only, so that any user may run it.
"""

from __future__ import annotations

import sys

import posix_ipc


def main() -> None:
    name, n_slots = sys.argv[1], int(sys.argv[2])
    ready = posix_ipc.Semaphore(f"/{name}.ready")
    others = [posix_ipc.Semaphore(f"/{name}.{kind}.{i}") for i in range(n_slots) for kind in ("req", "done")]
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
