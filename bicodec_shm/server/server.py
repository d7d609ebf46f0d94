"""The decoder server: owns the segment and the model; its lanes plan, decode and publish.

Threads of one ``DecoderServer``: K decode lanes (lanes.py), lane 0 in ``serve_forever``'s own
thread. Lanes take turns as the dispatcher (leader/followers): a free lane takes the dispatch
lock and::

    waits on the ready doorbell (in slices; it reaps slots of dead clients on each tick)
    takes req.I of each READY slot (the pairing operation; see transport.py)
    validates private copies of the headers, plans a batch (batching.py)
    copies and validates the ids the model will see, marks BUSY, holds the slots

then releases the lock (the next free lane plans the next batch) and, outside it::

    runs the batch on the device, converts on the device, copies to the host once
    publishes: PCM, fields, state, counters, posts; releases the slots

So a batch is planned only when a lane is free to run it (batches grow with the load instead of
being cut early), and a request never waits for a hand-off between threads. Slots in a planned
or running batch are *held*: the reaper never touches them, so no slot is reclaimed or
rewritten while a lane has it.

Lifecycle: the constructor owns the name (transport.py: locks, not pids) and starts serving;
``serve_forever`` runs until ``stop()``, SIGINT or SIGTERM; then every lane finishes the batch it
holds, the server stops serving (clients resubmit what is left, as after a crash: a rolling
restart loses nothing), unlinks everything and releases the name.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import posix_ipc
import torch

from ..errors import BiCodecShmError, ServerUnavailableError
from ..model.devices import exact_cuda_math
from ..protocol.layout import (
    CLAIMED,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MODE,
    DEFAULT_SLOTS,
    DEFAULT_START_WAIT,
    DONE,
    FREE,
    NO_BELL,
    READY,
    Phase,
    Status,
)
from ..protocol.names import validate_name
from ..protocol.segment import Segment, drain
from ..protocol.slot_io import Batch, Requests, check_headers, gather, publish, publish_failure, ring
from .adapters import codec_adapter
from .batching import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_WAIT_MS,
    DEFAULT_MIN_FILL,
    DEFAULT_REJOIN_MS,
    default_max_batch_tokens,
    plan_batch,
)
from .counters import Counters
from .lane_tuner import BatchMeter, LaneTuner, LaneTuning
from .lanes import STOP, Decoded, Lane, Runner, lane_threads
from .signals import on_stop_signals

log = logging.getLogger("bicodec_shm.server")

DEFAULT_REAP_INTERVAL = 0.25  # seconds; a dead client's slots come back within about this
# Lanes on CPU: the server measures which count serves best (lane_tuner.py) among these, up to
# the cores it has, starting from DEFAULT_CPU_LANES. More than 4 is left to --lanes: each lane
# holds a batch's activations of its own.
CPU_LANE_CANDIDATES = (1, 2, 4)
DEFAULT_CPU_LANES = 2
_COMING_BACK = frozenset((CLAIMED, DONE))  # an answered slot whose client may send again


class Detokenizer(Protocol):
    """What the server needs from a decoder (``BiCodecDecoder`` or a test double)."""

    def detokenize(
        self, semantic_ids: torch.Tensor, global_ids: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """(B, T) int64, (B, 32) int64, (B,) int64 host tensors -> (B, 320·T) float."""
        ...


class DecoderServer:
    """Serve ``decoder`` to every client process that attaches to ``name``.

    Args:
        decoder: any object with ``detokenize(semantic_ids, global_ids, lengths)``; its
            ``device`` (or its first parameter's device) decides where batches go.
        name: the segment name (letters, digits, ``_``, ``-``).
        slots: request slots shared by all clients (each costs max_tokens x 1280 bytes).
        max_batch: most rows in one forward pass.
        max_wait_ms: how long a batch may wait to grow once a lane is free (0: go at once).
        rejoin_ms: how long a free lane waits for the clients it has just answered to send their
            next request (it stops as soon as they have; 0: never waits).
        max_batch_tokens: padded-token budget per batch (rows x longest length), or None;
            "auto": 512 on CPU, 2400 on CUDA (batching.py says why).
        min_fill: a row joins a batch only if the batch's shortest row stays at least this
            share of its longest (0: no bound).
        max_tokens: longest request accepted (1500 tokens = 30 s).
        mode: permission bits of every object (0o600: this user only; 0o660: also the group).
        reap_interval: seconds between scans for slots of dead clients.
        lanes: decode lanes (threads sharing the weights, splitting the cores on CPU); None:
            1 on CUDA; on a CPU with 2+ cores, chosen while serving among 1, 2 and 4 lanes
            (up to the cores) by measuring each on the live traffic (lane_tuner.py).
        lane_tuning: the measuring's knobs (``LaneTuning``) when ``lanes`` is None on a CPU.
        start_wait: seconds to wait for a server that is stopping under the same name.
        metrics_port: serve Prometheus metrics on this TCP port (0: any free port; None: off).
            Needs the ``[metrics]`` extra (prometheus_client).
        metrics_host: the address the metrics endpoint binds to.
        reserved: the name's lock descriptor from ``transport.reserve_name``, taken before
            the model loaded; the segment is created on it (and it is released if creating
            the segment fails).
    """

    # Class-level defaults keep close() safe after a failed __init__.
    _segment: Segment | None = None
    _thread: threading.Thread | None = None
    _pid = 0  # the creating process (set in __init__)
    metrics: Any = None  # a metrics.MetricsExporter while one runs

    def __init__(
        self,
        decoder: Detokenizer,
        name: str,
        *,
        slots: int = DEFAULT_SLOTS,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
        rejoin_ms: float = DEFAULT_REJOIN_MS,
        max_batch_tokens: int | None | str = "auto",
        min_fill: float = DEFAULT_MIN_FILL,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        mode: int = DEFAULT_MODE,
        reap_interval: float = DEFAULT_REAP_INTERVAL,
        lanes: int | None = None,
        lane_tuning: LaneTuning | None = None,
        start_wait: float = DEFAULT_START_WAIT,
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",
        reserved: int | None = None,
    ) -> None:
        validate_name(name)
        if max_batch_tokens == "auto":
            max_batch_tokens = default_max_batch_tokens(_device_of(decoder).type)
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if rejoin_ms < 0:
            raise ValueError(f"rejoin_ms must be >= 0, got {rejoin_ms}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {max_batch_tokens}")
        if not 0.0 <= min_fill <= 1.0:
            raise ValueError(f"min_fill must be in [0, 1], got {min_fill}")
        if lanes is not None and not 1 <= lanes <= 64:
            raise ValueError(f"lanes must be in 1..64, got {lanes}")
        self.decoder = decoder
        self.name = name
        self.max_batch = max_batch
        self.max_wait_ms = max_wait_ms
        self.rejoin_ms = rejoin_ms
        self.max_batch_tokens = max_batch_tokens
        self.min_fill = min_fill
        self.reap_interval = reap_interval
        self.device = _device_of(decoder)
        cuda = self.device.type == "cuda"
        if cuda:
            exact_cuda_math()  # no TF32, deterministic cuDNN: batched rows stay exact
        self._cores = torch.get_num_threads()
        candidates = [c for c in CPU_LANE_CANDIDATES if c <= self._cores]
        self._tuner: LaneTuner | None = None
        # A decoder that plays a device (the bench's stand-in) is served as a GPU is: one lane
        # by default, not tuned; pipelined if it launches asynchronously (lanes.Runner).
        device_like = cuda or bool(getattr(decoder, "device_shaped", False))
        if lanes is None and not device_like and len(candidates) > 1:
            start = min(DEFAULT_CPU_LANES, candidates[-1])
            self._tuner = LaneTuner(candidates, start, lane_tuning)
            lanes = start
        self.lanes = lanes or 1  # lanes taking batches now (the tuner may change it)
        self.max_lanes = candidates[-1] if self._tuner else self.lanes  # lane threads started
        self._turns = threading.Condition()  # parked lanes wait here for their turn
        self._tuner_lock = threading.Lock()
        self._meter = BatchMeter()  # each batch's share of the time some lane was decoding
        self._pipeline = cuda or bool(getattr(decoder, "asynchronous", False))
        self.codec = codec_adapter(decoder).layout  # the served codec, named in the header
        self.semantic_vocab = self.codec.level_vocab[0]
        self.global_vocab = self.codec.global_vocab
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._forced = threading.Event()  # a second stop signal: do not wait for the lanes
        self._serving = threading.Event()  # serve_forever has begun (in whichever thread)
        self._stopped = threading.Event()
        self._teardown_lock = threading.Lock()
        self._held: set[int] = set()  # slots in planned or running batches
        self._held_lock = threading.Lock()
        self._counters = Counters()
        # READY slots whose req.I was taken, not yet batched -> when (monotonic ns): the batch
        # order goes by this, not by a time the client wrote.
        self._confirmed: dict[int, int] = {}
        # The validated private copies of the confirmed slots' headers, checked once, when
        # confirmed, in the chunks they were confirmed in: merged only when a batch is planned
        # (a wake-up of the fill window costs no concatenation). Rows of slots no longer
        # confirmed are dropped lazily.
        self._checked: list[Requests] = []
        self._answered: set[int] = set()  # slots answered since the last batch was planned
        self._dispatch = threading.Lock()  # held by the lane that plans the next batch
        self._next_reap = time.monotonic()
        self._lane_idle_since = [time.monotonic_ns()] * self.max_lanes
        self._segment = Segment.create(
            name,
            n_slots=slots,
            max_tokens=max_tokens,
            mode=mode,
            codec=self.codec,
            max_batch=max_batch,
            lanes=self.lanes,
            wait=start_wait,
            reserved=reserved,
        )
        self.n_bells = slots
        self._segment.start_serving()
        if metrics_port is not None:
            from .metrics import MetricsExporter  # needs prometheus_client: only on this path

            try:
                self.metrics = MetricsExporter(self._segment, port=metrics_port, host=metrics_host)
            except BaseException:
                self._teardown()
                raise
        log.info(
            "serving %r (%s): %d slots, max_tokens=%d, max_batch=%d, max_wait_ms=%g, rejoin_ms=%g, "
            "max_batch_tokens=%s, min_fill=%g, device=%s, lanes=%d%s (threads each: %s), mode=%o, "
            "segment %.1f MiB",
            name, self.codec.name, slots, max_tokens, max_batch, max_wait_ms, rejoin_ms,
            max_batch_tokens, min_fill, self.device, self.lanes,
            f" to start, measuring {self._tuner.candidates}" if self._tuner else "",
            self.threads_per_lane, mode,
            self._segment.layout.total_size / 2**20,
        )  # fmt: skip

    @property
    def threads_per_lane(self) -> int | None:
        """Each CPU lane's share of the cores now (None on CUDA: the host threads only launch)."""
        return None if self._pipeline else max(1, self._cores // self.lanes)

    @property
    def lane_choices(self) -> list:
        """Every lane-count decision so far (``lane_tuner.Choice``; empty with fixed lanes)."""
        return list(self._tuner.history) if self._tuner else []

    @property
    def segment(self) -> Segment:
        if self._segment is None:
            raise ServerUnavailableError(f"server {self.name!r} is closed")
        return self._segment

    # -- lifecycle ------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until ``stop()``, SIGINT or SIGTERM; then finish running batches and unlink.

        A second SIGINT or SIGTERM while the running batches finish forces the stop: the
        server stops serving and unlinks at once (clients resubmit what it had not answered)."""
        self._serving.set()
        restore = on_stop_signals(self._on_stop_signal)
        lanes = [
            Lane(i, Runner(self.decoder, self.device), take=self._take, publish=self._publish,
                 fail=self._fail_row,
                 started=self._lane_started, finished=self._lane_finished,
                 threads=self.threads_per_lane, pipeline=self._pipeline,
                 turn=self._turn if self._tuner else None)
            for i in range(self.max_lanes)
        ]  # fmt: skip
        threads: list[threading.Thread] = []
        try:
            threads = [lane.start_thread() for lane in lanes[1:]]
            lanes[0].run()
        finally:
            self.stop()
            for thread in threads:
                while thread.is_alive() and not self._forced.is_set():
                    thread.join(0.1)  # each finishes the batch it holds, unless forced
            # Our handlers stay until the segment is unlinked: a second signal during the
            # teardown must not kill the process half-way and leave the objects behind.
            try:
                self._teardown()
            finally:
                restore()
                self._stopped.set()

    def start_thread(self) -> threading.Thread:
        """Run ``serve_forever`` in a daemon thread (for in-process use and tests)."""
        thread = threading.Thread(target=self.serve_forever, name=f"bicodec-shm:{self.name}")
        thread.daemon = True
        self._thread = thread
        thread.start()
        return thread

    def stop(self) -> None:
        """Ask the server to finish the batches its lanes hold and exit (safe from any thread
        and from a signal handler); queued requests are left for the next server."""
        self._stop.set()
        seg = self._segment
        if seg is not None:
            try:
                # A hint for a successor started now (a rolling restart): wait for us rather
                # than give up because we still serve the batches we hold.
                if seg.header is not None:
                    seg.header["phase"] = Phase.STOPPING
                seg.ready.release()  # wake the dispatcher now rather than at the next tick
            except (posix_ipc.Error, BiCodecShmError, TypeError):
                pass

    def close(self, timeout: float = 30.0) -> None:
        """Stop serving and release everything; joins the serving thread first if there is one."""
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            self.stop()
            thread.join(timeout)
            if thread.is_alive():
                log.error("the serving thread of %r did not stop within %.0f s", self.name, timeout)
                return  # unmapping under a running thread would crash it
        elif self._serving.is_set() and not self._stopped.is_set():
            # ``serve_forever`` runs in a thread we did not start (a user's): it tears down
            # itself once stopped; unmapping under its lanes would crash them.
            self.stop()
            if not self._stopped.wait(timeout):
                log.error("serve_forever of %r did not stop within %.0f s", self.name, timeout)
            return
        self._teardown()

    def __enter__(self) -> DecoderServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<DecoderServer {self.name!r} device={self.device} lanes={self.lanes} "
                f"max_batch={self.max_batch}>")  # fmt: skip

    def _teardown(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked child's copy: the name, its locks and its thread are the parent's
        with self._teardown_lock:
            seg, self._segment = self._segment, None
            if seg is None:
                return
            metrics, self.metrics = self.metrics, None
            if metrics is not None:
                metrics.close()
            try:
                seg.stop_serving()  # clients resubmit whatever is still READY
                seg.unlink()
            finally:
                seg.close()
            log.info("stopped %r and unlinked its shared memory", self.name)

    # -- dispatching ------------------------------------------------------------------------

    def _take(self, block: bool) -> Batch | object | None:
        """The next batch for a free lane (see ``Lane``): ``STOP`` once stopping; None if
        ``block`` is False and nothing is ready."""
        with self._dispatch:
            if self._stop.is_set():
                return STOP
            batch = self._next_batch(block)
            return STOP if batch is None and self._stop.is_set() else batch

    def _turn(self, lane: int) -> int | None:
        """Block while ``lane`` is parked (the tuner runs fewer lanes); then its thread count
        for the next batch, or None once the server is stopping."""
        with self._turns:
            parked = False
            while lane >= self.lanes and not self._stop.is_set():
                parked = True
                self._turns.wait(self.reap_interval)
            if self._stop.is_set():
                return None
            if parked:  # parked is not idle: its gap to the next batch is not the host's
                self._lane_idle_since[lane] = time.monotonic_ns()
            return self.threads_per_lane

    def _apply_lanes(self, lanes: int) -> None:
        """Run ``lanes`` lanes from their next batch on (the tuner's choice)."""
        with self._turns:
            self.lanes = lanes
            self._turns.notify_all()
        seg = self._segment
        if seg is not None and seg.header is not None:
            seg.header["lanes"] = lanes  # stats and metrics show the lanes running now

    def _next_batch(self, block: bool) -> Batch | None:
        """Wait for ready requests; plan, gather and hold the next batch."""
        seg = self.segment
        while not self._stop.is_set():
            self._reap_if_due()
            waiting = self._scan(seg)
            if not waiting:
                if not block:
                    return None
                self._wait_doorbell(seg, max(0.0, self._next_reap - time.monotonic()))
                continue
            if self.rejoin_ms > 0 and waiting < self.max_batch:
                waiting = self._let_answered_clients_rejoin(seg, waiting)
            if self.max_wait_ms > 0 and waiting < self.max_batch:
                waiting = self._let_batch_grow(seg, waiting)
            if not waiting:  # every one left while we waited (reaped, say): look again
                continue
            ready = self._ready_requests()
            self._answered.clear()
            chosen = plan_batch(ready.lengths, ready.seen_ns, max_batch=self.max_batch,
                                max_batch_tokens=self.max_batch_tokens, min_fill=self.min_fill)  # fmt: skip
            req = ready.take(chosen)
            chosen_slots = req.slots.tolist()
            for slot in chosen_slots:
                self._confirmed.pop(slot, None)
            with self._held_lock:
                self._held.update(chosen_slots)
            batch, failures = gather(seg, req, semantic_vocab=self.semantic_vocab,
                                     global_vocab=self.global_vocab)  # fmt: skip
            for slot, status, message in failures:
                self._answer_failure(slot, status, message, req)
            if batch is not None:
                return batch
        return None

    def _ready_requests(self) -> Requests:
        """The confirmed requests found by ``_scan``, validated, as one ``Requests``."""
        chunks = self._checked
        if len(chunks) > 1:
            self._checked = chunks = [Requests.concat(chunks)]
        return chunks[0]

    def _scan(self, seg: Segment) -> int:
        """Confirm every READY slot whose request may be read (its req.I taken) and validate
        its header; returns how many confirmed requests wait (``_ready_requests``)."""
        drain(seg.ready)  # wake-ups only: everything READY is looked at below
        confirmed, held = self._confirmed, self._held  # (membership tests only: GIL-atomic)
        now = None
        new = []
        for slot in (seg.field["state"] == READY).nonzero()[0].tolist():  # a hint: req.I decides
            if slot not in confirmed and slot not in held and _take_post(seg.req(slot)):
                confirmed[slot] = now = now or time.monotonic_ns()
                new.append(slot)
        chunks = self._checked
        if chunks and sum(map(len, chunks)) != len(confirmed) - len(new):
            # Some left (batched, reaped, failed): keep the rows of the same confirmation (a
            # slot batched and confirmed again since has a new row, and new seen time).
            checked = Requests.concat(chunks)
            keep = [i for i, (s, t) in enumerate(zip(checked.slots.tolist(), checked.seen_ns.tolist()))
                    if confirmed.get(s) == t]  # fmt: skip
            chunks = [checked.take(np.asarray(keep, np.int64))] if keep else []
        if new:
            # Each header is copied and checked once, when its request is confirmed: its
            # private copy then stands (later client writes cannot reach it).
            slots = np.asarray(new, np.int64)
            requests, failures = check_headers(seg, slots, np.full(len(new), now, np.int64),
                                               n_bells=self.n_bells)  # fmt: skip
            for slot, status, message in failures:
                self._answer_failure(slot, status, message)
            if len(requests) != len(new):
                for slot in set(new) - set(requests.slots.tolist()):
                    confirmed.pop(slot, None)  # not READY after all, or answered above
            if len(requests):
                chunks = [*chunks, requests]
        self._checked = chunks
        return sum(map(len, chunks))

    def _let_answered_clients_rejoin(self, seg: Segment, waiting: int) -> int:
        """Wait up to rejoin_ms for the clients answered since the last batch was planned to
        send their next request, so that a busy client does not miss every other batch.

        Waits only for slots that are still owned and not READY again (CLAIMED or DONE): a
        client that gave its slot back, or is already in ``ready``, is not waited for. So at
        low load, once the one client is back, nothing more is waited."""
        states = seg.field["state"]

        def someone_may_come_back() -> bool:
            # A Python loop: np.isin costs ~40 us per call, a few slots here cost ~1 us.
            return any(int(states[slot]) in _COMING_BACK for slot in list(self._answered))

        return self._wait_for_more(seg, waiting, self.rejoin_ms, keep_waiting=someone_may_come_back)

    def _let_batch_grow(self, seg: Segment, waiting: int) -> int:
        """Wait up to max_wait_ms for more requests."""
        return self._wait_for_more(seg, waiting, self.max_wait_ms)

    def _wait_for_more(self, seg: Segment, waiting: int, wait_ms: float,
                       keep_waiting: Callable[[], bool] | None = None) -> int:  # fmt: skip
        """Take in whatever becomes ready for up to ``wait_ms``, sleeping on the doorbell (never
        spinning), until the batch is full or ``keep_waiting()`` turns False; returns how many
        confirmed requests wait then."""
        deadline = time.monotonic() + wait_ms / 1000
        while waiting < self.max_batch and not self._stop.is_set():
            if keep_waiting is not None and not keep_waiting():
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wait_doorbell(seg, left)
            waiting = self._scan(seg)
        return waiting

    def _wait_doorbell(self, seg: Segment, timeout: float) -> None:
        try:
            seg.ready.acquire(timeout)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            pass  # a timeout, or a signal handler ran: the loop re-checks _stop

    # -- answering --------------------------------------------------------------------------

    def _publish(self, batch: Batch, decoded: Decoded, elapsed_ns: int) -> None:
        """Answer every row of a decoded batch: audio, counters, then the posts.

        Every row is answered and rung whatever fails here (a failed write answers each row
        with an error instead): a batchmate's bad field, or a bug of ours, must not leave the
        others waiting for answers that never come."""
        seg = self.segment
        req = batch.requests
        try:
            done_ns = publish(seg, req, decoded.pcm16, decoded.rows16, decoded.pcm32, decoded.rows32)
        except Exception as exc:
            log.exception("publishing a batch of %d failed; answering each row with an error", len(req))
            for row in range(len(req)):
                self._answer_failure(int(req.slots[row]), Status.DECODE_FAILED,
                                     f"the server failed to publish the result: {exc}", req.take([row]))  # fmt: skip
            return
        try:
            self._count_batch(batch, done_ns, elapsed_ns)
        except Exception:
            log.exception("counting a batch of %d failed (its answers are unaffected)", len(req))
        finally:
            answered = req.slots.tolist()
            self._answered.update(answered)
            self._release_and_ring(answered, req.notify.tolist())

    def _count_batch(self, batch: Batch, done_ns: int, elapsed_ns: int) -> None:
        self._counters.count_batch(self.segment, batch, done_ns, elapsed_ns)

    def _release_and_ring(self, slots: list[int], bells: list[int]) -> None:
        """The last step of answering: the slots leave the held set, then their posts go out.

        Both under the held lock, which the reaper holds while it reclaims: so the reaper
        never frees a slot between its DONE and its post (a free must follow the server's last
        write and post), and a client answered here can make its slot READY again only after
        the slot left the held set, so the dispatcher never skips its next request (a lost
        wake-up: it would wait for the next tick of the reaper)."""
        with self._held_lock:
            self._held.difference_update(slots)
            ring(self.segment, slots, bells)

    def _fail_row(self, batch: Batch, row: int, message: str) -> None:
        req = batch.requests
        self._answer_failure(int(req.slots[row]), Status.DECODE_FAILED, message, req.take([row]))

    def _answer_failure(self, slot: int, status: int, message: str, req: Requests | None = None) -> None:
        """Answer one request with an error; ``req`` (if given) holds its validated header."""
        seg = self.segment
        ids = notify = None
        if req is not None:
            at = np.flatnonzero(req.slots == slot)
            if len(at):
                ids, notify = req.ids[at[0]], int(req.notify[at[0]])
        self._confirmed.pop(slot, None)
        # The answer first, then out of the held set and rung (``_release_and_ring``): the
        # reaper must not free the slot before the error is written and posted.
        bell = NO_BELL
        try:
            bell = publish_failure(seg, slot, status, message, ids=ids, notify=notify)
            self._counters.count_failure(seg, status)
        finally:
            self._release_and_ring([slot], [bell])

    def _lane_started(self, batch: Batch, lane: int) -> None:
        now = time.monotonic_ns()
        # The lane sat idle while this batch's first request was already waiting: time the
        # device waited for the host (gathering, planning, publishing, Python).
        waited_since = max(self._lane_idle_since[lane], int(batch.requests.submitted_ns.min()))
        self._counters.lane_started(self.segment, now - waited_since)
        if self._tuner is not None:
            self._meter.begin(id(batch))

    def _lane_finished(self, batch: Batch, lane: int) -> None:
        if self._tuner is not None:
            self._measure(batch)
        self._lane_idle_since[lane] = time.monotonic_ns()
        with self._held_lock:  # normally done already, when each row was answered
            self._held.difference_update(batch.slots.tolist())
        self._counters.lane_finished(self.segment)

    def _measure(self, batch: Batch) -> None:
        """Give the tuner a finished batch (in its lane's thread) and apply its choice."""
        req = batch.requests
        try:
            sample = self._meter.end(id(batch), planned_ns=batch.started_ns, tokens=int(req.lengths.sum()),
                                     rows=len(req), padded_tokens=len(req) * int(batch.semantic.shape[1]))
            # Only a batch decoded with the thread count of the arrangement being measured: right
            # after a switch, a lane being parked may still finish one with its old count.
            if sample is not None and lane_threads() == max(1, self._cores // self._tuner.lanes):
                with self._tuner_lock:
                    choice = self._tuner.observe(sample)
                if choice is not None:
                    self._apply_lanes(choice.lanes)
        except Exception:
            log.exception("measuring a batch of %d failed (its answers are unaffected)", len(req))

    # -- reaping ----------------------------------------------------------------------------

    def _reap_if_due(self) -> None:
        if time.monotonic() >= self._next_reap:
            self.reap()
            self._next_reap = time.monotonic() + self.reap_interval

    def reap(self) -> int:
        """Reclaim slots whose owner died; returns how many were reclaimed.

        A live owner holds its slot's lock for as long as it owns the slot. If the server can
        take that lock, the owner is gone (the kernel dropped the lock when it died). Slots held
        by a planned or running batch are left alone until their result is published.
        """
        seg = self.segment
        f = seg.field
        with self._held_lock:
            held = set(self._held)
        # Unknown state words come only from a buggy or hostile client: answer them here, at
        # the reaper's pace, rather than scan for them on every request.
        for slot in (f["state"] > DONE).nonzero()[0].tolist():
            if slot not in held:
                self._answer_failure(slot, Status.BAD_STATE,
                                     f"slot {slot} has unknown state value {int(f['state'][slot])}")
        reclaimed = 0
        # Under the held lock throughout: a lane answers a held slot (DONE, post) and lets go
        # of it in one step under this lock (``_release_and_ring``), so every slot freed here
        # has had its last write and post from the server.
        with self._held_lock:
            for slot in np.flatnonzero(f["state"] != FREE).tolist():
                if slot in self._held or not seg.try_lock_slot(slot):
                    continue  # in a batch, or its owner is alive
                if f["state"][slot] == FREE:
                    seg.unlock_slot(slot)  # given back between the scan and the lock
                    continue
                f["generation"][slot] += 1  # a late result can never match the next owner
                self._confirmed.pop(slot, None)
                try:
                    drain(seg.req(slot))  # the last owner's posts must not reach the next one
                    drain(seg.done(slot))
                finally:
                    seg.free_slot(slot)
                reclaimed += 1
        if reclaimed:
            self._counters.count_reclaimed(seg, reclaimed)
            # Not only the dead: an idle client leaves one warm slot unlocked (attachment.py),
            # and a request that timed out lets go of its slot; both come back here.
            log.info("reclaimed %d slot(s) nobody holds (a client died, timed out, or went idle)",
                     reclaimed)
        return reclaimed

    def _on_stop_signal(self, signum: int) -> None:
        if self._stop.is_set():
            log.warning("received %s again: stopping now, without waiting for the running "
                        "batches (their clients resubmit)", signal.Signals(signum).name)  # fmt: skip
            self._forced.set()
            return
        log.info("received %s: finishing the running batches, then stopping (send it again to "
                 "stop at once)", signal.Signals(signum).name)  # fmt: skip
        self.stop()


def _take_post(sem: posix_ipc.Semaphore) -> bool:
    """Take one post of ``sem`` if there is one, without blocking."""
    try:
        sem.acquire(0)
        return True
    except posix_ipc.BusyError:
        return False


def _device_of(decoder: object) -> torch.device:
    device = getattr(decoder, "device", None)
    if device is not None:
        return torch.device(device)
    parameters = getattr(decoder, "parameters", None)
    if callable(parameters):
        for p in parameters():
            return p.device
    return torch.device("cpu")

