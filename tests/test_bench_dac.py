"""The DAC benchmarks run end to end on the tiny presets and write their JSON: ``bicodec-shm bench
--codec dac-44khz`` (the engine of the BiCodec bench) and bench_dac_streaming."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bicodec_shm.codecs import DAC_24KHZ
from bicodec_shm.model.dac import DACDecoder
from bicodec_shm.server.adapters import codec_adapter
from bicodec_shm.tools import bench
from bicodec_shm.tools.bench import config, decoding, workload

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_dac_streaming  # noqa: E402


def _ours_in_dev_shm() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if config.NAME_PREFIX in e}


@pytest.mark.timeout(300)
def test_bench_codec_dac_runs_the_bench_engine(tmp_path, capsys):
    """Tiny dac-44khz, N = 2, 2 s windows, short requests: the server, its no-IPC limit (replaying
    the server's own batches) and a decoder per process all decode DAC requests, in frames."""
    before = _ours_in_dev_shm()
    out = tmp_path / "bench.json"
    code = bench.main(["--codec", "dac-44khz", "--quick", "--n", "2", "--window", "2",
                       "--mix", "8-20:0.8,30-60:0.2", "--systems", "shm,limit,per-process",
                       "--no-progress", "--no-plot", "--json", str(out)])  # fmt: skip
    assert code == 0
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert (report["config"]["codec"], report["config"]["preset"]) == ("dac-44khz", "tiny-44khz")
    runs = {r["system"]: r for r in report["results"]}
    assert set(runs) == {config.SHM, config.LIMIT, config.PER_PROCESS}
    for r in runs.values():
        assert r["requests"] > 0 and r["failed"] == 0, r
        assert r["audio_seconds"] == pytest.approx(r["tokens"] * 512 / 44100)
    assert runs[config.LIMIT]["batch_size_histogram"] == runs[config.SHM]["batch_size_histogram"]
    assert "targets: none for dac-44khz" in stdout and "decoder per process" in stdout
    assert report["left_in_dev_shm"] == [] and _ours_in_dev_shm() == before


def test_the_bench_decodes_without_a_server_as_the_server_does():
    """``decoding.as_batch`` + DAC's adapter (the limit, the decoder per process and the queue
    server): each row of a padded DAC 24 kHz batch is its lone decode."""
    model = DACDecoder.from_config("tiny-24khz", seed=0)
    rng = np.random.default_rng(0)
    requests = [workload.random_request(rng, DAC_24KHZ, n) for n in (7, 2, 5)]
    audio = decoding.decode_rows(codec_adapter(model), decoding.as_batch(requests, DAC_24KHZ))
    assert audio.shape == (3, 7 * 320 - 8)
    for row, r in zip(audio, requests):
        lone = model.detokenize(torch.from_numpy(np.stack(r.levels))[None])[0].numpy()
        np.testing.assert_allclose(row[: len(lone)], lone, atol=1e-5, rtol=0)
        assert not row[len(lone) :].any()


def test_bench_dac_streaming_quick(tmp_path, capsys):
    out = tmp_path / "streaming.json"
    argv = ["--preset", "tiny", "--variants", "dac-16khz", "--frames", "30", "--settings", "4,10,8",
            "--json", str(out)]  # fmt: skip
    assert bench_dac_streaming.main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["preset"]: r for r in result["results"]}
    assert set(rows) == {"default", "exact", "peers", "custom"}
    assert rows["exact"]["max_abs"] <= 1e-5 and rows["exact"]["max_lsb"] <= 1
    assert rows["custom"]["settings"]["chunk_tokens"] == 4
    assert "max LSB" in capsys.readouterr().out
