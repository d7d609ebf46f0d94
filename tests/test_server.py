"""The server on its own: batching, PCM conversion, validation of what it reads, failures."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import serve_command, wait_until_serving
from support import (
    ReadLog,
    SteppedDecoder,
    reference_model,
    seed_int16,
    single_decode,
    wait_for,
    wait_submitted,
)

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import DecodeError, DecodeTimeoutError, ServerAlreadyRunningError
from bicodec_shm.protocol.header import read_header, stats_from_header
from bicodec_shm.protocol.layout import HOP, NO_BELL, SlotState, Status
from bicodec_shm.protocol.names import leftover_objects
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.server.server import DecoderServer

POISON = 4242  # a semantic id that makes PoisonDecoder raise


class PoisonDecoder:
    """The tiny model, except that any batch containing POISON raises (a failing decode)."""

    def __init__(self) -> None:
        self.model = reference_model()
        self.device = self.model.device
        self.config = self.model.config
        self.calls: list[int] = []

    def detokenize(self, semantic_ids, global_ids, lengths):
        self.calls.append(semantic_ids.shape[0])
        for row, n in zip(semantic_ids, lengths):
            if (row[: int(n)] == POISON).any():
                raise RuntimeError("poisoned input: CUDA error: device-side assert (simulated)")
        return self.model.detokenize(semantic_ids, global_ids, lengths)


class GatedDecoder(PoisonDecoder):
    """Blocks each batch until the test opens the gate, so requests pile up into one batch."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def detokenize(self, semantic_ids, global_ids, lengths):
        self.gate.wait(30)
        return super().detokenize(semantic_ids, global_ids, lengths)


def _requests(seed, count, lo=5, hi=60):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 8192, int(rng.integers(lo, hi + 1))), rng.integers(0, 4096, 32))
            for _ in range(count)]  # fmt: skip


def _decode_all_concurrently(client, reqs, dtype="int16", gate=None, server=None):
    """Decode ``reqs`` in a thread each. With ``gate`` (a gated decoder's), the gate opens only
    once every request is submitted (``wait_submitted``): the batches that got in first wait in
    the decoder and all the others are queued behind them, so they form batches together."""
    results = [None] * len(reqs)

    def run(i):
        try:
            results[i] = client.decode(*reqs[i], dtype=dtype)
        except Exception as exc:  # collected and asserted by the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    if gate is not None:
        try:
            wait_submitted(server.segment, len(reqs), server=server)
        finally:
            gate.set()
    for t in threads:
        t.join(60)
    return results


def test_int16_is_the_seeds_exact_conversion(thread_server, shm_name):
    """Bit for bit: the server's int16 is the seed's conversion of the float32 it decoded. One
    request at a time, each a batch of its own, so the float32 twin is the same decode."""
    thread_server()
    with DecoderClient(shm_name) as client:
        for sem, glb in _requests(1, 5):
            audio = client.decode(sem, glb, dtype="float32")
            pcm = client.decode(sem, glb)
            assert pcm.dtype == np.int16 and pcm.shape == (HOP * len(sem),)
            np.testing.assert_allclose(audio, single_decode(sem, glb), rtol=0, atol=1e-5)
            assert np.array_equal(pcm, seed_int16(audio))
            assert np.count_nonzero(np.abs(audio) * 32767 % 1 >= 0.5) > len(audio) // 4  # rounding would show


def test_mixed_lengths_in_one_batch_each_get_their_lone_decode(thread_server, shm_name):
    decoder = GatedDecoder()
    server = thread_server(decoder, max_batch=8, max_batch_tokens=None, min_fill=0.0, lanes=1)
    reqs = _requests(2, 6, lo=3, hi=80)
    with DecoderClient(shm_name, slots=6) as client:
        results = _decode_all_concurrently(client, reqs, dtype="float32", gate=decoder.gate, server=server)
    assert max(decoder.calls) > 1, decoder.calls  # a real multi-row batch formed
    for (sem, glb), pcm in zip(reqs, results):
        np.testing.assert_allclose(pcm, single_decode(sem, glb), atol=1e-5, rtol=0)
    stats = stats_from_header(server.segment.header)
    assert stats["requests"] == 6 and stats["failed"] == 0
    assert stats["padded_tokens"] >= stats["tokens"]


def test_a_failing_request_fails_alone_after_split_and_retry(thread_server, shm_name):
    decoder = GatedDecoder()
    server = thread_server(decoder, max_batch=8, min_fill=0.0, lanes=1, batching="static")
    reqs = _requests(3, 5)
    bad = (np.full(20, POISON), np.zeros(32, np.int64))
    with DecoderClient(shm_name, slots=6) as client:
        results = _decode_all_concurrently(client, reqs + [bad], dtype="float32", gate=decoder.gate,
                                           server=server)  # fmt: skip
        # The handle and the server keep working afterwards.
        again = client.decode(*reqs[0], dtype="float32")
    assert max(decoder.calls) >= 3  # the poison shared a batch with others, which was split
    assert isinstance(results[-1], DecodeError)
    assert "poisoned input" in str(results[-1]) and results[-1].code == Status.DECODE_FAILED
    for (sem, glb), pcm in zip(reqs, results[:-1]):
        assert isinstance(pcm, np.ndarray), pcm
        np.testing.assert_allclose(pcm, single_decode(sem, glb), atol=1e-5, rtol=0)
    # Ground truth is the lone decode (batched vs lone differ by float rounding, ~2e-6).
    np.testing.assert_allclose(again, single_decode(*reqs[0]), atol=1e-5, rtol=0)


class _Rogue:
    """Writes requests straight into a slot, as a buggy or hostile process could."""

    def __init__(self, name):
        self.seg = Segment.attach(name)
        free = (self.seg.slots["state"] == SlotState.FREE).nonzero()[0].tolist()
        self.slot = next(i for i in free if self.seg.try_lock_slot(i))
        self.seg.slots["state"][self.slot] = SlotState.CLAIMED

    def send(self, **fields):
        s, i = self.seg.slots, self.slot
        self.seg.tokens[i, :10] = 5
        self.seg.globals[i] = 5
        defaults = dict(n_tokens=10, n_global=32, dtype=0, notify=NO_BELL, status=0,
                        req_generation=int(s["generation"][i]), request_seq=77)  # fmt: skip
        defaults.update({k: v for k, v in fields.items() if k in defaults})
        for k, v in defaults.items():
            s[k][i] = v
        if "semantic" in fields:
            self.seg.tokens[i, : len(fields["semantic"])] = fields["semantic"]
        if "global_ids" in fields:
            self.seg.globals[i] = fields["global_ids"]
        s["state"][i] = fields.get("state", SlotState.READY)
        self.seg.req(i).release()
        self.seg.ready.release()
        self.seg.done(i).acquire(10)
        assert s["state"][i] == SlotState.DONE
        assert int(s["result_seq"][i]) == 77
        return int(s["status"][i]), self.seg.error_text(i)

    def close(self):
        self.seg.close()


@pytest.mark.parametrize(
    "fields, status, words",
    [
        (dict(n_tokens=0), Status.BAD_LENGTH, "semantic length 0"),
        (dict(n_tokens=10**9), Status.BAD_LENGTH, "semantic length 1000000000"),
        (dict(n_global=31), Status.BAD_GLOBAL, "31 global ids"),
        (dict(semantic=[1, 2, 9000]), Status.BAD_SEMANTIC_ID, "semantic id 9000 at position 2"),
        (dict(semantic=[-3]), Status.BAD_SEMANTIC_ID, "semantic id -3 at position 0"),
        (dict(global_ids=[4096] * 32), Status.BAD_GLOBAL, "global id 4096 at position 0"),
        (dict(dtype=7), Status.BAD_DTYPE, "unknown output dtype code 7"),
        (dict(req_generation=12345), Status.STALE_GENERATION, "generation 12345"),
        (dict(notify=100_000), Status.BAD_NOTIFY, "bell index 100000 out of range"),
        (dict(state=99), Status.BAD_STATE, "unknown state value 99"),
    ],
)
def test_a_corrupt_slot_fails_alone_and_names_the_problem(thread_server, shm_name, fields, status, words):
    thread_server()
    rogue = _Rogue(shm_name)
    try:
        with DecoderClient(shm_name) as client:
            got_status, text = rogue.send(**fields)
            assert got_status == status, text
            assert words in text
            # Others are served correctly before and after.
            sem, glb = _requests(4, 1)[0]
            np.testing.assert_allclose(client.decode(sem, glb, dtype="float32"),
                                       single_decode(sem, glb), atol=1e-5, rtol=0)  # fmt: skip
    finally:
        rogue.close()


def test_dead_clients_slots_are_reclaimed(thread_server, shm_name):
    server = thread_server(reap_interval=0.1)
    code = (
        "import os, signal, threading; from bicodec_shm.client.decoder_client import DecoderClient; "
        f"c = DecoderClient({shm_name!r}, slots=3); "
        "ts = [threading.Thread(target=c.decode, args=([1] * 40, [0] * 32)) for _ in range(3)]; "
        "[t.start() for t in ts]; [t.join() for t in ts]; c.decode([1], [0] * 32); "
        # It dies holding two slots (requests about to be written).
        "held = [c._att.take_slot(float('inf'))[0] for _ in range(2)]; "
        # The reaper may have taken back the handle's warm slot before these claims (its
        # quiescent handle let it go): count from here.
        "from bicodec_shm.protocol.header import stats_from_header; "
        "st = stats_from_header(c._att.segment.header); "
        "print(*held, *(int(c._att.segment.slots['generation'][s]) for s in held), st['reclaimed'], "
        "st['idle_slots_expired'], flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    *held, gen_a, gen_b, before, expired_before = (int(v) for v in out.stdout.split())
    seg = server.segment
    deadline = time.monotonic() + 2.0
    while (seg.slots["state"] != SlotState.FREE).any():
        assert time.monotonic() < deadline, seg.slots["state"]
        time.sleep(0.02)
    stats = stats_from_header(seg.header)
    # Both were held by a client that died (one may be its warm slot, re-taken): reclaimed,
    # never counted as an idle handle's expiry.
    assert stats["reclaimed"] == before + 2
    assert stats["idle_slots_expired"] == expired_before
    # The reaper bumped each claim epoch: a late result can never match a next owner.
    assert seg.slots["generation"][held].tolist() == [gen_a + 1, gen_b + 1]


def test_an_idle_handles_warm_slot_is_counted_as_expired_not_reclaimed_and_logged_below_info(
        thread_server, shm_name, caplog):  # fmt: skip
    caplog.set_level(logging.DEBUG, logger="bicodec_shm.server")
    server = thread_server(reap_interval=0.1)
    seg = server.segment
    with DecoderClient(shm_name) as client:
        client.decode([1] * 20, [0] * 32)
        assert client._att.warm is not None  # quiescent: its one slot let go of, warm
        wait_for(lambda: (seg.slots["state"] == SlotState.FREE).all(), 10, "the warm slot to expire")
        time.sleep(0.3)  # a few more reaper ticks: counted once
        stats = stats_from_header(seg.header)
        assert stats["idle_slots_expired"] == 1
        assert stats["reclaimed"] == 0
        logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "bicodec_shm.server"]
        assert not [m for lvl, m in logged if lvl >= logging.INFO and ("reclaimed" in m or "expired" in m)]
        assert [m for level, m in logged if "expired" in m] == ["1 idle handle(s)' warm slot(s) expired"]
        # The handle comes back after its slot expired: an ordinary claim.
        assert client.decode([2] * 20, [0] * 32).shape == (20 * HOP,)
        assert stats_from_header(seg.header)["reclaimed"] == 0


def test_a_handle_that_comes_back_before_the_reap_holds_its_warm_slot_under_its_pid_again(
        thread_server, shm_name):  # fmt: skip
    server = thread_server(reap_interval=600)  # no tick during the test
    seg = server.segment
    with DecoderClient(shm_name) as client:
        client.decode([1] * 20, [0] * 32)
        warm, gen = client._att.warm
        # Let go of, warm: still CLAIMED at its claim epoch, marked as nobody's.
        assert seg.slots["state"][warm] == SlotState.CLAIMED and seg.slots["generation"][warm] == gen
        assert seg.slots["owner_pid"][warm] == 0
        slot, seq = client._att.take_slot(time.monotonic() + 10)
        assert slot == warm and seg.slots["generation"][warm] == gen  # re-taken, not claimed anew
        assert seg.slots["owner_pid"][warm] == os.getpid()
        client._att.give(slot, seq)
    stats = stats_from_header(seg.header)
    assert stats["idle_slots_expired"] == stats["reclaimed"] == 0  # close freed it itself


# -- how long a stop takes: the running batches, nothing else ---------------------------------
# The tests above use reap_interval=600 (no tick during the test); so do these, since a stop
# once waited for that tick where its wake-up went astray.


def test_a_stop_whose_wake_up_the_dispatcher_s_drain_takes_still_ends_the_server_at_once(
        thread_server, shm_name):  # fmt: skip
    """stop() sets the flag, then posts the doorbell. Landing after the dispatcher's check of
    the flag and before its scan drains the doorbell, the post was taken by that drain, and the
    dispatcher slept on the doorbell until the reap tick: 600 s here, where the tests' 20 s
    join found the server thread still alive (seen once, under load). Forced: the planted scan
    calls stop() itself, right before the real scan."""
    server = thread_server(reap_interval=600)
    real_scan, armed, scanned = server._scan, threading.Event(), threading.Event()

    def stop_then_scan(segment):
        if armed.is_set():
            armed.clear()
            server.stop()
        waiting = real_scan(segment)
        scanned.set()
        return waiting

    server._scan = stop_then_scan  # the dispatcher looks it up on every scan
    # First a scan through the plant, so that the dispatcher is past any scan already under
    # way (whose drain would take the posts below) and on its way to the doorbell. Posting
    # again is harmless until then: a scan that finds nothing goes back to the doorbell.
    deadline = time.monotonic() + 30
    while not scanned.is_set():
        assert time.monotonic() < deadline, "the dispatcher never scanned"
        server.segment.ready.release()
        scanned.wait(0.2)
    armed.set()
    server.segment.ready.release()  # the dispatcher wakes, and its next scan meets the stop
    server._thread.join(5)
    assert not armed.is_set(), "the dispatcher did not scan again"
    assert not server._thread.is_alive(), "the server slept through its stop"


def test_a_stop_wakes_the_lanes_the_tuner_parked(thread_server, shm_name):
    """With the lane tuner on, lanes beyond the running count wait for their turn, polling the
    stop every reap_interval: a stop must wake them, not wait for their poll (600 s here)."""
    decoder = reference_model()  # (built first: its first build sets one thread)
    torch.set_num_threads(4)  # 4 cores for this server: lanes 1, 2 and 4 to choose from
    server = thread_server(decoder, reap_interval=600)  # (the fixture restores the thread count)
    assert server.lanes == 1 and server.max_lanes == 4  # three lanes to park
    turns = server._lanes._turns  # the Condition parked lanes wait on: all three must be waiting
    deadline = time.monotonic() + 30
    while len(turns._waiters) < 3:  # (a stop before they park would find nothing to wake)
        assert time.monotonic() < deadline, "the three lanes beyond the running count never parked"
        time.sleep(0.01)
    server.stop()
    server._thread.join(5)
    assert not server._thread.is_alive(), "a parked lane slept through the stop"


def test_a_stop_waits_for_the_running_batch_only_and_answers_it(thread_server, shm_name):
    """The bound of a stop: the batches the lanes are running when it comes. The server ends
    once that batch is answered (its client gets its audio), whatever the reap interval."""
    decoder = SteppedDecoder()
    server = thread_server(decoder, reap_interval=600)
    sem, glb = _requests(41, 1)[0]
    out: dict = {}
    with DecoderClient(shm_name, timeout=60) as client:
        caller = threading.Thread(target=lambda: out.update(pcm=client.decode(sem, glb, dtype="float32")))
        caller.start()
        try:
            decoder.wait_entered(1)
            server.stop()
            server._thread.join(0.5)
            assert server._thread.is_alive(), "the server left before answering the batch it runs"
        finally:
            decoder.step()
            caller.join(30)
        server._thread.join(5)
        assert not server._thread.is_alive(), "the server did not end once its batch was answered"
    np.testing.assert_allclose(out["pcm"], single_decode(sem, glb), atol=1e-5, rtol=0)


def test_second_server_under_a_live_name_is_refused(thread_server, shm_name):
    thread_server()
    with pytest.raises(ServerAlreadyRunningError, match="already serving"):
        DecoderServer(reference_model(), shm_name)


def test_sigterm_stops_the_server_and_unlinks_everything(shm_name):
    proc = subprocess.Popen(serve_command(shm_name), stderr=subprocess.PIPE, text=True)
    try:
        wait_until_serving(shm_name, proc=proc)
        assert leftover_objects(shm_name)
        with DecoderClient(shm_name) as client:
            assert client.decode([1, 2, 3], [0] * 32).shape == (960,)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert leftover_objects(shm_name) == []
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


def test_a_new_server_takes_over_a_dead_ones_segment(shm_name):
    proc = subprocess.Popen(serve_command(shm_name), stderr=subprocess.DEVNULL)
    try:
        wait_until_serving(shm_name, proc=proc)
        proc.kill()
        proc.wait()
        assert leftover_objects(shm_name)  # SIGKILL left the segment behind
        stale_epoch = int(read_header(shm_name)["server_epoch"])
        server = DecoderServer(reference_model(), shm_name)
        try:
            assert int(server.segment.header["server_epoch"]) != stale_epoch
        finally:
            server.close()
    finally:
        proc.kill()
        proc.wait()
    assert leftover_objects(shm_name) == []


def test_server_validates_its_options(shm_name):
    with pytest.raises(ValueError, match="max_batch"):
        DecoderServer(reference_model(), shm_name, max_batch=0)
    with pytest.raises(ValueError, match="invalid segment name"):
        DecoderServer(reference_model(), "bad/name")


def test_decoder_with_wrong_output_shape_fails_requests_not_the_server(thread_server, shm_name):
    class Short:
        device = torch.device("cpu")

        def detokenize(self, s, g, n):
            return torch.zeros(s.shape[0], 5)

    thread_server(Short())
    with DecoderClient(shm_name) as client:
        with pytest.raises(DecodeError, match="decoder returned shape"):
            client.decode([1, 2], [0] * 32)
        with pytest.raises(DecodeError):
            client.decode([1, 2], [0] * 32)


def test_max_wait_window_grows_the_batch_without_spinning(thread_server, shm_name):
    decoder = PoisonDecoder()
    thread_server(decoder, max_batch=4, max_wait_ms=1000, min_fill=0.0, batching="static")
    reqs = _requests(8, 3)
    with DecoderClient(shm_name, slots=3) as client:
        results = [None] * 3

        def run(i):
            time.sleep(0.1 * i)  # staggered arrivals, all inside the window
            results[i] = client.decode(*reqs[i], dtype="float32")

        cpu0, wall0 = time.process_time(), time.monotonic()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert decoder.calls == [3]  # one batch of all three
    assert wall >= 0.9  # the first request waited for the window
    # Decoding three tiny requests costs ~0.1 s of CPU; a spinning window would add ~0.8 s.
    assert cpu < 0.4, f"the server spun: {cpu:.2f} s CPU in {wall:.2f} s"
    for (sem, glb), pcm in zip(reqs, results):
        np.testing.assert_allclose(pcm, single_decode(sem, glb), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rejoin_ms", [0.0, 1000.0])
def test_a_client_just_answered_joins_the_next_batch_within_the_rejoin_window(
    thread_server, shm_name, rejoin_ms
):
    """A is answered; B's request is read by the server before A sends again. With a rejoin
    window the server waits for A and decodes both together; without one, B goes alone (the
    server plans B's batch from what it has read, without a second look)."""
    decoder = PoisonDecoder()
    server = thread_server(decoder, max_batch=4, lanes=1, rejoin_ms=rejoin_ms, max_wait_ms=0,
                           min_fill=0.0)  # fmt: skip
    log = ReadLog(server)
    reqs = _requests(9, 3)
    with DecoderClient(shm_name, slots=1) as a, DecoderClient(shm_name, slots=1) as b:
        results = [a.decode(*reqs[0], dtype="float32"), None, None]
        a_read = len(log)  # A's request was read; nothing else is in flight

        def run_b():
            results[1] = b.decode(*reqs[1], dtype="float32")

        thread = threading.Thread(target=run_b)
        thread.start()
        assert log.wait_read(since=a_read), "the server never read B's request"
        results[2] = a.decode(*reqs[2], dtype="float32")
        thread.join(30)
    assert decoder.calls == ([1, 2] if rejoin_ms else [1, 1, 1])
    for (sem, glb), pcm in zip(reqs, results):
        np.testing.assert_allclose(pcm, single_decode(sem, glb), atol=1e-5, rtol=0)


def test_a_ready_slot_is_read_only_after_its_own_req_post(thread_server, shm_name):
    """Finding 12: the doorbell alone never makes the server read a slot (aarch64 ordering)."""
    server = thread_server()
    rogue = _Rogue(shm_name)
    try:
        s, i = rogue.seg.slots, rogue.slot
        rogue.seg.tokens[i, :10] = 5
        rogue.seg.globals[i] = 5
        for k, v in dict(n_tokens=10, n_global=32, dtype=0, notify=NO_BELL, status=0,
                         req_generation=int(s["generation"][i]), request_seq=9).items():  # fmt: skip
            s[k][i] = v
        s["state"][i] = SlotState.READY
        rogue.seg.ready.release()  # the wake-up, but not req.I
        # Another client's request, sent after ours is READY: the server scans the whole table
        # before it answers it, so it has looked at our slot (and must have left it alone).
        with DecoderClient(shm_name) as client:
            sem, glb = _requests(12, 1)[0]
            np.testing.assert_allclose(client.decode(sem, glb, dtype="float32"), single_decode(sem, glb),
                                       atol=1e-5, rtol=0)  # fmt: skip
        assert s["state"][i] == SlotState.READY  # untouched
        rogue.seg.req(i).release()
        rogue.seg.done(i).acquire(10)
        assert s["state"][i] == SlotState.DONE and int(s["status"][i]) == Status.OK
        assert stats_from_header(server.segment.header)["requests"] == 2
    finally:
        rogue.close()


def test_the_models_output_is_never_changed_in_place(thread_server, shm_name):
    """Finding 14: the int16 conversion works on a tensor of the server's own."""

    class Fixed:
        device = torch.device("cpu")

        def __init__(self):
            self.out = torch.linspace(-2.0, 2.0, 320 * 4).repeat(1, 1)
            self.kept = self.out.clone()

        def detokenize(self, s, g, n):
            return self.out[:, : 320 * s.shape[1]]

    decoder = Fixed()
    thread_server(decoder)
    with DecoderClient(shm_name) as client:
        pcm = client.decode([1, 2, 3, 4], [0] * 32)
    assert torch.equal(decoder.out, decoder.kept)
    expected = (np.clip(decoder.kept.numpy()[0], -1, 1) * 32767).astype(np.int16)
    assert np.array_equal(pcm, expected)


class RowWise:
    """A decoder whose rows depend only on their own ids (and not on the batch): the server's
    single-row and batched paths must then give identical bytes."""

    device = torch.device("cpu")

    def detokenize(self, semantic_ids, global_ids, lengths):
        t = semantic_ids.shape[1]
        frames = torch.sin(semantic_ids.double() * 0.37 + global_ids.double().sum(1, keepdim=True))
        audio = frames.repeat_interleave(HOP, dim=1) * 1.3  # some samples past +-1: clipped
        audio *= (torch.arange(t * HOP) < lengths[:, None] * HOP)  # nothing past each length
        return audio.float()


def test_single_row_and_batched_paths_give_identical_bytes(thread_server, shm_name):
    decoder = RowWise()
    gate = threading.Event()
    original = decoder.detokenize
    decoder.detokenize = lambda *a: (gate.wait(30), original(*a))[1]
    server = thread_server(decoder, lanes=1, max_batch=16, max_batch_tokens=None, min_fill=0.0)
    reqs = _requests(30, 12, lo=3, hi=40)
    with DecoderClient(shm_name, slots=12) as client:
        gate.set()
        alone = [client.decode(s, g, dtype=d) for (s, g), d in zip(reqs, ["int16", "float32"] * 6)]
        gate.clear()
        results = [None] * len(reqs)

        def run(i):
            results[i] = client.decode(*reqs[i], dtype=["int16", "float32"][i % 2])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        try:
            wait_submitted(server.segment, len(reqs), server=server)  # all queued behind the gated batch
        finally:
            gate.set()
        for t in threads:
            t.join(30)
        batches = client.get_stats()["batch_size_histogram"]
    assert max(batches) > 1, batches  # some rows really went through the batched path
    for a, b in zip(alone, results):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("lanes", [2, 4])
def test_a_poisoned_row_fails_alone_with_several_lanes(thread_server, shm_name, lanes):
    decoder = GatedDecoder()
    server = thread_server(decoder, max_batch=8, min_fill=0.0, max_batch_tokens=None, lanes=lanes)
    reqs = _requests(33, 9)
    bad = (np.full(12, POISON), np.zeros(32, np.int64))
    with DecoderClient(shm_name, slots=10) as client:
        results = _decode_all_concurrently(client, reqs[:5] + [bad] + reqs[5:], dtype="float32",
                                           gate=decoder.gate, server=server)  # fmt: skip
    assert isinstance(results[5], DecodeError) and "poisoned input" in str(results[5])
    for (sem, glb), pcm in zip(reqs, results[:5] + results[6:]):
        assert isinstance(pcm, np.ndarray), pcm
        np.testing.assert_allclose(pcm, single_decode(sem, glb), atol=1e-5, rtol=0)


class _PipelinedServer(DecoderServer):
    """The CUDA lane's control flow (launch batch k, then publish batch k-1) on the CPU, where
    a launched batch's host copy is already complete: the ordering and the failure paths run,
    the device overlap does not."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pipeline = True


def test_the_pipelined_lane_gives_each_row_its_lone_decode_and_fails_a_poisoned_row_alone(shm_name):
    decoder = GatedDecoder()
    server = _PipelinedServer(decoder, shm_name, max_batch=3, min_fill=0.0, max_batch_tokens=None,
                              lanes=1)  # fmt: skip
    thread = server.start_thread()
    try:
        reqs = _requests(34, 10)
        bad = (np.full(12, POISON), np.zeros(32, np.int64))
        with DecoderClient(shm_name, slots=11) as client:
            results = _decode_all_concurrently(client, reqs[:4] + [bad] + reqs[4:], dtype="float32",
                                               gate=decoder.gate, server=server)  # fmt: skip
    finally:
        server.stop()
        thread.join(20)
    assert not thread.is_alive()
    assert len(decoder.calls) >= 4  # several batches went through launch-then-publish
    assert isinstance(results[4], DecodeError) and "poisoned input" in str(results[4])
    for (sem, glb), pcm in zip(reqs, results[:4] + results[5:]):
        assert isinstance(pcm, np.ndarray), pcm
        np.testing.assert_allclose(pcm, single_decode(sem, glb), atol=1e-5, rtol=0)
    assert leftover_objects(shm_name) == []


def test_reaping_never_touches_a_slot_a_lane_holds(thread_server, shm_name):
    """Clients killed mid-batch, lanes on: their slots stay BUSY (not reclaimed, not rewritten)
    until the lane has published, then come back with their generation bumped."""
    decoder = GatedDecoder()
    server = thread_server(decoder, lanes=2, reap_interval=0.05, min_fill=0.0)
    code = (
        "import threading, time; from bicodec_shm.client.decoder_client import DecoderClient; "
        f"c = DecoderClient({shm_name!r}, slots=4); "
        "[threading.Thread(target=c.decode, args=([3] * 30, [1] * 32), daemon=True).start() "
        "for _ in range(4)]; time.sleep(60)"
    )
    victim = subprocess.Popen([sys.executable, "-c", code])
    seg = server.segment
    try:
        deadline = time.monotonic() + 30
        while int((seg.slots["state"] == SlotState.BUSY).sum()) < 2:  # two lanes, gated
            assert time.monotonic() < deadline, seg.slots["state"]
            time.sleep(0.02)
        busy = (seg.slots["state"] == SlotState.BUSY).nonzero()[0].tolist()
        generations = seg.slots["generation"][busy].tolist()
        victim.kill()
        victim.wait()
        # A reaper pass now that the owner is dead (both lanes are gated, so the dispatcher
        # may not tick until the gate opens): the held slots are not its to take.
        server.reap()
        assert (seg.slots["state"][busy] == SlotState.BUSY).all()
        assert seg.slots["generation"][busy].tolist() == generations
        decoder.gate.set()
        deadline = time.monotonic() + 2
        while (seg.slots["state"] != SlotState.FREE).any():
            assert time.monotonic() < deadline, seg.slots["state"]
            time.sleep(0.02)
        assert (seg.slots["generation"][busy] == np.array(generations) + 1).all()
    finally:
        decoder.gate.set()
        victim.kill()
        victim.wait()
    with DecoderClient(shm_name) as client:
        sem, glb = _requests(34, 1)[0]
        np.testing.assert_allclose(client.decode(sem, glb, dtype="float32"), single_decode(sem, glb),
                                   atol=1e-5, rtol=0)  # fmt: skip


class _PairFailsRowsWait:
    """The tiny model, except that a batch of more than one row fails (so it is split and its
    rows retried one by one), and a row whose length is in ``gates`` waits until the test
    opens that gate (``entered[length]`` is set when it starts waiting)."""

    def __init__(self, lengths) -> None:
        self.model = reference_model()
        self.device, self.config = self.model.device, self.model.config
        self.gates = {n: threading.Event() for n in lengths}
        self.entered = {n: threading.Event() for n in lengths}
        self.calls: list[list[int]] = []  # the lengths of every batch, in order

    def detokenize(self, semantic_ids, global_ids, lengths):
        self.calls.append(lengths.tolist())
        if semantic_ids.shape[0] > 1:
            raise RuntimeError("simulated out of memory for a batch of two")
        n = int(lengths[0])
        if n in self.gates:
            self.entered[n].set()
            if not self.gates[n].wait(60):
                raise RuntimeError(f"the row of length {n} was never let through")
        return self.model.detokenize(semantic_ids, global_ids, lengths)

    def open_all(self) -> None:
        for gate in self.gates.values():
            gate.set()


def test_a_lane_finishing_a_split_batch_never_unholds_a_slot_another_lane_holds(thread_server, shm_name):
    """A lane's finish once took its batch's slots out of the held set a second time, after
    each row had been answered. A batch [A, B] fails and is split: A is answered, A's client
    sends its next request in the same slot, and the other lane holds it in a new batch while
    this lane still decodes B. When this lane finished, the slot left the held set under the
    other lane's batch: once A's client let go of it, the reaper freed it, and that batch then
    wrote its answer over whatever the slot's next owner had sent. The slot must stay held
    (and unreaped) until the batch that holds it has published.

    Forced step by step: two free CPU lanes would share A and B out one each, so the first
    lane is kept busy with a request W at a gate while the second one waits for A and B and
    takes them as one batch; W's lane is freed before A is answered, to take A's next request."""
    decoder = _PairFailsRowsWait([50, 40, 30, 20])
    server = thread_server(decoder, lanes=2, slots=3, max_batch=2, max_wait_ms=0, rejoin_ms=0, min_fill=0.0,
                           max_batch_tokens=None, batching="static", reap_interval=0.05)  # fmt: skip
    seg = server.segment
    rng = np.random.default_rng(55)
    req_w, req_a, req_b, req_next = ((rng.integers(0, 8192, n), rng.integers(0, 4096, 32))
                                     for n in (50, 40, 30, 20))  # fmt: skip
    out: dict = {}
    with contextlib.ExitStack() as clients:
        a, b, w = (clients.enter_context(DecoderClient(shm_name, slots=1, timeout=30)) for _ in range(3))

        def client_w() -> None:
            out["w"] = w.decode(*req_w, dtype="float32")

        def client_a() -> None:
            out["a"] = a.decode(*req_a, dtype="float32")
            try:
                a.decode(*req_next, timeout=4)  # held by the other lane: it times out, lets go
            except DecodeTimeoutError as exc:
                out["next"] = exc

        def client_b() -> None:
            out["b"] = b.decode(*req_b, dtype="float32")

        threads = [threading.Thread(target=f) for f in (client_w, client_a, client_b)]
        try:
            threads[0].start()
            assert decoder.entered[50].wait(30)  # W holds one lane at its gate
            server.max_wait_ms = 10_000  # the other lane waits for both A and B: a batch of two
            threads[1].start()
            threads[2].start()
            # The pair went to the free lane, failed, and its first half (A) waits at the gate.
            assert decoder.entered[40].wait(30)
            assert decoder.calls[:3] == [[50], [40, 30], [40]], decoder.calls
            server.max_wait_ms = 0  # from now on a lane takes whatever is ready at once
            decoder.gates[50].set()  # W's lane publishes W and is free again
            threads[0].join(30)
            assert "w" in out
            decoder.gates[40].set()  # A is answered; A's next request goes to W's lane
            assert decoder.entered[20].wait(30)
            (slot,) = a._att.owned
            held_by_b = next(iter(b._att.owned))
            assert slot != held_by_b and seg.slots["state"][slot] == SlotState.BUSY
            decoder.gates[30].set()  # the pair's lane decodes B, publishes it and finishes
            wait_for(lambda: "b" in out and int(seg.header["busy_lanes"]) == 1, 30,
                     "the pair's lane to finish")  # fmt: skip
            still_held = slot in server._held
            generation = int(seg.slots["generation"][slot])
            threads[1].join(30)  # A's client timed out and let go of the slot
            assert isinstance(out.get("next"), DecodeTimeoutError), out.get("next")
            server.reap()
            time.sleep(0.2)  # and the dispatcher's own reaper ticks (every 50 ms)
            assert seg.slots["state"][slot] == SlotState.BUSY, "a held slot was reaped under its batch"
            assert int(seg.slots["generation"][slot]) == generation
            assert still_held, "the finished lane un-held a slot another lane holds"
        finally:
            decoder.open_all()
            for t in threads:
                if t.ident is not None:
                    t.join(30)
    np.testing.assert_allclose(out["w"], single_decode(*req_w), atol=1e-5, rtol=0)
    np.testing.assert_allclose(out["a"], single_decode(*req_a), atol=1e-5, rtol=0)
    np.testing.assert_allclose(out["b"], single_decode(*req_b), atol=1e-5, rtol=0)
    # Once the holding batch has published, the slot comes back (reaped: its client let go).
    wait_for(lambda: (seg.slots["state"] == SlotState.FREE).all(), 10, "the slots to come back")
