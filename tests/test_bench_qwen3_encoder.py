"""benchmarks/bench_qwen3_encoder_ties.py runs end to end on the tiny preset and writes its JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_qwen3_encoder_ties  # noqa: E402


def test_bench_qwen3_encoder_ties_quick(tmp_path, capsys):
    out = tmp_path / "ties.json"
    assert bench_qwen3_encoder_ties.main(["--trials", "2", "--max-seconds", "0.3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["variant"] == "tiny" and r["trials"] == 2 and r["max_samples"] == 7200
    assert r["codes"] >= 2 * 2 * 16 and r["codes"] % 16 == 0
    assert 0 <= r["flipped"] <= r["codes"] and 0 <= r["expected"] <= r["codes"]
    assert 0 <= r["change_mean"] <= r["change_max"] < 1e-3
    under = list(r["gaps_under"].values())
    assert under == sorted(under) and under[-1] <= r["codes"]
    assert "flipped by batching" in capsys.readouterr().out
