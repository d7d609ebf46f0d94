"""A module's forward replayed as a TorchScript graph, for the server's CPU lanes.

Why: a CPU server's lanes are threads of one process. An eager forward of a small decoder is
hundreds of short torch calls, and each gives the GIL up and takes it back, so two lanes
decoding at once spend their time handing the GIL to each other: tiny Qwen3-TTS, a window of
8 frames on a 2-core CPU, took 7.2 ms alone and 16.3 ms each with two lanes at once, where two
worker processes with decoders of their own do not contend at all. A traced graph runs all its
ops in C++ without the GIL (the same window: 3.1 ms alone, 3.3 ms each with two lanes at once),
and skips Python's cost per call. ``python benchmarks/bench_lane_graphs.py`` measures it.

Exact: the graph calls the same aten kernels in the same order (TorchScript fuses nothing on a
CPU unless asked), so its output equals the eager forward's bit for bit; tests check each codec
that uses it across batch sizes, lengths and dtypes. A trace records one path through Python,
so only a forward without branches on values or shapes may be traced (the caller knows which).

If tracing fails (a torch without TorchScript, say), the module runs eagerly and a warning says
so once: slower under concurrency, never wrong.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import torch
from torch import nn

log = logging.getLogger("bicodec_shm.model.traced")

_TRACE_LOCK = threading.Lock()  # warnings.catch_warnings is process-wide state


class TracedForward:
    """``module(x)`` through a graph traced at the first call (see the module docstring).

    Args:
        module: a forward of one tensor argument, traceable at any shape (no Python branch
            on its input's values or sizes); its parameters stay shared with the graph.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.graph: Any = None  # the traced graph once built
        self.failed = False  # tracing failed: eager from then on

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.graph is None and not self.failed:
            self._trace(x)
        return self.module(x) if self.graph is None else self.graph(x)

    def _trace(self, x: torch.Tensor) -> None:
        with _TRACE_LOCK:
            if self.graph is not None or self.failed:
                return
            try:
                with warnings.catch_warnings():
                    # TorchScript is in maintenance mode: newer torch warns on every trace.
                    warnings.simplefilter("ignore")
                    self.graph = torch.jit.trace(self.module, x, check_trace=False)
            except Exception as exc:  # any failure: decode eagerly, correct and slower
                self.failed = True
                log.warning("decoding eagerly: tracing %s failed (%s: %s); CPU lanes running at once "
                            "will contend for the GIL", type(self.module).__name__, type(exc).__name__, exc)
