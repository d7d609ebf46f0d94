"""The SNAC benchmarks run end to end on the tiny presets and write their JSON: ``bicodec-shm
bench --codec snac-24khz`` (the engine of the BiCodec bench), bench_snac_model and
bench_snac_streaming."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import without_jit_deprecation

from bicodec_shm.codecs import SNAC_24KHZ
from bicodec_shm.model.snac import SNACDecoder
from bicodec_shm.server.adapters import codec_adapter
from bicodec_shm.tools import bench
from bicodec_shm.tools.bench import config, decoding, workload

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_snac_model  # noqa: E402
import bench_snac_streaming  # noqa: E402


def _ours_in_dev_shm() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if config.NAME_PREFIX in e}


@pytest.mark.timeout(300)
def test_bench_codec_snac_runs_the_bench_engine(tmp_path, capsys):
    """Tiny snac-24khz, N = 2, 1 s windows: the server, its no-IPC limit (replaying the server's
    own batches) and a decoder per process all decode SNAC requests, counted in frames."""
    before = _ours_in_dev_shm()
    out = tmp_path / "bench.json"
    code = bench.main(["--codec", "snac-24khz", "--quick", "--n", "2", "--window", "1",
                       "--systems", "shm,limit,per-process", "--no-progress", "--no-plot",
                       "--json", str(out)])  # fmt: skip
    assert code == 0
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert (cfg["codec"], cfg["preset"]) == ("snac-24khz", "tiny-24khz")
    assert [(b["lo"], b["hi"]) for b in cfg["mix"]] == [(6, 12), (23, 70)]
    runs = {r["system"]: r for r in report["results"]}
    assert set(runs) == {config.SHM, config.LIMIT, config.PER_PROCESS}
    for r in runs.values():
        assert r["requests"] > 0 and r["failed"] == 0, r
        assert r["audio_seconds"] == pytest.approx(r["tokens"] * 2048 / 24000)
    assert runs[config.LIMIT]["batch_size_histogram"] == runs[config.SHM]["batch_size_histogram"]
    assert "targets: none for snac-24khz" in stdout and "decoder per process" in stdout
    assert report["left_in_dev_shm"] == [] and _ours_in_dev_shm() == before


def test_the_bench_decodes_without_a_server_as_the_server_does():
    """``decoding.as_batch`` + the codec's adapter (the limit, the decoder per process and the
    queue server): each row of a padded SNAC batch is its lone decode."""
    model = SNACDecoder.from_config("tiny-24khz", seed=0)
    adapter = codec_adapter(model)
    rng = np.random.default_rng(0)
    requests = [workload.random_request(rng, SNAC_24KHZ, n) for n in (7, 2, 5)]
    audio = decoding.decode_rows(adapter, decoding.as_batch(requests, SNAC_24KHZ))
    assert audio.shape == (3, 7 * 2048)
    for row, r in zip(audio, requests):
        lone = model.detokenize([torch.from_numpy(v)[None] for v in r.levels])[0].numpy()
        np.testing.assert_allclose(row[: len(lone)], lone, atol=1e-5, rtol=0)
        assert not row[len(lone) :].any()


def test_bench_snac_model_quick(tmp_path, capsys):
    out = tmp_path / "model.json"
    with without_jit_deprecation():  # snac's torch.jit.script, imported for the vs-snac check
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
