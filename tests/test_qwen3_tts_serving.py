"""Qwen3-TTS's 12 Hz tokenizer through the shared server: the codec seam (layout, registry, CLI
presets, the header's 16 levels) and mixed-length batches from real client processes across
the 300-frame chunk.

Ground truth is ``Qwen3TTSDecoder.detokenize`` of each request alone (itself checked against
qwen-tts's decode in tests/test_qwen3_tts_model.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from support import seed_int16

from bicodec_shm.codecs import LAYOUTS, QWEN3_TTS_12HZ, check_request
from bicodec_shm.codecs.layout import default_max_frames
from bicodec_shm.model.qwen3_tts import Qwen3TTSDecoder
from bicodec_shm.model.registry import decoder_class
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.tools.cli import _parser
from bicodec_shm.tools.model_args import CODEC_PRESETS, CODECS, load_decoder, resolve_preset

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dac_worker.py")  # one code per codebook per frame, as DAC


def lone(decoder: Qwen3TTSDecoder, codes: np.ndarray) -> np.ndarray:
    """The unpadded decode of one request (16, n): (1920·n,) float32."""
    return decoder.detokenize(torch.as_tensor(np.asarray(codes, np.int64))[None])[0].numpy()


def test_the_layout_has_a_decoder_a_cli_choice_and_presets():
    assert LAYOUTS["qwen3-tts-12hz"] == QWEN3_TTS_12HZ and "qwen3-tts-12hz" in CODECS
    assert QWEN3_TTS_12HZ.codes_per_frame == 16 and set(QWEN3_TTS_12HZ.level_vocab) == {2048}
    assert QWEN3_TTS_12HZ.samples_per_frame == 1920 and QWEN3_TTS_12HZ.frame_rate == 12.5
    assert decoder_class("qwen3-tts-12hz") is Qwen3TTSDecoder
    assert {"qwen3-tts-12hz", "tiny-12hz"} <= set(CODEC_PRESETS)
    assert resolve_preset("qwen3-tts-12hz", None) == "qwen3-tts-12hz"
    assert resolve_preset("qwen3-tts-12hz", "tiny") == "tiny-12hz"
    with pytest.raises(ValueError, match="not a qwen3-tts-12hz model"):
        resolve_preset("qwen3-tts-12hz", "tiny-24khz")
    with pytest.raises(ValueError, match="add --codec qwen3-tts-12hz"):
        resolve_preset("bicodec", "tiny-12hz")
    assert default_max_frames("qwen3-tts-12hz") == 375  # 30 s at 12.5 frames per second
    levels, _, frames = check_request(QWEN3_TTS_12HZ, np.zeros((16, 5), np.int64))
    assert frames == 5 and len(levels) == 16


def test_load_decoder_serves_the_codec_and_refuses_another_codecs_folder(tmp_path):
    args = _parser().parse_args(["serve", "--codec", "qwen3-tts-12hz", "--preset", "tiny"])
    decoder = load_decoder(args, announce=False)
    assert isinstance(decoder, Qwen3TTSDecoder) and decoder.config.layout == QWEN3_TTS_12HZ
    assert decoder.codec_adapter().layout == QWEN3_TTS_12HZ
    decoder.save_pretrained(tmp_path)
    args = _parser().parse_args(["serve", "--codec", "qwen3-tts-12hz", "--model-dir", str(tmp_path)])
    assert load_decoder(args, announce=False).config == decoder.config
    args = _parser().parse_args(["serve", "--codec", "dac-24khz", "--model-dir", str(tmp_path)])
    named = "holds a qwen3-tts-12hz model, not a dac-24khz one: pass --codec qwen3-tts-12hz"
    with pytest.raises(ValueError, match=named):
        load_decoder(args, announce=False)


def test_a_header_holds_16_codebooks(shm_name):
    seg = Segment.create(shm_name, n_slots=2, max_tokens=375, codec=QWEN3_TTS_12HZ)
    try:
        seg.start_serving()
        att = Segment.attach(shm_name)
        try:
            assert att.codec == QWEN3_TTS_12HZ and att.tokens.shape == (2, 375 * 16)
        finally:
            att.close()
    finally:
        seg.unlink()
        seg.close()


def test_client_processes_across_the_chunk_get_their_lone_decodes(start_server, shm_name, tmp_path):
    """`serve --codec qwen3-tts-12hz --preset tiny` to 3 torch-free client processes, 2 requests
    in flight each, 290-330 frames (most across the 300-frame chunk; no token budget, which would
    decode them one by one): batches of mixed lengths,
    each row its lone decode (float32 within 1e-5, int16 within 1 LSB, lengths equal)."""
    start_server("--codec", "qwen3-tts-12hz", "--preset", "tiny", "--threads", "1", "--slots", "8",
                 "--max-wait-ms", "50", "--min-fill", "0", "--max-batch-tokens", "none")  # fmt: skip
    clients, requests = 3, 2
    outs = [str(tmp_path / f"c{i}.npz") for i in range(clients)]
    dtypes = ["float32", "int16", "float32"]
    procs = [subprocess.Popen([sys.executable, WORKER, shm_name, str(20 + i), str(requests), outs[i],
                               "--dtype", dtypes[i], "--min-frames", "290", "--max-frames", "330"])
             for i in range(clients)]  # fmt: skip
    for p in procs:
        assert p.wait(timeout=280) == 0
    decoder = Qwen3TTSDecoder.from_config("tiny", seed=0)
    worst32 = worst16 = 0.0
    lengths = []
    for out, dtype in zip(outs, dtypes):
        data = np.load(out)
        for j in range(requests):
            expected = lone(decoder, data[f"codes_{j}"])
            pcm = data[f"pcm_{j}"]
            lengths.append(data[f"codes_{j}"].shape[1])
            assert pcm.dtype == np.dtype(dtype) and pcm.shape == expected.shape
            if dtype == "float32":
                worst32 = max(worst32, float(np.abs(pcm - expected).max()))
            else:
                worst16 = max(worst16, int(np.abs(pcm.astype(np.int32) - seed_int16(expected)).max()))
    assert worst32 <= 1e-5 and worst16 <= 1, (worst32, worst16)
    assert max(lengths) > 300 and len(set(lengths)) > 1, lengths
    stats = json.loads(subprocess.run([sys.executable, "-m", "bicodec_shm", "stats", shm_name, "--json"],
                                      capture_output=True, text=True, check=True).stdout)  # fmt: skip
    assert stats["codec"] == "qwen3-tts-12hz" and stats["requests"] == clients * requests
    assert stats["failed"] == 0
    assert max(int(b) for b in stats["batch_size_histogram"]) > 1, stats["batch_size_histogram"]
