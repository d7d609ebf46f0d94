"""Many more requests than slots on one handle: they are served first come, first served.

Real server (in a thread of the test process), real shared memory. One handle's requests wait
in line for its slots; a slot given back goes straight to the oldest waiter still waiting, nobody
claims a slot ahead of it, a waiter keeps its place across its slices, and one that leaves
passes on a slot it was handed. Sync and asyncio alike.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest
from support import wait_for

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import DecodeTimeoutError
from bicodec_shm.protocol.waiting import SLICE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_slot_waiters import PacedDecoder, closed_loop  # noqa: E402

GLB = [0] * 32


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, workers", [("asyncio", 512), ("threads", 192)])
def test_many_more_requests_than_slots_on_one_handle_never_time_out_and_none_waits_far_longer_than_the_rest(
    thread_server, shm_name, mode, workers
):
    """512 coroutines, or 192 threads, decoding back to back on one 8-slot handle for 6 s, each
    request with a 10 s timeout, 5 ms a batch: no request times out, the mean latency is well
    under a fifth of the timeout, and the slowest is within a small multiple of the mean. A
    handle whose newcomers take a free slot ahead of its waiters, or whose waiters lose their
    place at each slice, starves some of them: their slowest is over 10x the mean, and some
    time out."""
    thread_server(PacedDecoder(0.005), max_batch=8)
    timeout = 10.0
    with DecoderClient(shm_name, slots=8, timeout=timeout) as client:
        latencies, timeouts = closed_loop(client, mode, workers, 6.0, timeout)
    mean, slowest = statistics.fmean(latencies), max(latencies)
    summary = f"{len(latencies)} requests, mean {mean:.3f} s, slowest {slowest:.3f} s, {timeouts} timeouts"
    assert len(latencies) > 2 * workers, summary  # each worker was served several times
    # The mean is the machine's throughput (512 / ~500 requests a second on 2 busy cores, ~1 s);
    # under a fifth of the timeout, a request starved to 10x the mean would time out.
    assert mean < timeout / 5, summary
    assert timeouts == 0, summary
    assert slowest <= 4 * mean, summary


def _run_waiters(mode: str, att, n: int, hold, free):
    """``n`` requests of one handle wait for a slot in turn (each in line before the next comes,
    SLICE/4 apart, so that their slices end at different times); ``free()`` then gives a slot
    back or lets one go and, at once, a newcomer asks for a slot. Each request, once served,
    gives its slot back. Returns the order of service and the line's order as sampled across
    three slices before ``free()``."""
    served: list[object] = []
    deadline = time.monotonic() + 20
    lines: list[list[int]] = []

    def sample_line(order: list[int]) -> None:
        until = time.monotonic() + 3 * SLICE
        while time.monotonic() < until:
            with att.lock:
                lines.append(list(att.line.waiters))
            time.sleep(0.0005)

    if mode == "sync":

        def waiter(k: int) -> None:
            slot, seq = att.take_slot(deadline)
            served.append(k)
            att.give(slot, seq)

        threads = []
        for k in range(n):
            threads.append(threading.Thread(target=waiter, args=(k,)))
            threads[-1].start()
            wait_for(lambda k=k: len(att.line.waiters) == k + 1, 10, f"waiter {k} in line")
            time.sleep(SLICE / 4)
        order = list(att.line.waiters)
        sample_line(order)
        free()
        slot, seq = att.take_slot(deadline)  # the newcomer
        served.append("newcomer")
        att.give(slot, seq)
        for thread in threads:
            thread.join(20)
        return served, order, lines

    async def main():
        async def waiter(k: int) -> None:
            slot, seq = await att.take_slot_async(deadline)
            served.append(k)
            att.give(slot, seq)

        tasks = []
        for k in range(n):
            tasks.append(asyncio.create_task(waiter(k)))
            while len(att.line.waiters) < k + 1:
                await asyncio.sleep(0.001)
            await asyncio.sleep(SLICE / 4)
        order = list(att.line.waiters)
        until = time.monotonic() + 3 * SLICE
        while time.monotonic() < until:
            lines.append(list(att.line.waiters))
            await asyncio.sleep(0.0005)
        free()
        slot, seq = await att.take_slot_async(deadline)  # the newcomer, in the same step
        served.append("newcomer")
        att.give(slot, seq)
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        return served, order, lines

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["sync", "asyncio"])
@pytest.mark.parametrize("opening", ["given_back", "let_go_of"])
def test_a_slot_given_back_or_let_go_of_goes_to_the_oldest_waiter_never_to_a_newcomer(
    thread_server, shm_name, mode, opening
):
    """Four requests wait, in turn, for the handle's slots (all in use), across several slices:
    their places in line never change. Then a slot comes back (``given_back``: the request on
    it is done; ``let_go_of``: it timed out, so the handle may claim one more) and at that very
    moment a newcomer asks for a slot: the four are served in the order they came, the
    newcomer after them. A newcomer that takes the free slot (or claims the room) ahead of the
    line, a give that leaves the slot for whoever looks first, a wake-up of every waiter, or a
    waiter that goes to the back of the line at the end of each slice all break this order."""
    thread_server(slots=4)
    with DecoderClient(shm_name, slots=2, timeout=20) as client:
        client.decode([1, 2, 3], GLB)  # attached; its slot is warm
        att = client._att
        # Both of the handle's slots in use; one stays in use (the handle is never idle).
        held = [att.take_slot(time.monotonic() + 10) for _ in range(2)]

        def free() -> None:
            if opening == "given_back":
                att.give(*held.pop())
            else:
                att.let_go(*held.pop())

        served, order, lines = _run_waiters(mode, att, 4, held, free)
        for slot, seq in held:
            att.give(slot, seq)
    assert all(line == order for line in lines), next(line for line in lines if line != order)
    assert served == [0, 1, 2, 3, "newcomer"], served


def test_a_waiter_that_leaves_passes_on_the_slot_it_was_handed_and_one_past_its_deadline_is_skipped(
    thread_server, shm_name
):
    """Three coroutines wait for the handle's one slot: the first with a deadline that passes
    while it waits, the second cancelled right after a slot was handed to it (before it ran).
    The slot goes to the third: the first is skipped (and times out), the second passes on what
    it was handed instead of stranding it."""
    thread_server(slots=2)
    with DecoderClient(shm_name, slots=1, timeout=20) as client:
        client.decode([1, 2, 3], GLB)
        att = client._att

        async def main():
            slot, seq = att.take_slot(time.monotonic() + 10)  # the handle's one slot, in use
            now = time.monotonic()
            expiring = asyncio.create_task(att.take_slot_async(now + 0.05))
            while len(att.line.waiters) < 1:
                await asyncio.sleep(0.001)
            cancelled = asyncio.create_task(att.take_slot_async(now + 20))
            while len(att.line.waiters) < 2:
                await asyncio.sleep(0.001)
            last = asyncio.create_task(att.take_slot_async(now + 20))
            while len(att.line.waiters) < 3:
                await asyncio.sleep(0.001)
            while time.monotonic() < now + 0.06:  # the first one's deadline passes in line
                await asyncio.sleep(0.005)
            att.give(slot, seq)  # handed to the second (the first is past its deadline) ...
            handed = [s for s, q in att.using.items() if q != seq]
            cancelled.cancel()  # ... which leaves before it ever runs
            got = await asyncio.wait_for(last, 10)
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            with pytest.raises(DecodeTimeoutError):
                await expiring
            return handed, got

        handed, (slot, seq) = asyncio.run(main())
        assert handed == [slot]  # the slot the cancelled one was handed is the one the last got
        att.give(slot, seq)
        assert client.decode([4, 5], GLB).shape == (640,)
