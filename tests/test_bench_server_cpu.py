"""Smoke test of benchmarks/bench_server_cpu.py: a real server and clients in one process, the
server's CPU split by step, nothing left in /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bicodec_shm.protocol.names import leftover_objects

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_server_cpu.py")


def test_bench_server_cpu_splits_the_server_cpu_by_step(tmp_path):
    out = tmp_path / "cpu.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--batches", "1,3", "--no-progress",
                           "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert sorted(result["rows"]) == ["1", "3"]
    for row in result["rows"].values():
        assert row["server_cpu_us"] > 0 and row["decoder_call_alone_warm_us"] > 0
        split = row["split_us"]
        # Every step ran (each is timed only when the lane calls it), and the steps of depth 0
        # cannot add up to more than the timed pass's total.
        assert all(v > 0 for v in split.values()), split
        top = ("take (a batch from the slot table)", "lane started (counters)", "launch", "publish",
               "lane finished (counters)")  # fmt: skip
        assert sum(split[k] for k in top) <= row["server_cpu_us_with_timers"] * 1.01
    for line in ("total (plain pass)", "    int16 conversion", "decoder call alone, warm"):
        assert any(text.startswith(line) for text in proc.stdout.splitlines()), line
    assert result["left_in_dev_shm"] == [] and len(result["shm_names"]) == 4
    assert all(leftover_objects(name) == [] for name in result["shm_names"])
