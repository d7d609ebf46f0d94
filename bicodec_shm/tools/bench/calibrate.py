"""What a run will cost, said before it starts: one model process is started and times one
request, so that the bench can print how long the whole run will take and how many requests a
window will hold (a window with too few holds noise, not a result: report.py's ``few``).

``calibrate`` measures, in a spawned process as every run's processes are:

- ``process_s``: spawned -> its imports done: what every process of a run pays, a client too;
- ``model_s``: building the model and its warm-up decodes (``load_model``): what each model
  process (a server, the limit, each decoder per process) pays on top;
- ``request_s``: one request of the mix's mean length decoded alone on every core: the pace of
  one request at a time (the decoder per process's, roughly, at any N on a CPU, where N
  processes split the cores), so ``window / request_s`` is about the fewest requests a window
  holds; a batching system holds more. The stand-in's is its formula (standin.py).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import LIMIT, PER_PROCESS, QUEUE, SHM, START_TIMEOUT, ModelSpec, Setup
from .workload import Band

DECODE_BUDGET_S = 1.0  # the calibration times requests for about this long (at least one)
STOP_S = 0.5  # stopping a run's processes and collecting its records


@dataclass(frozen=True)
class Calibration:
    """The cost of starting a process, of building a model in it, and of one request (module
    docstring), in seconds."""

    process_s: float
    model_s: float
    request_s: float
    how: str  # "measured", or the stand-in's formula for ``request_s``

    @property
    def start_s(self) -> float:
        """One model process: spawned -> ready."""
        return self.process_s + self.model_s

    def requests_per_window(self, window: float) -> float:
        """About the fewest requests a window of ``window`` s holds: one at a time on every core."""
        return window / self.request_s if self.request_s > 0 else math.inf


def mean_frames(mix: Sequence[Band]) -> float:
    """The mean request length of ``mix`` (uniform within each band), in frames."""
    total = sum(b.weight for b in mix)
    return sum(b.weight * (b.lo + b.hi) / 2 for b in mix) / total


def calibrate(setup: Setup) -> Calibration:
    """Measure ``setup``'s costs (module docstring) in one spawned process."""
    frames = max(1, round(mean_frames(setup.mix)))
    ctx = mp.get_context("spawn")  # as every run's processes: nothing inherited
    events = ctx.Queue()
    proc = ctx.Process(target=_calibration_worker, args=(setup.model, setup.cores, frames, events),
                       name="bench-calibration", daemon=True)  # fmt: skip
    stamps = {"spawned": time.perf_counter()}  # perf_counter: one clock for every process (Linux)
    proc.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while "decoded" not in stamps:
            try:
                event = events.get(timeout=0.5)
            except queue.Empty:
                if proc.exitcode is not None:
                    raise RuntimeError(f"the calibration process exited with code {proc.exitcode}") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError("the calibration process sent nothing in time") from None
                continue
            if event[0] == "error":
                raise RuntimeError(f"{event[1]} failed:\n{event[2]}")
            stamps[event[0]] = event[1]
            if event[0] == "ready":
                deadline = time.monotonic() + setup.timeout
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join(30)
        events.cancel_join_thread()
        events.close()
    process_s = stamps["imported"] - stamps["spawned"]
    model_s = stamps["ready"] - stamps["imported"]
    if setup.stand_in:
        a_ms, b_ms = setup.stand_in_ms
        return Calibration(process_s, model_s, (a_ms + b_ms * frames) / 1000,
                           f"the stand-in's cost, {a_ms:.4g} + {b_ms:.4g} x 1 x {frames} ms")  # fmt: skip
    return Calibration(process_s, model_s, stamps["decoded"], "measured")


def _calibration_worker(spec: ModelSpec, threads: int, frames: int, events: Any) -> None:
    """Say when the imports are done and when the model is built and warm (``load_model``);
    then time requests of ``frames`` frames one at a time for about ``DECODE_BUDGET_S`` and send
    their median (the stand-in: none, its cost is its formula)."""
    from .workers import _child_setup, _reporting

    _child_setup()
    with _reporting(events, "the calibration"):
        from ...codecs.layout import get_layout
        from .decoding import as_batch, decode_rows, load_model
        from .workload import random_request

        # What every process of a run has imported by now (a client too; torch-free); a model
        # process then imports torch and builds its model.
        events.put(("imported", time.perf_counter()))
        model = load_model(spec, threads)
        events.put(("ready", time.perf_counter()))
        if spec.stand_in:
            events.put(("decoded", 0.0))
            return
        from ...server.adapters import codec_adapter

        adapter = codec_adapter(model)
        layout = get_layout(spec.codec)
        batch = as_batch([random_request(np.random.default_rng([spec.seed, 3]), layout, frames)], layout)
        times: list[float] = []
        began = time.perf_counter()
        while not times or (time.perf_counter() - began < DECODE_BUDGET_S and len(times) < 20):
            t0 = time.perf_counter()
            decode_rows(adapter, batch)
            times.append(time.perf_counter() - t0)
        events.put(("decoded", float(np.median(times))))


def run_seconds(cal: Calibration, setup: Setup, system: str, n: int, count: int | None) -> float:
    """About how long one run of ``system`` at ``n`` clients takes: its processes' start (they
    start at once, sharing the cores), its window (or its ``count`` requests per client, one at
    a time), the requests in flight at the close, and the stop."""
    cores = max(1, setup.cores)
    models = n if system == PER_PROCESS else 1
    light = 0 if system in (PER_PROCESS, LIMIT) else n  # the clients of a server
    cpu = (models + light) * cal.process_s + models * cal.model_s
    start = max(cal.start_s, cpu / cores)
    work = setup.window if setup.window is not None else (count or 0) * n * cal.request_s
    return start + work + cal.request_s + STOP_S


def estimate_seconds(cal: Calibration, setup: Setup, ns: Sequence[int], systems: Sequence[str],
                     repeats: int, requests: dict[int, int] | None) -> float:  # fmt: skip
    """The whole of ``bench_all``: every run of every system, N and repeat (the computed ideal
    batchers cost nothing)."""
    runs = [(s, n) for n in ns for s in systems if s in (LIMIT, PER_PROCESS, QUEUE)]
    runs += [(SHM, n) for n in ns for _ in setup.shm] if SHM in systems else []
    return repeats * sum(run_seconds(cal, setup, s, n, requests and requests[n]) for s, n in runs)


def sweep_seconds(cal: Calibration, setup: Setup, n: int, grid: int, repeats: int,
                  count: int | None) -> float:  # fmt: skip
    """The whole of ``bench_sweep``: bicodec-shm alone, once per policy of the grid and pass."""
    return grid * repeats * run_seconds(cal, setup, SHM, n, count)
