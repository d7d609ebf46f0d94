"""Whether a lane plans its next batch now or first waits for the clients of the batch it is
running (or has just answered): chosen at each plan from what the server measures.

- **Plan now** (pipelining): a pipelined lane (CUDA, an asynchronous decoder) plans batch k+1
  while batch k runs, so that the device never waits for the host; a sequential lane plans from
  whatever is ready as soon as it has published. Batch k's clients come back too late for this
  batch and join the next one.
- **Wait**: the lane lets batch k end and its clients send their next requests, then plans from
  all of them: fewer, larger batches, each paying the fixed cost once, for the device's idle
  time while the clients turn around (and, on a pipelined lane, while the host publishes, plans
  and launches, which pipelining hides).

Which one serves more depends on the device's fixed cost per batch, on how fast the clients
come back, and on the traffic: with 16 clients that all send 50 tokens, a pipelined lane on the
modern stand-in (4 ms + 6 µs per padded token) alternates two half batches of 8 rows (6.4 ms
each), where waiting runs all 16 at once (8.8 ms plus the turnaround); with the bench's default
mix of lengths, the token budget and the length classes already split what is ready, waiting
would add few rows, and pipelining wins. So it is measured, per plan::

    now:   B  = the batch planned from the requests ready now:          cost per row  t(B) / |B|
    wait:  B' = the batch planned from those and the running batch's rows (each client's next
                request taken as long as its last, and only the share of clients that came back
                within the wait window):                                (idle + t(B')) / |B'|
           idle = the clients' turnaround (75th percentile), plus the host's time per batch on
                  a pipelined lane; the whole wait window instead of the turnaround where some
                  of the clients are not expected back (the lane waits for them to its end)
    wait window = the rejoin window (``rejoin_ms``), or as long as the clients measure to take
                  (90th percentile x 1.25) where that is longer, up to 25 ms, if the stretch
                  takes in a measured share of them (``MIN_STRETCH_GAIN``): a window that no
                  client comes back within only idles the device

``t`` is the lane's own fitted batch cost (batch_costs.CostFit, fixed + per token); the
turnaround is measured from each answer's post to the client's next submit of that slot; the
host's time is the measured publish, plan and launch of a batch. The lane waits when waiting is
cheaper per row by ``margin``. Where the turnaround is measured and none of the clients it
would wait for come back within the window (a share of them too small to make one row), it
plans now, at once, whatever the votes say: light load, where clients take longer than any
window, never waits. Before anything is measured it does what it did before: a pipelined lane
plans now, a sequential lane waits up to the rejoin window.

The lane does not act on each comparison alone: one plan in ``VOTE_EVERY`` casts a vote (within
``margin`` either way, for the choice that prevails), and the lane does what the majority of the
last ``WINDOW`` votes says (a pipelined lane votes on the plans it makes beside a running batch,
which the comparison models; server/rejoin.py says what it does while its device is idle), so
that the noise of a loaded machine does not idle the device at random. The majority is taken again at
every vote, those of plans with nobody to wait for included, so that a "wait" turns back once
the clients stop coming back. ``dispatch="pipeline"`` or ``"wait"`` fixes the choice. Each
change of the prevailing choice is logged with the numbers of the vote that turned it, under
``bicodec_shm.server.dispatch``, and kept in ``history``.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .batch_costs import CostFit

log = logging.getLogger("bicodec_shm.server.dispatch")

DISPATCH_MODES = ("auto", "pipeline", "wait")
WINDOW = 16  # votes behind the prevailing choice
VOTE_EVERY = 4  # plans per vote (a vote plans four batches ahead: ~0.1 ms of host time)
TURNAROUND_SAMPLES = 256
MIN_TURNAROUNDS = 8  # turnarounds measured before waiting is judged on them
MAX_TURNAROUND_NS = 50_000_000  # a client that takes longer paused on its own
WINDOW_CAP_MS = 25.0  # the longest a lane waits for its clients, however slow they come back
HOST_SAMPLES = 32  # recent host times per step
REFRESH = 16  # clients back between recomputations of the turnaround statistics
# The share of the answered clients that a stretched wait window must take in beyond those back
# within the rejoin window: clients slower than the cap (a language model's step) are not worth it.
MIN_STRETCH_GAIN = 0.1


@dataclass
class DispatchChoice:
    """A change of the prevailing choice, with the numbers of the decision that turned it."""

    wait: bool
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)


class DispatchPolicy:
    """The measured choice between planning now and waiting (module docstring).

    Args:
        mode: "auto" (measured), "pipeline" (always plan now) or "wait" (always wait).
        rejoin_ms: how long a lane waits for the clients it answered, or as long as they
            measure to take where that is longer (``wait_window_ms``).
        pipelined: the lane pipelines (its host work overlaps the device unless it waits).
        margin: how much cheaper per row waiting must be.
    """

    def __init__(self, mode: str = "auto", *, rejoin_ms: float, pipelined: bool,
                 margin: float = 0.05) -> None:  # fmt: skip
        if mode not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCH_MODES)}, got {mode!r}")
        self.mode = mode
        self.pipelined = pipelined
        self.margin = margin
        self.rejoin_ms = rejoin_ms
        self.history: list[DispatchChoice] = []
        self.decisions = 0  # measured decisions ("auto")
        self.waits = 0  # times it said wait
        self._lock = threading.Lock()
        self._rung: dict[int, int] = {}  # slot -> when its answer was posted (monotonic ns)
        self._turnarounds: deque[int] = deque(maxlen=TURNAROUND_SAMPLES)  # ns, up to MAX_TURNAROUND_NS
        self._outcomes: deque[int] = deque(maxlen=TURNAROUND_SAMPLES)  # ns every answered client took
        self._host: dict[str, deque[int]] = {}  # step -> its recent ns per batch
        self._recent: deque[bool] = deque(maxlen=WINDOW)
        self._prevailing: bool | None = None
        self._calls = 0
        self._stats: tuple[float, float | None, float] | None = None
        self._stats_measured = False  # whether ``_stats`` was computed from enough clients
        self._new_backs = 0

    # -- measurements (any lane's thread) ----------------------------------------------------

    def answered(self, slots: Sequence[int], now_ns: int) -> None:
        """The answers of ``slots`` were posted at ``now_ns``."""
        with self._lock:
            rung = self._rung
            if len(rung) > 4 * TURNAROUND_SAMPLES:  # slots whose client never came back
                stale = [s for s, t in rung.items() if now_ns - t > MAX_TURNAROUND_NS]
                for s in stale:
                    del rung[s]
                self._outcomes.extend([MAX_TURNAROUND_NS + 1] * min(len(stale), TURNAROUND_SAMPLES))
            for slot in slots:
                rung[slot] = now_ns

    def came_back(self, slots: np.ndarray, submitted_ns: np.ndarray) -> None:
        """Requests of ``slots`` submitted at ``submitted_ns`` (clamped by the server) were seen."""
        with self._lock:
            for slot, submitted in zip(slots.tolist(), submitted_ns.tolist()):
                rung = self._rung.pop(slot, None)
                if rung is None:
                    continue
                took = max(0, submitted - rung)
                self._outcomes.append(took)
                self._new_backs += 1
                if took <= MAX_TURNAROUND_NS:  # longer is a client's own pause, not a turnaround
                    self._turnarounds.append(took)

    def host_step(self, step: str, ns: int) -> None:
        """One batch's host time in ``step`` ("publish", "plan", "launch")."""
        samples = self._host.get(step)
        if samples is None:
            samples = self._host[step] = deque(maxlen=HOST_SAMPLES)
        samples.append(ns)

    def _turnaround_stats(self) -> tuple[float, float | None, float]:
        """(wait window ns, turnaround ns within it or None, share of clients back within it),
        recomputed once ``REFRESH`` new clients came back (percentiles cost ~50 us each), and
        until they are ``measured`` (what was cached before then must not stand for them)."""
        if self._stats is not None and self._new_backs < REFRESH and self._stats_measured:
            return self._stats
        self._stats_measured = self.measured
        self._new_backs = 0
        turnarounds = np.fromiter(list(self._turnarounds), np.int64)
        outcomes = np.fromiter(list(self._outcomes), np.int64)
        window = self.rejoin_ms * 1e6
        if len(turnarounds) >= MIN_TURNAROUNDS:  # as long as the clients measure to take
            stretched = min(max(window, 1.25 * float(np.percentile(turnarounds, 90))), WINDOW_CAP_MS * 1e6)
            # Only where the stretch takes in clients: past the cap, the 90th percentile says
            # nothing about whether anybody comes back within it.
            if _share(outcomes, stretched) - _share(outcomes, window) >= MIN_STRETCH_GAIN:
                window = stretched
        within = turnarounds[turnarounds <= window]
        turnaround = float(np.percentile(within, 75)) if len(within) else None
        self._stats = (window, turnaround, _share(outcomes, window))
        return self._stats

    @property
    def measured(self) -> bool:
        """Enough answered clients were seen back, or not, to judge waiting on them."""
        return len(self._outcomes) >= MIN_TURNAROUNDS

    def rejoins_within(self, window_ms: float, coming: int) -> bool:
        """Would any of ``coming`` answered clients be back within ``window_ms``? (What a
        pipelined lane asks before it waits for them while its device is busy.) Unmeasured:
        yes; ``dispatch="pipeline"``: never waited for; ``"wait"``: always."""
        if self.mode in ("pipeline", "wait"):  # fixed
            return self.mode == "wait"
        if not self.measured:
            return True
        with self._lock:
            outcomes = np.fromiter(list(self._outcomes), np.int64)
        return round(_share(outcomes, window_ms * 1e6) * coming) >= 1

    def wait_window_ms(self) -> float:
        """How long a lane whose device is idle waits for the clients it answered: the rejoin
        window, or as long as the measured turnaround takes, 90th percentile x 1.25, where
        that is longer (a loaded machine's clients come back later), up to 25 ms."""
        return self._turnaround_stats()[0] / 1e6

    @property
    def turnaround_ns(self) -> float | None:
        """The clients' turnaround within the wait window, 75th percentile (None: none within)."""
        return self._turnaround_stats()[1]

    @property
    def rejoin_share(self) -> float:
        """The share of answered clients that sent again within the wait window."""
        return self._turnaround_stats()[2]

    @property
    def host_ns(self) -> float:
        """The host's time per batch: the median of each step's recent samples, summed (a
        median: a thread descheduled by another tenant once must not make waiting look dear)."""
        steps = [list(samples) for samples in list(self._host.values())]
        return float(sum(statistics.median(samples) for samples in steps if samples))

    # -- the decision (the dispatcher's thread) ----------------------------------------------

    def should_wait(self, ready: np.ndarray, ready_seen: np.ndarray, coming: Sequence[int],
                    fit: CostFit | None,
                    predict: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> bool:  # fmt: skip
        """Wait for the clients of ``coming`` (the running or answered batch's row lengths)
        before planning from ``ready`` (R,) lengths seen at ``ready_seen`` (R,)?
        ``predict(lengths, seen)`` -> the indices of the batch the planner would form."""
        if self.mode != "auto":
            self.waits += self.mode == "wait"
            return self.mode == "wait"
        self._calls += 1
        voting = self._prevailing is None or not self._calls % VOTE_EVERY
        window, turnaround, share = self._turnaround_stats()
        joining = np.asarray(list(coming)[: int(round(share * len(coming)))], ready.dtype)
        if self.measured and (not len(joining) or turnaround is None or not len(ready)):
            # Measured, and none of them back within the window: nothing to wait for, whatever
            # prevails. As a vote it counts, so that a "wait" turns back with the traffic.
            clear = {"rejoin_share": share, "window_ns": window, "coming": len(coming)}
            return self._decide(False, clear, clear=True) if voting else self._act(False)
        if not voting:
            return self._act(self._prevailing)  # between votes: the prevailing choice
        if fit is None or turnaround is None:
            self.waits += not self.pipelined
            return not self.pipelined  # what the lane did before anything was measured
        # Every request of either plan: those ready, then the joining clients' next ones (later).
        lengths = np.concatenate((ready, joining))
        later = ready_seen.max() + 1 + np.arange(len(joining), dtype=ready_seen.dtype)
        seen = np.concatenate((ready_seen, later))
        host = self.host_ns
        idle = turnaround + (host if self.pipelined else 0.0)
        # Now: B from the ready ones, then B2 from the rest and the joining clients, right behind
        # it (the device idles only if the clients take longer than B runs).
        first = predict(ready, ready_seen)
        cost_b = self._cost(fit, ready[first])
        rest = _others(len(lengths), first)
        second = rest[predict(lengths[rest], seen[rest])]
        now = cost_b + max(0.0, idle - cost_b) + self._cost(fit, lengths[second])
        now /= len(first) + len(second)
        # Waiting: the idle, then B' from all of them, then B'2 from what B' leaves.
        merged = predict(lengths, seen)
        if len(merged) <= len(first):
            # No joining row would make the first batch larger (a long row that short ones may
            # not join, say): plan now, without a vote. This batch says nothing about whether
            # waiting pays for the next ones, and as a vote it would hold the lane to "now".
            return self._act(False)
        left = _others(len(lengths), merged)
        after = left[predict(lengths[left], seen[left])] if len(left) else left
        # A client that does not come back keeps the lane waiting to the end of the window.
        stays = max(0.0, window - turnaround) if len(joining) < len(coming) else 0.0
        waited = idle + stays + self._cost(fit, lengths[merged]) + self._cost(fit, lengths[after])
        waited /= len(merged) + len(after)
        numbers = {"rows_now": len(first), "rows_next": len(second), "longest_now": int(ready[first].max()),
                   "rows_wait": len(merged), "longest_wait": int(lengths[merged].max()),
                   "ns_per_row_now": now, "ns_per_row_wait": waited, "turnaround_ns": turnaround,
                   "host_ns": host, "idle_ns": idle, "fixed_ns": fit.fixed_ns,
                   "rejoin_share": share}  # fmt: skip
        # A vote, with a dead band: within the margin either way it keeps the prevailing choice,
        # so that noise in the measurements does not flip the lane back and forth.
        if waited < now * (1.0 - self.margin):
            vote = True
        elif waited > now * (1.0 + self.margin) or self._prevailing is None:
            vote = False
        else:
            vote = self._prevailing
        return self._decide(vote, numbers)

    @staticmethod
    def _cost(fit: CostFit, rows: np.ndarray) -> float:
        return fit.batch_ns(len(rows), int(rows.max())) if len(rows) else 0.0

    def _decide(self, vote: bool, numbers: dict[str, float], *, clear: bool = False) -> bool:
        """Count a vote; the lane does what the majority of the last ``WINDOW`` votes says (a
        ``clear`` vote, where no row could join, is done at once: there is nothing to wait for).
        The majority is taken on every vote, a clear one included."""
        self.decisions += 1
        self._recent.append(vote)
        prevailing = sum(self._recent) * 2 > len(self._recent)
        if prevailing != self._prevailing:
            self._prevailing = prevailing
            self._record(prevailing, numbers)
        return self._act(vote if clear else self._prevailing)

    def _act(self, wait: bool) -> bool:
        self.waits += wait
        return wait

    def _record(self, wait: bool, n: dict[str, float]) -> None:
        ms = 1e6
        what = {(True, True): "wait for the clients of the running batch",
                (True, False): "wait for the clients just answered",
                (False, True): "pipeline (plan while the running batch runs)",
                (False, False): "plan at once"}[wait, self.pipelined]  # fmt: skip
        if "ns_per_row_now" not in n:  # a clear vote turned it
            reason = (f"{n['rejoin_share']:.0%} of the answered clients come back within the "
                      f"{n['window_ns'] / ms:.3g} ms window: none of the {n['coming']:.0f} coming would")
            self.history.append(DispatchChoice(wait, reason, dict(n)))
            log.info("dispatch -> %s: %s", what, reason)
            return
        reason = (f"now {n['rows_now']:.0f} rows of <= {n['longest_now']:.0f} tokens, then "
                  f"{n['rows_next']:.0f} behind them, cost {n['ns_per_row_now'] / ms:.3g} ms a row; waiting, "
                  f"{n['rows_wait']:.0f} rows of <= {n['longest_wait']:.0f} would cost "
                  f"{n['ns_per_row_wait'] / ms:.3g} ms a row, idle {n['idle_ns'] / ms:.3g} ms included "
                  f"(clients come back in {n['turnaround_ns'] / ms:.3g} ms, {n['rejoin_share']:.0%} of them "
                  f"within the window; host {n['host_ns'] / ms:.3g} ms a batch; a batch's fixed cost "
                  f"{n['fixed_ns'] / ms:.3g} ms)")  # fmt: skip
        self.history.append(DispatchChoice(wait, reason, dict(n)))
        log.info("dispatch -> %s: %s", what, reason)


def _share(outcomes: np.ndarray, window_ns: float) -> float:
    """The share of answered clients back within ``window_ns`` (1.0 before any was answered)."""
    return float(np.mean(outcomes <= window_ns)) if len(outcomes) else 1.0


def _others(n: int, taken: np.ndarray) -> np.ndarray:
    """The indices 0..n-1 not in ``taken`` (a mask: ~10x cheaper than np.setdiff1d here)."""
    keep = np.ones(n, bool)
    keep[taken] = False
    return np.flatnonzero(keep)
