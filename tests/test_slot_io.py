"""The server's vectorised slot I/O: validation of private copies, and batch write-back."""

from __future__ import annotations

import time

import numpy as np
import pytest

from bicodec_shm.slot_io import check_headers, gather, publish


def _seen(slots: np.ndarray) -> np.ndarray:
    """When the server took each slot's req.I (one moment for every call of a test, so that
    two calls over the same slots can be compared field for field)."""
    return np.full(len(slots), _SEEN_NS, np.int64)


_SEEN_NS = time.monotonic_ns() + 3600 * 10**9  # after every submit of the session

from bicodec_shm.transport import BUSY, DONE, HOP, NO_BELL, READY, Segment, Status


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
    publish(seg, batch.requests, pcm16, np.array([0]), pcm32, np.array([1]))
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
    many, _ = gather(seg, together.take([1, 0, 2]), semantic_vocab=8192, global_vocab=4096)
    assert np.array_equal(one.semantic[0], many.semantic[0, :2]) and one.semantic.shape == (1, 2)
    assert np.array_equal(one.global_ids, many.global_ids[:1])
