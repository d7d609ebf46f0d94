"""The client handle: validation before writing, asyncio, threads, backpressure, fork."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from support import (
    GatedDecoder,
    SteppedDecoder,
    check_in_forked_child,
    seed_int16,
    single_decode,
    submitted_requests,
    wait_for,
    wait_submitted,
)

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import BiCodecShmError, DecodeTimeoutError, ServerUnavailableError
from bicodec_shm.protocol.layout import HOP, SlotState

GLB = list(range(32))


def _snapshot(client):
    seg = client._att.segment
    return (seg.slots.copy(), seg.tokens.copy(), seg.globals.copy(), int(seg.header["requests"]))


BAD_INPUTS = [
    ("empty semantic ids", [], GLB, "empty"),
    ("too many tokens", [1] * 1501, GLB, "more than the 1500"),
    ("31 globals", [1, 2], GLB[:31], "exactly 32"),
    ("33 globals", [1, 2], GLB + [0], "exactly 32"),
    ("negative semantic id", [1, -1], GLB, r"semantic_ids\[1\] = -1 is out of range"),
    ("semantic id 8192", [8192], GLB, r"semantic_ids\[0\] = 8192"),
    ("global id 4096", [1], [4096] + GLB[1:], r"global_ids\[0\] = 4096"),
    ("negative global id", [1], [-5] + GLB[1:], r"global_ids\[0\] = -5"),
    ("float element", [1, 2.0], GLB, r"semantic_ids\[1\] = 2.0 is a float"),
    ("bool element", [True, 1], GLB, r"semantic_ids\[0\] = True is a bool"),
    ("None element", [1, None], GLB, "NoneType"),
    ("str element", ["12"], GLB, "is a str"),
    ("a string", "1234", GLB, "sequence of int ids"),
    ("None", None, GLB, "is None"),
    ("2-D array", np.ones((2, 3), np.int64), GLB, r"must be 1-D.*shape \(2, 3\): a batch of 2 rows"),
    ("a batch of lists", [[1, 2], [3, 4]], GLB, r"a list of 2 sequences: a batch of 2 rows; .*gather"),
    ("a batch of globals", [1], [GLB, GLB], "a batch of 2 rows"),
    ("a column", np.ones((3, 1), np.int64), GLB, r"shape \(3, 1\)"),
    ("a list in a list", [1, [2]], GLB, r"semantic_ids\[1\] = \[2\] is a list"),
    ("a scalar", np.int64(5), GLB, "must be 1-D, a sequence of ids, got a single value"),
    ("float numpy dtype", np.array([1.0, 2.0]), GLB, "integer dtype"),
    ("NaN", [1, float("nan")], GLB, "is a float"),
    ("NaN array", np.array([np.nan]), GLB, "integer dtype"),
    ("int32 overflow", [2**31], GLB, "out of range"),
    ("int64 overflow", [2**80], GLB, "does not fit"),
    ("bool numpy dtype", np.array([True]), GLB, "integer dtype"),
    ("bad output dtype", [1], GLB, "dtype must be"),
]


@pytest.mark.parametrize("label, sem, glb, words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_writes_nothing_and_leaves_the_handle_usable(thread_server, shm_name,
                                                                      label, sem, glb, words):  # fmt: skip
    thread_server()
    with DecoderClient(shm_name) as client:
        before = _snapshot(client)
        dtype = "int8" if label == "bad output dtype" else "int16"
        with pytest.raises(ValueError, match=words):
            client.decode(sem, glb, dtype=dtype)
        with pytest.raises(ValueError, match=words):
            asyncio.run(client.decode_async(sem, glb, dtype=dtype))
        after = _snapshot(client)
        for a, b in zip(before, after):
            assert np.array_equal(a, b), f"{label}: shared memory changed"
        assert client.decode([1, 2, 3], GLB).shape == (3 * HOP,)


def test_tensor_and_numpy_inputs_are_accepted(thread_server, shm_name):
    import torch

    thread_server()
    sem = np.arange(10, 40)
    with DecoderClient(shm_name) as client:
        a = client.decode(sem, GLB)
        b = client.decode(torch.as_tensor(sem), torch.as_tensor(GLB))
        c = client.decode(sem.astype(np.uint16).tolist(), np.array(GLB, np.int32))
    assert np.array_equal(a, b) and np.array_equal(a, c)


def test_spark_tts_shapes_are_one_request_everywhere(thread_server, shm_name):
    """Spark-TTS's (1, T) semantic and (1, 1, 32) global tensors, and the same as numpy arrays
    and nested lists: leading dimensions of size 1 are dropped, sync and async alike."""
    import torch

    thread_server()
    sem = np.arange(10, 40)
    shaped = [
        (torch.as_tensor(sem)[None], torch.as_tensor(GLB)[None, None]),
        (sem[None], np.array(GLB)[None, None]),
        ([sem.tolist()], [[GLB]]),
        (torch.as_tensor(sem, dtype=torch.int32)[None, None], (np.array(GLB),)),
    ]
    with DecoderClient(shm_name) as client:
        expected = client.decode(sem, GLB)
        for s, g in shaped:
            assert np.array_equal(client.decode(s, g), expected)
            assert np.array_equal(asyncio.run(client.decode_async(s, g)), expected)


def test_200_concurrent_coroutines_all_complete_correctly(thread_server, shm_name):
    """200 coroutines on one handle; the thread count is sampled while all 200 are in flight
    (the decoder is gated) and until they finish: one waiter thread per handle at most, never
    one per request."""
    decoder = GatedDecoder()
    server = thread_server(decoder, max_batch=16)
    rng = np.random.default_rng(5)
    reqs = [(rng.integers(0, 8192, int(rng.integers(2, 12))), rng.integers(0, 4096, 32))
            for _ in range(200)]  # fmt: skip

    async def main(client):
        threads_before = threading.active_count()
        peak = threads_before
        tasks = [asyncio.create_task(client.decode_async(s, g)) for s, g in reqs]
        # Every call has started (at the first await) and waits: eight are submitted (the
        # decoder is gated), the others wait for those eight slots.
        deadline = time.monotonic() + 30
        while submitted_requests(server.segment) < 8:
            assert time.monotonic() < deadline, server.segment.slots["state"]
            await asyncio.sleep(0.002)
            peak = max(peak, threading.active_count())
        await asyncio.sleep(0)
        peak = max(peak, threading.active_count())
        assert not any(t.done() for t in tasks), "all 200 must be in flight while sampling"
        decoder.gate.set()
        while not all(t.done() for t in tasks):
            peak = max(peak, threading.active_count())
            await asyncio.sleep(0.002)
        assert peak <= threads_before + 1, (threads_before, peak)
        return [t.result() for t in tasks]

    with DecoderClient(shm_name, slots=8) as client:
        results = asyncio.run(main(client))
        stats = client.get_stats()
    for (s, g), pcm in zip(reqs, results):
        assert np.abs(pcm.astype(np.int32) - seed_int16(single_decode(s, g))).max() <= 1
    assert stats["avg_batch_size"] > 1


def test_event_loop_is_never_blocked(thread_server, shm_name):
    thread_server()

    async def main(client):
        ticks = 0
        done = False

        async def ticker():
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0.001)

        t = asyncio.create_task(ticker())
        await asyncio.gather(*(client.decode_async([7] * 200, GLB) for _ in range(6)))
        done = True
        await t
        return ticks

    with DecoderClient(shm_name, slots=2) as client:
        assert asyncio.run(main(client)) > 5


def test_more_threads_than_slots_all_complete(thread_server, shm_name):
    thread_server()
    rng = np.random.default_rng(6)
    reqs = [(rng.integers(0, 8192, 8), rng.integers(0, 4096, 32)) for _ in range(24)]
    results = [None] * len(reqs)
    with DecoderClient(shm_name, slots=2) as client:

        def run(i):
            results[i] = client.decode(*reqs[i], dtype="float32")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for (s, g), pcm in zip(reqs, results):
        np.testing.assert_allclose(pcm, single_decode(s, g), atol=1e-5, rtol=0)


def test_backpressure_times_out_with_a_clear_error_when_slots_stay_busy(thread_server, shm_name):
    decoder = SteppedDecoder()  # each batch stays in the decoder until the test steps it
    thread_server(decoder)
    with DecoderClient(shm_name, slots=1) as client:
        first = threading.Thread(target=client.decode, args=([1, 2], GLB))
        first.start()
        decoder.wait_entered(1)  # the handle's one slot is busy with the first request
        with pytest.raises(DecodeTimeoutError, match="timed out waiting for a free slot"):
            client.decode([1, 2], GLB, timeout=0.3)
        decoder.step()
        first.join(30)
        # A request that times out waiting for the server frees its slot once answered.
        with pytest.raises(DecodeTimeoutError, match="it still serves: it may be overloaded"):
            client.decode([3, 4], GLB, timeout=0.3)
        decoder.step()  # [3, 4] is answered, its slot comes back ...
        decoder.step()  # ... and [5, 6] goes through
        assert client.decode([5, 6], GLB, timeout=10).shape == (2 * HOP,)


def test_handle_carried_across_fork_reattaches_with_its_own_slots(thread_server, shm_name):
    thread_server()
    client = DecoderClient(shm_name, slots=2)
    try:
        client.decode([9, 9, 9], GLB)
        held = client._att.take_slot(time.monotonic() + 5)  # the parent holds a slot at fork
        parent_slots = set(client._att.owned)
        assert len(parent_slots) == 1

        def child_uses_slots_of_its_own():
            pcm = client.decode([9, 9, 9], GLB)
            return pcm.shape == (3 * HOP,) and not (set(client._att.owned) & parent_slots)

        check_in_forked_child(child_uses_slots_of_its_own)
        assert set(client._att.owned) == parent_slots  # the parent is unaffected
        client._att.give(*held)
        assert client.decode([9, 9, 9], GLB).shape == (3 * HOP,)
    finally:
        client.close()


def test_the_at_fork_hook_resets_the_handle_in_the_child_before_any_call(thread_server, shm_name):
    """The child's handle is reset at fork itself, not lazily at its first call: a lock that
    another parent thread held at fork is a fresh one, and the parent's attachment is gone."""
    thread_server()
    client = DecoderClient(shm_name, slots=2)
    try:
        client.decode([9, 9, 9], GLB)
        assert client._att is not None

        def reset_before_any_call():
            return client._pid == os.getpid() and client._att is None and not client._lock.locked()

        with client._lock:  # as if another thread were inside the handle at fork
            check_in_forked_child(reset_before_any_call)
        assert client._att is not None and client.decode([9, 9, 9], GLB).shape == (3 * HOP,)
    finally:
        client.close()


def test_close_gives_slots_back_and_is_idempotent(thread_server, shm_name):
    server = thread_server()
    client = DecoderClient(shm_name, slots=3)
    client.decode([1], GLB)
    client._att.take_slot(time.monotonic() + 5)  # a request about to be written
    owned = list(client._att.owned)
    assert len(owned) == 1 and all(server.segment.slots["state"][owned] == SlotState.CLAIMED)
    client.close()
    client.close()
    assert all(server.segment.slots["state"][owned] == SlotState.FREE)
    with pytest.raises(BiCodecShmError, match="closed"):
        client.decode([1], GLB)


def test_no_server_gives_a_clear_error(shm_name):
    with pytest.raises(ServerUnavailableError, match="no bicodec-shm server is running"):
        DecoderClient(shm_name)


def test_client_side_imports_no_torch():
    code = ("import sys, bicodec_shm; from bicodec_shm import DecoderClient, BiCodecBatchDecoder; "
            "import bicodec_shm.tools.cli, bicodec_shm.client.decoder_client, bicodec_shm.integrations.batch_decoder; "
            "assert 'torch' not in sys.modules, 'torch was imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_stale_done_post_is_never_taken_for_the_answer(thread_server, shm_name):
    """Finding 12: every post carries a sequence number the reader checks after taking it."""
    decoder = GatedDecoder()
    server = thread_server(decoder, lanes=1)
    sem, glb = np.arange(40) * 11, np.arange(32) * 3
    with DecoderClient(shm_name, slots=1) as client:
        result = []
        t = threading.Thread(target=lambda: result.append(client.decode(sem, glb, dtype="float32")))
        t.start()
        wait_submitted(server.segment, 1)  # the request is in the (gated) decoder
        (slot,) = client._att.owned
        done = client._att.segment.done(slot)
        done.release()  # a stray post, as a timed-out request leaves
        wait_for(lambda: done.value == 0, what="the client to take the stray post")
        assert t.is_alive() and not result  # not fooled into reading a result that is not there
        decoder.gate.set()
        t.join(30)
    np.testing.assert_allclose(result[0], single_decode(sem, glb), atol=1e-5, rtol=0)


def test_slots_are_claimed_on_demand_and_given_back_when_quiescent(thread_server, shm_name):
    """Finding 13: no slot at attach, one per concurrent request; and (second review, finding
    11) none kept when idle, so idle handles never keep a new worker out."""
    server = thread_server(slots=8)
    seg = server.segment
    with DecoderClient(shm_name, slots=4) as client:
        assert (seg.slots["state"] == SlotState.FREE).all()
        rng = np.random.default_rng(9)
        reqs = [(rng.integers(0, 8192, 30), rng.integers(0, 4096, 32)) for _ in range(4)]

        async def burst():
            return await asyncio.gather(*(client.decode_async(s, g) for s, g in reqs))

        for (s, g), pcm in zip(reqs, asyncio.run(burst())):
            assert np.abs(pcm.astype(np.int32) - seed_int16(single_decode(s, g))).max() <= 1
        assert len(client._att.owned) == 0  # all went back once it was quiescent ...
        assert int((seg.slots["state"] != SlotState.FREE).sum()) <= 1  # ... but a warm one
        assert not any(seg.slot_owned_elsewhere(i) for i in range(8))  # which it let go of
        # Eight handles of eight slots each still fit on an eight-slot server.
        others = [DecoderClient(shm_name, slots=8) for _ in range(7)]
        try:
            for other in others:
                assert other.decode([1, 2], GLB).shape == (2 * HOP,)
        finally:
            for other in others:
                other.close()


def test_threads_of_one_handle_never_claim_the_same_slot(thread_server, shm_name, monkeypatch):
    """Slot locks exclude processes, not threads sharing a descriptor: claims are serialised."""
    decoder = GatedDecoder()
    server = thread_server(decoder, lanes=1, slots=8)
    # Every claimer starts its scan at the same slot: collisions are the rule, not luck.
    monkeypatch.setattr("bicodec_shm.protocol.attachment.random.randrange", lambda n: 0)
    rng = np.random.default_rng(12)
    reqs = [(rng.integers(0, 8192, 9), rng.integers(0, 4096, 32)) for _ in range(8)]
    results = [None] * 8
    with DecoderClient(shm_name, slots=8) as client:
        barrier = threading.Barrier(8)

        def run(i):
            barrier.wait()
            results[i] = client.decode(*reqs[i], dtype="float32")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        seg = server.segment
        wait_submitted(seg, 8, timeout=10)  # (two threads sharing a slot: never eight)
        assert len(client._att.owned) == 8  # eight distinct slots for eight requests in flight
        assert int((seg.slots["state"] != SlotState.FREE).sum()) == 8
        assert all(seg.slot_owned_elsewhere(slot) for slot in range(8))  # no lock dropped
        decoder.gate.set()
        for t in threads:
            t.join(30)
    for (s, g), pcm in zip(reqs, results):
        np.testing.assert_allclose(pcm, single_decode(s, g), atol=1e-5, rtol=0)
