"""Streaming DAC: a ``DecodeStream`` over a ``DACDecoder`` in process and over a DAC server.

The full single decode is the ground truth: the exact preset equals it up to float rounding,
the others keep exact sample counts and their measured SNR floor.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from support import seed_int16

from bicodec_shm.client.streaming import CODEC_PRESETS, DecodeStream
from bicodec_shm.codecs import LAYOUTS
from bicodec_shm.model.dac import DACDecoder
from bicodec_shm.model.precision import snr_db

TOL = 1e-5


@pytest.fixture(scope="module", params=["tiny-44khz", "tiny-24khz"])
def model(request) -> DACDecoder:
    return DACDecoder.from_config(request.param, seed=0)


def random_codes(model: DACDecoder, frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, (model.config.n_codebooks, frames))


def full_decode(model: DACDecoder, codes: np.ndarray) -> np.ndarray:
    return model.detokenize(torch.from_numpy(codes)[None])[0].numpy()


def stream_frames(stream: DecodeStream, codes: np.ndarray, pushes: list[int]) -> np.ndarray:
    parts, f = [], 0
    for n in pushes:
        parts.append(stream.push(codes[:, f : f + n]))  # one (n_codebooks, n) array a push
        f += n
    parts.append(stream.finish())
    return np.frombuffer(b"".join(parts), "<f4")


def snr(audio: np.ndarray, want: np.ndarray) -> float:
    return snr_db(torch.from_numpy(audio.copy()), torch.from_numpy(want))


def test_every_dac_codec_has_the_three_presets():
    for name in LAYOUTS:
        if name.startswith("dac-"):
            assert sorted(CODEC_PRESETS[name]) == ["default", "exact", "peers"]
            exact = CODEC_PRESETS[name]["exact"]
            assert exact.left_context >= 10 and exact.lookahead >= 10  # the receptive field: 9.8


@pytest.mark.parametrize("preset", ["exact", "default", "peers"])
def test_stream_has_exact_length_and_exact_preset_equals_full_decode(model, preset):
    cfg = model.config
    codes = random_codes(model, 61, seed=1)
    stream = DecodeStream(model, None, preset=preset, dtype="float32")
    assert stream.settings == CODEC_PRESETS[cfg.codec_name][preset]
    audio = stream_frames(stream, codes, [1, 3, 9, 1, 17, 2, 28])
    want = full_decode(model, codes)
    assert len(audio) == len(want) == cfg.decoded_samples(61) and stream.samples_emitted == len(want)
    if preset == "exact":
        assert np.abs(audio - want).max() <= TOL
    elif preset == "default":
        assert snr(audio, want) > 40  # tiny: 56-59 dB; full size in RESULTS.md
    else:  # 6 frames of lookahead: audibly off at each 43-frame joint, the same audio between
        assert 10 < snr(audio, want) < 60


def test_the_stream_takes_codes_as_lists_of_codebooks_too(model):
    codes = random_codes(model, 24, seed=2)
    as_array = stream_frames(DecodeStream(model, None, preset="exact", dtype="float32"), codes, [24])
    stream = DecodeStream(model, None, preset="exact", dtype="float32")
    as_lists = np.frombuffer(stream.push([list(row) for row in codes]) + stream.finish(), "<f4")
    assert np.array_equal(as_array, as_lists)


def test_streams_through_a_dac_server_process_equal_the_full_lone_decode(start_server, shm_name):
    """Three streams of one utterance at once through `serve --codec dac-24khz --preset tiny` (a
    real server process): `exact` equals the full lone decode (int16 within 1 LSB, float32 within
    1e-5) and `default` equals the same stream decoded in this process."""
    from bicodec_shm.client.decoder_client import DecoderClient

    start_server("--codec", "dac-24khz", "--slots", "8", "--max-wait-ms", "20", "--min-fill", "0")
    model = DACDecoder.from_config("tiny-24khz", seed=0)  # the server's model
    pushes = [2, 11, 1, 9, 16, 5]
    codes = random_codes(model, sum(pushes), seed=3)
    want = full_decode(model, codes)
    local = stream_frames(DecodeStream(model, None, dtype="float32"), codes, pushes)

    async def stream(client, preset, dtype) -> bytes:
        s = DecodeStream(client, None, preset=preset, dtype=dtype)
        parts, f = [], 0
        for n in pushes:
            parts.append(await s.push_async(codes[:, f : f + n]))
            f += n
        return b"".join(parts) + await s.finish_async()

    async def run(client):
        return await asyncio.gather(stream(client, "exact", "int16"), stream(client, "exact", "float32"),
                                    stream(client, "default", "float32"))  # fmt: skip

    with DecoderClient(shm_name, slots=6, timeout=120) as client:
        exact16, exact32, default = asyncio.run(run(client))
    exact16 = np.frombuffer(exact16, "<i2").astype(np.int32)
    assert len(exact16) == len(want) == sum(pushes) * 320 - 8  # dac-24khz's own length
    assert np.abs(exact16 - seed_int16(want)).max() <= 1
    assert np.abs(np.frombuffer(exact32, "<f4") - want).max() <= TOL
    assert np.abs(np.frombuffer(default, "<f4") - local).max() <= TOL


def test_a_stream_without_lookahead_is_refused_where_a_window_decodes_short():
    """At 24/16 kHz a window's decode ends 8 samples short of its last frame: a region there would
    leave 8 samples out at every joint, so a stream must keep one frame of lookahead."""
    short = DACDecoder.from_config("tiny-16khz", seed=0)
    with pytest.raises(ValueError, match="8 samples short of its last frame: lookahead must be >= 1"):
        DecodeStream(short, None, preset="peers", lookahead=0)
    DecodeStream(DACDecoder.from_config("tiny-44khz", seed=0), None, preset="peers", lookahead=0)
