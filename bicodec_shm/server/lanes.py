"""Decode lanes: the server's threads that plan, run and publish batches.

A free lane plans the next ``Batch`` (slot_io.py) itself (lanes take turns as dispatcher),
runs it through the decoder, converts the audio to each row's output dtype *on the device*
(int16 rows come back at half the bytes), copies it to the host once, and publishes it.

- **CPU**: K lanes share one copy of the weights and split the cores between them (each lane
  sets its own intra-op thread count). Which K serves best depends on the machine and the
  traffic, so by default the server measures it while serving (lane_tuner.py) and parks the
  lanes it does not need: a lane asks for its *turn* before each batch, which tells it its
  thread count or parks it. Each lane runs one batch at a time.
- **CUDA**: one lane by default. It pipelines: it launches batch k, then publishes batch k-1
  (whose device-to-host copy into a pinned buffer an event guards) while k runs. Two pinned
  buffers alternate so that k's copy never overwrites what k-1's publishing reads. Each lane
  thread makes the model's GPU its current device, and the event is recorded on that GPU's
  current stream, the one the decode and the copy were queued on.
- **An asynchronous decoder with host output** (``launch()``, adapters.py; the bench's
  ``modern`` stand-in): pipelined as on CUDA. Its output is complete only once its event is
  synchronized, so the conversion to each row's dtype waits for that, and writes into one of two
  alternating sets of host buffers: batch k is launched before batch k-1 is converted and
  published, and must not convert into the buffers that k-1's answers are read from.
- **Failures**: a batch that raises is split in halves and each half retried; a row that fails
  alone gets DECODE_FAILED and everyone else their audio. Retries are synchronous and use a
  third set of buffers of their own (pinned on CUDA): a pipelined batch whose audio is not yet
  published keeps its buffers whatever fails around it.

- **Encode batches** (audio in, codes back; a server started with an encoder) run through
  the encoder synchronously, on any lane, and come back as ``Encoded`` codes instead of audio;
  the rest (split-and-retry, publishing, releasing) is the decode's own.

Every buffer a launch writes is its batch's until the batch is published: the inputs are the
batch's own copies (slot_io.gather), the decoder's output is that launch's own (adapters.py),
and the staging and conversion buffers come in the sets above.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..model.traced import take_warmup_ns
from ..protocol.slot_io import Batch
from .adapters import codec_adapter

log = logging.getLogger("bicodec_shm.server")


@dataclass
class Decoded:
    """A batch's audio on the host, ready to publish: ``pcm16`` (B16, N) int16 for the rows
    ``rows16``, ``pcm32`` (B32, N) float32 for the rows ``rows32`` (indices into the batch).

    ``device_ns``: what the batch cost the device (a CUDA or stand-in batch's own time on its
    timeline; a synchronous decode and its conversion), None if unknown; ``launch_ns``: the
    host's time to launch an asynchronous batch (None for a synchronous one, whose launch is
    its decode). The server fits its batch costs and dispatch policy on them."""

    pcm16: np.ndarray | None
    rows16: np.ndarray
    pcm32: np.ndarray | None
    rows32: np.ndarray
    device_ns: int | None = None
    launch_ns: int | None = None


class _InFlight:
    """A launched batch whose host copy may still be under way (CUDA), whose host output is
    still being written (an asynchronous decoder on the host), or which is done (CPU).

    ``finish``: what turns the output into ``Decoded`` once the event has completed (the
    conversion of a host output, which cannot start before then); None if ``decoded`` is it."""

    def __init__(self, batch: Batch, decoded: Decoded | None, t0: int, event: Any = None,
                 finish: Callable[[], Decoded] | None = None, started: Any = None) -> None:  # fmt: skip
        self.batch, self.decoded, self.event = batch, decoded, event
        self._finish = finish
        self._started = started  # CUDA: a timing event recorded before the batch's first kernel
        self.t0 = t0  # perf_counter_ns at launch
        self.launch_ns = time.perf_counter_ns() - t0 if event is not None else None

    def wait(self) -> Decoded:
        """The batch's audio on the host (waited for; called once)."""
        if self.event is not None:
            self.event.synchronize()  # the host copy has landed, or the host output is written
        if self._finish is not None:
            self.decoded, self._finish = self._finish(), None
        if self.event is not None:
            self.decoded.device_ns = _device_ns(self.event, self._started)
            self.decoded.launch_ns = self.launch_ns
        return self.decoded


@dataclass
class Encoded:
    """An encode batch's codes on the host, ready to publish (``slot_io.publish_codes``):
    ``codes`` every level's (B, r_i·T) int32 codes, coarsest first; ``global_ids`` (B,
    n_global) int32; ``frames`` (B,) int64 each row's own frames. ``device_ns`` and
    ``launch_ns`` as ``Decoded``'s."""

    codes: list[np.ndarray]
    global_ids: np.ndarray
    frames: np.ndarray
    device_ns: int | None = None
    launch_ns: int | None = None


def _device_ns(event: Any, started: Any) -> int | None:
    """A completed batch's own time on its device: between two CUDA timing events, or what an
    asynchronous decoder's event says (``device_seconds``; the stand-in's); None if neither."""
    if started is not None:
        return int(started.elapsed_time(event) * 1e6)  # ms between the events, on the device
    seconds = getattr(event, "device_seconds", None)
    return None if seconds is None else int(seconds * 1e9)


_ALL = np.arange(256)  # row indices, made once
# The clip ufunc itself: np.clip's Python wrapper costs more than the clipping of a row.
_clip = getattr(np, "_core", getattr(np, "core", None)).umath.clip
_NONE = np.zeros(0, np.int64)


class Runner:
    """Runs batches on the decoder's device; returns host arrays of each row's output dtype.

    Args:
        decoder: ``detokenize(semantic (B,T) int64, global (B,32) int64, lengths (B,) int64)``
            -> float (B, >= decoded_samples(T)) on its device. Given host tensors: it moves them itself.
            A decoder of another codec provides ``codec_adapter()`` (adapters.py).
        device: where the decoder's output lives.
        encoder: the encode adapter (adapters.encode_adapter) of a server that encodes, or None.
    """

    def __init__(self, decoder: Any, device: torch.device, encoder: Any = None) -> None:
        self.decoder = decoder
        self.encoder = encoder
        self.adapter = codec_adapter(decoder)  # how this codec's decoder takes a batch
        self._samples = self.adapter.layout.decoded_samples  # frames -> the decoder's length
        if device.type == "cuda" and device.index is None:  # "cuda": the current GPU, named
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.cuda = device.type == "cuda"
        # A decoder that plays an asynchronous device (the bench's stand-in): launched like a
        # CUDA batch, waited for through its event.
        self.asynchronous = bool(getattr(decoder, "asynchronous", False)) and hasattr(self.adapter, "launch")
        # Two alternating sets for pipelined launches, and one for retries (see launch): pinned
        # buffers for CUDA's device-to-host copies, host buffers for a CPU conversion.
        self._pinned: list[dict[torch.dtype, torch.Tensor]] = [{}, {}]
        self._retry_pinned: dict[torch.dtype, torch.Tensor] = {}
        self._host: list[dict[type, np.ndarray]] = [{}, {}]
        self._retry_host: dict[type, np.ndarray] = {}
        self._flip = 0

    def launch(self, batch: Batch, *, retry: bool = False) -> _InFlight:
        """Queue ``batch``'s decode and its copy to the host; on CUDA nothing waits for the device.

        ``retry``: a synchronous decode (waited for before the next launch), which copies into
        the retry buffers and leaves the two pipelined sets, and whatever batch they hold
        unpublished, alone. Otherwise the sets alternate: a launch's buffers stay its own until
        the launch after next, so batch k-1 may be published after batch k is launched.
        """
        t0 = time.perf_counter_ns()
        if batch.audio is not None:
            return self._encode(batch, t0)
        b, t = batch.semantic.shape
        n = self._samples(t)
        event = started = None
        if self.cuda:  # times the batch on the device: from before its first kernel to its copies
            started = torch.cuda.Event(enable_timing=True)
            started.record(torch.cuda.current_stream(self.device))
        take_warmup_ns()  # a trace before this launch is none of this batch's
        if self.asynchronous:
            out, event = self.adapter.launch(batch)
        else:
            out = self.adapter.detokenize(batch)
        batch.warmup_ns = take_warmup_ns()  # graphs traced on the way: a one-off, no batch cost
        if out.dim() != 2 or out.shape[0] != b or out.shape[1] < n:
            raise RuntimeError(f"decoder returned shape {tuple(out.shape)}, expected ({b}, {n})")
        dtypes = batch.requests.dtypes
        n16 = int(np.count_nonzero(dtypes == 0))
        if n16 == b:  # the common case: every row wants int16
            rows16, rows32 = _ALL[:b] if b <= len(_ALL) else np.arange(b), _NONE
        else:
            rows16, rows32 = np.flatnonzero(dtypes == 0), np.flatnonzero(dtypes != 0)
        # This launch's buffers: the retry set, or the next of the two pipelined sets.
        if retry:
            pinned, host = self._retry_pinned, self._retry_host
        else:
            pinned, host = self._pinned[self._flip], self._host[self._flip]
            self._flip ^= 1
        if not self.cuda:

            def convert() -> Decoded:
                # numpy on the CPU: a numpy call costs about a third of a torch call here, and the
                # conversion goes into buffers of this launch's own (no fresh pages per batch, and
                # the decoder's own output is never changed in place).
                audio = out.detach().float().numpy()[:, :n]  # (B, N) float32, a view
                host16 = self._to_int16(audio if n16 == b else audio[rows16], host) if n16 else None
                host32 = None if n16 == b else (audio if n16 == 0 else audio[rows32])
                return Decoded(host16, rows16, host32, rows32)

            if event is None:  # a synchronous decoder: its output is complete now
                decoded = convert()
                decoded.device_ns = time.perf_counter_ns() - t0  # the decode and its conversion
                return _InFlight(batch, decoded, t0)
            return _InFlight(batch, None, t0, event, finish=convert)  # complete once the event is
        out = out[:, :n].float()
        dev16 = dev32 = None
        if n16:
            part = out if n16 == b else out[torch.from_numpy(rows16).to(out.device)]
            # The int16 conversion (clip, scale by 32767, truncate), on the device: half the bytes come back.
            dev16 = torch.clamp(part, -1.0, 1.0).mul_(32767.0).to(torch.int16)
        if n16 < b:
            dev32 = out if n16 == 0 else out[torch.from_numpy(rows32).to(out.device)]
        host16 = None if dev16 is None else self._to_pinned(pinned, dev16)
        host32 = None if dev32 is None else self._to_pinned(pinned, dev32)
        # On the stream the copies were queued on: the model's GPU's current stream (a bare
        # record() would use the current device's, which guards nothing on another GPU).
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return _InFlight(batch, Decoded(host16, rows16, host32, rows32), t0, event, started=started)

    def _encode(self, batch: Batch, t0: int) -> _InFlight:
        """Run an encode batch to the end (synchronously, on any device): its codes on the host."""
        if self.encoder is None:  # never planned: check_headers answers NO_ENCODER first
            raise RuntimeError("an encode batch reached a server without an encoder")
        take_warmup_ns()
        codes, global_ids, frames = self.encoder.encode(batch)
        batch.warmup_ns = take_warmup_ns()
        b = len(batch.requests)
        if global_ids.shape[0] != b or frames.shape != (b,) or any(c.shape[0] != b for c in codes):
            shapes = f"global ids {tuple(global_ids.shape)}, frames {tuple(frames.shape)}"
            raise RuntimeError(f"encoder returned {len(codes)} level(s), {shapes} for {b} rows")
        encoded = Encoded([c.to(torch.int32).cpu().numpy() for c in codes],
                          global_ids.to(torch.int32).cpu().numpy(),
                          frames.to(torch.int64).cpu().numpy())  # fmt: skip
        encoded.device_ns = time.perf_counter_ns() - t0  # the encode and its copy back
        return _InFlight(batch, encoded, t0)

    def _to_int16(self, audio: np.ndarray, buffers: dict[type, np.ndarray]) -> np.ndarray:
        """The int16 conversion of ``audio`` (B, N) float32 into ``buffers`` (one launch's
        set): clip, scale by 32767 in float32, truncate toward zero. Two passes: the scaling
        writes int16 directly, with the same unsafe (truncating) cast that ``astype`` uses."""
        clipped = self._buffer(buffers, np.float32, audio.shape)
        _clip(audio, np.float32(-1.0), np.float32(1.0), out=clipped)
        pcm = self._buffer(buffers, np.int16, audio.shape)
        np.multiply(clipped, np.float32(32767), out=pcm, casting="unsafe")
        return pcm

    @staticmethod
    def _buffer(buffers: dict[type, np.ndarray], dtype: type, shape: tuple[int, int]) -> np.ndarray:
        """A reused CPU array of ``shape`` from ``buffers``, one launch's set (launch says when
        a set is free again)."""
        numel = shape[0] * shape[1]
        buf = buffers.get(dtype)
        if buf is None or buf.size < numel:
            buf = np.empty(max(numel, 1 << 16), dtype)
            buffers[dtype] = buf
        return buf[:numel].reshape(shape)

    def _to_pinned(self, buffers: dict[torch.dtype, torch.Tensor], x: torch.Tensor) -> np.ndarray:
        """Start one non-blocking device-to-host copy of ``x`` into a reused pinned buffer."""
        buf = buffers.get(x.dtype)
        if buf is None or buf.numel() < x.numel():
            buf = self._alloc_pinned(max(x.numel(), 1 << 20), x.dtype)
            buffers[x.dtype] = buf
        view = buf[: x.numel()].view(x.shape)
        view.copy_(x, non_blocking=True)
        return view.numpy()


    @staticmethod
    def _alloc_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A page-locked host buffer (tests on a CPU-only torch replace this)."""
        return torch.empty(numel, dtype=dtype, pin_memory=True)


STOP = object()  # what ``take`` returns once the server is stopping
WAIT = object()  # what ``take`` returns to a pipelined lane that should let its running batch end first

_local = threading.local()  # the calling lane's intra-op thread count


def lane_threads() -> int | None:
    """The intra-op thread count the calling lane set (None outside a lane, or if it left
    torch's setting alone). ``torch.get_num_threads()`` cannot tell: it reports the process-wide
    value, while the OpenMP setting a lane makes is its own thread's."""
    return getattr(_local, "threads", None)


class Lane:
    """One decode worker. Lanes take turns as the dispatcher (leader/followers): a free lane
    plans the next batch itself, under the server's dispatch lock, then decodes and publishes
    it. So a batch is planned only when a lane is free to run it (it had time to grow), and a
    request never waits for a hand-off between threads.

    Args:
        index: the lane's number (for logs and host-gap accounting).
        runner: runs a batch on the device.
        take: ``take(block, running)`` -> the next ``Batch``; None if ``block`` is False and
            nothing is ready; ``STOP`` once the server is stopping; ``WAIT`` if the lane should
            first let ``running`` (its batch in flight, or None) end and its clients come back
            (dispatch_policy.py).
        publish: writes a decoded batch into its slots (``(batch, decoded, ns) -> None``).
        fail: answers one row with an error (``(batch, row, message) -> None``).
        started: called with (batch, lane index) when the lane starts a batch.
        finished: called likewise once all of the batch's rows are answered.
        threads: intra-op CPU threads for this lane (None: leave torch's setting).
        pipeline: overlap publishing batch k-1 with running batch k (CUDA).
        turn: ``turn(index)`` -> this lane's thread count for its next batch, blocking while
            the lane is parked; None once the server is stopping (sequential lanes only; None:
            always this lane's turn, with ``threads``).
        one_thread: ``one_thread(batch)`` -> True to decode that batch on one thread, whatever
            the lane's count (``lane_control.ONE_THREAD_BELOW_NS``; sequential lanes only).
    """

    def __init__(self, index: int, runner: Runner, *,
                 take: Callable[..., Any],
                 publish: Callable[[Batch, Decoded, int], None],
                 fail: Callable[[Batch, int, str], None],
                 started: Callable[[Batch, int], None],
                 finished: Callable[[Batch, int], None],
                 threads: int | None, pipeline: bool,
                 turn: Callable[[int], int | None] | None = None,
                 one_thread: Callable[[Batch], bool] | None = None) -> None:  # fmt: skip
        self.index = index
        self.runner = runner
        self._take = take
        self._on_publish, self._on_fail = publish, fail
        self._on_start, self._on_finish = started, finished
        self.threads = threads
        self.pipeline = pipeline
        self._turn = turn
        self._one_thread = one_thread

    def start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name=f"bicodec-shm-lane-{self.index}", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        """Take, decode and publish batches until the server stops (in the calling thread)."""
        self._set_threads(self.threads)
        if self.runner.cuda:
            # The current device is per thread: the decode's kernels, its copies, and the event
            # that guards them then all use the model's GPU and its current stream.
            torch.cuda.set_device(self.runner.device)
        with torch.inference_mode():
            if self.pipeline:
                self._run_pipelined()
            else:
                self._run_sequential()

    def _set_threads(self, threads: int | None) -> None:
        if threads and threads != lane_threads():
            torch.set_num_threads(threads)  # per thread (OpenMP): this lane's share of the cores
            _local.threads = threads

    def _run_sequential(self) -> None:
        while True:
            if self._turn is not None:
                threads = self._turn(self.index)  # parked here while the lane is not needed
                if threads is None:
                    return
                self._set_threads(threads)
            batch = self._take(True)
            if batch is STOP:
                return
            self._on_start(batch, self.index)
            self._release_after(batch, self._decode_on_its_threads, batch)

    def _run_pipelined(self) -> None:
        prev: _InFlight | None = None
        while True:
            # With a batch in flight: only what is ready now, or WAIT (let it end first).
            batch = self._take(prev is None, None if prev is None else prev.batch)
            if batch is WAIT:
                if prev is not None:
                    self._complete(prev)
                    prev = None
                continue
            current = None
            if batch is not None and batch is not STOP:
                self._on_start(batch, self.index)
                try:
                    current = self.runner.launch(batch)
                except Exception:
                    if prev is not None:  # publish k-1 first: its audio sits in a pinned buffer
                        self._complete(prev)
                        prev = None
                    self._decode_and_release(batch)  # split and retry, run to the end now
            if prev is not None:
                self._complete(prev)
            prev = current
            if batch is STOP:
                return

    def _complete(self, inflight: _InFlight) -> None:
        """Wait for a launched batch's host copy and publish it; if the device failed it, run
        it again through split-and-retry."""
        try:
            decoded = inflight.wait()
        except Exception:
            self._decode_and_release(inflight.batch)
            return
        self._publish_and_release(inflight.batch, decoded, time.perf_counter_ns() - inflight.t0)

    def _decode_on_its_threads(self, batch: Batch) -> None:
        """Decode ``batch`` with the lane's threads, or one thread if ``one_thread`` says so;
        inside ``_release_after``, so that even the choice failing releases the batch."""
        threads = lane_threads()
        if not (threads and threads > 1 and self._one_thread is not None and self._one_thread(batch)):
            self._decode(batch)
            return
        try:
            self._set_threads(1)
            self._decode(batch)
        finally:  # the lane's count again, whatever ended the decode (a signal's exception too)
            self._set_threads(threads)

    def _decode_and_release(self, batch: Batch) -> None:
        self._release_after(batch, self._decode, batch)

    def _publish_and_release(self, batch: Batch, decoded: Decoded, elapsed_ns: int) -> None:
        self._release_after(batch, self._on_publish, batch, decoded, elapsed_ns)

    def _release_after(self, batch: Batch, step: Callable[..., None], *args: Any) -> None:
        """Run ``step``, then release the batch's slots whatever happens: a bug of ours must not
        take the lane, or the slots it holds, with it."""
        try:
            step(*args)
        except Exception:
            log.exception("lane %d failed on a batch of %d", self.index, len(batch.requests))
        finally:
            self._on_finish(batch, self.index)

    def _decode(self, batch: Batch) -> None:
        """Run, publish; on failure split in halves and retry each (recursively)."""
        try:
            inflight = self.runner.launch(batch, retry=True)  # waited for at once
            decoded = inflight.wait()
        except Exception as exc:  # any model failure must fail requests, not the server
            _release_accelerator_memory(self.runner.device)
            if len(batch.requests) == 1:
                cause = f"{type(exc).__name__}: {exc}"
                log.warning("decode of slot %d failed: %s", int(batch.slots[0]), cause)
                self._on_fail(batch, 0, f"decode failed: {cause}")
                return
            log.warning("batch of %d failed (%s); splitting and retrying", len(batch.requests), exc)
            for half in batch.split():
                self._decode(half)
            return
        self._on_publish(batch, decoded, time.perf_counter_ns() - inflight.t0)


def _release_accelerator_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # after an OOM, so that the halves of a split batch can fit

