"""Choosing how many CPU decode lanes run, from what the live traffic measures.

Why measure: on a CPU, K lanes split the cores (K decodes of cores/K threads each, sharing the
weights). Whether one wide decode or several narrow ones serves more depends on the machine and
its state (cache, memory bandwidth, other tenants) and on the traffic (many short chunks favour
one lane's larger batches; long utterances favour parallel narrow decodes). The same 2-core VM
measured both orders an hour apart (benchmarks/RESULTS.md), so no constant holds.

How: the tuner tries each arrangement on the live traffic in turn and keeps the one whose
requests waited least per token of audio::

    score = sum(done - submitted) / sum(tokens)        seconds of latency per token, lower wins

With closed-loop clients (a worker sends its next request after its answer) the latency of a
request is N / throughput, so the lowest score is the highest throughput; with open-loop
traffic below saturation it is the lowest latency. Either way it is what a user sees.

Phases::

    EXPLORE   candidates are measured in the order  c0 c1 .. ck ck .. c1 c0  (each twice,
              mirrored, so that a drift in the traffic over the phase weighs on every
              candidate alike); a window lasts until at least ``min_requests`` requests
              submitted after it began are answered, and at least ``min_seconds``.
    HOLD      the best candidate runs (a challenger must beat the one running by ``margin``,
              so noise does not flip it); after ``hold_seconds``, explore again.

Every choice is logged with the scores behind it. A fixed ``--lanes`` bypasses all of this.
The tuner is pure bookkeeping (no threads, an injectable clock): the server feeds it answered
requests and applies what it returns.
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
        min_requests: answered requests a window needs (only requests submitted after it began).
        min_seconds: the shortest window.
        margin: how much lower (as a share) a challenger's score must be to replace the
            arrangement that ran before the phase.
        hold_seconds: how long a choice holds before the next exploration.
    """

    min_requests: int = 12
    min_seconds: float = 2.0
    margin: float = 0.05
    hold_seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.min_requests < 1 or self.min_seconds < 0 or self.hold_seconds < 0:
            raise ValueError(f"bad lane tuning {self}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"lane tuning margin must be in [0, 1), got {self.margin}")


@dataclass
class _Window:
    lanes: int
    start_ns: int
    requests: int = 0
    tokens: int = 0
    latency_ns: int = 0

    @property
    def score(self) -> float:
        """Seconds of latency per token (inf if nothing was measured)."""
        return self.latency_ns / 1e9 / self.tokens if self.tokens else float("inf")


@dataclass
class Choice:
    """A decision and the numbers behind it (``scores``: candidate -> mean score)."""

    lanes: int
    reason: str
    scores: dict[int, float] = field(default_factory=dict)


class LaneTuner:
    """Picks the active lane count among ``candidates`` from measured latency per token.

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

    def observe(self, submitted_ns: np.ndarray, done_ns: int, tokens: np.ndarray) -> Choice | None:
        """Count one published batch's requests ((B,) int64 submit times, one done time, (B,)
        tokens); returns a new :class:`Choice` when the running arrangement should change."""
        if self._window is None:  # holding
            if self._clock() - self._held_since < self.tuning.hold_seconds * 1e9:
                return None
            self._begin_exploring(incumbent=self.lanes)
            return self._switch_to_window(reason="re-exploring after the hold")
        w = self._window
        keep = submitted_ns >= w.start_ns  # requests queued under the previous arrangement do not count
        if keep.any():
            w.requests += int(keep.sum())
            w.tokens += int(tokens[keep].sum())
            w.latency_ns += int((done_ns - submitted_ns[keep]).clip(0).sum())
        long_enough = self._clock() - w.start_ns >= self.tuning.min_seconds * 1e9
        if w.requests < self.tuning.min_requests or not long_enough:
            return None
        self._scores.setdefault(w.lanes, []).append(w.score)
        self._plan.pop(0)
        if self._plan:
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
        ratio = means[incumbent] / means[best] if means[best] > 0 else float("inf")
        reason = f"chosen after exploring ({ratio:.2f}x the previous arrangement)"
        choice = Choice(best, reason, means)
        changed = best != self.lanes
        self.lanes = best
        self._record(choice)  # logged whether or not it changes what runs
        return choice if changed else None

    def _means(self) -> dict[int, float]:
        return {c: float(np.mean(s)) for c, s in self._scores.items()}

    def _record(self, choice: Choice) -> Choice:
        self.history.append(choice)
        scores = ", ".join(f"{c} lane(s): {s * 1e3:.2f} ms/token" for c, s in sorted(choice.scores.items()))
        log.info("lanes -> %d (%s)%s", choice.lanes, choice.reason, f"; latency per token: {scores}" if scores else "")
        return choice
