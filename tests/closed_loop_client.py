"""A closed-loop worker: sends one request, waits for its answer, sends the next, until its stdin
closes. Prints "ready" once attached, and starts sending when it reads a line "go" (so that a
test can start every worker's load at once). Usage: closed_loop_client.py NAME TOKENS [MAX_TOKENS
[THINK_MS THINK_MAX_MS]] (with MAX_TOKENS, each request's length is drawn from TOKENS..MAX_TOKENS;
with THINK_MS, the client first sleeps THINK_MS..THINK_MAX_MS before each request, as a language
model's step would take)."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

from bicodec_shm.client.decoder_client import DecoderClient


def main(name: str, tokens: int, longest: int, think: tuple[float, float] | None = None) -> None:
    stop = threading.Event()
    rng = np.random.default_rng([tokens, longest, threading.get_native_id()])
    with DecoderClient(name, connect_timeout=30) as client:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        while not stop.is_set():
            if think is not None:
                time.sleep(rng.uniform(*think) / 1000)
            n = int(rng.integers(tokens, longest + 1))
            client.decode(rng.integers(0, 8192, n), rng.integers(0, 4096, 32))


if __name__ == "__main__":
    think = (float(sys.argv[4]), float(sys.argv[5])) if len(sys.argv) > 5 else None
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3] if len(sys.argv) > 3 else sys.argv[2]), think)
