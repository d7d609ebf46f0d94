"""The child processes of every system (module level, so that the spawn context can import
them; torch is imported only where a model lives, never by the bicodec-shm clients).

Every system decodes the same requests of the codec under test (``workload.request_stream``);
those without a server decode them with the server's own codec adapter (``decoding.py``)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ...codecs.layout import CodecLayout, get_layout
from .config import LIMIT, PER_PROCESS, QUEUE, SHM, START_TIMEOUT, ModelSpec, Policy
from .decoding import load_model
from .workload import Band, Pending, Request, plan, random_request, request_stream


def _child_setup(on_orphan: Callable[[], None] | None = None) -> None:
    """Leave Ctrl-C to the parent, which stops children in order; exit if the parent dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = mp.parent_process()
    assert parent is not None, "only for processes started by multiprocessing"

    def watch() -> None:
        parent.join()  # returns when the parent exits or dies
        (on_orphan or (lambda: os._exit(1)))()

    threading.Thread(target=watch, daemon=True, name="bench-orphan-watch").start()


@contextlib.contextmanager
def _reporting(events: Any, who: str) -> Iterator[None]:
    """Send a child's exception to the parent, which then stops the run with its traceback."""
    try:
        yield
    except BaseException:
        events.put(("error", who, traceback.format_exc()))
        raise


# A completed request or batch, as children report it at exit: (latency s, frames, rows, t1),
# t1 from perf_counter, which is CLOCK_MONOTONIC on Linux: one clock for every process.
Record = tuple[float, int, int, float]


def _to_int16(audio: np.ndarray) -> np.ndarray:
    """The server's conversion, so every system returns the same int16 PCM."""
    scaled = np.clip(audio, -1.0, 1.0)
    scaled *= 32767
    return scaled.astype(np.int16)


def _client_loop(index: int, requests: Iterable[Request], samples: Callable[[int], int],
                 decode: Callable[[Request], Any], start: Any, deadline: Any,
                 events: Any) -> None:  # fmt: skip
    """Announce readiness, wait for the common start, then decode one request after another
    until the window closes (``deadline``, a perf_counter value the parent sets just before
    the start) or the requests run out. A request sent before the close is finished; the
    parent then leaves it out. The records go to the parent once, at exit, so that no
    per-request IPC to the parent runs inside the window."""
    events.put(("ready", index))
    start.wait()
    end = deadline.value
    clock = time.perf_counter
    records: list[Record] = []
    for k, request in enumerate(requests):
        if clock() >= end:
            break
        t0 = clock()
        pcm = decode(request)
        t1 = clock()
        if len(pcm) != samples(request.frames):
            raise RuntimeError(f"request {k}: {len(pcm)} samples, expected {samples(request.frames)}")
        records.append((t1 - t0, request.frames, 1, t1))
    events.put(("exit", index, records))


def _numpy_client(codec: str, index: int, mix: Sequence[Band], seed: int,
                  count: int | None) -> tuple[Iterator[Request], int]:  # fmt: skip
    """Client ``index``'s requests of ``codec`` and its decode length (frames -> samples)."""
    layout = get_layout(codec)
    return request_stream(mix, seed, index, count, layout), layout.decoded_samples


def _shm_client(name: str, codec: str, index: int, mix: Sequence[Band], seed: int, count: int | None,
                timeout: float, start: Any, deadline: Any, events: Any) -> None:  # fmt: skip
    _child_setup()
    with _reporting(events, f"{SHM} client {index}"):
        from ...client.decoder_client import DecoderClient

        # One slot: this worker has one request in flight at a time.
        with DecoderClient(name, slots=1, timeout=timeout, connect_timeout=START_TIMEOUT) as client:

            def decode(request: Request) -> np.ndarray:
                return client.decode_codes(request.levels, global_ids=request.global_ids)

            _client_loop(index, *_numpy_client(codec, index, mix, seed, count), decode, start,
                         deadline, events)  # fmt: skip


class _RecordingDecoder:
    """The model, whose codec adapter (the server's only way to decode) appends each batch to a
    file: the perf_counter time it started, then its lengths. Any other attribute the server
    asks for is the model's own, so that a server using more of the model's interface sees it."""

    def __init__(self, model: Any, path: str) -> None:
        self.model = model
        self.config = getattr(model, "config", None)
        self.device = model.device
        # No O_CREAT: if the parent already gave up on this run (Ctrl-C during start-up) and
        # removed the file, fail here rather than leave a new one behind in /tmp.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._file = os.fdopen(fd, "a", buffering=1)  # line-buffered: complete lines survive a kill

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def codec_adapter(self) -> Any:
        from ...server.adapters import codec_adapter

        return _RecordingAdapter(codec_adapter(self.model), self._file)


class _RecordingAdapter:
    """A codec adapter that logs each batch it decodes (``_RecordingDecoder``)."""

    def __init__(self, adapter: Any, file: Any) -> None:
        self.adapter = adapter
        self.layout = adapter.layout
        self._file = file

    def detokenize(self, batch: Any) -> Any:
        """A gathered ``slot_io.Batch`` -> (B, decoded_samples(T)) float audio, as the wrapped
        adapter's."""
        started = time.perf_counter()
        out = self.adapter.detokenize(batch)
        self._record(started, batch)
        return out

    def launch(self, batch: Any) -> Any:
        """An asynchronous stand-in's launch (standin.py): (audio, event), recorded at launch."""
        started = time.perf_counter()
        out = self.adapter.launch(batch)
        self._record(started, batch)
        return out

    def _record(self, started: float, batch: Any) -> None:
        self._file.write(f"{started!r} " + " ".join(str(n) for n in batch.lengths.tolist()) + "\n")


def _show_lane_choices(phases_path: str | None = None) -> None:
    """Print the server's measured choices on stderr, with their numbers: lane counts
    (lane_tuner.py), batching (batch_costs.py) and dispatch (dispatch_policy.py); with
    ``phases_path``, also append the lane tuner's state at each of its choices to that file
    (``read_lane_phases``), so that the parent knows which windows overlapped an exploration."""
    import sys

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("\n  server: %(message)s"))
    tuner_log = logging.getLogger("bicodec_shm.server.lanes")
    for name in ("batching", "dispatch"):
        choices_log = logging.getLogger(f"bicodec_shm.server.{name}")
        choices_log.addHandler(handler)
        choices_log.setLevel(logging.INFO)
    tuner_log.addHandler(handler)
    tuner_log.setLevel(logging.INFO)
    if phases_path is not None:
        tuner_log.addHandler(_PhaseRecorder(phases_path))


class _PhaseRecorder(logging.Handler):
    """Each lane-tuner record that carries the tuner's state becomes a line ``perf_counter lanes
    exploring(0|1)`` of a file (perf_counter: the clock of the window)."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.INFO)
        # No O_CREAT, as _RecordingDecoder: the parent made the file and removes it.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._file = os.fdopen(fd, "a", buffering=1)  # line-buffered: complete lines survive a kill

    def emit(self, record: logging.LogRecord) -> None:
        lanes, exploring = getattr(record, "lanes", None), getattr(record, "exploring", None)
        if lanes is not None and exploring is not None:
            self._file.write(f"{time.perf_counter()!r} {int(lanes)} {int(bool(exploring))}\n")

    def close(self) -> None:
        self._file.close()
        super().close()


def read_lane_phases(path: str) -> list[tuple[float, int, bool]]:
    """The ``_PhaseRecorder`` lines of ``path``: (perf_counter, lanes, exploring), in order."""
    out = []
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) == 3:
                out.append((float(fields[0]), int(fields[1]), fields[2] == "1"))
    return out


def read_batches(path: str, t0: float, t_end: float) -> list[list[int]]:
    """The lengths of the batches in a ``_RecordingDecoder`` file that started in [t0, t_end]."""
    out = []
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1 and t0 <= float(fields[0]) <= t_end:
                out.append([int(x) for x in fields[1:]])
    return out


def _shm_server(name: str, spec: ModelSpec, threads: int, policy: Policy, slots: int,
                max_tokens: int, server_options: dict[str, Any], record_path: str,
                events: Any, phases_path: str | None = None) -> None:  # fmt: skip
    with _reporting(events, f"{SHM} server"):
        from ...server.server import DecoderServer

        decoder = _RecordingDecoder(load_model(spec, threads), record_path)
        options = {"slots": slots, "max_tokens": max_tokens, **server_options}
        _show_lane_choices(phases_path)
        server = DecoderServer(decoder, name, max_batch=policy.max_batch,
                               max_wait_ms=policy.max_wait_ms,
                               max_batch_tokens=policy.max_batch_tokens, **options)  # fmt: skip
        # An orphaned server stops like a SIGTERMed one: finish the batch, unlink everything.
        _child_setup(on_orphan=server.stop)
        events.put(("ready", "server"))
        server.serve_forever()  # until SIGTERM from the parent (SIGINT stays ignored: see above)


@contextlib.contextmanager
def _traced(lock: Any, trace: Any) -> Iterator[None]:
    """Hold ``lock``; with ``trace`` (a file), log entry and exit while holding it."""
    with lock:
        if trace is not None:
            trace.write(f"{os.getpid()} enter {time.perf_counter_ns()}\n")
        try:
            yield
        finally:
            if trace is not None:
                trace.write(f"{os.getpid()} exit {time.perf_counter_ns()}\n")


def _own_decoder_client(spec: ModelSpec, threads: int, index: int, mix: Sequence[Band],
                        count: int | None, lock: Any, trace_path: str | None, start: Any,
                        deadline: Any, events: Any) -> None:  # fmt: skip
    """A process with its own decoder. With the stand-in, every decode holds ``lock``, one
    lock across the processes: they time-slice one device, as processes sharing a GPU do."""
    _child_setup()
    with _reporting(events, f"{PER_PROCESS} {index}"):
        model = load_model(spec, threads)
        if spec.stand_in:  # numpy in, numpy out: this process never imports torch
            trace = open(trace_path, "a", buffering=1) if trace_path else None

            def decode(request: Request) -> np.ndarray:
                with _traced(lock, trace):
                    audio = model.detokenize(request.levels[0][None], request.global_ids[None])
                return _to_int16(audio[0])
        else:
            from ...server.adapters import codec_adapter
            from .decoding import as_batch, decode_rows

            adapter = codec_adapter(model)

            def decode(request: Request) -> np.ndarray:  # unpadded: one request alone
                return _to_int16(decode_rows(adapter, as_batch([request], adapter.layout))[0])

        _client_loop(index, *_numpy_client(spec.codec, index, mix, spec.seed, count), decode, start,
                     deadline, events)  # fmt: skip


def _queue_client(codec: str, index: int, mix: Sequence[Band], seed: int, count: int | None,
                  timeout: float, requests_q: Any, reply_q: Any, start: Any, deadline: Any,
                  events: Any) -> None:  # fmt: skip
    _child_setup()
    with _reporting(events, f"{QUEUE} client {index}"):

        def decode(request: Request) -> np.ndarray:
            requests_q.put((index, time.monotonic_ns(), request))
            return reply_q.get(timeout=timeout)

        _client_loop(index, *_numpy_client(codec, index, mix, seed, count), decode, start, deadline,
                     events)  # fmt: skip


def _queue_server(spec: ModelSpec, threads: int, policy: Policy, requests_q: Any, reply_qs: list,
                  deadline: Any, events: Any) -> None:  # fmt: skip
    """bicodec-shm's decode loop with the shared memory replaced by pickles through Queues.
    Its batch-size histogram counts the batches started before the window closed."""
    _child_setup()
    with _reporting(events, f"{QUEUE} server"):
        from ...server.adapters import codec_adapter
        from .decoding import as_batch, decode_rows

        adapter = codec_adapter(load_model(spec, threads))
        samples = adapter.layout.decoded_samples  # frames -> the decoder's length
        events.put(("ready", "server"))
        waiting: dict[int, tuple[int, Request]] = {}  # request id -> (client, request)
        pending: list[Pending] = []
        hist: dict[int, int] = {}
        ids = iter(range(1 << 62))
        stopping = False

        def take(item: Any) -> None:
            nonlocal stopping
            if item is None:
                stopping = True
                return
            client, submitted_ns, request = item
            rid = next(ids)
            waiting[rid] = (client, request)
            pending.append(Pending(rid, request.frames, submitted_ns))

        def drain(timeout: float | None) -> None:
            """Take what has arrived; block up to ``timeout`` for the first item (None: forever)."""
            with contextlib.suppress(queue.Empty):
                take(requests_q.get(timeout=timeout) if timeout != 0 else requests_q.get_nowait())
                while True:
                    take(requests_q.get_nowait())

        while not (stopping and not pending):
            drain(None if not pending and not stopping else 0)
            if not pending:
                continue
            if policy.max_wait_ms > 0 and len(pending) < policy.max_batch:  # as the server does
                deadline = time.monotonic() + policy.max_wait_ms / 1000
                while len(pending) < policy.max_batch and not stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    drain(left)
            batch = plan(pending, max_batch=policy.max_batch,
                               max_batch_tokens=policy.max_batch_tokens)  # fmt: skip
            taken = {p.key for p in batch}
            pending[:] = [p for p in pending if p.key not in taken]
            rows = [waiting.pop(p.key) for p in batch]
            if time.perf_counter() <= deadline.value:
                hist[len(batch)] = hist.get(len(batch), 0) + 1
            audio = decode_rows(adapter, as_batch([r for _, r in rows], adapter.layout))
            for j, (client, request) in enumerate(rows):
                reply_qs[client].put(_to_int16(audio[j, : samples(request.frames)]))
        events.put(("stats", hist))




def _limit_worker(spec: ModelSpec, threads: int, batches: list[list[int]], start: Any,
                  deadline: Any, events: Any) -> None:  # fmt: skip
    """Replay recorded batches on the model, inputs built in advance: the best IPC could do.
    In a window, the batches are replayed in a loop until it closes; else once."""
    _child_setup()
    with _reporting(events, LIMIT):
        from ...server.adapters import codec_adapter
        from .decoding import as_batch, decode_rows

        adapter = codec_adapter(load_model(spec, threads))
        layout: CodecLayout = adapter.layout
        rng = np.random.default_rng([spec.seed, 2])
        inputs = [(as_batch([random_request(rng, layout, n) for n in lengths], layout), lengths)
                  for lengths in batches]  # fmt: skip
        events.put(("ready", "limit"))
        start.wait()
        end = deadline.value
        clock = time.perf_counter
        records: list[Record] = []
        for batch, plain in itertools.cycle(inputs) if end < math.inf else inputs:
            if clock() >= end:
                break
            t0 = clock()
            decode_rows(adapter, batch)
            t1 = clock()
            records.append((t1 - t0, sum(plain), len(plain), t1))
        events.put(("exit", "limit", records))
