"""The segment itself: layout, owning a name, attaching, permissions, locks, fork, cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import posix_ipc
import pytest

from bicodec_shm.errors import (
    SegmentError,
    ServerAlreadyRunningError,
    ServerUnavailableError,
    SharedMemoryFullError,
)
from bicodec_shm.protocol.header import read_header, stats_from_header
from bicodec_shm.protocol.layout import (
    HEADER_DT,
    HEADER_SIZE,
    HOP,
    LAYOUT_VERSION,
    MAGIC,
    SLOT_DT,
    Layout,
    SlotState,
)
from bicodec_shm.protocol.names import (
    ServerState,
    leftover_objects,
    probe,
    semaphore_names,
    unlink_all,
    validate_name,
)
from bicodec_shm.protocol.segment import Segment


def _serve(name: str, **kwargs) -> Segment:
    kwargs.setdefault("n_slots", 4)
    kwargs.setdefault("max_tokens", 100)
    seg = Segment.create(name, **kwargs)
    seg.start_serving()
    return seg


def _stop(seg: Segment) -> None:
    seg.stop_serving()
    seg.unlink()
    seg.close()


@pytest.fixture
def segment(shm_name):
    seg = _serve(shm_name)
    yield seg
    if seg.header is not None:
        _stop(seg)


def _python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            text=True, **kwargs)  # fmt: skip


def test_layout_regions_are_ordered_aligned_and_large_enough():
    lay = Layout(n_slots=64, max_tokens=1500)
    assert HEADER_DT.itemsize <= HEADER_SIZE
    assert lay.slots_off >= HEADER_SIZE
    assert lay.tokens_off >= lay.slots_off + 64 * SLOT_DT.itemsize
    assert lay.globals_off >= lay.tokens_off + 64 * 1500 * 4
    assert lay.pcm_off >= lay.globals_off + 64 * 32 * 4
    assert lay.pcm_stride >= 1500 * HOP * 4  # float32 output of the longest request fits
    for off in (lay.slots_off, lay.tokens_off, lay.globals_off, lay.pcm_off):
        assert off % 64 == 0


def test_create_writes_a_verifiable_header_and_attach_sees_it(segment, shm_name):
    h = read_header(shm_name)
    assert int(h["magic"]) == MAGIC and int(h["version"]) == LAYOUT_VERSION
    assert int(h["n_slots"]) == 4 and int(h["max_tokens"]) == 100
    assert int(h["server_uid"]) == os.geteuid()
    with Segment.attach(shm_name) as other:
        assert other.layout == segment.layout
        segment.tokens[2, :3] = [7, 8, 9]
        assert list(other.tokens[2, :3]) == [7, 8, 9]  # the same memory


def test_the_segment_is_reserved_up_front(segment, shm_name):
    # posix_fallocate: the pages exist now, so a full /dev/shm cannot SIGBUS a process later.
    st = os.stat(f"/dev/shm/{shm_name}")
    assert st.st_blocks * 512 >= segment.layout.total_size


def test_objects_are_created_owner_only_by_default(segment, shm_name):
    names = leftover_objects(shm_name)
    assert len(names) == 1 + len(semaphore_names(shm_name, 4)) == 1 + 2 + 3 * 4
    for entry in names:
        assert os.stat(f"/dev/shm/{entry}").st_mode & 0o777 == 0o600, entry


def test_group_mode_is_applied_despite_the_umask(shm_name):
    old = os.umask(0o022)
    try:
        seg = _serve(shm_name, n_slots=2, max_tokens=10, mode=0o660)
    finally:
        os.umask(old)
    try:
        # Shared with the group over its socket; the name's own object stays the user's alone.
        assert {e: os.stat(f"/dev/shm/{e}").st_mode & 0o777 for e in leftover_objects(shm_name)} == {
            shm_name: 0o600, f"{shm_name}.sock": 0o660}
    finally:
        _stop(seg)


def test_probe_follows_the_servers_life(shm_name):
    assert probe(shm_name) is ServerState.ABSENT
    seg = Segment.create(shm_name, n_slots=2, max_tokens=10)
    # probe() opens its own descriptor: our own locks look held from there.
    assert probe(shm_name) is ServerState.BUSY  # starting: owns the name, not serving yet
    seg.start_serving()
    assert probe(shm_name) is ServerState.SERVING
    seg.stop_serving()
    assert probe(shm_name) is ServerState.BUSY  # stopping
    seg.close()  # dies without unlinking: leftovers
    assert probe(shm_name) is ServerState.DEAD


def test_a_second_server_is_refused_while_the_first_serves(segment, shm_name):
    with pytest.raises(ServerAlreadyRunningError, match="already serving"):
        Segment.create(shm_name, n_slots=4, max_tokens=100)
    assert probe(shm_name) is ServerState.SERVING  # and nothing of the first was removed
    assert len(leftover_objects(shm_name)) == 15


def test_a_starting_or_stopping_server_is_waited_for_then_refused(shm_name):
    seg = Segment.create(shm_name, n_slots=2, max_tokens=10)  # owns the name, not serving
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerAlreadyRunningError, match="starting or stopping"):
            Segment.create(shm_name, n_slots=2, max_tokens=10, wait=0.3)
        assert time.monotonic() - t0 >= 0.3
    finally:
        seg.unlink()
        seg.close()


def test_a_stopping_server_is_replaced_as_soon_as_it_is_gone(shm_name):
    seg = _serve(shm_name, n_slots=2, max_tokens=10)
    seg.stop_serving()
    child = _python(f"""
        from bicodec_shm.protocol.segment import Segment
        seg = Segment.create({shm_name!r}, n_slots=2, max_tokens=10, wait=20)
        seg.start_serving()
        print("serving", flush=True)
        input()
        seg.stop_serving(); seg.unlink(); seg.close()
    """, stdin=subprocess.PIPE)  # fmt: skip
    try:
        time.sleep(0.3)
        assert child.poll() is None  # still waiting for us
        seg.unlink()
        seg.close()
        assert child.stdout.readline().strip() == "serving"
        assert probe(shm_name) is ServerState.SERVING
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=20) == 0
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        child.stdin.close()


def test_a_dead_servers_leftovers_are_taken_over(shm_name):
    child = _python(f"""
        import os, signal
        from bicodec_shm.protocol.segment import Segment
        seg = Segment.create({shm_name!r}, n_slots=3, max_tokens=10)
        seg.start_serving()
        os.kill(os.getpid(), signal.SIGKILL)
    """)  # fmt: skip
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.stdout.close()
    assert probe(shm_name) is ServerState.DEAD
    stale_epoch = int(read_header(shm_name)["server_epoch"])
    seg = _serve(shm_name, n_slots=2, max_tokens=10)
    try:
        assert int(seg.header["server_epoch"]) != stale_epoch
        assert len(leftover_objects(shm_name)) == 1 + 2 + 3 * 2  # no stale sem.*.2 left over
    finally:
        _stop(seg)


def test_something_that_is_not_ours_is_never_taken_over(shm_name):
    shm = posix_ipc.SharedMemory(f"/{shm_name}", posix_ipc.O_CREX, size=8192)
    try:
        os.write(shm.fd, b"not a bicodec segment" * 10)
        with pytest.raises(SegmentError, match="not a bicodec-shm segment"):
            Segment.create(shm_name, n_slots=2, max_tokens=10)
        assert os.path.exists(f"/dev/shm/{shm_name}")
    finally:
        shm.close_fd()
        shm.unlink()


def test_attach_to_a_missing_name_says_no_server_runs(shm_name):
    with pytest.raises(ServerUnavailableError, match="no bicodec-shm server is running"):
        Segment.attach(shm_name)


def test_attach_refuses_a_segment_nobody_serves(shm_name):
    seg = Segment.create(shm_name, n_slots=2, max_tokens=10)
    try:
        with pytest.raises(ServerUnavailableError, match="no server serves it"):
            Segment.attach(shm_name)
    finally:
        seg.unlink()
        seg.close()


def test_attach_refuses_a_segment_of_another_user(segment, shm_name):
    with pytest.raises(SegmentError, match=f"belongs to uid {os.geteuid()}, not to uid 12345"):
        Segment.attach(shm_name, owner_uid=12345)
    Segment.attach(shm_name, owner_uid=os.geteuid()).close()


def test_attach_to_another_layout_version(segment, shm_name):
    segment.header["version"] = LAYOUT_VERSION + 1
    with pytest.raises(SegmentError, match="layout version"):
        Segment.attach(shm_name)


def test_attach_never_resizes(segment, shm_name):
    size = os.stat(f"/dev/shm/{shm_name}").st_size
    Segment.attach(shm_name).close()
    assert os.stat(f"/dev/shm/{shm_name}").st_size == size


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 200, "sp ace", "dot.name", "a.", "a.1234", "ümlaut", None,
                                 "tts\n", "tts.0\n"])  # fmt: skip
def test_names_are_validated(bad):
    # "tts\n": a regular expression's "$" matches before a final newline; a name is matched whole.
    with pytest.raises(ValueError, match="invalid segment name"):
        validate_name(bad)


def test_group_member_names_are_valid():
    assert validate_name("tts.0") == "tts.0"
    assert validate_name("tts.17") == "tts.17"


def test_leftovers_of_a_name_never_include_another_names_objects(segment, shm_name):
    member = _serve(f"{shm_name}.1", n_slots=2, max_tokens=10)
    try:
        mine = leftover_objects(shm_name)
        theirs = leftover_objects(f"{shm_name}.1")
        assert mine and theirs and not set(mine) & set(theirs)
    finally:
        _stop(member)


def test_too_little_shared_memory_is_refused_with_advice(shm_name):
    with pytest.raises(SharedMemoryFullError, match=r"needs .* MiB.*--shm-size"):
        Segment.create(shm_name, n_slots=4096, max_tokens=100_000)
    assert leftover_objects(shm_name) == []


def test_slot_lock_is_exclusive_between_attachments_and_dies_with_its_process(segment, shm_name):
    with Segment.attach(shm_name) as a, Segment.attach(shm_name) as b:
        assert a.try_lock_slot(1)
        assert not b.try_lock_slot(1)
        assert b.try_lock_slot(2)
    # Both closed: their locks are gone.
    assert segment.try_lock_slot(1)
    segment.unlock_slot(1)

    # A process that holds a lock and is killed releases it without running any code.
    child = _python(f"""
        import time
        from bicodec_shm.protocol.segment import Segment
        s = Segment.attach({shm_name!r})
        assert s.try_lock_slot(3)
        print("locked", flush=True)
        time.sleep(60)
    """)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "locked"
        assert not segment.try_lock_slot(3)
        child.kill()
        child.wait(timeout=10)
        deadline = time.monotonic() + 5
        while not segment.try_lock_slot(3):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_a_forked_child_with_threads_running_does_not_keep_its_parents_locks(segment, shm_name):
    # The parent holds a slot lock, runs a thread that keeps a view of the mapping alive (so
    # the mapping, and mmap's own descriptor, survive in the child), forks, and is SIGKILLed.
    parent = _python(f"""
        import gc, os, threading, time
        from bicodec_shm.protocol.segment import Segment
        s = Segment.attach({shm_name!r})
        assert s.try_lock_slot(2)
        view = s.tokens[2]
        threading.Thread(target=lambda: time.sleep(60), daemon=True).start()
        gc.freeze()
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
        time.sleep(60)
    """)  # fmt: skip
    child_pid = int(parent.stdout.readline())
    try:
        assert not segment.try_lock_slot(2)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 2
        while not segment.try_lock_slot(2):
            assert time.monotonic() < deadline, "the forked child kept its dead parent's lock"
            time.sleep(0.01)
        os.kill(child_pid, 0)  # the child is still alive
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        try:
            os.kill(child_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_unlink_all_removes_everything_and_is_idempotent(shm_name):
    seg = Segment.create(shm_name, n_slots=3, max_tokens=10)
    seg.close()
    assert len(leftover_objects(shm_name)) == 1 + 2 + 3 * 3
    assert unlink_all(shm_name) == 12
    assert unlink_all(shm_name) == 0
    assert leftover_objects(shm_name) == []


def test_only_the_creator_may_unlink(segment, shm_name):
    with Segment.attach(shm_name) as other:
        with pytest.raises(SegmentError, match="only the server that created"):
            other.unlink()
    assert probe(shm_name) is ServerState.SERVING


def test_average_times_are_over_completed_requests_only(segment):
    """Failed requests add to ``requests`` but carry no queue or latency time: the averages
    must not be diluted by them."""
    h = segment.header
    h["requests"], h["failed"] = 5, 3  # 2 completed
    h["queue_wait_ns"], h["latency_ns"] = 2 * 4_000_000, 2 * 10_000_000
    stats = stats_from_header(h)
    assert stats["completed"] == 2
    assert stats["avg_queue_wait_ms"] == pytest.approx(4.0)
    assert stats["avg_latency_ms"] == pytest.approx(10.0)


def test_views_cover_the_payload_areas(segment):
    assert segment.slots.shape == (4,)
    assert (segment.slots["state"] == SlotState.FREE).all()
    assert segment.tokens.shape == (4, 100) and segment.tokens.dtype == np.int32
    assert segment.globals.shape == (4, 32)
    segment.pcm32[3, : 100 * HOP] = 0.5
    assert segment.pcm16.shape[1] >= 100 * HOP
    assert segment.pcm32[3, 100 * HOP - 1] == 0.5
    assert segment.pcm32[2, 0] == 0.0  # rows do not overlap
