"""A CPU decoder's kernels for the first windows of its streams, built before the server serves.

Why: torch runs a float32 CPU convolution through oneDNN, which builds (JIT-compiles) a kernel
the first time it sees an input shape at a thread count, and keeps it in a process-wide cache
(least recently used out). A batch brings shapes a worker's own decoder never sees: when four
streams open at once, their first windows decode as [2, 2], [2, 4] and [3, 2] frames, each
paying its builds. On a 2-core CPU (tiny Qwen3-TTS, one thread) [2, 2] took 19-22 ms the first
time and 5-6 ms after, so the four streams' first audio came ~20 ms later than with a decoder
in every worker (benchmarks/RESULTS.md, "Kernels built before serving").

What: before the segment reports SERVING, ``warm_up`` decodes zero codes (``slot_io.zero_batch``)
in the shapes those first windows take: each of ``frames`` (the served codec's default stream
preset's opening windows, ``StreamSettings.opening_windows``), 1 to ``rows`` rows, at each
thread count a lane may run with (``LaneControl.thread_counts``), through the lanes' own adapter,
so a CPU lane's traced graph is traced here too. Shortest windows and fewest rows first: they
are the first requests. It stops once ``budget_s`` has gone, so a full-size decoder (whose
decodes take hundreds of ms, and whose builds weigh little beside them) starts within it.

The cache holds 1024 kernels by default, ~27 shapes of tiny Qwen3-TTS's 37 convolutions: a
warm-up's 24 shapes would leave little room for the traffic's. ``bicodec-shm serve`` therefore
sets ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` to ``KERNEL_CACHE_CAPACITY`` unless the environment sets
it (read once, at the first convolution): a few hundred MiB at most (docs/deployment.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..protocol.slot_io import zero_batch
from .adapters import codec_adapter

log = logging.getLogger("bicodec_shm.server")

WARM_UP_ROWS = 4  # streams whose first windows batch together: a burst of workers starting at once
WARM_UP_BUDGET_S = 2.0  # the start-up time a warm-up may take
WARM_UP_WINDOWS = 3  # opening windows of a stream prepared (tiny Qwen3-TTS: 2, 4 and 8 frames)
KERNEL_CACHE_CAPACITY = 4096  # oneDNN kernels a server keeps (its default: 1024)


@dataclass(frozen=True)
class WarmUp:
    """What ``warm_up`` decoded: ``shapes`` as (rows, frames, threads), in order, and its time."""

    shapes: tuple[tuple[int, int, int], ...]
    seconds: float
    planned: int  # shapes it would have decoded without the budget


def warm_up(decoder: object, frames: Sequence[int], *, rows: int, thread_counts: Sequence[int],
            budget_s: float = WARM_UP_BUDGET_S) -> WarmUp:  # fmt: skip
    """Decode zero codes in every (rows, frames) shape at each thread count, shortest first,
    until ``budget_s`` has gone (the calling thread's torch thread count is restored). A
    failure costs the first requests time, never the server: it is logged, and the shapes
    built so far are returned.

    Args:
        decoder: the server's decoder (its ``codec_adapter`` decodes, as a lane's does).
        frames: window lengths in frames (duplicates and values < 1 are dropped).
        rows: the most rows of one shape (1..rows each).
        thread_counts: the intra-op thread counts the lanes may decode with.
        budget_s: no shape starts after this many seconds.
    """
    plan = [(r, f, t) for f in sorted({int(f) for f in frames if f >= 1})
            for r in range(1, rows + 1) for t in sorted(set(thread_counts))]  # fmt: skip
    done: list[tuple[int, int, int]] = []
    threads = torch.get_num_threads()
    start = time.perf_counter()
    try:
        adapter = codec_adapter(decoder)
        with torch.inference_mode():
            for r, f, t in plan:
                if time.perf_counter() - start >= budget_s:
                    break
                torch.set_num_threads(t)
                adapter.detokenize(zero_batch(adapter.layout, r, f))
                done.append((r, f, t))
    except Exception as exc:
        log.warning("serving without prebuilt kernels: the warm-up failed (%s: %s)", type(exc).__name__, exc)
    else:
        log.info("kernels built for %d of %d shapes (1-%d rows of %s frames, %s threads) in %.2f s%s",
                 len(done), len(plan), rows, sorted(set(frames)), sorted(set(thread_counts)),
                 time.perf_counter() - start,
                 "" if len(done) == len(plan) else f" (the {budget_s:g} s budget)")  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return WarmUp(tuple(done), time.perf_counter() - start, len(plan))
