"""The lane count follows what is measured: a planted cost model decides, and ``lanes=`` wins.

Two levels:
- the tuner alone, fed batches whose decode time a planted model gives each arrangement (a
  stepped clock, no threads): it picks the faster, keeps the incumbent within its margin, and follows a
  change of the traffic after its hold;
- a real server with a decoder whose batch cost is planted per lane thread count (it sleeps, so
  the machine's own speed does not enter), fed by closed-loop client processes: it settles on
  the arrangement the model makes faster, whichever that is, and a fixed ``lanes=`` is never
  changed.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from support import reap

from bicodec_shm.protocol.header import stats_from_header
from bicodec_shm.server.lane_tuner import LaneTuner, LaneTuning
from bicodec_shm.server.lanes import lane_threads

CLIENT = str(Path(__file__).with_name("closed_loop_client.py"))


class _Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def __call__(self) -> int:
        return self.ns


def _drive(tuner: LaneTuner, clock: _Clock, machine_ms: dict[int, float], batches: int) -> None:
    """Feed ``batches`` batches of 40 tokens, planned as the clock reads and decoded in
    ``machine_ms[lanes] x lanes`` ms by a lane of the arrangement running then (so that each
    arrangement costs ``machine_ms`` of machine time per batch: the planted model); 50 ms
    between batches."""
    for _ in range(batches):
        lanes = tuner.lanes
        planned = clock.ns
        clock.ns += 50_000_000
        tuner.observe(planned, int(machine_ms[lanes] * lanes * 1e6), 40)


FAST = LaneTuning(min_batches=2, min_seconds=0.1, margin=0.05, hold_seconds=10.0)


@pytest.mark.parametrize("planted, expected", [({1: 80.0, 2: 120.0}, 1), ({1: 120.0, 2: 80.0}, 2)])
def test_the_tuner_picks_what_the_planted_model_makes_faster(planted, expected):
    clock = _Clock()
    tuner = LaneTuner([1, 2], start=2, tuning=FAST, clock=clock)
    _drive(tuner, clock, planted, batches=40)
    final = tuner.history[-1]
    assert final.reason.startswith("chosen")
    assert tuner.lanes == final.lanes == expected
    # The numbers behind the choice are the planted ones: 80 or 120 ms over 40 tokens.
    assert final.scores == pytest.approx({c: planted[c] / 1e3 / 40 for c in planted})
    # A 1.5x difference is decisive: chosen after one window each (2, then 1).
    assert [c.lanes for c in tuner.history[:-1]] == [1]


def test_a_clear_winner_is_chosen_after_one_pass_a_close_one_after_the_mirror_pass():
    clock = _Clock()
    tuner = LaneTuner([1, 2], start=2, tuning=FAST, clock=clock)
    _drive(tuner, clock, {1: 60.0, 2: 100.0}, batches=40)  # 1 lane 40% cheaper: decisive
    assert [c.lanes for c in tuner.history] == [1, 1]  # explore 1, then chosen: no way back to 2
    assert tuner.history[-1].reason.startswith("chosen") and len(tuner._scores[1]) == 1
    clock = _Clock()
    tuner = LaneTuner([1, 2], start=2, tuning=FAST, clock=clock)
    _drive(tuner, clock, {1: 90.0, 2: 100.0}, batches=40)  # 10% cheaper: measured twice each
    chosen = tuner.history[-1]
    assert chosen.lanes == 1 and chosen.reason.startswith("chosen") and len(tuner._scores[1]) == 2


def test_within_the_margin_the_incumbent_stays():
    clock = _Clock()
    tuner = LaneTuner([1, 2], start=2, tuning=FAST, clock=clock)
    _drive(tuner, clock, {1: 97.0, 2: 100.0}, batches=40)  # 1 lane 3% faster: noise
    assert tuner.history[-1].lanes == 2 and tuner.lanes == 2


def test_after_the_hold_it_explores_again_and_follows_the_traffic():
    clock = _Clock()
    tuner = LaneTuner([1, 2], start=2, tuning=FAST, clock=clock)
    _drive(tuner, clock, {1: 80.0, 2: 120.0}, batches=40)
    assert tuner.lanes == 1
    _drive(tuner, clock, {1: 150.0, 2: 90.0}, batches=400)  # 20 s > the 10 s hold
    assert tuner.lanes == 2
    assert [c.lanes for c in tuner.history if c.reason.startswith("chosen")][:2] == [1, 2]


def test_batches_planned_before_a_window_do_not_count_for_it():
    clock = _Clock()
    tuner = LaneTuner([1, 2], start=2, tuning=LaneTuning(min_batches=1, min_seconds=0.0), clock=clock)
    assert tuner.observe(clock.ns - 1, 10**9, 40) is None  # planned before the first window began
    assert tuner._window.batches == 0


def test_bad_tuner_settings_are_refused():
    with pytest.raises(ValueError, match="two or more"):
        LaneTuner([2], start=2)
    with pytest.raises(ValueError, match="not among"):
        LaneTuner([1, 2], start=4)
    with pytest.raises(ValueError, match="margin"):
        LaneTuning(margin=1.5)


class PlantedCostDecoder:
    """Sleeps ``(a + b x rows x longest) / speedup[threads]`` ms per batch, where ``threads`` is
    the calling lane's intra-op thread count: the planted cost model. Records which lane
    thread counts ran batches."""

    device = "cpu"
    config = None

    def __init__(self, a_ms: float, b_ms: float, speedup: dict[int, float]) -> None:
        self.a_ms, self.b_ms, self.speedup = a_ms, b_ms, speedup
        self.threads_seen: list[int | None] = []
        self._lock = threading.Lock()

    def detokenize(self, semantic_ids, global_ids, lengths=None):
        b, t = semantic_ids.shape
        threads = lane_threads()
        with self._lock:
            self.threads_seen.append(threads)
        time.sleep((self.a_ms + self.b_ms * b * t) / self.speedup[threads or 1] / 1000)
        return torch.zeros(b, 320 * t)


@pytest.fixture
def two_cores():
    """The server splits ``torch.get_num_threads()`` cores between lanes; plant two."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _closed_loop_clients(name: str, n: int, tokens: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, CLIENT, name, str(tokens)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]  # fmt: skip
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.stdin.close()
    for p in procs:
        reap(p)


# Wide wins: a large fixed cost that two threads halve; one lane's batch of 4 costs half of
# what each of two lanes' batches of 2 costs -> 1 lane serves 2x. Narrow wins: threads do not
# help, and the per-token cost dominates -> two lanes' batches of 2 in parallel serve ~1.8x.
WIDE_WINS = dict(a_ms=40.0, b_ms=0.0, speedup={1: 1.0, 2: 2.0})
NARROW_WINS = dict(a_ms=5.0, b_ms=0.5, speedup={1: 1.0, 2: 1.0})


@pytest.mark.parametrize("model, expected", [(WIDE_WINS, 1), (NARROW_WINS, 2)], ids=["wide-wins", "narrow-wins"])
def test_the_server_settles_on_the_arrangement_the_planted_model_makes_faster(
        model, expected, thread_server, shm_name, two_cores):  # fmt: skip
    decoder = PlantedCostDecoder(**model)
    server = thread_server(decoder, lane_tuning=LaneTuning(min_batches=6, min_seconds=0.3,
                                                           hold_seconds=600.0))  # fmt: skip
    assert server.lanes == 2 and server.max_lanes == 2
    procs = _closed_loop_clients(shm_name, 4, tokens=20)
    try:
        deadline = time.monotonic() + 60
        while not any(c.reason.startswith("chosen") for c in server.lane_choices):
            assert time.monotonic() < deadline, server.lane_choices
            time.sleep(0.05)
    finally:
        _stop(procs)
    chosen = [c for c in server.lane_choices if c.reason.startswith("chosen")][0]
    assert chosen.lanes == expected, chosen
    assert server.lanes == expected
    assert stats_from_header(server.segment.header)["lanes"] == expected
    assert set(chosen.scores) == {1, 2}
    # Both arrangements really ran: one lane with both cores, two lanes with one each.
    assert {1, 2} <= set(decoder.threads_seen)


def test_a_fixed_lane_count_is_never_changed(thread_server, shm_name, two_cores):
    decoder = PlantedCostDecoder(**WIDE_WINS)  # one lane would be faster
    server = thread_server(decoder, lanes=2, lane_tuning=LaneTuning(min_batches=1, min_seconds=0.0))
    procs = _closed_loop_clients(shm_name, 4, tokens=20)
    try:
        deadline = time.monotonic() + 60
        while len(decoder.threads_seen) < 40:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        _stop(procs)
    assert server.lane_choices == [] and server.lanes == 2
    assert set(decoder.threads_seen) == {1}  # two lanes of one thread each, throughout
