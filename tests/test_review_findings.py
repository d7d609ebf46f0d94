"""The second adversarial review: one test per finding, named after what it proves.

Each reproduces the finding's situation with real shared memory (and real processes where the
finding needs them) and checks the outcome against the request's own lone decode.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import posix_ipc
import pytest
from conftest import ROOT, serve_command, wait_until_serving
from support import (
    GatedDecoder,
    ReadLog,
    plant_ready,
    reference_model,
    seed_int16,
    seeded_request,
    single_decode,
    wait_for,
    wait_submitted,
)

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import (
    BiCodecShmError,
    ClientClosedError,
    SegmentError,
    ServerAlreadyRunningError,
    ServerUnavailableError,
)
from bicodec_shm.protocol import locks, names, segment
from bicodec_shm.protocol.group import totals
from bicodec_shm.protocol.layout import FREE_BELL_CAP, READY, Phase, SlotState
from bicodec_shm.protocol.names import leftover_objects, random_name, remove_dead, reserve_name, unlink_all
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.server.server import DecoderServer


def _lone(req) -> np.ndarray:
    return single_decode(*req)


class _RingGate(DecoderServer):
    """A server that stops between writing an answer (DONE) and posting it, until opened."""

    def __init__(self, *args, **kwargs) -> None:
        self.ring_gate = threading.Event()
        self.at_ring = threading.Event()
        super().__init__(*args, **kwargs)

    def _release_and_ring(self, slots, bells, *moved) -> None:
        self.at_ring.set()
        self.ring_gate.wait(30)
        super()._release_and_ring(slots, bells, *moved)


def _start(server: DecoderServer) -> threading.Thread:
    thread = server.start_thread()
    return thread


def _stop(server: DecoderServer, thread: threading.Thread) -> None:
    server.stop()
    thread.join(30)
    assert not thread.is_alive()


# -- 1 -------------------------------------------------------------------------------------------


def test_1_closing_with_an_answer_written_but_not_posted_never_delivers_it_to_the_next_owner(shm_name):
    server = _RingGate(reference_model(), shm_name, slots=1, lanes=1, reap_interval=0.05)
    thread = _start(server)
    try:
        req_a, req_b = seeded_request(1, 30), seeded_request(2, 30)
        a = DecoderClient(shm_name, slots=1)
        failed = []
        t = threading.Thread(target=lambda: failed.append(_raises(lambda: a.decode(*req_a))))
        t.start()
        assert server.at_ring.wait(30)  # A's answer is DONE in the slot, its post not yet made
        a.close()  # the old rule freed the DONE slot here
        assert server.segment.slots["state"][0] == SlotState.DONE  # left to the reaper
        t.join(10)
        assert failed == [ClientClosedError]
        with DecoderClient(shm_name, slots=1, timeout=20) as b:
            got = []
            tb = threading.Thread(target=lambda: got.append(b.decode(*req_b, dtype="float32")))
            tb.start()
            # B waits for the slot. The one lane is held at the ring, so the dispatcher does not
            # tick: a reaper pass here stands for any that could run before the post. It must
            # leave the DONE slot alone (its owner is gone, but its post is still to come).
            server.reap()
            assert server.segment.slots["state"][0] == SlotState.DONE
            assert not got
            server.ring_gate.set()  # A's post goes out; then the slot is freed and B gets it
            tb.join(20)
        np.testing.assert_allclose(got[0], _lone(req_b), atol=1e-5, rtol=0)  # B's own audio
    finally:
        server.ring_gate.set()
        _stop(server, thread)


def test_1_an_answer_is_taken_only_if_it_names_the_handle_the_claim_and_the_request(thread_server, shm_name):
    """The identity rule alone (close() above never gets this far): the right sequence number
    is not enough; the handle and the slot's claim epoch must match too."""
    thread_server()
    with DecoderClient(shm_name, slots=1) as client:
        client.decode([1, 2, 3], [0] * 32)
        att = client._att
        slot, seq = att.take_slot(time.monotonic() + 5)
        try:
            seg = att.segment
            ids = [att.handle_id, att.generation[slot], seq]
            seg.result_id[slot] = ids
            seg.field["state"][slot] = SlotState.DONE  # as the server answers: identity, then DONE
            assert att.is_answer(seg, slot, seq)
            for k in range(3):  # another handle, an earlier claim, another request
                seg.result_id[slot] = [v + (k == i) for i, v in enumerate(ids)]
                assert not att.is_answer(seg, slot, seq), k
        finally:
            seg.field["state"][slot] = SlotState.CLAIMED  # as a client takes an answer
            att.give(slot, seq)


def _raises(call):
    try:
        call()
    except BaseException as exc:  # noqa: BLE001
        return type(exc)
    return None


# -- 2, S6 ---------------------------------------------------------------------------------------


def test_2_a_garbage_submit_time_fails_nobody_and_is_clamped(shm_name):
    decoder = GatedDecoder()
    server = DecoderServer(decoder, shm_name, slots=8, lanes=1, max_batch=8, min_fill=0.0)
    thread = _start(server)
    try:
        reqs = [seeded_request(10 + i, 20 + i) for i in range(4)]
        clients = [DecoderClient(shm_name, slots=1, timeout=30) for _ in reqs]
        results: dict[int, np.ndarray] = {}

        def run(i):
            results[i] = clients[i].decode(*reqs[i], dtype="float32")

        first = threading.Thread(target=run, args=(0,))
        first.start()
        wait_for(lambda: int(server.segment.header["busy_lanes"]) == 1)  # the lane is gated
        rest = [threading.Thread(target=run, args=(i,)) for i in (1, 2, 3)]
        for t in rest:
            t.start()
        seg = server.segment
        wait_for(lambda: int((seg.slots["state"] == READY).sum()) == 3)
        # One client writes garbage into its own field (a bug, or hostile): the largest value.
        garbage = int(np.flatnonzero(seg.slots["state"] == READY)[0])
        seg.slots["t_submit_ns"][garbage] = np.uint64(2**64 - 1)
        decoder.gate.set()
        for t in (first, *rest):
            t.join(30)
        for i, req in enumerate(reqs):
            np.testing.assert_allclose(results[i], _lone(req), atol=1e-5, rtol=0)
        stats = clients[0].get_stats()
        assert stats["requests"] == 4 and stats["failed"] == 0  # every batch was counted
        assert stats["avg_latency_ms"] < 60_000  # the garbage never reached the sums
        for c in clients:
            c.close()
    finally:
        decoder.gate.set()
        _stop(server, thread)


def test_s6_batch_order_and_queue_times_never_trust_a_client_written_time():
    from bicodec_shm.protocol.slot_io import TRUSTED_QUEUE_NS, check_headers

    name = random_name("bcshm-test")
    seg = Segment.create(name, n_slots=3, max_tokens=10)
    try:
        seg.start_serving()
        for slot, t in ((0, 0), (1, 2**64 - 1), (2, time.monotonic_ns())):
            plant_ready(seg, slot, t_submit_ns=t)
        seen = np.full(3, time.monotonic_ns(), np.int64)
        req, failures = check_headers(seg, np.arange(3), seen, n_bells=3)
        assert not failures and len(req) == 3
        assert (req.submitted_ns <= seen).all() and (req.submitted_ns >= seen - TRUSTED_QUEUE_NS).all()
        assert req.seen_ns.tolist() == seen.tolist()  # what the batch order is keyed on
        for slot in range(3):  # one slot alone takes the scalar path (_check_one): the same rule
            one, failures = check_headers(seg, np.array([slot]), seen[:1], n_bells=3)
            assert not failures and len(one) == 1
            assert seen[0] - TRUSTED_QUEUE_NS <= int(one.submitted_ns[0]) <= seen[0]
    finally:
        seg.stop_serving()
        seg.unlink()
        seg.close()


# -- 3, 4 ----------------------------------------------------------------------------------------


class _SoftTimeLimit(Exception):
    """Like Celery's SoftTimeLimitExceeded: raised by a signal handler."""


@pytest.mark.parametrize("raised", [KeyboardInterrupt, _SoftTimeLimit])
def test_3_4_an_exception_from_a_signal_handler_reaches_the_caller_and_frees_the_slot(shm_name, raised):
    decoder = GatedDecoder()
    server = DecoderServer(decoder, shm_name, slots=2, lanes=1, reap_interval=0.05)
    thread = _start(server)

    def handler(signum, frame):
        raise raised("from the handler")

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        with DecoderClient(shm_name, slots=1, timeout=30) as client:
            for _ in range(3):  # with slots=1 a leaked slot would wedge the second round
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                t0 = time.monotonic()
                with pytest.raises(raised):
                    client.decode(*seeded_request(3, 20))
                assert time.monotonic() - t0 < 5  # not the call's own 30 s timeout
                assert client._att.using == {}  # the slot is not kept out of use
            decoder.gate.set()
            req = seeded_request(4, 25)
            np.testing.assert_allclose(client.decode(*req, dtype="float32"), _lone(req), atol=1e-5, rtol=0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        decoder.gate.set()
        _stop(server, thread)


# -- 5, 8 ----------------------------------------------------------------------------------------


def test_5_a_server_restarted_with_a_smaller_max_tokens_gets_a_clear_error_not_a_leak(shm_name):
    server = DecoderServer(reference_model(), shm_name, slots=2, max_tokens=100)
    thread = _start(server)
    long_req, short_req = seeded_request(5, 80), seeded_request(6, 40)
    with DecoderClient(shm_name, slots=1, timeout=30) as client:
        client.decode(*long_req)
        _stop(server, thread)
        server = DecoderServer(reference_model(), shm_name, slots=2, max_tokens=50)
        thread = _start(server)
        try:
            with pytest.raises(ValueError, match="80 ids, more than the 50"):
                client.decode(*long_req)
            assert client._att.using == {}
            np.testing.assert_allclose(client.decode(*short_req, dtype="float32"), _lone(short_req),
                                       atol=1e-5, rtol=0)  # fmt: skip
        finally:
            _stop(server, thread)


# -- 6 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o600, 0o660])  # a named segment, and one handed over NAME.sock
def test_6_a_successor_waits_for_a_server_that_finishes_its_batch(shm_name, mode):
    decoder = GatedDecoder()
    old = DecoderServer(decoder, shm_name, slots=2, lanes=1, mode=mode)
    old_thread = _start(old)
    req = seeded_request(7, 20)
    new = None
    try:
        with DecoderClient(shm_name, slots=1, timeout=30) as client:
            got = []
            t = threading.Thread(target=lambda: got.append(client.decode(*req, dtype="float32")))
            t.start()
            wait_for(lambda: int(old.segment.header["busy_lanes"]) == 1)
            old.stop()  # SIGTERM: it still serves the batch it holds
            threading.Timer(1.0, decoder.gate.set).start()
            # It waits, not refused: under 0o660 it reads the old server's phase in NAME's own object.
            new = DecoderServer(reference_model(), shm_name, slots=2, start_wait=20, mode=mode)
            new.start_thread()
            old_thread.join(20)
            t.join(20)
            np.testing.assert_allclose(got[0], _lone(req), atol=1e-5, rtol=0)
    finally:
        decoder.gate.set()
        old_thread.join(20)
        if new is not None:
            new.close()


def test_6_serve_started_while_the_old_server_finishes_its_batch_takes_over(shm_name, tmp_path):
    """The README's rolling restart through the CLI: SIGTERM (here: stop()) and a new `serve` at
    once, while a batch is still running for 7 s. The new one must wait, not exit."""
    decoder = GatedDecoder()
    old = DecoderServer(decoder, shm_name, slots=2, lanes=1)
    old_thread = _start(old)
    req = seeded_request(12, 20)
    log = open(tmp_path / "serve.log", "wb")
    new = None
    try:
        with DecoderClient(shm_name, slots=1, timeout=60) as client:
            got = []
            t = threading.Thread(target=lambda: got.append(client.decode(*req)))
            t.start()
            wait_for(lambda: int(old.segment.header["busy_lanes"]) == 1)
            old.stop()
            new = subprocess.Popen(serve_command(shm_name), cwd=ROOT, stderr=log)
            threading.Timer(7.0, decoder.gate.set).start()  # past the CLI's 5 s grace
            wait_until_serving(shm_name, timeout=60, proc=new)  # raises if `serve` exited
            t.join(30)
            assert np.abs(got[0].astype(np.int32) - seed_int16(_lone(req))).max() <= 1
            assert client.decode(*req).shape == got[0].shape  # and the new server answers
    finally:
        decoder.gate.set()
        old_thread.join(20)
        if new is not None:
            from bicodec_shm.deploy import processes

            processes.stop_server(new, timeout=30)
        log.close()


def test_6_a_successor_is_still_refused_by_a_server_that_is_not_stopping(shm_name):
    server = DecoderServer(reference_model(), shm_name, slots=1)
    thread = _start(server)
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerAlreadyRunningError, match="already serving"):
            DecoderServer(reference_model(), shm_name, slots=1, start_wait=20)
        assert time.monotonic() - t0 < 5
    finally:
        _stop(server, thread)


# -- 7, 8 ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_7_8_a_group_handle_follows_the_name_to_a_single_server_with_other_limits(shm_name, tmp_path):
    from bicodec_shm.deploy import processes
    from bicodec_shm.protocol.group import member_names

    log = open(tmp_path / "serve.log", "ab")
    group = subprocess.Popen(serve_command(shm_name, "--device", "cpu,cpu", "--slots", "4",
                                           "--max-tokens", "100"), cwd=ROOT, stderr=log)  # fmt: skip
    single = None
    try:
        wait_until_serving(shm_name, timeout=120, proc=group)
        long_req, short_req = seeded_request(8, 80), seeded_request(9, 30)
        with DecoderClient(shm_name, slots=1, timeout=60) as client:
            assert client._group is not None
            client.decode(*long_req)
            processes.stop_server(group, timeout=60)
            single = subprocess.Popen(serve_command(shm_name, "--max-tokens", "50"), cwd=ROOT, stderr=log)
            wait_until_serving(shm_name, timeout=120, proc=single)
            pcm = client.decode(*short_req)  # re-reads the name: a single server now
            assert np.abs(pcm.astype(np.int32) - seed_int16(_lone(short_req))).max() <= 1
            assert client._group is None
            with pytest.raises(ValueError, match="more than the 50"):  # the new server's limit
                client.decode(*long_req)
    finally:
        for proc in (group, single):
            if proc is not None:
                processes.stop_server(proc, timeout=60)
        log.close()
        for n in member_names(shm_name, 2):
            unlink_all(n)


# -- 9 -------------------------------------------------------------------------------------------


def _fds_holding_ofd_locks() -> list[str]:
    """This process's descriptors through which an OFD lock is held (/proc/self/fdinfo lists
    the locks of each descriptor's open file description)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                if "OFDLCK" in f.read():
                    found.append(fd)
        except OSError:
            pass
    return found


def test_9_a_fork_during_attach_never_copies_a_lock_descriptor_into_the_child(shm_name):
    import warnings

    server = DecoderServer(reference_model(), shm_name, slots=4)
    thread = _start(server)
    stop = threading.Event()

    def attach_and_close():
        while not stop.is_set():
            DecoderClient(shm_name, slots=1).close()

    attacher = threading.Thread(target=attach_and_close)
    attacher.start()
    try:
        for _ in range(40):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                os._exit(1 if _fds_holding_ofd_locks() or locks._lock_fds else 0)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, "the child holds a lock descriptor"
    finally:
        stop.set()
        attacher.join(10)
        _stop(server, thread)


# -- 10, S8 --------------------------------------------------------------------------------------

_DROPIN = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from support import reference_model
from bicodec_shm import BiCodecBatchDecoder
d = BiCodecBatchDecoder(reference_model())
d.start()
print(d.name, flush=True)
how = sys.argv[1]
if how == "fork":
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # the child exits normally: finalizers and atexit run in it
    os.waitpid(pid, 0)
    import asyncio
    print(len(asyncio.run(d.decode_async([1, 2, 3], [0] * 32))), flush=True)
    d.stop()
else:
    os.kill(os.getpid(), getattr(signal, how))
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_10_a_signalled_drop_in_leaves_objects_that_the_next_drop_in_removes(how):
    script = _DROPIN.format(tests=os.path.join(ROOT, "tests"))
    out = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=120)
    name = out.stdout.split()[0]
    assert out.returncode == -getattr(signal, how)
    try:
        assert leftover_objects(name)  # nothing ran at its death
        again = subprocess.run([sys.executable, "-c", script.replace("how = sys.argv[1]", "how = 'fork'"),
                                "fork"], capture_output=True, text=True, timeout=120)  # fmt: skip
        assert again.returncode == 0, again.stderr
        assert leftover_objects(name) == []  # swept by the next private server
        assert leftover_objects(again.stdout.split()[0]) == []
    finally:
        unlink_all(name)


def test_s8_a_forked_child_of_a_drop_in_exits_quietly_and_leaves_the_parents_server_alone():
    script = _DROPIN.format(tests=os.path.join(ROOT, "tests"))
    out = subprocess.run([sys.executable, "-c", script, "fork"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout.split()[1] == str(3 * 320 * 2)  # the parent decoded after its child exited


# -- 11 ------------------------------------------------------------------------------------------


def test_11_idle_handles_do_not_keep_a_new_worker_out(shm_name):
    server = DecoderServer(reference_model(), shm_name, slots=2, reap_interval=0.1)
    thread = _start(server)
    try:
        idle = [DecoderClient(shm_name, slots=1) for _ in range(2)]
        for c in idle:
            c.decode([1, 2, 3], [0] * 32)  # each keeps a warm slot, then goes idle
        req = seeded_request(11, 10)
        with DecoderClient(shm_name, slots=1, timeout=5) as late:
            pcm = late.decode(*req, dtype="float32")  # waits for a slot, never refused
        np.testing.assert_allclose(pcm, _lone(req), atol=1e-5, rtol=0)
        for c in idle:  # and the idle ones still work afterwards
            assert c.decode([4, 5], [1] * 32).shape == (640,)
            c.close()
    finally:
        _stop(server, thread)


# -- 12 ------------------------------------------------------------------------------------------


def test_12_the_free_doorbell_stays_bounded_and_never_raises(shm_name):
    server = DecoderServer(reference_model(), shm_name, slots=4)
    thread = _start(server)
    try:
        seg = server.segment
        for _ in range(3 * FREE_BELL_CAP):
            with DecoderClient(shm_name, slots=2) as c:
                c.decode([1], [0] * 32)
        for _ in range(10 * FREE_BELL_CAP):
            seg.ring_free()
        assert seg.free.value <= FREE_BELL_CAP
    finally:
        _stop(server, thread)


# -- 13 ------------------------------------------------------------------------------------------


def test_13_a_semaphore_name_taken_by_someone_else_is_refused_clearly_and_ours_cleaned_up(
        shm_name, monkeypatch):
    foreign = posix_ipc.Semaphore(f"/{shm_name}.done.1", posix_ipc.O_CREX, 0o600, 0)
    try:
        # What /dev/shm's sticky bit does for another user's object: our unlink cannot remove it.
        monkeypatch.setattr(segment, "_unlink_semaphores", lambda name: 0)
        with pytest.raises(SegmentError, match=rf"sem\.{shm_name}\.done\.1 .*already exists"):
            Segment.create(shm_name, n_slots=2, max_tokens=10)
        assert leftover_objects(shm_name) == [f"sem.{shm_name}.done.1"]  # only the foreign one
    finally:
        foreign.unlink()
        foreign.close()


# -- 14 ------------------------------------------------------------------------------------------


def test_14_an_answered_client_s_next_request_is_not_left_for_the_reaper_tick(shm_name):
    server = DecoderServer(reference_model(), shm_name, slots=4, lanes=2, reap_interval=5.0, rejoin_ms=0)
    thread = _start(server)
    try:
        with DecoderClient(shm_name, slots=1) as client:
            client.decode([1, 2], [0] * 32)
            t0 = time.monotonic()
            for i in range(20):
                client.decode([1 + i, 2], [0] * 32)
            # A lost wake-up waits for the reaper's tick (5 s); twenty tiny decodes take ~0.1 s.
            assert time.monotonic() - t0 < 5.0
    finally:
        _stop(server, thread)


def test_14_a_request_sent_while_its_answer_is_being_rung_is_not_skipped(shm_name, monkeypatch):
    """The race made deterministic: the lane's post goes out, the client sends its next request
    at once and the other lane (the dispatcher) scans for it, all before the lane returns from
    ringing. The slot must no longer count as held by then, or the request waits for the
    reaper's tick (5 s here)."""
    import bicodec_shm.server.server as server_module

    real_ring = server_module.ring
    reads = []  # the server's ReadLog, once it exists

    def slow_ring(seg, slots, bells):
        since = len(reads[0])
        real_ring(seg, slots, bells)
        # The client resubmits and the other lane (the dispatcher) scans and reads the request.
        # With the slot still held, it is never read: after 1 s the lane goes on, and the
        # request waits for the reaper's tick (the assertion below).
        reads[0].wait_read(slots, since=since, timeout=1.0)

    monkeypatch.setattr(server_module, "ring", slow_ring)
    server = DecoderServer(reference_model(), shm_name, slots=4, lanes=2, reap_interval=5.0, rejoin_ms=0)
    reads.append(ReadLog(server))
    thread = _start(server)
    try:
        with DecoderClient(shm_name, slots=1) as client:
            client.decode([1, 2], [0] * 32)
            for i in range(3):
                t0 = time.monotonic()
                client.decode([3 + i, 2], [0] * 32)
                assert time.monotonic() - t0 < 2.0, "the request waited for the reaper's tick"
    finally:
        _stop(server, thread)


# -- 15 ------------------------------------------------------------------------------------------


def test_15_group_totals_count_only_members_that_serve():
    member = {"requests": 5, "batches": 2, "failed": 0, "reclaimed": 0, "idle_slots_expired": 1, "tokens": 50,
              "padded_tokens": 60, "slots": 4, "max_tokens": 100, "batch_size_histogram": {2: 2},
              "avg_batch_time_ms": 1.0, "avg_queue_wait_ms": 1.0, "avg_latency_ms": 2.0,
              "completed": 5}  # fmt: skip
    up = totals([member | {"server_alive": True}, member | {"server_alive": False}])
    assert up["members_up"] == 1 and up["requests"] == 5 and up["slots"] == 4
    assert up["idle_slots_expired"] == 1 and up["reclaimed"] == 0


# -- S2, S7 --------------------------------------------------------------------------------------


def test_s2_cleanup_never_removes_a_name_someone_owns(shm_name):
    fd = reserve_name(shm_name)  # a server that is loading its model
    try:
        with pytest.raises(ServerAlreadyRunningError):
            remove_dead(shm_name)
        assert leftover_objects(shm_name) == [shm_name]
    finally:
        names.release_name(fd, shm_name)
    assert leftover_objects(shm_name) == []


def test_s7_an_object_of_zeros_is_not_taken_over(shm_name):
    with open(f"/dev/shm/{shm_name}", "wb") as f:
        f.write(bytes(4096))
    with pytest.raises(SegmentError, match="not a bicodec-shm segment"):
        Segment.create(shm_name, n_slots=1, max_tokens=10)
    assert os.path.getsize(f"/dev/shm/{shm_name}") == 4096  # left where it was
    os.unlink(f"/dev/shm/{shm_name}")


# -- S3, S9 --------------------------------------------------------------------------------------


def test_s3_close_during_calls_that_are_attaching_leaves_no_attachment_behind(shm_name):
    server = DecoderServer(reference_model(), shm_name, slots=8)
    thread = _start(server)
    baseline = len(locks._lock_fds)  # the server's own
    try:
        for _ in range(10):
            client = DecoderClient(shm_name, slots=4, timeout=10)
            client._att.retire(BiCodecShmError("dropped"))  # every call must attach anew
            callers = [threading.Thread(target=_raises, args=(lambda c=client: c.decode([1, 2], [0] * 32),))
                       for _ in range(6)]  # fmt: skip
            for t in callers:
                t.start()
            client.close()
            for t in callers:
                t.join(10)
            assert client._att is None
            wait_for(lambda: len(locks._lock_fds) == baseline, 5)  # every attachment closed
    finally:
        _stop(server, thread)


def test_s9_close_while_a_users_thread_runs_serve_forever_waits_for_it(shm_name):
    server = DecoderServer(reference_model(), shm_name, slots=2)
    user = threading.Thread(target=server.serve_forever)  # not start_thread(): the user's own
    user.start()
    with DecoderClient(shm_name) as client:
        assert client.decode([1, 2], [0] * 32).shape == (640,)
    server.close()
    assert not user.is_alive()
    assert leftover_objects(shm_name) == []


# -- S4, and issue 18's fail-fast ------------------------------------------------------------------


def test_s4_a_second_sigterm_during_the_stop_still_unlinks_everything(shm_name):
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "slow_server.py"), shm_name, "1.0"],
                            cwd=ROOT, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_until_serving(shm_name, proc=proc)
        with DecoderClient(shm_name, timeout=10) as client:
            t = threading.Thread(target=_raises, args=(lambda: client.decode([1, 2], [0] * 32),))
            t.start()
            header = client._att.segment.header
            wait_for(lambda: int(header["busy_lanes"]) == 1, what="a running batch")  # of 1 s
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: int(header["phase"]) == Phase.STOPPING, what="the first SIGTERM handled")
            proc.send_signal(signal.SIGTERM)  # forces the stop
            assert proc.wait(20) == 0
            t.join(15)
        assert leftover_objects(shm_name) == []
    finally:
        proc.kill()
        proc.wait()


def test_queued_requests_fail_fast_once_the_server_stopped_with_no_successor(shm_name):
    decoder = GatedDecoder()
    server = DecoderServer(decoder, shm_name, slots=8, lanes=1)
    thread = _start(server)
    with DecoderClient(shm_name, slots=4, timeout=30) as client:

        async def run():
            first = asyncio.ensure_future(client.decode_async([1, 2, 9], [0] * 32))
            await asyncio.to_thread(wait_for, lambda: int(server.segment.header["busy_lanes"]) == 1)
            queued = [asyncio.ensure_future(client.decode_async([1, 2, i], [0] * 32)) for i in range(3)]
            ready = lambda: int((server.segment.slots["state"] == READY).sum()) == 3  # noqa: E731
            await asyncio.to_thread(wait_for, ready)
            t0 = time.monotonic()
            server.stop()  # SIGTERM with no successor: the running batch is finished ...
            decoder.gate.set()
            outcomes = await asyncio.gather(first, *queued, return_exceptions=True)
            return outcomes, time.monotonic() - t0

        outcomes, elapsed = asyncio.run(run())
        thread.join(20)
    assert isinstance(outcomes[0], np.ndarray)  # ... and answered
    queued = outcomes[1:]
    assert all(isinstance(o, ServerUnavailableError) for o in queued), outcomes
    assert all("stopped" in str(o) for o in queued)
    assert elapsed < 15  # the 5 s grace, not the 30 s timeout


def test_async_calls_across_a_restart_leave_nothing_in_the_users_log(shm_name):
    """Issue 18: "Future exception was never retrieved ... Gone" after a decoder restart. Every
    future the client makes is awaited, cancelled, or has its exception retrieved."""
    import gc

    decoder = GatedDecoder()
    server = DecoderServer(decoder, shm_name, slots=8, lanes=1)
    thread = _start(server)
    logged = []
    reqs = [seeded_request(40 + i, 10 + i) for i in range(24)]
    try:
        with DecoderClient(shm_name, slots=8, timeout=60) as client:

            async def run():
                asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: logged.append(ctx))
                tasks = [asyncio.ensure_future(client.decode_async(*r, dtype="float32")) for r in reqs]
                # Under load: a batch in the gated decoder, all eight slots submitted, sixteen
                # calls waiting for a slot.
                await asyncio.to_thread(wait_submitted, server.segment, 8, server=server)
                server.stop()  # the decoder restarts under load: the running batch is answered,
                decoder.gate.set()  # the queued ones are resubmitted to the new server
                await asyncio.to_thread(_stop, server, thread)
                new = DecoderServer(reference_model(), shm_name, slots=8, lanes=1)
                new.start_thread()
                results = await asyncio.gather(*tasks)
                gc.collect()
                await asyncio.sleep(0.2)
                return new, results

            new, results = asyncio.run(run())
        for req, pcm in zip(reqs, results):
            np.testing.assert_allclose(pcm, _lone(req), atol=1e-5, rtol=0)
        gc.collect()
        assert logged == []
    finally:
        if "new" in locals():
            new.close()
        else:
            _stop(server, thread)
