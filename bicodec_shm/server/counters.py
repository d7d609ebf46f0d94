"""The server's live counters and histograms in the segment header (what ``bicodec-shm stats``,
``get_stats()`` and the Prometheus endpoint read).

Every lane adds to them, so each update is one step under one lock: a batch's counters go in as
one vector add (``C_*`` order), its histogram bins as one ``bincount``. Every time here is a
server-side int64: submit times were clamped to when the server saw them (slot_io).
"""

from __future__ import annotations

import bisect
import threading

import numpy as np

from ..protocol.layout import (
    C_DROPPED,
    C_EXPIRED,
    C_FAILED,
    C_HOST_GAP,
    C_RECLAIMED,
    C_REQUESTS,
    C_WAITED,
    COUNTERS,
    HIST_BINS,
    N_STATUS,
    N_TIME_BINS,
    TIME_BUCKETS,
)
from ..protocol.segment import Segment
from ..protocol.slot_io import Batch

_BUCKETS = [int(b * 1e9) for b in TIME_BUCKETS]  # upper bounds, ns; bisect_left: "le" bins
_BUCKETS_NS = np.array(_BUCKETS, np.int64)


class Counters:
    """Adds the server's events to a segment's header; safe from any lane's thread.

    The server keeps its own copy of every number and writes the copy out whole: a client
    may write anything into the header (its mapping is writable), and an update that added to
    what the header holds would carry such a scribble on for good; this way the next update
    puts it right."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.busy_lanes = 0  # lanes running a batch now (the header's busy_lanes, read by the planner)
        self._segment: Segment | None = None  # whose numbers the copies below are

    def _mine(self, seg: Segment) -> None:
        """Start from zeros for a segment not counted before (a new segment starts at zero)."""
        if self._segment is not seg:
            self._segment = seg
            self.values = np.zeros(len(COUNTERS), np.uint64)  # C_* order, as seg.counters
            self.histograms = np.zeros(3 * N_TIME_BINS, np.uint64)  # as seg.histograms
            self.batch_hist = np.zeros(HIST_BINS, np.uint64)
            self.failed_by_status = np.zeros(N_STATUS, np.uint64)

    def _write_out(self, seg: Segment, histograms: bool = False) -> None:
        seg.counters[:] = self.values
        if histograms:
            seg.histograms[:] = self.histograms
            seg.header["batch_hist"] = self.batch_hist
        seg.header["failed_by_status"] = self.failed_by_status
        seg.header["busy_lanes"] = self.busy_lanes

    def restore(self, seg: Segment) -> None:
        """Write every number out again (a client may have overwritten the header)."""
        with self.lock:
            self._mine(seg)
            self._write_out(seg, histograms=True)

    def count_batch(self, seg: Segment, batch: Batch, done_ns: int, elapsed_ns: int) -> None:
        """Add one published batch: requests, tokens, padding, queue and latency times, the
        batch's decode time, and the batch-size histogram."""
        req = batch.requests
        rows, longest = len(req), batch.frames
        elapsed_ns = max(0, int(elapsed_ns))
        if rows == 1:  # Python scalars: the common case at low load
            submitted = int(req.submitted_ns[0])
            queued, latency = max(0, batch.started_ns - submitted), max(0, done_ns - submitted)
            tokens, queued_sum, latency_sum = int(req.lengths[0]), queued, latency
            bins = [bisect.bisect_left(_BUCKETS, queued), N_TIME_BINS + bisect.bisect_left(_BUCKETS, latency)]
        else:
            submitted_ns = req.submitted_ns
            queued_ns = (batch.started_ns - submitted_ns).clip(0)
            latency_ns = (done_ns - submitted_ns).clip(0)
            tokens = int(req.lengths.sum())
            queued_sum, latency_sum = int(queued_ns.sum()), int(latency_ns.sum())
            bins = np.concatenate((np.searchsorted(_BUCKETS_NS, queued_ns),
                                   np.searchsorted(_BUCKETS_NS, latency_ns) + N_TIME_BINS)).tolist()
        bins.append(2 * N_TIME_BINS + bisect.bisect_left(_BUCKETS, elapsed_ns))
        # Every counter of the batch in one add (C_* order).
        delta = np.array([rows, 1, 0, 0, tokens, rows * longest, queued_sum, elapsed_ns, latency_sum,
                          0, elapsed_ns, 0, 0], np.uint64)  # fmt: skip
        with self.lock:
            self._mine(seg)
            self.values[: len(delta)] += delta  # a batch's counters come first (C_* order)
            h = self.histograms
            if rows == 1:
                for i in bins:
                    h[i] += 1
            else:
                h += np.bincount(bins, minlength=3 * N_TIME_BINS).astype(np.uint64)
            self.batch_hist[min(rows, HIST_BINS - 1)] += 1
            self._write_out(seg, histograms=True)

    def _add(self, seg: Segment, counter: int, n: int) -> None:
        with self.lock:
            self._mine(seg)
            self.values[counter] += n
            self._write_out(seg)

    def count_failure(self, seg: Segment, status: int) -> None:
        with self.lock:
            self._mine(seg)
            self.values[C_REQUESTS] += 1
            self.values[C_FAILED] += 1
            self.failed_by_status[min(int(status), N_STATUS - 1)] += 1
            self._write_out(seg)

    def count_reclaimed(self, seg: Segment, reclaimed: int) -> None:
        """Slots the reaper freed of clients that died or gave up on a request."""
        self._add(seg, C_RECLAIMED, reclaimed)

    def count_expired(self, seg: Segment, expired: int) -> None:
        """Idle handles' warm slots the reaper freed (routine, apart from ``count_reclaimed``)."""
        self._add(seg, C_EXPIRED, expired)

    def count_dropped(self, seg: Segment, dropped: int) -> None:
        """Decoded rows whose answer was not published: their client freed the slot under the
        batch (slot_io.moved_on), so the slot is no longer that request's."""
        self._add(seg, C_DROPPED, dropped)

    def lane_started(self, seg: Segment, host_gap_ns: int, waited_ns: int = 0) -> None:
        """A lane starts a batch after the device waited ``host_gap_ns`` for the host, and
        ``waited_ns`` more while the lane held the batch's requests back on purpose (rejoin.py)."""
        with self.lock:
            self._mine(seg)
            self.values[C_HOST_GAP] += max(0, host_gap_ns)
            self.values[C_WAITED] += max(0, waited_ns)
            self.busy_lanes += 1
            self._write_out(seg)

    def lane_finished(self, seg: Segment) -> None:
        with self.lock:
            self._mine(seg)
            self.busy_lanes -= 1
            self._write_out(seg)
