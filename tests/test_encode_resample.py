"""Encode requests at a stated sample rate: ``DecoderClient.encode(audio, sample_rate=R)``
resamples the clip in the client process to the codec's rate as the codec's upstream does, so the
codes are those upstream computes for the same clip; the server only ever sees its codec's rate.

Ground truth, written out here independently of the package:

- BiCodec (Spark-TTS's ``load_audio``): ``soxr.resample(x, R, 16000, quality="VHQ")``, then
  ``BiCodecEncoder.tokenize`` of that clip alone;
- Qwen3-TTS (qwen-tts's ``Qwen3TTSTokenizer.encode``): ``librosa.resample(y, orig_sr=R,
  target_sr=24000)`` (``librosa_resample`` below: exactly what librosa 0.11's default
  ``res_type="soxr_hq"``, ``fix=True`` computes), then ``Qwen3TTSEncoder.tokenize`` alone.

Each comparison also checks that the other codec's way of resampling gives other codes, so a
test fails if the wrong quality (or length) is used.
"""

from __future__ import annotations

import asyncio
import math
import sys

import numpy as np
import pytest
from support import assert_lone_encode, reference_encoder

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.codecs import BICODEC, LAYOUTS, QWEN3_TTS_12HZ
from bicodec_shm.codecs.resample import LIBROSA, SOXR_HQ, SOXR_VHQ
from bicodec_shm.protocol.header import read_codec, write_codec
from bicodec_shm.protocol.layout import HEADER_DT

soxr = pytest.importorskip("soxr")

QWEN3_SPF = 1920


def noise(rate: int, seconds: float, seed: int) -> np.ndarray:
    """(N,) float32 noise in [-1, 1] at ``rate``: full-band, so resamplers of other qualities
    (other passbands and transition bands) give clips whose codes differ."""
    rng = np.random.default_rng([seed, rate])
    return np.clip(rng.standard_normal(int(rate * seconds)) * 0.2, -1, 1).astype(np.float32)


def spark_resample(x: np.ndarray, rate: int) -> np.ndarray:
    """Spark-TTS's sparktts/utils/audio.py ``load_audio``: soxr "VHQ" to 16 kHz."""
    return soxr.resample(x, rate, 16000, quality="VHQ")


def librosa_resample(y: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """``librosa.resample(y, orig_sr=orig_sr, target_sr=target_sr)`` with its defaults, as
    librosa 0.11 computes it (librosa is not a test dependency): ``res_type="soxr_hq"`` calls
    ``soxr.resample(y, orig_sr, target_sr, quality="soxr_hq")``, then ``fix=True`` pads with
    zeros (or cuts) to ``ceil(len(y) * (target_sr / orig_sr))`` samples, in ``y``'s dtype."""
    y_hat = soxr.resample(y, orig_sr, target_sr, quality="soxr_hq")
    n_samples = int(np.ceil(y.shape[-1] * (float(target_sr) / orig_sr)))
    y_hat = y_hat[:n_samples] if len(y_hat) >= n_samples else np.pad(y_hat, (0, n_samples - len(y_hat)))
    return np.asarray(y_hat, dtype=y.dtype)


def bicodec_ids(clip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lone = reference_encoder().tokenize(np.asarray(clip, np.float32)[None])
    return lone.semantic_ids[0].numpy(), lone.global_ids[0].numpy()


# -- BiCodec ----------------------------------------------------------------------------------


@pytest.fixture
def bicodec(thread_server, shm_name):
    thread_server(encoder=reference_encoder(), max_tokens=60, min_fill=0.0)  # a slot: 19200 samples
    with DecoderClient(shm_name, timeout=60) as client:
        yield client


@pytest.mark.parametrize("rate", [22050, 48000])
def test_a_clip_at_another_rate_gets_the_codes_of_spark_tts_resampled_clip(bicodec, rate):
    clip = noise(rate, 1.0, 1)
    got = bicodec.encode(clip, sample_rate=rate)
    assert_lone_encode(got, spark_resample(clip, rate))
    # The test tells the qualities apart: soxr "HQ" (qwen-tts's) gives other codes here.
    hq = bicodec_ids(soxr.resample(clip, rate, 16000, quality="HQ"))
    assert not np.array_equal(got.semantic_ids, hq[0])


def test_float64_is_resampled_as_float64_and_int16_as_float32(bicodec):
    """float64 stays float64 until it is resampled (Spark-TTS resamples what soundfile reads);
    int16 is read as ``x / 32768`` and resampled as float32."""
    clip64 = noise(44100, 0.8, 2).astype(np.float64) * 0.9
    assert_lone_encode(bicodec.encode(clip64, sample_rate=44100), spark_resample(clip64, 44100))
    pcm = (noise(22050, 0.8, 3) * 32767).astype(np.int16)
    as_float = pcm.astype(np.float32) / np.float32(32768)
    got = bicodec.encode(pcm, sample_rate=22050)
    assert_lone_encode(got, spark_resample(as_float, 22050))
    assert_lone_encode(bicodec.encode(pcm.astype(np.float32) / 32768, sample_rate=np.int64(22050)),
                       spark_resample(as_float, 22050))  # fmt: skip


def test_encode_async_resamples_as_encode_does(bicodec):
    clip = noise(8000, 0.5, 4)

    async def both():
        return await asyncio.gather(bicodec.encode_async(clip, sample_rate=8000),
                                    bicodec.encode_async(clip[:3000], sample_rate=8000))  # fmt: skip

    first, second = asyncio.run(both())
    assert_lone_encode(first, spark_resample(clip, 8000))
    assert_lone_encode(second, spark_resample(clip[:3000], 8000))


BAD_RATES = [
    (0, "sample_rate=0 Hz is not a sample rate"),
    (-16000, "sample_rate=-16000 Hz is not a sample rate"),
    (2_000_000, r"sample_rate=2000000 Hz is not a sample rate: it must be in \[1, 1000000\]"),
    (True, "sample_rate must be an int \\(Hz\\), got True"),
    (16000.0, "sample_rate must be an int \\(Hz\\), got 16000.0"),
    ("16000", "sample_rate must be an int \\(Hz\\), got '16000'"),
]


def test_bad_rates_and_clips_too_long_once_resampled_are_refused_before_anything_is_written(bicodec):
    clip = noise(48000, 0.5, 5)
    requests = bicodec.get_stats()["requests"]
    for rate, message in BAD_RATES:
        with pytest.raises(ValueError, match=message):
            bicodec.encode(clip, sample_rate=rate)
        with pytest.raises(ValueError, match=message):
            asyncio.run(bicodec.encode_async(clip, sample_rate=rate))
    # A slot holds 60 · 320 = 19200 samples at 16 kHz: 57602 samples at 48 kHz are 19201 there
    # (soxr rounds 19200.67 to the nearest).
    with pytest.raises(ValueError, match=r"audio of 19201 samples at 16000 Hz \(resampled from 57602 "
                                         r"samples at 48000 Hz\) \(1\.20 s\) is longer than a slot"):
        bicodec.encode(noise(48000, 1.3, 6)[:57602].copy(), sample_rate=48000)
    with pytest.raises(ValueError, match=r"audio of 99 samples at 16000 Hz \(resampled from 297 samples "
                                         r"at 48000 Hz\) is too short"):
        bicodec.encode(clip[:297], sample_rate=48000)
    assert bicodec.get_stats()["requests"] == requests  # nothing was written
    # The handle still works; the length that counts is the resampled one: 57600 samples at
    # 48 kHz are more than a slot holds at 16 kHz, but 19200 once resampled.
    long = noise(48000, 1.2, 6)
    assert_lone_encode(bicodec.encode(long, sample_rate=48000), spark_resample(long, 48000))
    assert_lone_encode(bicodec.encode(clip, sample_rate=48000), spark_resample(clip, 48000))


def test_a_server_process_gets_the_resampled_clip(start_server, shm_name):
    """``serve --encode`` in its own process, a 48 kHz int16 clip from this one."""
    start_server("--encode", "--max-tokens", "100")
    pcm = (noise(48000, 0.7, 7) * 30000).astype(np.int16)
    with DecoderClient(shm_name, timeout=60) as client:
        got = client.encode(pcm, sample_rate=48000)
    assert_lone_encode(got, spark_resample(pcm.astype(np.float32) / np.float32(32768), 48000))


# -- Qwen3-TTS --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_encoder():
    from bicodec_shm.model.qwen3_tts import Qwen3TTSEncoder

    return Qwen3TTSEncoder.from_config("tiny-12hz", seed=0)


def qwen3_codes(encoder, clip: np.ndarray) -> np.ndarray:
    """(16, frames): ``tokenize`` of ``clip`` alone."""
    out = encoder.tokenize(np.asarray(clip, np.float32))
    return out.codes[0, :, : int(out.lengths[0])].numpy()


@pytest.fixture
def qwen3(thread_server, shm_name, qwen3_encoder):
    from bicodec_shm.model.qwen3_tts import Qwen3TTSDecoder

    thread_server(Qwen3TTSDecoder.from_config("tiny", seed=0), encoder=qwen3_encoder, max_tokens=20,
                  min_fill=0.0)  # fmt: skip
    with DecoderClient(shm_name, timeout=60) as client:
        yield client


# 1764 samples at 22050 Hz are 1920 at 24 kHz, but 1764 * (24000 / 22050) is 1920.0000000000002
# in floating point: soxr makes 1920 samples, librosa pads them to 1921, a second frame of codes.
@pytest.mark.parametrize(("rate", "n"), [(22050, 1764), (22050, 11035), (48000, 9601), (16000, 9000)])
def test_a_clip_at_another_rate_gets_the_codes_of_qwen_tts_resampled_clip(qwen3, qwen3_encoder, rate, n):
    clip = noise(rate, n / rate, 8)[:n]
    assert len(clip) == n
    resampled = librosa_resample(clip, rate, 24000)
    got = qwen3.encode(clip, sample_rate=rate)
    want = qwen3_codes(qwen3_encoder, resampled)
    assert len(got.codes) == 16 and got.frames == -(-len(resampled) // QWEN3_SPF)
    np.testing.assert_array_equal(np.stack(got.codes), want)
    # The test tells the ways apart: soxr "VHQ" (Spark-TTS's) gives other codes, and so does
    # soxr "HQ" without librosa's padding where it pads.
    vhq = qwen3_codes(qwen3_encoder, soxr.resample(clip, rate, 24000, quality="VHQ"))
    assert vhq.shape != want.shape or not np.array_equal(vhq, want)
    unpadded = soxr.resample(clip, rate, 24000, quality="HQ")
    if len(unpadded) != len(resampled):
        other = qwen3_codes(qwen3_encoder, unpadded)
        assert other.shape != want.shape or not np.array_equal(other, want)


def test_qwen3_int16_and_the_resampled_length_limit(qwen3, qwen3_encoder):
    pcm = (noise(44100, 0.3, 9) * 20000).astype(np.int16)
    got = qwen3.encode(pcm, sample_rate=44100)
    as_float = pcm.astype(np.float32) / np.float32(32768)
    want = qwen3_codes(qwen3_encoder, librosa_resample(as_float, 44100, 24000))
    np.testing.assert_array_equal(np.stack(got.codes), want)
    # 20 frames of 1920: 38400 samples at 24 kHz; 25601 at 16 kHz are 38401.5 -> 38402 there.
    with pytest.raises(ValueError, match=r"audio of 38402 samples at 24000 Hz \(resampled from 25601"):
        qwen3.encode(np.zeros(25601, np.float32), sample_rate=16000)
    assert qwen3.encode(np.zeros(25600, np.float32), sample_rate=16000).frames == 20


# -- where each codec's way of resampling is said ---------------------------------------------


def test_each_codec_says_how_its_upstream_resamples_and_a_header_says_the_same():
    assert BICODEC.resampling == SOXR_VHQ and SOXR_VHQ.quality == "VHQ" and not SOXR_VHQ.fixed_length
    assert QWEN3_TTS_12HZ.resampling == LIBROSA and LIBROSA.quality == "HQ" and LIBROSA.fixed_length
    assert LAYOUTS["snac-24khz"].resampling == SOXR_HQ
    header = np.zeros((), HEADER_DT)
    for layout in (BICODEC, QWEN3_TTS_12HZ):
        write_codec(header, layout)
        assert read_codec(header).resampling == layout.resampling


def test_the_resampling_matches_the_written_out_upstreams():
    for rate, n in ((22050, 11035), (48000, 9601), (8000, 1), (44100, 4410)):
        x = noise(rate, 1.0, 10)[:n]
        np.testing.assert_array_equal(SOXR_VHQ.resample(x, rate, 16000), spark_resample(x, rate))
        np.testing.assert_array_equal(LIBROSA.resample(x, rate, 24000), librosa_resample(x, rate, 24000))
        assert len(LIBROSA.resample(x, rate, 24000)) == math.ceil(n * (24000 / rate))


def test_without_soxr_the_error_says_how_to_install_it(monkeypatch, bicodec):
    monkeypatch.setitem(sys.modules, "soxr", None)  # import soxr raises ImportError
    with pytest.raises(ImportError, match="pip install soxr"):
        bicodec.encode(noise(22050, 0.5, 11), sample_rate=22050)
    clip = noise(16000, 0.5, 11)
    assert_lone_encode(bicodec.encode(clip, sample_rate=16000), clip)  # at the codec's rate: no soxr
