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


MAX_GRAPHS = 32  # graphs a per-shape forward keeps; a shape beyond them decodes eagerly


class TracedForward:
    """``module(*tensors)`` through graphs traced at first use (see the module docstring).

    Args:
        module: a forward of tensor arguments; its parameters stay shared with the graphs.
        per_shape: False: one graph for every shape (the forward has no Python arithmetic on
            its inputs' sizes, checked by the tests); True: a graph for each signature (shapes
            and dtypes of the arguments, at most ``MAX_GRAPHS``), for a forward whose Python
            reads sizes (a window count, a padding) that a trace records as constants.
    """

    def __init__(self, module: nn.Module, *, per_shape: bool = False) -> None:
        self.module = module
        self.per_shape = per_shape
        self.graphs: dict[Any, Any] = {}  # signature (None when one fits all) -> traced graph
        self.failed = False  # tracing failed: eager from then on

    @property
    def graph(self) -> Any:
        """The one graph of a forward that is not per shape (None until the first call)."""
        return self.graphs.get(None)

    def __call__(self, *tensors: torch.Tensor) -> Any:
        key = tuple((tuple(t.shape), t.dtype) for t in tensors) if self.per_shape else None
        graph = self.graphs.get(key)
        if graph is None and not self.failed and len(self.graphs) < MAX_GRAPHS:
            graph = self._trace(key, tensors)
        return self.module(*tensors) if graph is None else graph(*tensors)

    def _trace(self, key: Any, tensors: tuple[torch.Tensor, ...]) -> Any:
        with _TRACE_LOCK:
            if key in self.graphs or self.failed:
                return self.graphs.get(key)
            try:
                with warnings.catch_warnings():
                    # TorchScript is in maintenance mode: newer torch warns on every trace.
                    warnings.simplefilter("ignore")
                    graph = torch.jit.trace(self.module, tensors, check_trace=False)
            except Exception as exc:  # any failure: decode eagerly, correct and slower
                self.failed = True
                log.warning("decoding eagerly: tracing %s failed (%s: %s); CPU lanes running at once "
                            "will contend for the GIL", type(self.module).__name__, type(exc).__name__, exc)
                return None
            self.graphs[key] = graph
            return graph
