"""Spark-TTS workers that hold only their language model: ``spark_tts.install()`` makes
``SparkTTS`` build a ``SharedBiCodecTokenizer``, which loads no model and whose ``tokenize``
(voice cloning's prompt wav) and ``detokenize`` go to a shared server.

The ids are held to Spark-TTS's own: ``tests/fixtures/spark_encode_reference.npz`` holds what
upstream's ``BiCodecTokenizer.tokenize`` returned for four prompt wavs on tiny random weights
(its make-script says how); the server here encodes with those weights. Upstream's package
cannot be imported beside this project's torch (its BiCodec needs torchaudio, which pins another
torch release), so the ``SparkTTS`` these workers build is a stand-in with upstream's shape: a
module-level ``BiCodecTokenizer`` that ``_initialize_inference`` calls with
``(model_dir, device=...)``, and that opens the model folder's weights. Upstream's whole
``SparkTTS.inference`` is held to through ``tests/fixtures/spark_inference_reference.npz``: its
script ran upstream's ``inference`` with its own tokenizer and, after ``install()``, against a
server (ids equal, audio within 1e-5), and the last test here answers the same calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import test_spark_encode_reference as encode_reference
import torch
from conftest import ROOT
from support import TESTS, load_script

from bicodec_shm.integrations import spark_tts
from bicodec_shm.integrations.spark_tts import SharedBiCodecTokenizer

# The fixture's weights and waveforms, as tests/test_spark_encode_reference.py builds them.
reference, model_folder = encode_reference.reference, encode_reference.model_folder
model = encode_reference.model
waves = encode_reference.waves
WORKER = os.path.join(TESTS, "spark_worker.py")
SOUNDFILE = pytest.importorskip("soundfile")

STANDIN = '''
"""A stand-in for Spark-TTS's cli/SparkTTS.py: only the shape install() relies on."""
from pathlib import Path


class BiCodecTokenizer:
    def __init__(self, model_dir, device=None, **kwargs):
        for weights in ("BiCodec/model.safetensors", "wav2vec2-large-xlsr-53/config.json"):
            Path(model_dir, weights).read_bytes()


class SparkTTS:
    def __init__(self, model_dir, device):
        self.model_dir, self.device = model_dir, device
        self._initialize_inference()

    def _initialize_inference(self):
        self.audio_tokenizer = BiCodecTokenizer(self.model_dir, device=self.device)
'''


@pytest.fixture(scope="module")
def decoder(model_folder):
    """The decoder of the fixture's BiCodec weights (its tiny codebook: 1024 semantic ids)."""
    from bicodec_shm.model import BiCodecDecoder

    return BiCodecDecoder.from_pretrained(model_folder / "BiCodec")


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """A directory holding ``cli/SparkTTS.py`` (the stand-in), imported as ``cli.SparkTTS``."""
    (tmp_path / "standin" / "cli").mkdir(parents=True)
    (tmp_path / "standin" / "cli" / "__init__.py").write_text("")
    (tmp_path / "standin" / "cli" / "SparkTTS.py").write_text(textwrap.dedent(STANDIN))
    monkeypatch.syspath_prepend(str(tmp_path / "standin"))
    for mod in ("cli", "cli.SparkTTS"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    yield str(tmp_path / "standin")
    spark_tts.uninstall()


@pytest.fixture
def prompts(reference, tmp_path) -> list[str]:
    """The fixture's waveforms as the float wav files upstream tokenized."""
    paths = []
    for i in waves(reference):
        path = str(tmp_path / f"prompt{i}.wav")
        SOUNDFILE.write(path, reference[f"wave/{i}/input"].astype(np.float32), 16000, subtype="FLOAT")
        paths.append(path)
    return paths


def _run_worker(name, standin, model_folder, out, wavs):
    proc = subprocess.run([sys.executable, WORKER, name, standin, str(model_folder), out, *wavs],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as got:
        return {k: got[k] for k in got.files}


def test_workers_load_no_codec_and_get_spark_tts_ids_from_the_server_at_once(
        thread_server, shm_name, model, decoder, model_folder, reference, prompts, standin,
        tmp_path):  # fmt: skip
    """Three worker processes, each building SparkTTS after install() and tokenizing the four
    prompts from threads at once: no file of the model folder opened, no torch, transformers or
    model code imported, and every (global, semantic) pair is upstream's, dtype and shape too."""
    thread_server(decoder, encoder=model, max_tokens=200, min_fill=0.0)
    outs = [str(tmp_path / f"w{k}.npz") for k in range(3)]
    procs = [subprocess.Popen([sys.executable, WORKER, shm_name, standin, str(model_folder), out, *prompts],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])},
                              stderr=subprocess.PIPE, text=True)
             for out in outs]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    for out in outs:
        with np.load(out) as got:
            assert str(got["tokenizer"]) == "SharedBiCodecTokenizer"
            assert got["opened"].tolist() == []
            assert got["modules"].tolist() == [False, False, False]
            for k, i in enumerate(waves(reference)):
                for key, mine in (("global", got[f"glb_{k}"]), ("semantic", got[f"sem_{k}"])):
                    theirs = reference[f"wave/{i}/{key}"]
                    assert (mine.dtype, mine.shape) == (theirs.dtype, theirs.shape), (i, key)
                    np.testing.assert_array_equal(mine, theirs, err_msg=f"wave {i} {key}")


def test_the_audit_sees_what_spark_tts_own_tokenizer_opens(model_folder, standin, tmp_path):
    """Without install(), the same worker's SparkTTS opens the folder's weights: the check above
    can fail."""
    got = _run_worker("-", standin, model_folder, str(tmp_path / "own.npz"), [])
    assert str(got["tokenizer"]) == "BiCodecTokenizer"
    assert sorted(os.path.basename(p) for p in got["opened"]) == ["config.json", "model.safetensors"]


def test_in_a_torch_process_tokenize_returns_tensors_that_inference_uses_as_upstream(
        thread_server, shm_name, model, decoder, reference, prompts, standin):  # fmt: skip
    """With torch imported (a Spark-TTS worker), tokenize returns upstream's tensors on the
    model's device; detokenize takes them back as SparkTTS.inference passes them, and
    uninstall() gives SparkTTS its own tokenizer again."""
    import cli.SparkTTS as upstream

    thread_server(decoder, encoder=model, max_tokens=200, min_fill=0.0)
    own = upstream.BiCodecTokenizer
    spark_tts.install(shm_name, timeout=60)
    tts = upstream.SparkTTS("/nonexistent/Spark-TTS-0.5B", torch.device("cpu"))
    tok = tts.audio_tokenizer
    assert isinstance(tok, SharedBiCodecTokenizer) and tok.device == torch.device("cpu")
    global_ids, semantic = tok.tokenize(prompts[0])
    i = waves(reference)[0]
    assert global_ids.dtype == torch.int32 and semantic.dtype == torch.int64
    assert torch.equal(global_ids, torch.from_numpy(reference[f"wave/{i}/global"]))
    assert torch.equal(semantic, torch.from_numpy(reference[f"wave/{i}/semantic"]))
    # inference's cloning prompt: "<|bicodec_global_{i}|>" for i in global_token_ids.squeeze()
    assert [f"{v}" for v in global_ids.squeeze()] == [str(v) for v in reference[f"wave/{i}/global"].ravel()]
    wav = tok.detokenize(global_ids.squeeze(0), semantic)
    assert wav.dtype == np.float32 and wav.shape == (320 * semantic.shape[1],)
    np.testing.assert_allclose(wav, spark_tts.SharedAudioTokenizer(shm_name).detokenize(
        global_ids.squeeze(0), semantic), atol=0)  # fmt: skip
    spark_tts.uninstall()
    assert upstream.BiCodecTokenizer is own


def test_a_prompt_at_another_rate_and_in_stereo_is_read_as_spark_tts_reads_it(
        thread_server, shm_name, model, decoder, reference, tmp_path, standin):  # fmt: skip
    """Channel 0, resampled to 16 kHz by soxr's VHQ (upstream's load_audio), then encoded."""
    soxr = pytest.importorskip("soxr")
    thread_server(decoder, encoder=model, max_tokens=200, min_fill=0.0)
    rng = np.random.default_rng(3)
    left = np.clip(rng.standard_normal(33075) * 0.3, -1, 1)  # 0.75 s at 44.1 kHz
    path = str(tmp_path / "stereo.wav")
    SOUNDFILE.write(path, np.stack([left, -left[::-1]], axis=1), 44100, subtype="PCM_16")
    read, _ = SOUNDFILE.read(path)
    wav16k = soxr.resample(read[:, 0], 44100, 16000, quality="VHQ")
    expect = model.tokenize(torch.from_numpy(wav16k.astype(np.float32)[None]))
    global_ids, semantic = SharedBiCodecTokenizer(name=shm_name, timeout=60).tokenize(path)
    np.testing.assert_array_equal(semantic.numpy()[0], expect.semantic_ids[0].numpy())
    np.testing.assert_array_equal(global_ids.numpy().ravel(), expect.global_ids[0].numpy())


def test_bad_prompts_are_value_errors_naming_the_file_and_the_server_serves_on(
        thread_server, shm_name, model, decoder, prompts, tmp_path):  # fmt: skip
    thread_server(decoder, encoder=model, max_tokens=200, min_fill=0.0)
    tok = SharedBiCodecTokenizer(name=shm_name, timeout=60)
    empty, nan, text, short = (str(tmp_path / f) for f in ("empty.wav", "nan.wav", "x.wav", "short.wav"))
    SOUNDFILE.write(empty, np.zeros(0, np.float32), 16000, subtype="FLOAT")
    SOUNDFILE.write(nan, np.array([0.1, np.nan] * 800, np.float32), 16000, subtype="FLOAT")
    SOUNDFILE.write(short, np.full(50, 0.1, np.float32), 16000, subtype="FLOAT")
    with open(text, "w") as f:
        f.write("not audio")
    for path, words in ((empty, "no audio"), (nan, "NaN"), (text, "cannot read"),
                        (str(tmp_path / "missing.wav"), "cannot read"), (short, "short")):  # fmt: skip
        with pytest.raises(ValueError, match=words) as err:
            tok.tokenize(path)
        assert err.value.__cause__ is None or isinstance(err.value.__cause__, ValueError)
    with pytest.raises(ValueError, match="cannot read"):
        tok.tokenize(12345)
    assert tok.tokenize(prompts[0])[1].shape[0] == 1  # the server serves on


def test_install_names_what_it_cannot_find(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "nospark.py").write_text("class SparkTTS: pass\n")
    with pytest.raises(ValueError, match="no BiCodecTokenizer"):
        spark_tts.install("x", module="nospark")
    with pytest.raises(ImportError, match="cannot import Spark-TTS's SparkTTS module"):
        spark_tts.install("x", module="no_such_spark_module")


INFERENCE = os.path.join(TESTS, "fixtures", "spark_inference_reference.npz")
INFERENCE_MAKER = os.path.join(TESTS, "fixtures", "make_spark_inference_reference.py")


def test_spark_tts_inference_on_the_shared_tokenizer_gets_upstreams_ids_and_audio(
        thread_server, shm_name, reference, model, model_folder, tmp_path):  # fmt: skip
    """``fixtures/spark_inference_reference.npz``: upstream's own ``SparkTTS.inference``, voice
    cloning and voice creation, on these codec weights and a tiny language model (its script
    also ran it after install() against a server: every id equal, the audio within 1e-5). Here
    a server on the same weights answers what inference asks of its tokenizer: ``tokenize`` of
    the prompt gives upstream's tensors, and ``detokenize`` of what upstream's inference passed
    gives its waveform within 1e-5."""
    import shutil

    from bicodec_shm.model import BiCodecDecoder

    maker = load_script(INFERENCE_MAKER)
    with np.load(INFERENCE) as data:
        ran = {k: data[k] for k in data.files}
    folder = tmp_path / "Spark-TTS-tiny"
    shutil.copytree(model_folder, folder)  # the encode fixture's folder, as the script writes it
    maker.scale_last_conv(folder)
    thread_server(BiCodecDecoder.from_pretrained(folder / "BiCodec"), encoder=model, max_tokens=200,
                  min_fill=0.0)  # fmt: skip
    prompt = str(tmp_path / "prompt.wav")
    SOUNDFILE.write(prompt, reference[f"wave/{maker.PROMPT_WAVE}/input"].astype(np.float32), 16000,
                    subtype="FLOAT")  # fmt: skip
    tok = SharedBiCodecTokenizer(folder, torch.device("cpu"), name=shm_name, timeout=60)
    global_ids, semantic = tok.tokenize(prompt)
    for mine, key in ((global_ids, "clone/tokenize_global"), (semantic, "clone/tokenize_semantic")):
        assert (mine.numpy().dtype, tuple(mine.shape)) == (ran[key].dtype, ran[key].shape), key
        np.testing.assert_array_equal(mine.numpy(), ran[key], err_msg=key)
    # inference passes global_token_ids.to(device).squeeze(0) on: upstream's was this one
    np.testing.assert_array_equal(global_ids.squeeze(0).numpy(), ran["clone/detok_global"])
    for task in ("clone", "create"):
        wav = tok.detokenize(torch.from_numpy(ran[f"{task}/detok_global"]),
                             torch.from_numpy(ran[f"{task}/detok_semantic"]))  # fmt: skip
        theirs = ran[f"{task}/wav"]
        assert (wav.dtype, wav.shape) == (theirs.dtype, theirs.shape), task
        assert np.abs(wav - theirs).max() <= 1e-5, (task, float(np.abs(wav - theirs).max()))
        assert float(ran[f"shared/{task}/max_abs_diff"]) <= 1e-5


def test_serve_loads_a_spark_tts_folder_with_its_own_config_yaml(model_folder):
    """``serve --model-dir pretrained_models/Spark-TTS-0.5B --encode``: the folder has a
    config.yaml of its own beside BiCodec/ (as released); the decoder is BiCodec/'s."""
    import argparse

    from bicodec_shm.model.bicodec.checkpoint import codec_in, find_folder
    from bicodec_shm.tools.model_args import load_decoder

    assert (model_folder / "config.yaml").is_file() and find_folder(model_folder) == model_folder / "BiCodec"
    assert codec_in(model_folder) == "bicodec"
    args = argparse.Namespace(model_dir=str(model_folder), device="cpu", threads=None, preset=None,
                              seed=0, codec="bicodec")  # fmt: skip
    assert load_decoder(args, announce=False).config.semantic_vocab == 1024
