"""Qwen3-TTS voice cloning through a shared server, held to qwen-tts's own run.

``fixtures/qwen3_clone_reference.npz``: qwen-tts 0.1.1's own ``Qwen3TTSModel.generate_voice_clone``
(``ref_audio=(wav, sr)`` and ``ref_text``) on a tiny Qwen3-TTS Base model whose speech tokenizer
holds the weights ``serve --codec qwen3-tts-12hz --preset tiny --seed 0 --encode`` serves; what
its tokenizer's ``encode`` returned for the reference clip, what ``decode`` was given and
returned, and the audio ``generate_voice_clone`` returned. Its script
(``fixtures/make_qwen3_clone_reference.py``) also ran ``generate_voice_clone`` after
``install(model, keep_tokenizer=False)``, and on a model loaded after ``install_loader`` (which
built no tokenizer), against a server on the same weights: every code equal, the audio within
1e-5. qwen-tts's package cannot be imported beside this project's torch (it
imports torchaudio, librosa, sox, onnxruntime), so here a server process answers the same calls
from several client processes at once.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT
from support import TESTS, load_script

from bicodec_shm import DecoderClient
from bicodec_shm.integrations.qwen3_tts import SharedSpeechTokenizer

FIXTURE = os.path.join(TESTS, "fixtures", "qwen3_clone_reference.npz")
MAKER = os.path.join(TESTS, "fixtures", "make_qwen3_clone_reference.py")
WORKER = os.path.join(TESTS, "qwen3_clone_worker.py")
QWEN3 = ("--codec", "qwen3-tts-12hz")
TOL = 1e-5
PROCESSES, ROUNDS = 3, 2


def maker():
    return load_script(MAKER)


@pytest.fixture(scope="module")
def ran() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


def test_the_fixture_was_made_on_the_weights_the_tiny_server_builds(ran):
    """The tokenizer of the recorded run held ``--preset tiny --seed 0``'s weights (their digest),
    and the shared run there matched upstream's: codes equal, audio within 1e-5."""
    make = maker()
    assert str(ran["tokenizer_digest"]) == make.weights_digest(*make.tokenizer_models())
    assert str(ran["qwen_tts"]) == "0.1.1"
    assert max(float(ran[f"{way}/{case}/max_abs_diff"]) for way in ("shared", "loader")
               for case in ("ref24k", "ref16k")) <= TOL  # fmt: skip
    # install_loader: from_pretrained built no tokenizer (qwen-tts's reads its feature extractor's
    # preprocessor_config.json first; without the loader it did)
    assert list(ran["loader/opened"]) == ["config.json"]
    assert "preprocessor_config.json" in list(ran["loader/opened_without"])
    for case, (sr, _) in make.CASES.items():
        assert int(ran[f"{case}/ref_sr"]) == sr
        np.testing.assert_array_equal(ran[f"{case}/ref_wav"], make.reference_clip(sr))
        ref, codes = ran[f"{case}/encode_codes"], ran[f"{case}/decode_codes"]
        # generate_voice_clone decodes the reference's codes, then the talker's
        assert codes.dtype == ref.dtype == np.int64 and codes.shape[1] == ref.shape[1] == 16
        np.testing.assert_array_equal(codes[: len(ref)], ref)
        assert len(codes) > len(ref) and ran[f"{case}/decoded"].shape == (len(codes) * 1920,)


def test_generate_voice_clones_tokenizer_calls_from_processes_at_once_get_upstreams_codes_and_audio(
        start_server, shm_name, tmp_path, ran):  # fmt: skip
    """Three worker processes, each asking two rounds of what ``generate_voice_clone`` asked of
    its tokenizer, all at once: ``encode`` of each reference (24 kHz, and 16 kHz resampled in the
    worker as qwen-tts does) gives upstream's codes, code for code; ``decode`` of the codes
    upstream decoded (both references) gives its audio within 1e-5, and cut as
    ``generate_voice_clone`` cuts it, the audio it returned."""
    start_server(*QWEN3, "--encode", "--max-tokens", "100", "--max-wait-ms", "20")
    outs = [str(tmp_path / f"w{k}.npz") for k in range(PROCESSES)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    command = [sys.executable, WORKER, shm_name, FIXTURE, str(ROUNDS)]
    procs = [subprocess.Popen([*command, out], cwd=ROOT, env=env) for out in outs]
    for proc in procs:
        assert proc.wait(180) == 0
    with DecoderClient(shm_name) as client:
        stats = client.get_stats()
    assert stats["requests"] == PROCESSES * ROUNDS * 4
    assert max(int(k) for k in stats["batch_size_histogram"]) > 1, stats["batch_size_histogram"]
    for out in outs:
        with np.load(out) as got:
            for r in range(ROUNDS):
                for case in ("ref24k", "ref16k"):
                    codes, want = got[f"{r}/{case}/encode_codes"], ran[f"{case}/encode_codes"]
                    assert (codes.dtype, codes.shape) == (want.dtype, want.shape), case
                    np.testing.assert_array_equal(codes, want, err_msg=case)
                    for key in ("decoded", "wav"):
                        mine, theirs = got[f"{r}/{case}/{key}"], ran[f"{case}/{key}"]
                        assert (mine.dtype, mine.shape) == (theirs.dtype, theirs.shape), (case, key)
                        diff = float(np.abs(mine - theirs).max())
                        assert diff <= TOL, (case, key, diff)


def test_the_16_khz_reference_encodes_to_upstreams_codes(start_server, shm_name, ran):
    """``create_voice_clone_prompt`` passes a 16 kHz reference to ``encode`` with ``sr=16000``;
    qwen-tts's tokenizer resamples it to 24 kHz (librosa, soxr's HQ filter) before encoding.
    The recorded codes are the check for an ``encode`` that resamples as it does."""
    start_server(*QWEN3, "--encode", "--max-tokens", "100")
    tokenizer = SharedSpeechTokenizer(shm_name, timeout=60)
    out = tokenizer.encode(ran["ref16k/ref_wav"], sr=int(ran["ref16k/ref_sr"]))
    (codes,) = out.audio_codes
    np.testing.assert_array_equal(np.asarray(codes), ran["ref16k/encode_codes"])
