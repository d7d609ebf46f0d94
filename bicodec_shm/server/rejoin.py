"""Waiting for the clients a lane has just answered, where the dispatch policy says it pays.

A lane that waits holds the ready requests back, so that the clients it answered last can send
their next requests into the same batch. ``Rejoin`` keeps the slots answered since the last plan
and says, at each plan, how long the lane waits for them (0: it plans now):

- **the device idle, a sequential lane**: the policy's wait window where the policy says
  waiting pays (``DispatchPolicy.should_wait``), else 0.
- **the device idle, a pipelined lane** (nothing in flight): the wait window where the policy
  measured that some of these clients come back within it (``rejoins_within``; never under
  ``dispatch="pipeline"``), else 0. Its votes are the plans it makes beside a running batch,
  which is what the policy's comparison models. A lane that the policy told to let its running
  batch end first (``WAIT``) waits the window without asking again: that was the question.
- **a batch in flight** (a pipelined lane): up to ``rejoin_ms`` for the clients answered before
  it (the device has work meanwhile), unless the policy measured that none of them come back
  within it, or ``dispatch="pipeline"``, which never waits.

What a lane spends waiting on purpose (this window, and ``max_wait_ms``) is kept per lane
thread (``add_waited``, ``take_waited_ns``): the server counts it apart from the host gap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ..protocol.layout import CLAIMED, DONE
from .dispatch_policy import DispatchPolicy

_COMING_BACK = frozenset((CLAIMED, DONE))  # an answered slot whose client may send again


class Rejoin:
    """The answered clients a lane may wait for, and how long (module docstring).

    Args:
        policy: the server's dispatch policy.
        rejoin_ms: the rejoin window (0: never waits).
    """

    def __init__(self, policy: DispatchPolicy, rejoin_ms: float) -> None:
        self.policy = policy
        self.rejoin_ms = rejoin_ms
        self.answered: dict[int, int] = {}  # slot -> its length: answered since the last plan
        self._lane = threading.local()  # per lane thread: ``told`` (WAIT), ``waited`` (ns)

    def coming(self, states: np.ndarray) -> list[int]:
        """The lengths of the answered slots whose clients may still send (``states``: the
        slot table's states)."""
        return [n for slot, n in list(self.answered.items()) if int(states[slot]) in _COMING_BACK]

    def may_come_back(self, states: np.ndarray) -> bool:
        # A Python loop: np.isin costs ~40 us per call, a few slots here cost ~1 us.
        return any(int(states[slot]) in _COMING_BACK for slot in list(self.answered))

    def window_ms(self, states: np.ndarray, running: bool, wants_wait: Callable[[list[int]], bool]) -> float:
        """How long the calling lane waits now for the answered clients (0: plan now).
        ``running``: the lane has a batch in flight; ``wants_wait(coming)``: the policy's
        verdict on waiting for the clients of ``coming`` (their last lengths)."""
        told, self._lane.told = getattr(self._lane, "told", False), False
        coming = self.coming(states) if self.rejoin_ms > 0 else []
        if not coming:
            return 0.0
        if running:
            return self.rejoin_ms if self.policy.rejoins_within(self.rejoin_ms, len(coming)) else 0.0
        window = self.policy.wait_window_ms()
        if told:
            return window
        if self.policy.pipelined:
            return window if self.policy.rejoins_within(window, len(coming)) else 0.0
        return window if wants_wait(coming) else 0.0

    def told_to_wait(self) -> None:
        """The calling lane was told to let its running batch end first (``WAIT``): its next
        plan, with the device idle, waits the window for those clients without asking again."""
        self._lane.told = True

    def add_waited(self, ns: int) -> None:
        """The calling lane held ready requests back for ``ns`` on purpose."""
        self._lane.waited = getattr(self._lane, "waited", 0) + ns

    def take_waited_ns(self) -> int:
        """What the calling lane waited on purpose since the last call (then reset)."""
        waited, self._lane.waited = getattr(self._lane, "waited", 0), 0
        return waited
