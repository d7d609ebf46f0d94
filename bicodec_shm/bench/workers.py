"""The child processes of every system (module level, so that the spawn context can import
them; torch is imported only where a model lives, never by the bicodec-shm clients)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..batching import (
    Pending,
    plan_batch,
)
from ..transport import (
    HOP,
    N_GLOBAL,
)
from .config import LIMIT, PER_PROCESS, QUEUE, SHM, START_TIMEOUT, Policy
from .workload import GLOBAL_VOCAB, SEMANTIC_VOCAB, _requests


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


def _load_model(preset: str, seed: int, threads: int) -> Any:
    """Build, then warm up, a decoder (the first calls pay for lazy initialisation)."""
    import torch

    torch.set_num_threads(threads)
    from ..model import BiCodecDecoder

    # Spawned workers inherit the device through the environment (set by --device).
    model = BiCodecDecoder.from_config(preset, seed=seed).to(os.environ.get(DEVICE_ENV, "cpu"))
    semantic = torch.zeros(2, 25, dtype=torch.long)
    model.detokenize(semantic, torch.zeros(2, N_GLOBAL, dtype=torch.long), torch.tensor([25, 20]))
    model.detokenize(semantic[:1], torch.zeros(1, N_GLOBAL, dtype=torch.long))
    return model


def _to_int16(audio: np.ndarray) -> np.ndarray:
    """The server's conversion, so every system returns the same int16 PCM."""
    scaled = np.clip(audio, -1.0, 1.0)
    scaled *= 32767
    return scaled.astype(np.int16)


def _client_loop(index: int, requests: list, decode: Callable[[np.ndarray, np.ndarray], Any],
                 start: Any, events: Any) -> None:  # fmt: skip
    """Announce readiness, wait for the common start, then decode one request after another."""
    events.put(("ready", index))
    start.wait()
    for k, (semantic, speaker) in enumerate(requests):
        t0 = time.perf_counter()
        pcm = decode(semantic, speaker)
        t1 = time.perf_counter()
        if len(pcm) != HOP * len(semantic):
            raise RuntimeError(f"request {k}: {len(pcm)} samples, expected {HOP * len(semantic)}")
        # perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process of the machine.
        events.put(("done", index, t1 - t0, len(semantic), 1, t1))
    events.put(("exit", index))


def _shm_client(name: str, index: int, lengths: list[int], seed: int, timeout: float,
                start: Any, events: Any) -> None:  # fmt: skip
    _child_setup()
    with _reporting(events, f"{SHM} client {index}"):
        from ..client import DecoderClient

        requests = _requests(index, lengths, seed)
        # One slot: this worker has one request in flight at a time.
        with DecoderClient(name, slots=1, timeout=timeout, connect_timeout=START_TIMEOUT) as client:
            _client_loop(index, requests, client.decode, start, events)


class _RecordingDecoder:
    """Passes ``detokenize`` through to the model and appends each batch's lengths to a file."""

    def __init__(self, model: Any, path: str) -> None:
        self.model = model
        self.config = model.config
        self.device = model.device
        self._file = open(path, "a", buffering=1)  # line-buffered: complete lines survive a kill

    def detokenize(self, semantic_ids: Any, global_ids: Any, lengths: Any) -> Any:
        """(B, T) long, (B, 32) long, (B,) long -> (B, 320·T) float32."""
        self._file.write(" ".join(str(n) for n in lengths.tolist()) + "\n")
        return self.model.detokenize(semantic_ids, global_ids, lengths)


def _shm_server(name: str, preset: str, seed: int, threads: int, policy: Policy, slots: int,
                max_tokens: int, record_path: str | None, events: Any) -> None:  # fmt: skip
    with _reporting(events, f"{SHM} server"):
        from ..server import DecoderServer

        model = _load_model(preset, seed, threads)
        decoder = _RecordingDecoder(model, record_path) if record_path else model
        server = DecoderServer(decoder, name, slots=slots, max_batch=policy.max_batch,
                               max_wait_ms=policy.max_wait_ms,
                               max_batch_tokens=policy.max_batch_tokens,
                               max_tokens=max_tokens)  # fmt: skip
        # An orphaned server stops like a SIGTERMed one: finish the batch, unlink everything.
        _child_setup(on_orphan=server.stop)
        events.put(("ready", "server"))
        server.serve_forever()  # until SIGTERM (or SIGINT) from the parent


def _own_decoder_client(preset: str, seed: int, threads: int, index: int, lengths: list[int],
                        start: Any, events: Any) -> None:  # fmt: skip
    _child_setup()
    with _reporting(events, f"{PER_PROCESS} {index}"):
        import torch

        model = _load_model(preset, seed, threads)
        requests = _requests(index, lengths, seed)

        def decode(semantic: np.ndarray, speaker: np.ndarray) -> np.ndarray:
            audio = model.detokenize(torch.from_numpy(semantic)[None], torch.from_numpy(speaker)[None])
            return _to_int16(audio[0].cpu().numpy())

        _client_loop(index, requests, decode, start, events)


def _queue_client(index: int, lengths: list[int], seed: int, timeout: float, requests_q: Any,
                  reply_q: Any, start: Any, events: Any) -> None:  # fmt: skip
    _child_setup()
    with _reporting(events, f"{QUEUE} client {index}"):
        requests = _requests(index, lengths, seed)

        def decode(semantic: np.ndarray, speaker: np.ndarray) -> np.ndarray:
            requests_q.put((index, time.monotonic_ns(), semantic, speaker))
            return reply_q.get(timeout=timeout)

        _client_loop(index, requests, decode, start, events)


def _queue_server(preset: str, seed: int, threads: int, policy: Policy, requests_q: Any,
                  reply_qs: list, events: Any) -> None:  # fmt: skip
    """bicodec-shm's decode loop with the shared memory replaced by pickles through Queues."""
    _child_setup()
    with _reporting(events, f"{QUEUE} server"):
        import torch

        model = _load_model(preset, seed, threads)
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
            batch = plan_batch(pending, max_batch=policy.max_batch,
                               max_batch_tokens=policy.max_batch_tokens)  # fmt: skip
            taken = {p.slot for p in batch}
            pending[:] = [p for p in pending if p.slot not in taken]
            rows = [waiting.pop(p.slot) for p in batch]
            longest = batch[0].length
            semantic = np.zeros((len(rows), longest), np.int64)
            for j, (_, sem, _) in enumerate(rows):
                semantic[j, : len(sem)] = sem
            speakers = np.stack([spk for _, _, spk in rows])
            lengths = np.array([p.length for p in batch], np.int64)
            audio = model.detokenize(torch.from_numpy(semantic), torch.from_numpy(speakers),
                                     torch.from_numpy(lengths)).cpu().numpy()  # fmt: skip
            for j, (client, sem, _) in enumerate(rows):
                reply_qs[client].put(_to_int16(audio[j, : HOP * len(sem)]))
            hist[len(batch)] = hist.get(len(batch), 0) + 1
        events.put(("stats", hist))


def _limit_worker(preset: str, seed: int, threads: int, batches: list[list[int]],
                  start: Any, events: Any) -> None:  # fmt: skip
    """Replay recorded batches on the model, inputs built in advance: the best IPC could do."""
    _child_setup()
    with _reporting(events, LIMIT):
        import torch

        model = _load_model(preset, seed, threads)
        rng = np.random.default_rng([seed, 2])
        inputs = []
        for lengths in batches:
            semantic = rng.integers(0, SEMANTIC_VOCAB, (len(lengths), max(lengths)), dtype=np.int64)
            speakers = rng.integers(0, GLOBAL_VOCAB, (len(lengths), N_GLOBAL), dtype=np.int64)
            inputs.append((torch.from_numpy(semantic), torch.from_numpy(speakers),
                           torch.tensor(lengths, dtype=torch.long), lengths))  # fmt: skip
        events.put(("ready", "limit"))
        start.wait()
        for semantic, speakers, lengths, plain in inputs:
            t0 = time.perf_counter()
            model.detokenize(semantic, speakers, lengths).cpu().numpy()
            t1 = time.perf_counter()
            events.put(("done", "limit", t1 - t0, sum(plain), len(plain), t1))
        events.put(("exit", "limit"))
