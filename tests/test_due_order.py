"""Requests are served by when their audio is due, not only by arrival.

A request says how long until its audio is due (``due_in``: a stream's audio still buffered at its
listener; 0, the default, for a whole utterance). The server keys its plans on seen time plus
that, capped at ``MAX_DUE_IN_US``: a stream about to run dry goes before one with seconds of
audio ahead, and a request is passed over only by ones due before it, so none starves.
``DecodeStream`` sends its windows with the listener's clock: its first window at once."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
from support import SteppedDecoder, bare_attachment, plant_ready, wait_submitted

from bicodec_shm import DecoderClient, DecodeStream
from bicodec_shm.client.requests import due_time
from bicodec_shm.client.streaming import PLAYING_LEAD_S
from bicodec_shm.protocol.layout import MAX_DUE_IN_US, NO_BELL
from bicodec_shm.protocol.names import random_name
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.protocol.slot_io import check_headers
from bicodec_shm.server.batching import plan_batch

GLB = np.arange(32) % 4096
S = 10**9


def _plan(lengths, due, max_batch=1):
    return plan_batch(np.asarray(lengths, np.int64), np.asarray(due, np.int64), max_batch=max_batch,
                      max_batch_tokens=None).tolist()  # fmt: skip


def test_the_request_due_soonest_goes_first_whatever_its_arrival():
    # seen at 0, 1 and 2 s; the first says its audio is due 5 s after it was seen
    assert _plan([3, 4, 5], [5 * S, 1 * S, 2 * S]) == [1]


def test_a_request_due_later_is_passed_only_by_requests_due_before_it():
    """Its due time does not move: newcomers due after it (seen later, due now) queue behind it."""
    pending = {"later": 5 * S}  # seen at 0, due at 5 s
    served = []
    for t in range(1, 9):  # one newcomer a second, each due when seen, one row a plan
        pending[f"new@{t}"] = t * S
        names = list(pending)
        (pick,) = _plan([4] * len(names), [pending[n] for n in names])
        served.append(names[pick])
        del pending[names[pick]]
    assert served.index("later") == 4  # after the newcomers due at 1..4 s, before the one at 5 s


@pytest.mark.parametrize("value", [-1, -0.001, math.nan, "soon", None, True])
def test_due_in_must_be_a_number_of_seconds_at_least_zero(value):
    with pytest.raises(ValueError, match="due_in must be a number of seconds >= 0"):
        due_time(value)


def test_due_in_is_written_as_the_microseconds_left_at_the_submit_and_capped():
    """The due time is fixed when the call is made and converted at the submit: a request that
    waited for a slot (or is resubmitted to a restarted server) is due that much sooner."""
    cases = (0, due_time(0.25), due_time(1e9), due_time(math.inf), time.monotonic_ns() - 10**9)
    with bare_attachment(random_name("bcshm-test"), len(cases)) as (seg, att):
        written = []
        for due_at in cases:  # one slot each, all left READY: no server reads them here
            seq = att.new_seq()
            slot, _ = att.take_slot(time.monotonic() + 5, seq)
            att.submit(slot, seq, np.array([5, 5], np.int32), GLB.astype(np.int32), 0, NO_BELL,
                       due_at_ns=due_at)  # fmt: skip
            written.append(int(seg.slots["due_in_us"][slot]))
        assert written[0] == 0 and 200_000 < written[1] <= 250_000
        # capped at the call (30 s from then), less what passed before the submit
        assert all(MAX_DUE_IN_US - 200_000 < w <= MAX_DUE_IN_US for w in written[2:4])
        assert written[4] == 0  # a due time already past: due now


def test_the_server_caps_a_client_written_due_time_on_both_header_paths():
    """A garbage ``due_in_us`` (any u32) postpones its own request by at most the cap."""
    seg = Segment.create(random_name("bcshm-test"), n_slots=3, max_tokens=10)
    try:
        seg.start_serving()
        written = (0, 1_500_000, 2**32 - 1)
        for slot, due_in in enumerate(written):
            plant_ready(seg, slot, due_in_us=due_in)
        seen = np.full(3, time.monotonic_ns(), np.int64)
        expected = [seen[0] + 1000 * min(d, MAX_DUE_IN_US) for d in written]
        req, failures = check_headers(seg, np.arange(3), seen, n_bells=3)
        assert not failures and req.due().tolist() == expected
        for slot in range(3):  # one slot alone takes the scalar path (_check_one)
            one, failures = check_headers(seg, np.array([slot]), seen[:1], n_bells=3)
            assert not failures and one.due().tolist() == [expected[slot]]
    finally:
        seg.stop_serving()
        seg.unlink()
        seg.close()


class _LengthLog(SteppedDecoder):
    """A stepped decoder that also records the lengths of each batch's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[list[int]] = []

    def detokenize(self, semantic_ids, global_ids, lengths):
        self.lengths.append([int(n) for n in lengths])
        return super().detokenize(semantic_ids, global_ids, lengths)


def _decode_behind_a_running_batch(thread_server, shm_name, queued: list[tuple[int, float]]):
    """Real server, real shared memory, one row a batch: a 2-token request runs in the
    decoder while ``queued`` ((tokens, due_in) each, submitted in that order) waits behind it;
    then every batch runs. Returns (the lengths of each batch decoded, tokens -> audio)."""
    decoder = _LengthLog()
    server = thread_server(decoder, max_batch=1, lanes=1)
    results: dict[int, np.ndarray] = {}
    with DecoderClient(shm_name, slots=8) as client:
        def decode(n: int, due_in: float) -> None:
            results[n] = client.decode(np.arange(n) % 8192, GLB, due_in=due_in, timeout=30)

        threads = [threading.Thread(target=decode, args=(2, 0.0))]
        threads[0].start()
        decoder.wait_entered(1)  # the 2-token request is in the decoder; the rest queue behind it
        for count, (n, due_in) in enumerate(queued, start=2):
            threads.append(threading.Thread(target=decode, args=(n, due_in)))
            threads[-1].start()
            wait_submitted(server.segment, count, server=server)
        for _ in range(len(threads)):
            decoder.step()
        for t in threads:
            t.join(30)
    return decoder.lengths, results


def test_the_server_decodes_a_stream_about_to_run_dry_before_one_with_audio_ahead(thread_server, shm_name,
                                                                                   monkeypatch):
    """Real server, real shared memory, one row a batch: behind a running batch wait a request
    due in 5 s, then two due now; the two due now are decoded first and the one due later after
    them (not dropped, not starved). The server confirms all three in one scan, so they share a
    seen time; claims take the lowest free slot here, so the one due later has the lowest slot
    and a plan by arrival alone would take it first."""
    monkeypatch.setattr("bicodec_shm.protocol.attachment.random.randrange", lambda n: 0)
    lengths, results = _decode_behind_a_running_batch(thread_server, shm_name, [(3, 5.0), (5, 0.0), (7, 0.0)])
    assert lengths == [[2], [5], [7], [3]]
    assert sorted(results) == [2, 3, 5, 7] and all(len(results[n]) == 320 * n for n in results)


class _DueLog:
    """A stand-in client that records each window's ``due_in`` and returns silence at once."""

    def __init__(self) -> None:
        self.due: list[float] = []

    def decode(self, semantic_ids, global_ids, *, dtype="int16", timeout=None, due_in=0.0):
        self.due.append(due_in)
        return np.zeros(320 * len(semantic_ids), np.float32)

    async def decode_async(self, semantic_ids, global_ids, *, dtype="int16", timeout=None, due_in=0.0):
        return self.decode(semantic_ids, global_ids, due_in=due_in)


def test_a_stream_sends_its_first_window_due_now_and_later_ones_by_the_audio_ahead():
    """The first window is due at once; the next when the first has played, plus the lead that
    lets other streams' first audio go before it (``PLAYING_LEAD_S``)."""
    log = _DueLog()
    stream = DecodeStream(log, GLB, preset="default")
    s = stream.settings
    first = stream.push(np.arange(s.first_chunk + s.lookahead))  # the first region, at once
    assert first and log.due == [0.0]
    played_from = time.monotonic()
    ahead = len(first) // 2 / 16000  # seconds of audio the listener holds now
    stream.push(np.arange(s.chunk_tokens))  # the next region: due when the first has played
    assert len(log.due) == 2
    due = log.due[1] - PLAYING_LEAD_S
    assert 0 < due <= ahead + (time.monotonic() - played_from) + 1e-3
    assert due >= ahead - (time.monotonic() - played_from) - 0.05


def test_a_new_streams_first_window_goes_before_a_playing_streams_late_window(thread_server, shm_name):
    """Real server, one row a batch: behind a running batch wait a window of a stream that has
    run dry (seen first) and then a new stream's first window; the first window is decoded
    first, and the late window right after it."""
    # A playing stream's window that has run dry (0 s ahead, plus the lead), then a first window.
    queued = [(3, PLAYING_LEAD_S), (5, 0.0)]
    lengths, results = _decode_behind_a_running_batch(thread_server, shm_name, queued)
    assert lengths == [[2], [5], [3]]
    assert sorted(results) == [2, 3, 5] and all(len(results[n]) == 320 * n for n in results)
