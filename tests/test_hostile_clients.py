"""A buggy or hostile client harms only its own requests.

Every client of the server's user, and with ``--mode 0o660`` every member of its group, may
open the server's semaphores and write its segment. These tests play such a client, in a real
process, against a real server and well-behaved client processes, and check that the others
get every answer right and on time:

- a flood of posts on the server's doorbell and on clients' semaphores, faster than anyone can
  take them (a drain that ran until the semaphore was empty never ended: every request timed
  out, also after the flood);
- a slot freed by its client while the server decodes it, then claimed by another client (the
  late answer overwrote that client's request, which was never answered);
- random bytes on the header and on the slots the scribbler owns, any state at any moment, and
  posts on any semaphore.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import posix_ipc
import pytest
from support import TESTS, SteppedDecoder, seeded_request, single_decode, wait_for

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import SegmentError
from bicodec_shm.protocol.header import read_header, stats_from_header
from bicodec_shm.protocol.layout import FREE, NO_BELL, READY, SlotState
from bicodec_shm.protocol.posts import DRAIN_MOST, drain, post
from bicodec_shm.protocol.segment import Segment

HONEST = os.path.join(TESTS, "honest_client.py")
FLOODER = os.path.join(TESTS, "post_flooder.py")
SCRIBBLER = os.path.join(TESTS, "scribbler.py")
# Seconds each honest request may take while a hostile client runs (one takes ~20 ms alone;
# the hostile one keeps a core busy on a machine shared with other work).
ON_TIME = 30.0
SLOTS = 8


@contextlib.contextmanager
def _honest_clients(name: str, tmp_path: Path, seeds: range, n: int):
    """Start one honest client process per seed; yields ``go()`` once each has attached (and
    decoded a first request), which lets them decode ``n`` requests each and checks that every
    answer is its request's lone decode and came within ``ON_TIME``."""
    procs, outs = [], []
    try:
        for seed in seeds:
            out = str(tmp_path / f"honest-{seed}.npz")
            procs.append(subprocess.Popen([sys.executable, HONEST, name, str(seed), str(n), out,
                                           "--timeout", str(ON_TIME)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE))  # fmt: skip
            outs.append(out)
        for proc in procs:
            assert proc.stdout.readline() == b"attached\n", "an honest client could not attach"

        def go() -> None:
            for proc in procs:
                proc.stdin.write(b"go\n")
                proc.stdin.close()
            for proc in procs:  # each request within ON_TIME, or the client exits non-zero
                assert proc.wait(timeout=n * ON_TIME + 60) == 0, "an honest client's request failed"
            for out in outs:
                with np.load(out) as got:
                    for i in range(n):
                        want = single_decode(got[f"sem_{i}"], got[f"glb_{i}"])
                        np.testing.assert_allclose(got[f"pcm_{i}"], want, atol=1e-5, rtol=0)
                        assert got[f"seconds_{i}"] < ON_TIME

        yield go
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if not pipe.closed:
                    pipe.close()


@contextlib.contextmanager
def _running(argv: list[str], first_line: bytes, **kwargs):
    """A hostile process, running once it printed ``first_line``; killed afterwards."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, **kwargs)
    try:
        assert proc.stdout.readline() == first_line, f"{argv[-3:]} did not start"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def _flooded(name: str) -> bool:
    """The flood outruns whoever takes its posts: ``ready`` holds a backlog."""
    if not os.path.exists(f"/dev/shm/{name}.sock"):
        return posix_ipc.Semaphore(f"/{name}.ready").value > 100_000
    with Segment.attach(name) as seg:  # a segment shared with the group: semaphores inside
        return seg.ready.value > 100_000


def _stops_cleanly(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=30) == 0, "the server did not stop cleanly"


def _serve_through_a_flood(start_server, name: str, tmp_path: Path, flooder: list[str], **kwargs) -> None:
    server = start_server("--slots", str(SLOTS), *kwargs.pop("serve", ()))
    with _honest_clients(name, tmp_path, range(3), 6) as during:
        with _running(flooder, b"flooding\n", **kwargs):
            wait_for(lambda: _flooded(name), 30, "a backlog of posts")
            during()  # every answer right and on time while the flood runs
    with _honest_clients(name, tmp_path, range(3, 5), 4) as after:
        after()  # and after it, the backlog still there
    _stops_cleanly(server)


def test_a_flood_of_posts_delays_no_other_client_during_or_after_it(start_server, shm_name, tmp_path):
    """A client of the server's own user posts ``ready`` and every slot's ``req`` and ``done``
    in a tight loop, faster than they can be taken."""
    _serve_through_a_flood(start_server, shm_name, tmp_path, [sys.executable, FLOODER, shm_name, str(SLOTS)])


def test_a_group_member_s_flood_of_posts_delays_no_other_client(start_server, shm_name, tmp_path,
                                                                unprivileged_python):  # fmt: skip
    """The same flood from another user of the server's group (``--mode 0o660``, as
    docs/deployment.md offers for workers under other users)."""
    user = unprivileged_python
    member = [a if a != "--clear-groups" else f"--groups={os.getgid()}" for a in user.prefix]
    code = Path(FLOODER).read_text()
    argv = [*member, "-c", code, shm_name, str(SLOTS), str(os.geteuid())]
    _serve_through_a_flood(start_server, shm_name, tmp_path, argv, serve=("--mode", "0o660"),
                           env=user.env, cwd=user.home)  # fmt: skip


class _BuggyClient:
    """Claims a slot as a client does, writes a request into it, and frees it while the server
    decodes it: a bug no well-behaved client has, which any client may have."""

    def __init__(self, name: str) -> None:
        self.seg = Segment.attach(name)
        f = self.seg.field
        self.slot = next(i for i in np.flatnonzero(f["state"] == FREE).tolist() if self.seg.try_lock_slot(i))
        f["generation"][self.slot] += 1
        f["state"][self.slot] = SlotState.CLAIMED

    def submit(self, semantic: np.ndarray, global_ids: np.ndarray) -> None:
        seg, i, f = self.seg, self.slot, self.seg.field
        seg.tokens[i, : len(semantic)] = semantic
        seg.globals[i] = global_ids
        fields = dict(n_tokens=len(semantic), n_global=32, dtype=1, notify=NO_BELL, handle_id=99,
                      req_generation=int(f["generation"][i]), request_seq=1)  # fmt: skip
        for field, value in fields.items():
            f[field][i] = value
        f["state"][i] = READY
        seg.req(i).release()
        seg.ready.release()

    def free_and_leave(self) -> None:
        self.seg.free_slot(self.slot)
        self.seg.close()


def test_a_slot_freed_while_it_is_decoded_costs_its_next_owner_nothing(thread_server, shm_name):
    decoder = SteppedDecoder()
    server = thread_server(decoder, slots=1, max_wait_ms=0, rejoin_ms=0, min_fill=0.0, lanes=1)
    buggy = _BuggyClient(shm_name)
    buggy.submit(*seeded_request(1, 20))
    decoder.wait_entered(1)  # the server decodes the buggy client's request
    buggy.free_and_leave()  # ... and the buggy client frees the slot under it
    sem, glb = seeded_request(2, 30)
    got: dict = {}
    with DecoderClient(shm_name, slots=1, timeout=60) as client:
        thread = threading.Thread(target=lambda: got.update(pcm=client.decode(sem, glb, dtype="float32")))
        thread.start()
        try:
            # The next owner claimed the (only) slot and its request waits behind the batch.
            seg = server.segment
            wait_for(lambda: int(seg.field["state"][0]) == READY and int(seg.field["generation"][0]) == 2,
                     30, "the next owner's request")  # fmt: skip
            decoder.step()  # the batch of the freed slot ends: its answer must not be published
            decoder.wait_entered(2)  # the next owner's request is decoded in turn
            decoder.step()
        finally:
            decoder.step(), decoder.step()  # nothing stays gated if a check above failed
            thread.join(60)
    np.testing.assert_allclose(got["pcm"], single_decode(sem, glb), atol=1e-5, rtol=0)
    stats = stats_from_header(read_header(shm_name))
    assert stats["dropped_answers"] == 1 and stats["failed"] == 0


def _late_attacher(name: str, stop: threading.Event, outcomes: list[str]) -> None:
    """Attach again and again while the header is scribbled on: each attempt either attaches
    and decodes correctly, or gets a clear SegmentError (never wrong audio, never a crash)."""
    seed = 100
    while not stop.is_set():
        sem, glb = seeded_request(seed, 12)
        seed += 1
        try:
            with DecoderClient(name, slots=1, timeout=ON_TIME) as client:
                pcm = client.decode(sem, glb, dtype="float32")
        except SegmentError as exc:
            assert str(exc).startswith(f"/dev/shm/{name}"), exc
            outcomes.append("refused")
            continue
        np.testing.assert_allclose(pcm, single_decode(sem, glb), atol=1e-5, rtol=0)
        outcomes.append("decoded")


@pytest.mark.parametrize("seed", [1, 2])
def test_a_client_scribbling_on_the_header_and_its_slots_harms_no_other_client(start_server, shm_name,
                                                                               tmp_path, seed):  # fmt: skip
    server = start_server("--slots", str(SLOTS))
    outcomes: list[str] = []
    late_failed: list[BaseException] = []
    stop = threading.Event()

    def late() -> None:
        try:
            _late_attacher(shm_name, stop, outcomes)
        except BaseException as exc:  # noqa: BLE001 - reported below, in the test's thread
            late_failed.append(exc)

    with _honest_clients(shm_name, tmp_path, range(10 * seed, 10 * seed + 3), 8) as go:
        with _running([sys.executable, SCRIBBLER, shm_name, str(seed)], b"scribbling\n"):
            thread = threading.Thread(target=late)
            thread.start()
            try:
                go()  # every honest answer right and on time while the scribbler runs
            finally:
                stop.set()
                thread.join(2 * ON_TIME)
            assert server.poll() is None, "the server crashed"
    assert not late_failed, late_failed
    assert outcomes, "the late attacher never finished an attempt"
    # Once the scribbler is gone the server restores its header: a new client attaches.
    wait_for(lambda: _attaches(shm_name), 10, "the header restored")
    with DecoderClient(shm_name, slots=1, timeout=ON_TIME) as client:
        sem, glb = seeded_request(7, 15)
        np.testing.assert_allclose(client.decode(sem, glb, dtype="float32"), single_decode(sem, glb),
                                   atol=1e-5, rtol=0)  # fmt: skip
    _stops_cleanly(server)


def _attaches(name: str) -> bool:
    try:
        Segment.attach(name).close()
        return True
    except SegmentError:
        return False


def test_an_answer_s_identity_is_not_taken_before_its_done(thread_server, shm_name):
    """The server writes the answer's identity, then DONE, then posts ``done``. A client that
    takes a stale post in between must not take the answer yet: it would submit its next
    request, and the server's DONE would then land on top of it."""
    decoder = SteppedDecoder()
    server = thread_server(decoder, slots=1, max_wait_ms=0, rejoin_ms=0, min_fill=0.0, lanes=1)
    sem, glb = seeded_request(3, 25)
    got: dict = {}
    with DecoderClient(shm_name, slots=1, timeout=60) as client:
        thread = threading.Thread(target=lambda: got.update(pcm=client.decode(sem, glb, dtype="float32")))
        thread.start()
        try:
            decoder.wait_entered(1)
            seg = server.segment
            seg.result_id[0] = seg.request_id[0]  # as a publish does, before its DONE ...
            for _ in range(5):
                seg.done(0).release()  # ... while stale posts wake the client
            wait_for(lambda: seg.done(0).value == 0, 30, "the client to take the stale posts")
            assert thread.is_alive(), "the client took an answer the server had not finished"
        finally:
            decoder.step()
            thread.join(60)
    np.testing.assert_allclose(got["pcm"], single_decode(sem, glb), atol=1e-5, rtol=0)


def test_a_client_attaching_to_an_overwritten_header_gets_a_clear_error_until_it_is_restored(shm_name):
    seg = Segment.create(shm_name, n_slots=2, max_tokens=20)
    try:
        seg.start_serving()
        seg.header["global_vocab"] = 17  # a client's stray write: attaching would validate wrong
        with pytest.raises(SegmentError, match="header was overwritten"):
            Segment.attach(shm_name)
        seg.restore_description()
        with Segment.attach(shm_name) as again:
            assert again.codec.global_vocab == 4096 == int(again.header["global_vocab"])
    finally:
        seg.stop_serving()
        seg.unlink()
        seg.close()


def test_the_server_restores_what_a_client_overwrote_in_its_header(thread_server, shm_name):
    server = thread_server(reap_interval=0.05)
    with DecoderClient(shm_name, slots=1) as client:
        client.decode(*seeded_request(4, 10))
        h = server.segment.header
        h["requests"], h["batch_hist"][3], h["busy_lanes"] = 10**9, 77, 5
        h["magic"], h["max_tokens"] = 0, 3
        # Within a few reap intervals, everything the server wrote is back, counters included.
        wait_for(lambda: _attaches(shm_name) and stats_from_header(read_header(shm_name))["requests"] == 1,
                 10, "the header restored")  # fmt: skip
        stats = stats_from_header(read_header(shm_name))
        assert stats["batch_size_histogram"] == {1: 1} and stats["busy_lanes"] == 0
        assert stats["max_tokens"] == 1500
        client.decode(*seeded_request(5, 10))  # the attached client never noticed
    assert stats_from_header(read_header(shm_name))["requests"] == 2


def test_a_post_on_a_semaphore_at_its_maximum_value_is_no_error(shm_name):
    """A flood may fill a semaphore up to SEM_VALUE_MAX: an honest post then finds it full,
    and must not fail the request (the waiter has posts enough to wake)."""
    sem = posix_ipc.Semaphore(f"/{shm_name}.x", posix_ipc.O_CREX, 0o600, posix_ipc.SEMAPHORE_VALUE_MAX)
    try:
        post(sem)
        assert sem.value == posix_ipc.SEMAPHORE_VALUE_MAX
        assert drain(sem) == DRAIN_MOST  # a bounded drain: it does not try to empty it
    finally:
        sem.unlink()
        sem.close()
