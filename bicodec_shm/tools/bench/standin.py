"""A device-shaped stand-in for the decoder, and the ideal batcher it is measured against.

On a GPU a batch costs a fixed launch-and-sync price plus a little per padded token, and the
host is idle meanwhile. ``StandInDecoder`` plays that: each ``detokenize`` call sleeps
``a + b·B·T`` ms (B rows, T the padded length) in ``time.sleep``, which holds no CPU and
releases the GIL, and returns zeros of shape (B, 320·T). Whatever a system adds on top of the
sleeps is its own overhead, with no CPU contention between model and IPC mixed in.

Calibration of the defaults, from a GPU on which 10 sequential decodes of ~30 ms each cost as
much as one batched call of ~35-40 ms, with requests of T = 50 tokens (1 s of audio):

    a + b·1·50  = 30 ms
    a + b·10·50 = 37.5 ms   (the middle of 35-40)
    => 450·b = 7.5  =>  b = 1/60 ms ≈ 0.0167 ms per padded token,  a = 30 - 50/60 ≈ 29.17 ms

So a batch of 16 × 50 tokens costs ~42.5 ms where 16 single decodes cost ~480 ms.

Named presets (``STAND_IN_PRESETS``; ``bench --stand-in NAME``):

- ``calibrated``: the calibration above, a synchronous decoder (the lane sleeps through the batch);
- ``modern``: a modern GPU, 4 ms + 0.006 ms per padded token, played as an *asynchronous*
  device, as CUDA is: ``launch`` returns at once and the batch "runs" on a device timeline
  (batches queue behind each other, as on one CUDA stream), and the event it returns sleeps
  until the batch's end when synchronized. The server then serves it as it serves a GPU: one
  pipelined lane that launches batch k and publishes batch k-1 while k runs (lanes.py).
  Callers that use ``detokenize`` (the per-process and queue baselines) still wait the cost.

The ideal batcher (``ideal_run``): what a perfect batcher with zero IPC overhead achieves with
this stand-in under the same offered load. The offered load is N closed-loop clients, each
with one request outstanding, drawing the same request lengths as the measured clients
(``workload.length_stream``). With zero overhead a client's next request is ready the instant
its reply is, so every batch is planned from all N outstanding requests, with the same policy
as the server (``batching.plan_batch``: ``max_batch``, ``max_batch_tokens``), and batches run
back to back, each costing exactly ``a + b·B·T`` (no sleep overshoot). It is computed, not run:
simulated time advances by each batch's cost, and, as in a measured window, a batch that
would end after the window closes is not counted.

The pipelined ideal (``ideal_run(..., pipelined=True)``, asynchronous stand-ins only): the
same zero-overhead batcher, held to what one pipelined lane can do. A pipelined lane plans batch
k+1 while batch k runs, so that the device never waits for the host; but batch k's clients are
back only when it ends, so batch k+1 is planned from the requests outstanding *without* them
(with none outstanding, it is planned when batch k ends, from its clients). The ideal batcher
plans every batch from all N; the pipelined ideal from N minus the running batch. With the
modern preset and the bench's defaults it reaches 0.73 / 0.85 / 0.92 of the ideal at N = 4 / 8 /
16 (benchmarks/RESULTS.md). The ratio to it says how much of what a pipelined lane reaches with
no host cost the server reaches; the rest of the gap to the ideal is the pipeline's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...protocol.layout import HOP
from .workload import Band, Pending, length_stream, plan

IDEAL_DEFINITION = (
    "N closed-loop clients drawing the measured clients' request lengths; every batch planned "
    "(batching.plan_batch, the run's max_batch and max_batch_tokens) from all N outstanding "
    "requests, batches back to back at exactly a + b x rows x longest ms each, zero IPC or "
    "host overhead; computed, not run; a batch ending after the window is not counted"
)
PIPELINED_DEFINITION = (
    "the ideal batcher held to one pipelined lane: batch k+1 is planned when batch k starts, from "
    "the requests outstanding then (batch k's clients are back only when it ends; with none "
    "outstanding, it is planned at batch k's end, from them); batches back to back, zero overhead; "
    "computed, not run"
)
DEFAULT_A_MS = 30.0 - 50 / 60  # ≈ 29.17 ms, see the module docstring
DEFAULT_B_MS = 1 / 60  # ms per padded token (row x longest length)


@dataclass(frozen=True)
class StandInPreset:
    """A named stand-in: its costs and whether it plays an asynchronous device."""

    a_ms: float
    b_ms: float
    asynchronous: bool
    about: str


STAND_IN_PRESETS = {
    "calibrated": StandInPreset(DEFAULT_A_MS, DEFAULT_B_MS, False,
                                "30 ms a decode, 37.5 ms for 10, synchronous"),
    "modern": StandInPreset(4.0, 0.006, True, "a modern GPU, asynchronous launches"),
}


def cost_ms(batch: int, longest: int, *, a_ms: float, b_ms: float) -> float:
    """Milliseconds the stand-in sleeps for ``batch`` rows padded to ``longest`` tokens."""
    return a_ms + b_ms * batch * longest


class _DeviceEvent:
    """When a launched stand-in batch starts and ends on the device timeline (perf_counter
    seconds); ``synchronize`` sleeps until its end. ``device_seconds``: the batch's own time on
    the device, what a CUDA timing event pair would measure (the server fits its costs on it)."""

    def __init__(self, done_at: float, started_at: float | None = None) -> None:
        self.done_at = done_at
        self.started_at = done_at if started_at is None else started_at

    @property
    def device_seconds(self) -> float:
        return self.done_at - self.started_at

    def synchronize(self) -> None:
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)


class StandInDecoder:
    """Sleeps ``a_ms + b_ms·B·T`` per call, holds no CPU, returns zeros.

    ``asynchronous=True`` plays a device with its own timeline (module docstring): ``launch``
    returns at once, with an event to synchronize on; ``detokenize`` still waits.

    Keeps its own accounting (``calls``, ``rows``, ``padded_tokens``, ``planned_s``, the sleep
    asked for; ``slept_s``, the sleep measured), so that tests need no wall clock.
    """

    device = "cpu"
    config = None  # the server then assumes the real vocabularies (8192 semantic, 4096 global)
    device_shaped = True  # the server serves it as a device: one lane, not tuned like CPU lanes

    def __init__(self, *, a_ms: float = DEFAULT_A_MS, b_ms: float = DEFAULT_B_MS,
                 asynchronous: bool = False) -> None:  # fmt: skip
        if a_ms < 0 or b_ms < 0:
            raise ValueError(f"stand-in costs must be >= 0 ms, got a={a_ms}, b={b_ms}")
        self.a_ms = a_ms
        self.b_ms = b_ms
        self.asynchronous = asynchronous
        self._device_free_at = 0.0  # perf_counter seconds: when the last launched batch ends
        self._np_zeros: np.ndarray | None = None  # shared zero outputs (see _zeros)
        self._torch_zeros: Any = None
        self.calls = 0
        self.rows = 0
        self.padded_tokens = 0
        self.planned_s = 0.0
        self.slept_s = 0.0

    def __repr__(self) -> str:
        return f"StandInDecoder(a_ms={self.a_ms:g}, b_ms={self.b_ms:g}, asynchronous={self.asynchronous})"

    def launch(self, semantic_ids: Any, global_ids: Any, lengths: Any = None) -> tuple[Any, _DeviceEvent]:
        """Queue a batch on the device timeline and return at once: ((B, 320·T) zeros, the event
        of its end). A batch starts when the one before it ends, as on one CUDA stream."""
        b, t = semantic_ids.shape
        planned = cost_ms(b, t, a_ms=self.a_ms, b_ms=self.b_ms) / 1000
        start = max(time.perf_counter(), self._device_free_at)
        self._device_free_at = start + planned
        self.planned_s += planned
        self.calls += 1
        self.rows += b
        self.padded_tokens += b * t
        return self._zeros(semantic_ids, b, t), _DeviceEvent(self._device_free_at, start)

    def detokenize(self, semantic_ids: Any, global_ids: Any, lengths: Any = None) -> Any:
        """(B, T) ids, (B, 32) ids, optional (B,) lengths -> (B, 320·T) float32 zeros.

        Torch tensors in give a torch tensor out (the servers); numpy arrays give numpy (the
        decoder-per-process baseline, which then never imports torch).
        """
        b, t = semantic_ids.shape
        planned = cost_ms(b, t, a_ms=self.a_ms, b_ms=self.b_ms) / 1000
        t0 = time.perf_counter()
        time.sleep(planned)
        self.slept_s += time.perf_counter() - t0
        self.planned_s += planned
        self.calls += 1
        self.rows += b
        self.padded_tokens += b * t
        return self._zeros(semantic_ids, b, t)

    def _zeros(self, like: Any, b: int, t: int) -> Any:
        """(b, 320·t) float32 zeros: a view of one zeroed buffer, grown as needed. A fresh
        tensor per batch would cost the host a page-faulting allocation a GPU's output never
        costs it (measured: ~5 ms a batch on a loaded 2-core VM, as much as the modern preset's
        whole batch). Nobody writes into a decoder's output (lanes.Runner), so sharing is safe."""
        n = b * HOP * t
        if isinstance(like, np.ndarray):
            if self._np_zeros is None or self._np_zeros.size < n:
                self._np_zeros = np.zeros(max(n, 1 << 20), np.float32)
            return self._np_zeros[:n].reshape(b, HOP * t)
        import torch

        if self._torch_zeros is None or self._torch_zeros.numel() < n:
            self._torch_zeros = torch.zeros(max(n, 1 << 20))
        return self._torch_zeros[:n].view(b, HOP * t)


@dataclass
class IdealRun:
    """What the ideal batcher completed: requests, tokens, batch sizes, simulated seconds."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0  # the window, or the time to finish every request (count mode)
    busy_seconds: float = 0.0  # the sum of the batches' costs
    batch_sizes: list[int] = field(default_factory=list)
    padded_tokens: int = 0


def ideal_run(mix: Sequence[Band], seed: int, n_clients: int, *, max_batch: int,
              max_batch_tokens: int | None, a_ms: float, b_ms: float,
              window_s: float | None = None, requests: int | None = None,
              pipelined: bool = False) -> IdealRun:  # fmt: skip
    """The ideal batcher (module docstring) for ``n_clients``: for ``window_s`` seconds, or
    until each client has had ``requests`` requests decoded (exactly one must be given).
    ``pipelined``: the pipelined ideal instead (module docstring)."""
    if (window_s is None) == (requests is None):
        raise ValueError("give exactly one of window_s and requests")
    streams = [itertools.islice(length_stream(mix, seed, i), requests) for i in range(n_clients)]
    order = itertools.count()  # submission order: requests left out of a batch stay oldest

    def next_requests(clients: Sequence[int]) -> list[Pending]:
        """Each client's next request, ready the instant its reply is (zero overhead)."""
        out = []
        for i in clients:
            length = next(streams[i], None)
            if length is not None:
                out.append(Pending(i, length, next(order)))
        return out

    pending = next_requests(range(n_clients))
    running: list[int] = []  # pipelined: the clients of the batch on the device, not back yet
    out = IdealRun()
    while pending or running:
        if not pending:  # nothing to queue behind the running batch: plan at its end
            pending, running = next_requests(running), []
            continue
        batch = plan(pending, max_batch=max_batch, max_batch_tokens=max_batch_tokens)
        longest = batch[0].length  # plan_batch sorts longest first
        cost = cost_ms(len(batch), longest, a_ms=a_ms, b_ms=b_ms) / 1000
        if window_s is not None and out.seconds + cost > window_s:
            break  # ends after the window closes: not counted, as in a measured run
        out.seconds += cost
        out.busy_seconds += cost
        out.requests += len(batch)
        out.tokens += sum(p.length for p in batch)
        out.padded_tokens += len(batch) * longest
        out.batch_sizes.append(len(batch))
        taken = {p.key for p in batch}
        pending = [p for p in pending if p.key not in taken]
        clients = [p.key for p in batch]
        if pipelined:  # this batch starts as the running one ends: those clients come back
            clients, running = running, clients
        pending += next_requests(clients)
    if window_s is not None:
        out.seconds = window_s
    return out
