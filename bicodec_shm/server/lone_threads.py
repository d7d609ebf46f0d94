"""How many intra-op threads a lone CPU lane runs: every core, or one, measured on its batches.

Why measure: one lane with every core is what one client at a time gets (lane_tuner.py, START),
on the assumption that a wide decode is faster. For a full-size model it is: on a 2-core CPU,
Qwen3-TTS's 12 Hz decoder decodes a 50-frame window in 3.2 s on two threads and 5.3 s on one.
For a small one it is not: the tiny preset decodes the same window in 38 ms on two threads and
15 ms on one, idle, because each of its many small operators pays the threads' hand-off; and
on a host whose cores the clients share, the second thread waits for a core the client holds,
so a lone first chunk of a stream took 13-19 ms instead of 5-7 ms now and then
(benchmarks/RESULTS.md). Which side a decoder is on depends on the model and the machine, so
it is measured, like the lane count.

How: the lone lane's first ``2 x samples`` batches (graph traces left out) run alternately on
every core and on one, in the order A B B A A B B A ..., which gives each count every position
of a stream's repeating pattern of window lengths (a strict A B A B would give one count only
the short windows of a period-2 pattern). Each count's decode times are fitted as
``ns = a + b x padded tokens`` (least squares; the mean where its lengths are all equal), and
the count whose fit is lower at the median length of all the batches wins and holds from then
on. The choice is logged with both costs.

Pure bookkeeping (no threads, no clock): ``LaneControl`` asks it for each lone batch's count
and feeds it each decoded one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("bicodec_shm.server.lanes")  # under the server's: `serve` shows it

SAMPLES = 8  # lone batches measured on each thread count before the choice


@dataclass
class _Costs:
    """One thread count's measured batches: padded tokens and decode ns."""

    tokens: list[int] = field(default_factory=list)
    ns: list[int] = field(default_factory=list)

    def at(self, tokens: float) -> float:
        """The fitted decode ns of a batch of ``tokens`` padded tokens."""
        x, y = np.asarray(self.tokens, float), np.asarray(self.ns, float)
        if np.ptp(x) == 0:
            return float(y.mean())
        slope, intercept = np.polyfit(x, y, 1)
        return float(intercept + slope * tokens)


class LoneThreads:
    """The thread count of the one lane running: measured between ``cores`` and 1.

    Args:
        cores: the intra-op threads the lanes share (2 or more).
        samples: batches measured on each count before the choice.
    """

    def __init__(self, cores: int, samples: int = SAMPLES) -> None:
        if cores < 2 or samples < 2:
            raise ValueError(f"measuring a lone lane's threads needs 2+ cores and samples, "
                             f"got {cores}, {samples}")
        self.cores = cores
        self.samples = samples
        self.chosen: int | None = None  # None while measuring
        self._costs = {cores: _Costs(), 1: _Costs()}
        self._handed = 0  # batches given a count so far (the A B B A position)

    @property
    def measuring(self) -> bool:
        return self.chosen is None

    @property
    def threads(self) -> int:
        """The count a lone lane runs now: the choice, or every core while measuring."""
        return self.cores if self.chosen is None else self.chosen

    def next_threads(self) -> int:
        """The count for the lone lane's next batch (A B B A while measuring)."""
        if self.chosen is not None:
            return self.chosen
        position = self._handed % 4
        self._handed += 1
        return self.cores if position in (0, 3) else 1

    def add(self, threads: int | None, padded_tokens: int, decode_ns: int) -> int | None:
        """A lone batch of ``padded_tokens`` decoded in ``decode_ns`` on ``threads``; returns the
        chosen count once both are measured (then None again)."""
        costs = self._costs.get(threads) if self.chosen is None else None
        if costs is None or padded_tokens <= 0:
            return None
        costs.tokens.append(int(padded_tokens))
        costs.ns.append(int(decode_ns))
        if any(len(c.ns) < self.samples for c in self._costs.values()):
            return None
        every = [t for c in self._costs.values() for t in c.tokens]
        at = float(np.median(every))
        wide, one = (max(0.0, self._costs[n].at(at)) for n in (self.cores, 1))
        self.chosen = 1 if one < wide else self.cores
        log.info("lanes: a lone lane runs %d thread(s): a batch of %.0f tokens decodes in %.1f ms on "
                 "%d threads, %.1f ms on 1 (measured on %d batches each)", self.chosen, at, wide / 1e6,
                 self.cores, one / 1e6, self.samples)  # fmt: skip
        return self.chosen
