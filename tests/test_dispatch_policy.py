"""Planning now or waiting for the running batch's clients (server/dispatch_policy.py): the
measured batch cost and client turnaround decide, and ``dispatch=`` wins over them.

- The policy alone, with planted costs and turnarounds (no clock, no threads): with equal lengths
  and a large fixed cost it waits, with a small one it pipelines, where waiting adds no row
  (a full batch, the token budget, rows that would not be batched, clients that do not come
  back in time) it pipelines; the prevailing choice follows the traffic and each change is
  logged with its numbers.
- A real server on the stand-in (it sleeps, so the machine's speed does not enter), fed by
  closed-loop client processes of equal lengths: a pipelined lane waits when the fixed cost
  is large and pipelines when it is small; ``dispatch="pipeline"`` keeps it pipelining; a
  sequential lane (the calibrated stand-in's) waits for its clients too.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from support import reap

from bicodec_shm.server.batch_costs import BatchPlanner, CostFit
from bicodec_shm.server.dispatch_policy import DispatchPolicy
from bicodec_shm.tools.bench.standin import StandInDecoder

CLIENT = str(Path(__file__).with_name("closed_loop_client.py"))
MS = 1_000_000

MODERN = CostFit(4 * MS, 0.006 * MS, 0.0, 0.0, 0.006 * MS)  # the modern stand-in's costs
CHEAP_LAUNCH = CostFit(0.2 * MS, 0.006 * MS, 0.0, 0.0, 0.006 * MS)  # a small fixed cost
NO_BATCHING = CostFit(60 * MS, 20 * MS, 0.0, 60 * MS, 30 * MS)  # an extra row costs more than alone


def _policy(turnaround_ms: float = 1.2, *, pipelined: bool = True, mode: str = "auto",
            host_ms: float = 0.3, back: float = 1.0) -> DispatchPolicy:  # fmt: skip
    """A policy that measured ``turnaround_ms`` for a share ``back`` of its answered clients
    (the rest paused 60 ms, past any wait window) and ``host_ms`` of host time per batch."""
    policy = DispatchPolicy(mode, rejoin_ms=2.0, pipelined=pipelined)
    for i in range(40):
        policy.answered([i], 100 * MS * i)
        took = turnaround_ms if i < back * 40 else 60.0
        policy.came_back(np.array([i]), np.array([100 * MS * i + int(took * MS)]))
    for step in ("publish", "plan", "launch"):
        policy.host_step(step, int(host_ms * MS / 3))
    return policy


def _decide(policy: DispatchPolicy, fit: CostFit, ready: list[int], coming: list[int], *,
            max_batch: int = 16, max_batch_tokens: int | None = 2400) -> bool:  # fmt: skip
    planner = BatchPlanner(max_batch=max_batch, max_batch_tokens=max_batch_tokens, min_fill=0.5,
                           measured=True, prior_batches=True)  # fmt: skip
    lengths = np.array(ready, np.int64)
    return policy.should_wait(lengths, np.arange(len(ready), dtype=np.int64), coming, fit,
                              lambda ln, seen: planner.predict(ln, seen, fit=fit))  # fmt: skip


def test_equal_lengths_and_a_large_fixed_cost_wait_for_the_running_batch():
    """16 clients of 50 tokens on the modern stand-in: 8 now and the other 8 right behind them
    cost 6.4 ms each (0.8 ms a row); all 16 after the turnaround, 1.5 + 8.8 ms (0.64 a row)."""
    policy = _policy()
    assert _decide(policy, MODERN, [50] * 8, [50] * 8)
    n = policy.history[-1].numbers
    assert (n["rows_now"], n["rows_next"], n["rows_wait"]) == (8, 8, 16)
    assert n["ns_per_row_now"] == pytest.approx(0.8 * MS)
    assert n["ns_per_row_wait"] == pytest.approx((1.2 + 0.3 + 8.8) / 16 * MS)


def test_a_small_fixed_cost_pipelines():
    assert not _decide(_policy(), CHEAP_LAUNCH, [50] * 8, [50] * 8)


def test_a_slow_turnaround_pipelines_where_a_fast_one_waits():
    assert _decide(_policy(turnaround_ms=0.5), MODERN, [50] * 8, [50] * 8)
    assert not _decide(_policy(turnaround_ms=1.9, host_ms=2.0), MODERN, [50] * 8, [50] * 8)


def test_where_no_row_would_join_it_does_not_wait():
    assert not _decide(_policy(), MODERN, [50] * 16, [50] * 4)  # the batch is full already
    # The token budget (512) caps the batch at 10 rows of 50: 2 more for 1.5 ms of idle.
    assert not _decide(_policy(), MODERN, [40, 45, 50, 42, 38, 50, 47, 44], [50, 45, 48, 200, 150, 300],
                       max_batch_tokens=512)  # fmt: skip
    # Rows that the measured costs would not batch anyway (a CPU where batching does not pay).
    assert not _decide(_policy(pipelined=False), NO_BATCHING, [50], [50] * 3)


def test_a_batch_that_no_joining_row_would_grow_plans_now_without_a_vote():
    """A long row ready, short clients coming: they could not join it (min_fill), so this batch
    goes now; but it casts no vote, and the next batch of equal lengths still waits."""
    policy = _policy(pipelined=False)
    assert not _decide(policy, MODERN, [278], [40, 42, 45])
    assert (policy.decisions, policy.history) == (0, [])
    assert _decide(policy, MODERN, [50] * 2, [50] * 2)  # the next decision is a vote, for waiting
    assert policy.decisions == 1 and policy.history[-1].wait


def test_clients_that_do_not_come_back_within_the_window_are_not_waited_for():
    # 1 of 8 would join: a batch of 9 after the idle does not beat 8 now and 1 behind them.
    assert not _decide(_policy(back=0.1), MODERN, [50] * 8, [50] * 8)
    assert _decide(_policy(back=0.9), MODERN, [50] * 8, [50] * 8)


def test_the_wait_window_stretches_to_the_measured_turnaround_up_to_a_cap():
    assert _policy(turnaround_ms=1.2).wait_window_ms() == 2.0  # the rejoin window covers them
    assert _policy(turnaround_ms=4.0).wait_window_ms() == pytest.approx(5.0)  # a loaded machine
    assert _policy(turnaround_ms=40.0).wait_window_ms() == 25.0
    assert _policy(turnaround_ms=4.0, mode="wait").wait_window_ms() == pytest.approx(5.0)  # it waits for them


def test_a_fixed_dispatch_mode_wins_over_the_measurement():
    assert not _decide(_policy(mode="pipeline"), MODERN, [50] * 8, [50] * 8)
    assert _decide(_policy(mode="wait"), CHEAP_LAUNCH, [50] * 8, [50] * 8)
    with pytest.raises(ValueError, match="auto, pipeline, wait"):
        DispatchPolicy("sometimes", rejoin_ms=2.0, pipelined=True)


def test_before_anything_is_measured_it_does_what_the_lane_did_before():
    fresh = DispatchPolicy("auto", rejoin_ms=2.0, pipelined=True)
    assert not _decide(fresh, MODERN, [50] * 8, [50] * 8)  # a pipelined lane pipelines
    fresh = DispatchPolicy("auto", rejoin_ms=2.0, pipelined=False)
    assert _decide(fresh, MODERN, [50] * 8, [50] * 8)  # a sequential lane waits up to rejoin_ms


def test_the_prevailing_choice_follows_the_traffic_and_each_change_is_logged(caplog):
    policy = _policy()
    with caplog.at_level(logging.INFO, logger="bicodec_shm.server.dispatch"):
        for _ in range(80):  # 16 x 50 tokens
            _decide(policy, MODERN, [50] * 8, [50] * 8)
        switched = None
        for i in range(80):  # the traffic changes: lengths the budget splits
            waits = policy.waits
            _decide(policy, MODERN, [40, 45, 50, 42, 38, 50, 47, 44], [50, 45, 48, 200],
                    max_batch_tokens=512)  # fmt: skip
            if switched is None and len(policy.history) == 2:
                switched = i
            elif switched is None:
                assert policy.waits == waits + 1  # until the votes turn, the lane keeps waiting
    assert [c.wait for c in policy.history] == [True, False]
    assert switched is not None and switched < 4 * 9  # nine votes of sixteen, one every fourth plan
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("dispatch -> wait for the clients of the running batch: now 8 rows of <= 50 "
                               "tokens, then 8 behind them, cost 0.8 ms a row; waiting, 16 rows")  # fmt: skip
    assert "clients come back in 1.2 ms" in lines[0] and "a batch's fixed cost 4 ms" in lines[0]
    assert lines[1].startswith("dispatch -> pipeline (plan while the running batch runs)")


# -- a real server on the stand-in ----------------------------------------------------------------


class RecordingStandIn(StandInDecoder):
    """The stand-in, recording each batch's rows."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.sizes: list[int] = []
        self._lock = threading.Lock()

    def launch(self, semantic_ids, global_ids, lengths=None):
        with self._lock:
            self.sizes.append(int(semantic_ids.shape[0]))
        return super().launch(semantic_ids, global_ids, lengths)

    def detokenize(self, semantic_ids, global_ids, lengths=None):
        with self._lock:
            self.sizes.append(int(semantic_ids.shape[0]))
        return super().detokenize(semantic_ids, global_ids, lengths)


def _serve_equal_lengths(server, decoder, name: str, clients: int = 8, batches: int = 120) -> list[int]:
    procs = [subprocess.Popen([sys.executable, CLIENT, name, "50"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(clients)]  # fmt: skip
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        deadline = time.monotonic() + 90
        while len(decoder.sizes) < batches:
            assert time.monotonic() < deadline, decoder.sizes
            time.sleep(0.02)
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            reap(p)
    return decoder.sizes[batches // 2 : batches]  # once measured


# The rejoin window is widened from 2 ms so that the choice does not hang on how fast the
# client processes come back on a loaded 2-core CI machine.
SERVER = dict(max_batch=16, max_batch_tokens=2400, rejoin_ms=20.0)


def test_a_pipelined_lane_with_a_large_fixed_cost_waits_and_runs_every_client_at_once(
        thread_server, shm_name):  # fmt: skip
    decoder = RecordingStandIn(a_ms=20.0, b_ms=0.01, asynchronous=True)
    server = thread_server(decoder, **SERVER)
    assert server.lanes == 1 and server._pipeline
    sizes = _serve_equal_lengths(server, decoder, shm_name)
    assert server.dispatch_choices and server.dispatch_choices[-1].wait and server._policy.waits > 0
    assert np.mean(sizes) > 6.5  # 8 clients: nearly all in every batch


def test_a_pipelined_lane_with_a_small_fixed_cost_keeps_pipelining(thread_server, shm_name):
    decoder = RecordingStandIn(a_ms=0.2, b_ms=0.1, asynchronous=True)
    server = thread_server(decoder, **SERVER)
    _serve_equal_lengths(server, decoder, shm_name)
    assert server.dispatch_choices and not server.dispatch_choices[-1].wait
    assert server._policy.waits < 0.1 * server._policy.decisions


def test_dispatch_pipeline_never_waits_where_waiting_would_pay(thread_server, shm_name):
    decoder = RecordingStandIn(a_ms=20.0, b_ms=0.01, asynchronous=True)
    server = thread_server(decoder, dispatch="pipeline", **SERVER)
    _serve_equal_lengths(server, decoder, shm_name)
    assert server.dispatch_choices == [] and server._policy.waits == 0


def test_a_sequential_lane_with_a_large_fixed_cost_waits_for_its_clients(thread_server, shm_name):
    """The calibrated stand-in's shape: a synchronous device, one sequential lane."""
    decoder = RecordingStandIn(a_ms=20.0, b_ms=0.01)
    server = thread_server(decoder, **SERVER)
    assert not server._pipeline
    waited = np.mean(_serve_equal_lengths(server, decoder, shm_name, batches=60))
    assert server.dispatch_choices[-1].wait and waited > 5.5  # of 8 clients
