"""The client handle: validation before writing, asyncio, threads, backpressure, fork."""

from __future__ import annotations

import asyncio
import dis
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support import (
    GatedDecoder,
    SteppedDecoder,
    bare_attachment,
    check_in_forked_child,
    seed_int16,
    single_decode,
    submitted_requests,
    wait_for,
    wait_submitted,
)

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import (
    BiCodecShmError,
    ClientClosedError,
    DecodeTimeoutError,
    ServerUnavailableError,
)
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
    ("a column", np.ones((3, 1), np.int64), GLB, r"shape \(3, 1\): a column of 3 ids; pass it flattened"),
    ("a list column", [[1], [2], [3]], GLB, r"a list of 3 one-id sequences: a column of 3 ids; pass it"),
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
        while submitted_requests(server.segment, server) < 8:
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


def test_a_close_between_the_waiter_threads_check_and_its_sleep_ends_it_quietly(shm_name):
    """``close`` may retire an attachment after its asyncio waiter thread looked (not retired)
    and before the thread takes the mapping to sleep on its bell: the thread must end there,
    not die with ``ClientClosedError`` (an unhandled exception in a thread of the caller's)."""
    with bare_attachment(shm_name, 2) as (_, att):
        att.bell = 0  # a bell is held: the loop sleeps on it through ``use()``
        sleep_on_bell = att._sleep_on_bell

        def closed_in_between(bell):
            att.retire(ClientClosedError("closed by another thread"))
            return sleep_on_bell(bell)

        att._sleep_on_bell = closed_in_between
        att._wait_loop()  # returns; raised ClientClosedError before
        assert isinstance(att.retired, ClientClosedError)


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
            "import bicodec_shm.tools.cli, bicodec_shm.client.decoder_client; "
            "import bicodec_shm.integrations.batch_decoder; "
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
        wait_submitted(server.segment, 1, server=server)  # the request is in the (gated) decoder
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
        wait_submitted(seg, 8, timeout=10, server=server)  # (two threads sharing a slot: never eight)
        assert len(client._att.owned) == 8  # eight distinct slots for eight requests in flight
        assert int((seg.slots["state"] != SlotState.FREE).sum()) == 8
        assert all(seg.slot_owned_elsewhere(slot) for slot in range(8))  # no lock dropped
        decoder.gate.set()
        for t in threads:
            t.join(30)
    for (s, g), pcm in zip(reqs, results):
        np.testing.assert_allclose(pcm, single_decode(s, g), atol=1e-5, rtol=0)


class _WatchedLock:
    """A handle's claim lock that shows which thread holds it and which wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holder: int | None = None
        self.waiting: set[int] = set()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        self.waiting.add(me)
        try:
            got = self._lock.acquire(blocking, timeout)
        finally:
            self.waiting.discard(me)
        if got:
            self.holder = me
        return got

    def release(self) -> None:
        self.holder = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


_TRY_LOCK = (
    "import sys\n"
    "from bicodec_shm.protocol.segment import Segment\n"
    "seg = Segment.attach(sys.argv[1])\n"
    "print(' '.join(str(int(seg.try_lock_slot(int(s)))) for s in sys.argv[2:]))\n"
)


def _another_process_takes(name: str, slots) -> list[bool]:
    """Which of ``slots`` a client in another process could lock (claim) right now."""
    slots = sorted(slots)
    out = subprocess.run([sys.executable, "-c", _TRY_LOCK, name, *map(str, slots)], check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()  # fmt: skip
    return [bool(int(v)) for v in out]


@pytest.mark.parametrize("dropped", ["warm", "surplus", "let go"])
def test_threads_sharing_a_handle_never_own_an_unlocked_slot(thread_server, shm_name, dropped):
    """A release (the surplus slot given back, or the warm one let go of) once dropped its lock
    outside the claim lock: a claim in another thread of the same handle "re-took" that lock
    (the same open file description holds it, so the lock call succeeds) and owned the slot,
    then the release's unlock dropped it. That thread then owned a slot nobody had locked: the
    reaper frees it under its request (lost), and another process can claim it while tokens are
    being written there (wrong audio). Here the step that drops the lock stops right before its
    unlock while a second thread claims: the claim must wait for it, and whatever slot it gets,
    no other process can lock. (Letting go of a slot takes the claim lock too: otherwise the
    claim, finishing steps that interruptions left, frees that CLAIMED slot and takes it, and
    the late unlock drops its lock.)"""
    let_go = dropped == "let go"
    # One slot to let go of, which the reaper must then free for the claimer; else two, and no
    # reaper tick during the test.
    server = thread_server(slots=1 if let_go else 2, reap_interval=0.05 if let_go else 3600)
    with DecoderClient(shm_name, slots=2, timeout=20) as client:
        client.decode([1, 2, 3], GLB)
        att = client._att
        deadline = time.monotonic() + 20
        if not let_go:
            first, q1 = att.take_slot(deadline)
        second, q2 = att.take_slot(deadline)
        if not let_go:
            att.give(first, q1)  # idle: request q2 is still in flight
        # When q2 is given back the handle is quiescent: `first` goes back to the segment (the
        # surplus, least recently used) and `second` stays warm. Or q2 lets go of `second`.
        target = first if dropped == "surplus" else second
        claim_lock = att.claim_lock = _WatchedLock()
        seg = att.segment
        unlock = seg.unlock_slot
        releaser: list[int] = []
        at_unlock, claimed = threading.Event(), threading.Event()

        def paused_unlock(slot: int) -> None:
            if slot == target and threading.get_ident() in releaser and not at_unlock.is_set():
                at_unlock.set()
                # Until the other thread has claimed (it could: the old release held no claim
                # lock), or waits for the claim lock that this release holds (today's).
                end = time.monotonic() + 3  # (or, should it wait elsewhere, a while)
                while time.monotonic() < end and not claimed.is_set():
                    if claim_lock.holder == releaser[0] and claim_lock.waiting:
                        break
                    time.sleep(0.001)
            unlock(slot)

        seg.unlock_slot = paused_unlock  # this segment's calls only

        def release() -> None:
            releaser.append(threading.get_ident())
            if let_go:
                att.let_go(second, q2)  # (its caller gave up on it: a timeout, say)
            else:
                att.give(second, q2)

        got = []

        def claim() -> None:
            got.append(att.take_slot(time.monotonic() + 20))
            claimed.set()

        releasing = threading.Thread(target=release)
        releasing.start()
        try:
            assert at_unlock.wait(10), "the release never reached the unlock"
            claiming = threading.Thread(target=claim)
            claiming.start()
            claiming.join(20)
            releasing.join(20)
        finally:
            del seg.unlock_slot
        assert got, "the claim never completed"
        slot, seq = got[0]
        assert slot in att.owned
        # The slot this thread owns is locked: no other process can claim it under its request.
        assert _another_process_takes(shm_name, [slot]) == [False]
        att.give(slot, seq)
    assert (server.segment.slots["state"] == SlotState.FREE).all()


class _Silence:
    """A decoder that answers at once with silence: the handle's own steps, not the model's
    arithmetic, take the time."""

    def detokenize(self, semantic_ids, global_ids, lengths):
        import torch

        return torch.zeros(semantic_ids.shape[0], HOP * semantic_ids.shape[1])


def test_threads_sharing_a_handle_keep_every_owned_slot_locked_under_load(thread_server, shm_name):
    """The same race, left to chance: three threads share one handle and decode back to back
    while a watcher checks, under the handle's lock (so that no step is half seen), that every
    slot the handle owns is locked as another open file description sees it. The old release
    lost this within seconds; a bounded run here, beside the forced interleaving above."""
    server = thread_server(_Silence(), slots=3, reap_interval=0.05)
    seg = server.segment  # the server's own descriptor: it sees the handle's locks from outside
    bad: list[tuple[int, set]] = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns every few bytecodes: far more interleavings
    stop = time.monotonic() + 2.0
    with DecoderClient(shm_name, slots=3, timeout=30) as client:
        client.decode([1, 2, 3], GLB)
        att = client._att

        def work(i: int) -> int:
            done = 0
            while time.monotonic() < stop:
                client.decode([1 + i, 2, 3], GLB)
                done += 1
            return done

        def watch() -> None:
            while time.monotonic() < stop:
                with att.lock:
                    unlocked = {s for s in att.owned if not seg.slot_owned_elsewhere(s)}
                if unlocked:
                    bad.append((len(bad), unlocked))
                time.sleep(0.0005)

        try:
            with ThreadPoolExecutor(4) as pool:
                watcher = pool.submit(watch)
                counts = [f.result(timeout=60) for f in [pool.submit(work, i) for i in range(3)]]
                watcher.result(timeout=60)
        finally:
            sys.setswitchinterval(switch)
    assert not bad, f"owned slots without a lock: {bad[:5]}"
    assert min(counts) > 0


class _Interrupt(BaseException):
    """What a signal handler raises: Ctrl-C's KeyboardInterrupt, a SIGALRM deadline."""


# Where a request's slot changes hands: the handle's steps, the client's call around them, the
# segment's lock and semaphore calls. Not the waits (how many bytecodes a wait runs depends on
# timing), nor the input's validation (nothing is taken yet), nor the callback that hands an
# answer to its event loop (asyncio, not the caller, gets an exception raised there).
_STEPS = {"attachment.py": None, "slot_waits.py": None, "waiting.py": None, "transport.py": None,
          "client.py": {"_decode", "_decode_async", "_submit"}}  # fmt: skip
_NOT_STEPS = {"wait_result", "wait", "_wait_for_segment_slot", "_sleep_in_line", "apply"}


def _is_step(code) -> bool:
    path = code.co_filename
    if f"{os.sep}bicodec_shm{os.sep}" not in path or code.co_name in _NOT_STEPS:
        return False
    names = _STEPS.get(os.path.basename(path), ())
    return names is None or code.co_name in names


# The points where CPython runs a signal handler, and so where its exception lands: a
# function's start (a generator's resumption too), right after a call returns, a backward
# jump. (Not just any bytecode: between the last call of a ``with`` block's body and its
# ``__exit__`` no handler runs, and raising there would leak even a plain ``threading.Lock``.)
_CHECKS_AFTER = {dis.opmap[op] for op in ("CALL", "CALL_FUNCTION_EX", "JUMP_BACKWARD") if op in dis.opmap}


def _run_interrupted_at(call, n: int | None):
    """Run ``call()`` in this thread, raising ``_Interrupt`` at the ``n``-th point where a
    signal handler could run in a step (None: only count them). Returns (points counted, where
    it was raised or None, call's result or its exception)."""
    count, where, last = [0], [None], {}

    def interrupt_here(frame) -> None:
        count[0] += 1
        if count[0] == n:
            code = frame.f_code
            where[0] = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"
            raise _Interrupt(where[0])  # the trace function is unset with it

    def local(frame, event, arg):
        if event == "opcode":
            if last.get(id(frame)) in _CHECKS_AFTER:
                interrupt_here(frame)
            last[id(frame)] = frame.f_code.co_code[frame.f_lasti]
        return local

    def tracer(frame, event, arg):
        if event != "call" or not _is_step(frame.f_code):
            return None
        last.pop(id(frame), None)
        interrupt_here(frame)
        frame.f_trace_opcodes = True
        return local

    sys.settrace(tracer)
    try:
        outcome = call()
    except _Interrupt as exc:
        outcome = exc
    finally:
        sys.settrace(None)
    return count[0], where[0], outcome


# An exception between calling a coroutine function and awaiting what it returned leaves a
# coroutine that never ran: Python warns when it is collected (nothing of ours is involved).
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
@pytest.mark.parametrize("path", ["warm", "claim", "asyncio"])
def test_an_exception_at_any_bytecode_of_a_request_leaves_no_slot_locked_or_booked(thread_server, shm_name,
                                                                                   path):  # fmt: skip
    """A signal handler's exception (SIGALRM deadlines, Celery's soft time limits, Ctrl-C) may
    land between any two steps. Steps that locked a slot before booking it, or unbooked it
    before unlocking, or a try that began only after the slot was taken, left a slot locked and
    owned by no request: the reaper can never free it, and with every slot so lost the handle,
    and then fresh clients in other processes, time out waiting for one. Here one request is
    interrupted at each point of its ownership steps where a handler could run, in turn, on
    the warm-slot path, on the claim path (a fresh handle), and in a coroutine (warm slot):
    right after each, the handle holds no lock and books nothing; and at the end a client in
    another process decodes on the server's one slot."""
    server = thread_server(slots=1, reap_interval=3600)  # only the test reaps, when it means to
    seg = server.segment
    req = ([5, 6, 7], GLB)
    clients = [DecoderClient(shm_name, slots=1, timeout=5)]

    def start_of_path() -> DecoderClient:
        """Everything back to the segment (a request let go of is reaped once answered); then
        the state the path starts from: a warm slot of the handle's, or a fresh handle."""
        def reaped() -> bool:
            # A reaper pass by the dispatcher itself (reaping from this thread could race the
            # planning of a batch, which the server never does): due now, and a wake-up.
            server._next_reap = 0.0
            seg.ready.release()
            time.sleep(0.005)
            return int(seg.slots["state"][0]) == SlotState.FREE

        wait_for(reaped, 10, "the slot to come back")
        if path == "claim":
            clients.pop().close()
            clients.append(DecoderClient(shm_name, slots=1, timeout=5))
        else:
            request(clients[-1])  # leaves its slot warm (and, in a coroutine, its bell claimed)
        return clients[-1]

    def request(client: DecoderClient):
        if path == "asyncio":
            return asyncio.run(client.decode_async(*req))
        return client.decode(*req)

    try:
        # The server's first decode traces its CPU lanes' graph (~0.4 s, once per decoder): a
        # request that waited for it polls more, so its points are counted on a warm server.
        request(clients[-1])
        client = start_of_path()
        total, _, _ = _run_interrupted_at(lambda: request(client), None)
        assert total > 50, total
        for n in range(1, total + 10):
            client = start_of_path()
            points, where, outcome = _run_interrupted_at(lambda c=client: request(c), n)
            if where is None:
                assert points < n and n > total - 5 and isinstance(outcome, np.ndarray), (n, points, total)
                break  # past the request's last step
            assert isinstance(outcome, _Interrupt), f"at {where}: the exception was swallowed ({outcome!r})"
            att = client._att
            left = {"owned": set(att.owned), "using": dict(att.using), "claiming": att.claiming,
                    "loose": set(getattr(att, "loose", ())), "pending": dict(att.pending),
                    "locked": seg.slot_owned_elsewhere(0)}  # fmt: skip
            nothing = {"owned": set(), "using": {}, "claiming": 0, "loose": set(), "pending": {},
                       "locked": False}  # fmt: skip
            assert left == nothing, (
                f"an exception at {where} (point {n} of {total}) left {left}")
        else:
            pytest.fail(f"the request never ran to its end ({total} points)")
    finally:
        for client in clients:
            client.close()
    # The one slot is not lost: a client in another process gets it at once.
    code = (f"from bicodec_shm.client.decoder_client import DecoderClient; "
            f"print(DecoderClient({shm_name!r}, timeout=5).decode({req[0]!r}, {req[1]!r}).shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"({3 * HOP},)", out.stderr[-2000:]


def test_an_exception_at_any_bytecode_of_giving_a_slot_back_to_the_segment_leaves_it_ours_or_free(shm_name):
    """``give`` with a request of the handle in line and another handle asking for a slot sends
    the slot back to the segment in several steps. An exception at any point where a handler
    could run, then the caller's cleanup (``abandon``), leaves the slot either ours (owned,
    booked to nobody or to the request in line) or FREE and forgotten: never booked to the
    waiting request while no longer ours (it would submit into a slot the handle then frees)."""
    from bicodec_shm.protocol.layout import FREE

    for n in range(1, 200):
        with bare_attachment(shm_name, 2) as (seg, att):
            slot, seq = att.take_slot(time.monotonic() + 5)
            waiting = att.new_seq()
            with att.lock:
                att.line.join(waiting, time.monotonic() + 5, None)
            seg.header["slot_wanted"] = 12345  # another handle found no FREE slot
            _, where, _ = _run_interrupted_at(lambda a=att, s=slot, q=seq: a.give(s, q), n)
            att.abandon(seq)
            state = (slot in att.owned, att.using.get(slot), slot in att.loose, int(seg.slots["state"][slot]))
            if where is None:
                assert state == (False, None, False, FREE), state  # given back, uninterrupted
                break
            ours, booked, loose, st = state
            assert not loose, f"an exception at {where} left slot {slot} loose: {state}"
            assert ours or (booked is None and st == FREE), f"an exception at {where} left {state}"
            att.abandon(waiting)
    else:
        pytest.fail("give never ran to its end")


def test_a_storm_of_signal_handler_exceptions_never_wedges_the_handle_or_the_slot(thread_server, shm_name):
    """Chance's version of the sweep above, bounded: a signal every 0.5-3 ms whose handler
    raises into whatever the main thread is doing in its decode calls (one exception a call),
    on a one-slot server, for 3 s. Afterwards the handle books and holds nothing, decodes, and a
    client in another process decodes at once."""
    server = thread_server(_Silence(), slots=1, reap_interval=0.05)
    inside = [False]

    def handler(signum, frame):
        if inside[0]:  # only into a decode call (the test's own loop must not be hit)
            inside[0] = False
            raise _Interrupt("from the handler")

    previous = signal.signal(signal.SIGUSR1, handler)
    stop = threading.Event()

    def storm() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            time.sleep(rng.uniform(0.0005, 0.003))
            os.kill(os.getpid(), signal.SIGUSR1)

    counts = {"answered": 0, "interrupted": 0}
    try:
        with DecoderClient(shm_name, slots=1, timeout=10) as client:
            client.decode([1, 2, 3], GLB)
            sender = threading.Thread(target=storm, daemon=True)
            sender.start()
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                try:
                    inside[0] = True
                    client.decode([1, 2, 3], GLB)
                    inside[0] = False
                    counts["answered"] += 1
                except _Interrupt:
                    counts["interrupted"] += 1
            stop.set()
            sender.join(10)
            att = client._att
            left = (set(att.owned), dict(att.using), att.claiming, set(getattr(att, "loose", ())))
            assert left == (set(), {}, 0, set()), left
            assert not server.segment.slot_owned_elsewhere(0)
            assert client.decode([1, 2, 3], GLB).shape == (3 * HOP,)
    finally:
        stop.set()
        signal.signal(signal.SIGUSR1, previous)
    assert counts["interrupted"] > 50 and counts["answered"] > 50, counts
    code = (f"from bicodec_shm.client.decoder_client import DecoderClient; "
            f"print(DecoderClient({shm_name!r}, timeout=5).decode([1, 2, 3], {GLB!r}).shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"({3 * HOP},)", out.stderr[-2000:]


def test_an_exception_at_any_bytecode_of_a_request_waiting_in_line_leaves_nothing_booked_or_in_line(
    thread_server, shm_name
):
    """The same sweep for a request that has to wait in line: the handle's one slot is in use;
    the request joins the line and another thread then gives that slot back, so that it is
    handed to the waiting request. An exception at each point of the request's steps in turn:
    right after each, nothing is left in line, booked or locked (a slot handed to the request
    was passed on, and with nobody else waiting went back), and the handle still decodes."""
    server = thread_server(slots=2, reap_interval=0.05)
    seg = server.segment
    with DecoderClient(shm_name, slots=1, timeout=5) as client:
        client.decode([5, 6, 7], GLB)
        att = client._att

        def interrupted_at(n: int | None):
            held = att.take_slot(time.monotonic() + 5)  # the handle's one slot, in use
            done = threading.Event()

            def give_when_in_line() -> None:
                wait_for(lambda: bool(att.line.waiters) or done.is_set(), 10, "the request in line")
                att.give(*held)

            giver = threading.Thread(target=give_when_in_line)
            giver.start()
            try:
                return _run_interrupted_at(lambda: client.decode([5, 6, 7], GLB), n)
            finally:
                done.set()
                giver.join(10)

        total, _, outcome = interrupted_at(None)
        assert isinstance(outcome, np.ndarray) and total > 30, (total, outcome)
        for n in range(1, total + 10):
            points, where, outcome = interrupted_at(n)
            if where is None:
                assert isinstance(outcome, np.ndarray), (n, points, total)
                break
            assert isinstance(outcome, _Interrupt), f"at {where}: the exception was swallowed ({outcome!r})"
            left = {"line": dict(att.line.waiters), "using": dict(att.using), "claiming": att.claiming,
                    "loose": set(att.loose), "pending": dict(att.pending)}  # fmt: skip
            nothing = {"line": {}, "using": {}, "claiming": 0, "loose": set(), "pending": {}}
            assert left == nothing, f"an exception at {where} (point {n} of {total}) left {left}"
        else:
            pytest.fail(f"the request never ran to its end ({total} points)")
        assert client.decode([1, 2], GLB).shape == (2 * HOP,)
    assert not seg.slot_owned_elsewhere(0) and not seg.slot_owned_elsewhere(1)
