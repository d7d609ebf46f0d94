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

from bicodec_shm.protocol.header import stats_from_header
from bicodec_shm.protocol.layout import DONE, FREE, READY
from bicodec_shm.server.batch_costs import BatchPlanner, CostFit
from bicodec_shm.server.dispatch_policy import DispatchPolicy
from bicodec_shm.server.rejoin import Rejoin
from bicodec_shm.tools.bench.standin import StandInDecoder
from bicodec_shm.tools.stats_cmd import stats_rows

CLIENT = str(Path(__file__).with_name("closed_loop_client.py"))
MS = 1_000_000

MODERN = CostFit(4 * MS, 0.006 * MS, 0.0, 0.0, 0.006 * MS)  # the modern stand-in's costs
CHEAP_LAUNCH = CostFit(0.2 * MS, 0.006 * MS, 0.0, 0.0, 0.006 * MS)  # a small fixed cost
NO_BATCHING = CostFit(60 * MS, 20 * MS, 0.0, 60 * MS, 30 * MS)  # an extra row costs more than alone


def _policy(turnaround_ms: float = 1.2, *, pipelined: bool = True, mode: str = "auto",
            host_ms: float = 0.3, back: float = 1.0,
            took_ms: list[float] | None = None) -> DispatchPolicy:  # fmt: skip
    """A policy that measured ``turnaround_ms`` for a share ``back`` of its answered clients
    (the rest paused 60 ms, past any wait window), or each of ``took_ms`` in turn for 40
    clients, and ``host_ms`` of host time per batch."""
    policy = DispatchPolicy(mode, rejoin_ms=2.0, pipelined=pipelined)
    for i in range(40):
        policy.answered([i], 100 * MS * i)
        took = turnaround_ms if i < back * 40 else 60.0
        took = took if took_ms is None else took_ms[i % len(took_ms)]
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
    # 2 of 40 back in time: of 8 clients, not one row would join.
    assert not _decide(_policy(back=0.05), MODERN, [50] * 8, [50] * 8)
    assert _decide(_policy(back=0.9), MODERN, [50] * 8, [50] * 8)


def test_a_wait_for_clients_that_may_not_come_back_is_charged_the_whole_window():
    """1 of 8 clients back in time: the lane would wait out the whole window for the other 7."""
    policy = _policy(back=0.1)  # 4 of 40 back in 1.2 ms; the window stays 2 ms
    assert _decide(policy, MODERN, [50] * 8, [50] * 8)  # 9 rows after 2.3 ms beat 8 now, 1 behind
    n = policy.history[-1].numbers
    assert (n["rows_wait"], n["ns_per_row_wait"]) == (9, pytest.approx((2.0 + 0.3 + 6.7) / 9 * MS))


def test_clients_slower_than_any_window_are_never_waited_for_once_measured():
    """Two clients that turn around in 30-45 ms (a language model's step): no window up to the
    25 ms cap takes in anyone, so no plan waits, on either kind of lane, and none votes to."""
    steps = [30.0 + 15.0 * k / 39 for k in range(40)]
    for pipelined in (False, True):
        policy = _policy(took_ms=steps, pipelined=pipelined)
        assert policy.wait_window_ms() == 2.0 and policy.rejoin_share == 0.0
        assert not any(_decide(policy, MODERN, [50], [50]) for _ in range(64))
        assert policy.waits == 0 and policy.decisions == 17  # the first plan, then every fourth: clear votes
        assert [c.wait for c in policy.history] == [False]
        assert "0% of the answered clients come back within the 2 ms window" in policy.history[0].reason


def test_the_wait_window_stretches_only_where_clients_come_back_within_it():
    assert _policy(turnaround_ms=1.2).wait_window_ms() == 2.0  # the rejoin window covers them
    assert _policy(turnaround_ms=4.0).wait_window_ms() == pytest.approx(5.0)  # a loaded machine
    # Clients 5-30 ms: the capped window takes in 80 % of them.
    assert _policy(took_ms=[5.0 + 25.0 * k / 39 for k in range(40)]).wait_window_ms() == 25.0
    # None within the cap: stretching to it would idle the device for nobody.
    assert _policy(turnaround_ms=40.0).wait_window_ms() == 2.0
    # Half back at once, half past the cap: the stretch adds nobody.
    assert _policy(took_ms=[1.0, 40.0]).wait_window_ms() == 2.0
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


def test_a_wait_verdict_turns_back_once_the_clients_stop_coming_back():
    """The lane waits for 16 x 50 tokens; then its clients stop coming back in time. The votes
    on those plans (nobody to wait for) turn the stored verdict back, and no plan waits
    meanwhile; once they come back in time again, it waits again."""
    policy = _policy()
    for _ in range(64):
        _decide(policy, MODERN, [50] * 8, [50] * 8)
    assert [c.wait for c in policy.history] == [True]
    for i in range(40, 300):  # the traffic changes: every client now pauses 60 ms
        policy.answered([i], 100 * MS * i)
        policy.came_back(np.array([i]), np.array([100 * MS * i + 60 * MS]))
    waits = policy.waits
    for _ in range(64):
        _decide(policy, MODERN, [50] * 8, [50] * 8)
    assert policy.waits == waits  # not one plan waited for clients that do not come back
    assert [c.wait for c in policy.history] == [True, False]
    for i in range(300, 600):  # and back to 1.2 ms
        policy.answered([i], 100 * MS * i)
        policy.came_back(np.array([i]), np.array([100 * MS * i + int(1.2 * MS)]))
    for _ in range(64):
        _decide(policy, MODERN, [50] * 8, [50] * 8)
    assert [c.wait for c in policy.history] == [True, False, True]


# -- how long a lane waits for the clients it answered (server/rejoin.py) ------------------------

LIGHT_LOAD = [30.0 + 15.0 * k / 39 for k in range(40)]  # two LM clients' turnarounds, ms


def _rejoin(policy: DispatchPolicy) -> tuple[Rejoin, np.ndarray]:
    """A ``Rejoin`` that answered slots 0 and 1 (50 tokens each), whose clients may send
    again (DONE); slot 2 was answered too but its client gave the slot back (FREE)."""
    rejoin = Rejoin(policy, policy.rejoin_ms)
    rejoin.answered.update({0: 50, 1: 50, 2: 50})
    return rejoin, np.array([DONE, DONE, FREE, READY], np.uint32)


def _all_rows(lengths: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """A planner that batches every row."""
    return np.arange(len(lengths))


def _never_asked(coming):
    raise AssertionError(f"the policy was asked about {coming}")


def test_an_idle_sequential_lane_asks_the_policy_before_it_waits():
    rejoin, states = _rejoin(_policy(took_ms=LIGHT_LOAD, pipelined=False))
    asked: list[list[int]] = []
    ask = lambda coming: asked.append(coming) or False  # noqa: E731
    assert rejoin.window_ms(states, False, ask) == 0.0
    assert asked == [[50, 50]]  # the clients that may come back, not the one that left
    assert rejoin.window_ms(states, False, lambda coming: True) == 2.0  # where it pays: the window


def test_an_idle_pipelined_lane_waits_only_for_clients_measured_to_come_back_within_the_window():
    rejoin, states = _rejoin(_policy(took_ms=LIGHT_LOAD))  # 30-45 ms: none within any window
    assert rejoin.window_ms(states, False, _never_asked) == 0.0
    rejoin, states = _rejoin(_policy(turnaround_ms=4.0))  # a loaded machine's 4 ms: the window
    assert rejoin.window_ms(states, False, _never_asked) == pytest.approx(5.0)
    rejoin, states = _rejoin(_policy(turnaround_ms=4.0, mode="pipeline"))
    assert rejoin.window_ms(states, False, _never_asked) == 0.0


def test_a_pipelined_lane_told_to_wait_waits_the_window_without_asking_again():
    rejoin, states = _rejoin(_policy(turnaround_ms=4.0, pipelined=False))  # (the told state is the same)
    rejoin.told_to_wait()
    assert rejoin.window_ms(states, False, _never_asked) == pytest.approx(5.0)
    assert rejoin.window_ms(states, False, lambda coming: False) == 0.0  # told once, for one plan


def test_a_busy_pipelined_lane_waits_for_answered_clients_only_where_they_come_back_in_time():
    rejoin, states = _rejoin(_policy(turnaround_ms=1.2))
    assert rejoin.window_ms(states, True, _never_asked) == 2.0  # back within rejoin_ms
    rejoin, states = _rejoin(_policy(took_ms=LIGHT_LOAD))
    assert rejoin.window_ms(states, True, _never_asked) == 0.0  # measured: none back in time
    rejoin, states = _rejoin(DispatchPolicy("auto", rejoin_ms=2.0, pipelined=True))
    assert rejoin.window_ms(states, True, _never_asked) == 2.0  # unmeasured: as before


def test_dispatch_pipeline_never_waits_for_answered_clients():
    rejoin, states = _rejoin(_policy(turnaround_ms=1.2, mode="pipeline"))
    rejoin.told_to_wait()  # (never told under "pipeline"; even so)
    assert rejoin.window_ms(states, True, _never_asked) == 0.0
    assert rejoin.window_ms(states, False, lambda coming: rejoin.policy.should_wait(
        np.array([50]), np.array([0]), coming, MODERN, _all_rows)) == 0.0  # fmt: skip
    rejoin, states = _rejoin(_policy(took_ms=LIGHT_LOAD, mode="wait"))
    assert rejoin.window_ms(states, True, _never_asked) == 2.0  # "wait" always waits


def test_what_a_lane_waits_on_purpose_is_its_own_and_taken_once():
    rejoin, _ = _rejoin(_policy())
    rejoin.add_waited(3 * MS)
    other = threading.Thread(target=lambda: rejoin.add_waited(7 * MS))
    other.start()
    other.join()
    assert rejoin.take_waited_ns() == 3 * MS and rejoin.take_waited_ns() == 0


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
    assert int(server.segment.header["waited_ns"]) == 0  # nor for the clients of the batch before


def test_a_sequential_lane_with_a_large_fixed_cost_waits_for_its_clients(thread_server, shm_name):
    """The calibrated stand-in's shape: a synchronous device, one sequential lane."""
    decoder = RecordingStandIn(a_ms=20.0, b_ms=0.01)
    server = thread_server(decoder, **SERVER)
    assert not server._pipeline
    waited = np.mean(_serve_equal_lengths(server, decoder, shm_name, batches=60))
    assert server.dispatch_choices[-1].wait and waited > 5.5  # of 8 clients


# -- light load: two clients that take a language model's step between requests ------------------


def _serve_light_load(server, decoder, name: str, batches: int = 90,
                      think: tuple[str, str] = ("30", "45")) -> tuple[int, int]:  # fmt: skip
    """Two closed-loop clients that think 30-45 ms (``think``) between requests; (the header's
    waited_ns once the policy measured them, at ``batches // 3`` batches; at ``batches``)."""
    procs = [subprocess.Popen([sys.executable, CLIENT, name, "50", "50", *think], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    header = server.segment.header
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        deadline = time.monotonic() + 120
        measured = None
        while len(decoder.sizes) < batches:
            assert time.monotonic() < deadline, decoder.sizes
            if measured is None and len(decoder.sizes) >= batches // 3:
                assert server._policy.measured
                measured = int(header["waited_ns"])
            time.sleep(0.01)
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            reap(p)
    return measured, int(header["waited_ns"])


@pytest.mark.parametrize("lane", ["pipelined", "sequential"])
def test_at_light_load_a_lane_stops_waiting_once_it_measured_that_its_clients_come_back_late(
        thread_server, shm_name, lane):  # fmt: skip
    """Two clients that each take 30-45 ms between requests: once measured, no lane holds a
    ready request back for the other client (it would wait the whole window, for nobody). With
    the default rejoin window; the 4 ms stand-in as a GPU (pipelined) and as a synchronous
    device (a sequential lane, a CPU's)."""
    decoder = RecordingStandIn(a_ms=4.0, b_ms=0.006, asynchronous=lane == "pipelined")
    server = thread_server(decoder)
    assert server._pipeline == (lane == "pipelined")
    measured, end = _serve_light_load(server, decoder, shm_name)
    assert end == measured, f"waited {(end - measured) / MS:.1f} ms after measuring"


def test_deliberate_waits_are_counted_apart_from_the_host_gap(thread_server, shm_name):
    """``dispatch="wait"`` with a 60 ms window and clients that take 100-120 ms: a batch waits
    until the other client's request comes or the window ends (25-60 ms a batch measured here,
    the less the more loaded the machine). That is counted as waited, not as host gap (which a
    machine this loaded makes up to ~15 ms a batch)."""
    decoder = RecordingStandIn(a_ms=4.0, b_ms=0.006)
    server = thread_server(decoder, dispatch="wait", rejoin_ms=60.0)
    _serve_light_load(server, decoder, shm_name, batches=40, think=("100", "120"))
    header = server.segment.header
    waited, gap = int(header["waited_ns"]), int(header["host_gap_ns"])
    assert waited > 0.25 * 60 * MS * len(decoder.sizes)
    assert gap < 0.5 * waited, f"host gap {gap / MS:.0f} ms, waited {waited / MS:.0f} ms"
    rows = dict(stats_rows(stats_from_header(header)))  # what ``bicodec-shm stats`` shows
    assert rows["waited on purpose"].startswith(f"{waited / MS:.1f} ms")
