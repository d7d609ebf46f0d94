"""bicodec_shm.integrations.spark_tts: Spark-TTS's ``audio_tokenizer.detokenize`` call, unchanged,
answered by a BiCodec server (a thread of this process, real shared memory).

Spark-TTS is not a package, so the call is made here as ``SparkTTS.inference`` makes it
(cli/SparkTTS.py): global ids built as it builds them, (1, 1, 32) then ``.squeeze(0)``, semantic
ids ``(1, T)``, both ``torch.long`` on the model's device (the CPU here). Ground truth: what
``BiCodecTokenizer.detokenize`` returns for the same ids, the in-process decoder's (B, 1, 320·T)
output with its dimensions of size 1 squeezed out, as a float32 numpy array.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from support import reference_model

from bicodec_shm import DecoderClient
from bicodec_shm.integrations.spark_tts import SharedAudioTokenizer

TOL = 1e-5


def spark_detokenize_reference(global_tokens: torch.Tensor, semantic_tokens: torch.Tensor) -> np.ndarray:
    """BiCodecTokenizer.detokenize on the in-process decoder: (B, 32), (B, T) -> squeezed float32."""
    wav_rec = reference_model().detokenize(semantic_tokens, global_tokens)[:, None]  # (B, 1, 320·T)
    return wav_rec.detach().squeeze().cpu().numpy()


def inference_tail(model, predicts: str, global_token_ids: torch.Tensor | None = None):
    """What ``SparkTTS.inference`` does once its language model has written ``predicts``: the ids
    are parsed out into int64 tensors on ``model.device``, the global ids as (1, 1, 32) (from the
    text in voice creation, from ``tokenize`` in voice cloning) given to ``detokenize`` as
    (1, 32), the semantic ids as (1, T)."""

    def ids(kind: str) -> torch.Tensor:
        return torch.tensor([int(i) for i in re.findall(rf"bicodec_{kind}_(\d+)", predicts)]).long()

    if global_token_ids is None:  # voice creation: the language model wrote them too
        global_token_ids = ids("global")[None, None]
    semantic = ids("semantic")[None].to(model.device)
    return model.audio_tokenizer.detokenize(global_token_ids.to(model.device).squeeze(0), semantic)


class SparkTTSStandIn:
    """What ``SparkTTS`` holds that ``inference`` uses at its end."""

    device = torch.device("cpu")

    def __init__(self, audio_tokenizer) -> None:
        self.audio_tokenizer = audio_tokenizer


class ClonerStandIn:
    """The original tokenizer's other methods (``tokenize``: (1, 1, 32) global ids, as
    BiCodec's speaker encoder returns them, and (1, T) semantic ids)."""

    sample_rate = 16000

    def tokenize(self, audio_path):
        rng = np.random.default_rng(len(audio_path))
        global_ids, semantic_ids = rng.integers(0, 4096, (1, 1, 32)), rng.integers(0, 8192, (1, 9))
        return torch.from_numpy(global_ids), torch.from_numpy(semantic_ids)


def model_text(rng, n_semantic: int, with_globals: bool) -> str:
    glob = "".join(f"<|bicodec_global_{i}|>" for i in rng.integers(0, 4096, 32)) if with_globals else ""
    return glob + "".join(f"<|bicodec_semantic_{i}|>" for i in rng.integers(0, 8192, n_semantic))


@pytest.fixture
def server(thread_server):
    return thread_server(slots=8, max_wait_ms=5)


def test_voice_creation_flow_returns_what_bicodec_tokenizer_returns(server):
    """``model.audio_tokenizer = SharedAudioTokenizer(name)`` and nothing else changed."""
    rng = np.random.default_rng(0)
    predicts = model_text(rng, 47, with_globals=True)
    model = SparkTTSStandIn(audio_tokenizer=None)
    model.audio_tokenizer = SharedAudioTokenizer(server.name)  # the one-line change
    wav = inference_tail(model, predicts)
    glob = torch.tensor([int(t) for t in re.findall(r"bicodec_global_(\d+)", predicts)]).long()[None]
    sem = torch.tensor([int(t) for t in re.findall(r"bicodec_semantic_(\d+)", predicts)]).long()[None]
    want = spark_detokenize_reference(glob, sem)
    assert isinstance(wav, np.ndarray) and wav.dtype == np.float32 == want.dtype
    assert wav.shape == want.shape == (47 * 320,)
    assert np.abs(wav - want).max() <= TOL
    assert np.abs(wav).max() > 1e-2, "near-silent audio: a weak check"
    model.audio_tokenizer.close()


def test_voice_cloning_flow_keeps_the_original_tokenize(server):
    original = ClonerStandIn()
    model = SparkTTSStandIn(audio_tokenizer=original)
    model.audio_tokenizer = SharedAudioTokenizer(server.name, tokenizer=model.audio_tokenizer)
    global_token_ids, prompt_semantic = model.audio_tokenizer.tokenize("prompt.wav")  # process_prompt
    assert global_token_ids.shape == (1, 1, 32) and model.audio_tokenizer.sample_rate == 16000
    predicts = model_text(np.random.default_rng(1), 30, with_globals=False)
    wav = inference_tail(model, predicts, global_token_ids)
    sem = torch.tensor([int(t) for t in re.findall(r"bicodec_semantic_(\d+)", predicts)]).long()[None]
    want = spark_detokenize_reference(global_token_ids.squeeze(0), sem)
    assert wav.shape == (30 * 320,) and wav.dtype == np.float32
    assert np.abs(wav - want).max() <= TOL
    model.audio_tokenizer.close()


def test_a_batch_returns_rows_as_spark_tts_squeeze_leaves_them(server):
    rng = np.random.default_rng(2)
    glob = torch.from_numpy(rng.integers(0, 4096, (3, 32)))
    sem = torch.from_numpy(rng.integers(0, 8192, (3, 12)))
    with DecoderClient(server.name) as client:
        wav = SharedAudioTokenizer(client=client).detokenize(glob, sem)
    want = spark_detokenize_reference(glob, sem)
    assert wav.shape == want.shape == (3, 12 * 320) and wav.dtype == np.float32
    assert np.abs(wav - want).max() <= TOL


def test_numpy_and_lists_work_and_bad_input_raises_before_anything_is_sent(server):
    tok = SharedAudioTokenizer(server.name)
    rng = np.random.default_rng(3)
    glob, sem = rng.integers(0, 4096, (1, 32)), rng.integers(0, 8192, (1, 5))
    assert np.array_equal(tok.detokenize(glob, sem), tok.detokenize(glob.tolist(), sem.tolist()))
    requests = tok.client.get_stats()["requests"]
    with pytest.raises(ValueError, match=r"global_tokens must be \(B, 32\), got shape \(1, 31\)"):
        tok.detokenize(glob[:, :31], sem)
    with pytest.raises(ValueError, match=r"global_tokens must be 2-D, \(B, N\) .* got shape \(32,\)"):
        tok.detokenize(glob[0], sem)
    with pytest.raises(ValueError, match="semantic_tokens must hold integer ids .* got dtype float32"):
        tok.detokenize(glob, torch.zeros(1, 5))
    with pytest.raises(ValueError, match="global_tokens has 1 row.* and semantic_tokens 2"):
        tok.detokenize(glob, np.zeros((2, 5), np.int64))
    with pytest.raises(ValueError, match=r"semantic_ids\[2\] = 8192 is out of range: ids must be in 0..8191"):
        tok.detokenize(glob, [[0, 1, 8192]])
    assert tok.client.get_stats()["requests"] == requests
    with pytest.raises(AttributeError, match="pass tokenizer=model.audio_tokenizer"):
        tok.tokenize("prompt.wav")
    tok.close()
