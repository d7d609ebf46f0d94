"""What a batch costs on this server's decoder, fitted online from its own batches, and the
planner that batches only where that pays.

Why: on a GPU a batch of 8 costs little more than one row, so every row that fits should join.
On a CPU a batch costs about as much per row as single decodes, and a row padded to its
batch's longest pays for the padding: SNAC 24 kHz on a 2-core CPU measured 1.4-1.7x per item at
B = 2 (benchmarks/RESULTS.md), so batching mixed lengths made the shared server lose to a
decoder per process. Which case holds depends on the model, the device, the lengths and the
machine's state, so it is measured, on the server's own batches.

The model (one fit per lane thread count; nanoseconds)::

    t(R rows, longest L) = a + b·L + c·L²  +  (R - 1)·(a_r + b_r·L)
    a row alone, of length l:   a + b·l + c·l²
    each extra row of a batch:  a_r + b_r·L      (padded to the batch's longest, L)

fitted by non-negative least squares on relative error (each sample weighted by 1/t) over the
most recent batches, lone ones (R = 1) and batched ones in separate windows so that neither
crowds the other out. ``a`` is the fixed cost a batch pays once (a GPU's launches and syncs),
``a_r`` what each extra row adds beyond its tokens, ``b_r`` an extra row's cost per padded token
(a CPU's: about ``b``; a GPU's: far less); ``c`` lets a long decode cost more than linearly
(activations that outgrow the caches).

The rule: a row of length ``l`` joins a batch of R rows padded to L only if the batch with it
costs less than the batch without it plus the row decoded alone::

    t(R + 1, max(L, l)) - t(R, L) < t(1, l)

So where the fixed cost is large (a GPU) every row that fits joins; where it is small, only rows
near the batch's length do, up to the padding the saved fixed cost buys; where an extra row
costs more than a lone decode even unpadded, nothing is batched. The static policy's bounds
(``max_batch``, the token budget, ``min_fill``; batching.py) still hold on top.

On a CPU lane one more bound holds: every row of a batch waits for the whole of it, and an
extra row there costs nearly a lone decode, so a batch may take at most ``LATENCY_FACTOR`` times
what its most urgent row (the one due soonest) takes alone, however much time that row has left:
slack spent filling one lane's batch is slack the next window, due sooner, would have needed. A
device batches every row that pays: a batch there costs little more than a row.

Measuring needs batches: while a fit lacks batched samples, or when none was decoded for
``probe_every`` batches, one plan in two (then one) is a *probe*, the static policy's batch cut
to its two nearest lengths: the cheapest batch that says what an extra row costs. Before a fit
exists, a CPU server decodes rows alone between its probes (the cheap side of a wrong guess there)
and a device-shaped one batches as the static policy does.

Every change of the verdict (``off``: not even two equal rows pay; ``near-equal``: rows join
only within a padding tighter than ``min_fill``'s; ``on``) is logged with its numbers under
``bicodec_shm.server.batching`` and kept in ``BatchCosts.history``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from .batching import plan_batch

log = logging.getLogger("bicodec_shm.server.batching")

BATCHING_MODES = ("auto", "static")
WINDOW = 48  # recent samples of each kind (lone, batched) the fit uses
MIN_SAMPLES = 8  # samples before a fit is trusted ...
MIN_BATCHED = 3  # ... of which batched ones
PROBE_EVERY = 32  # batches without a batched sample before the next probe
# A CPU lane's batch takes at most this many times its most urgent row's lone decode. 16 Orpheus
# streams on 2 cores (tiny SNAC, a window every 140 ms with ~30 ms of slack at its second chunk):
# with every row that pays in one batch (up to ~75 ms), 54 and 12 late chunks of 960 in two runs;
# batches of at most 2 rows, 8 and 3 (benchmarks/RESULTS.md). Letting the urgent row's slack
# stretch the bound measured worse (38-43): a lane filled up to a row's 170 ms of slack while
# the next window had 30.
LATENCY_FACTOR = 2.0
_N_PARAMS = 5


@dataclass(frozen=True)
class CostFit:
    """A fitted cost model (module docstring), nanoseconds; ``samples``: batches behind it."""

    fixed_ns: float  # a
    token_ns: float  # b
    square_ns: float  # c (per token squared)
    row_ns: float  # a_r
    row_token_ns: float  # b_r
    samples: int = 0
    batched: int = 0

    def lone_ns(self, length: float) -> float:
        return self.fixed_ns + self.token_ns * length + self.square_ns * length * length

    def batch_ns(self, rows: int, longest: float) -> float:
        """What a batch of ``rows`` rows padded to ``longest`` tokens costs."""
        return self.lone_ns(longest) + (rows - 1) * (self.row_ns + self.row_token_ns * longest)

    def join_pays(self, rows: int, longest: int, length: int) -> bool:
        """Does a row of ``length`` tokens cost less in the batch (``rows`` rows padded to
        ``longest``) than alone?"""
        grown = self.batch_ns(rows + 1, max(longest, length)) - self.batch_ns(rows, longest)
        return grown < self.lone_ns(length)

    def padding_that_pays(self, length: int) -> int:
        """The most padding (tokens) a row may take to join one row of ``length`` tokens; -1 if
        not even an equal row pays."""
        extra = self.row_ns + self.row_token_ns * length
        shorter = np.arange(length, 0, -1, dtype=np.float64)  # the joining row's length: l..1
        pays = extra < self.fixed_ns + self.token_ns * shorter + self.square_ns * shorter**2
        return int(np.argmin(pays)) - 1 if not pays.all() else length - 1

    def describe(self) -> str:
        lone = f"{self.fixed_ns / 1e6:.3g} ms + {self.token_ns / 1e6:.3g} ms/token"
        if self.square_ns:
            lone += f" + {self.square_ns / 1e6:.2g} ms/token²"
        return (f"a row alone {lone}; each extra row {self.row_ns / 1e6:.3g} ms + "
                f"{self.row_token_ns / 1e6:.3g} ms/padded token (fit of {self.samples} batches, "
                f"{self.batched} batched)")  # fmt: skip


def fit_costs(rows: np.ndarray, longest: np.ndarray, ns: np.ndarray) -> CostFit | None:
    """The non-negative least-squares fit of the model to batches of ``rows`` (S,) rows padded
    to ``longest`` (S,) tokens that took ``ns`` (S,) ns, on relative error; None if the samples
    cannot tell the parameters apart at all (fewer than 2)."""
    rows, longest, ns = (np.asarray(x, np.float64) for x in (rows, longest, ns))
    keep = ns > 0
    rows, longest, ns = rows[keep], longest[keep], ns[keep]
    if len(ns) < 2:
        return None
    scale = max(float(longest.max()), 1.0)  # columns of comparable size: a well-conditioned solve
    x = longest / scale
    extra = rows - 1
    design = np.stack([np.ones_like(x), x, x * x, extra, extra * x], axis=1)
    # Relative error: each residual over its own time; in units of the median time (O(1) numbers).
    unit = float(np.median(ns))
    weighted = design * (unit / ns)[:, None]
    gram = weighted.T @ weighted  # the normal equations: every subset below is a 5x5 solve at most
    gram += np.eye(_N_PARAMS) * 1e-9 * np.trace(gram)  # collinear columns (equal lengths) stay solvable
    rhs = weighted.sum(axis=0)  # weighted.T @ ones
    best, best_err = np.zeros(_N_PARAMS), np.inf
    # Exact NNLS for five parameters: the optimum is the least-squares solution on its support,
    # so it is the best of the subsets whose own solution is non-negative (31 small solves).
    for k in range(1, _N_PARAMS + 1):
        for support in itertools.combinations(range(_N_PARAMS), k):
            cols = list(support)
            coef = np.linalg.solve(gram[np.ix_(cols, cols)], rhs[cols])
            if (coef < 0).any():
                continue
            err = float(coef @ gram[np.ix_(cols, cols)] @ coef - 2 * coef @ rhs[cols])  # + len(ns)
            if err < best_err - 1e-12:
                best_err, best = err, np.zeros(_N_PARAMS)
                best[cols] = coef
    best *= unit
    a, b, c, a_r, b_r = best
    return CostFit(float(a), float(b / scale), float(c / scale**2), float(a_r), float(b_r / scale),
                   samples=len(ns), batched=int((rows > 1).sum()))  # fmt: skip


@dataclass
class BatchingChoice:
    """A change of the verdict for one lane thread count (``key``), with its numbers."""

    key: Hashable
    mode: str  # "off", "near-equal" or "on"
    length: int  # the typical length it was judged at
    padding: int  # the most padding a joining row may take there (-1: none)
    fit: CostFit
    reason: str = ""


@dataclass
class _Samples:
    lone: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    batched: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    since_batched: int = 0  # batches since the last batched one
    new: int = 0  # samples since the last fit
    fit: CostFit | None = None
    fitted_at: float = -1e18
    mode: str | None = None


def _kind(key: Hashable) -> str:
    """Which model a cost key's batches ran: "encode" for ``("encode", threads)``, else "decode"."""
    return key[0] if isinstance(key, tuple) else "decode"


class BatchCosts:
    """The online fits, one per key (the lane thread count; None for a device; a server that
    encodes keys its encode batches ``("encode", threads)``: another model), and each
    verdict's log. ``add`` is called from any lane's thread, the rest from the dispatcher.

    Args:
        min_fill: the static padding bound (``near-equal`` is any tighter verdict).
        refit_every: new samples between fits ...
        refit_seconds: ... and seconds (a fit costs ~1 ms: at most a few per second of fast
            batches).
        clock: monotonic seconds (tests step it by hand).
    """

    def __init__(self, *, min_fill: float, refit_every: int = 4, refit_seconds: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.min_fill = min_fill
        self.refit_every = refit_every
        self.refit_seconds = refit_seconds
        self._clock = clock
        self.history: list[BatchingChoice] = []
        self._lock = threading.Lock()
        self._by_key: dict[Hashable, _Samples] = {}
        # The last fit of any key of a kind (decode, encode): a prior for a new key of that kind.
        self._latest: dict[str, CostFit] = {}

    def add(self, key: Hashable, rows: int, longest: int, tokens: int, ns: int) -> None:
        """One decoded batch: ``rows`` rows padded to ``longest`` (``tokens`` valid) in ``ns``."""
        if ns <= 0 or rows < 1 or longest < 1:
            return
        with self._lock:
            s = self._by_key.setdefault(key, _Samples())
            (s.batched if rows > 1 else s.lone).append((rows, longest, tokens, ns))
            s.since_batched = 0 if rows > 1 else s.since_batched + 1
            s.new += 1
            if s.new < self.refit_every or self._clock() - s.fitted_at < self.refit_seconds:
                return
            s.new = 0
            samples = [*s.lone, *s.batched]
            # Two row counts at least: with one, a batch's fixed cost and its rows' cannot be told apart.
            if (len(samples) < MIN_SAMPLES or len(s.batched) < MIN_BATCHED
                    or len({sample[0] for sample in samples}) < 2):  # fmt: skip
                return
            r, lng, tok, t = (np.array(col, np.float64) for col in zip(*samples))
            fit = fit_costs(r, lng, t)
            if fit is None:
                return
            s.fit = self._latest[_kind(key)] = fit
            s.fitted_at = self._clock()
            typical = max(1, int(round(float(np.median(tok / r)))))
            self._judge(key, s, fit, typical)

    def fit(self, key: Hashable) -> CostFit | None:
        """The key's own fit, else the latest of any key of its kind (the model is the same;
        its thread count changes the scale more than which batches pay), else None."""
        s = self._by_key.get(key)
        return s.fit if s is not None and s.fit is not None else self._latest.get(_kind(key))

    def lone_ns(self, key: Hashable, length: int) -> float | None:
        """What one row of ``length`` tokens costs alone under ``key``: the key's own fit, or
        before one (one client never makes a batched sample), the median of its last lone
        samples of that length (three at least); None while neither exists."""
        with self._lock:
            s = self._by_key.get(key)
            if s is None:
                return None
            if s.fit is not None:
                return s.fit.lone_ns(length)
            same = [ns for rows, longest, _, ns in s.lone if longest == length]
        return float(np.median(same)) if len(same) >= 3 else None

    def own_fit(self, key: Hashable) -> CostFit | None:
        s = self._by_key.get(key)
        return None if s is None else s.fit

    def mode(self, key: Hashable) -> str | None:
        """The key's verdict now ("off", "near-equal", "on"), or None before its first fit."""
        s = self._by_key.get(key)
        return None if s is None else s.mode

    def probing(self, key: Hashable) -> None:
        """A probe of ``key`` was planned: the next waits ``PROBE_EVERY`` batches (another lane
        must not probe again before this one's sample is in)."""
        with self._lock:
            self._by_key.setdefault(key, _Samples()).since_batched = 0

    def wants_probe(self, key: Hashable) -> bool:
        """Too few batched samples, or none for ``PROBE_EVERY`` batches."""
        s = self._by_key.get(key)
        return s is None or len(s.batched) < MIN_BATCHED or s.since_batched >= PROBE_EVERY

    def _judge(self, key: Hashable, s: _Samples, fit: CostFit, length: int) -> None:
        padding = fit.padding_that_pays(length)
        if padding < 0:
            mode = "off"
        elif padding < min(length - 1, (1.0 - self.min_fill) * length):
            mode = "near-equal"
        else:
            mode = "on"
        if mode == s.mode:
            return
        s.mode = mode
        pair = fit.batch_ns(2, length) / (2 * fit.lone_ns(length))
        what = {"off": "decode rows alone", "near-equal": "batch only near-equal lengths",
                "on": "batch every row that fits"}[mode]  # fmt: skip
        kind, threads = key if isinstance(key, tuple) else ("", key)  # ("encode", threads)
        where = ("the device" if threads is None else f"{threads} thread(s) a lane") + (
            f" ({kind})" if kind else "")  # fmt: skip
        reason = (f"at {length} tokens two rows together cost {pair:.2f}x apart"
                  + (f", and a row may be padded by up to {padding} tokens" if padding >= 0 else "")
                  + f"; {fit.describe()}")  # fmt: skip
        self.history.append(BatchingChoice(key, mode, length, padding, fit, reason))
        log.info("batching (%s) -> %s: %s", where, what, reason)


class BatchPlanner:
    """The next batch: the static policy (batching.py), narrowed by the measured costs.

    Args:
        max_batch, max_batch_tokens, min_fill: the static bounds, which always hold.
        measured: batch only where the fit says it pays (False: the static policy alone).
        prior_batches: before any fit, batch as the static policy does (a device); else decode
            rows alone between probes (a CPU).
        latency_bound: a measured batch takes at most ``LATENCY_FACTOR`` times its most urgent
            row's lone decode (CPU lanes; module docstring).
    """

    def __init__(self, *, max_batch: int, max_batch_tokens: int | None, min_fill: float,
                 measured: bool, prior_batches: bool, latency_bound: bool = False) -> None:  # fmt: skip
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.min_fill = min_fill
        self.measured = measured
        self.prior_batches = prior_batches
        self.latency_bound = latency_bound
        self.costs = BatchCosts(min_fill=min_fill)
        self.plans = 0
        self.probes = 0  # probe batches planned (tests, logs)
        self._skip_probe = False  # probes alternate with ordinary plans while a fit is missing

    def plan(self, lengths: np.ndarray, seen_ns: np.ndarray, *, key: Hashable = None,
             max_rows: int | None = None) -> np.ndarray:  # fmt: skip
        """Indices of the next batch among ready requests of ``lengths`` (R,) due at ``seen_ns``
        (R,: their seen times, or when their audio is due), longest first; at most ``max_rows``
        rows (a lane's share). The one due soonest is always in it."""
        self.plans += 1
        rows = self.max_batch if max_rows is None else max(1, min(self.max_batch, max_rows))
        static = dict(max_batch=rows, max_batch_tokens=self.max_batch_tokens, min_fill=self.min_fill)
        if not self.measured or len(lengths) < 2 or rows < 2:
            return plan_batch(lengths, seen_ns, **static)
        fit = self.costs.fit(key)
        if fit is not None:
            chosen = plan_batch(lengths, seen_ns, **static, joins=self._gate(fit, key),
                                within=self._bound(fit, lengths, seen_ns))  # fmt: skip
        elif self.prior_batches:
            return plan_batch(lengths, seen_ns, **static)
        else:
            chosen = plan_batch(lengths, seen_ns, **{**static, "max_batch": 1})  # the oldest, alone
        if len(chosen) == 1 and self.costs.wants_probe(key):
            if self._skip_probe and self.costs.own_fit(key) is None:
                self._skip_probe = False  # one ordinary plan between probes while unfitted
                return chosen
            probe = plan_batch(lengths, seen_ns, **{**static, "max_batch": 2})
            if len(probe) == 2:
                self.probes += 1
                self.costs.probing(key)
                self._skip_probe = True
                return probe
        return chosen

    def settled(self, key: Hashable = None) -> bool:
        """Batches are planned as the measurement says: a first fit exists, or the traffic has
        not given one in ``2 x MIN_SAMPLES`` plans (one request at a time has nothing to batch)."""
        return not self.measured or self.plans >= 2 * MIN_SAMPLES or self.costs.fit(key) is not None

    def predict(self, lengths: np.ndarray, seen_ns: np.ndarray, *, fit: CostFit | None = None,
                key: Hashable = None) -> np.ndarray:  # fmt: skip
        """The indices of the batch ``plan`` would form from these requests with ``fit``'s
        costs, without probing (for the dispatch policy's predictions)."""
        static = dict(max_batch=self.max_batch, max_batch_tokens=self.max_batch_tokens,
                      min_fill=self.min_fill)  # fmt: skip
        if not self.measured or fit is None:
            return plan_batch(lengths, seen_ns, **static)
        return plan_batch(lengths, seen_ns, **static, joins=self._gate(fit, key),
                          within=self._bound(fit, lengths, seen_ns))  # fmt: skip

    def _bound(self, fit: CostFit, lengths: np.ndarray,
               due_ns: np.ndarray) -> Callable[[int, int], bool] | None:  # fmt: skip
        """The latency bound of a CPU lane's batch (module docstring), or None (a device)."""
        if not self.latency_bound or len(lengths) < 2:
            return None
        urgent = int(np.lexsort((np.arange(len(due_ns)), due_ns))[0])  # as plan_batch's first row
        limit = LATENCY_FACTOR * fit.lone_ns(int(lengths[urgent]))
        return lambda rows, longest: fit.batch_ns(rows, longest) <= limit

    def _gate(self, fit: CostFit, key: Hashable) -> Callable[[int, int, int], bool] | None:
        """The join rule, or None where the key's verdict is "on" (every row that fits pays:
        the static plan, without a cost call per candidate row; ~4x cheaper)."""
        return None if self.costs.mode(key) == "on" else fit.join_pays
