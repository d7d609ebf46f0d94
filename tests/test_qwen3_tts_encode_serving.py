"""Qwen3-TTS encodes through the server: ``serve --codec qwen3-tts-12hz --encode`` answering
``DecoderClient.encode`` from client processes, and the drop-in's ``SharedSpeechTokenizer.encode``
(``integrations/qwen3_tts.py``) answering ``Qwen3TTSModel``'s voice-cloning call.

Ground truth: ``Qwen3TTSEncoder.tokenize`` of each clip alone, and qwen-tts's own
``Qwen3TTSTokenizer.encode`` (its file as it is, ``test_qwen3_tts_dropin.qwen_tts_tokenizer``)
over qwen-tts's ``Qwen3TTSTokenizerV2Model`` holding the same tiny random encoder weights.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import types
import weakref

import numpy as np
import pytest
import torch
from conftest import ROOT, wait_until_serving
from support import TESTS, qwen3_clip
from test_encode import _serve_reporting_imports
from test_encode_resample import librosa_resample
from test_qwen3_tts_dropin import Qwen3TTSModelStandIn, qwen_tts_tokenizer
from upstream_qwen3_tts import make_tokenizer

from bicodec_shm import DecoderClient, NoEncoderError
from bicodec_shm.integrations.qwen3_tts import EncodeOutput, SharedSpeechTokenizer, install
from bicodec_shm.model.qwen3_tts import Qwen3CodecConfig, Qwen3TTSDecoder, Qwen3TTSEncoder

WORKER = os.path.join(TESTS, "qwen3_encode_worker.py")
SPF = 1920
QWEN3 = ("--codec", "qwen3-tts-12hz")


@pytest.fixture(scope="module")
def encoder() -> Qwen3TTSEncoder:
    """The encoder ``serve --codec qwen3-tts-12hz --encode --preset tiny --seed 0`` builds."""
    return Qwen3TTSEncoder.from_config("tiny-12hz", seed=0)


def lone(encoder: Qwen3TTSEncoder, clip: np.ndarray) -> np.ndarray:
    """(16, frames): ``tokenize`` of ``clip`` alone."""
    out = encoder.tokenize(clip)
    return out.codes[0, :, : int(out.lengths[0])].numpy()


def qwen_tts_with(encoder: Qwen3TTSEncoder):
    """qwen-tts's ``Qwen3TTSTokenizer`` whose model holds ``encoder``'s weights, with the feature
    extractor Mimi's checkpoints name (transformers' ``EncodecFeatureExtractor``, 24 kHz mono,
    padded with 0)."""
    from transformers import EncodecFeatureExtractor

    torch.manual_seed(0)
    twin = make_tokenizer(Qwen3CodecConfig.preset("tiny").to_dict(), encoder.config.to_dict())
    assert twin.encoder.load_state_dict(encoder.encoder.state_dict(), strict=False).unexpected_keys == []
    tokenizer = qwen_tts_tokenizer(twin)
    tokenizer.feature_extractor = EncodecFeatureExtractor(feature_size=1, sampling_rate=24000,
                                                          padding_value=0.0)  # fmt: skip
    return tokenizer


@pytest.fixture(scope="module")
def reference(encoder):
    return qwen_tts_with(encoder)


@pytest.fixture
def server(thread_server, shm_name, encoder):
    thread_server(Qwen3TTSDecoder.from_config("tiny", seed=0), encoder=encoder, max_tokens=100, min_fill=0.0)
    with DecoderClient(shm_name, slots=8, timeout=60) as client:
        yield client


def test_client_processes_encoding_at_once_each_get_their_clips_lone_codes(start_server, shm_name, tmp_path,
                                                                          encoder):  # fmt: skip
    """``serve --codec qwen3-tts-12hz --encode``, two client processes with three encodes each
    in flight at once: every clip gets its lone ``tokenize``'s codes, as 16 levels that
    ``decode_codes`` takes back as they are (one 1920-sample frame a code)."""
    start_server(*QWEN3, "--encode", "--max-tokens", "100", "--max-wait-ms", "20")
    outs = [str(tmp_path / f"w{k}.npz") for k in range(2)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    procs = [subprocess.Popen([sys.executable, WORKER, shm_name, str(20 + k), "3", outs[k]],
                              cwd=ROOT, env=env) for k in range(2)]  # fmt: skip
    for proc in procs:
        assert proc.wait(120) == 0
    with DecoderClient(shm_name) as client:
        histogram = client.get_stats()["batch_size_histogram"]
    assert max(int(k) for k in histogram) > 1, histogram  # rows of different processes batched
    for k, out in enumerate(outs):
        with np.load(out) as got:
            for i in range(3):
                clip = qwen3_clip(20 + k, i)
                np.testing.assert_array_equal(got[f"codes_{i}"], lone(encoder, clip))
                assert got[f"pcm_{i}"].shape == (-(-len(clip) // SPF) * SPF,)
                assert np.isfinite(got[f"pcm_{i}"]).all()


def test_a_qwen3_server_without_encode_loads_no_encoder_and_refuses_encodes(shm_name):
    proc = _serve_reporting_imports(shm_name, *QWEN3)
    try:
        wait_until_serving(shm_name, proc=proc)
        with DecoderClient(shm_name, timeout=30) as client:
            with pytest.raises(NoEncoderError, match="--encode"):
                client.encode(qwen3_clip(1, 0))
            with pytest.raises(NoEncoderError, match="--encode"):
                SharedSpeechTokenizer(client=client).encode(qwen3_clip(1, 0), sr=24000)
            assert client.decode_codes(np.zeros((16, 3), np.int32)).shape == (3 * SPF,)  # decodes as ever
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "IMPORTED []" in out, out  # no transformers: no encoder built


def test_the_drop_ins_encode_is_qwen_tts_encode(server, reference):
    """Each form qwen-tts's ``encode`` takes from numpy (one array, a list, a 2-D channels-last
    array it mixes down, float64) gives its ``audio_codes``: (frames, 16) int64 tensors, equal
    code for code to qwen-tts's encode of each clip alone, and its output's ways of reading."""
    tokenizer = SharedSpeechTokenizer(client=server)
    clips = [qwen3_clip(30, 0), np.zeros(1, np.float32), qwen3_clip(30, 2)[:3840].astype(np.float64),
             np.stack([qwen3_clip(30, 3), -0.5 * qwen3_clip(30, 3)[::-1]], axis=-1)]  # fmt: skip
    requests = server.get_stats()["requests"]
    out = tokenizer.encode(clips, sr=24000)
    assert server.get_stats()["requests"] == requests + len(clips)
    assert isinstance(out, EncodeOutput) and out["audio_codes"] is out.audio_codes is out[0]
    for clip, got in zip(clips, out.audio_codes, strict=True):
        want = reference.encode(clip, sr=24000).audio_codes[0]
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype == torch.int64
        assert got.shape == want.shape == (-(-len(clip) // SPF), 16)
        assert torch.equal(got, want)
    one = tokenizer.encode(clips[0], sr=24000, return_dict=False)
    assert isinstance(one, tuple) and torch.equal(one[0][0], out.audio_codes[0])
    wavs, rate = tokenizer.decode(out)  # encode's output decodes as it is
    assert rate == 24000 and [len(w) for w in wavs] == [len(c) * SPF for c in out.audio_codes]


def test_the_drop_ins_encode_at_another_rate_is_qwen_tts_encode(server, reference, monkeypatch):
    """Clips at 16, 22.05 and 48 kHz (one, a list, float64, 2-D channels last): qwen-tts's encode
    resamples numpy input with ``librosa.resample(y, orig_sr=sr, target_sr=24000)``, the drop-in
    as it does, in the client: the codes are equal code for code. librosa is not a test
    dependency: qwen-tts's module gets ``librosa_resample`` in its place, exactly what librosa
    0.11's ``resample`` computes with its defaults (soxr "HQ", padded to ``ceil(n · ratio)``)."""
    module = sys.modules[type(reference).__module__]
    monkeypatch.setattr(module, "librosa", types.SimpleNamespace(resample=librosa_resample))
    tokenizer = SharedSpeechTokenizer(client=server)
    for sr, clips in [(16000, [qwen3_clip(31, 0)]),
                      (22050, [qwen3_clip(31, 1)[:1764], qwen3_clip(31, 2).astype(np.float64)]),
                      (48000, np.stack([qwen3_clip(31, 3), qwen3_clip(31, 3)[::-1]], axis=-1))]:  # fmt: skip
        out = tokenizer.encode(clips, sr=sr)
        for clip, got in zip(clips if isinstance(clips, list) else [clips], out.audio_codes, strict=True):
            want = reference.encode(clip, sr=sr).audio_codes[0]  # each clip alone, as above
            assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)
    # 1764 samples at 22050 Hz: librosa pads soxr's 1920 samples to 1921, two frames of codes.
    assert tokenizer.encode(qwen3_clip(31, 1)[:1764], sr=22050).audio_codes[0].shape == (2, 16)


BAD = [
    ("ref.wav", {"sr": 24000}, "paths, URLs and base64 strings are not read here"),
    (["a.wav", "b.wav"], {"sr": 24000}, "pass the array with its rate"),
    ([], {"sr": 24000}, "nothing to encode"),
    (np.zeros(100, np.float32), {}, "you must provide `sr`"),
    (np.zeros(100, np.float32), {"sr": 0}, r"sr=0 Hz is not a sample rate: it must be in \[1, 1000000\]"),
    (np.zeros(100, np.float32), {"sr": 24000.0}, r"sr must be an int \(Hz\), got 24000.0"),
    (torch.zeros(100), {"sr": 24000}, r"pass \.cpu\(\)\.numpy\(\)"),
    ([np.zeros(100, np.float32), [0.0] * 100], {"sr": 24000}, "clip 1 must be a numpy array"),
    ([np.zeros(100, np.float32), np.zeros(0, np.float32)], {"sr": 24000}, "clip 1: audio is empty"),
    (np.array([0.1, np.nan], np.float32), {"sr": 24000}, r"clip 0: audio\[1\] = nan is not finite"),
    (np.zeros((2, 3, 4), np.float32), {"sr": 24000}, "clip 0: audio must be 1-D"),
    (np.zeros(10, bool), {"sr": 24000}, "must hold real samples"),
    (np.zeros(100 * SPF + 1, np.float32), {"sr": 24000}, "clip 0: audio of 192001 samples .* longer than"),
    ([np.zeros(10, np.float32), np.zeros(128001, np.float32)], {"sr": 16000},
     r"clip 1: audio of 192002 samples at 24000 Hz \(resampled from 128001 samples at 16000 Hz\) .* longer"),
]


def test_bad_audio_is_a_value_error_before_anything_is_sent(server):
    tokenizer = SharedSpeechTokenizer(client=server)
    requests = server.get_stats()["requests"]
    for audios, kwargs, message in BAD:
        with pytest.raises(ValueError, match=message):
            tokenizer.encode(audios, **kwargs)
    assert server.get_stats()["requests"] == requests  # every check comes before any clip is sent
    assert tokenizer.encode(np.zeros(100 * SPF, np.float32), sr=24000).audio_codes[0].shape == (100, 16)


def test_install_without_the_tokenizer_clones_voices_on_the_server_and_frees_its_weights(
        server, shm_name, encoder, reference):  # fmt: skip
    """``generate_voice_clone``'s encode and decode both go to the server; with
    ``keep_tokenizer=False`` nothing in the worker holds the tokenizer's model any more (with
    ``keep_tokenizer=True`` the same check finds it alive)."""
    model = Qwen3TTSModelStandIn(qwen_tts_with(encoder))
    weights = weakref.ref(model.model.speech_tokenizer.model)
    install(model, name=shm_name)
    gc.collect()
    assert weights() is not None  # kept: the check below can fail
    shared = install(model, name=shm_name, keep_tokenizer=False)
    assert shared.tokenizer is None
    del shared
    gc.collect()
    assert weights() is None, gc.get_referrers(weights())
    model.model.speech_tokenizer._client = server  # the test's client, for its stats
    ref_audio = qwen3_clip(31, 0)
    talker = [torch.randint(0, 2048, (n, 16), generator=torch.Generator().manual_seed(n)) for n in (9, 4)]
    requests = server.get_stats()["requests"]
    wavs, rate = model.generate_voice_clone(talker, ref_audio)
    assert server.get_stats()["requests"] == requests + 1 + len(talker)
    assert rate == 24000 and [len(w) for w in wavs] == [9 * SPF, 4 * SPF]
    ref_code = reference.encode(ref_audio, sr=24000).audio_codes[0]
    full, _ = model.model.speech_tokenizer.decode([{"audio_codes": torch.cat([ref_code, talker[0]])}])
    # The clone decoded these codes (within float rounding: batched with the other row there).
    np.testing.assert_allclose(wavs[0], full[0][len(ref_code) * SPF :], rtol=0, atol=1e-5)


def test_encode_for_a_codec_without_an_encoder_is_refused_naming_those_with_one(shm_name, capsys):
    from bicodec_shm.tools.cli import main

    assert main(["serve", "--codec", "snac-24khz", "--encode", "--name", shm_name]) != 0
    assert "snac-24khz has no encoder here; the codecs that encode are bicodec, qwen3-tts-12hz" in (
        capsys.readouterr().err)  # fmt: skip


# What qwen-tts's ``Qwen3TTSForConditionalGeneration.from_pretrained`` does with the speech
# tokenizer, line for line (qwen_tts/core/models/modeling_qwen3_tts.py): the module's own
# ``Qwen3TTSTokenizer``, looked up when it runs, builds it from ``<folder>/speech_tokenizer``.
UPSTREAM_LOAD = '''
import os

class Qwen3TTSTokenizer:
    @classmethod
    def from_pretrained(cls, path, *model_args, **kwargs):
        with open(os.path.join(path, "model.safetensors"), "rb") as f:  # the weights
            f.read(1)
        raise AssertionError("qwen-tts's own tokenizer was loaded")

def from_pretrained(folder):
    speech_tokenizer_dir = os.path.join(folder, "speech_tokenizer")
    return Qwen3TTSTokenizer.from_pretrained(speech_tokenizer_dir)
'''


def upstream_loader(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(UPSTREAM_LOAD, f"<{name}>", "exec"), module.__dict__)
    return module


def speech_tokenizer_folder(root, model_type: str):
    folder = root / "speech_tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "%s"}' % model_type)
    (folder / "model.safetensors").write_bytes(b"weights")
    return root


def test_install_loader_makes_from_pretrained_load_no_tokenizer_and_clone_on_the_server(
        server, shm_name, encoder, reference, tmp_path):  # fmt: skip
    """Before loading: ``from_pretrained`` opens no tokenizer weights (it would, without
    ``install_loader``: the stand-in opens them and fails) and gets a ``SharedSpeechTokenizer``
    keeping nothing, whose encode and decode are the server's; ``uninstall_loader`` puts qwen-tts's
    class back."""
    from bicodec_shm.integrations import qwen3_tts

    module = upstream_loader("qwen3_loader_standin")
    folder = speech_tokenizer_folder(tmp_path, "qwen3_tts_tokenizer_12hz")
    original = module.Qwen3TTSTokenizer
    opened: list[str] = []
    with pytest.raises(AssertionError, match="own tokenizer was loaded"):
        module.from_pretrained(str(folder))  # the check below can fail
    qwen3_tts.install_loader(shm_name, module=module, timeout=60)
    qwen3_tts.install_loader(shm_name, module=module, timeout=60)  # twice: uninstall still restores
    try:
        root = os.path.realpath(folder) + os.sep
        watching = [True]

        def hook(event: str, args: tuple) -> None:  # every file opened under the model folder
            if watching[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
                path = os.path.realpath(os.fsdecode(args[0]))
                if path.startswith(root):
                    opened.append(os.path.basename(path))

        sys.addaudithook(hook)  # hooks cannot be removed: this one stops watching below
        try:
            tokenizer = module.from_pretrained(str(folder))
        finally:
            watching[0] = False
        assert isinstance(tokenizer, SharedSpeechTokenizer) and tokenizer.tokenizer is None
        assert opened == ["config.json"]  # the weights stay unread
        clip = qwen3_clip(5, 0)
        (codes,) = tokenizer.encode(clip, sr=24000).audio_codes
        np.testing.assert_array_equal(codes.numpy(), reference.encode(clip, sr=24000).audio_codes[0].numpy())
        wavs, sr = tokenizer.decode([{"audio_codes": codes}])
        assert sr == 24000 and wavs[0].shape == (codes.shape[0] * SPF,)
    finally:
        qwen3_tts.uninstall_loader()
    assert module.Qwen3TTSTokenizer is original


def test_install_loader_refuses_a_25_hz_tokenizer_and_a_module_without_one(tmp_path):
    from bicodec_shm.integrations import qwen3_tts

    module = upstream_loader("qwen3_loader_standin_25hz")
    folder = speech_tokenizer_folder(tmp_path, "qwen3_tts_tokenizer_25hz")
    qwen3_tts.install_loader("unused", module=module)
    try:
        with pytest.raises(ValueError, match="'qwen3_tts_tokenizer_25hz'.*serve --codec qwen3-tts-12hz"):
            module.from_pretrained(str(folder))
    finally:
        qwen3_tts.uninstall_loader()
    with pytest.raises(ValueError, match="has no Qwen3TTSTokenizer"):
        qwen3_tts.install_loader("unused", module=types.ModuleType("empty"))
