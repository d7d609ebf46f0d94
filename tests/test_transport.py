"""The segment itself: layout, creation, attaching, permissions, slot locks, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import posix_ipc
import pytest

from bicodec_shm.errors import SegmentError, ServerUnavailableError, SharedMemoryFullError
from bicodec_shm.transport import (
    HEADER_DT,
    HEADER_SIZE,
    HOP,
    LAYOUT_VERSION,
    MAGIC,
    SLOT_DT,
    Layout,
    Segment,
    SlotState,
    leftover_objects,
    read_header,
    unlink_all,
    validate_name,
)


@pytest.fixture
def segment(shm_name):
    seg = Segment.create(shm_name, n_slots=4, max_tokens=100)
    yield seg
    seg.close()
    seg.unlink()


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
    assert int(h["server_pid"]) == os.getpid()
    with Segment.attach(shm_name) as other:
        assert other.layout == segment.layout
        segment.tokens[2, :3] = [7, 8, 9]
        assert list(other.tokens[2, :3]) == [7, 8, 9]  # the same memory


def test_objects_are_created_owner_only_by_default(segment, shm_name):
    names = leftover_objects(shm_name)
    assert len(names) == 1 + 1 + 4  # segment, ready, 4 done semaphores
    for entry in names:
        assert os.stat(f"/dev/shm/{entry}").st_mode & 0o777 == 0o600, entry


def test_group_mode_is_applied_despite_the_umask(shm_name):
    old = os.umask(0o022)
    try:
        seg = Segment.create(shm_name, n_slots=2, max_tokens=10, mode=0o660)
    finally:
        os.umask(old)
    try:
        for entry in leftover_objects(shm_name):
            assert os.stat(f"/dev/shm/{entry}").st_mode & 0o777 == 0o660, entry
    finally:
        seg.close()
        seg.unlink()


def test_create_refuses_an_existing_name(segment, shm_name):
    with pytest.raises(posix_ipc.ExistentialError):
        Segment.create(shm_name, n_slots=4, max_tokens=100)


def test_attach_to_a_missing_name_says_no_server_runs(shm_name):
    with pytest.raises(ServerUnavailableError, match="no bicodec-shm server is running"):
        Segment.attach(shm_name)


def test_attach_to_something_that_is_not_ours(shm_name):
    shm = posix_ipc.SharedMemory(f"/{shm_name}", posix_ipc.O_CREX, size=8192)
    try:
        os.write(shm.fd, b"not a bicodec segment" * 10)
        with pytest.raises(SegmentError, match="not a bicodec-shm segment"):
            Segment.attach(shm_name)
    finally:
        shm.close_fd()
        shm.unlink()


def test_attach_to_another_layout_version(segment, shm_name):
    segment.header["version"] = LAYOUT_VERSION + 1
    with pytest.raises(SegmentError, match="layout version"):
        Segment.attach(shm_name)


def test_attach_never_resizes(segment, shm_name):
    size = os.fstat(segment.fd).st_size
    Segment.attach(shm_name).close()
    assert os.fstat(segment.fd).st_size == size


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 200, "sp ace", "dot.name", "ümlaut", None])
def test_names_are_validated(bad):
    with pytest.raises(ValueError, match="invalid segment name"):
        validate_name(bad)


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
    code = (
        "import sys, time; from bicodec_shm.transport import Segment; "
        f"s = Segment.attach({shm_name!r}); assert s.try_lock_slot(3); print('locked', flush=True); "
        "time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
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


def test_unlink_all_removes_everything_and_is_idempotent(shm_name):
    seg = Segment.create(shm_name, n_slots=3, max_tokens=10)
    seg.close()
    assert len(leftover_objects(shm_name)) == 5
    assert unlink_all(shm_name) == 5
    assert unlink_all(shm_name) == 0
    assert leftover_objects(shm_name) == []


def test_views_cover_the_payload_areas(segment):
    assert segment.slots.shape == (4,)
    assert (segment.slots["state"] == SlotState.FREE).all()
    assert segment.tokens.shape == (4, 100) and segment.tokens.dtype == np.int32
    assert segment.globals.shape == (4, 32)
    segment.pcm_float32(3, 100 * HOP)[:] = 0.5
    assert segment.pcm_int16(3, 10).shape == (10,)
    assert segment.pcm_float32(3, 100 * HOP)[-1] == 0.5
