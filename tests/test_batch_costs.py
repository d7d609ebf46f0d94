"""Batching only where it pays (server/batch_costs.py): a planted cost model decides, and the
static bounds and ``batching="static"`` win over the measurement.

Three levels:
- the fit alone, on batches timed by a planted model (no clock, no threads);
- the planner fed those fits, on ready requests of mixed lengths: with a large fixed cost every
  row that fits joins, with a small one only near-equal lengths, where an extra row costs more
  than a lone decode none; and it probes so that the measurement goes on;
- a real server whose decoder sleeps what the planted model says a batch costs (so the
  machine's own speed does not enter), fed by closed-loop client processes of mixed lengths.
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
import torch
from support import SteppedDecoder, join_within, reap, seeded_request, single_decode, submitted_requests

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.server.batch_costs import (
    LATENCY_FACTOR,
    MIN_SAMPLES,
    PROBE_EVERY,
    BatchCosts,
    BatchPlanner,
    CostFit,
    fit_costs,
)
from bicodec_shm.server.batching import plan_batch

CLIENT = str(Path(__file__).with_name("closed_loop_client.py"))
MS = 1e6

# A GPU: 4 ms a batch, 6 us a padded token, an extra row nearly free.
DEVICE = CostFit(4 * MS, 0.006 * MS, 0.0, 0.0, 0.006 * MS)
# This project's CPU on BiCodec (benchmarks/RESULTS.md, bench_model): ~108 ms fixed, ~14 ms a
# token; an extra row saves most of the fixed cost, so padding of up to ~7 tokens pays.
CPU_BICODEC = CostFit(108 * MS, 14 * MS, 0.0, 9 * MS, 14 * MS)
# SNAC on that CPU: an extra row costs more per token than a lone decode (1.4-1.7x at B = 2).
CPU_SNAC = CostFit(60 * MS, 20 * MS, 0.0, 60 * MS, 30 * MS)
# Tiny SNAC's stream windows on that CPU, one thread a lane (a server's log at 16 Orpheus
# streams: "a row alone 16.7 ms + 0 ms/token; each extra row 13.9 ms + 0 ms/padded token"):
# every extra row pays, whatever its padding, and costs nearly a lone decode of its own.
CPU_WINDOWS = CostFit(16 * MS, 0.5 * MS, 0.0, 13 * MS, 0.0)


def _samples(model: CostFit, n: int = 60, seed: int = 0, noise: float = 0.0):
    rng = np.random.default_rng(seed)
    rows = rng.integers(1, 6, n)
    longest = rng.integers(20, 300, n)
    ns = np.array([model.batch_ns(r, t) for r, t in zip(rows, longest)])
    return rows, longest, ns * rng.normal(1.0, noise, n) if noise else ns


def _fed(model: CostFit, key=1, n: int = 40) -> BatchCosts:
    costs = BatchCosts(min_fill=0.5, refit_seconds=0.0)
    for rows, longest, ns in zip(*_samples(model, n)):
        costs.add(key, int(rows), int(longest), int(rows * longest), int(ns))
    return costs


@pytest.mark.parametrize("model", [DEVICE, CPU_BICODEC, CPU_SNAC], ids=["device", "cpu-bicodec", "cpu-snac"])
def test_the_fit_recovers_the_planted_costs(model):
    fit = fit_costs(*_samples(model))
    for rows, longest in [(1, 25), (1, 300), (2, 50), (4, 100), (8, 40)]:
        assert fit.batch_ns(rows, longest) == pytest.approx(model.batch_ns(rows, longest), rel=1e-3)
    noisy = fit_costs(*_samples(model, n=96, noise=0.05))  # 5 % noise on every timing
    for rows, longest in [(1, 40), (2, 40), (4, 120)]:
        assert noisy.batch_ns(rows, longest) == pytest.approx(model.batch_ns(rows, longest), rel=0.08)


def test_the_join_rule_follows_the_fixed_cost_and_the_padding():
    assert DEVICE.join_pays(1, 50, 50) and DEVICE.join_pays(1, 300, 25)  # any padding pays
    assert DEVICE.padding_that_pays(50) == 49
    assert CPU_BICODEC.join_pays(1, 50, 50)  # equal lengths: the saved 99 ms
    assert CPU_BICODEC.join_pays(1, 50, 44) and not CPU_BICODEC.join_pays(1, 50, 42)
    assert CPU_BICODEC.padding_that_pays(50) == 7  # 99 ms / 14 ms a token
    assert not CPU_SNAC.join_pays(1, 20, 20) and CPU_SNAC.padding_that_pays(20) == -1


def _ready(lengths):
    lengths = np.asarray(lengths, np.int64)
    return lengths, np.arange(len(lengths), dtype=np.int64)  # the first is the oldest


def _planner(model: CostFit | None, **kw) -> BatchPlanner:
    planner = BatchPlanner(max_batch=kw.pop("max_batch", 16),
                           max_batch_tokens=kw.pop("max_batch_tokens", None), min_fill=0.5,
                           measured=kw.pop("measured", True), prior_batches=False,
                           latency_bound=kw.pop("latency_bound", False))  # fmt: skip
    if model is not None:
        planner.costs = _fed(model)
    return planner


READY = [50, 48, 30, 50, 26, 45, 90, 50]


def test_with_a_large_fixed_cost_every_row_the_static_bounds_admit_joins():
    lengths, seen = _ready(READY)
    chosen = _planner(DEVICE).plan(lengths, seen, key=1)
    static = plan_batch(lengths, seen, max_batch=16, max_batch_tokens=None, min_fill=0.5)
    assert sorted(chosen.tolist()) == sorted(static.tolist()) and len(chosen) == 7  # all but the 90


def test_with_a_small_fixed_cost_only_near_equal_lengths_join():
    lengths, seen = _ready(READY)
    chosen = _planner(CPU_BICODEC).plan(lengths, seen, key=1)
    assert sorted(lengths[chosen].tolist()) == [45, 48, 50, 50, 50]  # within 7 tokens of 50


def test_where_an_extra_row_costs_more_than_a_lone_decode_rows_go_alone():
    lengths, seen = _ready(READY)
    chosen = _planner(CPU_SNAC).plan(lengths, seen, key=1)
    assert chosen.tolist() == [0]  # the oldest, alone


def test_a_cpu_lanes_batch_takes_at_most_twice_its_most_urgent_rows_lone_decode():
    """Where every extra row pays but costs nearly a lone decode (a CPU), every row of a big
    batch would wait for all of it: 8 windows of 7 frames would take 110 ms against 19.5 alone."""
    lengths, due = _ready([7, 7, 6, 7, 7, 7, 6, 7])
    assert _fed(CPU_WINDOWS).mode(1) == "on"  # batching pays, any padding: every row that fits
    assert len(_planner(CPU_WINDOWS).plan(lengths, due, key=1)) == 8  # so without the bound: all
    bounded = _planner(CPU_WINDOWS, latency_bound=True)
    chosen = bounded.plan(lengths, due, key=1)
    assert len(chosen) == 2 and 0 in chosen.tolist()  # the one due soonest, and one more
    assert CPU_WINDOWS.batch_ns(2, 7) <= LATENCY_FACTOR * CPU_WINDOWS.lone_ns(7) < CPU_WINDOWS.batch_ns(3, 7)
    urgent = np.array([5, 4, 3, 2, 1, 0, 6, 7])  # the sixth row is due soonest now
    assert 5 in bounded.plan(lengths, urgent, key=1).tolist()
    # The bound is the most urgent row's: a 24-frame row alone takes 28 ms, so its batch may take
    # 56 (three rows, 54 ms); a 14-frame row's bound (46 ms) would take two (41 ms).
    long_first, long_due = _ready([24, 14, 14, 14, 14, 14])
    chosen = bounded.plan(long_first, long_due, key=1)
    assert len(chosen) == 3 and 0 in chosen.tolist()
    assert len(bounded.predict(lengths, due, fit=CPU_WINDOWS, key=1)) == 2  # the policy's forecast too


def test_the_latency_bound_leaves_a_device_batching_every_row_that_pays():
    lengths, seen = _ready(READY)
    chosen = _planner(DEVICE, latency_bound=True).plan(lengths, seen, key=1)
    assert len(chosen) == 7  # a batch costs little more than a row there: as without the bound


def test_a_cpu_server_bounds_its_batches_and_a_device_shaped_one_does_not(thread_server):
    from support import reference_model

    from bicodec_shm.protocol.names import random_name, unlink_all
    from bicodec_shm.server.server import DecoderServer
    from bicodec_shm.tools.bench.standin import StandInDecoder

    assert thread_server(reference_model())._planner.latency_bound
    device_name = random_name("bcshm-test")
    try:
        with DecoderServer(StandInDecoder(), device_name) as device:
            assert not device._planner.latency_bound
    finally:
        unlink_all(device_name)


def test_static_batching_and_the_bounds_win_over_the_measurement():
    lengths, seen = _ready(READY)
    static = plan_batch(lengths, seen, max_batch=16, max_batch_tokens=None, min_fill=0.5)
    unmeasured = _planner(CPU_SNAC, measured=False)  # batching="static"
    assert unmeasured.plan(lengths, seen, key=1).tolist() == static.tolist()
    capped = _planner(DEVICE, max_batch=3)  # --max-batch 3: batching pays, still 3 rows
    assert len(capped.plan(lengths, seen, key=1)) == 3
    budget = _planner(DEVICE, max_batch_tokens=150)  # the token budget holds too
    chosen = budget.plan(lengths, seen, key=1)
    assert len(chosen) * lengths[chosen].max() <= 150
    assert len(_planner(DEVICE).plan(lengths, seen, key=1, max_rows=2)) == 2  # a lane's share


def test_before_any_fit_a_cpu_decodes_alone_and_probes_every_other_plan():
    lengths, seen = _ready(READY)
    planner = _planner(None)
    sizes = [len(planner.plan(lengths, seen, key=1)) for _ in range(6)]
    assert sizes == [2, 1, 2, 1, 2, 1]  # probe, lone, probe, ...
    device = BatchPlanner(max_batch=16, max_batch_tokens=None, min_fill=0.5, measured=True,
                          prior_batches=True)  # fmt: skip
    assert len(device.plan(lengths, seen, key=None)) == 7  # a device batches as the static policy


def test_when_nothing_pays_a_probe_still_comes_every_probe_every_batches():
    lengths, seen = _ready(READY)
    planner = _planner(CPU_SNAC)
    sizes = []
    for _ in range(2 * PROBE_EVERY + 2):
        chosen = planner.plan(lengths, seen, key=1)
        sizes.append(len(chosen))
        rows, longest = len(chosen), int(lengths[chosen].max())
        planner.costs.add(1, rows, longest, int(lengths[chosen].sum()), int(CPU_SNAC.batch_ns(rows, longest)))
    probes = [i for i, n in enumerate(sizes) if n == 2]
    assert 1 <= len(probes) <= 3 and set(sizes) == {1, 2}
    assert all(b - a >= PROBE_EVERY for a, b in zip(probes, probes[1:]))


def test_each_change_of_the_verdict_is_logged_with_its_numbers(caplog):
    costs = BatchCosts(min_fill=0.5, refit_seconds=0.0)
    with caplog.at_level(logging.INFO, logger="bicodec_shm.server.batching"):
        for model, mode in ((CPU_SNAC, "off"), (CPU_BICODEC, "near-equal"), (DEVICE, "on")):
            for rows, longest, ns in zip(*_samples(model, n=300)):  # the windows turn over
                costs.add(2, int(rows), int(longest), int(rows * 40), int(ns))  # 40 tokens a row
            assert costs.mode(2) == costs.history[-1].mode == mode  # the traffic's costs changed
            assert costs.own_fit(2).padding_that_pays(40) == model.padding_that_pays(40)
    assert CPU_BICODEC.padding_that_pays(40) == 7
    assert all(c.key == 2 and c.length == 40 for c in costs.history)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(costs.history)  # every change, and only changes
    first = lines[0]
    assert first.startswith("batching (2 thread(s) a lane) -> decode rows alone: at 40 tokens two rows")
    assert "a row alone 60 ms + 20 ms/token" in first and "each extra row 60 ms + 30 ms/padded token" in first
    assert any("batch only near-equal lengths" in line and "padded by up to" in line for line in lines)
    assert "batch every row that fits" in lines[-1]


def test_a_fit_needs_batches_of_two_row_counts():
    costs = BatchCosts(min_fill=0.5, refit_seconds=0.0)
    for _ in range(2 * MIN_SAMPLES):
        costs.add(1, 4, 50, 200, int(DEVICE.batch_ns(4, 50)))  # always 4 rows: a vs a_r unknown
    assert costs.own_fit(1) is None
    costs.add(1, 1, 50, 50, int(DEVICE.lone_ns(50)))
    for _ in range(3):
        costs.add(1, 4, 50, 200, int(DEVICE.batch_ns(4, 50)))
    assert costs.own_fit(1) is not None


# -- a real server, its decoder sleeping the planted costs ----------------------------------------


class PlantedBatchDecoder:
    """Sleeps ``model.batch_ns(rows, longest)`` per batch (holds no CPU), on either lane; records
    each batch's row count and how many batches ran at once."""

    device = "cpu"
    config = None

    def __init__(self, model: CostFit) -> None:
        self.model = model
        self.rows: list[int] = []
        self.running = self.most_at_once = 0
        self._lock = threading.Lock()

    def detokenize(self, semantic_ids, global_ids, lengths=None):
        b, t = semantic_ids.shape
        with self._lock:
            self.rows.append(b)
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(self.model.batch_ns(b, t) / 1e9)
        with self._lock:
            self.running -= 1
        return torch.zeros(b, 320 * t)


def _clients(name: str, n: int, lo: int, hi: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, CLIENT, name, str(lo), str(hi)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]  # fmt: skip
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


def _run(server, decoder, name: str, batches: int, lo: int, hi: int, clients: int = 6) -> list[int]:
    procs = _clients(name, clients, lo, hi)
    try:
        deadline = time.monotonic() + 90
        while len(decoder.rows) < batches:
            assert time.monotonic() < deadline, decoder.rows
            time.sleep(0.02)
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            reap(p)
    return decoder.rows[-batches // 2:]  # after the first fits


# Scaled down to milliseconds: a SNAC-like CPU (an extra row of 20 tokens costs 13 ms, twice its
# lone decode) and a device-like decoder (a large fixed cost).
SLEEP_SNAC = CostFit(1 * MS, 0.25 * MS, 0.0, 3 * MS, 0.5 * MS)
SLEEP_DEVICE = CostFit(15 * MS, 0.01 * MS, 0.0, 0.0, 0.01 * MS)


def test_a_server_whose_batches_do_not_pay_decodes_rows_alone_on_both_lanes(thread_server, shm_name):
    decoder = PlantedBatchDecoder(SLEEP_SNAC)
    server = thread_server(decoder, lanes=2, min_fill=0.0)
    settled = _run(server, decoder, shm_name, 120, 10, 30)
    assert sum(r > 1 for r in settled) <= 0.1 * len(settled)  # probes, and rare short pairs
    assert decoder.most_at_once == 2  # the two lanes decode rows side by side
    assert server.batching_choices and server.batching_choices[-1].mode == "off"


def test_the_same_traffic_is_batched_with_batching_static(thread_server, shm_name):
    decoder = PlantedBatchDecoder(SLEEP_SNAC)
    thread_server(decoder, lanes=1, min_fill=0.0, batching="static")
    settled = _run(None, decoder, shm_name, 60, 10, 30)
    assert np.mean(settled) > 2  # what the measurement would have stopped


def test_a_server_whose_batches_pay_batches_every_row_that_fits(thread_server, shm_name):
    decoder = PlantedBatchDecoder(SLEEP_DEVICE)
    server = thread_server(decoder, lanes=1, min_fill=0.0)
    settled = _run(server, decoder, shm_name, 40, 10, 30)
    assert np.mean(settled) > 4  # six clients, most of them in every batch
    assert server.batching_choices[-1].mode == "on"



def test_two_free_lanes_each_take_their_share_of_four_waiting_requests_and_decode_side_by_side(
    thread_server, shm_name
):
    """Four requests wait, both CPU lanes are free, and the planner would batch all four
    (``batching="static"``): the lane that plans takes its share, two, and the other lane the
    rest, decoding beside it; one lane never takes everything while the other idles.

    Forced: the dispatcher's first look at the table is held until all four requests are in
    (``submitted_requests``), so the plan sees the four together whatever the machine's load."""
    decoder = SteppedDecoder()
    server = thread_server(decoder, lanes=2, slots=4, max_batch=4, max_wait_ms=0, rejoin_ms=0,
                           min_fill=0.0, max_batch_tokens=None, batching="static")  # fmt: skip
    real_scan, held = server._scan, threading.Event()

    def scan_once_all_four_are_in(segment):
        if not held.is_set():  # (bounded, and not past a stop: a failing test still ends)
            deadline = time.monotonic() + 30
            while submitted_requests(segment) < 4 and time.monotonic() < deadline:
                if server._stop.wait(0.002):
                    break
            held.set()
        return real_scan(segment)

    server._scan = scan_once_all_four_are_in  # the dispatcher looks it up on every scan
    requests = [seeded_request(70 + i, 20 + i) for i in range(4)]
    out: dict = {}
    with DecoderClient(shm_name, slots=4, timeout=60) as client:
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, client.decode(*requests[i],
                   dtype="float32"))) for i in range(4)]  # fmt: skip
        try:
            for t in threads:
                t.start()
            decoder.wait_entered(1)
            assert decoder.calls[0] == 2, f"the first free lane took {decoder.calls[0]} of 4 rows"
            decoder.wait_entered(2)  # the other lane's batch, while the first one is still held
            for _ in range(4):
                decoder.step()
        finally:
            for _ in range(4):
                decoder.step()
            join_within(threads, 60)
        assert sum(decoder.calls) == 4, decoder.calls
        # Each row against the same request decoded alone by the same server's lanes: the split
        # across lanes is what is under test here; the lanes' decode against the model's own is
        # every other exactness test's (a lane thread's kernels are not the test thread's).
        # (The eight steps above let the next four batches through: these four, one row each.)
        for i, (sem, glb) in enumerate(requests):
            alone = client.decode(sem, glb, dtype="float32")
            np.testing.assert_allclose(out[i], alone, atol=1e-5, rtol=0)
            assert len(out[i]) == len(single_decode(sem, glb))
        assert decoder.calls[2:] == [1, 1, 1, 1], decoder.calls


def test_two_lanes_split_what_waits_and_decode_side_by_side_where_batching_pays(thread_server, shm_name):
    """Batching pays (a 15 ms fixed cost): still, each free lane takes its share of the ready
    requests, rather than one lane all of them while the other idles."""
    decoder = PlantedBatchDecoder(SLEEP_DEVICE)
    thread_server(decoder, lanes=2, min_fill=0.0)
    settled = _run(None, decoder, shm_name, 60, 10, 30, clients=4)
    assert decoder.most_at_once == 2
    assert 1.5 <= np.mean(settled) <= 2.5  # 4 clients, two lanes: about 2 rows each
