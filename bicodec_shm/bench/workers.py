"""The child processes of every system (module level, so that the spawn context can import
them; torch is imported only where a model lives, never by the bicodec-shm clients)."""

from __future__ import annotations

import contextlib
import itertools
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

from ..transport import HOP, N_GLOBAL
from .config import LIMIT, PER_PROCESS, QUEUE, SHM, START_TIMEOUT, ModelSpec, Policy
from .standin import StandInDecoder
from .workload import GLOBAL_VOCAB, SEMANTIC_VOCAB, Band, Pending, plan, request_stream


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


DEVICE_ENV = "BICODEC_SHM_BENCH_DEVICE"

# A completed request or batch, as children report it at exit: (latency s, tokens, rows, t1),
# t1 from perf_counter, which is CLOCK_MONOTONIC on Linux: one clock for every process.
Record = tuple[float, int, int, float]


def _load_model(spec: ModelSpec, threads: int) -> Any:
    """Build, then warm up, a decoder (the first calls pay for lazy initialisation)."""
    if spec.stand_in:
        # no torch, nothing to warm up
        return StandInDecoder(a_ms=spec.a_ms, b_ms=spec.b_ms, asynchronous=spec.asynchronous)
    import torch

    torch.set_num_threads(threads)
    from ..model import BiCodecDecoder
    from ..model.devices import exact_cuda_math

    # Spawned workers inherit the device through the environment (set by --device).
    device = torch.device(os.environ.get(DEVICE_ENV, "cpu"))
    if device.type == "cuda":
        # Every system, not only bicodec-shm's DecoderServer, runs with the server's math: a
        # baseline left at cuDNN's TF32 default would be faster for that alone.
        exact_cuda_math()
    model = BiCodecDecoder.from_config(spec.preset, seed=spec.seed).to(device)
    semantic = torch.zeros(2, 25, dtype=torch.long)
    model.detokenize(semantic, torch.zeros(2, N_GLOBAL, dtype=torch.long), torch.tensor([25, 20]))
    model.detokenize(semantic[:1], torch.zeros(1, N_GLOBAL, dtype=torch.long))
    return model


def _to_int16(audio: np.ndarray) -> np.ndarray:
    """The server's conversion, so every system returns the same int16 PCM."""
    scaled = np.clip(audio, -1.0, 1.0)
    scaled *= 32767
    return scaled.astype(np.int16)


def _client_loop(index: int, requests: Iterable[tuple[np.ndarray, np.ndarray]],
                 decode: Callable[[np.ndarray, np.ndarray], Any], start: Any, deadline: Any,
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
    for k, (semantic, speaker) in enumerate(requests):
        if clock() >= end:
            break
        t0 = clock()
        pcm = decode(semantic, speaker)
        t1 = clock()
        if len(pcm) != HOP * len(semantic):
            raise RuntimeError(f"request {k}: {len(pcm)} samples, expected {HOP * len(semantic)}")
        records.append((t1 - t0, len(semantic), 1, t1))
    events.put(("exit", index, records))


def _shm_client(name: str, index: int, mix: Sequence[Band], seed: int, count: int | None,
                timeout: float, start: Any, deadline: Any, events: Any) -> None:  # fmt: skip
    _child_setup()
    with _reporting(events, f"{SHM} client {index}"):
        from ..client import DecoderClient

        # One slot: this worker has one request in flight at a time.
        with DecoderClient(name, slots=1, timeout=timeout, connect_timeout=START_TIMEOUT) as client:
            _client_loop(index, request_stream(mix, seed, index, count), client.decode, start,
                         deadline, events)  # fmt: skip


class _RecordingDecoder:
    """Passes ``detokenize`` through to the model and appends each batch to a file: the
    perf_counter time it started, then its lengths. Any other attribute the server asks for
    is the model's own, so that a server using more of the model's interface sees it."""

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

    def detokenize(self, semantic_ids: Any, global_ids: Any, lengths: Any) -> Any:
        """(B, T) long, (B, 32) long, (B,) long -> (B, 320·T) float32."""
        started = time.perf_counter()
        out = self.model.detokenize(semantic_ids, global_ids, lengths)
        self._record(started, lengths)
        return out

    def launch(self, semantic_ids: Any, global_ids: Any, lengths: Any) -> Any:
        """An asynchronous stand-in's launch (standin.py), recorded when launched."""
        started = time.perf_counter()
        out = self.model.launch(semantic_ids, global_ids, lengths)
        self._record(started, lengths)
        return out

    def _record(self, started: float, lengths: Any) -> None:
        self._file.write(f"{started!r} " + " ".join(str(n) for n in lengths.tolist()) + "\n")


def _show_lane_choices() -> None:
    """Print the server's lane-count choices (lane_tuner.py) on stderr, with their numbers."""
    import logging
    import sys

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("\n  server: %(message)s"))
    tuner_log = logging.getLogger("bicodec_shm.server.lanes")
    tuner_log.addHandler(handler)
    tuner_log.setLevel(logging.INFO)


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
                events: Any) -> None:  # fmt: skip
    with _reporting(events, f"{SHM} server"):
        from ..server import DecoderServer

        decoder = _RecordingDecoder(_load_model(spec, threads), record_path)
        options = {"slots": slots, "max_tokens": max_tokens, **server_options}
        _show_lane_choices()
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
        model = _load_model(spec, threads)
        if spec.stand_in:
            trace = open(trace_path, "a", buffering=1) if trace_path else None

            def decode(semantic: np.ndarray, speaker: np.ndarray) -> np.ndarray:
                with _traced(lock, trace):
                    audio = model.detokenize(semantic[None], speaker[None])
                return _to_int16(audio[0])
        else:
            import torch

            def decode(semantic: np.ndarray, speaker: np.ndarray) -> np.ndarray:
                audio = model.detokenize(torch.from_numpy(semantic)[None],
                                         torch.from_numpy(speaker)[None])  # fmt: skip
                return _to_int16(audio[0].cpu().numpy())

        _client_loop(index, request_stream(mix, spec.seed, index, count), decode, start, deadline,
                     events)  # fmt: skip


def _queue_client(index: int, mix: Sequence[Band], seed: int, count: int | None, timeout: float,
                  requests_q: Any, reply_q: Any, start: Any, deadline: Any,
                  events: Any) -> None:  # fmt: skip
    _child_setup()
    with _reporting(events, f"{QUEUE} client {index}"):

        def decode(semantic: np.ndarray, speaker: np.ndarray) -> np.ndarray:
            requests_q.put((index, time.monotonic_ns(), semantic, speaker))
            return reply_q.get(timeout=timeout)

        _client_loop(index, request_stream(mix, seed, index, count), decode, start, deadline, events)


def _queue_server(spec: ModelSpec, threads: int, policy: Policy, requests_q: Any, reply_qs: list,
                  deadline: Any, events: Any) -> None:  # fmt: skip
    """bicodec-shm's decode loop with the shared memory replaced by pickles through Queues.
    Its batch-size histogram counts the batches started before the window closed."""
    _child_setup()
    with _reporting(events, f"{QUEUE} server"):
        import torch

        model = _load_model(spec, threads)
        events.put(("ready", "server"))
        waiting: dict[int, tuple] = {}  # request id -> (client, semantic, speaker)
        pending: list[Pending] = []
        hist: dict[int, int] = {}
        ids = iter(range(1 << 62))
        stopping = False

        def take(item: Any) -> None:
            nonlocal stopping
            if item is None:
                stopping = True
                return
            client, submitted_ns, semantic, speaker = item
            rid = next(ids)
            waiting[rid] = (client, semantic, speaker)
            pending.append(Pending(rid, len(semantic), submitted_ns))

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
            longest = batch[0].length
            semantic = np.zeros((len(rows), longest), np.int64)
            for j, (_, sem, _) in enumerate(rows):
                semantic[j, : len(sem)] = sem
            speakers = np.stack([spk for _, _, spk in rows])
            lengths = np.array([p.length for p in batch], np.int64)
            if time.perf_counter() <= deadline.value:
                hist[len(batch)] = hist.get(len(batch), 0) + 1
            audio = model.detokenize(torch.from_numpy(semantic), torch.from_numpy(speakers),
                                     torch.from_numpy(lengths)).cpu().numpy()  # fmt: skip
            for j, (client, sem, _) in enumerate(rows):
                reply_qs[client].put(_to_int16(audio[j, : HOP * len(sem)]))
        events.put(("stats", hist))




def _limit_worker(spec: ModelSpec, threads: int, batches: list[list[int]], start: Any,
                  deadline: Any, events: Any) -> None:  # fmt: skip
    """Replay recorded batches on the model, inputs built in advance: the best IPC could do.
    In a window, the batches are replayed in a loop until it closes; else once."""
    _child_setup()
    with _reporting(events, LIMIT):
        import torch

        model = _load_model(spec, threads)
        rng = np.random.default_rng([spec.seed, 2])
        inputs = []
        for lengths in batches:
            semantic = rng.integers(0, SEMANTIC_VOCAB, (len(lengths), max(lengths)), dtype=np.int64)
            speakers = rng.integers(0, GLOBAL_VOCAB, (len(lengths), N_GLOBAL), dtype=np.int64)
            inputs.append((torch.from_numpy(semantic), torch.from_numpy(speakers),
                           torch.tensor(lengths, dtype=torch.long), lengths))  # fmt: skip
        events.put(("ready", "limit"))
        start.wait()
        end = deadline.value
        clock = time.perf_counter
        records: list[Record] = []
        for semantic, speakers, lengths, plain in itertools.cycle(inputs) if end < math.inf else inputs:
            if clock() >= end:
                break
            t0 = clock()
            model.detokenize(semantic, speakers, lengths).cpu().numpy()
            t1 = clock()
            records.append((t1 - t0, sum(plain), len(plain), t1))
        events.put(("exit", "limit", records))
