"""Round-trip latency of bicodec-shm against the IPC it replaces and the floor beneath it.

What it measures: the wall time of one synchronous request/reply between two processes, timed
one round trip at a time with ``time.perf_counter()``. The request is 50 int32 semantic tokens
plus 32 int32 global tokens; the reply is 16 000 int16 samples (50 tokens x 320 samples).

Against what (all five run in one invocation, interleaved round by round so that a noisy
machine slows every transport alike):

1. ``semaphore floor``: two processes ping-ponging a pair of POSIX semaphores (posix_ipc), no
   payload. Every bicodec-shm round trip contains exactly this hand-off, so nothing built on
   it can be faster.
2. ``bicodec-shm``: a ``DecoderClient.decode()`` call in this process (which never imports
   torch) against a ``DecoderServer`` in a spawned process whose decoder is a no-op returning
   zeros of shape (B, 320*T) (a view of one tensor made once, so that not even an allocation
   is the decoder's). What remains is the package's own overhead; on the CPU that includes
   converting the float32 output to int16 (clip, scale, truncate), which a CUDA server does on
   the device.
3. ``multiprocessing.Pipe``: the same payloads as numpy arrays, pickled through a Pipe to an
   echo process that answers with a zero int16 array of 16 000 samples. A bare ``recv()``, no
   ``poll(timeout)`` before it: the fast path a user would pick (a dead peer shows as EOFError).
4. ``multiprocessing.Queue``: the same, through a pair of Queues (feeder thread + pipe), read
   with a bare ``get()``: the fast path. A watcher thread here puts a marker into the reply
   queue if the echo child exits, so that a dead child ends the run instead of hanging it; it
   costs nothing per round trip.
5. ``multiprocessing.Queue get(timeout)``: the same Queues read with ``get(timeout=...)``, which
   polls the pipe first through ``multiprocessing.connection.wait`` (a selector per call): tens
   of microseconds more per round trip (~40 us on a 2-core VM). Shown because it is what a
   careful user writes, but the comparison is always against the faster of the two Queue rows.

Then the server's CPU per request, with 1 and 16 client processes in every run (``--clients``
adds more rows; default 1,4,16): K client processes, each doing synchronous round trips, share
one no-op ``DecoderServer`` whose ``max_batch`` is K (it waits up to ``--concurrent-wait-ms`` for
the batch to fill, sleeping, so that batches of 4 and 16 form; with one client the batch is full
at once and nothing waits). Its padded-token budget is the GPU server's (2400 tokens: the no-op
server stands for a GPU server), so that 16 rows of 50 tokens fit in one batch; the CPU default
of 512 would cap every batch at 10 rows. For each row: the round-trip percentiles over every
client, requests per second, the average batch size (the server's own counters) and the
server's CPU time per request: /proc/PID/task/*/schedstat of the server process (every thread)
over the timed round trips, divided by the requests the server counted in them. Batch 1 and
batch 16 are measured the same way, each by its own server.

Beside the wall-time percentiles, the interleaved table gives the CPU time each side spent per
round trip ("cpu here": this process, all threads; "cpu peer": the child, from
/proc/PID/task/*/schedstat, over the whole interleaved window, so a server's idle ticks while
the other transports run count too). CPU time depends far less than wall time on what else the
machine runs (though cache misses still inflate it there), so it is the column to compare
across runs on a shared machine, where wall time is dominated by waiting for a core.

Targets: the fastest Queue's round trip at least 3x bicodec-shm's at batch 1 (one client);
the server's CPU per request at most 30 us at batch 1 and at most 20 us at batch 16; and, from
earlier, bicodec-shm's median within 1.5x the floor's. The table says, for each, what was
measured and whether it was met, and then says plainly how bicodec-shm's round trip compares
with the Pipe's and with the fastest Queue's.

Usage::

    python benchmarks/bench_ipc.py                 # 2000 round trips per transport
    python benchmarks/bench_ipc.py --quick         # a few seconds, for a smoke check
    python benchmarks/bench_ipc.py --clients 4,8,16,32   # more concurrent rows
    python benchmarks/bench_ipc.py --profile out   # also cProfile separate runs at batch 1 and 16

Results are printed as a table and written as JSON (default ``benchmarks/out/bench_ipc.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.context
import os
import pstats
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import posix_ipc
from tqdm import tqdm

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.deploy.processes import is_serving
from bicodec_shm.errors import SegmentError, ServerUnavailableError
from bicodec_shm.protocol.header import read_header
from bicodec_shm.protocol.names import leftover_objects, random_name, unlink_all
from bicodec_shm.server.batching import DEFAULT_CUDA_MAX_BATCH_TOKENS

N_TOKENS = 50
N_GLOBAL = 32
HOP = 320
N_SAMPLES = N_TOKENS * HOP  # 16 000 int16 samples = 1 s at 16 kHz
N_REQUESTS = 256  # distinct pre-generated requests, cycled through
SERVER_SLOTS = 8  # the client claims 4 (its default); 8 keeps the segment at ~15 MiB
SERVER_MAX_BATCH = 16
REPLY_TIMEOUT = 60.0  # seconds; generous because the first reply waits for a child to start
DECODE_TIMEOUT = 10.0  # seconds; a no-op decode takes well under 1 ms, even on a busy machine
START_TIMEOUT = 120.0  # seconds for the server child to import torch and create its segment

DEFAULT_CLIENTS = (1, 4, 16)  # the concurrent rows
TARGET_CLIENTS = (1, 16)  # always measured: the server-CPU targets are at batch 1 and 16
# The no-op server stands for a GPU server, so it gets the GPU's padded-token budget: 16 rows of
# 50 tokens fit in one batch (the CPU default, 512 tokens, would cap every batch at 10 rows).
NOOP_MAX_BATCH_TOKENS = DEFAULT_CUDA_MAX_BATCH_TOKENS
# A no-op batch is ready at once, so with no wait the server would take whatever has arrived;
# waiting (asleep on the doorbell) until max_batch = clients requests are in makes the batch
# size the row's clients. The wait ends as soon as the batch is full; it runs out only when a
# client is descheduled. (The batches of ~9-10 that 16 clients got before came from the CPU's
# padded-token budget, 512 / 50 = 10 rows, not from this wait: see NOOP_MAX_BATCH_TOKENS.)
CONCURRENT_WAIT_MS = 20.0

TARGET_FLOOR_RATIO = 1.5  # bicodec-shm median <= 1.5 x the semaphore floor's
TARGET_QUEUE_SPEEDUP = 3.0  # the fastest Queue's median >= 3 x bicodec-shm's, at batch 1
# Server CPU per request (us) at each batch size the targets name: the rows of 1 and 16
# clients, which every run measures.
TARGET_SERVER_CPU_US = {1: 30.0, 16: 20.0}
TARGET_SERVER_BATCH = max(TARGET_SERVER_CPU_US)  # the larger batch of the targets

FLOOR = "semaphore floor"
SHM = "bicodec-shm"
PIPE = "multiprocessing.Pipe"
QUEUE = "multiprocessing.Queue"  # a bare get(): the fast path
QUEUE_TIMEOUT = "multiprocessing.Queue get(timeout)"
TRANSPORTS = (FLOOR, SHM, PIPE, QUEUE, QUEUE_TIMEOUT)
QUEUES = (QUEUE, QUEUE_TIMEOUT)
_CHILD_EXITED = "bench: the echo child exited"  # the watcher's marker in a reply queue

Request = tuple[np.ndarray, np.ndarray]


# ---------------------------------------------------------------------------------------------
# Child processes (module level so that the spawn context can import them)
# ---------------------------------------------------------------------------------------------


def _child_setup(on_orphan: Callable[[], None] | None = None) -> None:
    """Leave Ctrl-C to the parent, which stops children in order; exit if it dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = mp.parent_process()
    assert parent is not None, "only for processes started by multiprocessing"

    def watch() -> None:
        parent.join()  # returns when the parent's end of a pipe closes: when it exits or dies
        (on_orphan or (lambda: os._exit(1)))()

    threading.Thread(target=watch, daemon=True, name="bench-orphan-watch").start()


class _NoopDecoder:
    """A decoder that costs nothing: (B, T) tokens -> (B, 320·T) zeros on the CPU.

    The zeros are a view of one tensor made once (grown when a larger batch comes): a fresh
    ``torch.zeros`` per batch (1 MB at batch 16) cost ~12 us per request here, which is the
    decoder's allocation, not the server's overhead. The server never writes into a decoder's
    output (lanes.py converts into buffers of its own), so sharing it is safe.
    """

    device = "cpu"

    def __init__(self) -> None:
        import torch

        self._zeros = torch.zeros(SERVER_MAX_BATCH, N_SAMPLES)

    def detokenize(self, semantic_ids: Any, global_ids: Any, lengths: Any) -> Any:
        """(B, T) long, (B, 32) long, (B,) long -> (B, 320·T) float32 zeros."""
        b, t = semantic_ids.shape
        if b > self._zeros.shape[0] or HOP * t > self._zeros.shape[1]:
            self._zeros = self._zeros.new_zeros(max(b, self._zeros.shape[0]),
                                                max(HOP * t, self._zeros.shape[1]))  # fmt: skip
        return self._zeros[:b, : HOP * t]


def _serve_noop(name: str, slots: int, max_batch: int, profile_path: str | None,
                max_wait_ms: float = 0.0) -> None:  # fmt: skip
    import torch

    torch.set_num_threads(1)
    from bicodec_shm.server.server import DecoderServer

    server = DecoderServer(_NoopDecoder(), name, slots=slots, max_batch=max_batch,
                           max_wait_ms=max_wait_ms, max_batch_tokens=NOOP_MAX_BATCH_TOKENS)  # fmt: skip
    # serve_forever replaces _child_setup's SIGINT handler with its own (stop, then unlink), so
    # Ctrl-C, the parent's SIGTERM and an orphaned server all end in a clean unlink.
    _child_setup(on_orphan=server.stop)
    if profile_path is None:
        server.serve_forever()
        return
    # CPU time of the serving thread (the one lane), not wall time: a wall-clock profile
    # charges the server for the time it waits for a core, e.g. in the sem_post that wakes a
    # client, which the server-CPU rows do not count.
    profiler = cProfile.Profile(time.thread_time_ns, 1e-9)
    profiler.enable()
    try:
        server.serve_forever()
    finally:
        profiler.disable()
        profiler.dump_stats(profile_path)


def _semaphore_echo(ping_name: str, pong_name: str, count: int) -> None:
    ping, pong = posix_ipc.Semaphore(ping_name), posix_ipc.Semaphore(pong_name)

    def orphaned() -> None:
        # The parent died without its finally blocks (SIGKILL): remove its semaphores.
        for sem_name in (ping_name, pong_name):
            with contextlib.suppress(posix_ipc.Error):
                posix_ipc.unlink_semaphore(sem_name)
        os._exit(1)

    _child_setup(on_orphan=orphaned)
    try:
        for _ in range(count):
            ping.acquire()
            pong.release()
        # Exit only when the parent says so (one more post): exiting right after the last
        # round trip would add the interpreter's teardown to the CPU time measured for us.
        with contextlib.suppress(posix_ipc.BusyError):
            ping.acquire(REPLY_TIMEOUT)
    finally:
        ping.close()
        pong.close()


def _queue_echo(requests: Any, replies: Any) -> None:
    _child_setup()
    while requests.get() is not None:
        replies.put(np.zeros(N_SAMPLES, np.int16))


def _pipe_echo(conn: Any) -> None:
    _child_setup()
    try:
        while conn.recv() is not None:
            conn.send(np.zeros(N_SAMPLES, np.int16))
    except EOFError:
        pass  # the parent went away


def _concurrent_client(name: str, index: int, iterations: int, warmup: int, start: Any,
                       results: Any) -> None:  # fmt: skip
    """One of K client processes: warm up, wait for the common start, time round trips."""
    _child_setup()
    client = None
    try:
        client = DecoderClient(name, slots=1, timeout=DECODE_TIMEOUT, connect_timeout=START_TIMEOUT)
        requests = make_requests(64, seed=index + 1)
        _check_reply(SHM, client.decode(*requests[0]))
        _timed(lambda r: client.decode(r[0], r[1]), requests, 1, warmup, [])
        results.put(("ready", index))
        start.wait()
        samples: list[float] = []
        cpu0 = time.process_time()
        _timed(lambda r: client.decode(r[0], r[1]), requests, 0, iterations, samples)
        cpu = time.process_time() - cpu0
        results.put(("done", index, samples, cpu, "torch" in sys.modules))
    except BaseException:
        results.put(("error", index, traceback.format_exc()))
        raise
    finally:
        if client is not None:
            client.close()


# ---------------------------------------------------------------------------------------------
# The parent's side of each transport
# ---------------------------------------------------------------------------------------------


@dataclass
class Peer:
    """A running transport: ``roundtrip(request)`` sends one request and returns the reply."""

    roundtrip: Callable[[Request], Any]
    children: list[mp.process.BaseProcess] = field(default_factory=list)
    shm_names: list[str] = field(default_factory=list)
    counters: Callable[[], dict[str, int]] | None = None


def _stop_child(proc: mp.process.BaseProcess, *, timeout: float = 10.0) -> None:
    """Wait for a child asked to exit; escalate to SIGTERM, then SIGKILL."""
    if proc.pid is None:
        return  # never started
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(5.0)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _check_clean(name: str) -> None:
    left = leftover_objects(name)
    if left:
        unlink_all(name)
        raise RuntimeError(f"/dev/shm objects left behind under {name!r}: {left}")


@contextlib.contextmanager
def semaphore_peer(ctx: mp.context.BaseContext, *, total: int) -> Iterator[Peer]:
    """Ping-pong a pair of POSIX semaphores with a child, ``total`` times in all."""
    base = random_name("bcshm-bench")
    ping_name, pong_name = f"/{base}.ping", f"/{base}.pong"
    ping = pong = None
    proc = ctx.Process(target=_semaphore_echo, args=(ping_name, pong_name, total),
                       name="bench-semaphore-echo", daemon=True)  # fmt: skip
    try:
        ping = posix_ipc.Semaphore(ping_name, posix_ipc.O_CREX, 0o600, 0)
        pong = posix_ipc.Semaphore(pong_name, posix_ipc.O_CREX, 0o600, 0)
        proc.start()
        # Timed wait, as DecoderClient's: a dead child raises BusyError instead of hanging.
        release, acquire = ping.release, pong.acquire

        def roundtrip(_request: Request) -> None:
            release()
            acquire(REPLY_TIMEOUT)

        yield Peer(roundtrip, children=[proc], shm_names=[base])
    finally:
        if ping is not None and proc.pid is not None:
            ping.release()  # "exit now"; a child still short of its count exits on SIGTERM
        _stop_child(proc, timeout=2.0)
        for sem, sem_name in ((ping, ping_name), (pong, pong_name)):
            if sem is not None:
                sem.close()
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_semaphore(sem_name)
        _check_clean(base)


@contextlib.contextmanager
def bicodec_shm_peer(ctx: mp.context.BaseContext, *, total: int = 0,
                     profile_path: str | None = None) -> Iterator[Peer]:  # fmt: skip
    """A no-op ``DecoderServer`` in a spawned child and a ``DecoderClient`` here."""
    del total  # the server runs until stopped
    name = random_name("bcshm-bench")
    proc = ctx.Process(target=_serve_noop, name="bench-decoder-server", daemon=True,
                       args=(name, SERVER_SLOTS, SERVER_MAX_BATCH, profile_path))  # fmt: skip
    client: DecoderClient | None = None
    try:
        proc.start()
        client = _connect(name, proc)

        def counters() -> dict[str, int]:
            h = read_header(name)
            if h is None:
                return {}
            keys = ("requests", "batches", "queue_wait_ns", "decode_ns")
            return {k: int(h[k]) for k in keys}

        decode = client.decode

        def roundtrip(request: Request) -> np.ndarray:
            return decode(request[0], request[1])

        yield Peer(roundtrip, children=[proc], shm_names=[name], counters=counters)
    finally:
        if client is not None:
            client.close()
        if proc.pid is not None and proc.is_alive():
            proc.terminate()  # SIGTERM: the server finishes its batch, then unlinks everything
        _stop_child(proc)
        unlink_all(name)  # in case the server died without cleaning up
        _check_clean(name)


def _connect(name: str, proc: mp.process.BaseProcess) -> DecoderClient:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            return DecoderClient(name, timeout=DECODE_TIMEOUT)
        except (ServerUnavailableError, SegmentError):
            if not proc.is_alive():
                raise RuntimeError(f"the decoder server exited with code {proc.exitcode}") from None
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.02)


@contextlib.contextmanager
def pipe_peer(ctx: mp.context.BaseContext, *, total: int = 0) -> Iterator[Peer]:
    """Pickle requests and replies through one duplex ``multiprocessing.Pipe``."""
    del total
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_pipe_echo, args=(there,), name="bench-pipe-echo", daemon=True)
    try:
        proc.start()
        there.close()  # so that the child's exit shows here as EOF
        send, recv = here.send, here.recv

        def roundtrip(request: Request) -> np.ndarray:
            send(request)
            return recv()  # no timeout needed: a dead child shows as EOFError

        yield Peer(roundtrip, children=[proc])
    finally:
        with contextlib.suppress(OSError):
            here.send(None)
        _stop_child(proc)
        here.close()
        there.close()


@contextlib.contextmanager
def queue_peer(ctx: mp.context.BaseContext, *, total: int = 0,
               timeout: float | None = None) -> Iterator[Peer]:  # fmt: skip
    """Pickle requests and replies through two ``multiprocessing.Queue`` objects.

    ``timeout`` None: a bare ``get()``, the fast path (a user who picks a Queue picks this).
    A Queue never sees its peer die, so a watcher thread puts a marker into the reply queue
    when the child exits: a dead child then ends the run instead of hanging it. Otherwise
    ``get(timeout=timeout)``, which polls the pipe before every read (tens of us more).
    """
    del total
    requests, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_queue_echo, args=(requests, replies), name="bench-queue-echo",
                       daemon=True)  # fmt: skip
    stopping = threading.Event()
    try:
        proc.start()
        put, get = requests.put, replies.get
        if timeout is None:

            def watch() -> None:
                multiprocessing.connection.wait([proc.sentinel])  # blocked in the kernel
                if not stopping.is_set():
                    with contextlib.suppress(OSError, ValueError):
                        replies.put(_CHILD_EXITED)

            threading.Thread(target=watch, daemon=True, name="bench-queue-watch").start()

            def roundtrip(request: Request) -> np.ndarray:
                put(request)
                reply = get()
                if reply.__class__ is str:  # the watcher's marker
                    raise RuntimeError(f"the Queue echo child exited with code {proc.exitcode}")
                return reply

        else:

            def roundtrip(request: Request) -> np.ndarray:
                put(request)
                return get(timeout=timeout)

        yield Peer(roundtrip, children=[proc])
    finally:
        stopping.set()
        with contextlib.suppress(OSError, ValueError):
            requests.put(None)
        _stop_child(proc)
        for q in (requests, replies):
            q.cancel_join_thread()  # never block exit on a feeder thread with nobody reading
            q.close()


def queue_timeout_peer(ctx: mp.context.BaseContext, *, total: int = 0
                       ) -> contextlib.AbstractContextManager[Peer]:  # fmt: skip
    """``queue_peer`` read with ``get(timeout=REPLY_TIMEOUT)``."""
    return queue_peer(ctx, total=total, timeout=REPLY_TIMEOUT)


PEERS: dict[str, Callable[..., contextlib.AbstractContextManager[Peer]]] = {
    FLOOR: semaphore_peer,
    SHM: bicodec_shm_peer,
    PIPE: pipe_peer,
    QUEUE: queue_peer,
    QUEUE_TIMEOUT: queue_timeout_peer,
}


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def make_requests(n: int = N_REQUESTS, *, seed: int = 0) -> list[Request]:
    """``n`` random requests: (50,) int32 semantic ids and (32,) int32 global ids."""
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, 8192, N_TOKENS).astype(np.int32),
         rng.integers(0, 4096, N_GLOBAL).astype(np.int32))
        for _ in range(n)
    ]  # fmt: skip


def _check_reply(transport: str, reply: Any) -> None:
    if transport == FLOOR:
        return
    ok = isinstance(reply, np.ndarray) and reply.dtype == np.int16 and reply.shape == (N_SAMPLES,)
    if not ok:
        got = f"{type(reply).__name__} {getattr(reply, 'dtype', '')} {getattr(reply, 'shape', '')}"
        raise RuntimeError(f"{transport} replied with {got}, expected ({N_SAMPLES},) int16")


def _timed(roundtrip: Callable[[Request], Any], requests: list[Request], start: int, n: int,
           out: list[float]) -> None:  # fmt: skip
    """Append ``n`` individually timed round trips (seconds) to ``out``."""
    clock = time.perf_counter
    k = len(requests)
    for i in range(start, start + n):
        request = requests[i % k]
        t0 = clock()
        roundtrip(request)
        out.append(clock() - t0)


def _children_cpu(children: list[mp.process.BaseProcess]) -> float | None:
    """CPU seconds used so far by every thread of ``children``, or None where unknown.

    Read from /proc/PID/task/TID/schedstat (nanoseconds on CPU) rather than psutil's
    cpu_times, which counts in 10 ms clock ticks: too coarse for a few hundred round trips.
    """
    total_ns = 0
    for proc in children:
        try:
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as f:
                    total_ns += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None
    return total_ns / 1e9


def bench_all(transports: tuple[str, ...] = TRANSPORTS, *, iterations: int, warmup: int,
              rounds: int, progress: bool = True) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Time ``iterations`` round trips of each transport, interleaved in ``rounds`` rounds.

    Returns, per transport: ``samples`` (seconds, in order); ``client_cpu_s`` and
    ``server_cpu_s``, the CPU time this process and the transport's child used over the timed
    round trips (less sensitive than wall time to what else the machine runs);
    and, for bicodec-shm, ``server``, the deltas of the server's own counters.
    """
    unknown = set(transports) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown transports {sorted(unknown)}; choose from {list(PEERS)}")
    if iterations < 1 or warmup < 0 or rounds < 1:
        raise ValueError("iterations and rounds must be >= 1 and warmup >= 0")
    rounds = min(rounds, iterations)
    ctx = mp.get_context("spawn")
    requests = make_requests()
    warm = max(1, warmup)  # at least one, to wait for every child and check its reply
    samples: dict[str, list[float]] = {t: [] for t in transports}
    done = dict.fromkeys(transports, 0)
    client_cpu = dict.fromkeys(transports, 0.0)
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        peers = {t: stack.enter_context(PEERS[t](ctx, total=warm + iterations))
                 for t in transports}  # fmt: skip
        # Warm-up, which also waits for every child to be up and checks each reply once.
        for t, peer in peers.items():
            _check_reply(t, peer.roundtrip(requests[0]))
            _timed(peer.roundtrip, requests, 1, warm - 1, [])
        before = {t: p.counters() for t, p in peers.items() if p.counters}
        child_cpu = {t: _children_cpu(p.children) for t, p in peers.items()}
        bar = tqdm(total=iterations * len(transports), desc="round trips", unit="rt",
                   file=sys.stderr, disable=not progress, leave=False)  # fmt: skip
        with bar:
            for r in range(rounds):
                # Rotate the order so that no transport always runs right after another one.
                order = transports[r % len(transports) :] + transports[: r % len(transports)]
                for t in order:
                    n = iterations * (r + 1) // rounds - done[t]
                    # process_time: all threads, so that Queue's feeder thread is counted.
                    cpu0 = time.process_time()
                    _timed(peers[t].roundtrip, requests, warm + done[t], n, samples[t])
                    client_cpu[t] += time.process_time() - cpu0
                    done[t] += n
                    bar.update(n)
        for t, peer in peers.items():
            cpu0, cpu1 = child_cpu[t], _children_cpu(peer.children)
            results[t] = {
                "samples": samples[t],
                "shm_names": peer.shm_names,
                "client_cpu_s": client_cpu[t],
                "server_cpu_s": None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
            }
            if peer.counters:
                after = peer.counters()
                results[t]["server"] = {k: after[k] - before[t].get(k, 0) for k in after}
    # Only now (after the ExitStack stopped them) are exit codes final.
    for t, peer in peers.items():
        results[t]["exitcodes"] = [p.exitcode for p in peer.children]
    return results


def bench_concurrent(clients: int, *, iterations: int, warmup: int,
                     wait_ms: float = CONCURRENT_WAIT_MS,
                     profile_path: str | None = None) -> dict[str, Any]:  # fmt: skip
    """``clients`` processes doing synchronous round trips against one no-op server whose
    ``max_batch`` is ``clients``; ``iterations`` round trips in all, shared out.

    Returns the samples of every client (seconds), the wall time of the timed part, the
    server's CPU seconds over it (schedstat, all threads), the clients' CPU seconds (summed),
    the deltas of the server's counters, and whether any client imported torch.
    ``profile_path``: cProfile the server (CPU time of its lane) into this file.
    """
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    ctx = mp.get_context("spawn")
    name = random_name("bcshm-bench")
    per_client = max(1, iterations // clients)
    server = ctx.Process(target=_serve_noop, name="bench-decoder-server", daemon=True,
                         args=(name, max(SERVER_SLOTS, clients), clients, profile_path, wait_ms))  # fmt: skip
    start, results = ctx.Event(), ctx.Queue()
    procs: list[mp.process.BaseProcess] = []
    out: dict[str, Any] = {"clients": clients, "per_client": per_client, "samples": [],
                           "client_cpu_s": 0.0, "torch": False, "shm_names": [name]}  # fmt: skip
    try:
        server.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not is_serving(name):
            if not server.is_alive():
                raise RuntimeError(f"the decoder server exited with code {server.exitcode}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the decoder server did not start within {START_TIMEOUT:.0f} s")
            time.sleep(0.02)
        for i in range(clients):
            proc = ctx.Process(target=_concurrent_client, name=f"bench-client-{i}", daemon=True,
                               args=(name, i, per_client, warmup, start, results))  # fmt: skip
            proc.start()
            procs.append(proc)

        def next_result() -> tuple:
            item = results.get(timeout=REPLY_TIMEOUT + START_TIMEOUT)
            if item[0] == "error":
                raise RuntimeError(f"client {item[1]} failed:\n{item[2]}")
            return item

        for _ in range(clients):
            next_result()  # "ready": connected and warmed up
        before, cpu0 = _server_counters(name), _children_cpu([server])
        t0 = time.perf_counter()
        start.set()
        for _ in range(clients):
            _, _, samples, cpu, torch_imported = next_result()
            out["samples"] += samples
            out["client_cpu_s"] += cpu
            out["torch"] |= torch_imported
        out["wall_s"] = time.perf_counter() - t0
        after, cpu1 = _server_counters(name), _children_cpu([server])
        out["server_cpu_s"] = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        out["server"] = {k: after[k] - before.get(k, 0) for k in after}
        out["server_requests_total"] = after.get("requests", 0)  # warm-up included
    finally:
        for proc in procs:
            _stop_child(proc)
        if server.pid is not None and server.is_alive():
            server.terminate()
        _stop_child(server)
        results.cancel_join_thread()
        results.close()
        unlink_all(name)
        _check_clean(name)
    out["exitcodes"] = [p.exitcode for p in procs] + [server.exitcode]
    return out


def _server_counters(name: str) -> dict[str, int]:
    h = read_header(name)
    if h is None:
        return {}
    return {k: int(h[k]) for k in ("requests", "batches", "queue_wait_ns", "decode_ns")}


def summarize_concurrent(result: dict[str, Any]) -> dict[str, Any]:
    """A concurrent row: round-trip percentiles (us), requests/s, average batch, CPU per request."""
    stats = summarize({"samples": result["samples"]})
    server = result.get("server", {})
    requests, batches = server.get("requests", 0), server.get("batches", 0)
    n = len(result["samples"])
    cpu = result.get("server_cpu_s")
    return {
        "clients": result["clients"], "n": n, "median_us": stats["median_us"],
        "p10_us": stats["p10_us"], "p90_us": stats["p90_us"], "p99_us": stats["p99_us"],
        "requests_per_s": n / result["wall_s"] if result.get("wall_s") else None,
        "avg_batch_size": requests / batches if batches else None,
        # Per request the server served in the timed part (its counter), not per sample: the
        # same number unless a warm-up round trip of a slow client overlapped the timed part.
        "server_cpu_us": cpu * 1e6 / requests if cpu is not None and requests else None,
        "client_cpu_us": result["client_cpu_s"] * 1e6 / n if n else None,
        "server_requests": requests, "server_batches": batches,
    }  # fmt: skip


def bench_semaphore_floor(*, iterations: int = 2000, warmup: int = 200) -> list[float]:
    """Seconds per round trip of the semaphore ping-pong alone."""
    return bench_all((FLOOR,), iterations=iterations, warmup=warmup, rounds=1)[FLOOR]["samples"]


def bench_bicodec_shm(*, iterations: int = 2000, warmup: int = 200) -> list[float]:
    """Seconds per ``DecoderClient.decode`` round trip against a no-op server."""
    return bench_all((SHM,), iterations=iterations, warmup=warmup, rounds=1)[SHM]["samples"]


def bench_pipe(*, iterations: int = 2000, warmup: int = 200) -> list[float]:
    """Seconds per round trip through ``multiprocessing.Pipe``."""
    return bench_all((PIPE,), iterations=iterations, warmup=warmup, rounds=1)[PIPE]["samples"]


def bench_queue(*, iterations: int = 2000, warmup: int = 200, timeout: bool = False) -> list[float]:
    """Seconds per round trip through ``multiprocessing.Queue`` (bare ``get()``, or
    ``get(timeout=)`` with ``timeout``)."""
    t = QUEUE_TIMEOUT if timeout else QUEUE
    return bench_all((t,), iterations=iterations, warmup=warmup, rounds=1)[t]["samples"]


def summarize(result: dict[str, Any]) -> dict[str, float | None]:
    """Order statistics of round-trip times and CPU time per round trip, in microseconds."""
    us = np.asarray(result["samples"]) * 1e6
    p10, p50, p90, p99 = np.percentile(us, [10, 50, 90, 99])

    def per_rt(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1e6 / us.size

    return {"n": int(us.size), "median_us": float(p50), "p10_us": float(p10),
            "p90_us": float(p90), "p99_us": float(p99), "mean_us": float(us.mean()),
            "min_us": float(us.min()), "max_us": float(us.max()),
            "client_cpu_us": per_rt(result.get("client_cpu_s")),
            "server_cpu_us": per_rt(result.get("server_cpu_s"))}  # fmt: skip


def compare(stats: dict[str, dict[str, float]],
            concurrent: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:  # fmt: skip
    """Ratios of medians, the targets where what they compare was measured, and plain
    statements of how bicodec-shm's round trip compares with the Pipe's and the fastest Queue's.

    Every Queue comparison is against the fastest Queue row measured (a user who picks a Queue
    picks its fast path); ``fastest_queue`` names it.
    """
    med = {t: s["median_us"] for t, s in stats.items()}
    out: dict[str, Any] = {"vs_floor": {}, "vs_bicodec_shm": {}, "targets": {}, "plain": {}}
    for t, m in med.items():
        if FLOOR in med:
            out["vs_floor"][t] = m / med[FLOOR]
        if SHM in med:
            out["vs_bicodec_shm"][t] = m / med[SHM]
    queues = [t for t in QUEUES if t in med]
    fastest = min(queues, key=lambda t: med[t]) if queues else None
    out["fastest_queue"] = fastest
    if SHM in med and fastest is not None:
        ratio = med[fastest] / med[SHM]
        out["targets"]["faster_than_queue"] = {
            "goal": f"fastest Queue round trip / bicodec-shm round trip at batch 1 >= "
                    f"{TARGET_QUEUE_SPEEDUP:g}x ({fastest})",
            "measured": ratio, "unit": "x", "met": ratio >= TARGET_QUEUE_SPEEDUP,
            "queue": fastest}  # fmt: skip
    rows = {r["clients"]: r for r in concurrent}
    for batch, goal_us in TARGET_SERVER_CPU_US.items():
        row = rows.get(batch)
        if row is None or row.get("server_cpu_us") is None:
            continue
        cpu = row["server_cpu_us"]
        avg = row.get("avg_batch_size") or 0.0
        out["targets"][f"server_cpu_at_batch_{batch}"] = {
            "goal": f"server CPU per request at batch {batch} <= {goal_us:g} us "
                    f"({batch} client{'s' * (batch != 1)}, avg batch {avg:.1f})",
            "measured": cpu, "unit": " us", "met": cpu <= goal_us,
            "clients": batch, "avg_batch_size": row.get("avg_batch_size")}  # fmt: skip
    if SHM in med and FLOOR in med:
        ratio = med[SHM] / med[FLOOR]
        out["targets"]["bicodec_shm_within_floor"] = {
            "goal": f"bicodec-shm median <= {TARGET_FLOOR_RATIO}x semaphore floor",
            "measured": ratio, "unit": "x", "met": ratio <= TARGET_FLOOR_RATIO}  # fmt: skip
    for key, other in (("vs_pipe", PIPE), ("vs_fastest_queue", fastest)):
        if SHM in med and other is not None and other in med:
            ratio = med[SHM] / med[other]
            faster = other if ratio > 1 else SHM
            out["plain"][key] = {
                "other": other, "shm_median_us": med[SHM], "other_median_us": med[other],
                "shm_over_other": ratio,
                "says": f"bicodec-shm's round trip ({med[SHM]:.0f} us) is {ratio:.2f}x "
                        f"{other}'s ({med[other]:.0f} us): {faster} is faster"}  # fmt: skip
    return out


def server_breakdown(server: dict[str, int]) -> dict[str, float]:
    """Average server-side phases per request, in microseconds, from its header counters."""
    requests, batches = server.get("requests", 0), server.get("batches", 0)
    if not requests or not batches:
        return {}
    return {
        # t_submit (client, just before its sem_post) -> t_start (server took it into a batch)
        "submit_to_batch_us": server["queue_wait_ns"] / requests / 1e3,
        # _run_decoder: tokens -> tensors, detokenize (no-op here), .numpy()
        "decode_call_us": server["decode_ns"] / batches / 1e3,
        "avg_batch_size": requests / batches,
    }


def server_cpu_summary(concurrent: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{"batch_1": ..., "batch_16": ...}``: the server's CPU per request of the rows of 1 and
    16 clients beside their goals (None where a row is missing or its CPU unknown)."""
    rows = {r["clients"]: r for r in concurrent}
    out = {}
    for batch, goal_us in TARGET_SERVER_CPU_US.items():
        row = rows.get(batch, {})
        cpu = row.get("server_cpu_us")
        out[f"batch_{batch}"] = {
            "clients": batch, "server_cpu_us": cpu, "goal_us": goal_us,
            "met": None if cpu is None else cpu <= goal_us,
            "avg_batch_size": row.get("avg_batch_size"),
            "server_requests": row.get("server_requests")}  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def format_table(stats: dict[str, dict[str, float]], comparison: dict[str, Any],
                 breakdown: dict[str, float] | None = None,
                 concurrent: Sequence[dict[str, Any]] = ()) -> str:  # fmt: skip
    """The results as plain-text tables (times in microseconds), then the targets."""

    def opt(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    head = ("transport", "median", "p10", "p90", "mean", "x floor", "x shm", "cpu here",
            "cpu peer")  # fmt: skip
    rows = [head]
    for t, s in stats.items():
        vf, vs = comparison["vs_floor"].get(t), comparison["vs_bicodec_shm"].get(t)
        rows.append((t, f"{s['median_us']:.1f}", f"{s['p10_us']:.1f}", f"{s['p90_us']:.1f}",
                     f"{s['mean_us']:.1f}", opt(vf, ".2f") + "x" * (vf is not None),
                     opt(vs, ".2f") + "x" * (vs is not None), opt(s["client_cpu_us"], ".1f"),
                     opt(s["server_cpu_us"], ".1f")))  # fmt: skip
    out = [
        "round-trip wall time and CPU time per round trip (this process, the peer "
        "process), microseconds; x shm: this transport's median / bicodec-shm's",
        *_aligned(rows),
    ]
    if breakdown:
        out += ["", f"bicodec-shm server counters: submit -> batch start "
                    f"{breakdown['submit_to_batch_us']:.1f} us/request, decode call "
                    f"{breakdown['decode_call_us']:.1f} us/batch, "
                    f"avg batch {breakdown['avg_batch_size']:.2f}"]  # fmt: skip
    if concurrent:
        crows = [("clients", "avg batch", "median", "p10", "p90", "p99", "req/s",
                  "server cpu/req", "client cpu/req")]  # fmt: skip
        for r in concurrent:
            crows.append((str(r["clients"]), opt(r["avg_batch_size"], ".2f"), f"{r['median_us']:.1f}",
                          f"{r['p10_us']:.1f}", f"{r['p90_us']:.1f}", f"{r['p99_us']:.1f}",
                          opt(r["requests_per_s"], ".0f"), opt(r["server_cpu_us"], ".1f"),
                          opt(r["client_cpu_us"], ".1f")))  # fmt: skip
        out += ["", "bicodec-shm with K client processes, each row its own no-op server (max_batch "
                    "= K): round trip and CPU per request (server: schedstat of the server "
                    "process over the timed round trips / requests it served; client: the mean "
                    "over clients), microseconds",
                *_aligned(crows)]  # fmt: skip
    targets = comparison["targets"]
    if targets:
        goal_w = max(len(v["goal"]) for v in targets.values())
        out += ["", f"{'target'.ljust(goal_w)}  measured  result"]
        for v in targets.values():
            result = "met" if v["met"] else "NOT MET"
            measured = f"{v['measured']:.2f}{v.get('unit', 'x')}"
            out.append(f"{v['goal'].ljust(goal_w)}  {measured.rjust(8)}  {result}")
    plain = comparison.get("plain", {})
    if plain:
        out += ["", "plainly:", *(f"  {v['says']}" for v in plain.values())]
    return "\n".join(out)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """The first column left-aligned, the rest right-aligned; a rule under the head."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: tuple[str, ...]) -> str:
        cells = [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        return "  ".join([r[0].ljust(widths[0]), *cells])

    return [line(rows[0]), line(tuple("-" * w for w in widths)), *(line(r) for r in rows[1:])]


# ---------------------------------------------------------------------------------------------
# Profiling (a separate run: cProfile would inflate the table's numbers)
# ---------------------------------------------------------------------------------------------


def profile_bicodec_shm(prefix: str, *, iterations: int, warmup: int, top: int = 25,
                        clients: int = TARGET_SERVER_BATCH) -> str:  # fmt: skip
    """cProfile both sides of ``iterations`` bicodec-shm round trips at batch 1, and the server
    of a ``clients``-client row (batch ``clients``); returns a text report.

    Writes ``PREFIX.client.prof``, ``PREFIX.server.prof`` and ``PREFIX.server{clients}.prof``
    (open with ``python -m pstats``). The servers' profiles count the CPU time of their lane
    (``time.thread_time``), over their whole life (warm-up included); the report gives the
    requests each served, to read the totals per request.
    """
    client_path, server_path = f"{prefix}.client.prof", f"{prefix}.server.prof"
    batch_path = f"{prefix}.server{clients}.prof"
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    for path in (server_path, batch_path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    requests = make_requests()
    profiler = cProfile.Profile(time.thread_time_ns, 1e-9)
    served = 0
    with bicodec_shm_peer(mp.get_context("spawn"), profile_path=server_path) as peer:
        _timed(peer.roundtrip, requests, 0, warmup, [])
        profiler.enable()
        _timed(peer.roundtrip, requests, warmup, iterations, [])
        profiler.disable()
        assert peer.counters is not None
        served = peer.counters().get("requests", 0)
    profiler.dump_stats(client_path)
    row = bench_concurrent(clients, iterations=iterations, warmup=warmup, profile_path=batch_path)
    summary = summarize_concurrent(row)
    report = io.StringIO()
    for label, path, what in (
        ("client", client_path, f"{iterations} round trips"),
        ("server, 1 client", server_path, f"{served} requests served in batches of 1"),
        (f"server, {clients} clients", batch_path,
         f"{row['server_requests_total']} requests served, avg batch "
         f"{summary['avg_batch_size'] or 0:.1f} in the timed part"),
    ):  # fmt: skip
        report.write(f"\n== {label} ({path}), {what}; CPU time, sorted by tottime ==\n")
        if os.path.exists(path):
            pstats.Stats(path, stream=report).sort_stats("tottime").print_stats(top)
        else:
            report.write("(no profile written)\n")
    return report.getvalue()


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    default_json = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "bench_ipc.json")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--iterations", type=int, default=2000, help="timed round trips per transport")
    p.add_argument("--warmup", type=int, default=200, help="untimed round trips first")
    p.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="interleave the transports in this many rounds (noise hits all alike)",
    )
    p.add_argument("--quick", action="store_true", help="200 iterations, 20 warm-up, 2 rounds")
    p.add_argument(
        "--transports",
        default=",".join(TRANSPORTS),
        help=f"comma-separated subset of: {', '.join(TRANSPORTS)}",
    )
    p.add_argument("--clients", default=",".join(map(str, DEFAULT_CLIENTS)), metavar="K,K,...",
                   help="concurrent rows: K client processes against one no-op server, "
                        "--iterations round trips in all (default %(default)s; the rows of "
                        f"{' and '.join(map(str, TARGET_CLIENTS))} clients, which the server-CPU "
                        "targets need, are always measured)")  # fmt: skip
    p.add_argument("--concurrent-wait-ms", type=float, default=CONCURRENT_WAIT_MS,
                   help="max_wait_ms of the concurrent rows' server (default %(default)s)")
    p.add_argument("--json", default=default_json, help="results file (default: %(default)s)")
    p.add_argument(
        "--profile",
        metavar="PREFIX",
        help="afterwards, cProfile separate bicodec-shm runs (CPU time) into PREFIX.client.prof, "
        f"PREFIX.server.prof (1 client) and PREFIX.server{TARGET_SERVER_BATCH}.prof "
        f"({TARGET_SERVER_BATCH} clients)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    if args.quick:
        args.iterations, args.warmup, args.rounds = 200, 20, 2
    if args.iterations < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--iterations and --rounds must be >= 1, --warmup >= 0")
    transports = tuple(t.strip() for t in args.transports.split(",") if t.strip())
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad or not transports:
        p.error(f"--transports: unknown {bad}; choose from {', '.join(TRANSPORTS)}")
    args.transports = tuple(t for t in TRANSPORTS if t in transports)
    try:
        args.clients = tuple(int(k) for k in args.clients.split(",") if k.strip())
    except ValueError:
        p.error(f"--clients: expected comma-separated integers, got {args.clients!r}")
    if any(k < 1 for k in args.clients) or args.concurrent_wait_ms < 0:
        p.error("--clients needs values >= 1 and --concurrent-wait-ms >= 0")
    args.clients = tuple(sorted(set(args.clients) | set(TARGET_CLIENTS)))
    return args


def main(argv: list[str] | None = None) -> int:
    # The same machine record as bench_throughput; imported here, not at the top, so that the
    # spawned children (which import this module) need not import the bench package.
    from bicodec_shm.tools.bench.sampling import environment

    args = _parse(argv)
    # SIGTERM (e.g. from a CI timeout) unwinds like Ctrl-C, so every finally block runs and
    # every child and /dev/shm object is cleaned up.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        started, load_start = time.perf_counter(), os.getloadavg()
        machine = environment()  # its loadavg: at the start, like load_start
        raw = bench_all(args.transports, iterations=args.iterations, warmup=args.warmup,
                        rounds=args.rounds, progress=not args.no_progress)  # fmt: skip
        concurrent_raw = [
            bench_concurrent(k, iterations=args.iterations, warmup=args.warmup,
                             wait_ms=args.concurrent_wait_ms)
            for k in args.clients
        ]
        elapsed = time.perf_counter() - started
        stats = {t: summarize(raw[t]) for t in args.transports}
        concurrent = [summarize_concurrent(r) for r in concurrent_raw]
        comparison = compare(stats, concurrent)
        breakdown = server_breakdown(raw[SHM]["server"]) if SHM in raw else {}
        print(f"{N_TOKENS} int32 tokens + {N_GLOBAL} int32 globals in, {N_SAMPLES} int16 samples "
              f"out (the floor carries no payload); {args.iterations} round trips per transport "
              f"in {min(args.rounds, args.iterations)} interleaved rounds after {args.warmup} "
              f"warm-up; {os.cpu_count()} CPUs, load average (1 min) {load_start[0]:.2f} at the "
              f"start, {os.getloadavg()[0]:.2f} at the end\n")  # fmt: skip
        print(format_table(stats, comparison, breakdown, concurrent))
        exitcodes = {**{t: r["exitcodes"] for t, r in raw.items()},
                     **{f"{r['clients']} clients": r["exitcodes"] for r in concurrent_raw}}  # fmt: skip
        failed = {t: codes for t, codes in exitcodes.items() if any(c != 0 for c in codes)}
        if failed:
            print(f"warning: child processes exited abnormally: {failed}", file=sys.stderr)
        report = {
            "benchmark": "bench_ipc",
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "config": {"iterations": args.iterations, "warmup": args.warmup,
                       "rounds": min(args.rounds, args.iterations),
                       "transports": list(args.transports), "n_tokens": N_TOKENS,
                       "n_global": N_GLOBAL, "n_samples": N_SAMPLES,
                       "server_slots": SERVER_SLOTS, "server_max_batch": SERVER_MAX_BATCH,
                       "clients": list(args.clients),
                       "concurrent_wait_ms": args.concurrent_wait_ms},
            "environment": machine,
            "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()),
            "elapsed_s": elapsed,
            "results": stats,
            "comparison": comparison,
            "bicodec_shm_server": breakdown,
            "concurrent": concurrent,
            # The targets' rows, by batch size: server CPU per request (us), the goal, met.
            "server_cpu_per_request": server_cpu_summary(concurrent),
            "child_exitcodes": exitcodes,
            "shm_names": sorted([n for r in raw.values() for n in r["shm_names"]] +
                                [n for r in concurrent_raw for n in r["shm_names"]]),
            "client_imported_torch": "torch" in sys.modules or any(r["torch"] for r in concurrent_raw),
        }  # fmt: skip
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"\nwrote {args.json}")
        if args.profile:
            print(profile_bicodec_shm(args.profile, iterations=args.iterations,
                                      warmup=args.warmup))  # fmt: skip
        return 1 if failed else 0
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
