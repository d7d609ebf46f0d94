"""``bicodec_shm.tools.bench`` (``bicodec-shm bench``): the quick run and a stand-in run end to end, the
sweep, cleanup on failure and on Ctrl-C, the stand-in and its lock, the ideal batcher, and the
arithmetic of the tables from given numbers."""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from bicodec_shm.codecs import SNAC_24KHZ
from bicodec_shm.protocol.names import leftover_objects
from bicodec_shm.tools import bench
from bicodec_shm.tools.bench import cli, config, orchestrate, sampling, standin, systems, workload
from bicodec_shm.tools.bench import report as reporting
from bicodec_shm.tools.bench import results as run_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ours_in_dev_shm() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if config.NAME_PREFIX in e}


def _live_children() -> list[psutil.Process]:
    """Children of this process, except multiprocessing's resource tracker (one per process)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()) and child.is_running():
                out.append(child)
        except psutil.Error:
            pass
    return out


# -- end to end ----------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_quick_run_covers_every_system_and_leaves_nothing(tmp_path, capsys):
    before = _ours_in_dev_shm()
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = bench.main(["--quick", "--no-progress", "--json", str(out), "--plot", str(png)])
    assert code == 0
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert cfg["preset"] == "tiny" and cfg["n_clients"] == [1, 2]
    assert cfg["window_s"] == config.QUICK_WINDOW_S and cfg["repeats"] == 1
    assert cfg["requests_per_client"] is None
    assert cfg["threads"]["per_process"] == {
        "1": systems.per_process_threads(cfg["cores"], 1),
        "2": systems.per_process_threads(cfg["cores"], 2),
    }
    for n in (1, 2):
        rows = {r["system"]: r for r in report["results"] if r["n_clients"] == n}
        assert set(rows) == set(config.SYSTEMS), n
        for system, r in rows.items():
            assert r["audio_s_per_s"] > 0 and r["requests"] > 0, (n, system)
            assert r["window_s"] == config.QUICK_WINDOW_S and r["repeat"] == 0
            # Throughput is what completed inside the window, over the window.
            assert r["wall_seconds"] == pytest.approx(config.QUICK_WINDOW_S)
            assert r["requests_per_s"] == pytest.approx(r["requests"] / config.QUICK_WINDOW_S)
            assert 0 <= r["cut_at_edge"] <= n
            assert r["failed"] == 0 and r["peak_rss_mib"] > 0
            if system != config.LIMIT:
                assert 0 < r["latency_p50_ms"] <= r["latency_p99_ms"]
        assert rows[config.PER_PROCESS]["avg_batch_size"] == 1.0
        assert rows[config.LIMIT]["avg_batch_size"] == pytest.approx(rows[config.SHM]["avg_batch_size"])
        ratios = report["comparison"][str(n)]
        for system in config.SYSTEMS:
            for key in ("vs_limit", "vs_per_process", "vs_queue", "memory_vs_per_process"):
                s = ratios[system][key]
                assert s["min"] <= s["median"] <= s["max"] and s["n"] == 1, (n, system, key)
        assert ratios[config.LIMIT]["vs_limit"]["median"] == pytest.approx(1.0)
        assert ratios[config.PER_PROCESS]["vs_per_process"]["median"] == pytest.approx(1.0)
        assert ratios[config.SHM]["vs_ideal"] is None  # the ideal batcher is the stand-in's
    summary = {(s["n_clients"], s["system"]): s for s in report["summary"]}
    assert set(summary) == {(n, s) for n in (1, 2) for s in config.SYSTEMS}
    # A fresh server reads the load from its first batches and holds what it predicts: one
    # client runs one lane, and no exploration (two measuring windows of 2 s or more, a minute
    # after the start) fills the 2 s window.
    if cfg["cores"] >= 2:
        for n in (1, 2):
            shm_run = next(r for r in report["results"] if (r["n_clients"], r["system"]) == (n, config.SHM))
            assert shm_run["tuner_exploring_s"] < 0.5 * config.QUICK_WINDOW_S and shm_run["lanes"], shm_run
            assert n > 1 or 1 in shm_run["lanes"], shm_run
    assert "estimated time: about" in stdout and "first run: N=1 bicodec-shm:" in stdout
    assert report["calibration"]["model_s"] > 0 and report["estimated_s"] > 0
    for key in ("audio_s_per_s", "requests_per_s", "latency_p50_ms", "latency_p99_ms", "cpu_per_audio_s"):
        s = summary[(2, config.SHM)][key]
        assert set(s) == {"median", "min", "max", "n", "values"} and s["min"] <= s["median"] <= s["max"]
    # Targets are set at N = 8 (and 4, 16): this run has none, and says so without "N=8" lines.
    assert report["targets"] == []
    assert "targets: none for this run (N=1,2)" in stdout
    assert not [line for line in stdout.splitlines() if line.startswith(("N=4", "N=8", "N=16"))]
    assert report["left_in_dev_shm"] == []
    assert len(report["shm_names"]) == 2
    for name in report["shm_names"]:
        assert leftover_objects(name) == []
    assert _ours_in_dev_shm() <= before
    assert _live_children() == []
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists()
        assert 'pip install "bicodec-shm[plot]"' in stdout
    else:
        assert png.stat().st_size > 0


def _stand_in_report(tmp_path, stand_in: str, repeats: int) -> dict:
    """A short bicodec-shm run against the stand-in ``stand_in`` at N = 2; its JSON report."""
    out = tmp_path / "standin.json"
    code = bench.main(["--model", "stand-in", "--stand-in", stand_in, "--systems", "shm",
                       "--n", "2", "--window", "0.5", "--repeats", str(repeats), "--no-progress",
                       "--no-plot", "--json", str(out)])  # fmt: skip
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_stand_in_run_reports_the_share_of_the_ideal(tmp_path):
    report = _stand_in_report(tmp_path, "5,0.01", repeats=2)
    assert report["config"]["stand_in"]["a_ms"] == 5 and report["config"]["stand_in"]["b_ms"] == 0.01
    assert "all N outstanding requests" in report["config"]["stand_in"]["ideal"]
    runs = [(r["system"], r["repeat"]) for r in report["results"]]
    assert sorted(runs) == sorted([(s, k) for s in (config.SHM, config.IDEAL) for k in (0, 1)])
    ideal = [r for r in report["results"] if r["system"] == config.IDEAL]
    assert ideal[0]["requests"] == ideal[1]["requests"] > 0  # computed: the same every repeat
    share = report["comparison"]["2"][config.SHM]["vs_ideal"]
    assert share["n"] == 2 and 0 < share["min"] <= share["median"] <= share["max"]
    assert report["targets"] == []  # set at N = 16
    assert _live_children() == []


@pytest.mark.timeout(300)
def test_every_shm_variant_runs_in_one_pass_under_its_own_label():
    """What --lanes 1,2 does, with a keyword today's server takes (lanes= comes later)."""
    variants = tuple(config.ShmVariant(f"{config.SHM} (reap_interval={v})", {"reap_interval": v})
                     for v in (0.5, 1.0))  # fmt: skip
    setup = config.Setup(preset=config.STAND_IN, seed=0, mix=workload.parse_mix("25-50"), cores=1,
                         policy=config.Policy(), sample_interval=0.05, timeout=60, window=0.5,
                         stand_in_ms=(2.0, 0.01), shm=variants)  # fmt: skip
    results = orchestrate.bench_all(setup, [2], systems=(config.SHM,), progress=False)
    assert [r.system for r in results] == [v.label for v in variants] + [config.IDEAL]
    assert all(r.requests > 0 for r in results)
    comparison = reporting.compare(results)
    for v in variants:
        assert reporting.is_shm(v.label)
        assert comparison[2][v.label]["vs_ideal"]["median"] > 0
    assert _live_children() == []


@pytest.mark.timeout(300)
def test_sweep_reports_each_policy(tmp_path):
    out = tmp_path / "sweep.json"
    # --server-arg goes through to DecoderServer (reap_interval: a keyword every server takes).
    code = bench.main(["--quick", "--sweep", "--n", "2", "--sweep-wait", "0,5",
                       "--sweep-tokens", "4096", "--window", "1", "--server-arg", "reap_interval=0.5",
                       "--no-progress", "--json", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert [(s["max_wait_ms"], s["max_batch_tokens"]) for s in summary] == [(0, 4096), (5, 4096)]
    for s in summary:
        assert s["runs"] == 1 and s["audio_s_per_s"] > 0 and s["latency_p99_ms"] > 0
    assert {r["system"] for r in report["results"]} == {config.SHM}
    assert report["config"]["bicodec_shm"] == [{"label": config.SHM,
                                                "server_options": {"reap_interval": 0.5}}]  # fmt: skip
    assert report["left_in_dev_shm"] == []
    assert _live_children() == []


def test_a_failing_server_stops_the_run_and_cleans_up():
    """A child that raises stops the run with its traceback; processes and /dev/shm are cleaned."""
    from tqdm import tqdm

    setup = config.Setup(preset="no-such-preset", seed=0, mix=workload.parse_mix("25-30"), cores=1,
                         policy=config.Policy(), sample_interval=0.05, timeout=60, window=1.0)  # fmt: skip
    sampler = sampling._Sampler(0.05)
    names: list[str] = []
    try:
        with pytest.raises(RuntimeError, match="bicodec-shm server failed"):
            systems.bench_shm(setup, 2, ctx=mp.get_context("spawn"), sampler=sampler,
                              bar=tqdm(disable=True), names=names)  # fmt: skip
    finally:
        sampler.stop()
    assert len(names) == 1 and leftover_objects(names[0]) == []
    assert _live_children() == []


# `python -m bicodec_shm.tools.bench` as a terminal's foreground job runs it: Ctrl-C at its default.
# A test run started in the background (`pytest &`, as some CI runners do) has SIGINT ignored,
# which the bench would inherit and, rightly, keep.
_BENCH_WITH_CTRL_C = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                      "runpy.run_module('bicodec_shm.tools.bench', run_name='__main__', alter_sys=True)")


@pytest.mark.timeout(300)
def test_ctrl_c_cleans_up_every_process_and_object(tmp_path):
    """SIGINT to the whole process group (a terminal's Ctrl-C) while a server is serving."""
    before = _ours_in_dev_shm()
    proc = subprocess.Popen(
        [sys.executable, "-c", _BENCH_WITH_CTRL_C, "--quick", "--no-progress", "--no-plot",
         "--json", str(tmp_path / "x.json")],
        cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    err = ""
    try:
        deadline = time.monotonic() + 180
        while not (_ours_in_dev_shm() - before) and proc.poll() is None:
            assert time.monotonic() < deadline, "no bicodec-shm server came up"
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)  # let the clients connect
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            # SIGTERM first: the bench unwinds, and multiprocessing's resource tracker (in the
            # same process group) unlinks its semaphores. SIGKILL only if that hangs too.
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()  # reap it and close the pipes, even after a timeout
    assert proc.returncode == 130, err
    assert "cleaned up" in err
    deadline = time.monotonic() + 10
    while True:
        left = [p for p in psutil.process_iter() if _in_session(p, proc.pid)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == []
    assert _ours_in_dev_shm() <= before
    assert not (tmp_path / "x.json").exists()


def _in_session(p: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        return False


# -- the workload -------------------------------------------------------------------------------


def test_parse_mix():
    Band = workload.Band
    assert workload.parse_mix(workload.DEFAULT_MIX) == (Band(25, 50, 0.8), Band(100, 300, 0.2))
    assert workload.parse_mix("40") == (workload.Band(40, 40, 1.0),)
    for bad in ("", "50-25:1", "0-10:1", "10-20:0", "a-b:1", "10-20:x"):
        with pytest.raises(ValueError):
            workload.parse_mix(bad)


def test_draw_lengths_follows_the_mix_and_is_reproducible():
    mix = workload.parse_mix("25-50:0.8,100-300:0.2")
    lengths = workload.draw_lengths(mix, 8, 250, seed=3)
    flat = np.array([n for client in lengths for n in client])
    assert all(25 <= n <= 50 or 100 <= n <= 300 for n in flat)
    assert 0.75 < np.mean(flat <= 50) < 0.85
    assert workload.draw_lengths(mix, 8, 250, seed=3) == lengths
    # Client i's requests do not depend on how many clients there are.
    assert workload.draw_lengths(mix, 2, 250, seed=3) == lengths[:2]


def test_request_stream_is_the_length_stream_with_ids():
    mix = workload.parse_mix(workload.DEFAULT_MIX)
    lengths = list(itertools.islice(workload.length_stream(mix, 5, 3), 150))  # crosses blocks
    assert workload.draw_lengths(mix, 4, 150, seed=5)[3] == lengths
    requests = list(workload.request_stream(mix, 5, 3, count=150))
    assert [r.frames for r in requests] == lengths
    assert all(len(r.levels) == 1 and r.levels[0].dtype == np.int64 and 0 <= r.levels[0].min()
               and r.levels[0].max() < 8192 for r in requests)  # fmt: skip
    assert len({r.global_ids.tobytes() for r in requests}) == 1  # one speaker per client


def test_a_snac_request_stream_draws_every_level_at_its_rate_and_no_global_ids():
    mix = workload.parse_mix(workload.default_mix(SNAC_24KHZ))
    assert mix == workload.parse_mix("6-12:0.8,23-70:0.2")  # the BiCodec mix's seconds
    requests = list(workload.request_stream(mix, 5, 3, count=40, layout=SNAC_24KHZ))
    assert [r.frames for r in requests] == workload.draw_lengths(mix, 4, 40, seed=5)[3]
    for r in requests:
        assert [len(v) for v in r.levels] == [r.frames, 2 * r.frames, 4 * r.frames]
        assert r.global_ids is None and all(0 <= v.min() and v.max() < 4096 for v in r.levels)
    assert workload.audio_seconds(24, SNAC_24KHZ) == 24 * 2048 / 24000


def test_requests_per_client_and_threads():
    assert workload.requests_per_client(4, 7) == 7
    assert workload.requests_per_client(1, None) == workload.TOTAL_REQUESTS
    assert workload.requests_per_client(64, None) == workload.MIN_REQUESTS
    assert [systems.per_process_threads(2, n) for n in (1, 2, 4, 16)] == [2, 1, 1, 1]
    assert [systems.per_process_threads(8, n) for n in (1, 2, 4, 16)] == [8, 4, 2, 1]


# -- the stand-in and the ideal batcher -------------------------------------------------------------


def test_stand_in_defaults_follow_their_calibration():
    # 1 x 50 tokens ~30 ms; 10 x 50 tokens ~37.5 ms (the middle of 35-40 ms).
    costs = {"a_ms": standin.DEFAULT_A_MS, "b_ms": standin.DEFAULT_B_MS}
    assert standin.cost_ms(1, 50, **costs) == pytest.approx(30)
    assert standin.cost_ms(10, 50, **costs) == pytest.approx(37.5)


def test_stand_in_sleeps_a_plus_b_rows_longest_and_returns_zeros():
    import torch

    decoder = standin.StandInDecoder(a_ms=1.0, b_ms=0.01)
    out = decoder.detokenize(np.zeros((3, 40), np.int64), np.zeros((3, 32), np.int64))
    assert isinstance(out, np.ndarray) and out.shape == (3, 40 * 320) and not out.any()
    assert decoder.planned_s == pytest.approx((1.0 + 0.01 * 3 * 40) / 1000)
    out = decoder.detokenize(torch.zeros(2, 10, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long),
                             torch.tensor([10, 7]))  # fmt: skip
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (2, 3200) and not out.any()
    assert decoder.planned_s == pytest.approx((2.2 + 1.2) / 1000)
    assert (decoder.calls, decoder.rows, decoder.padded_tokens) == (2, 5, 140)
    assert decoder.slept_s >= decoder.planned_s * 0.99  # time.sleep never returns early
    with pytest.raises(ValueError, match=">= 0"):
        standin.StandInDecoder(a_ms=-1)


def test_the_modern_preset_plays_an_asynchronous_device_whose_batches_queue():
    import time

    import torch

    preset = standin.STAND_IN_PRESETS["modern"]
    assert (preset.a_ms, preset.b_ms, preset.asynchronous) == (4.0, 0.006, True)
    decoder = standin.StandInDecoder(a_ms=20.0, b_ms=0.0, asynchronous=True)
    ids, glb = torch.zeros(2, 10, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long)
    t0 = time.perf_counter()
    out, first = decoder.launch(ids, glb)
    _, second = decoder.launch(ids, glb)  # queued behind the first, as on one CUDA stream
    launched = time.perf_counter() - t0
    assert tuple(out.shape) == (2, 3200) and not out.any()
    assert second.done_at == pytest.approx(first.done_at + 0.020)
    assert launched < first.done_at - t0  # launching returned before the "device" finished
    second.synchronize()
    assert time.perf_counter() >= second.done_at  # synchronize waits out both batches
    assert decoder.planned_s == pytest.approx(0.040) and decoder.calls == 2


def test_the_server_pipelines_an_asynchronous_stand_in_with_one_lane(thread_server, shm_name):
    from bicodec_shm.client.decoder_client import DecoderClient

    decoder = standin.StandInDecoder(a_ms=2.0, b_ms=0.0, asynchronous=True)

    def synchronous(*args):
        raise AssertionError("the server waited in detokenize instead of launching")

    decoder.detokenize = synchronous
    server = thread_server(decoder)
    assert server.lanes == 1 and server._pipeline and server.lane_choices == []
    with DecoderClient(shm_name) as client:
        pcm = client.decode(np.ones(30, np.int64), np.zeros(32, np.int64))
    assert len(pcm) == 30 * 320 and not np.any(pcm)
    assert decoder.calls == 1


def test_ideal_batcher_from_hand_made_numbers():
    mix = workload.parse_mix("50")
    # 2 clients, 30 ms a batch of 2 whatever its size: 3 batches fit in 100 ms, the 4th would end
    # at 120 ms and is not counted.
    run = standin.ideal_run(mix, 0, 2, max_batch=16, max_batch_tokens=None, a_ms=30, b_ms=0,
                            window_s=0.1)  # fmt: skip
    assert (run.requests, run.tokens, run.batch_sizes, run.seconds) == (6, 300, [2, 2, 2], 0.1)
    assert run.busy_seconds == pytest.approx(0.09)
    # A budget of 60 padded tokens keeps every batch to 1 row of 50: half as many requests.
    run = standin.ideal_run(mix, 0, 2, max_batch=16, max_batch_tokens=60, a_ms=30, b_ms=0,
                            window_s=0.1)  # fmt: skip
    assert run.batch_sizes == [1, 1, 1]
    # Count mode: 3 requests per client, batches of 2 rows x 50 tokens at 10 + 0.1 x 100 ms.
    run = standin.ideal_run(mix, 0, 2, max_batch=16, max_batch_tokens=None, a_ms=10, b_ms=0.1,
                            requests=3)  # fmt: skip
    assert run.requests == 6 and run.batch_sizes == [2, 2, 2]
    assert run.seconds == pytest.approx(0.06)
    with pytest.raises(ValueError):
        standin.ideal_run(mix, 0, 2, max_batch=16, max_batch_tokens=None, a_ms=1, b_ms=0)


def test_pipelined_ideal_from_hand_made_numbers():
    """3 clients, 2 rows a batch, 30 ms each. The ideal plans every batch from all three:
    [2, 2, 2] in 100 ms. A pipelined lane plans batch 2 while batch 1 (clients 0 and 1) runs:
    only client 2 is outstanding, so [2, 1, ...]; batch 3 is planned while batch 2 runs, from
    clients 0 and 1, back at batch 1's end: [2, 1, 2], and the 4th would end at 120 ms."""
    mix = workload.parse_mix("50")
    kw = dict(max_batch=2, max_batch_tokens=None, a_ms=30, b_ms=0, window_s=0.1)
    ideal = standin.ideal_run(mix, 0, 3, **kw)
    piped = standin.ideal_run(mix, 0, 3, pipelined=True, **kw)
    assert (ideal.batch_sizes, ideal.requests) == ([2, 2, 2], 6)
    assert (piped.batch_sizes, piped.requests, piped.tokens) == ([2, 1, 2], 5, 250)
    assert piped.seconds == 0.1 and piped.busy_seconds == pytest.approx(0.09)
    # When every batch takes every client, nothing is left to queue behind the running batch:
    # the next one is planned at its end, from its clients, and the two batchers agree.
    kw["max_batch"] = 16
    assert standin.ideal_run(mix, 0, 2, pipelined=True, **kw).batch_sizes == [2, 2, 2]
    # Count mode ends when every client has had its requests, the running batch's included.
    piped = standin.ideal_run(mix, 0, 3, pipelined=True, max_batch=2, max_batch_tokens=None,
                              a_ms=30, b_ms=0, requests=2)  # fmt: skip
    assert piped.requests == 6 and sum(piped.batch_sizes) == 6


def test_pipelined_ideal_never_beats_the_ideal_and_nears_it_as_clients_grow():
    """The bench's mix with the modern preset: a pipelined lane plans from N minus the running
    batch, so it loses most with few clients."""
    mix = workload.parse_mix(workload.DEFAULT_MIX)
    shares = []
    for n in (2, 4, 16, 64):
        kw = dict(max_batch=16, max_batch_tokens=512, a_ms=4.0, b_ms=0.006, window_s=20)
        ideal, piped = standin.ideal_run(mix, 0, n, **kw), standin.ideal_run(mix, 0, n, pipelined=True, **kw)
        shares.append(piped.tokens / ideal.tokens)
        assert np.mean(piped.batch_sizes) <= np.mean(ideal.batch_sizes)
    assert all(0 < s <= 1 for s in shares)
    assert shares == sorted(shares) and shares[0] < 0.8 and shares[-1] > 0.95, shares


@pytest.mark.timeout(300)
def test_an_asynchronous_stand_in_run_adds_the_pipelined_ideal(tmp_path):
    report = _stand_in_report(tmp_path, "modern", repeats=1)
    assert "planned when batch k starts" in report["config"]["stand_in"]["pipelined_ideal"]
    systems = [r["system"] for r in report["results"]]
    assert systems == [config.SHM, config.IDEAL, config.PIPELINED_IDEAL]
    ratios = report["comparison"]["2"]
    assert ratios[config.SHM]["vs_pipelined_ideal"]["median"] > 0
    piped = ratios[config.PIPELINED_IDEAL]["vs_ideal"]["median"]
    assert 0 < piped <= 1
    assert _live_children() == []


@pytest.mark.timeout(120)
def test_stand_in_per_process_decodes_one_at_a_time_through_the_lock(tmp_path):
    from tqdm import tqdm

    trace = tmp_path / "lock.txt"
    setup = config.Setup(preset=config.STAND_IN, seed=0, mix=workload.parse_mix("25-50"), cores=1,
                         policy=config.Policy(), sample_interval=0.05, timeout=60, window=1.0,
                         stand_in_ms=(4.0, 0.0), lock_trace=str(trace))  # fmt: skip
    sampler = sampling._Sampler(0.05)
    try:
        result = systems.bench_per_process(setup, 3, ctx=mp.get_context("spawn"), sampler=sampler,
                                           bar=tqdm(disable=True))  # fmt: skip
    finally:
        sampler.stop()
    assert _live_children() == []
    held: dict[int, list[int]] = {}
    events = [line.split() for line in trace.read_text().splitlines()]
    for pid, what, ns in events:
        held.setdefault(int(pid), []).append(int(ns))
        assert what == ("enter" if len(held[int(pid)]) % 2 else "exit")
    assert len(held) == 3  # every process decoded
    spans = sorted((stamps[k], stamps[k + 1]) for stamps in held.values()
                   for k in range(0, len(stamps), 2))  # fmt: skip
    assert len(spans) >= result.requests > 10
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end  # nobody entered while another process held the lock


# -- options ----------------------------------------------------------------------------------------


def test_server_args_and_lanes_become_shm_variants():
    assert cli.parse_server_arg("lanes=2") == ("lanes", 2)
    assert cli.parse_server_arg("reap-interval=0.5") == ("reap_interval", 0.5)
    assert cli.parse_server_arg("mode=fast") == ("mode", "fast")
    assert cli.parse_server_arg("max_batch_tokens=None") == ("max_batch_tokens", None)
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_server_arg("lanes")
    (only,) = cli.shm_variants([("reap_interval", 0.5)], None)
    assert only == config.ShmVariant(config.SHM, {"reap_interval": 0.5})
    variants = cli.shm_variants([("reap_interval", 0.5)], (1, 2))
    assert [v.label for v in variants] == ["bicodec-shm (lanes=1)", "bicodec-shm (lanes=2)"]
    assert variants[1].server_options == {"reap_interval": 0.5, "lanes": 2}
    auto, two = cli.shm_variants([], cli._lane_counts("auto,2"))
    assert (auto.label, auto.server_options) == ("bicodec-shm (lanes=auto)", {})  # the server's choice
    assert (two.label, two.server_options) == ("bicodec-shm (lanes=2)", {"lanes": 2})
    with pytest.raises(argparse.ArgumentTypeError, match="auto"):
        cli._lane_counts("1,many")
    for bad in ((0,), (2, 2), (None, None)):
        with pytest.raises(ValueError, match="--lanes"):
            cli.shm_variants([], bad)
    with pytest.raises(ValueError, match="not both"):
        cli.shm_variants([("lanes", 2)], (1,))
    cli.check_server_options({"reap_interval": 0.5})
    with pytest.raises(ValueError, match="no_such_option="):
        cli.check_server_options({"no_such_option": 1})
    with pytest.raises(ValueError, match="--max-batch"):
        cli.check_server_options({"max_batch": 4})


def test_bad_options_name_what_is_allowed():
    for argv, match in ((["--window", "0"], "--window"), (["--window", "5", "--requests", "2"], "exclude"),
                        (["--repeats", "0"], "--repeats"), (["--systems", "limit"], "include shm"),
                        (["--model", "tiny", "--stand-in", "1,2"], "--model stand-in")):  # fmt: skip
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        with pytest.raises(ValueError, match=match):
            cli.Plan(p.parse_args(argv))


# -- the tables from given numbers ----------------------------------------------------------------


def _result(system: str, n: int, audio_s_per_s: float, rss: float | None, **kw) -> run_results.RunResult:
    base = dict(system=system, n_clients=n, requests=10, failed=0, tokens=500,
                audio_seconds=10.0, wall_seconds=10 / audio_s_per_s,
                audio_s_per_s=audio_s_per_s, requests_per_s=audio_s_per_s,
                latency_p50_ms=100.0, latency_p99_ms=200.0, avg_batch_size=1.0,
                batch_size_histogram={}, peak_rss_mib=rss, cpu_seconds=1.0,
                others_cpu_share=0.1, threads="1", policy={})  # fmt: skip
    base.update(kw)
    return run_results.RunResult(**base)


def test_summarise_takes_median_min_max_of_what_was_measured():
    assert reporting.summarise([3.0, None, 1.0, 2.0, float("nan")]) == {
        "median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "values": [3.0, 1.0, 2.0]}  # fmt: skip
    assert reporting.summarise([1.0, 4.0])["median"] == 2.5
    assert reporting.summarise([None]) is None


def test_ratios_are_taken_per_repeat_then_summarised():
    shm, own = (1.0, 0.9, 1.2), (0.5, 1.0, 0.8)
    results = [r for k in range(3) for r in (
        _result(config.SHM, 8, shm[k], 1000.0, repeat=k, latency_p99_ms=100.0 * (k + 1)),
        _result(config.PER_PROCESS, 8, own[k], 4000.0, repeat=k))]  # fmt: skip
    comparison = reporting.compare(results)
    s = comparison[8][config.SHM]["vs_per_process"]
    # Per repeat 2.0, 0.9, 1.5: the median is 1.5 (the ratio of the medians would be 1.25).
    assert (s["median"], s["min"], s["max"], s["n"]) == pytest.approx((1.5, 0.9, 2.0, 3))
    assert comparison[8][config.SHM]["memory_vs_per_process"]["median"] == 0.25
    assert comparison[8][config.SHM]["vs_limit"] is None  # no limit ran
    (row,) = [r for r in reporting.summary(results) if r["system"] == config.SHM]
    assert row["runs"] == 3 and row["latency_p99_ms"]["median"] == 200.0
    assert (row["audio_s_per_s"]["min"], row["audio_s_per_s"]["max"]) == (0.9, 1.2)
    text = reporting.format_table(results, comparison)
    assert "1.50 (0.90-2.00)" in text and "200 (100-300)" in text


def test_target_lines_only_for_the_n_that_ran():
    mix = workload.parse_mix(workload.DEFAULT_MIX)

    def run(n: int, speed: float, rss: float, **kw) -> list[run_results.RunResult]:
        return [_result(config.SHM, n, speed, rss, **kw), _result(config.LIMIT, n, 1.0, 900.0),
                _result(config.PER_PROCESS, n, 0.5, 8000.0), _result(config.QUEUE, n, 0.6, 1100.0)]

    small = reporting.compare(run(1, 0.95, 1000.0) + run(2, 0.95, 1000.0))
    assert reporting.targets(small, stand_in=False, mix=mix) == []
    note = reporting.format_targets([], ran=[1, 2])
    assert note.startswith("targets: none for this run (N=1,2)") and "\nN=" not in note
    fast = reporting.compare(run(2, 0.95, 1000.0) + run(8, 0.95, 1000.0))
    t = reporting.targets(fast, stand_in=False, mix=mix)
    assert [(v["key"], v["n_clients"], v["met"]) for v in t] == [
        ("vs_per_process", 8, True), ("memory_vs_per_process", 8, True), ("vs_limit", 8, True)]
    assert t[0]["measured"] == pytest.approx(1.9)
    lines = reporting.format_targets(t, ran=[2, 8]).splitlines()[1:]
    assert len(lines) == 3 and all(line.startswith("N=8 bicodec-shm:") for line in lines)
    assert "NOT MET" not in "\n".join(lines)
    slow = reporting.targets(reporting.compare(run(8, 0.45, 4000.0)), stand_in=False, mix=mix)
    assert [v["met"] for v in slow] == [False, False, False]
    assert reporting.format_targets(slow, ran=[8]).count("NOT MET") == 3
    # Other mixes and the stand-in have their own targets.
    assert reporting.targets(fast, stand_in=True, mix=mix) == []
    assert reporting.targets(fast, stand_in=False, mix=workload.parse_mix("25")) == []
    stand_in = reporting.compare([_result(config.SHM, 16, 0.95, 10.0),
                                  _result(config.IDEAL, 16, 1.0, None)])  # fmt: skip
    (v,) = reporting.targets(stand_in, stand_in=True, mix=mix)
    assert (v["key"], v["n_clients"], v["measured"], v["met"]) == ("vs_ideal", 16, 0.95, True)


def test_a_skipped_system_is_shown_not_compared():
    results = [_result(config.SHM, 16, 1.0, 1000.0),
               run_results._skipped(config.PER_PROCESS, 16, "skipped: needs ~17 GiB free")]  # fmt: skip
    comparison = reporting.compare(results)
    assert comparison[16][config.SHM]["vs_per_process"] is None
    assert config.PER_PROCESS not in comparison[16]
    assert "skipped: needs ~17 GiB free" in reporting.format_table(results, comparison)


def test_sweep_summary_takes_medians_and_marks_the_best():
    def run(wait: float, budget: int, speed: float, p99: float) -> run_results.RunResult:
        return _result(config.SHM, 8, speed, 1000.0, latency_p99_ms=p99,
                       policy={"max_batch": 16, "max_wait_ms": wait, "max_batch_tokens": budget})

    results = [run(0, 1024, 1.0, 900), run(0, 1024, 3.0, 700), run(0, 1024, 2.0, 800),
               run(5, 4096, 1.5, 500)]  # fmt: skip
    summary = reporting.sweep_summary(results)
    assert [(s["max_wait_ms"], s["max_batch_tokens"], s["runs"]) for s in summary] == [
        (0, 1024, 3), (5, 4096, 1)]  # fmt: skip
    assert summary[0]["audio_s_per_s"] == 2.0 and summary[0]["latency_p99_ms"] == 800
    lines = reporting.format_sweep(results).splitlines()
    assert "best throughput" in lines[2] and "best p99" in lines[3]


# -- the lent GPU machine's needs (benchmarks/device_check.sh) ----------------------------------


def test_per_process_memory_check_takes_the_machines_memory_and_a_max_n(monkeypatch):
    """A VM whose memory grows on use reports little available at first: --memory-gib says
    what it has. --per-process-max-n drops the decoder per process above an N."""
    setup = config.Setup(preset="spark-tts-0.5b", seed=0, mix=workload.parse_mix("25-50"), cores=16,
                         policy=config.Policy(), sample_interval=0.05, timeout=60, window=1.0)  # fmt: skip
    monkeypatch.setattr(psutil, "virtual_memory", lambda: argparse.Namespace(available=2 * 2**30))
    assert "2.0 GiB available" in orchestrate._memory_ok(setup, 16)
    grown = config.Setup(**{**setup.__dict__, "memory_gib": 120.0, "per_process_max_n": 16})
    assert orchestrate._memory_ok(grown, 16) == ""
    assert orchestrate._memory_ok(grown, 32) == "skipped: --per-process-max-n 16"
    small = config.Setup(**{**setup.__dict__, "memory_gib": 8.0})
    assert "8.0 GiB given (--memory-gib)" in orchestrate._memory_ok(small, 16)


@pytest.mark.timeout(300)
def test_partial_results_are_saved_after_every_run(tmp_path, monkeypatch):
    """A step cut by its timeout must still leave the runs that ended: the JSON is rewritten
    after each system's run, marked partial until the last."""
    out = tmp_path / "bench.json"
    writes = []
    real_write = cli._write_json
    monkeypatch.setattr(cli, "_write_json", lambda path, report: (writes.append(dict(report)),
                                                                   real_write(path, report)))  # fmt: skip
    code = bench.main(["--model", "stand-in", "--stand-in", "2,0.01", "--systems", "shm,per-process",
                       "--n", "2", "--window", "0.3", "--repeats", "1", "--per-process-max-n", "1",
                       "--memory-gib", "64", "--no-progress", "--no-plot", "--json", str(out)])  # fmt: skip
    assert code == 0
    partial = [w for w in writes if w.get("partial")]
    assert [[r["system"] for r in w["results"]] for w in partial] == [
        [config.SHM], [config.SHM, config.PER_PROCESS]]  # fmt: skip
    assert partial[-1]["results"][1]["note"] == "skipped: --per-process-max-n 1"
    final = json.loads(out.read_text())
    assert "partial" not in final and len(final["results"]) == 3  # + the ideal batcher
    assert _live_children() == []


def test_the_json_is_written_through_a_fresh_temporary_file_never_a_link_at_path_part(tmp_path):
    """``--json PATH`` in a shared directory: a symbolic link planted at the predictable
    ``PATH.part`` must not be followed (it would overwrite the file it points to, and the
    rename would leave PATH a link to it)."""
    out, victim = tmp_path / "bench.json", tmp_path / "victim.txt"
    victim.write_text("not the benchmark's\n")
    os.symlink(victim, str(out) + ".part")
    cli._write_json(str(out), {"benchmark": "bench_throughput"})
    assert victim.read_text() == "not the benchmark's\n"
    assert not out.is_symlink() and json.loads(out.read_text()) == {"benchmark": "bench_throughput"}
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.json.part", "victim.txt"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_every_benchmark_system_loads_its_model_with_the_servers_cuda_math(monkeypatch):
    """The limit, per-process and queue systems build their models in load_model, as the
    bicodec-shm server's process does: on CUDA each gets exact_cuda_math (no TF32), not
    cuDNN's TF32 default, which would make every ratio against them spuriously low."""
    import torch

    from bicodec_shm.model import BiCodecDecoder
    from bicodec_shm.model.devices import uses_exact_cuda_math
    from bicodec_shm.tools.bench import decoding

    class Stub:
        def to(self, device):
            self.device = device
            return self

        def detokenize(self, *args):
            return None

    monkeypatch.setattr(BiCodecDecoder, "from_config", classmethod(lambda cls, *a, **k: Stub()))
    monkeypatch.setenv(decoding.DEVICE_ENV, "cuda:0")
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)  # fmt: skip
    try:
        torch.backends.cudnn.allow_tf32 = True
        assert not uses_exact_cuda_math()
        model = decoding.load_model(config.ModelSpec("tiny"), threads=torch.get_num_threads())
        assert model.device == torch.device("cuda:0")
        assert uses_exact_cuda_math()
    finally:
        (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved


def test_dispatch_and_batching_values_become_shm_variants_with_lanes():
    variants = cli.shm_variants([], cli._lane_counts("auto,2"), ("auto", "wait"), ("static",))
    assert [v.label for v in variants] == [
        "bicodec-shm (lanes=auto, dispatch=auto, batching=static)",
        "bicodec-shm (lanes=auto, dispatch=wait, batching=static)",
        "bicodec-shm (lanes=2, dispatch=auto, batching=static)",
        "bicodec-shm (lanes=2, dispatch=wait, batching=static)"]  # fmt: skip
    assert variants[3].server_options == {"lanes": 2, "dispatch": "wait", "batching": "static"}
    assert variants[0].server_options == {"dispatch": "auto", "batching": "static"}
    with pytest.raises(ValueError, match="not both"):
        cli.shm_variants([("dispatch", "wait")], None, ("auto",))
    with pytest.raises(argparse.ArgumentTypeError, match="auto, pipeline, wait"):
        cli._policy_names(("auto", "pipeline", "wait"))("auto,sometimes")
    assert cli._stand_in_costs("4,0.006,async") == (4.0, 0.006, True)
    assert cli._stand_in_costs("4,0.006") == (4.0, 0.006, False)
    with pytest.raises(argparse.ArgumentTypeError, match="A_MS,B_MS"):
        cli._stand_in_costs("4,0.006,sync")
