"""``bicodec_shm.bench`` (``bicodec-shm bench``): the quick run end to end, the sweep, cleanup
on failure and on Ctrl-C, and the arithmetic of the tables from given numbers."""

from __future__ import annotations

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

from bicodec_shm import bench
from bicodec_shm.bench import config, report, sampling, systems, workload
from bicodec_shm.transport import leftover_objects

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
def test_quick_run_covers_every_system_and_leaves_nothing(tmp_path):
    before = _ours_in_dev_shm()
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = bench.main(["--quick", "--no-progress", "--json", str(out), "--plot", str(png)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["config"]["preset"] == "tiny"
    assert report["config"]["n_clients"] == [1, 2]
    assert report["config"]["threads"]["per_process"] == {
        "1": systems.per_process_threads(report["config"]["cores"], 1),
        "2": systems.per_process_threads(report["config"]["cores"], 2),
    }
    results = report["results"]
    for n in (1, 2):
        rows = {r["system"]: r for r in results if r["n_clients"] == n}
        assert set(rows) == set(config.SYSTEMS), n
        for system, r in rows.items():
            assert r["audio_s_per_s"] > 0 and r["requests_per_s"] > 0, (n, system)
            assert r["requests"] == n * config.QUICK_REQUESTS, (n, system)
            assert r["failed"] == 0
            assert r["peak_rss_mib"] > 0
            if system != config.LIMIT:
                assert 0 < r["latency_p50_ms"] <= r["latency_p99_ms"]
        # The limit replays exactly the batches bicodec-shm formed.
        shm, limit = rows[config.SHM], rows[config.LIMIT]
        assert limit["tokens"] == shm["tokens"]
        assert limit["avg_batch_size"] == pytest.approx(shm["avg_batch_size"])
        assert rows[config.PER_PROCESS]["avg_batch_size"] == 1.0
        ratios = report["comparison"][str(n)]
        assert ratios[config.LIMIT]["vs_limit"] == pytest.approx(1.0)
        assert ratios[config.PER_PROCESS]["vs_per_process"] == pytest.approx(1.0)
    assert set(report["targets"]) == set(config.TARGETS)
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
    else:
        assert png.stat().st_size > 0


@pytest.mark.timeout(300)
def test_sweep_reports_each_policy(tmp_path):
    out = tmp_path / "sweep.json"
    code = bench.main(["--quick", "--sweep", "--n", "2", "--sweep-wait", "0,5",
                       "--sweep-tokens", "4096", "--no-progress", "--json", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert [(s["max_wait_ms"], s["max_batch_tokens"]) for s in summary] == [(0, 4096), (5, 4096)]
    for s in summary:
        assert s["runs"] == 1 and s["audio_s_per_s"] > 0 and s["latency_p99_ms"] > 0
    assert {r["system"] for r in report["results"]} == {config.SHM}
    assert report["left_in_dev_shm"] == []
    assert _live_children() == []


def test_a_failing_server_stops_the_run_and_cleans_up():
    """A child that raises stops the run with its traceback; processes and /dev/shm are cleaned."""
    from tqdm import tqdm

    setup = config.Setup(preset="no-such-preset", seed=0, mix=workload.parse_mix("25-30"), cores=1,
                        policy=config.Policy(), sample_interval=0.05, timeout=60)  # fmt: skip
    sampler = sampling._Sampler(0.05)
    names: list[str] = []
    try:
        with pytest.raises(RuntimeError, match="bicodec-shm server failed"):
            systems.bench_shm(setup, [[25], [30]], ctx=mp.get_context("spawn"), sampler=sampler,
                            bar=tqdm(disable=True), names=names)  # fmt: skip
    finally:
        sampler.stop()
    assert len(names) == 1 and leftover_objects(names[0]) == []
    assert _live_children() == []


@pytest.mark.timeout(300)
def test_ctrl_c_cleans_up_every_process_and_object(tmp_path):
    """SIGINT to the whole process group (a terminal's Ctrl-C) while a server is serving."""
    before = _ours_in_dev_shm()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bicodec_shm.bench", "--quick", "--no-progress", "--no-plot",
         "--json", str(tmp_path / "x.json")],
        cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
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
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
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


def test_requests_per_client_and_threads():
    assert workload.requests_per_client(4, 7) == 7
    assert workload.requests_per_client(1, None) == workload.TOTAL_REQUESTS
    assert workload.requests_per_client(64, None) == workload.MIN_REQUESTS
    assert [systems.per_process_threads(2, n) for n in (1, 2, 4, 16)] == [2, 1, 1, 1]
    assert [systems.per_process_threads(8, n) for n in (1, 2, 4, 16)] == [8, 4, 2, 1]


# -- the tables from given numbers ----------------------------------------------------------------


def _result(system: str, n: int, audio_s_per_s: float, rss: float, **kw) -> systems.RunResult:
    base = dict(system=system, n_clients=n, requests=10, failed=0, tokens=500,
                audio_seconds=10.0, wall_seconds=10 / audio_s_per_s,
                audio_s_per_s=audio_s_per_s, requests_per_s=audio_s_per_s,
                latency_p50_ms=100.0, latency_p99_ms=200.0, avg_batch_size=1.0,
                batch_size_histogram={}, peak_rss_mib=rss, cpu_seconds=1.0,
                others_cpu_share=0.1, threads="1", policy={})  # fmt: skip
    base.update(kw)
    return systems.RunResult(**base)


def test_compare_and_targets():
    results = [
        _result(config.SHM, 8, 0.95, 1000.0, avg_batch_size=3.5),
        _result(config.LIMIT, 8, 1.0, 900.0, latency_p50_ms=None, latency_p99_ms=None),
        _result(config.PER_PROCESS, 8, 0.5, 8000.0),
        _result(config.QUEUE, 8, 0.6, 1100.0),
    ]
    comparison = report.compare(results)
    shm = comparison[8][config.SHM]
    assert shm["vs_limit"] == pytest.approx(0.95)
    assert shm["vs_per_process"] == pytest.approx(1.9)
    assert shm["memory_vs_per_process"] == pytest.approx(0.125)
    t = report.targets(comparison)
    assert all(v["met"] for v in t.values())
    text = report.format_table(results, comparison)
    assert "1.90" in text and "0.95" in text and "0.12" in text
    assert "NOT MET" not in report.format_targets(t)
    slow = report.compare([_result(config.SHM, 8, 0.5, 4000.0), *results[1:]])
    t = report.targets(slow)
    assert [v["met"] for v in t.values()] == [False, False, False]
    assert report.format_targets(t).count("NOT MET") == 3
    assert all(v["met"] is None for v in report.targets(comparison, n=4).values())


def test_a_skipped_system_is_shown_not_compared():
    results = [_result(config.SHM, 16, 1.0, 1000.0),
               systems._skipped(config.PER_PROCESS, 16, "skipped: needs ~17 GiB free")]  # fmt: skip
    comparison = report.compare(results)
    assert comparison[16][config.SHM]["vs_per_process"] is None
    assert config.PER_PROCESS not in comparison[16]
    assert "skipped: needs ~17 GiB free" in report.format_table(results, comparison)


def test_sweep_summary_takes_medians_and_marks_the_best():
    def run(wait: float, budget: int, speed: float, p99: float) -> systems.RunResult:
        return _result(config.SHM, 8, speed, 1000.0, latency_p99_ms=p99,
                       policy={"max_batch": 16, "max_wait_ms": wait, "max_batch_tokens": budget})

    results = [run(0, 1024, 1.0, 900), run(0, 1024, 3.0, 700), run(0, 1024, 2.0, 800),
               run(5, 4096, 1.5, 500)]  # fmt: skip
    summary = report.sweep_summary(results)
    assert [(s["max_wait_ms"], s["max_batch_tokens"], s["runs"]) for s in summary] == [
        (0, 1024, 3), (5, 4096, 1)]  # fmt: skip
    assert summary[0]["audio_s_per_s"] == 2.0 and summary[0]["latency_p99_ms"] == 800
    lines = report.format_sweep(results).splitlines()
    assert "best throughput" in lines[2] and "best p99" in lines[3]
