"""BiCodec's encode path on random weights (the ``tiny`` preset): batching, input checks, the
waveform steps and the config. Agreement with Spark-TTS itself is tests/test_spark_encode_reference.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bicodec_shm.model.bicodec.encode_config import BiCodecEncodeConfig, RefClipConfig
from bicodec_shm.model.bicodec.tokenizer import BiCodecEncoder
from bicodec_shm.model.bicodec.wav2vec2_features import TINY_WAV2VEC2, XLSR53_WAV2VEC2, Wav2Vec2Features
from bicodec_shm.model.bicodec.waveforms import reference_clip, volume_normalize

FEATURE_TOL = 1e-5  # float32 rounding of another batch shape's kernels (measured ~1e-6)


@pytest.fixture(scope="module")
def model() -> BiCodecEncoder:
    return BiCodecEncoder.from_config("tiny", seed=7)


def speechy(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    return 0.3 * np.sin(2 * np.pi * rng.uniform(100, 300) * t) * np.sin(2 * np.pi * 3 * t) ** 2 + (
        0.02 * rng.standard_normal(n)
    )


def test_the_released_reference_clip_is_6_s_of_whole_hops():
    assert RefClipConfig().ref_segment_length == 96000
    assert RefClipConfig(ref_segment_duration=1.23).ref_segment_length == 19520  # 19680 floored


def test_a_mixed_length_batch_gives_each_row_its_lone_ids(model):
    lengths = [16000, 700, 23456]  # 1 s, 44 ms (one wav2vec2 frame), 1.5 s: all but one tiled
    batch = np.zeros((3, max(lengths)))
    for row, n in enumerate(lengths):
        batch[row, :n] = speechy(n, row)
    batch[1, 700:] = 5.0  # garbage in the padding must not matter
    tokens = model.tokenize(batch, lengths)
    prepared = model.prepare(batch, lengths)
    with torch.inference_mode():
        features, frames = model.semantic_features(prepared)
    assert tokens.lengths.tolist() == frames.tolist() == [49, 1, 73]
    for row, n in enumerate(lengths):
        lone = model.tokenize(batch[row : row + 1, :n])
        k = int(lone.lengths[0])
        assert torch.equal(tokens.semantic_ids[row, :k], lone.semantic_ids[0])
        assert (tokens.semantic_ids[row, k:] == 0).all()
        assert torch.equal(tokens.global_ids[row], lone.global_ids[0])
        with torch.inference_mode():
            lone_features, _ = model.semantic_features(model.prepare(batch[row : row + 1, :n]))
        assert float((features[row, :k] - lone_features[0]).abs().max()) <= FEATURE_TOL
    assert len(torch.unique(tokens.semantic_ids[2])) > 10  # the ids are not degenerate
    # The speaker path's clips have one fixed length: a batch of them needs no mask.
    assert prepared.ref_clip.shape == (3, model.config.clip.ref_segment_length)


@pytest.mark.parametrize(
    ("wavs", "lengths", "message"),
    [
        (np.zeros((1, 0)), None, "wavs is empty"),
        (np.zeros((0, 800)), None, "wavs is empty"),
        (np.zeros(800), None, r"wavs must be 2-D \(B, N\).*1-D"),
        (np.zeros((1, 1, 800)), None, "wavs must be 2-D.*3-D"),
        (np.zeros((1, 800), np.int16), None, "wavs must have a floating dtype"),
        ([[0.0] * 800], None, "wavs must be a torch.Tensor or numpy array"),
        (np.zeros((1, 399)), None, "wavs row 0 has 399 samples; wav2vec2 needs at least 400"),
        (np.zeros((2, 800)), [800, 0], r"lengths\[1\] = 0 is outside"),
        (np.zeros((2, 800)), [800], r"lengths must have shape \(B,\)"),
    ],
)
def test_bad_input_is_a_value_error_naming_it(model, wavs, lengths, message):
    with pytest.raises(ValueError, match=message):
        model.tokenize(wavs, lengths)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_sample_is_named_but_padding_may_hold_anything(model, bad):
    wav = np.zeros((2, 1000))
    wav[1, 123] = bad
    with pytest.raises(ValueError, match=r"wavs\[1, 123\] = .* is not finite"):
        model.tokenize(wav)
    wav[1, 123] = 0.0
    wav[1, 900] = bad  # past row 1's length: zeroed, never read
    assert model.tokenize(wav, [1000, 500]).lengths.tolist() == [2, 1]


def test_volume_normalisation_as_spark_tts_scales():
    loud = torch.tensor(speechy(8000, 1))
    out = volume_normalize(loud)
    magnitudes = torch.sort(out.abs()).values
    top = magnitudes[magnitudes > 0.01]
    # the 90th-99th percentile of the significant magnitudes lands on 0.2 (scale within limits)
    assert abs(float(top[int(0.9 * len(top)) : int(0.99 * len(top))].mean()) - 0.2) < 0.02
    quiet = torch.full((100,), 0.005)
    assert torch.allclose(volume_normalize(quiet), torch.full((100,), 0.1, dtype=torch.float64))
    assert out.dtype == torch.float64


def test_the_reference_clip_tiles_short_waveforms_and_cuts_long_ones():
    wav = torch.arange(5.0)
    assert reference_clip(wav, 12).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert reference_clip(torch.arange(20.0), 12).tolist() == list(range(12))


def test_random_weights_at_the_released_size_build_xlsr53s_architecture(monkeypatch):
    """So that a full-size server on random weights (``serve --encode`` without --model-dir)
    holds and computes what a real one does; the tiny preset keeps its tiny wav2vec2."""
    built = []

    def capture(config, *, seed=None):
        built.append(dict(config))
        raise RuntimeError("enough")  # the 251 M parameters need not be drawn

    monkeypatch.setattr(Wav2Vec2Features, "from_config", staticmethod(capture))
    for preset in ("spark-tts-0.5b", "tiny"):
        with pytest.raises(RuntimeError, match="enough"):
            BiCodecEncoder.from_config(preset, seed=0)
    full, tiny = built
    assert full == XLSR53_WAV2VEC2 and full["num_hidden_layers"] == 24 and full["conv_dim"] == [512] * 7
    assert tiny == {**TINY_WAV2VEC2, "hidden_size": tiny["hidden_size"]}


def test_a_group_norm_wav2vec2_is_refused():
    with pytest.raises(ValueError, match="feat_extract_norm='layer'"):
        Wav2Vec2Features.from_config({**TINY_WAV2VEC2, "feat_extract_norm": "group",
                                      "do_stable_layer_norm": False}, seed=0)  # fmt: skip
    with pytest.raises(ValueError, match="at least 16 hidden layers"):
        Wav2Vec2Features.from_config({**TINY_WAV2VEC2, "num_hidden_layers": 12}, seed=0)


def test_the_config_names_what_is_missing_or_inconsistent():
    section = BiCodecEncodeConfig.preset("tiny").to_dicts()[0]["audio_tokenizer"]
    with pytest.raises(ValueError, match="missing section 'encoder'"):
        BiCodecEncodeConfig.from_dict({k: v for k, v in section.items() if k != "encoder"})
    bad = {**section, "encoder": {**section["encoder"], "out_channels": 7}}
    with pytest.raises(ValueError, match="encoder.out_channels=7 must equal quantizer.input_dim"):
        BiCodecEncodeConfig.from_dict(bad)
    with pytest.raises(ValueError, match="every sample rate must be 16000"):
        BiCodecEncodeConfig.from_dict(section, {"sample_rate": 24000})
