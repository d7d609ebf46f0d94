"""Choosing how many CPU decode lanes run, from what the live traffic measures.

Why measure: on a CPU, K lanes split the cores (K decodes of cores/K threads each, sharing the
weights). Whether one wide decode or several narrow ones serves more depends on the machine and
its state (cache, memory bandwidth, other tenants) and on the traffic (many short chunks favour
one lane's larger batches; long utterances favour parallel narrow decodes). The same 2-core VM
measured both orders an hour apart (benchmarks/RESULTS.md), so no constant holds.

How: the tuner tries each arrangement on the live traffic in turn and keeps the one whose
decoding keeps the machine busy for the least time per token of audio, measured on the batches
it decodes (each a ``BatchSample``: when it was planned, when its decode began and ended, its
rows and tokens, and its share of the busy time)::

    score = sum(batch shares) / sum(batch tokens)     lower wins
    share = the integral, over the batch's decode, of 1 / (decodes running then)   (BusyClock)

The shares of all batches sum to the busy time: the wall time during which at least one lane
decoded. A batch that ran alone costs its whole decode time; beside another, half of it. (The
server keeps the count of decodes running, so a batch's share is exact even when its
neighbour belongs to no window: a window closes while batches of its arrangement still run.)

What the traffic gets is in the overlap. Under heavy load every lane is busy at once, the busy
time is the window's wall time, and the score is one over the throughput: K narrow lanes score
K batches per decode time. Under light load (one request at a time) the lanes take turns, the
busy time is the sum of the decode times, and the score is the decode time per token that each
request waits: narrow lanes, each slower, score slower. (Decode time / tokens / K would assume
the first case always: with one client it would choose two one-thread lanes over one two-thread
lane that decodes each request 1.6x faster.) Between the two, the overlap the traffic really
makes decides. The batches are the live traffic's, so the score also carries everything else
that differs between the arrangements: a wide decode's thread scaling, narrow decodes contending
for memory bandwidth, and the smaller batches that K lanes form from the same requests. It needs
no request to finish its whole queueing (an end-to-end latency would), so a window closes after
a few batches: on a full-size CPU decode of seconds a batch, an exploration chooses within about a
minute of traffic.

Phases::

    START     (only with ``predict``: the server's) ``start`` runs while the load is read
              from the first ``min_batches`` batches: the requests decoding at once
              during each, ``rows x decode time / share`` (a batch alone: its rows; two batches
              of 4 side by side: 8 each), or, where more, the requests that waited when it was
              planned (``queued``: its rows and those left for later). The server reads on one
              lane with every core (``start`` = 1): what one request at a time gets, so that it
              pays nothing for the reading, while load shows at the first plan that finds more
              than one request waiting (a single lane cannot show it as a batch beside its own).
              One request at a time (every reading 1) predicts one lane with every core; a
              reading past 1.5 (another request decoding beside, a batch of several, or
              requests queued behind it) predicts, at once, the most lanes that do not share a
              core (``cores``); or, where a batch read took ``LONG_BATCH_S`` or more, the most
              lanes of all: behind batches of seconds (a full-size stream's window on a CPU) a
              request that comes while every core decodes would wait for one to end, while
              lanes that time-share the cores start it at once. (Short batches gain nothing
              from sharing a core, and their lanes' Python contends for one interpreter lock.)
              The prediction holds for ``first_hold_seconds`` before the first exploration
              (from it), so that a fresh server does not pay for measuring the arrangements
              the rule already rules out. The rule is the light and heavy cases below, which
              hold on any device: with one request at a time, narrow lanes only take turns,
              each slower; with more, every lane has a batch and the work runs in parallel.
              During the first hold, a prediction of one lane gives way to what load predicts
              at the first batch that shows load (clients that start after the first), and
              lanes that do not share a core to the most of all at the first long batch; never
              the other way: one lone or short batch is no sign that the load has gone.
    EXPLORE   candidates are measured in the order  c0 c1 .. ck ck .. c1 c0  (each twice,
              mirrored, so that a drift in the traffic over the phase weighs on every
              candidate alike); a window lasts until at least ``min_batches`` batches planned
              after it began are decoded, and at least ``min_seconds``.
              After the first pass (every candidate measured once), a candidate that beats
              every other by ``decisive`` is chosen at once: no mirror pass for a clear case.
    HOLD      the best candidate runs (a challenger must beat the one running by ``margin``,
              so noise does not flip it); after ``hold_seconds``, explore again.

Every choice is logged with the scores behind it, and so is the start of each exploration; each
record carries the tuner's state (``record.lanes``, ``record.exploring``), so that a reader of the
log (the bench) knows which of its measurements overlapped an exploration. A fixed ``--lanes``
bypasses all of this.
The tuner is pure bookkeeping (no threads, an injectable clock): the server feeds it decoded
batches and applies what it returns; the server's ``BatchMeter`` (one lock, which every lane
calls) measures each batch and its share. A window keeps its samples whole (``Window.samples``), so
that other measures of the same batches (cost by rows or by padding) need no new plumbing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
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
        first_hold_seconds: how long the arrangement predicted from the load at the start holds
            before the first exploration (a tuner built with ``predict``): as long as a measured
            choice, since the rule's prediction is the choice measuring most often keeps, while
            an exploration's windows can cost its traffic a quarter more (one lane of two
            threads against two of one, full-size Qwen3-TTS at 16 streams on a 2-core CPU).
    """

    min_batches: int = 4
    min_seconds: float = 2.0
    margin: float = 0.05
    decisive: float = 0.2
    hold_seconds: float = 300.0
    first_hold_seconds: float = 300.0

    def __post_init__(self) -> None:
        if min(self.min_seconds, self.hold_seconds, self.first_hold_seconds) < 0 or self.min_batches < 1:
            raise ValueError(f"bad lane tuning {self}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"lane tuning margin must be in [0, 1), got {self.margin}")


@dataclass(frozen=True)
class BatchSample:
    """One decoded batch as the server measured it (times: monotonic ns).

    Args:
        planned_ns: when it was planned (a window counts only batches planned after it began).
        start_ns: when its decode began.
        end_ns: when its decode ended (its rows answered).
        tokens: its valid tokens (the rows' lengths summed).
        rows: its rows.
        padded_tokens: rows x its longest row's tokens (0: not given).
        busy_ns: its share of the busy time (``BusyClock``); None: it ran alone (its decode time).
        queued: the requests waiting when it was planned, its rows included (0: not counted).
    """

    planned_ns: int
    start_ns: int
    end_ns: int
    tokens: int
    rows: int = 1
    padded_tokens: int = 0
    busy_ns: int | None = None
    queued: int = 0

    @property
    def decode_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)

    @property
    def share_ns(self) -> int:
        """Its share of the busy time: ``busy_ns``, else its decode time."""
        return self.decode_ns if self.busy_ns is None else max(0, self.busy_ns)


class BusyClock:
    """Shares the wall time among the decodes that run at once.

    A decode's share is the integral, over its run, of 1 / (decodes running then): its whole
    decode time when it ran alone, half of it while one other ran beside it. The shares of all
    decodes sum to the busy time, the wall time during which at least one ran. ``begin`` and
    ``end`` may be called from any thread (one lock; two float operations each).

    Args:
        clock: monotonic nanoseconds (tests step it by hand).
    """

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._running = 0
        self._at = clock()
        self._shared = 0.0  # ns: the integral of 1 / running over the busy time so far

    def begin(self) -> float:
        """A decode begins; returns its mark, for ``end``."""
        with self._lock:
            self._advance()
            self._running += 1
            return self._shared

    def end(self, mark: float) -> int:
        """The decode that began at ``mark`` ends; returns its share (ns)."""
        with self._lock:
            self._advance()
            self._running = max(0, self._running - 1)
            return int(round(self._shared - mark))

    def _advance(self) -> None:
        now = self._clock()
        if self._running:
            self._shared += (now - self._at) / self._running
        self._at = now


class BatchMeter:
    """The server's measuring of its batches: when each began, and at its end its
    ``BatchSample`` with its share of the busy time (``busy``, a ``BusyClock``). A key names a
    batch while it runs (the server's: one per batch in flight); ``begin`` and ``end`` may be
    called from any lane's thread.

    Args:
        clock: monotonic nanoseconds (tests step it by hand).
    """

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._clock = clock
        self.busy = BusyClock(clock)
        self._running: dict[Hashable, tuple[int, float]] = {}  # key -> (began ns, busy mark)

    def begin(self, key: Hashable) -> None:
        self._running[key] = (self._clock(), self.busy.begin())

    def end(self, key: Hashable, *, planned_ns: int, tokens: int, rows: int = 1,
            padded_tokens: int = 0, queued: int = 0) -> BatchSample | None:  # fmt: skip
        """The batch ``key`` ended: its sample (None if it did not begin here)."""
        begun = self._running.pop(key, None)
        if begun is None:
            return None
        start_ns, mark = begun
        share = self.busy.end(mark)
        return BatchSample(planned_ns, start_ns, self._clock(), tokens, rows, padded_tokens, share, queued)


# More than this many requests decoding at once during a batch (a mean over its decode) is load:
# 1.0 is one request alone; another lane's batch beside it for half its decode makes 1.5.
LOADED = 1.5
# Under load, batches this long (read on the fresh server's lane) predict lanes that share the
# cores: a request arriving behind them would wait about half of one (START, module docstring).
LONG_BATCH_S = 0.2


def _load_of(sample: BatchSample) -> float:
    """The requests decoding at once during ``sample``, on average: its rows x its decode time /
    its share of the busy time (alone: its rows; beside one other batch throughout: twice); or
    the requests that waited when it was planned, where more (a lane of its own cannot show the
    others as batches beside it)."""
    share = sample.share_ns
    at_once = sample.rows * sample.decode_ns / share if share > 0 else float(sample.rows)
    return max(at_once, float(sample.queued))


@dataclass
class Window:
    """One arrangement's measurement: ``lanes`` lanes from ``start_ns`` on, and the samples of
    the batches planned since."""

    lanes: int
    start_ns: int
    samples: list[BatchSample] = field(default_factory=list)

    @property
    def batches(self) -> int:
        return len(self.samples)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    @property
    def score(self) -> float:
        """Busy seconds per token: the batches' shares over their tokens (module docstring; inf
        if nothing measured)."""
        tokens = self.tokens
        return sum(s.share_ns for s in self.samples) / 1e9 / tokens if tokens else float("inf")


@dataclass
class Choice:
    """A decision and the numbers behind it (``scores``: candidate -> mean score)."""

    lanes: int
    reason: str
    scores: dict[int, float] = field(default_factory=dict)


class LaneTuner:
    """Picks the active lane count among ``candidates`` from measured busy time per token.

    Args:
        candidates: the lane counts to try, e.g. ``[1, 2]`` (each splits the cores evenly).
        start: the arrangement running now (it is measured first; with ``predict``, the one
            that runs while the load is read).
        tuning: the knobs (:class:`LaneTuning`).
        clock: monotonic nanoseconds (tests step it by hand).
        predict: read the load first and hold the arrangement it predicts (START, module
            docstring); else explore from ``start`` at once.
        cores: candidates up to this many run side by side without sharing a core (None: all
            of them); load predicts the most of those unless its batches are long.
    """

    def __init__(self, candidates: Sequence[int], start: int, tuning: LaneTuning | None = None,
                 clock: Callable[[], int] = time.monotonic_ns, *, predict: bool = False,
                 cores: int | None = None) -> None:  # fmt: skip
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
        self._window: Window | None = None
        self._hold_ns = self.tuning.hold_seconds * 1e9  # the hold running now (HOLD)
        # START: the requests decoding at once during each batch read so far (None: read).
        self._load: list[float] | None = None
        self._predicted = False
        self._cores = cores
        self._longest_ns = 0  # the longest decode read at the start (START)
        if predict:
            self._load = []
            self._load_since = self._clock()
            log.info("lanes: reading the load at %d lanes", self.lanes,
                     extra={"lanes": self.lanes, "exploring": True})  # fmt: skip
        else:
            self._begin_exploring(incumbent=start, reason="measuring on the live traffic")

    # -- the server's side ------------------------------------------------------------------

    def observe(self, sample: BatchSample) -> Choice | None:
        """Count one decoded batch; returns a new :class:`Choice` when the running arrangement
        should change."""
        if self._load is not None:
            return self._read_load(sample)
        if self._window is None:  # holding
            if self._clock() - self._held_since < self._hold_ns:
                return self._reread_load(sample) if self._predicted else None
            self._begin_exploring(incumbent=self.lanes, reason="re-exploring after the hold")
            return self._switch_to_window(reason="re-exploring after the hold")
        w = self._window
        if sample.planned_ns >= w.start_ns:  # batches of the previous arrangement do not count
            w.samples.append(sample)
        long_enough = self._clock() - w.start_ns >= self.tuning.min_seconds * 1e9
        if w.batches < self.tuning.min_batches or not long_enough:
            return None
        self._scores.setdefault(w.lanes, []).append(w.score)
        self._plan.pop(0)
        if self._plan and not self._clear_winner():
            return self._switch_to_window(reason="exploring")
        return self._decide()

    # -- phases -----------------------------------------------------------------------------

    @property
    def exploring(self) -> bool:
        """True while candidates are being measured (EXPLORE) or the load is read (START);
        False while a choice holds."""
        return self._window is not None or self._load is not None

    @property
    def reading_load(self) -> bool:
        """True while the load is read (START): every batch counts, the batching policy measured
        or not (how many requests decode at once does not depend on it)."""
        return self._load is not None

    def _read_load(self, sample: BatchSample) -> Choice | None:
        """START: read the requests decoding at once during ``sample``; predict from them."""
        if sample.planned_ns < self._load_since:
            return None
        self._load.append(_load_of(sample))
        self._longest_ns = max(self._longest_ns, sample.decode_ns)
        peak = max(self._load)
        loaded = peak > LOADED
        if not loaded and len(self._load) < self.tuning.min_batches:
            return None
        lanes = self._loaded_lanes() if loaded else self.candidates[0]
        self._load = None
        self._predicted = True
        self._incumbent = lanes
        self._held_since = self._clock()
        self._hold_ns = self.tuning.first_hold_seconds * 1e9
        changed = lanes != self.lanes
        self.lanes = lanes
        choice = self._predict(lanes, peak)  # logged whether or not it changes what runs
        return choice if changed else None

    def _reread_load(self, sample: BatchSample) -> Choice | None:
        """The first hold of a prediction: a batch that shows load predicts again, and more lanes
        than run now are taken at once, not minutes later: one lane gives way to load that comes
        later (clients that start after the first), and lanes that do not share a core to the
        most of all once batches under load turn out long (a stream's later, longer windows).
        Only ever more lanes, and only on load: a lone or short batch is no sign that the load
        or the long batches have gone, and a long batch alone is no sign of load."""
        if sample.planned_ns < self._held_since:
            return None
        self._longest_ns = max(self._longest_ns, sample.decode_ns)
        at_once = _load_of(sample)
        if at_once <= LOADED:
            return None
        lanes = self._loaded_lanes()
        if lanes <= self.lanes:
            return None
        self.lanes = self._incumbent = lanes
        return self._predict(lanes, at_once)

    def _loaded_lanes(self) -> int:
        """What load predicts: the most lanes that do not share a core, or, behind long
        batches, the most of all."""
        if self._cores is None or self._longest_ns >= LONG_BATCH_S * 1e9:
            return self.candidates[-1]
        return max((c for c in self.candidates if c <= self._cores), default=self.candidates[0])

    def _predict(self, lanes: int, at_once: float) -> Choice:
        reason = (f"predicted from the load: up to {at_once:.1f} requests decoding or waiting at once, "
                  f"batches up to {self._longest_ns / 1e6:.0f} ms")  # fmt: skip
        return self._record(Choice(lanes, reason))

    def _begin_exploring(self, incumbent: int, reason: str) -> None:
        others = [c for c in self.candidates if c != incumbent]
        order = [incumbent, *others]
        self._plan = order + order[::-1]  # mirrored: c0 c1 .. ck ck .. c1 c0
        self._incumbent = incumbent
        self._predicted = False  # the hold is the start's prediction's (``_reread_load``)
        self._scores: dict[int, list[float]] = {}
        self._window: Window | None = Window(self._plan[0], self._clock())
        # The first window runs the incumbent, so no choice is logged until the next one: say
        # that an exploration began (its measurements mix arrangements until it ends).
        log.info("lanes: exploring %s, from %d (%s)", self.candidates, incumbent, reason,
                 extra={"lanes": self.lanes, "exploring": True})  # fmt: skip

    def _switch_to_window(self, reason: str) -> Choice | None:
        lanes = self._plan[0]
        self._window = Window(lanes, self._clock())
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
        self._hold_ns = self.tuning.hold_seconds * 1e9
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
                 f"; busy time per token: {scores}" if scores else "",
                 extra={"lanes": choice.lanes, "exploring": self.exploring})  # fmt: skip
        return choice
