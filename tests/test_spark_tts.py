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
import threading

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


# -- the longest rows Spark-TTS writes, and every input form --------------------------------------

SPARK_LONGEST = 3000  # semantic tokens: Spark-TTS's max_new_tokens, ~60 s
# Measured (tiny preset, seed 7, 3000 tokens through a 1500-token server, three windows): max |Δ|
# against the whole decode 2.7e-6 (float rounding; int16: 1 step); TOL keeps a margin. With
# random weights the far tokens weigh little (30 tokens of context: 2.7e-6 too, 16: 2e-3), so
# the receptive field's need is shown by tests/test_model.py's NaN test, not by this tolerance.


class ConcurrentWindows:
    """A client whose decodes wait for each other at a barrier: windows sent one after another
    never get past it (BrokenBarrierError after 20 s)."""

    def __init__(self, client: DecoderClient, parties: int) -> None:
        self._client, self._barrier, self.name = client, threading.Barrier(parties, timeout=20), client.name

    @property
    def max_tokens(self) -> int:
        return self._client.max_tokens

    def decode(self, *args, **kwargs):
        self._barrier.wait()
        return self._client.decode(*args, **kwargs)


def test_a_3000_token_row_decodes_as_the_whole_decode_through_a_1500_token_server(server):
    """Spark-TTS's longest output, twice what a default slot holds: exact overlapping windows,
    sent together (three, held at a barrier until all are in flight)."""
    rng = np.random.default_rng(7)
    glob = torch.from_numpy(rng.integers(0, 4096, (1, 32)))
    sem = torch.from_numpy(rng.integers(0, 8192, (1, SPARK_LONGEST)))
    with DecoderClient(server.name, timeout=60) as client:
        assert client.max_tokens == 1500  # the server's default
        requests = client.get_stats()["requests"]
        wav = SharedAudioTokenizer(client=ConcurrentWindows(client, 3)).detokenize(glob, sem)
        assert client.get_stats()["requests"] - requests == 3
    want = spark_detokenize_reference(glob, sem)
    assert wav.dtype == np.float32 and wav.shape == want.shape == (320 * SPARK_LONGEST,)
    assert np.abs(wav - want).max() <= TOL
    assert np.abs(want).max() > 1e-2


def test_a_long_row_is_planned_again_for_a_server_restarted_with_a_smaller_max_tokens(shm_name):
    """The server (1500) is replaced by one with --max-tokens 400 between the read of its limit
    and the windows: the new server refuses them, and the row is planned again for 400."""
    from bicodec_shm.server.server import DecoderServer

    def serve(limit):
        s = DecoderServer(reference_model(), shm_name, slots=8, max_tokens=limit, max_wait_ms=5)
        return s, s.start_thread()

    running = [serve(1500)]

    def restart():
        old, thread = running.pop()
        old.stop()
        thread.join(30)
        running.append(serve(400))

    class RestartAfterLimitRead:
        def __init__(self, client):
            self._client, self._restart, self.name = client, restart, client.name

        @property
        def max_tokens(self):
            limit, (restart_now, self._restart) = self._client.max_tokens, (self._restart, None)
            if restart_now is not None:
                restart_now()
            return limit

        def decode(self, *args, **kwargs):
            return self._client.decode(*args, **kwargs)

    rng = np.random.default_rng(8)
    glob, sem = rng.integers(0, 4096, (1, 32)), rng.integers(0, 8192, (1, 2000))
    try:
        with DecoderClient(shm_name, timeout=60) as client:
            wav = SharedAudioTokenizer(client=RestartAfterLimitRead(client)).detokenize(glob, sem)
            assert client.max_tokens == 400
    finally:
        for s, thread in running:
            s.stop()
            thread.join(30)
    want = spark_detokenize_reference(torch.from_numpy(glob), torch.from_numpy(sem))
    assert np.abs(wav - want).max() <= TOL


INTEGER_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32,
                  torch.int64, torch.uint64]  # fmt: skip


def test_every_integer_tensor_dtype_numpy_arrays_and_lists_decode_alike(server):
    rng = np.random.default_rng(9)
    glob, sem = rng.integers(0, 128, (1, 32)), rng.integers(0, 128, (1, 11))  # ids every dtype holds
    tok = SharedAudioTokenizer(server.name)
    want = spark_detokenize_reference(torch.from_numpy(glob), torch.from_numpy(sem))
    forms = [(torch.from_numpy(glob).to(d), torch.from_numpy(sem).to(d)) for d in INTEGER_DTYPES]
    forms += [(glob.astype(np.int32), sem.astype(np.uint16)), (glob.tolist(), sem.tolist())]
    for g, s in forms:
        wav = tok.detokenize(g, s)
        assert wav.shape == want.shape and np.abs(wav - want).max() <= TOL, type(s)
    tok.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.complex64, torch.bool])  # fmt: skip
@pytest.mark.parametrize("which", ["global_tokens", "semantic_tokens"])
def test_a_tensor_of_any_other_dtype_gets_a_value_error_naming_the_input(server, dtype, which):
    tok = SharedAudioTokenizer(server.name)
    glob, sem = torch.zeros(1, 32, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long)
    args = {"global_tokens": glob, "semantic_tokens": sem}
    args[which] = args[which].to(dtype)
    requests = tok.client.get_stats()["requests"]
    with pytest.raises(ValueError, match=rf"^{which} must hold integer ids .* got dtype {str(dtype)[6:]}$"):
        tok.detokenize(args["global_tokens"], args["semantic_tokens"])
    assert tok.client.get_stats()["requests"] == requests
    tok.close()


@pytest.mark.parametrize(("glob", "sem", "message"), [
    (np.zeros((1, 32), np.int64), np.zeros(5, np.int64), r"semantic_tokens must be 2-D, \(B, N\)"),
    (np.zeros(32, np.int64), np.zeros((1, 5), np.int64), r"global_tokens must be 2-D, \(B, N\)"),
    (np.zeros((1, 32), int), np.zeros((1, 0), int), r"semantic_tokens must be 2-D.* got shape \(1, 0\)"),
    (np.zeros((0, 32), int), np.zeros((0, 5), int), r"global_tokens must be 2-D.* got shape \(0, 32\)"),
    ([[0] * 32], [], r"semantic_tokens must (be 2-D|hold integer ids)"),
    (torch.zeros(1, 32).long(), torch.zeros(1, 0).long(), "semantic_tokens must be 2-D"),
    ([[0] * 32], [[1, 2], [3]], "semantic_tokens: cannot read a list as an array"),
    ([[0] * 32], [["a"]], "semantic_tokens must hold integer ids"),
    ([[0] * 32], np.zeros((1, 100_001), np.int64), "semantic_ids has 100001 ids, more than the 100000"),
])  # fmt: skip
def test_bad_shapes_and_empty_rows_get_a_value_error_naming_the_input(server, glob, sem, message):
    tok = SharedAudioTokenizer(server.name)
    with pytest.raises(ValueError, match=message):
        tok.detokenize(glob, sem)
    tok.close()


@pytest.mark.slow
def test_a_long_row_at_full_size_equals_the_whole_decode(shm_name):
    """spark-tts-0.5b (receptive field 67 tokens, the windows' context) through a 200-token
    server: 250 tokens as two windows. Measured max |Δ| 2.1e-6. (Full size decodes ~15 tokens
    a second on a 2-core CPU: 3000 tokens would take minutes; the tiny test covers that length.)"""
    from bicodec_shm.model import BiCodecDecoder
    from bicodec_shm.server.server import DecoderServer

    full = BiCodecDecoder.from_config("spark-tts-0.5b", seed=0)
    rng = np.random.default_rng(10)
    glob = torch.from_numpy(rng.integers(0, 4096, (1, 32)))
    sem = torch.from_numpy(rng.integers(0, 8192, (1, 250)))
    with torch.inference_mode():
        want = full.detokenize(sem, glob)[0].numpy()
    server = DecoderServer(full, shm_name, slots=4, max_tokens=200, max_wait_ms=5)
    thread = server.start_thread()
    try:
        with DecoderClient(shm_name, timeout=300) as client:
            wav = SharedAudioTokenizer(client=client).detokenize(glob, sem)
            assert client.get_stats()["requests"] == 2
    finally:
        server.stop()
        thread.join(60)
    assert np.abs(wav - want).max() <= TOL
