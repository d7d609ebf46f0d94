"""Streaming decode: exact sample counts, the exact preset vs the lone decode, concurrent streams
through one server, and clear errors for bad input."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import asdict

import numpy as np
import pytest
from support import reference_model, seed_int16, single_decode

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.client.streaming import (
    HOP,
    PRESETS,
    RECEPTIVE_FIELD,
    DecodeStream,
    StreamFinishedError,
    StreamSettings,
)

# Measured on the tiny model (benchmarks/bench_streaming.py --quick): the exact preset is within
# 1.5e-6 of the lone decode (float rounding: window lengths change the conv algorithms' order of
# summation). Bounds keep a margin.
EXACT_TOL = 1e-5
# SNR floors against the lone decode, one sequence each, tokens pushed one at a time. Tiny model,
# 180 tokens: exact 151.6 dB, default 103.6 dB (max |Δ| 2.4e-5, under one int16 step), peers
# 13.3 dB; the default with no crossfade gives 94.9 dB, with lookahead 16 + left context 29 72 dB.
TINY_SNR_DB = {"exact": 130.0, "default": 100.0}
# Full size (spark-tts-0.5b, seed 0), 70 tokens: default 99.0 dB and 1 LSB (no crossfade: 92.0 dB
# and 3 LSB; lookahead 16 + left 29: 64.3 dB), peers 12.9 dB. The documented floor is 85 dB
# within 2 LSB (benchmarks/RESULTS.md: 92.3 dB over 2249 tokens); this sequence must do 95.
FULL_SNR_DB = {"documented": 85.0, "this sequence": 95.0}


SETTINGS = {
    "default": PRESETS["default"],
    "exact": PRESETS["exact"],
    "peers": PRESETS["peers"],
    "one-token chunks": StreamSettings(chunk_tokens=1, left_context=0, lookahead=0, crossfade=0),
    "odd": StreamSettings(chunk_tokens=7, left_context=3, lookahead=2, crossfade=500),
    "big crossfade": StreamSettings(chunk_tokens=4, left_context=9, lookahead=0, crossfade=1280),
}


@pytest.fixture(scope="module")
def full():
    from bicodec_shm.model import BiCodecDecoder

    return BiCodecDecoder.from_config("spark-tts-0.5b", seed=0)


class LocalDecoder:
    """A client stand-in whose audio for a token depends on that token only.

    Streaming must then reproduce the full decode exactly, so any gap, duplicated or shifted
    sample shows. Counts requests; can be told to fail the next ones.
    """

    def __init__(self) -> None:
        self.requests = 0
        self.fail_next = 0

    def decode(self, semantic_ids, global_ids, *, dtype="int16", timeout=None) -> np.ndarray:
        assert dtype == "float32"  # streams crossfade in float
        self.requests += 1
        if self.fail_next:
            self.fail_next -= 1
            raise TimeoutError("injected failure")
        ids = np.asarray(semantic_ids, np.float32)
        ramp = np.arange(HOP, dtype=np.float32) / HOP
        return ((ids[:, None] + ramp[None, :]) / 8192 + global_ids[0] / 1e6).reshape(-1)

    async def decode_async(self, semantic_ids, global_ids, *, dtype="int16", timeout=None):
        await asyncio.sleep(0)
        return self.decode(semantic_ids, global_ids, dtype=dtype, timeout=timeout)


def _random_pushes(rng: np.random.Generator, n: int, largest: int) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(int(rng.choice([1, 1, 2, int(rng.integers(1, largest + 1))])))
    sizes[-1] -= sum(sizes) - n
    return sizes


def _stream(stream: DecodeStream, semantic: np.ndarray, sizes: list[int], width: int = 2) -> bytes:
    """Push ``semantic`` in pieces of ``sizes``, then finish; checks the counters on the way."""
    out, i = [], 0
    for k in sizes:
        out.append(stream.push(semantic[i : i + k]))
        i += k
        assert sum(map(len, out)) == width * stream.samples_emitted
        assert stream.tokens_received == i
    out.append(stream.finish())
    return b"".join(out)


@pytest.mark.parametrize("name", SETTINGS)
def test_sample_count_and_placement_are_exact_for_any_push_sizes(name):
    settings = SETTINGS[name]
    rng = np.random.default_rng(len(name))
    decoder = LocalDecoder()
    for trial in range(6):
        n = int(rng.integers(1, 260))
        semantic, glb = rng.integers(0, 8192, n), rng.integers(0, 4096, 32)
        largest = 3 * settings.window_tokens  # some pushes span several chunks
        sizes = [1] * n if trial == 0 else _random_pushes(rng, n, largest)
        stream = DecodeStream(decoder, glb, dtype="float32", **asdict(settings))
        audio = np.frombuffer(_stream(stream, semantic, sizes, width=4), "<f4")
        assert len(audio) == HOP * n
        full = decoder.decode(semantic, glb, dtype="float32")
        np.testing.assert_allclose(audio, full, rtol=0, atol=1e-6)
        assert stream.finished and stream.samples_emitted == HOP * n


@pytest.mark.parametrize("preset", ["default", "peers"])
def test_sample_count_with_the_real_model_and_int16(preset):
    model = reference_model()
    rng = np.random.default_rng(3)
    semantic, glb = rng.integers(0, 8192, 143), rng.integers(0, 4096, 32)
    pcm = _stream(DecodeStream(model, glb, preset=preset), semantic, _random_pushes(rng, 143, 120))
    assert len(pcm) == 2 * HOP * 143


def test_exact_preset_equals_the_lone_decode():
    model = reference_model()
    rng = np.random.default_rng(5)
    semantic, glb = rng.integers(0, 8192, 230), rng.integers(0, 4096, 32)
    expected = single_decode(semantic, glb)
    for sizes in ([1] * 230, _random_pushes(rng, 230, 150)):
        stream = DecodeStream(model, glb, preset="exact", dtype="float32")
        audio = np.frombuffer(_stream(stream, semantic, sizes, width=4), "<f4")
        np.testing.assert_allclose(audio, expected, rtol=0, atol=EXACT_TOL)
        assert stream.joints, "the sequence should span several decodes"
    pcm = np.frombuffer(_stream(DecodeStream(model, glb, preset="exact"), semantic, [1] * 230), "<i2")
    assert np.abs(pcm.astype(np.int32) - seed_int16(expected)).max() <= 1


def snr_db(audio: np.ndarray, reference: np.ndarray) -> float:
    """Signal-to-error ratio of ``audio`` against ``reference`` (inf when equal)."""
    error = float(np.sum((audio.astype(np.float64) - reference) ** 2))
    return np.inf if error == 0.0 else 10 * np.log10(float(np.sum(reference.astype(np.float64) ** 2)) / error)


def lsb(pcm: np.ndarray, reference: np.ndarray) -> int:
    """Largest int16 difference between ``pcm`` and the seed's conversion of ``reference``."""
    return int(np.abs(pcm.astype(np.int32) - seed_int16(reference)).max())


def stream_one_at_a_time(model, semantic, glb, preset: str, dtype: str = "float32") -> np.ndarray:
    """The stream's output, the tokens pushed one at a time: float32 audio or int16 PCM."""
    stream = DecodeStream(model, glb, preset=preset, dtype=dtype)
    width, fmt = (4, "<f4") if dtype == "float32" else (2, "<i2")
    return np.frombuffer(_stream(stream, semantic, [1] * len(semantic), width=width), fmt)


def test_snr_floor_of_each_preset_and_the_streams_int16_is_the_seeds():
    """Tiny model: exact at float rounding, default above its floor and within 1 LSB, peers far
    worse; and each int16 stream is exactly the seed's conversion of its float32 twin."""
    model = reference_model()
    rng = np.random.default_rng(0)
    semantic, glb = rng.integers(0, 8192, 180), rng.integers(0, 4096, 32)
    expected = single_decode(semantic, glb)
    snr = {}
    for preset in ("exact", "default", "peers"):
        audio = stream_one_at_a_time(model, semantic, glb, preset)
        pcm = stream_one_at_a_time(model, semantic, glb, preset, dtype="int16")
        assert np.array_equal(pcm, seed_int16(audio)), f"{preset}: int16 is not the seed's conversion"
        snr[preset] = snr_db(audio, expected)
        if preset != "peers":
            assert snr[preset] >= TINY_SNR_DB[preset], (preset, snr)
            assert lsb(pcm, expected) <= 1, preset
    assert snr["peers"] < 20.0 and snr["default"] - snr["peers"] > 60.0, snr


@pytest.mark.slow
def test_snr_floor_of_the_default_preset_at_full_size(full):
    """Full size, where the presets were tuned (receptive field 67 tokens): default at least
    85 dB and within 2 LSB of the lone decode, peers far worse."""
    rng = np.random.default_rng(0)
    semantic, glb = rng.integers(0, 8192, 70), rng.integers(0, 4096, 32)
    expected = full.detokenize(semantic[None], glb[None])[0].numpy()
    audio = stream_one_at_a_time(full, semantic, glb, "default")
    snr, worst = snr_db(audio, expected), lsb(seed_int16(audio), expected)
    assert snr >= FULL_SNR_DB["documented"] and worst <= 2, (snr, worst)
    assert snr >= FULL_SNR_DB["this sequence"], snr
    peers = snr_db(stream_one_at_a_time(full, semantic, glb, "peers"), expected)
    assert peers < 20.0, peers


def test_async_twins_match_the_sync_calls_in_process():
    model = reference_model()
    rng = np.random.default_rng(7)
    semantic, glb = rng.integers(0, 8192, 120), rng.integers(0, 4096, 32)
    sizes = _random_pushes(rng, 120, 60)
    sync = _stream(DecodeStream(model, glb), semantic, sizes)

    async def run() -> bytes:
        stream, out, i = DecodeStream(model, glb), [], 0
        for k in sizes:
            out.append(await stream.push_async(semantic[i : i + k]))
            i += k
        out.append(await stream.finish_async())
        return b"".join(out)

    assert asyncio.run(run()) == sync


def test_concurrent_streams_through_one_server_do_not_mix(start_server, shm_name):
    start_server()
    rng = np.random.default_rng(11)
    items = [(rng.integers(0, 8192, n), rng.integers(0, 4096, 32)) for n in (150, 97, 181)]
    expected = [single_decode(sem, glb) for sem, glb in items]
    with DecoderClient(shm_name, connect_timeout=30) as client:

        async def one(sem: np.ndarray, glb: np.ndarray, seed: int) -> np.ndarray:
            local = np.random.default_rng(seed)
            stream = DecodeStream(client, glb, preset="exact", dtype="float32", chunk_tokens=20)
            out, i = [], 0
            while i < len(sem):
                k = int(local.integers(1, 30))
                out.append(await stream.push_async(sem[i : i + k]))
                i += k
                await asyncio.sleep(0)  # let the other streams push in between
            out.append(await stream.finish_async())
            return np.frombuffer(b"".join(out), "<f4")

        async def all_streams() -> list[np.ndarray]:
            return await asyncio.gather(*(one(s, g, i) for i, (s, g) in enumerate(items)))

        for audio, ref in zip(asyncio.run(all_streams()), expected, strict=True):
            np.testing.assert_allclose(audio, ref, rtol=0, atol=EXACT_TOL)
        histogram = client.get_stats()["batch_size_histogram"]
        assert max(histogram) > 1, f"no window of one stream shared a batch: {histogram}"

        # The same through threads sharing the handle, with the sync API and int16 output.
        results: dict[int, bytes] = {}
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                sem, glb = items[i]
                stream = DecodeStream(client, glb, preset="exact", chunk_tokens=15)
                results[i] = _stream(stream, sem, _random_pushes(np.random.default_rng(i), len(sem), 40))
            except BaseException as exc:  # surfaced below with the thread's traceback
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(items))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        for i, ref in enumerate(expected):
            pcm = np.frombuffer(results[i], "<i2").astype(np.int32)
            assert np.abs(pcm - seed_int16(ref)).max() <= 1


def test_bad_input_raises_clear_errors():
    decoder = LocalDecoder()
    glb = np.arange(32)
    with pytest.raises(ValueError, match="global_ids must have exactly 32 ids, got 31"):
        DecodeStream(decoder, glb[:31])
    with pytest.raises(ValueError, match=r"global_ids\[3\] = 4096 is out of range"):
        DecodeStream(decoder, [0, 0, 0, 4096] + [0] * 28)
    stream = DecodeStream(decoder, glb)
    with pytest.raises(ValueError, match=r"semantic_ids\[1\] = 8192 is out of range"):
        stream.push([5, 8192])
    with pytest.raises(ValueError, match=r"semantic_ids\[0\] = -1"):
        stream.push(np.array([-1]))
    with pytest.raises(ValueError, match="integer dtype"):
        stream.push(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="must be 1-D"):
        stream.push(np.zeros((2, 3), np.int64))
    with pytest.raises(ValueError, match="is None"):
        stream.push(None)
    assert stream.tokens_received == 0  # a rejected push buffers nothing
    assert stream.push([]) == b""
    stream.push([1, 2, 3])
    assert len(stream.finish()) == 2 * HOP * 3
    with pytest.raises(StreamFinishedError, match="finished"):
        stream.push([1])
    with pytest.raises(ValueError, match="finished"):  # StreamFinishedError is a ValueError
        stream.finish()
    with pytest.raises(StreamFinishedError):
        asyncio.run(stream.push_async([1]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"preset": "fast"}, r"unknown preset 'fast'; expected one of \['default', 'exact'"),
        ({"chunk_tokens": 0}, "chunk_tokens must be >= 1"),
        ({"lookahead": -1}, "must be >= 0"),
        ({"chunk_tokens": 2.5}, "chunk_tokens must be an int"),
        ({"left_context": 2, "crossfade": 641}, r"crossfade must be in \[0, 640\]"),
        ({"dtype": "int8"}, "dtype must be 'int16' or 'float32'"),
        ({"max_window": 60}, "70 tokens is more than max_window = 60"),
    ],
)
def test_bad_settings_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeStream(LocalDecoder(), np.zeros(32, np.int64), **kwargs)


def test_bad_decoder_raises():
    with pytest.raises(ValueError, match="DecoderClient or a BiCodecDecoder"):
        DecodeStream(object(), np.zeros(32, np.int64))


def test_failed_decode_leaves_the_stream_retryable():
    decoder = LocalDecoder()
    rng = np.random.default_rng(1)
    semantic, glb = rng.integers(0, 8192, 120), rng.integers(0, 4096, 32)
    stream = DecodeStream(decoder, glb, dtype="float32")
    out = [stream.push(semantic[:30])]
    decoder.fail_next = 1
    with pytest.raises(TimeoutError):
        stream.push(semantic[30:100])
    assert stream.tokens_received == 100
    out += [stream.push([]), stream.push(semantic[100:])]
    decoder.fail_next = 1
    with pytest.raises(TimeoutError):
        stream.finish()
    assert not stream.finished
    out.append(stream.finish())
    audio = np.frombuffer(b"".join(out), "<f4")
    np.testing.assert_allclose(audio, decoder.decode(semantic, glb, dtype="float32"), atol=1e-6)


def test_presets():
    exact, peers, default = PRESETS["exact"], PRESETS["peers"], PRESETS["default"]
    assert exact.left_context >= RECEPTIVE_FIELD and exact.lookahead >= RECEPTIVE_FIELD
    assert (peers.chunk_tokens, peers.left_context, peers.lookahead, peers.crossfade) == (
        50, 5, 0, 1600)  # fmt: skip
    assert default.first_audio_tokens <= peers.first_audio_tokens
