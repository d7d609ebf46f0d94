"""``bicodec-shm bench`` says when its numbers are noise: rows of windows with few requests, of
repeats that spread widely, or measured while the lane tuner explored are flagged in the table,
the JSON and the PNG; a ratio above the no-IPC limit is marked with the reason; and before the
runs it names the model, the estimated time and the requests a window will hold, warning of a
long full-size run on a CPU. Everything from given numbers, but the calibration and one short
stand-in run (no torch)."""

from __future__ import annotations

import argparse
import json
import logging
import math

import pytest

from bicodec_shm.server.lane_tuner import BatchSample, LaneTuner, LaneTuning
from bicodec_shm.tools import bench
from bicodec_shm.tools.bench import calibrate, cli, config, workers
from bicodec_shm.tools.bench import report as reporting
from bicodec_shm.tools.bench import results as run_results

SHM, LIMIT, PER_PROCESS = config.SHM, config.LIMIT, config.PER_PROCESS


def _result(system: str, n: int, speed: float, *, requests: int = 100, repeat: int = 0,
            rss: float = 1000.0, **kw) -> run_results.RunResult:  # fmt: skip
    base = dict(system=system, n_clients=n, requests=requests, failed=0, tokens=50 * requests,
                audio_seconds=10.0, wall_seconds=10.0, audio_s_per_s=speed,
                requests_per_s=requests / 10, latency_p50_ms=100.0, latency_p99_ms=200.0,
                avg_batch_size=1.0, batch_size_histogram={}, peak_rss_mib=rss, cpu_seconds=1.0,
                others_cpu_share=0.1, threads="1", policy={}, repeat=repeat, window_s=10.0)  # fmt: skip
    base.update(kw)
    return run_results.RunResult(**base)


def _row(results: list, n: int, system: str) -> dict:
    (row,) = [r for r in reporting.summary(results) if (r["n_clients"], r["system"]) == (n, system)]
    return row


# -- the flags -----------------------------------------------------------------------------------


def test_a_row_whose_windows_held_few_requests_is_flagged_few():
    results = [_result(SHM, 2, 1.0, requests=k, repeat=i) for i, k in enumerate((25, 6, 30))]
    results += [_result(PER_PROCESS, 2, 1.0, requests=reporting.MIN_REQUESTS)]
    row = _row(results, 2, SHM)
    assert row["noise"]["flags"] == ["few"] and row["noise"]["min_requests"] == 6
    assert _row(results, 2, PER_PROCESS)["noise"]["flags"] == []  # 20 is enough
    text = reporting.format_table(results, reporting.compare(results))
    line = next(x for x in text.splitlines() if x.startswith("2  bicodec-shm"))
    assert line.endswith("few")
    assert f"few: a window held fewer than {reporting.MIN_REQUESTS} requests" in text
    assert "(fewest here: 6)" in text
    # The ratio against it is marked as noise too.
    assert reporting.compare(results)[2][SHM]["vs_per_process"]["flags"] == ["few"]
    assert "1.00 ?" in text and "?  noise, not a result" in text


def test_a_window_in_which_no_request_completed_counts_as_zero_not_as_skipped():
    """A full-size request can outlast a short window: that run measured 0 audio s/s. It stays
    in the row's median and min, flagged few, rather than vanish as a skipped system does."""
    results = [_result(SHM, 2, 0.0, requests=0, repeat=0, latency_p50_ms=None, latency_p99_ms=None),
               _result(SHM, 2, 1.0, requests=30, repeat=1),
               _result(PER_PROCESS, 2, 0.5, requests=30, repeat=0),
               _result(PER_PROCESS, 2, 0.5, requests=30, repeat=1),
               run_results._skipped(config.QUEUE, 2, "skipped: not asked for")]  # fmt: skip
    row = _row(results, 2, SHM)
    assert row["runs"] == 2 and row["audio_s_per_s"]["min"] == 0.0 and row["requests"]["min"] == 0
    assert row["noise"]["flags"] == ["few"] and row["noise"]["min_requests"] == 0
    assert reporting.compare(results)[2][SHM]["vs_per_process"]["min"] == 0.0
    assert _row(results, 2, config.QUEUE)["runs"] == 0  # skipped: no numbers
    text = reporting.format_table(results, reporting.compare(results))
    assert "0.500 (0.000-1.000)" in text


def test_a_row_whose_repeats_spread_over_the_limit_is_flagged_spread():
    wide = [_result(SHM, 4, v, repeat=i) for i, v in enumerate((1.0, 1.2, 1.6))]
    narrow = [_result(PER_PROCESS, 4, v, repeat=i) for i, v in enumerate((1.0, 1.2, 1.45))]
    results = wide + narrow
    row = _row(results, 4, SHM)
    assert row["noise"]["flags"] == ["spread"] and row["noise"]["spread"] == pytest.approx(1.6)
    assert _row(results, 4, PER_PROCESS)["noise"]["flags"] == []
    # One repeat has no spread to judge.
    assert _row([_result(SHM, 4, 1.0)], 4, SHM)["noise"]["spread"] is None
    text = reporting.format_table(results, reporting.compare(results))
    assert "spread: its throughput differs by more than 1.5x" in text and "(here up to 1.60x)" in text


def test_a_ratio_that_spreads_over_the_limit_is_marked_though_its_rows_are_not():
    # Throughputs within 1.5x each, but moving in opposite directions: the ratio spans 2.25x.
    shm = [_result(SHM, 8, v, repeat=i) for i, v in enumerate((1.2, 0.8))]
    own = [_result(PER_PROCESS, 8, v, repeat=i) for i, v in enumerate((0.8, 1.2))]
    s = reporting.compare(shm + own)[8][SHM]["vs_per_process"]
    assert (s["min"], s["max"]) == pytest.approx((2 / 3, 1.5)) and s["flags"] == ["spread"]


def test_a_window_the_lane_tuner_explored_is_flagged_tuner():
    results = [_result(SHM, 2, 1.0, tuner_exploring_s=4.0, lanes=[1, 2]),  # 40 % of 10 s
               _result(SHM + " (lanes=auto)", 2, 1.0, tuner_exploring_s=0.5, lanes=[1]),  # 5 %
               _result(SHM + " (lanes=1)", 2, 1.0, lanes=[1])]  # fmt: skip  (no tuner)
    assert _row(results, 2, SHM)["noise"]["flags"] == ["tuner"]
    assert _row(results, 2, SHM)["noise"]["tuner_exploring_share"] == pytest.approx(0.4)
    assert _row(results, 2, SHM + " (lanes=auto)")["noise"]["flags"] == []
    assert _row(results, 2, SHM + " (lanes=1)")["noise"]["tuner_exploring_share"] is None
    text = reporting.format_table(results, reporting.compare(results))
    assert "tuner: the lane tuner explored" in text and "(here up to 40% of a window)" in text


def test_lane_phases_in_a_window_give_its_lane_counts_and_exploring_seconds():
    # Server start at 0 (exploring, 2 lanes), 1 lane at 12, chosen (1 lane) at 15, re-explored
    # at 40 (from 1 lane); the window is [10, 20].
    phases = [(0.0, 2, True), (12.0, 1, True), (15.0, 1, False), (40.0, 1, True)]
    assert run_results.lane_phases_in_window(phases, 10.0, 20.0) == ([1, 2], pytest.approx(5.0))
    assert run_results.lane_phases_in_window(phases, 16.0, 30.0) == ([1], 0.0)
    assert run_results.lane_phases_in_window(phases, 35.0, 45.0) == ([1], pytest.approx(5.0))
    assert run_results.lane_phases_in_window([], 0.0, 1.0) == ([], 0.0)


def test_the_lane_tuner_logs_its_state_from_the_start_through_the_hold_and_the_bench_reads_it(
        caplog, tmp_path):  # fmt: skip
    """The tuner explores from its construction (no choice logged yet), holds after choosing,
    and explores again after the hold: each of those is a record carrying ``exploring``, which
    the bench's recorder turns into the phases it reads back."""
    clock = [0]
    tuning = LaneTuning(min_batches=1, min_seconds=0.0, hold_seconds=5.0, decisive=0.2)
    path = tmp_path / "phases.txt"
    path.touch()
    recorder = workers._PhaseRecorder(str(path))
    tuner_log = logging.getLogger("bicodec_shm.server.lanes")
    tuner_log.addHandler(recorder)
    caplog.set_level(logging.INFO, logger="bicodec_shm.server.lanes")
    try:
        tuner = LaneTuner([1, 2], start=2, tuning=tuning, clock=lambda: clock[0])
        assert tuner.exploring
        for _ in range(6):  # 1 lane decodes at half the cost per token: chosen after one pass
            clock[0] += 10**9
            cost = 10**8 if tuner.lanes == 1 else 2 * 10**8
            tuner.observe(BatchSample(clock[0] - 1, clock[0], clock[0] + cost, 40))
        assert not tuner.exploring and tuner.lanes == 1
        clock[0] += 6 * 10**9  # past the hold
        tuner.observe(BatchSample(clock[0], clock[0], clock[0] + 10**8, 40))
        assert tuner.exploring
    finally:
        tuner_log.removeHandler(recorder)
        recorder.close()
    states = [(r.lanes, r.exploring) for r in caplog.records if hasattr(r, "exploring")]
    assert states == [(2, True), (1, True), (1, False), (1, True)]
    assert "re-exploring after the hold" in caplog.records[-1].getMessage()
    phases = workers.read_lane_phases(str(path))
    assert [(n, e) for _, n, e in phases] == states
    assert [t for t, _, _ in phases] == sorted(t for t, _, _ in phases)


def test_a_ratio_above_the_limit_is_marked_and_footnoted_as_an_artefact():
    def run(shm_speed: float, lanes: list[int], **kw) -> list:
        return [_result(SHM, 2, shm_speed, lanes=lanes, **kw),
                _result(LIMIT, 2, 1.0, replays=SHM), _result(PER_PROCESS, 2, 0.5)]  # fmt: skip

    one_lane = run(1.42, [1], requests=4)
    comparison = reporting.compare(one_lane)
    s = comparison[2][SHM]["vs_limit"]
    assert s["median"] == pytest.approx(1.42) and "above-limit" in s["flags"] and "few" in s["flags"]
    assert "cannot be faster: a measurement artefact of its row's noise (few)" in s["note"]
    text = reporting.format_table(one_lane, comparison)
    ratios = text[text.index("ratios, computed"):]
    line = next(x for x in ratios.splitlines() if x.startswith("2  bicodec-shm"))
    assert "1.42 !?" in line
    assert "!  N=2 bicodec-shm: 1.42x the limit (no IPC), above it: with one lane" in text
    # No noise in the row: the footnote names the machine's load as the cause.
    quiet = reporting.compare(run(1.05, [1]))[2][SHM]["vs_limit"]
    assert quiet["flags"] == ["above-limit"] and "others' load" in quiet["note"]
    # Two lanes at once: the one-process replay is no bound, and the footnote says so.
    two = reporting.compare(run(1.3, [1, 2]))[2][SHM]["vs_limit"]
    assert "above-limit" in two["flags"] and "2 lanes decoded at once" in two["note"]
    # Below the limit: no mark; the limit's own ratio is 1 by definition, never marked.
    slower = run(0.9, [1])
    below = reporting.compare(slower)
    assert below[2][SHM]["vs_limit"]["flags"] == [] and below[2][LIMIT]["vs_limit"]["flags"] == []
    assert "!" not in reporting.format_table(slower, below)


def test_a_target_judged_on_noise_says_so():
    from bicodec_shm.tools.bench import workload

    results = [_result(SHM, 8, 1.0, requests=5), _result(LIMIT, 8, 1.05, replays=SHM),
               _result(PER_PROCESS, 8, 0.8, rss=8000.0)]  # fmt: skip
    t = reporting.targets(reporting.compare(results), stand_in=False,
                          mix=workload.parse_mix(workload.DEFAULT_MIX))  # fmt: skip
    assert t and all(v["noise"] for v in t)
    assert "judged on noise (few)" in reporting.format_targets(t, ran=[8])


# -- the up-front lines --------------------------------------------------------------------------


def _plan(*argv: str) -> cli.Plan:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.Plan(p.parse_args(["--no-plot", "--cores", "2", *argv]))


# What the user's 2-core VM measured for the full-size model: ~12 s to start a model process,
# ~2.5 s for a request of the mix's mean length.
FULL_CPU = calibrate.Calibration(process_s=1.5, model_s=10.5, request_s=2.5, how="measured")


def test_the_up_front_lines_name_the_model_the_time_and_the_requests_per_window():
    plan = _plan("--window", "5", "--n", "2")
    described = plan.describe(sweep=False)
    assert "codec bicodec, model spark-tts-0.5b (the full size), random weights (seed 0" in described
    assert "on cpu" in described
    lines = plan.expectations(FULL_CPU, sweep=False)
    # 4 systems x 3 repeats; each run: start-up (>= 12 s), the 5 s window, the request in flight.
    total = calibrate.estimate_seconds(FULL_CPU, plan.setup, plan.ns, plan.systems, 3, None)
    assert 12 * (12 + 5 + 2.5) <= total <= 12 * (24 + 5 + 2.5 + 1)
    assert lines[0].startswith(f"estimated time: about {cli._span(total)} for 12 runs")
    assert "decodes in 2.5 s on 2 cores" in lines[0]
    assert "expected requests per window: about 2 or more" in lines[1]
    few = next(x for x in lines if x.startswith("warning: a 5 s window"))
    assert "fewer than 20" in few and f"--window {math.ceil(20 * 2.5)} or more" in few
    long = next(x for x in lines if x.startswith("warning: the full-size model"))
    assert "on a CPU: this run takes about 4 min" in long and "--quick" in long and "--model tiny" in long


def test_a_run_estimate_counts_its_processes_starting_at_once_on_the_cores():
    setup = _plan("--window", "5", "--n", "8").setup  # 2 cores
    cal = FULL_CPU
    tail = 5 + cal.request_s + calibrate.STOP_S
    # 8 decoders per process: 8 x 12 s of start-up on 2 cores.
    assert calibrate.run_seconds(cal, setup, PER_PROCESS, 8, None) == pytest.approx(4 * cal.start_s + tail)
    # A server and 8 torch-free clients: one model, 9 process starts, on 2 cores.
    assert calibrate.run_seconds(cal, setup, SHM, 8, None) == pytest.approx(
        (9 * cal.process_s + cal.model_s) / 2 + tail)  # fmt: skip
    # One model process alone cannot start faster than it does.
    assert calibrate.run_seconds(cal, setup, LIMIT, 8, None) == pytest.approx(cal.start_s + tail)
    # Without a window: the requests one at a time.
    counted = _plan("--requests", "3", "--n", "2").setup
    assert calibrate.run_seconds(cal, counted, LIMIT, 2, 3) == pytest.approx(
        cal.start_s + 6 * cal.request_s + cal.request_s + calibrate.STOP_S)  # fmt: skip


def test_the_long_run_warning_only_for_the_full_size_model_on_a_cpu():
    def warned(*argv: str) -> bool:
        lines = _plan(*argv).expectations(FULL_CPU, sweep=False)
        return any(x.startswith("warning: the full-size model") for x in lines)

    assert warned("--n", "1,2,4", "--window", "10")
    assert not warned("--n", "1,2,4", "--window", "10", "--model", "tiny")
    assert not warned("--n", "1,2,4", "--window", "10", "--device", "cuda:0")
    assert not warned("--n", "1", "--window", "1", "--repeats", "1", "--systems", "shm")  # short
    # Not calibrated: the windows alone decide (60 runs of 60 s), and start-up comes on top.
    lines = _plan("--window", "60").expectations(None, sweep=False)
    assert any("this run takes about 60 min plus start-up" in x for x in lines)
    assert "not calibrated" in lines[0]


def test_counted_requests_are_shown_and_too_few_warned():
    lines = _plan("--requests", "3", "--n", "1,8").expectations(FULL_CPU, sweep=False)
    assert "requests per run (counted, no window): N=1: 3, N=8: 24" in lines
    assert any(x.startswith("warning: a run of 3 requests, fewer than 20") for x in lines)


@pytest.mark.timeout(120)
def test_the_calibration_times_a_real_process_start():
    """A spawned process (the stand-in: no torch) reports when it imported and built its model;
    the stand-in's request cost is its formula."""
    plan = _plan("--model", "stand-in", "--stand-in", "5,0.01", "--mix", "40-60")
    cal = calibrate.calibrate(plan.setup)
    assert 0 < cal.process_s < 60 and 0 <= cal.model_s < 60
    assert cal.request_s == pytest.approx((5 + 0.01 * 50) / 1000)
    assert cal.requests_per_window(1.0) == pytest.approx(1 / cal.request_s)


@pytest.mark.timeout(300)
def test_a_short_stand_in_run_says_up_front_and_after_its_first_window_that_it_is_noise(tmp_path, capsys):
    """40 ms a request, 0.3 s windows: about 7 requests each. The run says so before it starts,
    again when the first window ends, flags the rows, and writes the flags into the JSON."""
    out = tmp_path / "bench.json"
    code = bench.main(["--model", "stand-in", "--stand-in", "40,0.01", "--mix", "25", "--systems",
                       "shm,per-process", "--n", "1", "--window", "0.3", "--repeats", "1",
                       "--no-progress", "--no-plot", "--json", str(out)])  # fmt: skip
    assert code == 0
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    estimated = next(i for i, x in enumerate(lines) if x.startswith("estimated time: about"))
    few = next(i for i, x in enumerate(lines) if x.startswith("warning: a 0.3 s window holds about 7"))
    first = next(i for i, x in enumerate(lines) if x.startswith("first run: N=1 bicodec-shm:"))
    table = next(i for i, x in enumerate(lines) if x.startswith("N  system"))
    assert estimated < few < first < table
    assert "(calibration: about 7 or more)" in lines[first] and "the rest about" in lines[first]
    assert lines[table].endswith("noise")
    report = json.loads(out.read_text())
    assert report["noise_rules"]["min_requests"] == reporting.MIN_REQUESTS
    assert report["calibration"]["request_s"] == pytest.approx(0.04025)
    assert report["estimated_s"] > 0
    rows = {r["system"]: r for r in report["summary"]}
    assert "few" in rows[SHM]["noise"]["flags"] and "few" in rows[PER_PROCESS]["noise"]["flags"]
    assert report["comparison"]["1"][SHM]["vs_per_process"]["flags"] == ["few"]
    # The stand-in is served on one lane, untuned.
    shm_run = next(r for r in report["results"] if r["system"] == SHM)
    assert shm_run["lanes"] == [1] and shm_run["tuner_exploring_s"] is None


# -- the PNG -------------------------------------------------------------------------------------


def test_log_ticks_are_round_and_inside_the_range():
    from bicodec_shm.tools.bench import plot

    assert plot.log_ticks(1, 1000) == [1, 10, 100, 1000]
    assert plot.log_ticks(40, 900) == [50, 100, 200, 500]
    assert plot.log_ticks(300, 590) == [300, 400, 500]
    assert plot.log_ticks(131, 149) == [133, 140, 147]
    assert [plot.plain(v) for v in (1350.0, 20.0, 0.5, 100000.0)] == ["1350", "20", "0.5", "100000"]


def test_the_png_has_a_memory_panel_plain_ticks_and_hollow_noisy_points(tmp_path):
    pytest.importorskip("matplotlib")
    from bicodec_shm.tools.bench import plot

    # Noisy: bicodec-shm at N=2 (few requests); clean elsewhere. Latencies over 1000 ms and
    # memory over 10000 MiB would be labelled 10^3, 10^4 by default.
    results = []
    for n in (1, 2, 4):
        results.append(_result(SHM, n, 1.0 * n, requests=5 if n == 2 else 100, rss=900.0 + 10 * n,
                               latency_p99_ms=1350.0 * n))  # fmt: skip
        results.append(_result(PER_PROCESS, n, 0.8 * n, rss=12000.0 * n, latency_p99_ms=900.0 * n))
    fig = plot.figure(results)
    try:
        fig.canvas.draw()
        axes = fig.axes
        assert [ax.get_title().splitlines()[0] for ax in axes] == [
            "throughput", "p99 request latency", "peak memory, all its processes"]  # fmt: skip
        memory = axes[2]
        plotted = sorted(y for line in memory.get_lines() for y in line.get_ydata())
        assert 12000.0 * 4 in plotted and 920.0 in plotted
        for ax in axes:
            labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)]
            shown = [x for x in labels if x]
            assert shown and all(x.replace(".", "").isdigit() for x in shown), shown
        assert "1000" in [t.get_text() for t in axes[1].get_yticklabels()]
        # One hollow marker per panel, at bicodec-shm's N=2; the legend explains it.
        for ax in axes:
            hollow = [(x, y) for line in ax.get_lines() if line.get_markerfacecolor() == "none"
                      for x, y in zip(line.get_xdata(), line.get_ydata())]  # fmt: skip
            assert [x for x, _ in hollow] == [2]
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert plot.NOISE_LABEL in legend and SHM in legend and PER_PROCESS in legend
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    png = tmp_path / "bench.png"
    assert plot.plot(results, str(png)) == f"wrote {png}" and png.stat().st_size > 10_000


def test_without_noise_the_png_has_no_hollow_marker_and_no_noise_entry():
    pytest.importorskip("matplotlib")
    from bicodec_shm.tools.bench import plot

    fig = plot.figure([_result(SHM, n, 1.0) for n in (1, 2)])
    try:
        assert all(line.get_markerfacecolor() != "none" for ax in fig.axes for line in ax.get_lines())
        assert plot.NOISE_LABEL not in [t.get_text() for t in fig.legends[0].get_texts()]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
