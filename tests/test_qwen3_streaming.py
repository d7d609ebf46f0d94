"""Streaming Qwen3-TTS: a ``DecodeStream`` over a ``Qwen3TTSDecoder`` in process and over a
``serve --codec qwen3-tts-12hz`` process.

Ground truth is qwen-tts's own decode of the whole utterance (its ``chunked_decode``): the
``exact`` preset equals it up to float rounding, the others keep exact sample counts and their
measured SNR floor and decode cost.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from support import seed_int16
from test_qwen3_tts_model import upstream_decode, upstream_twin

from bicodec_shm.client.streaming import CODEC_PRESETS, DecodeStream, StreamSettings
from bicodec_shm.model.precision import snr_db
from bicodec_shm.model.qwen3_tts import Qwen3TTSDecoder

TOL = 1e-5
SPF = 1920
PRESETS = CODEC_PRESETS["qwen3-tts-12hz"]


@pytest.fixture(scope="module")
def tiny() -> Qwen3TTSDecoder:
    return Qwen3TTSDecoder.from_config("tiny", seed=0)


@pytest.fixture(scope="module")
def utterance(tiny) -> tuple[np.ndarray, np.ndarray]:
    """650 frames of random codes (two cuts of the 300-frame grid) and qwen-tts's decode of them."""
    codes = np.random.default_rng(7).integers(0, 2048, (16, 650))
    whole = upstream_decode(upstream_twin(tiny), torch.from_numpy(codes)[None], [650])[0].numpy()
    return codes, whole


def stream_frames(stream: DecodeStream, codes: np.ndarray, pushes: list[int]) -> tuple[np.ndarray, int]:
    """The stream's float32 audio for ``codes`` pushed ``pushes`` frames at a time, and the frames
    pushed when its first audio came."""
    parts, f, first = [], 0, None
    for n in pushes:
        parts.append(stream.push(codes[:, f : f + n]))
        f += n
        first = f if first is None and parts[-1] else first
    parts.append(stream.finish())
    return np.frombuffer(b"".join(parts), "<f4"), first or f


def test_the_presets_follow_qwen_tts_chunks_and_start_early():
    assert sorted(PRESETS) == ["default", "exact", "peers"]
    exact = PRESETS["exact"]
    assert (exact.chunk_tokens, exact.left_context, exact.lookahead) == (300, 25, 0)  # chunked_decode's
    assert PRESETS["default"].first_audio_tokens == 2
    assert all(s.lookahead == 0 for s in PRESETS.values())  # a causal codec: nothing to wait for


@pytest.mark.parametrize("pushes", [[1] * 650, [2, 297, 3, 1, 300, 47], [650]])
def test_exact_preset_equals_qwen_tts_decode_of_the_whole_utterance(tiny, utterance, pushes):
    """Frame by frame, in uneven pushes across the cuts, and all at once (windows split by the
    30 s default limit): float32 within 1e-5 of qwen-tts's decode, the same length."""
    codes, whole = utterance
    stream = DecodeStream(tiny, None, preset="exact", dtype="float32")
    audio, first = stream_frames(stream, codes, pushes)
    assert len(audio) == len(whole) == 650 * SPF == stream.samples_emitted
    assert np.abs(audio - whole).max() <= TOL
    assert first == next(int(c) for c in np.cumsum(pushes) if c >= 300)  # qwen-tts's first chunk


def test_default_preset_starts_after_two_frames_at_a_bounded_cost(tiny, utterance, record_property):
    """Measured on the tiny model: 47 dB against qwen-tts's whole decode, each frame decoded 3.8
    times (24-frame regions, 72 frames of context); peers' 25-frame context: 22 dB."""
    codes, whole = utterance
    rows = {}
    for name in ("default", "peers"):
        stream = DecodeStream(tiny, None, preset=name, dtype="float32")
        audio, first = stream_frames(stream, codes, [1] * 650)
        assert len(audio) == len(whole)
        rows[name] = (snr_db(torch.from_numpy(audio.copy()), torch.from_numpy(whole)), first,
                      stream.tokens_decoded / 650)  # fmt: skip
        record_property(f"qwen3_stream_{name}", rows[name])
    (snr, first, cost), (peer_snr, peer_first, _) = rows["default"], rows["peers"]
    assert first == 2 and peer_first == 25
    assert snr > 40 and snr > peer_snr + 15, rows
    assert cost < 4.0, rows


def test_a_short_first_chunk_then_regions_that_double_up_to_the_chunk():
    """first_chunk_tokens: a short first region, then each as long as the audio before it, up to
    chunk_tokens: 3, 3, 6, 12, then 20-frame chunks."""
    model = Qwen3TTSDecoder.from_config("tiny", seed=0)
    codes = np.random.default_rng(8).integers(0, 2048, (16, 60))
    stream = DecodeStream(model, None, chunk_tokens=20, left_context=10, lookahead=0, crossfade=0,
                          first_chunk_tokens=3)  # fmt: skip
    assert stream.settings.first_audio_tokens == 3
    assert stream.push(codes[:, :2]) == b"" and len(stream.push(codes[:, 2:3])) == 2 * 3 * SPF
    for f in range(3, 60):  # frame by frame: one region each time a chunk is complete
        stream.push(codes[:, f : f + 1])
    assert len(stream.finish()) == 2 * (60 - 44) * SPF  # the rest: [44, 60)
    assert stream.joints == tuple(SPF * f for f in (3, 6, 12, 24, 44))
    with pytest.raises(ValueError, match=r"first_chunk_tokens must be in \[1, chunk_tokens = 20\]"):
        StreamSettings(chunk_tokens=20, left_context=10, lookahead=0, crossfade=0, first_chunk_tokens=21)
    with pytest.raises(ValueError, match="first_chunk_tokens must be an int"):
        StreamSettings(chunk_tokens=20, left_context=10, lookahead=0, crossfade=0, first_chunk_tokens=2.0)
    assert StreamSettings(8, 4, 2, 0, first_chunk_tokens=6).fitted(10).first_chunk_tokens == 4


def test_streams_through_a_qwen3_server_process(start_server, shm_name, tiny, utterance):
    """Three streams at once through `serve --codec qwen3-tts-12hz --preset tiny`: `exact` (int16
    and float32) equals qwen-tts's whole decode (within 1 LSB, 1e-5): each window's start frame
    places it on the utterance's chunk grid in the server; `default` equals the same stream
    decoded in this process."""
    from bicodec_shm.client.decoder_client import DecoderClient

    start_server("--codec", "qwen3-tts-12hz", "--preset", "tiny", "--slots", "8", "--max-wait-ms", "20",
                 "--min-fill", "0", "--threads", "1")  # fmt: skip
    codes, whole = utterance
    codes, whole = codes[:, :340], whole[: 340 * SPF]  # one cut, and fewer decodes
    pushes = [2, 40, 250, 9, 1, 38]
    local, _ = stream_frames(DecodeStream(tiny, None, dtype="float32"), codes, pushes)

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
    assert len(exact16) == len(whole)
    assert np.abs(exact16 - seed_int16(whole)).max() <= 1
    assert np.abs(np.frombuffer(exact32, "<f4") - whole).max() <= TOL
    assert np.abs(np.frombuffer(default, "<f4") - local).max() <= TOL
