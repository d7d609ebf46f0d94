"""The SNAC benchmarks run end to end on the tiny presets and write their JSON."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_snac_model  # noqa: E402
import bench_snac_streaming  # noqa: E402


def test_bench_snac_model_quick(tmp_path, capsys):
    out = tmp_path / "model.json"
    with warnings.catch_warnings():  # snac's torch.jit.script, imported for the vs-snac check
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        assert bench_snac_model.main(["--variant", "tiny-32khz", "--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["frames"], r["batch"]) for r in result["results"]] == [(4, 1), (4, 2)]
    assert result["quality"]["batched_vs_lone_max_abs"] <= 1e-5
    assert result["quality"]["vs_snac_max_abs"] <= 1e-5
    assert "GFLOP per frame" in capsys.readouterr().out


def test_bench_snac_streaming_runs(tmp_path, capsys):
    out = tmp_path / "streaming.json"
    assert bench_snac_streaming.main(["--variants", "tiny-24khz", "--frames", "9", "--json", str(out)]) == 0
    rows = {r["preset"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"default", "exact", "peers"}
    assert rows["exact"]["max_abs"] <= 1e-5 and rows["peers"]["snr_db"] < rows["default"]["snr_db"]
