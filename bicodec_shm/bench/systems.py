"""The parent's side of each system: start its processes, release them together, sample
them, stop them; and the orchestration over N (``bench_all``) or a policy grid (``bench_sweep``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..transport import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SLOTS,
    leftover_objects,
    random_name,
    read_header,
    stats_from_header,
    unlink_all,
)
from .config import (
    LIMIT,
    NAME_PREFIX,
    PER_PROCESS,
    PROCESS_GIB,
    QUEUE,
    SHM,
    START_TIMEOUT,
    SYSTEMS,
    Policy,
    Setup,
)
from .sampling import _Sampler
from .workers import (
    _limit_worker,
    _own_decoder_client,
    _queue_client,
    _queue_server,
    _shm_client,
    _shm_server,
)
from .workload import audio_seconds, draw_lengths


@dataclass
class RunResult:
    """One system at one N (absolute numbers; ratios are computed by ``compare``)."""

    system: str
    n_clients: int
    requests: int
    failed: int
    tokens: int
    audio_seconds: float
    wall_seconds: float
    audio_s_per_s: float
    requests_per_s: float
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    avg_batch_size: float
    batch_size_histogram: dict
    peak_rss_mib: float  # the peak of the sum over processes
    cpu_seconds: float
    others_cpu_share: float | None
    threads: str
    policy: dict
    largest_process_rss_mib: float = 0.0  # the largest single process's own peak
    padding_overhead: float | None = None  # padded tokens / tokens - 1
    note: str = ""
    batches: list = field(default_factory=list, repr=False)  # bicodec-shm's, for the limit


class _Run:
    """The processes of one system at one N: started, released together, always stopped."""

    def __init__(self, ctx: Any, sampler: _Sampler, bar: Any, timeout: float) -> None:
        self.ctx = ctx
        self.sampler = sampler
        self.bar = bar
        self.timeout = timeout
        self.events = ctx.Queue()
        self.start_event = ctx.Event()
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

    def next_event(self, deadline: float) -> tuple:
        """The next event from a child; raises if a child failed or nothing came in time."""
        while True:
            try:
                event = self.events.get(timeout=0.5)
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

    def measure(self, n_ready: int, n_exits: int) -> tuple[list[tuple], float, float]:
        """Wait until ``n_ready`` children are ready, release them all at once, and collect
        ``done`` events until ``n_exits`` have exited. Returns (done events, t0, t_end)."""
        ready = 0
        deadline = time.monotonic() + START_TIMEOUT
        self.bar.set_postfix_str("starting")
        while ready < n_ready:
            if self.next_event(deadline)[0] == "ready":
                ready += 1
        self.bar.set_postfix_str("")
        self.sampler.open()
        t0 = time.perf_counter()
        self.start_event.set()
        done: list[tuple] = []
        exited = 0
        while exited < n_exits:
            event = self.next_event(time.monotonic() + self.timeout)
            if event[0] == "done":
                done.append(event)
                self.bar.update(event[4])
            elif event[0] == "exit":
                exited += 1
        self.sampler.close()
        t_end = max((e[5] for e in done), default=time.perf_counter())
        return done, t0, t_end

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


def _summarize(system: str, n: int, done: list[tuple], t0: float, t_end: float, sampler: _Sampler,
               *, threads: str, policy: Policy | None, failed: int = 0,
               latencies: bool = True) -> RunResult:  # fmt: skip
    wall = max(t_end - t0, 1e-9)
    tokens = sum(e[3] for e in done)
    requests = sum(e[4] for e in done)
    lat_ms = np.array([e[2] for e in done]) * 1000
    return RunResult(
        system=system, n_clients=n, requests=requests, failed=failed, tokens=tokens,
        audio_seconds=audio_seconds(tokens), wall_seconds=wall,
        audio_s_per_s=audio_seconds(tokens) / wall, requests_per_s=requests / wall,
        latency_p50_ms=float(np.percentile(lat_ms, 50)) if latencies and len(lat_ms) else None,
        latency_p99_ms=float(np.percentile(lat_ms, 99)) if latencies and len(lat_ms) else None,
        avg_batch_size=1.0, batch_size_histogram={}, peak_rss_mib=sampler.peak_rss / 2**20,
        cpu_seconds=sampler.cpu_seconds, others_cpu_share=sampler.others_cpu_share,
        threads=threads, policy=asdict(policy) if policy else {},
        largest_process_rss_mib=max(sampler.peak_rss_by_pid.values(), default=0) / 2**20,
    )  # fmt: skip


def bench_shm(setup: Setup, lengths: list[list[int]], *, ctx: Any, sampler: _Sampler, bar: Any,
              policy: Policy | None = None, record: bool = True,
              names: list[str] | None = None) -> RunResult:  # fmt: skip
    """bicodec-shm: one server process, one client process per entry of ``lengths``.

    With ``record``, the server's decoder logs each batch's lengths (``result.batches``).
    """
    import tempfile

    policy = policy or setup.policy
    n = len(lengths)
    name = random_name(NAME_PREFIX)
    if names is not None:
        names.append(name)
    # The defaults a user gets, widened only if this run needs more.
    slots = max(DEFAULT_SLOTS, n)
    max_tokens = max(DEFAULT_MAX_TOKENS, max(b.hi for b in setup.mix))
    fd, record_path = tempfile.mkstemp(prefix="bcshm-batches-", suffix=".txt")
    os.close(fd)
    run = _Run(ctx, sampler, bar, setup.timeout)
    try:
        run.spawn(_shm_server, name, setup.preset, setup.seed, setup.cores, policy, slots,
                  max_tokens, record_path if record else None, run.events,
                  name="bench-shm-server")  # fmt: skip
        for i, lens in enumerate(lengths):
            run.spawn(_shm_client, name, i, lens, setup.seed, setup.timeout, run.start_event,
                      run.events, name=f"bench-shm-client-{i}")  # fmt: skip
        done, t0, t_end = run.measure(n_ready=n + 1, n_exits=n)
        header = read_header(name)
        stats = stats_from_header(header) if header is not None else {}
        with open(record_path) as f:
            batches = [[int(x) for x in line.split()] for line in f if line.strip()]
    finally:
        run.stop()  # SIGTERM: the server finishes its batch, then unlinks everything
        unlink_all(name)  # only does something if the server could not clean up after itself
        os.remove(record_path)
    left = leftover_objects(name)
    if left:
        raise RuntimeError(f"/dev/shm objects left behind under {name!r}: {left}")
    result = _summarize(SHM, n, done, t0, t_end, sampler, policy=policy,
                        threads=f"server {setup.cores}, clients import no torch")  # fmt: skip
    result.avg_batch_size = stats.get("avg_batch_size", 0.0)
    result.batch_size_histogram = stats.get("batch_size_histogram", {})
    result.failed = stats.get("failed", 0)
    if stats.get("tokens"):
        result.padding_overhead = stats["padded_tokens"] / stats["tokens"] - 1
    result.batches = batches
    return result


def bench_limit(setup: Setup, batches: list[list[int]], n: int, *, ctx: Any, sampler: _Sampler,
                bar: Any) -> RunResult:  # fmt: skip
    """The recorded batches, replayed on the model in one process with no IPC."""
    run = _Run(ctx, sampler, bar, setup.timeout)
    try:
        run.spawn(_limit_worker, setup.preset, setup.seed, setup.cores, batches,
                  run.start_event, run.events, name="bench-limit")  # fmt: skip
        done, t0, t_end = run.measure(n_ready=1, n_exits=1)
    finally:
        run.stop()
    result = _summarize(LIMIT, n, done, t0, t_end, sampler, policy=setup.policy, latencies=False,
                        threads=f"{setup.cores} (one process)")  # fmt: skip
    sizes = [len(b) for b in batches]
    result.avg_batch_size = float(np.mean(sizes)) if sizes else 0.0
    result.batch_size_histogram = {s: sizes.count(s) for s in sorted(set(sizes))}
    result.note = "replays bicodec-shm's batches; no latency (no clients)"
    return result


def per_process_threads(cores: int, n: int) -> int:
    return max(1, cores // n)


def bench_per_process(setup: Setup, lengths: list[list[int]], *, ctx: Any, sampler: _Sampler,
                      bar: Any) -> RunResult:  # fmt: skip
    """Every client process loads its own decoder and decodes its requests one by one."""
    n = len(lengths)
    threads = per_process_threads(setup.cores, n)
    run = _Run(ctx, sampler, bar, setup.timeout)
    try:
        for i, lens in enumerate(lengths):
            run.spawn(_own_decoder_client, setup.preset, setup.seed, threads, i, lens,
                      run.start_event, run.events, name=f"bench-own-decoder-{i}")  # fmt: skip
        done, t0, t_end = run.measure(n_ready=n, n_exits=n)
    finally:
        run.stop()
    return _summarize(PER_PROCESS, n, done, t0, t_end, sampler, policy=None,
                      threads=f"{threads} per process x {n}")  # fmt: skip


def bench_queue(setup: Setup, lengths: list[list[int]], *, ctx: Any, sampler: _Sampler,
                bar: Any) -> RunResult:  # fmt: skip
    """One server process fed pickled numpy requests through multiprocessing Queues."""
    n = len(lengths)
    run = _Run(ctx, sampler, bar, setup.timeout)
    try:
        requests_q = run.queue()
        reply_qs = [run.queue() for _ in range(n)]
        server = run.spawn(_queue_server, setup.preset, setup.seed, setup.cores, setup.policy,
                           requests_q, reply_qs, run.events, name="bench-queue-server")  # fmt: skip
        for i, lens in enumerate(lengths):
            run.spawn(_queue_client, i, lens, setup.seed, setup.timeout, requests_q, reply_qs[i],
                      run.start_event, run.events, name=f"bench-queue-client-{i}")  # fmt: skip
        done, t0, t_end = run.measure(n_ready=n + 1, n_exits=n)
        requests_q.put(None)  # every client has exited: the server sends its stats and ends
        deadline = time.monotonic() + 60
        while (event := run.next_event(deadline))[0] != "stats":
            pass
        hist: dict[int, int] = event[1]
        server.join(30)
    finally:
        run.stop()
    result = _summarize(QUEUE, n, done, t0, t_end, sampler, policy=setup.policy,
                        threads=f"server {setup.cores}, clients import no torch")  # fmt: skip
    rows = sum(b * c for b, c in hist.items())
    result.avg_batch_size = rows / sum(hist.values()) if hist else 0.0
    result.batch_size_histogram = dict(sorted(hist.items()))
    return result


def _memory_ok(setup: Setup, n: int) -> str:
    """Why N decoder processes must not be started here ("" if they may)."""
    import psutil

    need = n * PROCESS_GIB.get(setup.preset, 1.0) + 1.0
    free = psutil.virtual_memory().available / 2**30
    if free < need:
        return f"skipped: needs ~{need:.0f} GiB free, {free:.1f} GiB available"
    return ""


def _skipped(system: str, n: int, note: str) -> RunResult:
    return RunResult(system=system, n_clients=n, requests=0, failed=0, tokens=0,
                     audio_seconds=0.0, wall_seconds=0.0, audio_s_per_s=0.0, requests_per_s=0.0,
                     latency_p50_ms=None, latency_p99_ms=None, avg_batch_size=0.0,
                     batch_size_histogram={}, peak_rss_mib=0.0, cpu_seconds=0.0,
                     others_cpu_share=None, threads="", policy={}, note=note)  # fmt: skip


def bench_all(setup: Setup, ns: Sequence[int], *, requests: dict[int, int],
              systems: Sequence[str] = SYSTEMS, progress: bool = True,
              names: list[str] | None = None) -> list[RunResult]:  # fmt: skip
    """Every system at every N (``requests[n]`` each); one ``RunResult`` per (N, system)."""
    from tqdm import tqdm

    ctx = mp.get_context("spawn")  # children must not inherit this process's state
    plan = {n: draw_lengths(setup.mix, n, requests[n], setup.seed) for n in ns}
    total = sum(n * requests[n] for n in ns) * len(systems)
    sampler = _Sampler(setup.sample_interval)
    results: list[RunResult] = []
    try:
        with tqdm(total=total, desc="bench", unit="req", file=sys.stderr, disable=not progress,
                  dynamic_ncols=True) as bar:  # fmt: skip
            for n in ns:
                lengths = plan[n]
                shm: RunResult | None = None
                for system in (s for s in SYSTEMS if s in systems):
                    bar.set_description(f"N={n} {system}")
                    if system == SHM:
                        shm = bench_shm(setup, lengths, ctx=ctx, sampler=sampler, bar=bar,
                                        names=names)  # fmt: skip
                        results.append(shm)
                    elif system == LIMIT:
                        if shm is None:
                            raise ValueError(f"{LIMIT!r} replays {SHM!r}'s batches: run both")
                        results.append(bench_limit(setup, shm.batches, n, ctx=ctx,
                                                   sampler=sampler, bar=bar))  # fmt: skip
                    elif system == PER_PROCESS:
                        why = _memory_ok(setup, n)
                        if why:
                            bar.write(f"N={n} {PER_PROCESS}: {why}")
                            bar.update(sum(map(len, lengths)))
                            results.append(_skipped(PER_PROCESS, n, why))
                            continue
                        results.append(bench_per_process(setup, lengths, ctx=ctx,
                                                         sampler=sampler, bar=bar))  # fmt: skip
                    elif system == QUEUE:
                        results.append(bench_queue(setup, lengths, ctx=ctx, sampler=sampler,
                                                   bar=bar))  # fmt: skip
    finally:
        sampler.stop()
    return results


def bench_sweep(setup: Setup, n: int, *, requests: int, waits: Sequence[float],
                tokens: Sequence[int | None], repeats: int = 1, progress: bool = True,
                names: list[str] | None = None) -> list[RunResult]:  # fmt: skip
    """bicodec-shm alone at ``n`` clients for every (max_wait_ms, max_batch_tokens).

    With ``repeats`` > 1 the whole grid runs that many times, each pass in a rotated order, so
    that a burst of load from other processes does not land on the same configurations.
    """
    from tqdm import tqdm

    ctx = mp.get_context("spawn")
    m = requests
    lengths = draw_lengths(setup.mix, n, m, setup.seed)
    grid = [Policy(setup.policy.max_batch, w, t) for w in waits for t in tokens]
    sampler = _Sampler(setup.sample_interval)
    results: list[RunResult] = []
    try:
        with tqdm(total=len(grid) * repeats * n * m, desc="sweep", unit="req", file=sys.stderr,
                  disable=not progress, dynamic_ncols=True) as bar:  # fmt: skip
            for r in range(repeats):
                shift = (r * len(grid)) // repeats
                for policy in grid[shift:] + grid[:shift]:
                    bar.set_description(f"N={n} wait {policy.max_wait_ms:g} ms "
                                        f"budget {policy.max_batch_tokens}")  # fmt: skip
                    results.append(bench_shm(setup, lengths, ctx=ctx, sampler=sampler, bar=bar,
                                             policy=policy, record=False, names=names))  # fmt: skip
    finally:
        sampler.stop()
    return results
