"""Smoke test of benchmarks/bench_ipc.py: a few round trips of each transport, nothing left over."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from bicodec_shm.transport import leftover_objects

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_ipc.py")


def _load_module():
    spec = importlib.util.spec_from_file_location("bench_ipc_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_bench_ipc_runs_end_to_end(tmp_path):
    out = tmp_path / "bench_ipc.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--iterations", "20", "--warmup", "2", "--rounds", "2",
         "--no-progress", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for row in ("semaphore floor", "bicodec-shm", "multiprocessing.Pipe", "multiprocessing.Queue",
                "bicodec-shm median <=",
                "Queue round trip / bicodec-shm round trip at batch 1 >= 3x",
                "server CPU per request at batch 16 <= 20 us (16 clients, avg batch"):  # fmt: skip
        assert row in proc.stdout
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"semaphore floor", "bicodec-shm", "multiprocessing.Pipe",
                                      "multiprocessing.Queue"}  # fmt: skip
    for stats in report["results"].values():
        assert stats["n"] == 20
        assert 0 < stats["p10_us"] <= stats["median_us"] <= stats["p90_us"]
    assert set(report["comparison"]["targets"]) == {"bicodec_shm_within_floor", "faster_than_queue",
                                                    "server_cpu_at_batch_16"}  # fmt: skip
    assert report["bicodec_shm_server"]["avg_batch_size"] >= 1
    # The concurrent rows: every client's round trips, served in batches of up to K.
    rows = {r["clients"]: r for r in report["concurrent"]}
    assert set(rows) == {4, 16}
    for k, r in rows.items():
        assert r["n"] == k * max(1, 20 // k)
        assert r["server_requests"] >= r["n"] and 1 <= r["avg_batch_size"] <= k
        assert r["server_cpu_us"] > 0 and r["client_cpu_us"] > 0 and r["requests_per_s"] > 0
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"]
    assert len(report["child_exitcodes"]["16 clients"]) == 17  # 16 clients and their server
    assert all(code == 0 for codes in report["child_exitcodes"].values() for code in codes)
    assert report["client_imported_torch"] is False
    assert report["shm_names"]
    for name in report["shm_names"]:
        assert leftover_objects(name) == []


def test_table_and_targets_from_numbers():
    bench = _load_module()
    stats = {
        bench.FLOOR: bench.summarize({"samples": [10e-6] * 5, "client_cpu_s": 5e-5}),
        bench.SHM: bench.summarize({"samples": [14e-6] * 5}),
        bench.QUEUE: bench.summarize({"samples": [50e-6] * 5}),
    }
    concurrent = [
        bench.summarize_concurrent({"clients": 16, "samples": [1e-3] * 32, "wall_s": 0.016,
                                    "client_cpu_s": 32e-5, "server_cpu_s": 32 * 18e-6,
                                    "server": {"requests": 32, "batches": 2}}),
    ]  # fmt: skip
    assert concurrent[0]["server_cpu_us"] == 18.0 and concurrent[0]["avg_batch_size"] == 16
    assert concurrent[0]["requests_per_s"] == 2000 and concurrent[0]["client_cpu_us"] == 10.0
    comparison = bench.compare(stats, concurrent)
    targets = comparison["targets"]
    assert targets["bicodec_shm_within_floor"]["met"] is True  # 1.4x <= 1.5x
    assert abs(targets["faster_than_queue"]["measured"] - 50 / 14) < 1e-9
    assert targets["faster_than_queue"]["met"] is True
    assert targets["server_cpu_at_batch_16"]["measured"] == 18.0
    assert targets["server_cpu_at_batch_16"]["met"] is True  # 18 us <= 20 us
    table = bench.format_table(stats, comparison, concurrent=concurrent)
    assert "1.40x" in table and "NOT MET" not in table and "18.00 us  met" in table
    assert stats[bench.FLOOR]["client_cpu_us"] == 10.0
    # Without a 16-client row there is no line for that target.
    assert "server_cpu_at_batch_16" not in bench.compare(stats, concurrent=[])["targets"]
