"""The decoder server: owns the segment and the model; its lanes plan, decode and publish.

Threads of one ``DecoderServer``: K decode lanes (lanes.py), lane 0 in ``serve_forever``'s own
thread. Lanes take turns as the dispatcher (leader/followers): a free lane takes the dispatch
lock and::

    waits on the ready doorbell (in slices; it reaps slots of dead clients on each tick)
    takes req.I of each READY slot (the pairing operation; see protocol/segment.py)
    validates private copies of the headers, plans a batch (batching.py)
    copies and validates the ids the model will see, marks BUSY, holds the slots

then releases the lock (the next free lane plans the next batch) and, outside it::

    runs the batch on the device, converts on the device, copies to the host once
    publishes: PCM, fields, state, counters, posts; releases the slots

So a batch is planned only when a lane is free to run it (batches grow with the load instead of
being cut early), and a request never waits for a hand-off between threads. Slots in a planned
or running batch are *held*: the reaper never touches them, so no slot is reclaimed or
rewritten while a lane has it.

Lifecycle: the constructor owns the name (protocol/locks.py: locks, not pids) and starts serving;
``serve_forever`` runs until ``stop()``, SIGINT or SIGTERM; then every lane finishes the batch it
holds, the server stops serving (clients resubmit what is left, as after a crash: a rolling
restart loses nothing), unlinks everything and releases the name.

Encode requests (a server given an ``encoder``) take the same path as decodes (encoding.py); a
plan takes rows of one kind, with batch costs of their own (``_cost_key``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import posix_ipc
import torch

from ..errors import BiCodecShmError, ServerUnavailableError
from ..model.devices import exact_cuda_math
from ..protocol.layout import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_MODE,
    DEFAULT_SLOTS,
    DEFAULT_START_WAIT,
    NO_BELL,
    READY,
    Status,
)
from ..protocol.names import released_on_failure, validate_name
from ..protocol.posts import drain, post, take_post
from ..protocol.segment import Segment
from ..protocol.slot_io import Batch, Requests, check_headers, gather, publish_failure, ring
from .adapters import Detokenizer, codec_adapter, device_of
from .batch_costs import BATCHING_MODES, BatchPlanner
from .batching import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_WAIT_MS,
    DEFAULT_MIN_FILL,
    DEFAULT_REJOIN_MS,
    check_options,
    default_max_batch_tokens,
)
from .counters import Counters
from .dispatch_policy import DispatchPolicy
from .encoding import encoder_for, one_kind, publish_result
from .kernel_warmup import WARM_UP_ROWS, warm_up
from .lane_control import LaneControl
from .lane_tuner import LaneTuning
from .lanes import STOP, WAIT, Decoded, Lane, Runner, lane_threads
from .reaping import reap_dead_owners, slot_wanted
from .rejoin import Rejoin
from .signals import on_stop_signals

log = logging.getLogger("bicodec_shm.server")

DEFAULT_REAP_INTERVAL = 0.25  # seconds; a dead client's slots come back within about this


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
            next request (it stops as soon as they have; longer where they measure to take
            longer, up to 25 ms: dispatch_policy.py; 0: never waits).
        max_batch_tokens: padded-token budget per batch (rows x longest length), or None;
            "auto": 512 on CPU, 2400 on CUDA (batching.py says why).
        min_fill: a row joins a batch only if the batch's shortest row stays at least this
            share of its longest (0: no bound).
        max_tokens: longest request accepted (1500 tokens = 30 s).
        mode: who may attach (0o600: this user only; 0o660: also the group, over NAME.sock: the
            segment is then a sealed memfd, see protocol/handoff.py).
        reap_interval: seconds between scans for slots of dead clients.
        lanes: decode lanes (threads sharing the weights, splitting the cores on CPU); None:
            1 on CUDA; on a CPU with 2+ cores, predicted from the first batches' load, then
            chosen among 1, 2 and 4 (up to twice the cores) by measuring each live (lane_tuner.py).
        lane_tuning: the measuring's knobs (``LaneTuning``) when ``lanes`` is None on a CPU.
        batching: "auto": batch only where the batches measured so far say it pays
            (batch_costs.py), within the bounds above; "static": every row the bounds admit.
        dispatch: "auto": plan the next batch now or wait for the clients of the running one,
            whichever the measured costs and turnaround say serves more (dispatch_policy.py);
            "pipeline" or "wait" fixes it.
        start_wait: seconds to wait for a server that is stopping under the same name.
        metrics_port: serve Prometheus metrics on this TCP port (0: any free port; None: off).
            Needs the ``[metrics]`` extra (prometheus_client).
        metrics_host: the address the metrics endpoint binds to: the loopback (only this host
            scrapes) unless another is named ("0.0.0.0" exposes it on every IPv4 interface).
        reserved: the name's lock descriptor from ``protocol.names.reserve_name``, taken before
            the model loaded; the segment is created on it (and it is released if creating
            the segment fails).
        encoder: an encoder of the served codec (``BiCodecEncoder``) to answer encode requests
            (``DecoderClient.encode``) too; None: the server says in its header that it does not.
        warm_up_frames: on a CPU, window lengths (frames) whose kernels are built before the
            segment serves (kernel_warmup.py; ``serve`` passes the first stream windows).
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
        batching: str = "auto",
        dispatch: str = "auto",
        start_wait: float = DEFAULT_START_WAIT,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        reserved: int | None = None,
        encoder: Any = None,
        warm_up_frames: Sequence[int] = (),
    ) -> None:
        # Until the segment owns a name reserved while the model loaded, a failure releases it.
        with released_on_failure(reserved, name):
            validate_name(name)
            if max_batch_tokens == "auto":
                max_batch_tokens = default_max_batch_tokens(device_of(decoder).type)
            check_options(max_batch=max_batch, max_wait_ms=max_wait_ms, rejoin_ms=rejoin_ms,
                          max_batch_tokens=max_batch_tokens, min_fill=min_fill, lanes=lanes)  # fmt: skip
            if batching not in BATCHING_MODES:
                raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}, got {batching!r}")
            self.decoder = decoder
            self.name = name
            self.max_batch = max_batch
            self.max_wait_ms = max_wait_ms
            self.rejoin_ms = rejoin_ms
            self.max_batch_tokens = max_batch_tokens
            self.min_fill = min_fill
            self.reap_interval = reap_interval
            self.device = device_of(decoder)
            cuda = self.device.type == "cuda"
            if cuda:
                exact_cuda_math()  # no TF32, deterministic cuDNN: batched rows stay exact
            # A decoder that plays a device (the bench's stand-in) is served as a GPU is: one lane
            # by default, not tuned; pipelined if it launches asynchronously (lanes.Runner).
            device_like = cuda or bool(getattr(decoder, "device_shaped", False))
            self._pipeline = cuda or bool(getattr(decoder, "asynchronous", False))
            self._lanes = LaneControl(lanes, cores=torch.get_num_threads(), tunable=not device_like,
                                      pipelined=self._pipeline, tuning=lane_tuning,
                                      on_change=self._show_lanes)  # fmt: skip
            self.max_lanes = self._lanes.max_lanes  # lane threads started
            self._planner = BatchPlanner(max_batch=max_batch, max_batch_tokens=max_batch_tokens,
                                         min_fill=min_fill, measured=batching == "auto",
                                         prior_batches=device_like,
                                         latency_bound=not device_like)  # fmt: skip
            self._policy = DispatchPolicy(dispatch, rejoin_ms=rejoin_ms, pipelined=self._pipeline)
            self.codec = codec_adapter(decoder).layout  # the served codec, named in the header
            self._encoder = encoder_for(encoder, self.codec)  # its adapter, None without one
            if warm_up_frames and self.device.type == "cpu" and not device_like:
                warm_up(decoder, warm_up_frames, rows=min(WARM_UP_ROWS, max_batch),
                        thread_counts=self._lanes.thread_counts())  # fmt: skip
            self.semantic_vocab = self.codec.level_vocab[0]
            self.global_vocab = self.codec.global_vocab
            self._pid = os.getpid()
            self._stop = threading.Event()
            self._forced = threading.Event()  # a second stop signal: do not wait for the lanes
            self._serving = threading.Event()  # serve_forever has begun (in whichever thread)
            self._stopped = threading.Event()
            self._teardown_lock = threading.Lock()
            # Slots in planned or running batches -> the seen time of the request that holds each (a
            # new one for every confirmation: a slot held again, by another lane, is told apart).
            self._held: dict[int, int] = {}
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
            self._rejoin = Rejoin(self._policy, rejoin_ms)  # the answered clients a lane may wait for
            self._dispatch = threading.Lock()  # held by the lane that plans the next batch
            self._next_reap = time.monotonic()
            self._reap_asked = 0  # the header's ``slot_wanted`` when the reaper last ran (a hint)
            self._lane_idle_since = [time.monotonic_ns()] * self.max_lanes
        self._segment = Segment.create(
            name, n_slots=slots, max_tokens=max_tokens, mode=mode, codec=self.codec, max_batch=max_batch,
            lanes=self.lanes, wait=start_wait, reserved=reserved,
            encode_min_samples=0 if self._encoder is None else self._encoder.min_samples)  # fmt: skip
        self.n_bells = slots
        try:  # from here on, a failure (or a Ctrl-C's KeyboardInterrupt) unlinks what was made
            self._segment.start_serving()
            if metrics_port is not None:
                from .metrics import MetricsExporter  # needs prometheus_client: only on this path

                self.metrics = MetricsExporter(self._segment, port=metrics_port, host=metrics_host)
            log.info(
                "serving %r (%s): %d slots, max_tokens=%d, max_batch=%d, max_wait_ms=%g, rejoin_ms=%g, "
                "max_batch_tokens=%s, min_fill=%g, batching=%s, dispatch=%s, device=%s, lanes=%d%s "
                "(threads each: %s), mode=%o, segment %.1f MiB, encodes: %s",
                name, self.codec.name, slots, max_tokens, max_batch, max_wait_ms, rejoin_ms,
                max_batch_tokens, min_fill, batching, dispatch, self.device, self.lanes,
                f" to start, measuring {self._lanes.tuner.candidates}" if self._lanes.tuner else "",
                self.threads_per_lane, mode, self._segment.layout.total_size / 2**20,
                f"audio of {self._encoder.min_samples}..{self._segment.layout.max_audio_samples} samples"
                if self._encoder else "no (no --encode)",
            )  # fmt: skip
        except BaseException:
            self._teardown()
            raise

    @property
    def lanes(self) -> int:
        """The lanes taking batches now (the lane tuner may change it: lane_control.py)."""
        return self._lanes.lanes

    @property
    def threads_per_lane(self) -> int | None:
        """Each CPU lane's share of the cores now (None on CUDA: the host threads only launch)."""
        return self._lanes.threads_per_lane

    @property
    def lane_choices(self) -> list:
        """Every lane-count decision so far (``lane_tuner.Choice``; empty with fixed lanes)."""
        return list(self._lanes.tuner.history) if self._lanes.tuner else []

    @property
    def batching_choices(self) -> list:
        """Every change of the measured batching verdict (``batch_costs.BatchingChoice``)."""
        return list(self._planner.costs.history)

    @property
    def dispatch_choices(self) -> list:
        """Every change of the prevailing dispatch choice (``dispatch_policy.DispatchChoice``)."""
        return list(self._policy.history)

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
            Lane(i, Runner(self.decoder, self.device, self._encoder), take=self._take, publish=self._publish,
                 fail=self._fail_row,
                 started=self._lane_started, finished=self._lane_finished,
                 threads=self.threads_per_lane, pipeline=self._pipeline,
                 turn=self._turn if self._lanes.tuner else None,
                 one_thread=lambda b: self._lanes.one_thread_pays(b, self._planner.costs))
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
        and from a signal handler); queued requests are left for the next server. The bound:
        ``serve_forever`` returns once the batches running now are answered (nothing else it
        waits on, the doorbell or a parked lane's turn, outlasts a stop)."""
        self._stop.set()
        self._lanes.wake()  # parked lanes look at the stop now, not at their next poll
        seg = self._segment
        if seg is not None:
            try:
                # A hint for a successor started now (a rolling restart): wait for us rather
                # than give up because we still serve the batches we hold.
                seg.mark_stopping()
                post(seg.ready)  # wake the dispatcher now rather than at the next tick
            except (posix_ipc.Error, BiCodecShmError, TypeError, OSError):
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

    def _take(self, block: bool, running: Batch | None = None) -> Batch | object | None:
        """The next batch for a free lane (see ``Lane``): ``STOP`` once stopping; None if
        ``block`` is False and nothing is ready; ``WAIT`` if the dispatch policy would rather
        let ``running`` (the lane's batch in flight) end and its clients come back first."""
        with self._dispatch:
            self._rejoin.take_waited_ns()  # what this take waits on purpose is counted from here
            if self._stop.is_set():
                return STOP
            batch = self._next_batch(block, running)
            return STOP if batch is None and self._stop.is_set() else batch

    def _turn(self, lane: int) -> int | None:
        """Block while ``lane`` is parked (the tuner runs fewer lanes); then its thread count
        for the next batch, or None once the server is stopping."""
        threads, parked = self._lanes.turn(lane, self._stop, self.reap_interval)
        if parked:  # parked is not idle: its gap to the next batch is not the host's
            self._lane_idle_since[lane] = time.monotonic_ns()
        return threads

    def _show_lanes(self, lanes: int) -> None:
        seg = self._segment
        if seg is not None and seg.header is not None:
            seg.header["lanes"] = lanes  # stats and metrics show the lanes running now

    def _next_batch(self, block: bool, running: Batch | None = None) -> Batch | object | None:
        """Wait for ready requests; plan, gather and hold the next batch (or ``WAIT``)."""
        seg = self.segment
        while not self._stop.is_set():
            self._reap_if_due()
            waiting = self._scan(seg)
            if not waiting:
                if not block:
                    return None
                if slot_wanted(seg) != self._reap_asked:
                    # A claimer asked after the reap above, and its ``ready`` post went in
                    # the scan's drain: reap now, or it waits for the tick.
                    continue
                if self._stop.is_set():  # a stop since the loop's check: its post went in the
                    break  # scan's drain, and the doorbell would sleep until the reap tick
                self._wait_doorbell(seg, max(0.0, self._next_reap - time.monotonic()))
                continue
            if waiting < self.max_batch:  # the clients just answered, where waiting pays (rejoin.py)
                waiting = self._let_answered_clients_rejoin(seg, waiting, running is not None)
            if self.max_wait_ms > 0 and waiting < self.max_batch:
                waiting = self._let_batch_grow(seg, waiting)
            if not waiting:  # every one left while we waited (reaped, say): look again
                continue
            t0 = time.perf_counter_ns()
            everything = self._ready_requests()  # a batch runs one kind (only an encoder's server has two)
            ready, encode = one_kind(everything) if self._encoder is not None else (everything, False)
            key = self._cost_key(encode)
            if running is not None and self._wants_wait(ready, running.lengths.tolist(), key):
                self._rejoin.told_to_wait()
                return WAIT
            self._rejoin.answered.clear()
            # What is due soonest goes first: a stream whose listener is about to run dry before
            # one with seconds of audio buffered, a whole utterance when it was submitted.
            chosen = self._planner.plan(ready.lengths, ready.due(), key=key, max_rows=self._share(waiting))
            req = ready.take(chosen)
            chosen_slots = req.slots.tolist()
            for slot in chosen_slots:
                self._confirmed.pop(slot, None)
            with self._held_lock:
                self._held.update(zip(chosen_slots, req.seen_ns.tolist()))
            batch, failures = gather(seg, req, semantic_vocab=self.semantic_vocab,
                                     global_vocab=self.global_vocab)  # fmt: skip
            for slot, status, message in failures:
                self._answer_failure(slot, status, message, req)
            self._policy.host_step("plan", time.perf_counter_ns() - t0)
            if batch is not None:
                batch.queued = len(everything)  # its rows and those left for later
                return batch
        return None

    def _cost_key(self, encode: bool = False) -> Any:
        """Whose batch costs apply: the device's (None), or the calling CPU lane's thread count;
        for an encode batch, ``("encode", that)``: the encoder's costs are its own."""
        key = None if self._pipeline else lane_threads()
        return ("encode", key) if encode else key

    def _share(self, waiting: int) -> int | None:
        """A CPU lane's share of what waits, so that free lanes run in parallel (None: all)."""
        if self._pipeline or self.lanes < 2:
            return None
        return -(-waiting // max(1, self.lanes - self._counters.busy_lanes))

    def _wants_wait(self, ready: Requests, coming: list[int], key: int | None) -> bool:
        fit = self._planner.costs.fit(key)
        def predict(lengths: np.ndarray, seen: np.ndarray) -> np.ndarray:
            return self._planner.predict(lengths, seen, fit=fit, key=key)

        return self._policy.should_wait(ready.lengths, ready.seen_ns, coming, fit, predict)

    def _rejoin_pays(self, coming: list[int]) -> bool:
        """Wait for the answered clients of ``coming`` (their last lengths) before this plan?"""
        return self._wants_wait(self._ready_requests(), coming, self._cost_key())

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
            if slot not in confirmed and slot not in held and take_post(seg.req(slot)):
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
                self._policy.came_back(requests.slots, requests.submitted_ns)
        self._checked = chunks
        return sum(map(len, chunks))

    def _let_answered_clients_rejoin(self, seg: Segment, waiting: int, running: bool) -> int:
        """Wait for the clients answered since the last plan to send their next request, for as
        long as ``Rejoin.window_ms`` says (0: not at all), so that a busy client does not miss
        every other batch. Waits only while one of them is still owned and not READY again: at
        low load, once the one client is back, nothing more is waited."""
        states = seg.field["state"]
        window = self._rejoin.window_ms(states, running, self._rejoin_pays)
        return self._wait_for_more(seg, waiting, window,
                                   keep_waiting=lambda: self._rejoin.may_come_back(states))  # fmt: skip

    def _let_batch_grow(self, seg: Segment, waiting: int) -> int:
        """Wait up to max_wait_ms for more requests."""
        return self._wait_for_more(seg, waiting, self.max_wait_ms)

    def _wait_for_more(self, seg: Segment, waiting: int, wait_ms: float,
                       keep_waiting: Callable[[], bool] | None = None) -> int:  # fmt: skip
        """Take in whatever becomes ready for up to ``wait_ms``, sleeping on the doorbell (never
        spinning), until the batch is full or ``keep_waiting()`` turns False; returns how many
        confirmed requests wait then."""
        t0 = time.monotonic_ns()
        deadline = time.monotonic() + wait_ms / 1000
        while waiting < self.max_batch and not self._stop.is_set():
            if keep_waiting is not None and not keep_waiting():
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wait_doorbell(seg, left)
            waiting = self._scan(seg)
        self._rejoin.add_waited(time.monotonic_ns() - t0 if wait_ms > 0 else 0)  # held back on purpose
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
        t0 = time.perf_counter_ns()
        try:
            done_ns, moved = publish_result(seg, req, decoded)  # audio, or an encode's codes
        except Exception as exc:
            log.exception("publishing a batch of %d failed; answering each row with an error", len(req))
            for row in range(len(req)):
                message = f"the server failed to publish the result: {exc}"
                self._answer_failure(int(req.slots[row]), Status.DECODE_FAILED, message, req.take([row]))
            return
        try:
            self._counters.count_batch(seg, batch, done_ns, elapsed_ns)
            if moved:
                self._counters.count_dropped(seg, len(moved))
        except Exception:
            log.exception("counting a batch of %d failed (its answers are unaffected)", len(req))
        finally:
            moved_slots = [int(req.slots[i]) for i in moved]  # freed under the batch: never rung
            kept = req.take(np.setdiff1d(np.arange(len(req)), moved)) if moved else req
            answered = kept.slots.tolist()
            self._rejoin.answered.update(zip(answered, kept.lengths.tolist()))
            self._release_and_ring(answered, kept.notify.tolist(), moved_slots)
            self._policy.answered(answered, time.monotonic_ns())
            self._policy.host_step("publish", time.perf_counter_ns() - t0)
        try:  # after the posts: a refit of the costs (~1 ms) delays no answer
            self._measure_costs(batch, decoded)
        except Exception:
            log.exception("measuring a batch of %d failed (its answers are unaffected)", len(req))

    def _measure_costs(self, batch: Batch, decoded: Decoded) -> None:
        """Feed the batch cost fit (batch_costs.py) and the host's launch time (dispatch_policy.py)."""
        req = batch.requests
        if decoded.device_ns and not batch.warmup_ns:  # a batch that traced a graph paid a one-off
            self._planner.costs.add(self._cost_key(batch.audio is not None), len(req), batch.frames,
                                    int(req.lengths.sum()), decoded.device_ns)  # fmt: skip
        if decoded.launch_ns is not None:
            self._policy.host_step("launch", decoded.launch_ns)

    def _release_and_ring(self, slots: list[int], bells: list[int], moved: list[int] = ()) -> None:
        """The last step of answering: the slots leave the held set, then their posts go out.

        ``moved``: slots of the batch that are not answered (freed under it: ``moved_on``);
        they leave the held set unrung, and the dispatcher is woken, because a request their
        next owner made READY meanwhile was skipped while they were held.

        Both under the held lock, which the reaper holds while it reclaims: so the reaper
        never frees a slot between its DONE and its post (a free must follow the server's last
        write and post), and a client answered here can make its slot READY again only after
        the slot left the held set, so the dispatcher never skips its next request (a lost
        wake-up: it would wait for the next tick of the reaper)."""
        with self._held_lock:
            for slot in (*slots, *moved):
                self._held.pop(slot, None)
            ring(self.segment, slots, bells)
            if moved:
                post(self.segment.ready)

    def _fail_row(self, batch: Batch, row: int, message: str) -> None:
        req = batch.requests
        self._answer_failure(int(req.slots[row]), Status.DECODE_FAILED, message, req.take([row]))

    def _answer_failure(self, slot: int, status: int, message: str, req: Requests | None = None) -> None:
        """Answer one request with an error; ``req`` (if given) holds its validated header (and
        then a slot freed under it since is let go of unanswered: ``publish_failure``)."""
        seg = self.segment
        ids = notify = None
        if req is not None:
            at = np.flatnonzero(req.slots == slot)
            if len(at):
                ids, notify = req.ids[at[0]], int(req.notify[at[0]])
        self._confirmed.pop(slot, None)
        # The answer first, then out of the held set and rung (``_release_and_ring``): the
        # reaper must not free the slot before the error is written and posted.
        bell: int | None = NO_BELL
        try:
            bell = publish_failure(seg, slot, status, message, ids=ids, notify=notify)
            if bell is None:
                self._counters.count_dropped(seg, 1)
            else:
                self._counters.count_failure(seg, status)
        finally:
            self._release_and_ring(*(([], [], [slot]) if bell is None else ([slot], [bell])))

    def _lane_started(self, batch: Batch, lane: int) -> None:
        now = time.monotonic_ns()
        # The lane sat idle while this batch's first request was already waiting: time the
        # device waited for the host (gathering, planning, publishing, Python).
        # Less what the lane held it back on purpose (rejoin.py): counted apart, as waited.
        gap = now - max(self._lane_idle_since[lane], int(batch.requests.submitted_ns.min()))
        waited = min(max(0, gap), self._rejoin.take_waited_ns())
        self._counters.lane_started(self.segment, gap - waited, waited)
        self._lanes.begin(batch)

    def _lane_finished(self, batch: Batch, lane: int) -> None:
        try:
            self._lanes.end(batch, settled=self._planner.settled)
        except Exception:
            log.exception("measuring a batch of %d failed (its answers are unaffected)", len(batch.requests))
        self._lane_idle_since[lane] = time.monotonic_ns()
        with self._held_lock:  # normally done already, when each row was answered
            # Only the rows this batch still holds: a row answered already may be held again,
            # by another lane, for its client's next request.
            for slot, seen in zip(batch.slots.tolist(), batch.requests.seen_ns.tolist()):
                if self._held.get(slot) == seen:
                    del self._held[slot]
        self._counters.lane_finished(self.segment)

    # -- reaping ----------------------------------------------------------------------------

    def _reap_if_due(self) -> None:
        """Reap at each tick, and at once when a claimer asked for a slot: one that found no
        FREE slot stores a fresh value in the header's ``slot_wanted`` and posts ``ready``
        (attachment.py), because idle handles' warm slots come back only through a reap and
        a new handle must not wait a whole tick for one."""
        seg = self.segment
        wanted = slot_wanted(seg)
        asked, self._reap_asked = wanted != self._reap_asked, wanted
        if time.monotonic() >= self._next_reap:
            self.reap()
            seg.restore_description()  # what a client may have overwritten, from our own copies
            self._counters.restore(seg)
            self._next_reap = time.monotonic() + self.reap_interval
        elif asked:
            self.reap(asked=True)

    def reap(self, *, asked: bool = False) -> int:
        """Free the slots nobody holds (reaping.py): reclaimed from clients that died or gave
        up on a request, expired from idle handles; returns how many were freed.

        ``asked``: a claimer asked for a slot. What such a reap frees is mostly idle handles'
        warm slots, routine under many handles: counted, logged at DEBUG only."""
        return reap_dead_owners(self.segment, self._held_lock, self._held, self._confirmed,
                                answer_failure=self._answer_failure, counters=self._counters,
                                asked=asked)  # fmt: skip

    def _on_stop_signal(self, signum: int) -> None:
        if self._stop.is_set():
            log.warning("received %s again: stopping now, without waiting for the running "
                        "batches (their clients resubmit)", signal.Signals(signum).name)  # fmt: skip
            return self._forced.set()
        log.info("received %s: finishing the running batches, then stopping (send it again to "
                 "stop at once)", signal.Signals(signum).name)  # fmt: skip
        self.stop()

