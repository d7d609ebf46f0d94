"""Choosing how many CPU decode lanes run, from what the live traffic measures.

Why measure: on a CPU, K lanes split the cores (K decodes of cores/K threads each, sharing the
weights). Whether one wide decode or several narrow ones serves more depends on the machine and
its state (cache, memory bandwidth, other tenants) and on the traffic (many short chunks favour
one lane's larger batches; long utterances favour parallel narrow decodes). The same 2-core VM
measured both orders an hour apart (benchmarks/RESULTS.md), so no constant holds.

How: the tuner tries each arrangement on the live traffic in turn and keeps the one that
spends the least machine time per token of audio, measured on the batches it decodes::

    score = sum(batch decode time) / sum(batch tokens) / lanes     lower wins

K lanes decode K batches at once, so a lane's decode time is worth 1/K of the machine's. The
batches are the live traffic's, so the score carries everything that differs between the
arrangements: a wide decode's thread scaling, narrow decodes running side by side (and
contending for memory bandwidth), and the smaller batches that K lanes form from the same
requests. It needs no request to finish its whole queueing (an end-to-end latency would), so a
window closes after a few batches: on a full-size CPU decode of seconds a batch, a first choice
comes within about a minute of traffic.

Phases::

    EXPLORE   candidates are measured in the order  c0 c1 .. ck ck .. c1 c0  (each twice,
              mirrored, so that a drift in the traffic over the phase weighs on every
              candidate alike); a window lasts until at least ``min_batches`` batches planned
              after it began are decoded, and at least ``min_seconds``.
              After the first pass (every candidate measured once), a candidate that beats
              every other by ``decisive`` is chosen at once: no mirror pass for a clear case.
    HOLD      the best candidate runs (a challenger must beat the one running by ``margin``,
              so noise does not flip it); after ``hold_seconds``, explore again.

Every choice is logged with the scores behind it. A fixed ``--lanes`` bypasses all of this.
The tuner is pure bookkeeping (no threads, an injectable clock): the server feeds it decoded
batches and applies what it returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("bicodec_shm.server.lanes")  # under the server's: `serve` shows it


@dataclass(frozen=True)
class LaneTuning:
    """The tuner's knobs (defaults sized for a CPU decode of 0.1–3 s per batch).

    Args:
        min_batches: decoded batches a window needs (only batches planned after it began).
        min_seconds: the shortest window.
        margin: how much lower (as a share) a challenger's score must be to replace the
            arrangement that ran before the phase.
        decisive: after one window each, a candidate this much lower than every other is
            chosen without the mirror pass.
        hold_seconds: how long a choice holds before the next exploration.
    """

    min_batches: int = 4
    min_seconds: float = 2.0
    margin: float = 0.05
    decisive: float = 0.2
    hold_seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.min_batches < 1 or self.min_seconds < 0 or self.hold_seconds < 0:
            raise ValueError(f"bad lane tuning {self}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"lane tuning margin must be in [0, 1), got {self.margin}")


@dataclass
class _Window:
    lanes: int
    start_ns: int
    batches: int = 0
    tokens: int = 0
    decode_ns: int = 0

    @property
    def score(self) -> float:
        """Machine seconds per token: decode time / tokens / lanes (inf if nothing measured)."""
        return self.decode_ns / 1e9 / self.tokens / self.lanes if self.tokens else float("inf")


@dataclass
class Choice:
    """A decision and the numbers behind it (``scores``: candidate -> mean score)."""

    lanes: int
    reason: str
    scores: dict[int, float] = field(default_factory=dict)


class LaneTuner:
    """Picks the active lane count among ``candidates`` from measured machine time per token.

    Args:
        candidates: the lane counts to try, e.g. ``[1, 2]`` (each splits the cores evenly).
        start: the arrangement running now (it is measured first).
        tuning: the knobs (:class:`LaneTuning`).
        clock: monotonic nanoseconds (tests step it by hand).
    """

    def __init__(self, candidates: Sequence[int], start: int, tuning: LaneTuning | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:  # fmt: skip
        cands = sorted(set(int(c) for c in candidates))
        if len(cands) < 2 or cands[0] < 1:
            raise ValueError(f"a lane tuner needs two or more lane counts >= 1, got {candidates}")
        if start not in cands:
            raise ValueError(f"start {start} is not among the candidates {cands}")
        self.candidates = cands
        self.tuning = tuning or LaneTuning()
        self._clock = clock
        self.lanes = start  # the arrangement running now
        self.history: list[Choice] = []  # every decision, for logs and tests
        self._begin_exploring(incumbent=start)

    # -- the server's side ------------------------------------------------------------------

    def observe(self, planned_ns: int, decode_ns: int, tokens: int) -> Choice | None:
        """Count one decoded batch (when it was planned, monotonic ns; how long its decode took,
        ns; its tokens); returns a new :class:`Choice` when the running arrangement should
        change."""
        if self._window is None:  # holding
            if self._clock() - self._held_since < self.tuning.hold_seconds * 1e9:
                return None
            self._begin_exploring(incumbent=self.lanes)
            return self._switch_to_window(reason="re-exploring after the hold")
        w = self._window
        if planned_ns >= w.start_ns:  # batches of the previous arrangement do not count
            w.batches += 1
            w.tokens += int(tokens)
            w.decode_ns += max(0, int(decode_ns))
        long_enough = self._clock() - w.start_ns >= self.tuning.min_seconds * 1e9
        if w.batches < self.tuning.min_batches or not long_enough:
            return None
        self._scores.setdefault(w.lanes, []).append(w.score)
        self._plan.pop(0)
        if self._plan and not self._clear_winner():
            return self._switch_to_window(reason="exploring")
        return self._decide()

    # -- phases -----------------------------------------------------------------------------

    def _begin_exploring(self, incumbent: int) -> None:
        others = [c for c in self.candidates if c != incumbent]
        order = [incumbent, *others]
        self._plan = order + order[::-1]  # mirrored: c0 c1 .. ck ck .. c1 c0
        self._incumbent = incumbent
        self._scores: dict[int, list[float]] = {}
        self._window: _Window | None = _Window(self._plan[0], self._clock())

    def _switch_to_window(self, reason: str) -> Choice | None:
        lanes = self._plan[0]
        self._window = _Window(lanes, self._clock())
        if lanes == self.lanes:
            return None
        self.lanes = lanes
        return self._record(Choice(lanes, reason, self._means()))

    def _decide(self) -> Choice | None:
        means = self._means()
        best = min(means, key=means.__getitem__)
        incumbent = self._incumbent
        if best != incumbent and means[best] > means[incumbent] * (1 - self.tuning.margin):
            best = incumbent  # not clearly better: keep what ran before
        self._window = None
        self._held_since = self._clock()
        runner_up = min((m for c, m in means.items() if c != best), default=means[best])
        ratio = runner_up / means[best] if means[best] > 0 else float("inf")
        reason = f"chosen after exploring: the next best costs {ratio:.2f}x per token"
        choice = Choice(best, reason, means)
        changed = best != self.lanes
        self.lanes = best
        self._record(choice)  # logged whether or not it changes what runs
        return choice if changed else None

    def _clear_winner(self) -> bool:
        """Every candidate measured, and one beats every other by ``decisive``."""
        if len(self._scores) < len(self.candidates):
            return False
        means = self._means()
        best = min(means, key=means.__getitem__)
        return all(means[best] <= m * (1 - self.tuning.decisive) for c, m in means.items() if c != best)

    def _means(self) -> dict[int, float]:
        return {c: float(np.mean(s)) for c, s in self._scores.items()}

    def _record(self, choice: Choice) -> Choice:
        self.history.append(choice)
        scores = ", ".join(f"{c} lane(s): {s * 1e3:.2f} ms/token" for c, s in sorted(choice.scores.items()))
        log.info("lanes -> %d (%s)%s", choice.lanes, choice.reason,
                 f"; machine time per token: {scores}" if scores else "")  # fmt: skip
        return choice
