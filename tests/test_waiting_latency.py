"""A request that has to wait (for a slot, or without an asyncio bell) is answered promptly.

Real server, real shared memory; the other workers that hold the slots or the bells are real
processes. Every answer is checked against the request's own lone decode.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from support import assert_lone_int16, seeded_request

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.protocol.layout import CLAIMED

# A worker that decodes once and then sits idle with its warm slot until its stdin closes.
IDLE_WORKER = """
import sys
from bicodec_shm.client.decoder_client import DecoderClient
client = DecoderClient(sys.argv[1], slots=1, timeout=30)
client.decode([1, 2, 3], [0] * 32)
print("idle", flush=True)
sys.stdin.read()
client.close()
"""

# Other workers' asyncio waiters, as many as the server has bells: every bell is taken.
BELL_HOLDER = """
import sys
from bicodec_shm.protocol.segment import Segment
seg = Segment.attach(sys.argv[1])
held = [b for b in range(seg.layout.n_slots) if seg.try_lock_bell(b)]
print(len(held), flush=True)
sys.stdin.read()
seg.close()
"""


def _helper(script: str, name: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, name], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)  # fmt: skip


def _finish(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize("mode", ["sync", "asyncio"])
def test_a_claim_that_finds_every_slot_warm_in_idle_handles_is_served_without_waiting_for_the_reaper_tick(
    thread_server, shm_name, mode
):
    """Two slots, each the warm slot of an idle worker process, and the reaper's tick 30 s away:
    each new handle still gets a slot at once. New handles stay open, so the third one finds
    every slot warm again (in the first two new handles)."""
    server = thread_server(slots=2, reap_interval=30.0)
    idle = [_helper(IDLE_WORKER, shm_name) for _ in range(2)]
    late: list[DecoderClient] = []
    try:
        for proc in idle:
            assert proc.stdout.readline() == b"idle\n"
        # Both slots are CLAIMED by handles that let go of their locks (warm), none FREE.
        assert server.segment.field["state"].tolist() == [CLAIMED, CLAIMED]
        for k in range(4):
            handle = DecoderClient(shm_name, slots=1, timeout=5)
            late.append(handle)
            req = seeded_request(700 + k, 12)
            t0 = time.monotonic()
            if mode == "sync":
                pcm = handle.decode(*req)
            else:
                pcm = asyncio.run(handle.decode_async(*req))
            waited = time.monotonic() - t0
            assert_lone_int16(pcm, *req)
            # A claim that waits for the tick waits up to 30 s (or times out at 5 s); a tiny
            # decode takes milliseconds, so 2 s is only slack for a loaded machine.
            assert waited < 2.0, f"new handle {k} waited {waited:.2f} s for a slot"
    finally:
        for handle in late:
            handle.close()
        _finish(idle)


def test_an_asyncio_handle_that_gets_no_bell_is_answered_within_its_short_poll(thread_server, shm_name):
    """Every bell is some other process's: the handle's waiter polls instead of sleeping on a
    bell, and must poll at its short interval, not the 100 ms slice of an idle waiter."""
    thread_server(slots=2)
    holder = _helper(BELL_HOLDER, shm_name)
    try:
        assert holder.stdout.readline() == b"2\n"  # both bells are taken

        async def calls() -> list[float]:
            with DecoderClient(shm_name, slots=1, timeout=10) as client:
                await client.decode_async([1, 2], [0] * 32)  # attach, claim, start the waiter
                times = []
                for k in range(6):
                    req = seeded_request(800 + k, 8)
                    t0 = time.monotonic()
                    pcm = await client.decode_async(*req)
                    times.append(time.monotonic() - t0)
                    assert_lone_int16(pcm, *req)
                return times

        times = asyncio.run(calls())
        # A tiny decode takes a few ms; a waiter sleeping whole 100 ms slices answers each
        # call ~100 ms late.
        assert statistics.median(times) < 0.05, [f"{t * 1000:.0f} ms" for t in times]
    finally:
        _finish([holder])

