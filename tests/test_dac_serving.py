"""DAC through the shared server: the codec seam, the client's checks (codes as one array, Dia's
delayed tokens), exact mixed-length batches from real client processes.

Ground truth is ``DACDecoder.detokenize`` of each request alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from support import seed_int16

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.codecs import DAC_24KHZ, DAC_44KHZ, LAYOUTS, check_request, codes_to_dia, dia_to_codes
from bicodec_shm.codecs.layout import default_max_frames
from bicodec_shm.model.dac import DACDecoder
from bicodec_shm.model.registry import decoder_class
from bicodec_shm.protocol.layout import MAX_LEVELS
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.tools.cli import _parser
from bicodec_shm.tools.model_args import CODECS, load_decoder, resolve_preset

HERE = os.path.dirname(os.path.abspath(__file__))
DAC_WORKER = os.path.join(HERE, "dac_worker.py")


def lone(decoder: DACDecoder, codes: np.ndarray) -> np.ndarray:
    """The unpadded decode of one request (n_codebooks, n): (decoded_samples(n),) float32."""
    return decoder.detokenize(torch.as_tensor(np.asarray(codes, np.int64))[None])[0].numpy()


def random_codes(rng, frames: int, layout=DAC_44KHZ) -> np.ndarray:
    return rng.integers(0, 1024, (layout.n_levels, frames))


@pytest.fixture(scope="module")
def tiny44() -> DACDecoder:
    return DACDecoder.from_config("tiny-44khz", seed=0)


@pytest.fixture
def dac_server(thread_server, tiny44):
    return thread_server(tiny44, slots=8, max_tokens=32, max_wait_ms=30, min_fill=0.0)


# -- the seam ---------------------------------------------------------------------------------


def test_every_layout_has_a_decoder_a_cli_choice_and_presets():
    """The seam for DAC: its layouts, one registry entry each; the CLI derives its choices."""
    for name in LAYOUTS:
        assert name in CODECS
        if name.startswith("dac-"):
            cls = decoder_class(name)
            assert cls is DACDecoder
            for preset in (None, "tiny"):
                model = cls.from_config(resolve_preset(name, preset)) if preset else None
                assert model is None or model.config.layout == LAYOUTS[name]
    assert resolve_preset("dac-24khz", None) == "dac-24khz"
    assert resolve_preset("dac-16khz", "tiny") == "tiny-16khz"
    with pytest.raises(ValueError, match="not a dac-44khz model"):
        resolve_preset("dac-44khz", "snac-44khz")
    with pytest.raises(ValueError, match="snac-44khz or dac-44khz"):
        resolve_preset("bicodec", "tiny-44khz")
    assert default_max_frames("dac-44khz") == 2584  # 30 s at 86.1 frames per second


def test_load_decoder_serves_the_dac_codec_asked_for(tmp_path):
    args = _parser().parse_args(["serve", "--codec", "dac-24khz", "--preset", "tiny"])
    decoder = load_decoder(args, announce=False)
    assert isinstance(decoder, DACDecoder) and decoder.config.layout == DAC_24KHZ
    decoder.save_pretrained(tmp_path)
    args = _parser().parse_args(["serve", "--codec", "dac-44khz", "--model-dir", str(tmp_path)])
    wrong = "holds a dac-24khz model, not a dac-44khz one: pass --codec dac-24khz"
    with pytest.raises(ValueError, match=wrong):
        load_decoder(args, announce=False)


def test_a_header_holds_dac_24khzs_32_codebooks(shm_name):
    """The header described 8 levels at most; DAC 24 kHz has 32 codebooks."""
    assert MAX_LEVELS >= 32
    seg = Segment.create(shm_name, n_slots=2, max_tokens=10, codec=DAC_24KHZ)
    try:
        seg.start_serving()
        att = Segment.attach(shm_name)
        try:
            assert att.codec == DAC_24KHZ and att.tokens.shape == (2, 10 * 32)
            assert att.layout.level_offset(31) == 310
        finally:
            att.close()
    finally:
        seg.unlink()
        seg.close()


# -- the client -------------------------------------------------------------------------------


def test_codes_as_one_array_are_checked_without_torch():
    code = ("import sys, numpy as np; from bicodec_shm.codecs import check_request, DAC_44KHZ; "
            "l, _, n = check_request(DAC_44KHZ, np.ones((9, 5), np.int64)); "
            "assert n == 5 and len(l) == 9 and 'torch' not in sys.modules")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)
    rng = np.random.default_rng(0)
    codes = random_codes(rng, 6)
    levels, _, frames = check_request(DAC_44KHZ, codes)
    assert frames == 6 and all(np.array_equal(a, b) for a, b in zip(levels, codes))
    levels, _, _ = check_request(DAC_44KHZ, list(codes))
    assert all(np.array_equal(a, b) for a, b in zip(levels, codes))
    with pytest.raises(ValueError, match=r"takes a \(9, frames\) array.*\(6, 9\) \(transposed\? rows are"):
        check_request(DAC_44KHZ, codes.T)
    with pytest.raises(ValueError, match=r"snac-24khz has levels of different rates \(1:2:4\)"):
        check_request(LAYOUTS["snac-24khz"], codes[:3])


@pytest.mark.parametrize(
    ("codes", "message"),
    [
        (lambda c: c.T, r"this request has 6 code level\(s\) .* serves dac-44khz: dac-44khz: 9 level\(s\)"),
        (lambda c: c[:8], r"this request has 8 code level\(s\)"),
        (lambda c: np.where(np.arange(6) == 4, 1024, c), r"levels\[0\]\[4\] = 1024 is out of range"),
        (lambda c: c[:, :0], "levels\\[0\\] is empty"),
        (lambda c: c.astype(np.float32), "integer dtype"),
        (lambda c: np.zeros((9, 40), np.int64), "more than the 32 a slot holds"),
    ],
)
def test_bad_dac_codes_are_refused_before_anything_is_written(dac_server, codes, message):
    good = random_codes(np.random.default_rng(1), 6)
    with DecoderClient(dac_server.name) as client:
        with pytest.raises(ValueError, match=message):
            client.decode_codes(codes(good))
        assert client.get_stats()["requests"] == 0


def test_a_dac_request_to_a_snac_server_names_both_codecs(thread_server):
    from bicodec_shm.model.snac import SNACDecoder

    server = thread_server(SNACDecoder.from_config("tiny-24khz", seed=0), slots=2, max_tokens=8)
    codes = random_codes(np.random.default_rng(2), 4)
    with DecoderClient(server.name) as client:
        with pytest.raises(ValueError, match=r"9 code level\(s\) without global ids \(the shape of "
                                             r"dac-44khz codes\), but .* serves snac-24khz"):  # fmt: skip
            client.decode_codes(codes)
        with pytest.raises(ValueError, match="these are dac-44khz codes, but .* serves snac-24khz"):
            client.decode_dia(codes_to_dia(codes))


def test_dac_decodes_equal_their_lone_decode_and_dia_tokens_decode_the_same(dac_server, tiny44):
    rng = np.random.default_rng(3)
    codes = random_codes(rng, 7)
    with DecoderClient(dac_server.name) as client:
        assert client.codec == DAC_44KHZ
        audio = client.decode_codes(codes, dtype="float32")
        listed = client.decode_codes(list(codes), dtype="float32")
        dia = client.decode_dia(codes_to_dia(codes), dtype="float32")
        pcm = client.decode_codes(codes)
    want = lone(tiny44, codes)
    assert audio.shape == (7 * 512,)
    np.testing.assert_allclose(audio, want, atol=1e-5, rtol=0)
    assert np.array_equal(listed, audio) and np.array_equal(dia, audio)
    assert pcm.dtype == np.int16 and np.abs(pcm.astype(np.int32) - seed_int16(want)).max() <= 1


@pytest.mark.parametrize("variant", ["44khz", "24khz", "16khz"])
def test_served_dac_answers_have_upstreams_length_and_audio_at_every_rate(thread_server, variant):
    """descript-audio-codec decodes n frames of its 24 and 16 kHz models to 320·n - 8 samples
    (44.1 kHz: 512·n): every served answer, batched with others or alone, has upstream's length
    and audio, and the client knows that length from the server's header."""
    from test_dac_model import upstream_decode, upstream_twin

    model = DACDecoder.from_config(f"tiny-{variant}", seed=0)
    twin = upstream_twin(model)
    server = thread_server(model, slots=8, max_tokens=16, max_wait_ms=50, min_fill=0.0)
    rng = np.random.default_rng(11)
    requests = [random_codes(rng, n, model.config.layout) for n in (9, 1, 5, 16)]

    async def decode_all(client):
        return await asyncio.gather(*(client.decode_codes_async(c, dtype="float32") for c in requests))

    with DecoderClient(server.name) as client:
        assert client.codec == model.config.layout
        answers = asyncio.run(decode_all(client))
        lone16 = client.decode_codes(requests[1])
        lengths = [client.codec.decoded_samples(c.shape[1]) for c in requests]
    for codes, audio, n in zip(requests, answers, lengths, strict=True):
        want = upstream_decode(twin, torch.as_tensor(codes[None], dtype=torch.int64))[0].numpy()
        assert audio.shape == want.shape == (n,)
        np.testing.assert_allclose(audio, want, atol=1e-5, rtol=0)
    assert lone16.shape == (lengths[1],) and lengths[1] == (512 if variant == "44khz" else 320 - 8)


def test_dia_rows_round_trip_and_what_cannot_be_undone_is_refused():
    codes = random_codes(np.random.default_rng(4), 5)
    rows = codes_to_dia(codes)
    assert rows.shape == (5 + 15, 9) and rows[5, 0] == 1024 and rows[0, 8] == 1026
    assert np.array_equal(dia_to_codes(rows), codes)
    # The language model's own last step (book 8's EOS) after Dia's decoded rows changes nothing.
    closing = np.full((1, 9), 1025)
    closing[0, 8] = 1024
    assert np.array_equal(dia_to_codes(np.vstack([rows, closing])), codes)
    assert np.array_equal(dia_to_codes(rows[None]), codes)  # Dia's (1, rows, 9)
    with pytest.raises(ValueError, match="row 0, codebook 0 = 1026 is Dia's BOS .*pass the rows after"):
        dia_to_codes(np.vstack([np.full((1, 9), 1026), rows]))
    with pytest.raises(ValueError, match=r"ends at row 5 .* pass rows 0..19 \(got 19 rows\)"):
        dia_to_codes(rows[:-1])
    with pytest.raises(ValueError, match="transposed"):
        dia_to_codes(rows.T)
    with pytest.raises(ValueError, match="a batch of 2 utterances"):
        dia_to_codes(np.stack([rows, rows]))
    with pytest.raises(ValueError, match="needs at least 16 rows"):
        dia_to_codes(np.zeros((15, 9), np.int64))
    broken = rows.copy()
    broken[12, 3] = 1025
    with pytest.raises(ValueError, match=r"row 12, codebook 3 = 1025 is Dia's PAD .* frame 2's code"):
        dia_to_codes(broken)
    with pytest.raises(ValueError, match="no frames"):
        dia_to_codes(codes_to_dia(codes)[5:])


# -- real processes ---------------------------------------------------------------------------


def serve_to_client_processes(start_server, name, tmp_path, codec, *, preset="tiny", clients=4,
                              requests=6, max_frames=9, threads=1) -> dict:
    """`serve --codec X --preset P` to torch-free client processes (tests/dac_worker.py) of mixed
    lengths, alternately float32 and int16 (dac-44khz: every other request as Dia's tokens);
    checks every row against its lone decode (float32 within 1e-5, int16 within 1 LSB)."""
    start_server("--codec", codec, "--preset", preset, "--threads", str(threads), "--slots", "8",
                 "--max-wait-ms", "20", "--min-fill", "0")  # fmt: skip
    outs = [str(tmp_path / f"c{i}.npz") for i in range(clients)]
    dtypes = ["float32", "int16"] * clients
    dia = ["--dia"] if codec == "dac-44khz" else []
    procs = [subprocess.Popen([sys.executable, DAC_WORKER, name, str(10 + i), str(requests), outs[i],
                               "--dtype", dtypes[i], "--max-frames", str(max_frames), *dia])
             for i in range(clients)]  # fmt: skip
    for p in procs:
        assert p.wait(timeout=240) == 0
    decoder = DACDecoder.from_config(resolve_preset(codec, preset), seed=0)
    worst32 = worst16 = 0.0
    for out, dtype in zip(outs, dtypes):
        data = np.load(out)
        for j in range(requests):
            expected = lone(decoder, data[f"codes_{j}"])
            pcm = data[f"pcm_{j}"]
            assert pcm.dtype == np.dtype(dtype) and pcm.shape == expected.shape
            if dtype == "float32":
                worst32 = max(worst32, float(np.abs(pcm - expected).max()))
            else:
                worst16 = max(worst16, int(np.abs(pcm.astype(np.int32) - seed_int16(expected)).max()))
    assert worst32 <= 1e-5 and worst16 <= 1, (worst32, worst16)
    stats = json.loads(subprocess.run([sys.executable, "-m", "bicodec_shm", "stats", name, "--json"],
                                      capture_output=True, text=True, check=True).stdout)  # fmt: skip
    assert stats["codec"] == codec and stats["requests"] == clients * requests and stats["failed"] == 0
    assert max(int(b) for b in stats["batch_size_histogram"]) > 1, stats["batch_size_histogram"]
    return stats


@pytest.mark.parametrize("codec", ["dac-44khz", "dac-24khz", "dac-16khz"])
def test_four_client_processes_get_their_lone_decodes(start_server, shm_name, tmp_path, codec):
    """4 torch-free client processes through `serve --codec X --preset tiny`."""
    serve_to_client_processes(start_server, shm_name, tmp_path, codec)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_full_size_dac_44khz_batches_mixed_lengths_exactly_through_the_server(start_server, shm_name,
                                                                               tmp_path):  # fmt: skip
    """The full-size dac-44khz architecture (random weights) served to 4 client processes, 2
    requests of 1-4 frames in flight each: mixed lengths batch together, each row its lone decode."""
    serve_to_client_processes(start_server, shm_name, tmp_path, "dac-44khz", preset="dac-44khz",
                              clients=4, requests=2, max_frames=4, threads=2)
