"""benchmarks/bench_encode.py: each shared row's memory and clip rate over the own row of its
worker count, and a count skipped for memory said as such (the arithmetic on given rows)."""

from __future__ import annotations

import importlib.util
import os

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_encode.py")
_spec = importlib.util.spec_from_file_location("bench_encode", SCRIPT)
bench_encode = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_encode)


def _row(mode: str, workers: int, total: float, rate: float) -> dict:
    return {"mode": mode, "workers": workers, "worker_loaded_mib": 40.0, "worker_peak_mib": 42.0,
            "server_mib": 0.0, "total_mib": total, "latency_p50_ms": 900.0, "latency_p95_ms": 950.0,
            "clips_per_s": rate}  # fmt: skip


def test_shared_rows_are_divided_by_the_own_row_of_their_worker_count():
    rows = [_row("own", 4, 8000.0, 1.0), _row("shared", 4, 2000.0, 1.2),
            {"mode": "own", "workers": 16, "skipped": "needs ~29 GiB, 22 GiB available"},
            _row("shared", 16, 2800.0, 1.3)]  # fmt: skip
    lines = bench_encode.table(rows).splitlines()
    shared4 = next(line for line in lines if line.startswith("shared") and " 4 " in line)
    assert "0.25x" in shared4 and "1.20x" in shared4
    assert any("skipped: needs ~29 GiB" in line for line in lines)
    shared16 = next(line for line in lines if line.startswith("shared") and " 16 " in line)
    assert "x" not in shared16.split("MiB")[-1]  # no own row at 16: no ratio
