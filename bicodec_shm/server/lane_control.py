"""Which of the server's lanes take batches now, and each one's thread count: a fixed count, or
the lane tuner's choice (lane_tuner.py) applied as it measures.

Lane threads are started up to ``max_lanes``; the ones beyond ``lanes`` are *parked*: a lane asks
for its turn (``turn``) before each batch, which blocks while it is parked and then tells it its
thread count (the cores split evenly between the lanes running). Every decoded batch is measured
(``begin``, ``end``: its share of the busy time) and given to the tuner, whose choice is applied
from the next batch on. One exception to the even split: a lone request with nothing behind it
and a decode of a few milliseconds runs on one thread (``one_thread_pays``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..protocol.slot_io import Batch
from .batch_costs import BatchCosts
from .lane_tuner import BatchMeter, Choice, LaneTuner, LaneTuning
from .lanes import lane_threads

# Lanes on CPU: the server measures which count serves best (lane_tuner.py) among these, up to
# twice the cores it has, starting from the one the load predicts, read on one lane with every
# core (what one client gets: it pays nothing for the reading). Lanes beyond the cores
# time-share them, one thread each: a request that comes while every core is inside a long
# batch (a full-size stream's window of seconds) starts at once instead of waiting for one to
# end; load predicts them behind long batches only (LONG_BATCH_S). The busy-time score charges
# the sharing (two decodes on one core each take twice as long and are charged half), so
# oversubscribing wins only what it really serves.
# More than 4 is left to --lanes: each lane holds a batch's activations of its own.
CPU_LANE_CANDIDATES = (1, 2, 4)
LANES_PER_CORE = 2  # the most lanes the tuner tries per core
# A lone request measured to decode in less than this on its lane's threads runs on one thread.
# A second intra-op thread saves at most half of such a decode (tiny Qwen3-TTS's first window:
# 5.8 ms on one thread, 6.7 ms on two, eager and idle), while each parallel region makes the
# lane wait for both threads: when a core is busy elsewhere (the client that just sent the
# request, libgomp's idle threads spinning), the decode stalls 10-20 ms. On a 2-core CPU, a
# server trace: the 2-frame window's p90 17.8 ms on two threads; one worker's first-audio p95
# 102 ms, and 91-92 ms with these on one thread, against 94-95 ms with a decoder in the worker.
# A full-size decoder's windows (200 ms and more) and every batch under load keep every core.
ONE_THREAD_BELOW_NS = 10_000_000


class LaneControl:
    """The lanes running now (``lanes``), those started (``max_lanes``), and the tuner.

    Args:
        lanes: a fixed count, or None: tuned among ``CPU_LANE_CANDIDATES`` (up to
            ``LANES_PER_CORE x cores``) when ``tunable`` (a CPU with 2+ cores), else 1.
        cores: the intra-op threads the lanes share.
        tunable: the decoder runs on the CPU, not a device (nor a decoder playing one).
        pipelined: the lanes launch on a device (no thread count of their own).
        tuning: the tuner's knobs.
        on_change: called with the new count once the tuner changes it (the segment header).
    """

    def __init__(self, lanes: int | None, *, cores: int, tunable: bool, pipelined: bool,
                 tuning: LaneTuning | None, on_change: Callable[[int], None]) -> None:  # fmt: skip
        self.cores = cores
        self.pipelined = pipelined
        # One core runs one lane: nothing runs side by side there to weigh a shared core against.
        candidates = [c for c in CPU_LANE_CANDIDATES if c <= LANES_PER_CORE * cores] if cores > 1 else [1]
        self.tuner: LaneTuner | None = None
        if lanes is None and tunable and len(candidates) > 1:
            lanes = candidates[0]
            self.tuner = LaneTuner(candidates, lanes, tuning, predict=True, cores=cores)
        self.lanes = lanes or 1  # lanes taking batches now (the tuner may change it)
        self.max_lanes = candidates[-1] if self.tuner else self.lanes  # lane threads started
        self._on_change = on_change
        self._turns = threading.Condition()  # parked lanes wait here for their turn
        self._tuner_lock = threading.Lock()
        self._meter = BatchMeter()  # each batch's share of the time some lane was decoding

    @property
    def threads_per_lane(self) -> int | None:
        """Each CPU lane's share of the cores now (None on a device: the host threads only launch)."""
        return None if self.pipelined else max(1, self.cores // self.lanes)

    def thread_counts(self) -> list[int]:
        """Every intra-op thread count a lane may decode with: each arrangement's share of the
        cores, and one (``one_thread_pays``); none on a device (its lanes only launch)."""
        if self.pipelined:
            return []
        arrangements = self.tuner.candidates if self.tuner else [self.lanes]
        return sorted({1} | {max(1, self.cores // lanes) for lanes in arrangements})

    def turn(self, lane: int, stop: threading.Event, poll: float) -> tuple[int | None, bool]:
        """Block while ``lane`` is parked; then (its thread count for the next batch, whether
        it was parked), or (None, ...) once ``stop`` is set."""
        with self._turns:
            parked = False
            while lane >= self.lanes and not stop.is_set():
                parked = True
                self._turns.wait(poll)
            return (None if stop.is_set() else self.threads_per_lane), parked

    def wake(self) -> None:
        """Wake every parked lane to look at its stop event again (the server stops)."""
        with self._turns:  # a reentrant lock: safe from a signal handler of a lane's thread
            self._turns.notify_all()

    def one_thread_pays(self, batch: Batch, costs: BatchCosts) -> bool:
        """Decode ``batch`` on one thread although the calling lane has more: one row, nothing
        else waiting (``Batch.queued``), and its cost alone as measured (``costs.lone_ns``) on
        the lane's threads, or where those samples have aged out, on one thread, under
        ``ONE_THREAD_BELOW_NS``. Its cost then counts under one thread (``lane_threads()`` says
        1 while it runs), and the tuner leaves it out: it measures neither arrangement."""
        if self.pipelined or batch.audio is not None or len(batch.requests) != 1 or batch.queued != 1:
            return False
        predicted = costs.lone_ns(lane_threads(), batch.frames)
        if predicted is None:
            predicted = costs.lone_ns(1, batch.frames)
        return predicted is not None and predicted < ONE_THREAD_BELOW_NS

    def begin(self, batch: Batch) -> None:
        if self.tuner is not None:
            self._meter.begin(id(batch))

    def end(self, batch: Batch, *, settled: Callable[[int | None], bool]) -> Choice | None:
        """A lane finished ``batch``: give the tuner its sample and apply its choice.
        ``settled(threads)``: the batching policy of that thread count is measured too."""
        if self.tuner is None:
            return None
        req = batch.requests
        sample = self._meter.end(id(batch), planned_ns=batch.started_ns, tokens=int(req.lengths.sum()),
                                 rows=len(req), padded_tokens=len(req) * batch.frames,
                                 queued=batch.queued)  # fmt: skip
        # Only a batch decoded with the thread count of the arrangement being measured (right
        # after a switch, a lane being parked may still finish one with its old count), once
        # the batching policy is measured too (batch_costs.py): arrangements compare alike. The
        # load is read at once: how many requests decode together needs no settled policy.
        # Nor a batch that traced a graph (``Batch.warmup_ns``): a one-off 20-50 times a tiny
        # decoder's batch, which would read as a long batch and predict lanes sharing the cores.
        threads = lane_threads()
        if sample is None or batch.warmup_ns or threads != max(1, self.cores // self.tuner.lanes):
            return None
        if not self.tuner.reading_load and not settled(threads):
            return None
        with self._tuner_lock:
            choice = self.tuner.observe(sample)
        if choice is not None:
            with self._turns:
                self.lanes = choice.lanes
                self._turns.notify_all()
            self._on_change(choice.lanes)
        return choice

