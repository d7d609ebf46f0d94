"""examples/orpheus_tts, examples/spark_tts and examples/qwen3_tts, briefly: 2 worker processes
per mode, tiny codecs, a fast stand-in language model. Each example starts its own server process
and stops it, and gives each mode every core; the run must finish, return all the audio, and
leave nothing in /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from bicodec_shm.protocol.names import leftover_objects


def run_example(module: str, tmp_path, *options: str) -> dict:
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", module, "--workers", "2", "--utterances", "2",
                           "--rate", "2000", "--json", str(out), *options],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert "load average" in result["machine"] and "TTFA p50" in proc.stdout
    rows = result["rows"]
    assert [(r["mode"], r["streams"], r["utterances"]) for r in rows] == [("own", 2, 4), ("shared", 2, 4)]
    for r in rows:
        assert 0 < r["ttfa_p50_ms"] <= r["ttfa_max_ms"] and r["audio_s_per_s"] > 0
    assert rows[0]["server"] is None and rows[1]["server"].startswith("bcshm-example-")
    # Both modes use every core: two own decoders a half each, the one server all of them.
    assert [r["threads"] for r in rows] == [max(1, os.cpu_count() // 2), os.cpu_count()]
    assert leftover_objects(rows[1]["server"]) == []
    return rows


def test_orpheus_example_runs_both_decoders_and_returns_every_frame(tmp_path):
    rows = run_example("examples.orpheus_tts.run", tmp_path, "--frames", "8")
    for r in rows:
        assert r["audio_s"] == pytest.approx(4 * 8 * 2048 / 24000)


def test_spark_example_runs_both_decoders_and_returns_every_sample(tmp_path):
    rows = run_example("examples.spark_tts.run", tmp_path, "--tokens", "30")
    for r in rows:
        assert r["audio_s"] == pytest.approx(4 * 30 * 320 / 16000)
        assert r["chunks"] == 4  # Spark-TTS returns each utterance whole


def test_qwen3_example_runs_both_decoders_and_returns_every_frame(tmp_path):
    rows = run_example("examples.qwen3_tts.run", tmp_path, "--frames", "8")
    for r in rows:
        assert r["audio_s"] == pytest.approx(4 * 8 * 1920 / 24000)
        assert r["ttfa_p50_ms"] <= r["ttfa_p95_ms"] <= r["ttfa_max_ms"]
