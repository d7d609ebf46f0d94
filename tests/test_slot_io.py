"""The server's vectorised slot I/O: validation of private copies, and batch write-back."""

from __future__ import annotations

import time

import numpy as np
import pytest

from bicodec_shm.protocol.layout import BUSY, CLAIMED, DONE, HOP, NO_BELL, READY, Status
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.protocol.slot_io import check_headers, gather, publish, publish_failure


def _seen(slots: np.ndarray) -> np.ndarray:
    """When the server took each slot's req.I (one moment for every call of a test, so that
    two calls over the same slots can be compared field for field)."""
    return np.full(len(slots), _SEEN_NS, np.int64)


_SEEN_NS = time.monotonic_ns() + 3600 * 10**9  # after every submit of the session



@pytest.fixture
def seg(shm_name):
    s = Segment.create(shm_name, n_slots=6, max_tokens=50)
    s.start_serving()
    yield s
    s.stop_serving()
    s.unlink()
    s.close()


def _ready(seg, slot, tokens, *, globals_=7, seq=1, dtype=0):
    f = seg.field
    seg.tokens[slot, : len(tokens)] = tokens
    seg.globals[slot] = globals_
    for k, v in dict(n_tokens=len(tokens), n_global=32, dtype=dtype, notify=NO_BELL,
                     req_generation=int(f["generation"][slot]), request_seq=seq).items():  # fmt: skip
        f[k][slot] = v
    f["state"][slot] = READY


def test_gather_validates_and_returns_the_private_copy_the_model_will_see(seg):
    """Finding 11: what is validated is what is decoded; later writes to the slot cannot reach it."""
    _ready(seg, 1, [3, 4, 5, 6])
    _ready(seg, 4, [9, 9])
    req, failures = check_headers(seg, np.array([1, 4]), _seen(np.array([1, 4])), n_bells=6)
    assert failures == [] and req.lengths.tolist() == [4, 2]
    batch, failures = gather(seg, req, semantic_vocab=8192, global_vocab=4096)
    assert failures == []
    seg.tokens[1, :4] = 99999  # a client rewriting its ids after the check
    assert batch.semantic.tolist() == [[3, 4, 5, 6], [9, 9, 0, 0]]  # padding is zeros, not slot garbage
    assert batch.semantic.dtype == np.int64 and batch.global_ids.shape == (2, 32)
    assert seg.field["state"][[1, 4]].tolist() == [BUSY, BUSY]


def test_gather_fails_rows_whose_copied_ids_are_out_of_range_and_keeps_the_rest(seg):
    _ready(seg, 0, [1, 2, 8192])
    _ready(seg, 2, [5, 6])
    _ready(seg, 3, [5], globals_=4096)
    req, _ = check_headers(seg, np.array([0, 2, 3]), _seen(np.array([0, 2, 3])), n_bells=6)
    batch, failures = gather(seg, req, semantic_vocab=8192, global_vocab=4096)
    assert batch.slots.tolist() == [2]
    assert [(s, st) for s, st, _ in failures] == [(0, Status.BAD_SEMANTIC_ID), (3, Status.BAD_GLOBAL)]
    assert "semantic id 8192 at position 2" in failures[0][2]


def test_check_headers_ignores_a_slot_that_is_not_ready(seg):
    _ready(seg, 5, [1, 2])
    seg.field["state"][5] = 1  # CLAIMED: its owner is still writing
    req, failures = check_headers(seg, np.array([5]), _seen(np.array([5])), n_bells=6)
    assert len(req) == 0 and failures == []


def test_publish_writes_each_rows_samples_and_results_for_mixed_dtypes(seg):
    _ready(seg, 1, [1, 2, 3], seq=11, dtype=0)
    _ready(seg, 2, [1, 2], seq=12, dtype=1)
    req, _ = check_headers(seg, np.array([1, 2]), _seen(np.array([1, 2])), n_bells=6)
    batch, _ = gather(seg, req, semantic_vocab=8192, global_vocab=4096)
    n = 3 * HOP
    pcm16 = np.arange(n, dtype=np.int16)[None]
    pcm32 = np.linspace(-1, 1, n, dtype=np.float32)[None]
    assert publish(seg, batch.requests, pcm16, np.array([0]), pcm32, np.array([1]))[1] == []
    f = seg.field
    assert f["state"][[1, 2]].tolist() == [DONE, DONE]
    assert f["result_seq"][[1, 2]].tolist() == [11, 12]
    assert f["n_samples"][[1, 2]].tolist() == [3 * HOP, 2 * HOP]
    assert np.array_equal(seg.pcm16[1, :n], pcm16[0])
    assert np.array_equal(seg.pcm32[2, : 2 * HOP], pcm32[0, : 2 * HOP])


def test_the_single_row_path_and_the_vectorised_path_agree_field_for_field(seg):
    """check_headers and gather take a scalar path for one slot: both must say the same."""
    for slot, tokens in ((1, [4, 5, 6]), (3, [7, 8]), (5, [9])):
        _ready(seg, slot, tokens, seq=slot * 10)
    alone, _ = check_headers(seg, np.array([3]), _seen(np.array([3])), n_bells=6)
    together, _ = check_headers(seg, np.array([1, 3, 5]), _seen(np.array([1, 3, 5])), n_bells=6)
    row = together.take([1])
    for field in ("slots", "lengths", "ids", "dtypes", "notify", "submitted_ns", "seen_ns"):
        a, b = getattr(alone, field), getattr(row, field)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), field
    one, _ = gather(seg, alone, semantic_vocab=8192, global_vocab=4096)
    seg.field["state"][3] = READY  # gathered (BUSY): READY again, to gather it a second way
    many, _ = gather(seg, together.take([1, 0, 2]), semantic_vocab=8192, global_vocab=4096)
    assert np.array_equal(one.semantic[0], many.semantic[0, :2]) and one.semantic.shape == (1, 2)
    assert np.array_equal(one.global_ids, many.global_ids[:1])


@pytest.mark.parametrize(
    "fields, status",
    [
        (dict(n_tokens=0), Status.BAD_LENGTH),
        (dict(n_tokens=51), Status.BAD_LENGTH),  # max_tokens + 1
        (dict(n_tokens=50), None),  # max_tokens
        (dict(n_global=31), Status.BAD_GLOBAL),
        (dict(dtype=2), Status.BAD_DTYPE),
        (dict(req_generation=12345), Status.STALE_GENERATION),
        (dict(notify=6), Status.BAD_NOTIFY),  # n_bells
        (dict(notify=5), None),  # n_bells - 1
        (dict(notify=NO_BELL), None),
        (dict(notify=NO_BELL - 1), Status.BAD_NOTIFY),
        (dict(state=1), "stray"),  # not READY: dropped without an answer
    ],
)
def test_the_vectorised_check_agrees_with_the_single_row_check_on_every_bad_field(seg, fields, status):
    """check_headers checks a batch with wrapping uint32 arithmetic (n - 1, notify + 1) and the
    single-row path with Python comparisons: both must reach the same verdict, at the edges too,
    and a bad row must not cost its batchmates."""
    for slot in (0, 2, 4):
        _ready(seg, slot, [1, 2, 3], seq=slot + 1)
    for k, v in fields.items():
        seg.field[k][2] = v
    alone, alone_failures = check_headers(seg, np.array([2]), _seen(np.array([2])), n_bells=6)
    together, failures = check_headers(seg, np.array([0, 2, 4]), _seen(np.array([0, 2, 4])), n_bells=6)
    assert [(s, st) for s, st, _ in failures] == [(s, st) for s, st, _ in alone_failures]
    assert [m for *_, m in failures] == [m for *_, m in alone_failures]
    if status is None:
        assert failures == [] and together.slots.tolist() == [0, 2, 4]
        row = together.take([1])
        for field in ("slots", "lengths", "ids", "dtypes", "notify", "submitted_ns", "seen_ns",
                      "noise_seeds", "flags"):  # fmt: skip
            a, b = getattr(alone, field), getattr(row, field)
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), field
    else:
        assert together.slots.tolist() == [0, 4] and len(alone) == 0
        assert failures == ([] if status == "stray" else [(2, status, failures[0][2])])
    assert together.ids[:, 2].tolist()[0] == 1 and together.ids[:, 2].tolist()[-1] == 5


def test_check_headers_copies_every_field_it_returns(seg):
    """The rows returned are (views of) a private copy: a client writing its slot after the
    check changes none of them, in either path."""
    for slot in (1, 3):
        _ready(seg, slot, [1, 2], seq=slot)
    for slots in (np.array([1]), np.array([1, 3])):
        req, _ = check_headers(seg, slots, _seen(slots), n_bells=6)
        fields = ("lengths", "ids", "dtypes", "notify", "submitted_ns", "noise_seeds", "flags")
        before = {k: getattr(req, k).tolist() for k in fields}
        f = seg.field
        for k, v in dict(n_tokens=7, request_seq=999, handle_id=5, dtype=1, notify=2,
                         t_submit_ns=1, noise_seed=3, flags=1).items():  # fmt: skip
            f[k][1] = v
        assert {k: getattr(req, k).tolist() for k in before} == before
        _ready(seg, 1, [1, 2], seq=1)


def test_check_headers_of_only_strays_is_empty(seg):
    for slot in (1, 3):
        _ready(seg, slot, [1, 2])
        seg.field["state"][slot] = 1
    req, failures = check_headers(seg, np.array([1, 3]), _seen(np.array([1, 3])), n_bells=6)
    assert len(req) == 0 and failures == [] and req.ids.shape == (0, 3)


@pytest.mark.parametrize("where, value, ok", [
    ("semantic", -1, False), ("semantic", 8191, True), ("semantic", 8192, False),
    ("semantic", -(2**31), False), ("global", -1, False), ("global", 4095, True),
    ("global", 4096, False),
])  # fmt: skip
def test_gather_range_check_at_the_edges_in_both_paths(seg, where, value, ok):
    """One reduction per array (ids seen as uint64): negative ids must still fail."""
    for slots in (np.array([2]), np.array([0, 2])):
        for slot in slots.tolist():
            _ready(seg, slot, [1, 2, 3])
        if where == "semantic":
            seg.tokens[2, 1] = value
        else:
            seg.globals[2, 5] = value
        req, _ = check_headers(seg, slots, _seen(slots), n_bells=6)
        batch, failures = gather(seg, req, semantic_vocab=8192, global_vocab=4096)
        if ok:
            assert failures == [] and 2 in batch.slots.tolist()
        else:
            status = Status.BAD_SEMANTIC_ID if where == "semantic" else Status.BAD_GLOBAL
            assert [(s, st) for s, st, _ in failures] == [(2, status)]
            assert f"{value} at position" in failures[0][2]
            assert batch is None if len(slots) == 1 else batch.slots.tolist() == [0]


def test_requests_take_in_order_is_itself_and_any_other_order_is_a_copy(seg):
    for slot in (0, 2, 4):
        _ready(seg, slot, [1, 2, 3][: slot // 2 + 1], seq=slot + 1)
    req, _ = check_headers(seg, np.array([0, 2, 4]), _seen(np.array([0, 2, 4])), n_bells=6)
    assert req.take(np.arange(3)) is req
    other = req.take(np.array([2, 0, 1]))
    assert other.slots.tolist() == [4, 0, 2] and other.ids[:, 2].tolist() == [5, 1, 3]
    assert req.take(np.array([True, False, True])).slots.tolist() == [0, 4]  # a mask: a copy
    assert req.take(slice(1, None)).slots.tolist() == [2, 4]  # Batch.split's halves
    assert req.take([0, 1]).slots.tolist() == [0, 2]


def _claimed_again(seg, slot):
    """The slot's client freed it, and another client claimed it (a new claim epoch)."""
    seg.field["generation"][slot] += 1
    seg.field["state"][slot] = CLAIMED


@pytest.mark.parametrize("rows", [1, 2])
def test_publish_leaves_a_slot_that_was_freed_and_claimed_again_under_its_batch(seg, rows):
    slots = np.array([1, 2][:rows])
    for slot in slots.tolist():
        _ready(seg, slot, [1, 2, 3], seq=10 + slot)
    req, _ = check_headers(seg, slots, _seen(slots), n_bells=6)
    batch, _ = gather(seg, req, semantic_vocab=8192, global_vocab=4096)
    _claimed_again(seg, int(slots[-1]))
    pcm = np.zeros((rows, 3 * HOP), np.float32)
    _, moved = publish(seg, batch.requests, None, np.array([], np.int64), pcm, np.arange(rows))
    assert moved == [rows - 1]  # the last row is not answered: the slot is someone else's now
    assert int(seg.field["state"][slots[-1]]) == CLAIMED  # its next owner's, untouched
    assert seg.field["state"][slots[:-1]].tolist() == [DONE] * (rows - 1)


def test_gather_leaves_out_a_slot_freed_and_claimed_again_since_its_request_was_confirmed(seg):
    slots = np.array([1, 2])
    _ready(seg, 1, [1, 2, 3])
    _ready(seg, 2, [4, 5])
    req, _ = check_headers(seg, slots, _seen(slots), n_bells=6)
    _claimed_again(seg, 2)
    batch, failures = gather(seg, req, semantic_vocab=8192, global_vocab=4096)
    assert batch.slots.tolist() == [1]
    assert [(slot, status) for slot, status, _ in failures] == [(2, Status.BAD_STATE)]
    assert int(seg.field["state"][2]) == CLAIMED  # not BUSY over its next owner's claim


def test_an_error_answer_for_a_slot_claimed_again_is_not_written(seg):
    _ready(seg, 3, [1, 2], seq=5)
    req, _ = check_headers(seg, np.array([3]), _seen(np.array([3])), n_bells=6)
    batch, _ = gather(seg, req, semantic_vocab=8192, global_vocab=4096)
    _claimed_again(seg, 3)
    ids = batch.requests.ids[0]
    assert publish_failure(seg, 3, Status.DECODE_FAILED, "x", ids=ids, notify=NO_BELL) is None
    assert int(seg.field["state"][3]) == CLAIMED
