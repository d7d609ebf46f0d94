"""Slots shared between handles: a handle that always has calls in flight never goes quiescent,
so it would keep every slot it holds for its own next request; another handle that finds no
FREE slot must still get one, within a few of the busy handle's requests."""

from __future__ import annotations

import threading
import time

import numpy as np
from support import seeded_request, single_decode

from bicodec_shm.client.decoder_client import DecoderClient


def _keep_busy(client: DecoderClient, n_threads: int, stop: threading.Event) -> list[threading.Thread]:
    req = seeded_request(3, 6)

    def loop() -> None:
        while not stop.is_set():
            client.decode(*req, dtype="float32")

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n_threads)]
    for t in threads:
        t.start()
    return threads


def test_a_handle_that_finds_every_slot_held_by_busy_handles_still_gets_one(thread_server, shm_name):
    """Two slots, both held by a handle whose six threads call without pause; a second handle
    asks for one: the busy handle gives a slot back to the server at its next turn, instead of
    handing it to its own next caller, and the second handle's call is answered exactly."""
    thread_server(slots=2)
    req = seeded_request(11, 9)
    stop = threading.Event()
    busy = DecoderClient(shm_name, slots=2, timeout=60)
    threads = _keep_busy(busy, 6, stop)
    try:
        deadline = time.monotonic() + 30
        while (busy._att is None or len(busy._att.owned) < 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(busy._att.owned) == 2, "the busy handle never held both slots"
        with DecoderClient(shm_name, slots=1, timeout=10) as late:
            t0 = time.monotonic()
            pcm = late.decode(*req, dtype="float32")
            waited = time.monotonic() - t0
        np.testing.assert_allclose(pcm, single_decode(*req), atol=1e-5, rtol=0)
        assert waited < 5, f"the second handle waited {waited:.1f} s for a slot"
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        busy.close()
    assert not any(t.is_alive() for t in threads)
