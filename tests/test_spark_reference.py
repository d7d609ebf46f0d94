"""Our loader and model against Spark-TTS's own BiCodec code (a recorded fixture).

``fixtures/spark_reference.npz`` holds small random weights under upstream's parameter names and
the audio that upstream's ``BiCodec.detokenize`` made from them, at a pinned commit; how it was
made is in ``fixtures/make_spark_reference.py``. Here the weights go through our loader (a
Spark-TTS folder: ``config.yaml`` + ``model.safetensors``, weight norm as ``weight_g``/``weight_v``)
and our model must give the same audio.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from bicodec_shm.model import BiCodecDecoder

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "spark_reference.npz")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def model(reference, tmp_path_factory) -> BiCodecDecoder:
    """Our loader on the fixture's weights, written as upstream's own file was (float32)."""
    folder = tmp_path_factory.mktemp("spark-bicodec")
    (folder / "config.yaml").write_text(str(reference["config_yaml"]), encoding="utf-8")
    tensors = {
        k[2:]: torch.from_numpy(v.astype(np.float32)) for k, v in reference.items() if k.startswith("w/")
    }
    save_file(tensors, str(folder / "model.safetensors"))
    return BiCodecDecoder.from_pretrained(folder)


def lone_cases(reference) -> list[str]:
    return sorted({k.split("/")[1] for k in reference if k.startswith("single/")}, key=int)


def test_the_fixture_covers_1_to_63_tokens_and_audible_audio(reference):
    lengths = [int(n) for n in lone_cases(reference)]
    assert min(lengths) == 1 and max(lengths) == 63
    for n in lengths:
        audio = reference[f"single/{n}/audio"]
        assert audio.shape == (1, 320 * n)
        assert 0.01 < np.sqrt(np.mean(audio**2)) and np.abs(audio).max() < 0.99  # neither silent nor clipped


def test_each_length_decodes_as_spark_tts_does(reference, model):
    for n in lone_cases(reference):
        expected = reference[f"single/{n}/audio"]
        audio = model.detokenize(reference[f"single/{n}/semantic"], reference[f"single/{n}/global"])
        assert audio.shape == expected.shape
        err = float(np.abs(audio.numpy() - expected).max())
        assert err <= TOLERANCE, f"{n} tokens: max |ours - Spark-TTS| = {err:.2e}"


def test_a_mixed_length_batch_gives_each_row_its_spark_tts_lone_decode(reference, model):
    lengths = reference["batch/lengths"]
    assert len(set(lengths.tolist())) == len(lengths) >= 3
    audio = model.detokenize(reference["batch/semantic"], reference["batch/global"], lengths).numpy()
    err = np.abs(audio - reference["batch/lone"]).max(axis=1)
    assert (err <= TOLERANCE).all(), f"max |ours - Spark-TTS| per row: {err}"
    # The case is telling: unmasked, the padding would reach the short rows' audio.
    leaky = model.detokenize(reference["batch/semantic"], reference["batch/global"], lengths, mask=False)
    assert np.abs(leaky.numpy() - reference["batch/lone"]).max() > 100 * TOLERANCE
