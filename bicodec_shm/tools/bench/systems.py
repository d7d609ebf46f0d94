"""The parent's side of each system: start its processes, release them together, sample them
for one window, stop them (the order of the runs is ``orchestrate.py``'s).

The window: the parent sets a shared deadline (perf_counter, one clock for every process on
Linux) to t0 + window and releases every process at t0. Clients send requests back to back
until the deadline; a request sent before it is finished (the server must not be left with
half a batch), but only requests that *completed* by the deadline count, in throughput,
latency and batch sizes alike. So the work in flight at the close, at most one request per
client or one batch per server, is left out: every system loses the same kind of partial
work, bounded by one request's (or batch's) duration out of the window. The CPU time and the
memory peak are sampled over the window alone. With ``--requests`` there is no window: every
request counts and the wall time ends at the last reply.
"""

from __future__ import annotations

import math
import os
import queue
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from ...codecs.layout import default_max_frames
from ...protocol.header import read_header, stats_from_header
from ...protocol.layout import DEFAULT_SLOTS
from ...protocol.names import leftover_objects, random_name, unlink_all
from .config import (
    IDEAL,
    LIMIT,
    NAME_PREFIX,
    PER_PROCESS,
    PIPELINED_IDEAL,
    QUEUE,
    START_TIMEOUT,
    Policy,
    Setup,
    ShmVariant,
)
from .results import RunResult, _batch_stats, _skipped, _summarize, lane_phases_in_window
from .sampling import _Sampler
from .standin import ideal_run
from .workers import (
    Record,
    _limit_worker,
    _own_decoder_client,
    _queue_client,
    _queue_server,
    _shm_client,
    _shm_server,
    read_batches,
    read_lane_phases,
)
from .workload import audio_seconds


class _Run:
    """The processes of one system at one N: started, released together, always stopped."""

    def __init__(self, ctx: Any, sampler: _Sampler, bar: Any, timeout: float) -> None:
        self.ctx = ctx
        self.sampler = sampler
        self.bar = bar
        self.timeout = timeout
        self.events = ctx.Queue()
        self.start_event = ctx.Event()
        # Set once, before the start event: the Event orders the store before every read.
        self.deadline = ctx.RawValue("d", math.inf)
        self.procs: list[Any] = []
        self.queues: list[Any] = [self.events]

    def spawn(self, target: Callable, *args: Any, name: str) -> Any:
        proc = self.ctx.Process(target=target, args=args, name=name, daemon=True)
        proc.start()
        self.procs.append(proc)
        self.sampler.watch(proc.pid)
        return proc

    def queue(self) -> Any:
        q = self.ctx.Queue()
        self.queues.append(q)
        return q

    def next_event(self, deadline: float, *, wake_at: float = math.inf) -> tuple | None:
        """The next event from a child, or None once perf_counter passes ``wake_at``; raises
        if a child failed or nothing came before ``deadline`` (time.monotonic)."""
        while True:
            wait = min(0.5, max(0.0, wake_at - time.perf_counter()))
            try:
                event = self.events.get(timeout=wait) if wait > 0 else self.events.get_nowait()
            except queue.Empty:
                event = None
            if event is not None:
                if event[0] == "error":
                    raise RuntimeError(f"{event[1]} failed:\n{event[2]}")
                return event
            for p in self.procs:
                if p.exitcode not in (None, 0):
                    raise RuntimeError(f"child {p.name} exited with code {p.exitcode}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no event from the children within {self.timeout:.0f} s")
            if time.perf_counter() >= wake_at:
                return None

    def measure(self, n_ready: int, n_exits: int, window: float | None,
                count: int | None = None) -> tuple[list[Record], float, float]:  # fmt: skip
        """Wait until ``n_ready`` children are ready, release them all at once, and collect
        the records of ``n_exits`` children (``count`` requests each, without a window).
        Returns (records, t0, t_end): t_end is the window's close, or the last completion."""
        ready = 0
        deadline = time.monotonic() + START_TIMEOUT
        self.bar.set_postfix_str("starting")
        while ready < n_ready:
            event = self.next_event(deadline)
            if event is not None and event[0] == "ready":
                ready += 1
        self.sampler.open()
        t0 = time.perf_counter()
        close = t0 + window if window is not None else math.inf
        self.deadline.value = close
        self.start_event.set()
        records: list[Record] = []
        exited = 0
        sampling = True
        # Children report only at exit: the window, or ``count`` requests, pass in silence.
        silent = window if window is not None else self.timeout * (count or 1)
        deadline = time.monotonic() + silent + self.timeout
        while exited < n_exits:
            now = time.perf_counter()
            if sampling and now >= close:
                self.sampler.close()  # CPU and memory over the window only
                sampling = False
            wake = min(close, now + 1.0) if sampling else math.inf
            if window is not None:
                self.bar.set_postfix_str(f"{min(now - t0, window):.0f}/{window:.0f} s")
            event = self.next_event(deadline, wake_at=wake)
            if event is not None and event[0] == "exit":
                exited += 1
                records += event[2]
                deadline = time.monotonic() + self.timeout
        if sampling:
            self.sampler.close()
        t_end = close if window is not None else max((r[3] for r in records), default=t0)
        return records, t0, t_end

    def stop(self) -> None:
        """SIGTERM whatever still runs (servers finish their batch and unlink), then SIGKILL."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 30
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for q in self.queues:
            q.cancel_join_thread()  # never block this process's exit on an unread queue
            q.close()
        self.sampler.clear()


def _check_count(setup: Setup, count: int | None) -> None:
    if setup.window is None and count is None:
        raise ValueError("without a window, give the number of requests per client")


def bench_shm(setup: Setup, n: int, *, count: int | None = None, ctx: Any, sampler: _Sampler,
              bar: Any, policy: Policy | None = None, variant: ShmVariant | None = None,
              names: list[str] | None = None) -> RunResult:  # fmt: skip
    """bicodec-shm: one server process, ``n`` client processes.

    The server's decoder logs each batch; ``result.batches`` holds those that started in
    the window (or all, without one), for the limit to replay.
    """
    _check_count(setup, count)
    policy = policy or setup.policy
    variant = variant or setup.shm[0]
    name = random_name(NAME_PREFIX)
    if names is not None:
        names.append(name)
    # The defaults a user gets (serve --codec X), widened only if this run needs more.
    slots = max(DEFAULT_SLOTS, n)
    max_tokens = max(default_max_frames(setup.codec), max(b.hi for b in setup.mix))
    fd, record_path = tempfile.mkstemp(prefix="bcshm-batches-", suffix=".txt")
    os.close(fd)
    phases_path = None
    run = _Run(ctx, sampler, bar, setup.timeout)
    try:
        fd, phases_path = tempfile.mkstemp(prefix="bcshm-lanes-", suffix=".txt")  # the lane tuner's
        os.close(fd)
        run.spawn(_shm_server, name, setup.model, setup.cores, policy, slots, max_tokens,
                  variant.server_options, record_path, run.events, phases_path,
                  name="bench-shm-server")  # fmt: skip
        for i in range(n):
            run.spawn(_shm_client, name, setup.codec, i, setup.mix, setup.seed, count, setup.timeout,
                      run.start_event, run.deadline, run.events,
                      name=f"bench-shm-client-{i}")  # fmt: skip
        records, t0, t_end = run.measure(n_ready=n + 1, n_exits=n, window=setup.window,
                                         count=count)
        header = read_header(name)
        stats = stats_from_header(header) if header is not None else {}
        batches = read_batches(record_path, t0, t_end)
        phases = read_lane_phases(phases_path)
    finally:
        run.stop()  # SIGTERM: the server finishes its batch, then unlinks everything
        unlink_all(name)  # only does something if the server could not clean up after itself
        os.remove(record_path)
        if phases_path is not None:
            os.remove(phases_path)
    left = leftover_objects(name)
    if left:
        raise RuntimeError(f"/dev/shm objects left behind under {name!r}: {left}")
    result = _summarize(variant.label, n, records, t0, t_end, sampler, window=setup.window,
                        policy=policy, threads=f"server {setup.cores}, clients import no torch",
                        layout=setup.layout)  # fmt: skip
    result.failed = stats.get("failed", 0)
    if batches:
        _batch_stats(result, batches)
    elif stats.get("batches"):  # nothing recorded (a server that bypasses detokenize): its counters
        result.avg_batch_size = stats["avg_batch_size"]
        result.batch_size_histogram = stats["batch_size_histogram"]
        result.padding_overhead = stats["padded_tokens"] / stats["tokens"] - 1 if stats["tokens"] else None
        result.note = "batch sizes from the server's counters (whole run); no batches recorded"
    result.batches = batches
    if phases:  # the lane tuner ran: what it did in the window
        result.lanes, result.tuner_exploring_s = lane_phases_in_window(phases, t0, t_end)
    elif "lanes" in stats:  # a fixed lane count
        result.lanes = [stats["lanes"]]
    return result


def bench_limit(setup: Setup, batches: list[list[int]], n: int, *, ctx: Any, sampler: _Sampler,
                bar: Any) -> RunResult:  # fmt: skip
    """The recorded batches, replayed on the model in one process with no IPC (in a loop
    until the window closes)."""
    if not batches:
        return _skipped(LIMIT, n, "skipped: bicodec-shm completed no batch to replay")
    run = _Run(ctx, sampler, bar, setup.timeout)
    try:
        run.spawn(_limit_worker, setup.model, setup.cores, batches, run.start_event, run.deadline,
                  run.events, name="bench-limit")  # fmt: skip
        records, t0, t_end = run.measure(n_ready=1, n_exits=1, window=setup.window, count=len(batches))
    finally:
        run.stop()
    result = _summarize(LIMIT, n, records, t0, t_end, sampler, window=setup.window,
                        policy=setup.policy, latencies=False,
                        threads=f"{setup.cores} (one process)", layout=setup.layout)  # fmt: skip
    _batch_stats(result, batches)
    result.note = f"replays {setup.shm[0].label}'s batches; no latency (no clients)"
    result.replays = setup.shm[0].label
    return result


def per_process_threads(cores: int, n: int) -> int:
    return max(1, cores // n)


def bench_per_process(setup: Setup, n: int, *, count: int | None = None, ctx: Any,
                      sampler: _Sampler, bar: Any) -> RunResult:  # fmt: skip
    """Every client process loads its own decoder and decodes its requests one by one; with
    the stand-in, through one lock shared by all (the one device they time-slice)."""
    _check_count(setup, count)
    threads = per_process_threads(setup.cores, n)
    run = _Run(ctx, sampler, bar, setup.timeout)
    lock = ctx.Lock() if setup.stand_in else None
    try:
        for i in range(n):
            run.spawn(_own_decoder_client, setup.model, threads, i, setup.mix, count, lock,
                      setup.lock_trace, run.start_event, run.deadline, run.events,
                      name=f"bench-own-decoder-{i}")  # fmt: skip
        records, t0, t_end = run.measure(n_ready=n, n_exits=n, window=setup.window, count=count)
    finally:
        run.stop()
    result = _summarize(PER_PROCESS, n, records, t0, t_end, sampler, window=setup.window,
                        policy=None, threads=f"{threads} per process x {n}",
                        layout=setup.layout)  # fmt: skip
    if setup.stand_in:
        result.note = "one cross-process lock around each decode (one device, time-sliced)"
    return result


def bench_queue(setup: Setup, n: int, *, count: int | None = None, ctx: Any, sampler: _Sampler,
                bar: Any) -> RunResult:  # fmt: skip
    """One server process fed pickled numpy requests through multiprocessing Queues."""
    _check_count(setup, count)
    run = _Run(ctx, sampler, bar, setup.timeout)
    try:
        requests_q = run.queue()
        reply_qs = [run.queue() for _ in range(n)]
        server = run.spawn(_queue_server, setup.model, setup.cores, setup.policy, requests_q,
                           reply_qs, run.deadline, run.events, name="bench-queue-server")  # fmt: skip
        for i in range(n):
            run.spawn(_queue_client, setup.codec, i, setup.mix, setup.seed, count, setup.timeout,
                      requests_q, reply_qs[i], run.start_event, run.deadline, run.events,
                      name=f"bench-queue-client-{i}")  # fmt: skip
        records, t0, t_end = run.measure(n_ready=n + 1, n_exits=n, window=setup.window,
                                         count=count)
        requests_q.put(None)  # every client has exited: the server sends its stats and ends
        deadline = time.monotonic() + 60
        while (event := run.next_event(deadline)) is None or event[0] != "stats":
            pass
        hist: dict[int, int] = event[1]
        server.join(30)
    finally:
        run.stop()
    result = _summarize(QUEUE, n, records, t0, t_end, sampler, window=setup.window,
                        policy=setup.policy, layout=setup.layout,
                        threads=f"server {setup.cores}, clients import no torch")  # fmt: skip
    rows = sum(b * c for b, c in hist.items())
    result.avg_batch_size = rows / sum(hist.values()) if hist else 0.0
    result.batch_size_histogram = dict(sorted(hist.items()))
    return result


def bench_ideal(setup: Setup, n: int, *, count: int | None = None, pipelined: bool = False) -> RunResult:
    """The stand-in's ideal batcher at ``n`` clients (standin.py): computed, not run.
    ``pipelined``: the pipelined ideal instead."""
    _check_count(setup, count)
    a_ms, b_ms = setup.stand_in_ms
    p = setup.policy
    ideal = ideal_run(setup.mix, setup.seed, n, max_batch=p.max_batch,
                      max_batch_tokens=p.max_batch_tokens, a_ms=a_ms, b_ms=b_ms,
                      window_s=setup.window, requests=count if setup.window is None else None,
                      pipelined=pipelined)  # fmt: skip
    wall = max(ideal.seconds, 1e-9)
    sizes = ideal.batch_sizes
    return RunResult(
        system=PIPELINED_IDEAL if pipelined else IDEAL, n_clients=n, requests=ideal.requests,
        failed=0, tokens=ideal.tokens,
        audio_seconds=audio_seconds(ideal.tokens), wall_seconds=ideal.seconds,
        audio_s_per_s=audio_seconds(ideal.tokens) / wall, requests_per_s=ideal.requests / wall,
        latency_p50_ms=None, latency_p99_ms=None,
        avg_batch_size=float(np.mean(sizes)) if sizes else 0.0,
        batch_size_histogram={s: sizes.count(s) for s in sorted(set(sizes))},
        peak_rss_mib=None, cpu_seconds=0.0, others_cpu_share=None, threads="",
        policy=asdict(p), window_s=setup.window,
        padding_overhead=ideal.padded_tokens / ideal.tokens - 1 if ideal.tokens else None,
        note=("computed: each batch planned while the one before it runs, zero overhead" if pipelined
              else "computed: every batch from all N outstanding requests, zero overhead"),
    )  # fmt: skip
