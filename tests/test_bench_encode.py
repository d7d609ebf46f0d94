"""benchmarks/bench_encode.py: each shared row's memory and clip rate over the own row of its
worker count and codec, a count skipped for memory said as such, rows of few encodes flagged as
noise (the arithmetic on given rows), and the Qwen3-TTS 12 Hz path run end to end at tiny size."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

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


def test_each_codec_divides_by_its_own_rows():
    rows = [{**_row("own", 4, 8000.0, 1.0), "codec": "bicodec"},
            {**_row("own", 4, 4000.0, 2.0), "codec": "qwen3-tts-12hz"},
            {**_row("shared", 4, 2000.0, 1.0), "codec": "qwen3-tts-12hz"}]  # fmt: skip
    shared = next(line for line in bench_encode.table(rows).splitlines() if line.startswith("shared"))
    assert "0.50x" in shared and "0.25x" not in shared  # 2000 / 4000 and 1.0 / 2.0: Qwen3's own row


def test_a_count_is_skipped_when_its_estimate_exceeds_the_memory_allowed():
    assert bench_encode.skip_reason(16, 0.0, 14 * 1024, 22 * 1024) is None  # nothing measured yet
    assert bench_encode.skip_reason(8, 1024.0, 14 * 1024, 22 * 1024) is None
    why = bench_encode.skip_reason(16, 1024.0, 14 * 1024, 22 * 1024)
    assert why == "needs ~16.0 GiB, more than the 14.0 GiB allowed (22.0 GiB available)"


def test_rows_of_few_encodes_are_flagged_and_their_ratios_marked():
    rows = [{**_row("own", 1, 400.0, 1.0), "encodes": 2},
            {**_row("shared", 1, 100.0, 1.0), "encodes": 2},
            {**_row("own", 16, 6400.0, 1.0), "encodes": 32},
            {**_row("shared", 16, 500.0, 2.0), "encodes": 32}]  # fmt: skip
    lines = bench_encode.table(rows).splitlines()
    own1 = next(line for line in lines if line.startswith("own") and " 1 " in line)
    shared1 = next(line for line in lines if line.startswith("shared") and " 1 " in line)
    shared16 = next(line for line in lines if line.startswith("shared") and " 16 " in line)
    assert own1.endswith("few") and shared1.endswith("few") and "0.25x " in shared1 and "1.00x ?" in shared1
    assert "0.08x" in shared16 and "2.00x" in shared16
    assert "?" not in shared16 and not shared16.endswith("few")
    assert any("few: fewer than 20 encodes (fewest here: 2)" in line for line in lines)
    assert any(line.startswith("?  noise, not a result") for line in lines)
    assert "noise: " not in bench_encode.table(rows[2:])  # enough encodes: no legend


def test_an_own_qwen3_worker_encodes_24_khz_clips():
    encode, decoder = bench_encode.own_encoder("qwen3-tts-12hz", "tiny-12hz", threads=1)
    audio = bench_encode.clip(0, 0.5, bench_encode.sample_rate("qwen3-tts-12hz"))
    assert audio.shape == (12000,)
    codes = encode(audio)
    assert tuple(codes.codes.shape) == (1, 16, 7) and codes.lengths.tolist() == [7]  # ceil(12000 / 1920)
    assert type(decoder).__name__ == "Qwen3TTSDecoder"


def test_qwen3_at_tiny_size_runs_both_modes(tmp_path):
    """The whole run at tiny size: one own worker, then one client of a qwen3-tts-12hz server."""
    out = tmp_path / "encode.json"
    # In its own interpreter: the spawned workers import the script by its path.
    subprocess.run([sys.executable, SCRIPT, "--codec", "qwen3-tts-12hz", "--preset", "tiny", "--workers",
                    "1", "--clips", "1", "--seconds", "0.5", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=300, stdout=subprocess.DEVNULL)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["codec"], r["mode"], r["preset"]) for r in rows] == [
        ("qwen3-tts-12hz", "own", "tiny-12hz"), ("qwen3-tts-12hz", "shared", "tiny-12hz")]  # fmt: skip
    assert all(r["encodes"] == 1 and r["noise"] == ["few"] and r["clips_per_s"] > 0 for r in rows)
    assert rows[1]["server_mib"] > 0 and rows[1]["worker_peak_mib"] < rows[0]["worker_peak_mib"]
