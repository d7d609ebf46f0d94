"""The lane count follows what is measured: a planted cost model decides, and ``lanes=`` wins.

Three levels:
- the tuner alone, fed batches whose decode time a planted model gives each arrangement (a
  stepped clock, no threads): it picks the faster, keeps the incumbent within its margin, and follows a
  change of the traffic after its hold;
- the tuner driving simulated lanes and closed-loop clients (a discrete-event simulation on the
  same clock), with a cost model per thread count and rows: at light load (one client) it keeps
  the arrangement that serves each request soonest, at heavy load the one with the most
  throughput, for the same decoder;
- a real server with a decoder whose batch cost is planted per lane thread count (it sleeps, so
  the machine's own speed does not enter), fed by closed-loop client processes: it settles on
  the arrangement the model makes faster, whichever that is and whatever the load, and a fixed
  ``lanes=`` is never changed.
"""

from __future__ import annotations

import heapq
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support import reap

from bicodec_shm.protocol.header import stats_from_header
from bicodec_shm.server.lane_tuner import BatchMeter, BatchSample, BusyClock, Choice, LaneTuner, LaneTuning
from bicodec_shm.server.lanes import lane_threads

CLIENT = str(Path(__file__).with_name("closed_loop_client.py"))


class _Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def __call__(self) -> int:
        return self.ns


def _drive(tuner: LaneTuner, clock: _Clock, machine_ms: dict[int, float], batches: int) -> None:
    """Heavy load: feed ``batches`` batches of 40 tokens, in rounds in which every lane of the
    arrangement running then decodes one at the same time, each in ``machine_ms[lanes] x lanes``
    ms, so that each batch's share of the busy time is ``machine_ms`` (the planted model),
    planned when the round starts."""
    fed = 0
    while fed < batches:
        lanes = tuner.lanes
        planned = start = clock.ns
        end = start + int(machine_ms[lanes] * lanes * 1e6)
        clock.ns = end
        for _ in range(min(lanes, batches - fed)):
            fed += 1
            sample = BatchSample(planned, start, end, 40, busy_ns=(end - start) // lanes)
            if tuner.observe(sample) is not None:
                break  # the arrangement changed: the rest of the round is another's


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
    # planned before the first window began
    assert tuner.observe(BatchSample(clock.ns - 1, clock.ns, clock.ns + 10**9, 40)) is None
    assert tuner._window.batches == 0


def test_decodes_that_run_at_once_share_the_busy_time_and_the_shares_sum_to_it():
    clock = _Clock()
    busy = BusyClock(clock)
    ms = 1_000_000

    def at(t_ms: float) -> BusyClock:
        clock.ns = 1_000_000_000 + int(t_ms * ms)
        return busy

    a = at(0).begin()  # a alone for 10 ms, beside b for 10 ms, alone for 10 ms
    b = at(10).begin()
    shares = [at(20).end(b), at(30).end(a)]
    assert shares == [5 * ms, 25 * ms]
    c = at(40).begin()  # then, after an idle gap: c alone (the gap is nobody's)
    shares.append(at(45).end(c))
    assert shares[-1] == 5 * ms
    d, e, f = at(50).begin(), busy.begin(), busy.begin()  # three at once for 30 ms, then d alone
    shares += [at(80).end(e), busy.end(f), at(90).end(d)]
    assert shares[-3:] == [10 * ms, 10 * ms, 20 * ms]
    assert sum(shares) == (30 + 5 + 40) * ms  # the time at least one ran


# -- a simulated server: lanes, closed-loop clients and the tuner on one clock -------------------

# The CPU this project's benchmarks ran on: two 1-thread lanes decode 1.24x what one 2-thread
# lane does (benchmarks/RESULTS.md), so two threads make one decode 2 / 1.24 = 1.61x faster.
# Per padded token at one thread, with a small fixed cost: a 25-token request takes 103 ms on
# one thread and 64 ms on two.
RESULTS_CPU = dict(a_ms=3.0, b_ms=4.0, speedup={1: 1.0, 2: 1.61})


def _planted_ms(model: dict, threads: int, rows: int, longest: int) -> float:
    return (model["a_ms"] + model["b_ms"] * rows * longest) / model["speedup"][threads]


def _simulate(tuner: LaneTuner, clock: _Clock, cost_ms: Callable[[int, int, int], float], *,
              clients: int, tokens: int, requests: int, max_batch: int, cores: int = 2,
              turnaround_ms: float = 0.5) -> list[float]:  # fmt: skip
    """Serve ``requests`` requests of ``tokens`` tokens from ``clients`` closed-loop clients
    (each sends its next ``turnaround_ms`` after its answer) with ``tuner.lanes`` lanes of
    ``cores // lanes`` threads: a free lane that is not parked takes the oldest waiting requests
    (up to ``max_batch``) and decodes them in ``cost_ms(threads, rows, tokens)`` ms; each decoded
    batch goes to the tuner, measured as the server measures it (``BatchMeter``). Events of one
    instant are taken together before any lane plans. Returns every request's latency (ms), in
    order."""
    ms = 1_000_000
    meter = BatchMeter(clock)  # the server's: each batch's share of the time lanes were busy
    events: list[tuple[int, int, str, object]] = []  # (time, order, kind, what)
    order = iter(range(10**9))
    for c in range(clients):
        heapq.heappush(events, (clock.ns, next(order), "send", c))
    waiting: list[tuple[int, int]] = []  # (client, sent at)
    busy: set[int] = set()
    latencies: list[float] = []
    sent = 0
    while events and len(latencies) < requests:
        clock.ns = events[0][0]
        while events and events[0][0] == clock.ns:
            _, _, kind, what = heapq.heappop(events)
            if kind == "send":
                if sent < requests:
                    sent += 1
                    waiting.append((what, clock.ns))
                continue
            lane, batch, planned, key, queued = what  # a batch is done
            busy.discard(lane)
            tuner.observe(meter.end(key, planned_ns=planned, tokens=tokens * len(batch), rows=len(batch),
                                    padded_tokens=tokens * len(batch), queued=queued))  # fmt: skip
            for client, sent_at in batch:
                latencies.append((clock.ns - sent_at) / ms)
                heapq.heappush(events, (clock.ns + int(turnaround_ms * ms), next(order), "send", client))
        for lane in range(tuner.lanes):  # the lanes not parked now, as the server's turns
            if waiting and lane not in busy:
                queued = len(waiting)  # the requests this plan finds (the server's Batch.queued)
                batch, waiting = waiting[:max_batch], waiting[max_batch:]
                busy.add(lane)
                took = int(cost_ms(cores // tuner.lanes, len(batch), tokens) * ms)
                key = next(order)
                meter.begin(key)
                what = (lane, batch, clock.ns, key, queued)
                heapq.heappush(events, (clock.ns + took, next(order), "done", what))
    return latencies


@pytest.mark.parametrize("clients, expected", [(1, 1), (8, 2)], ids=["light-1-client", "heavy-8-clients"])
def test_the_tuner_keeps_what_serves_the_load_it_sees(clients, expected):
    """One decoder, two loads (batches of at most 4). With one client sending one request at a
    time, two lanes take turns and each request waits a one-thread decode (103 ms): one
    two-thread lane (64 ms) wins. With eight, both lanes are busy at once and two batches of 4 in
    parallel deliver 1.24x what one lane's batches of 4 on two threads do: two lanes win."""
    clock = _Clock()
    tuner = LaneTuner([1, 2], start=2, tuning=LaneTuning(min_batches=4, min_seconds=1.0, hold_seconds=600),
                      clock=clock)  # fmt: skip

    def cost(threads: int, rows: int, longest: int) -> float:
        return _planted_ms(RESULTS_CPU, threads, rows, longest)

    latencies = _simulate(tuner, clock, cost, clients=clients, tokens=25, requests=400 * clients, max_batch=4)
    chosen = [c for c in tuner.history if c.reason.startswith("chosen")]
    assert chosen and chosen[0].lanes == expected, tuner.history
    assert tuner.lanes == expected
    settled = latencies[-50 * clients:]  # after the choice: what the traffic gets now
    if clients == 1:
        # one request at a time, each decoded on two threads: 64 ms (+ nothing: no queue)
        assert sum(settled) / len(settled) == pytest.approx(cost(2, 1, 25), rel=0.01)
        assert chosen[0].scores[2] / chosen[0].scores[1] == pytest.approx(1.61, rel=0.01)
    else:
        # both lanes decode a batch of 4 on one thread at once: 3 + 4 x 100 ms each round
        assert max(settled) == pytest.approx(cost(1, 4, 25), rel=0.01)
        # per token: one lane 250 ms / 100, two lanes 403 ms / 200
        assert chosen[0].scores[1] / chosen[0].scores[2] == pytest.approx(1.24, rel=0.01)


# -- a fresh tuner starts from the load's prediction -------------------------------------------

START = LaneTuning(min_batches=4, min_seconds=0.5, first_hold_seconds=30.0, hold_seconds=600.0)


def _light_cost(threads: int, rows: int, longest: int) -> float:
    return _planted_ms(RESULTS_CPU, threads, rows, longest)


@pytest.mark.parametrize("start", [1, 2], ids=["read-on-one-lane", "read-on-two-lanes"])
def test_one_request_at_a_time_starts_and_stays_at_one_lane_without_trying_narrow_lanes(start):
    """One client: the first 4 batches (the reading) each ran alone with one row; then one
    two-thread lane serves every request, and nothing is explored for the first hold (30 s;
    200 requests of 64 ms are 13 s). Read on one lane of two threads (the server's start), the
    reading costs the client nothing; read on two lanes of one thread, its 4 requests the
    one-thread decode."""
    clock = _Clock()
    tuner = LaneTuner([1, 2], start=start, tuning=START, clock=clock, predict=True)
    assert tuner.lanes == start and tuner.exploring
    latencies = _simulate(tuner, clock, _light_cost, clients=1, tokens=25, requests=200, max_batch=4)
    assert [(c.lanes, c.reason.split(":")[0]) for c in tuner.history] == [(1, "predicted from the load")]
    assert tuner.lanes == 1 and not tuner.exploring
    reading = _light_cost(2 // start, 1, 25)
    assert latencies[:4] == pytest.approx([reading] * 4, rel=0.01)
    assert latencies[4:] == pytest.approx([_light_cost(2, 1, 25)] * 196, rel=0.01)


@pytest.mark.parametrize("clients, max_batch, start", [(8, 4, 2), (2, 1, 2), (8, 4, 1), (2, 1, 1)],
                         ids=["batches-of-4", "one-row-side-by-side", "batches-of-4-on-one-lane",
                              "one-row-queued-on-one-lane"])  # fmt: skip
def test_concurrent_requests_start_at_the_most_lanes_after_one_batch(clients, max_batch, start):
    """Several clients: the first batch already shows more than one request decoding at once
    (batches of 4; or single rows that two lanes decode side by side), or, read on one lane,
    more than one waiting when it was planned (single rows queued behind each other), so the
    most lanes are predicted at once and hold."""
    clock = _Clock()
    tuner = LaneTuner([1, 2], start=start, tuning=START, clock=clock, predict=True)
    _simulate(tuner, clock, _light_cost, clients=clients, tokens=25, requests=50 * clients,
              max_batch=max_batch)
    assert [(c.lanes, c.reason.split(":")[0]) for c in tuner.history] == [(2, "predicted from the load")]
    assert tuner.lanes == 2 and float(tuner.history[0].reason.split("up to ")[1].split()[0]) >= 2


def test_the_start_reads_the_load_then_predicts_one_lane_or_all_of_them():
    """Planted batches, four cores, read at four lanes and at two (the server's): four one-row
    batches alone predict one lane (after the fourth); two side by side (each half of its
    decode) predict four, after the first."""
    clock = _Clock()
    alone = LaneTuner([1, 2, 4], start=4, tuning=START, clock=clock, predict=True)
    assert alone.lanes == 4
    for k in range(4):
        start = clock.ns
        clock.ns += 100_000_000
        choice = alone.observe(BatchSample(start, start, clock.ns, 25))
        assert (choice is None) == (k < 3) and alone.lanes == (4 if k < 3 else 1)
    assert choice.lanes == 1 and choice.reason.startswith("predicted")
    side = LaneTuner([1, 2, 4], start=2, tuning=START, clock=clock, predict=True)
    start = clock.ns
    clock.ns += 100_000_000
    choice = side.observe(BatchSample(start, start, clock.ns, 25, busy_ns=50_000_000))
    assert choice is not None and choice.lanes == side.lanes == 4 and choice.reason.startswith("predicted")
    assert [c.lanes for c in side.history] == [4] and not side.exploring


@pytest.mark.parametrize("decode_ms, expected", [(100, 2), (300, 4)], ids=["short-batches", "long-batches"])
def test_load_predicts_lanes_that_share_the_cores_only_behind_long_batches(decode_ms, expected):
    """Two cores, lanes 1, 2 and 4, read on one lane: a first batch with three requests waiting
    predicts two lanes (one a core) behind short batches, four (two a core) behind batches of
    LONG_BATCH_S or more, where a request would otherwise wait for one to end."""
    clock = _Clock()
    tuner = LaneTuner([1, 2, 4], start=1, tuning=START, clock=clock, predict=True, cores=2)
    start = clock.ns
    clock.ns += decode_ms * 1_000_000
    choice = tuner.observe(BatchSample(start, start, clock.ns, 25, queued=3))
    assert choice is not None and choice.lanes == tuner.lanes == expected, choice
    assert choice.reason.startswith("predicted") and f"batches up to {decode_ms} ms" in choice.reason


def test_a_long_batch_in_the_first_hold_turns_lanes_of_a_core_each_into_the_most():
    """Loaded with short batches, two lanes hold; a long batch alone changes nothing (no sign of
    load); the first long batch under load (a stream's later, longer window) turns them into
    four at once; short and lone batches after it change nothing."""
    clock = _Clock()
    tuner = LaneTuner([1, 2, 4], start=1, tuning=START, clock=clock, predict=True, cores=2)

    def batch(ms: int, queued: int = 1, rows: int = 1) -> Choice | None:
        start = clock.ns
        clock.ns += ms * 1_000_000
        return tuner.observe(BatchSample(start, start, clock.ns, 25 * rows, rows=rows, queued=queued))

    assert batch(50, queued=2).lanes == 2
    for _ in range(5):
        assert batch(50, rows=2) is None
    assert batch(400) is None and tuner.lanes == 2  # one request alone: no load to share the cores for
    choice = batch(400, queued=2)
    assert choice is not None and choice.lanes == tuner.lanes == 4 and choice.reason.startswith("predicted")
    for _ in range(5):
        assert batch(50) is None
    assert tuner.lanes == 4 and not tuner.exploring and [c.lanes for c in tuner.history] == [2, 4]


def test_later_load_turns_a_prediction_of_one_lane_into_the_most_lanes_at_once():
    """One client first (one lane predicted), then more: the first batch of three rows ends
    the one lane at once, before the first hold's end; then the most lanes hold, and lone
    batches among theirs change nothing."""
    clock = _Clock()
    tuner = LaneTuner([1, 2, 4], start=4, tuning=START, clock=clock, predict=True)

    def batch(rows: int, share: float = 1.0) -> Choice | None:
        start = clock.ns
        clock.ns += 100_000_000
        return tuner.observe(BatchSample(start, start, clock.ns, 25 * rows, rows=rows,
                                         busy_ns=int(100_000_000 * share)))  # fmt: skip

    for _ in range(4 + 10):
        batch(1)
    assert tuner.lanes == 1 and len(tuner.history) == 1
    choice = batch(3)
    assert choice is not None and choice.lanes == tuner.lanes == 4 and choice.reason.startswith("predicted")
    for _ in range(10):
        assert batch(1) is None
    assert tuner.lanes == 4 and not tuner.exploring and clock.ns - 10**9 < START.first_hold_seconds * 1e9


def test_a_prediction_is_measured_after_its_first_hold_and_replaced_when_slower():
    """Heavy load predicts two lanes; the planted model makes one faster. Nothing changes for
    the first hold (5 s); then the exploration from two measures both and chooses one; and a
    later change of the traffic is followed after the ordinary hold, as ever."""
    clock = _Clock()
    tuning = LaneTuning(min_batches=2, min_seconds=0.1, first_hold_seconds=5.0, hold_seconds=10.0)
    tuner = LaneTuner([1, 2], start=2, tuning=tuning, clock=clock, predict=True)
    began = clock.ns
    _drive(tuner, clock, {1: 80.0, 2: 120.0}, batches=2)
    assert [c.lanes for c in tuner.history] == [2] and tuner.history[0].reason.startswith("predicted")
    _drive(tuner, clock, {1: 80.0, 2: 120.0}, batches=18)  # 18 batches of 120 ms: 2.2 s
    assert tuner.lanes == 2 and len(tuner.history) == 1 and clock.ns - began < 5e9
    _drive(tuner, clock, {1: 80.0, 2: 120.0}, batches=100)
    chosen = [c for c in tuner.history if c.reason.startswith("chosen")]
    assert chosen[0].lanes == 1 and set(chosen[0].scores) == {1, 2} and tuner.lanes == 1
    _drive(tuner, clock, {1: 150.0, 2: 90.0}, batches=400)
    assert tuner.lanes == 2
    assert [c.lanes for c in tuner.history if c.reason.startswith("chosen")][:2] == [1, 2]


@pytest.mark.parametrize("clients, max_batch, expected", [(1, 16, 1), (4, 16, 2), (4, 1, 2)],
                         ids=["one-client", "four-clients", "four-clients-one-row-batches"])  # fmt: skip
def test_a_fresh_server_starts_from_the_load_without_exploring(clients, max_batch, expected, thread_server,
                                                               shm_name, two_cores):  # fmt: skip
    """A real server, closed-loop client processes: one client keeps the one two-thread lane
    the load is read on, four get two one-thread lanes (the most that do not share a core:
    their batches are short) within their first batches; neither explores during the first
    hold. With batches of one row the load shows only as requests waiting when a batch is
    planned."""
    decoder = PlantedCostDecoder(**LIGHT_LOAD)
    server = thread_server(decoder, max_batch=max_batch,
                           lane_tuning=LaneTuning(min_batches=4, min_seconds=0.3,
                                                  first_hold_seconds=600.0))  # fmt: skip
    assert server.lanes == 1  # the load is read on one lane with both cores
    procs = _closed_loop_clients(shm_name, clients, tokens=20)
    try:
        deadline = time.monotonic() + 60
        while len(decoder.threads_seen) < 60:
            assert time.monotonic() < deadline, server.lane_choices
            time.sleep(0.05)
    finally:
        _stop(procs)
    choices = [(c.lanes, c.reason.split(":")[0]) for c in server.lane_choices]
    assert choices == [(expected, "predicted from the load")]
    assert server.lanes == expected and stats_from_header(server.segment.header)["lanes"] == expected
    threads = decoder.threads_seen
    # The load is read on one lane with both cores: one client's every batch has both (the
    # reading costs it nothing); four clients' first batch or two (until a plan finds more
    # than one request waiting and that batch ends), then one thread for each of two lanes.
    if expected == 1:
        assert set(threads) == {2}, threads[:10]
    else:
        switched = threads.index(1)
        assert switched in (1, 2, 3) and set(threads[:switched]) == {2}, threads[:10]
        assert set(threads[switched:]) == {1}, threads[:20]


def test_bad_tuner_settings_are_refused():
    with pytest.raises(ValueError, match="two or more"):
        LaneTuner([2], start=2)
    with pytest.raises(ValueError, match="not among"):
        LaneTuner([1, 2], start=4)
    with pytest.raises(ValueError, match="margin"):
        LaneTuning(margin=1.5)
    with pytest.raises(ValueError, match="bad lane tuning"):
        LaneTuning(first_hold_seconds=-1.0)


class PlantedCostDecoder:
    """Takes ``(a + b x rows x longest) / speedup[threads]`` ms of a core's time per batch, where
    ``threads`` is the calling lane's intra-op thread count: the planted cost model. Decodes
    share ``cores`` as a CPU does: while their threads together outnumber the cores, each
    progresses at cores / threads running (four one-thread lanes on two cores each take twice
    as long), so that more lanes than cores cost what they would. Records which lane thread
    counts ran batches."""

    device = "cpu"
    config = None

    def __init__(self, a_ms: float, b_ms: float, speedup: dict[int, float], cores: int = 2) -> None:
        self.a_ms, self.b_ms, self.speedup, self.cores = a_ms, b_ms, speedup, cores
        self.threads_seen: list[int | None] = []
        self._lock = threading.Lock()
        self._threads_running = 0

    def detokenize(self, semantic_ids, global_ids, lengths=None):
        b, t = semantic_ids.shape
        threads = lane_threads() or 1
        with self._lock:
            self.threads_seen.append(threads)
            self._threads_running += threads
        try:
            self._share_the_cores((self.a_ms + self.b_ms * b * t) / self.speedup[threads])
        finally:
            with self._lock:
                self._threads_running -= threads
        return torch.zeros(b, 320 * t)

    def _share_the_cores(self, work_ms: float) -> None:
        done, last = 0.0, time.monotonic()
        while done < work_ms:
            time.sleep(min(0.5, work_ms - done) / 1000)
            now = time.monotonic()
            with self._lock:
                rate = min(1.0, self.cores / self._threads_running)
            done += (now - last) * 1000 * rate
            last = now


@pytest.fixture
def two_cores():
    """The server splits ``torch.get_num_threads()`` cores between lanes; plant two."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _closed_loop_clients(name: str, n: int, tokens: int) -> list[subprocess.Popen]:
    """``n`` closed-loop client processes, started together once all are attached: the tuner's
    windows then measure the load of ``n`` clients, not the ramp of their start-up."""
    procs = [subprocess.Popen([sys.executable, CLIENT, name, str(tokens)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]  # fmt: skip
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.stdin.close()
    for p in procs:
        reap(p)


def _decode_batches(name: str, decoder: PlantedCostDecoder, *, clients: int, tokens: int,
                    batches: int) -> None:
    """Run ``clients`` closed-loop clients until ``decoder`` has decoded ``batches`` batches."""
    procs = _closed_loop_clients(name, clients, tokens=tokens)
    try:
        deadline = time.monotonic() + 60
        while len(decoder.threads_seen) < batches:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        _stop(procs)


# Wide wins: a large fixed cost that two threads halve; one lane's batch of 4 costs half of
# what each of two lanes' batches of 2 costs -> 1 lane serves 2x. Narrow wins: threads do not
# help, and the per-token cost dominates -> two lanes' batches of 2 in parallel serve ~1.8x,
# and four lanes' batches of 1, two to a core (each twice as long), ~1.5x: two lanes win.
WIDE_WINS = dict(a_ms=40.0, b_ms=0.0, speedup={1: 1.0, 2: 2.0})
NARROW_WINS = dict(a_ms=5.0, b_ms=0.5, speedup={1: 1.0, 2: 1.0})
# This project's CPU (RESULTS_CPU above), faster: a 20-token request takes 42 ms on one thread,
# 26 ms on two. With one client sending one request at a time the two lanes take turns: one
# lane of two threads serves each request 1.61x sooner.
LIGHT_LOAD = dict(a_ms=2.0, b_ms=2.0, speedup={1: 1.0, 2: 1.61})


@pytest.mark.parametrize("model, clients, expected",
                         [(WIDE_WINS, 4, 1), (NARROW_WINS, 4, 2), (LIGHT_LOAD, 1, 1)],
                         ids=["wide-wins", "narrow-wins", "one-client-wide-wins"])  # fmt: skip
def test_the_server_settles_on_the_arrangement_the_planted_model_makes_faster(
        model, clients, expected, thread_server, shm_name, two_cores):  # fmt: skip
    decoder = PlantedCostDecoder(**model)
    server = thread_server(decoder, lane_tuning=LaneTuning(min_batches=6, min_seconds=0.3, hold_seconds=600.0,
                                                           first_hold_seconds=0.0))  # fmt: skip
    assert server.lanes == 1 and server.max_lanes == 4  # read on one; up to two lanes per core
    procs = _closed_loop_clients(shm_name, clients, tokens=20)
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
    assert set(chosen.scores) == {1, 2, 4}
    # Each arrangement really ran: one lane with both cores, two or four lanes with one each.
    assert {1, 2} <= set(decoder.threads_seen)


def test_a_fixed_lane_count_is_never_changed(thread_server, shm_name, two_cores):
    decoder = PlantedCostDecoder(**WIDE_WINS)  # one lane would be faster
    server = thread_server(decoder, lanes=2, lane_tuning=LaneTuning(min_batches=1, min_seconds=0.0))
    _decode_batches(shm_name, decoder, clients=4, tokens=20, batches=40)
    assert server.lane_choices == [] and server.lanes == 2
    assert set(decoder.threads_seen) == {1}  # two lanes of one thread each, throughout


# --- a lone request of a few milliseconds on one thread (lane_control.ONE_THREAD_BELOW_NS) ----

# Planted: a 10-token request takes ~0.8 ms on one thread and ~0.7 ms on two (under the bound),
# or 26 ms on two (over it: LIGHT_LOAD).
FEW_MS = dict(a_ms=0.3, b_ms=0.05, speedup={1: 1.0, 2: 1.2})


@pytest.mark.parametrize("model, threads", [(FEW_MS, {1}), (LIGHT_LOAD, {2})], ids=["few-ms", "26-ms"])
def test_a_lone_clients_few_millisecond_requests_run_on_one_thread_and_long_ones_on_every_core(
        model, threads, thread_server, shm_name, two_cores):  # fmt: skip
    """One client, one request at a time, a lone lane of two threads: once three of its
    requests are measured on the lane's two threads, a request planted under 10 ms runs on one
    thread from then on, one planted over it on both, throughout."""
    decoder = PlantedCostDecoder(**model)
    server = thread_server(decoder, lanes=1)
    assert server.threads_per_lane == 2
    _decode_batches(shm_name, decoder, clients=1, tokens=10, batches=24)
    assert set(decoder.threads_seen[:3]) == {2}  # measured on the lane's threads first
    assert set(decoder.threads_seen[8:]) == threads, decoder.threads_seen


def _one_thread_pays(rows: int = 1, queued: int = 1, lone_ms: float | None = 3.0, frames: int = 5, *,
                     pipelined: bool = False, encode: bool = False, on_one: bool = False) -> bool:
    from types import SimpleNamespace

    from bicodec_shm.server.batch_costs import BatchCosts
    from bicodec_shm.server.lane_control import LaneControl

    costs = BatchCosts(min_fill=0.5)
    for _ in range(3 if lone_ms is not None else 0):
        costs.add(1 if on_one else lane_threads(), 1, frames, frames, int(lone_ms * 1e6))  # a lone row's
    control = LaneControl(1, cores=2, tunable=False, pipelined=pipelined, tuning=None,
                          on_change=lambda lanes: None)  # fmt: skip
    batch = SimpleNamespace(requests=list(range(rows)), queued=queued, frames=frames,
                            audio=object() if encode else None)  # fmt: skip
    return control.one_thread_pays(batch, costs)


def test_only_a_lone_measured_short_decode_drops_to_one_thread():
    assert _one_thread_pays()
    assert not _one_thread_pays(lone_ms=12.0)  # measured over the bound
    assert not _one_thread_pays(lone_ms=None)  # not measured yet
    assert _one_thread_pays(on_one=True)  # measured on one thread only (the lane's aged out)
    assert not _one_thread_pays(on_one=True, lone_ms=12.0)
    assert not _one_thread_pays(rows=2, queued=2)  # a batch: every core
    assert not _one_thread_pays(queued=2)  # another request waits: load, every core
    assert not _one_thread_pays(pipelined=True)  # on a device the lanes set no threads
    assert not _one_thread_pays(encode=True)  # an encode's costs are the encoder's
