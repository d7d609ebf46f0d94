"""A CPU server builds the kernels of its clients' first windows before it serves
(server/kernel_warmup.py): which shapes, at which thread counts, within which time, what a
failed warm-up costs, and that ``bicodec-shm serve`` asks for them and for a larger oneDNN cache.

Whether the warm-up pays (first audio of four streams opening at once) is measured in
benchmarks/RESULTS.md ("Kernels built before serving"), not asserted here.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from support import reference_model, seed_int16, single_decode

from bicodec_shm import DecoderClient
from bicodec_shm.client.stream_settings import CODEC_PRESETS, StreamSettings
from bicodec_shm.client.streaming import DecodeStream
from bicodec_shm.codecs.layout import get_layout
from bicodec_shm.deploy import processes
from bicodec_shm.protocol.names import leftover_objects
from bicodec_shm.server.adapters import BiCodecAdapter
from bicodec_shm.server.kernel_warmup import KERNEL_CACHE_CAPACITY, warm_up
from bicodec_shm.server.lane_control import LaneControl
from bicodec_shm.server.server import DecoderServer
from bicodec_shm.tools.cli import main


class _WindowLog:
    """A stand-in client of ``codec`` that records each window's length and returns silence."""

    def __init__(self, codec: str) -> None:
        self.codec = get_layout(codec)
        self.max_tokens = 100_000
        self.widths: list[int] = []

    def decode(self, semantic_ids, global_ids, **_):
        self.widths.append(len(semantic_ids))
        return np.zeros(self.codec.decoded_samples(len(semantic_ids)), np.float32)

    def decode_codes(self, levels, **_):
        frames = len(levels[0]) // self.codec.level_rates[0]
        self.widths.append(frames)
        return np.zeros(self.codec.decoded_samples(frames), np.float32)

    async def decode_async(self, semantic_ids, global_ids, **_):
        return self.decode(semantic_ids, global_ids)

    async def decode_codes_async(self, levels, **_):
        return self.decode_codes(levels)


@pytest.mark.parametrize("codec", ["bicodec", "snac-24khz", "snac-32khz", "dac-44khz", "qwen3-tts-12hz"])
@pytest.mark.parametrize("preset", ["default", "exact", "peers"])
def test_opening_windows_are_the_windows_a_stream_sends_first(codec, preset):
    """Tokens pushed one at a time: the first windows a ``DecodeStream`` sends have the lengths
    ``StreamSettings.opening_windows`` predicts (the ramp of a first chunk included)."""
    log = _WindowLog(codec)
    layout = log.codec
    stream = DecodeStream(log, np.zeros(layout.n_global, np.int64) if codec == "bicodec" else None,
                          preset=preset)  # fmt: skip
    settings = CODEC_PRESETS[codec][preset]
    frame = 0 if codec == "bicodec" else [np.zeros(r, np.int64) for r in layout.level_rates]
    while len(log.widths) < 4:
        stream.push([frame] if codec == "bicodec" else frame)
    assert log.widths[:4] == settings.opening_windows(4)


def test_opening_windows_of_the_default_presets():
    """The shapes a server builds before serving (the first three of each codec's default)."""
    want = {"bicodec": [45, 70, 70], "snac-24khz": [4, 6, 7], "dac-44khz": [16, 24, 26],
            "qwen3-tts-12hz": [2, 4, 8]}  # fmt: skip
    for codec, widths in want.items():
        assert StreamSettings.preset("default", codec).opening_windows(3) == widths


class _Recording:
    """A BiCodec decoder whose adapter records each decode's (rows, frames, threads) and when
    it started, sleeping ``cost`` seconds a decode; it fails while ``failing`` is set."""

    def __init__(self, cost: float = 0.0, failing: bool = False) -> None:
        self.model = reference_model()
        self.calls: list[tuple[int, int, int]] = []
        self.starts: list[float] = []
        self.cost = cost
        self.failing = failing
        self.device = torch.device("cpu")

    def codec_adapter(self):
        recording, adapter = self, BiCodecAdapter(self.model)

        class Adapter:
            layout = adapter.layout

            def detokenize(self, batch):
                recording.starts.append(time.perf_counter())
                recording.calls.append((*batch.semantic.shape, torch.get_num_threads()))
                if recording.failing:
                    raise RuntimeError("planted failure")
                time.sleep(recording.cost)
                return adapter.detokenize(batch)

        return Adapter()


def test_warm_up_decodes_the_first_windows_first_at_every_thread_count_and_restores_threads():
    decoder = _Recording()
    torch.set_num_threads(3)
    try:
        done = warm_up(decoder, [8, 3, 3, 0], rows=2, thread_counts=[2, 1])
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(1)
    want = [(1, 3, 1), (1, 3, 2), (2, 3, 1), (2, 3, 2), (1, 8, 1), (1, 8, 2), (2, 8, 1), (2, 8, 2)]
    assert decoder.calls == want and list(done.shapes) == want and done.planned == len(want)


def test_warm_up_starts_no_shape_after_its_budget():
    decoder = _Recording(cost=0.05)
    t0 = time.perf_counter()
    done = warm_up(decoder, [2, 4, 8], rows=4, thread_counts=[1], budget_s=0.12)
    assert 1 <= len(done.shapes) < done.planned == 12
    assert all(start - t0 < 0.12 for start in decoder.starts)
    assert len(decoder.calls) == len(done.shapes)


def test_lanes_may_decode_at_one_thread_and_at_each_arrangements_share_of_the_cores():
    def counts(lanes, cores, pipelined=False):
        control = LaneControl(lanes, cores=cores, tunable=True, pipelined=pipelined, tuning=None,
                              on_change=lambda n: None)  # fmt: skip
        return control.thread_counts()

    assert counts(None, 8) == [1, 2, 4, 8]  # the tuner's 1, 2 and 4 lanes, and a lone short request
    assert counts(1, 2) == [1, 2]  # one lane of two threads; a lone short request on one
    assert counts(None, 1) == [1]
    assert counts(1, 2, pipelined=True) == []  # a device's lanes only launch


def test_a_cpu_server_builds_them_before_its_segment_exists(shm_name, thread_server):
    """At every thread count its lanes may use (the tuner's arrangements and one thread), 1-4
    rows, before the name serves; it then answers exactly."""
    decoder = _Recording()
    torch.set_num_threads(2)  # two cores: the tuner's arrangements run 2 and 1 threads a lane
    seen_segment = []
    original = decoder.codec_adapter

    def watching_adapter():
        adapter = original()
        inner = adapter.detokenize

        def detokenize(batch):
            seen_segment.append(leftover_objects(shm_name) != [])
            return inner(batch)

        adapter.detokenize = detokenize
        return adapter

    decoder.codec_adapter = watching_adapter
    server = thread_server(decoder, warm_up_frames=[5])
    threads = server._lanes.thread_counts()
    assert threads == [1, 2]
    assert decoder.calls[: 4 * len(threads)] == [(r, 5, t) for r in range(1, 5) for t in threads]
    assert seen_segment[: 4 * len(threads)] == [False] * (4 * len(threads))
    semantic, glb = np.arange(40) % 64, np.arange(32) % 16
    with DecoderClient(shm_name, timeout=30) as client:
        pcm = client.decode(semantic, glb)
    assert np.abs(pcm.astype(np.int32) - seed_int16(single_decode(semantic, glb))).max() <= 1


def test_a_server_without_warm_up_frames_or_on_a_device_builds_nothing(shm_name, thread_server):
    decoder = _Recording()
    server = thread_server(decoder)
    assert decoder.calls == []
    server.stop()
    device = _Recording()
    device.device_shaped = True  # served as a GPU is: its kernels are not oneDNN's
    DecoderServer(device, shm_name + "-d", warm_up_frames=[5]).close()
    assert device.calls == []


def test_a_failed_warm_up_is_logged_and_the_server_serves(shm_name, thread_server, caplog):
    decoder = _Recording(failing=True)
    with caplog.at_level(logging.WARNING, logger="bicodec_shm.server"):
        thread_server(decoder, warm_up_frames=[5])
    assert "the warm-up failed (RuntimeError: planted failure)" in caplog.text
    decoder.failing = False
    semantic, glb = np.arange(30) % 64, np.arange(32) % 16
    with DecoderClient(shm_name, timeout=30) as client:
        pcm = client.decode(semantic, glb)
    assert np.abs(pcm.astype(np.int32) - seed_int16(single_decode(semantic, glb))).max() <= 1


def _serve_briefly(argv: list[str]) -> int:
    """``bicodec-shm serve`` in this process until it serves, then SIGTERM."""
    name = argv[argv.index("--name") + 1]

    def stop_when_serving():
        try:
            processes.wait_until_serving(name, None, 60)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=stop_when_serving)
    t.start()
    rc = main(["serve", *argv])
    t.join(30)
    return rc


def test_serve_builds_the_codecs_first_windows_and_raises_the_kernel_cache(shm_name, caplog, monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    with caplog.at_level(logging.INFO, logger="bicodec_shm.server"):
        rc = _serve_briefly(["--codec", "qwen3-tts-12hz", "--preset", "tiny-12hz", "--name", shm_name,
                             "--threads", "1"])  # fmt: skip
    assert rc == 0
    assert "kernels built for 12 of 12 shapes (1-4 rows of [2, 4, 8] frames, [1] threads)" in caplog.text
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(KERNEL_CACHE_CAPACITY)


def test_serve_keeps_a_kernel_cache_size_the_environment_sets_and_warms_nothing_when_told(
    shm_name, caplog, monkeypatch
):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "2048")
    with caplog.at_level(logging.INFO, logger="bicodec_shm.server"):
        rc = _serve_briefly(["--preset", "tiny", "--name", shm_name, "--threads", "1", "--warm-up", "none"])
    assert rc == 0
    assert "kernels built" not in caplog.text
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "2048"
