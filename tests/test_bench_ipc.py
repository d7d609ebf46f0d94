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
                "bicodec-shm median <=", "Queue median >="):  # fmt: skip
        assert row in proc.stdout
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"semaphore floor", "bicodec-shm", "multiprocessing.Pipe",
                                      "multiprocessing.Queue"}  # fmt: skip
    for stats in report["results"].values():
        assert stats["n"] == 20
        assert 0 < stats["p10_us"] <= stats["median_us"] <= stats["p90_us"]
    assert set(report["comparison"]["targets"]) == {"bicodec_shm_within_floor", "faster_than_queue"}
    assert report["bicodec_shm_server"]["avg_batch_size"] >= 1
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
    comparison = bench.compare(stats)
    targets = comparison["targets"]
    assert targets["bicodec_shm_within_floor"]["met"] is True  # 1.4x <= 1.5x
    assert abs(targets["faster_than_queue"]["measured"] - 50 / 14) < 1e-9
    assert targets["faster_than_queue"]["met"] is True
    table = bench.format_table(stats, comparison)
    assert "1.40x" in table and "NOT MET" not in table
    assert stats[bench.FLOOR]["client_cpu_us"] == 10.0
