"""A module's forward replayed as a TorchScript graph, for the server's CPU lanes.

Why: a CPU server's lanes are threads of one process. An eager forward of a small decoder is
hundreds of short torch calls, and each gives the GIL up and takes it back, so two lanes
decoding at once spend their time handing the GIL to each other: tiny Qwen3-TTS, a window of
8 frames on a 2-core CPU, took 7.1 ms alone and 15.9 ms each with two lanes at once, where two
worker processes with decoders of their own do not contend at all. A traced graph runs all its
ops in C++ without the GIL (the same window: 4.0 ms alone, 4.1 ms each with two lanes at once),
and skips Python's cost per call. ``python benchmarks/bench_lane_graphs.py`` measures it.

Exact: the graph calls the same aten kernels in the same order, so its output equals the eager
forward's bit for bit; tests check each codec that uses it across batch sizes, lengths and
dtypes. It runs unoptimized (``torch.jit.optimized_execution(False)``, per thread): the
profiling executor would re-profile every new shape, tens of ms each time, and could fuse.

A trace records one path through the forward's Python. Sizes read from a tensor are recorded
as sizes, so one graph serves every shape, but a Python *branch* on a size is not: a forward
with one names the branch with ``key(*tensors)``, and each key gets a graph of its own (SNAC's
attention skips its mask when the length fills its windows).

If tracing fails (a torch without TorchScript, say), or a graph fails where the eager forward
might not, the module runs eagerly and a warning says so once: slower under concurrency, never
wrong. Tracing costs ~0.3 s on a tiny decoder, once per key and decoder: the graphs are shared
by every lane of the decoder, and only a CPU decoder's lanes use them (``cpu_lane_graphs``).
That is 20-50 times a tiny decoder's batch, so a batch that traced is no measurement of what a
batch costs: each thread counts the time it spent tracing, or waiting for another thread's
trace (``take_warmup_ns``), and the server leaves such a batch out of its cost fit and its
lane tuner.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

log = logging.getLogger("bicodec_shm.model.traced")

_LOCK = threading.Lock()  # one trace at a time: warnings.catch_warnings is process-wide state
_WARMUP = threading.local()  # .ns: this thread's time in _trace since its last take_warmup_ns


def take_warmup_ns() -> int:
    """The nanoseconds this thread spent tracing graphs, or waiting for another thread's trace,
    since its last call (0: none); the count starts again from zero."""
    ns = getattr(_WARMUP, "ns", 0)
    _WARMUP.ns = 0
    return ns


class TracedForward:
    """``module(*tensors)`` through graphs traced at first use (see the module docstring).

    Args:
        module: a forward of tensor arguments; its parameters stay shared with the graphs.
        key: the branch of the forward's Python that these arguments take, as a hashable
            (a graph each); None: the forward has none (one graph for every shape).
    """

    def __init__(self, module: nn.Module, *, key: Callable[..., Hashable] | None = None) -> None:
        self.module = module
        self.key = key
        self.graphs: dict[Hashable, Any] = {}  # branch -> traced graph
        self.failed = False  # tracing failed: eager from then on

    def __call__(self, *tensors: torch.Tensor) -> Any:
        branch = None if self.key is None else self.key(*tensors)
        graph = self.graphs.get(branch)
        if self.failed:
            return self.module(*tensors)
        if graph is None:
            graph = self._trace(branch, tensors)
        if graph is None:
            return self.module(*tensors)
        try:
            with torch.jit.optimized_execution(False):
                return graph(*tensors)
        except Exception as exc:  # the eager forward decides: it fails too, or it is right
            self._give_up(f"its graph failed ({type(exc).__name__}: {exc})")
            return self.module(*tensors)

    def _trace(self, branch: Hashable, tensors: tuple[torch.Tensor, ...]) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return self._trace_locked(branch, tensors)
        finally:  # the lock's wait counts too: the batch waited for a trace either way
            _WARMUP.ns = getattr(_WARMUP, "ns", 0) + time.perf_counter_ns() - t0

    def _trace_locked(self, branch: Hashable, tensors: tuple[torch.Tensor, ...]) -> Any:
        with _LOCK:
            if branch in self.graphs or self.failed:
                return self.graphs.get(branch)
            try:
                with warnings.catch_warnings(), torch.jit.optimized_execution(False):
                    # TorchScript is in maintenance mode: newer torch warns on every trace.
                    warnings.simplefilter("ignore")
                    graph = torch.jit.trace(self.module, tensors, check_trace=False)
            except Exception as exc:  # any failure: decode eagerly, correct and slower
                self._give_up(f"tracing failed ({type(exc).__name__}: {exc})")
                return None
            self.graphs[branch] = graph
            return graph

    def _give_up(self, why: str) -> None:
        """Eager from now on, said once."""
        if not self.failed:
            self.failed = True
            log.warning("decoding eagerly: %s: %s; CPU lanes running at once will contend for the GIL",
                        type(self.module).__name__, why)  # fmt: skip


def cpu_lane_graphs(owner: nn.Module, make: Callable[[], TracedForward]) -> TracedForward | None:
    """``owner``'s one ``TracedForward`` (made by ``make`` at the first call) if its weights are
    on the CPU, else None (CUDA has graphs of its own): every lane's adapter of a decoder replays
    the same graphs, so each is traced once per server."""
    if owner.device.type != "cpu":
        return None
    with _LOCK:
        graphs = owner.__dict__.get("_bicodec_shm_graphs")
        if graphs is None:
            graphs = owner.__dict__["_bicodec_shm_graphs"] = make()
        return graphs
