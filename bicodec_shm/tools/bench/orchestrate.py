"""The order of the runs: every system at every N and repeat (``bench_all``), or bicodec-shm
over a grid of policies (``bench_sweep``)."""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from .config import LIMIT, PER_PROCESS, PROCESS_GIB, QUEUE, SHM, SYSTEMS, Policy, Setup
from .results import RunResult, _skipped
from .sampling import _Sampler
from .systems import _check_count, bench_ideal, bench_limit, bench_per_process, bench_queue, bench_shm


def _memory_ok(setup: Setup, n: int) -> str:
    """Why N decoder processes must not be started here ("" if they may).

    ``setup.memory_gib``, when given, is the memory the machine has: a VM whose memory starts
    small and grows as it is used (the lent GPU machine) reports little "available" at first,
    and asking it would skip runs that fit.
    """
    if setup.per_process_max_n is not None and n > setup.per_process_max_n:
        return f"skipped: --per-process-max-n {setup.per_process_max_n}"
    need = n * PROCESS_GIB.get(setup.preset, 1.0) + 1.0
    if setup.memory_gib is not None:
        free, what = setup.memory_gib, "given (--memory-gib)"
    else:
        import psutil

        free, what = psutil.virtual_memory().available / 2**30, "available"
    if free < need:
        return f"skipped: needs ~{need:.0f} GiB free, {free:.1f} GiB {what}"
    return ""


def runs_per_repeat(setup: Setup, systems: Sequence[str]) -> int:
    """Processes-and-window runs of one repeat at one N (the ideal batcher is not run)."""
    return len(setup.shm) * (SHM in systems) + sum(s in systems for s in (LIMIT, PER_PROCESS, QUEUE))


def bench_all(setup: Setup, ns: Sequence[int], *, requests: dict[int, int] | None = None,
              repeats: int = 1, systems: Sequence[str] = SYSTEMS, progress: bool = True,
              names: list[str] | None = None,
              on_result: Callable[[list[RunResult]], None] | None = None) -> list[RunResult]:  # fmt: skip
    """Every system at every N, ``repeats`` times; one ``RunResult`` per (N, repeat, system).
    ``on_result(results so far)`` is called after every system's run (to save partial results).

    Within a repeat the systems run in an order rotated from one repeat to the next (the
    limit always right after bicodec-shm, whose batches it replays), so that a burst of load
    from other processes does not always land on the same system. ``requests[n]``: requests
    per client when there is no window.
    """
    from tqdm import tqdm

    if setup.window is None and requests is None:
        raise ValueError("without a window, give the requests per client")
    ctx = mp.get_context("spawn")  # children must not inherit this process's state
    sampler = _Sampler(setup.sample_interval)
    results: list[RunResult] = []
    groups = [g for g in (SHM, PER_PROCESS, QUEUE) if g in systems]
    total = len(ns) * repeats * runs_per_repeat(setup, systems)
    try:
        with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not progress,
                  dynamic_ncols=True) as bar:  # fmt: skip
            for n in ns:
                count = requests[n] if requests is not None else None
                for r in range(repeats):
                    shift = r % len(groups)
                    done = len(results)
                    for group in groups[shift:] + groups[:shift]:
                        results += _run_group(group, setup, n, count, systems, ctx=ctx,
                                              sampler=sampler, bar=bar, names=names, repeat=r)  # fmt: skip
                        if on_result is not None:
                            on_result(results)
                    if setup.stand_in:
                        results.append(bench_ideal(setup, n, count=count))
                    if setup.stand_in and setup.stand_in_async:  # what a pipelined lane can reach
                        results.append(bench_ideal(setup, n, count=count, pipelined=True))
                    for result in results[done:]:
                        result.repeat = r
    finally:
        sampler.stop()
    return results


def _run_group(group: str, setup: Setup, n: int, count: int | None, systems: Sequence[str], *,
               ctx: Any, sampler: _Sampler, bar: Any, names: list[str] | None,
               repeat: int) -> list[RunResult]:  # fmt: skip
    """One system (bicodec-shm: each variant, then the limit), with the progress bar kept."""
    out: list[RunResult] = []

    def step(label: str, fn: Callable[[], RunResult]) -> None:
        bar.set_description(f"N={n} #{repeat + 1} {label}")
        out.append(fn())
        bar.update(1)

    if group == SHM:
        for k, variant in enumerate(setup.shm):
            step(variant.label, lambda v=variant: bench_shm(setup, n, count=count, ctx=ctx,
                                                            sampler=sampler, bar=bar, variant=v,
                                                            names=names))  # fmt: skip
            if k == 0 and LIMIT in systems:
                step(LIMIT, lambda b=out[-1].batches: bench_limit(setup, b, n, ctx=ctx,
                                                                  sampler=sampler, bar=bar))
    elif group == PER_PROCESS:
        why = _memory_ok(setup, n)
        if why:
            bar.write(f"N={n} {PER_PROCESS}: {why}")
            bar.update(1)
            out.append(_skipped(PER_PROCESS, n, why))
        else:
            step(PER_PROCESS, lambda: bench_per_process(setup, n, count=count, ctx=ctx,
                                                        sampler=sampler, bar=bar))  # fmt: skip
    elif group == QUEUE:
        step(QUEUE, lambda: bench_queue(setup, n, count=count, ctx=ctx, sampler=sampler, bar=bar))
    return out


def bench_sweep(setup: Setup, n: int, *, requests: int | None = None, waits: Sequence[float],
                tokens: Sequence[int | None], repeats: int = 1, progress: bool = True,
                names: list[str] | None = None) -> list[RunResult]:  # fmt: skip
    """bicodec-shm alone at ``n`` clients for every (max_wait_ms, max_batch_tokens).

    With ``repeats`` > 1 the whole grid runs that many times, each pass in a rotated order, so
    that a burst of load from other processes does not land on the same configurations.
    """
    from tqdm import tqdm

    _check_count(setup, requests)
    ctx = mp.get_context("spawn")
    grid = [Policy(setup.policy.max_batch, w, t) for w in waits for t in tokens]
    sampler = _Sampler(setup.sample_interval)
    results: list[RunResult] = []
    try:
        with tqdm(total=len(grid) * repeats, desc="sweep", unit="run", file=sys.stderr,
                  disable=not progress, dynamic_ncols=True) as bar:  # fmt: skip
            for r in range(repeats):
                shift = (r * len(grid)) // repeats
                for policy in grid[shift:] + grid[:shift]:
                    bar.set_description(f"N={n} wait {policy.max_wait_ms:g} ms "
                                        f"budget {policy.max_batch_tokens}")  # fmt: skip
                    result = bench_shm(setup, n, count=requests, ctx=ctx, sampler=sampler, bar=bar,
                                       policy=policy, names=names)  # fmt: skip
                    results.append(replace(result, repeat=r, batches=[]))
                    bar.update(1)
    finally:
        sampler.stop()
    return results
