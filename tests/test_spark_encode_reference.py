"""Our encode path against Spark-TTS's own tokenizer (a recorded fixture).

``fixtures/spark_encode_reference.npz`` holds what upstream's ``BiCodecTokenizer.tokenize``
computed at a pinned commit (torchaudio's mel included) for four waveforms, on small random
weights that the fixture describes by name, shape, range and SHA-256; how it was made is in
``fixtures/make_spark_encode_reference.py``. Here those weights are drawn again (every hash
checked), written as a Spark-TTS model folder, loaded by our loader, and our ids must equal
upstream's.

Tolerances: ids are compared exactly. Features are float32 computed by another torch build
(2.9.1 there), with float64 normalisation statistics where upstream uses float32 numpy, so they
agree to float32 rounding carried through 16 transformer layers: FEATURE_TOL is absolute, on
features up to ~13 in magnitude, a factor ~13 over the 7.7e-6 measured. Our mel filterbank is
built in torchaudio's float32 order and came out bit-equal to torchaudio's mel; MEL_TOL
(relative to the mel's peak) leaves room for another FFT build's rounding only.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file
from support import load_script

from bicodec_shm.model.bicodec.tokenizer import BiCodecEncoder

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "fixtures", "spark_encode_reference.npz")
MAKER = os.path.join(HERE, "fixtures", "make_spark_encode_reference.py")
FEATURE_TOL = 1e-4
MEL_TOL = 1e-6


def _maker():
    """The fixture's script, for its weight drawing (``weights_from_specs``) only."""
    return load_script(MAKER)


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def model_folder(reference, tmp_path_factory):
    """A Spark-TTS model folder (config.yaml, BiCodec/, wav2vec2-large-xlsr-53/) holding the
    fixture's weights, as the fixture's script wrote it for upstream."""
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

    maker = _maker()
    folder = tmp_path_factory.mktemp("Spark-TTS-tiny")
    (folder / "BiCodec").mkdir()
    (folder / "config.yaml").write_text(str(reference["model_config_yaml"]))
    (folder / "BiCodec" / "config.yaml").write_text(str(reference["bicodec_config_yaml"]))
    bicodec = maker.weights_from_specs(json.loads(str(reference["weights/bicodec"])))
    tensors = {k: torch.from_numpy(v) for k, v in bicodec.items()}
    save_file(tensors, str(folder / "BiCodec" / "model.safetensors"))
    w2v = Wav2Vec2Model(Wav2Vec2Config(**json.loads(str(reference["wav2vec2_config_json"]))))
    state = maker.weights_from_specs(json.loads(str(reference["weights/wav2vec2"])))
    w2v.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    w2v.save_pretrained(folder / "wav2vec2-large-xlsr-53")
    Wav2Vec2FeatureExtractor(**json.loads(str(reference["preprocessor_json"]))).save_pretrained(
        folder / "wav2vec2-large-xlsr-53"
    )
    return folder


@pytest.fixture(scope="module")
def model(model_folder) -> BiCodecEncoder:
    return BiCodecEncoder.from_pretrained(model_folder)


def waves(reference) -> list[str]:
    return sorted({k.split("/")[1] for k in reference if k.startswith("wave/")}, key=int)


def lone_input(reference, i) -> np.ndarray:
    """The waveform as upstream read it from its float wav file: float64 samples."""
    return reference[f"wave/{i}/input"].astype(np.float64)[None]


def test_the_fixture_covers_tiling_cutting_and_diverse_ids(reference, model):
    clip = model.config.clip.ref_segment_length
    lengths = [reference[f"wave/{i}/input"].shape[0] for i in waves(reference)]
    assert min(lengths) < clip < max(lengths)  # a clip tiled and a clip cut
    assert yaml.safe_load(str(reference["model_config_yaml"]))["volume_normalize"] is True
    globals_ = {tuple(reference[f"wave/{i}/global"].ravel()) for i in waves(reference)}
    assert len(globals_) == len(lengths)  # the speaker path tells the waveforms apart
    for i in waves(reference):
        assert len(np.unique(reference[f"wave/{i}/semantic"])) >= 10


def test_each_waveform_tokenizes_as_spark_tts_does(reference, model):
    for i in waves(reference):
        tokens = model.tokenize(lone_input(reference, i))
        expected = reference[f"wave/{i}/semantic"]
        assert tokens.semantic_ids.shape == expected.shape and int(tokens.lengths[0]) == expected.shape[1]
        np.testing.assert_array_equal(tokens.semantic_ids.numpy(), expected, err_msg=f"wave {i}")
        np.testing.assert_array_equal(tokens.global_ids.numpy(), reference[f"wave/{i}/global"][:, 0])


def test_features_and_mel_match_spark_tts_and_torchaudio(reference, model):
    for i in waves(reference):
        prepared = model.prepare(lone_input(reference, i))
        with torch.inference_mode():
            features, _ = model.semantic_features(prepared)
            mel = model.mel(prepared.ref_clip)
        expected = reference[f"wave/{i}/features"]
        assert features.shape == expected.shape
        err = float(np.abs(features.numpy() - expected).max())
        assert err <= FEATURE_TOL, f"wave {i}: max |ours - Spark-TTS| feature = {err:.2e}"
        torchaudio_mel = reference[f"wave/{i}/ref_mel"]
        assert mel.shape == torchaudio_mel.shape
        rel = float(np.abs(mel.numpy() - torchaudio_mel).max() / np.abs(torchaudio_mel).max())
        assert rel <= MEL_TOL, f"wave {i}: mel off torchaudio's by {rel:.2e} of its peak"


def padded_batch(reference) -> tuple[np.ndarray, np.ndarray]:
    inputs = [reference[f"wave/{i}/input"].astype(np.float64) for i in waves(reference)]
    lengths = np.array([len(x) for x in inputs])
    batch = np.zeros((len(inputs), lengths.max()))
    for row, x in enumerate(inputs):
        batch[row, : len(x)] = x
    return batch, lengths


def test_a_mixed_length_batch_gives_each_row_spark_tts_ids(reference, model):
    batch, lengths = padded_batch(reference)
    tokens = model.tokenize(batch, lengths)
    for row, i in enumerate(waves(reference)):
        expected = reference[f"wave/{i}/semantic"][0]
        n = int(tokens.lengths[row])
        assert n == len(expected)
        np.testing.assert_array_equal(tokens.semantic_ids[row, :n].numpy(), expected, err_msg=f"row {row}")
        assert (tokens.semantic_ids[row, n:] == 0).all()
        np.testing.assert_array_equal(tokens.global_ids[row].numpy(), reference[f"wave/{i}/global"][0, 0])


def test_batched_features_are_each_rows_lone_features_and_need_the_mask(reference, model):
    batch, lengths = padded_batch(reference)
    prepared = model.prepare(batch, lengths)
    with torch.inference_mode():
        features, frames = model.semantic_features(prepared)
        # The same padded batch through wav2vec2 without its attention mask.
        unmasked = model.features(prepared.wav)[:, : features.shape[1]]
    leak = 0.0
    for row, i in enumerate(waves(reference)):
        n = int(frames[row])
        expected = reference[f"wave/{i}/features"][0]
        err = float(np.abs(features[row, :n].numpy() - expected).max())
        assert err <= FEATURE_TOL, f"row {row}: max |batched - Spark-TTS lone| = {err:.2e}"
        leak = max(leak, float(np.abs(unmasked[row, :n].numpy() - expected).max()))
    assert leak > 100 * FEATURE_TOL  # the case is telling: unmasked, padding reaches short rows


def test_a_folder_without_wav2vec2_or_encode_weights_is_refused_by_name(model_folder, tmp_path):
    import shutil

    from bicodec_shm.errors import CheckpointError

    shutil.copytree(model_folder / "BiCodec", tmp_path / "BiCodec")
    with pytest.raises(CheckpointError, match="wav2vec2-large-xlsr-53: no wav2vec2 folder"):
        BiCodecEncoder.from_pretrained(tmp_path)
    # A decode-only file (the encode networks' tensors left out) lists what it lacks.
    from safetensors.torch import load_file

    decode_only = {k: v for k, v in load_file(tmp_path / "BiCodec" / "model.safetensors").items()
                   if not k.startswith(("encoder.", "speaker_encoder.speaker_encoder."))}  # fmt: skip
    save_file(decode_only, str(tmp_path / "BiCodec" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing: encoder\.encoder\.embed\.weight"):
        BiCodecEncoder.from_pretrained(tmp_path / "BiCodec", wav2vec2=model_folder / "wav2vec2-large-xlsr-53")
