"""SNAC through the shared server: the codec seam, the client's checks, exact mixed-length batches.

Ground truth is ``SNACDecoder.detokenize`` of each request alone, with the request's seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from support import seed_int16

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.codecs import BICODEC, SNAC_24KHZ, SNAC_32KHZ, codes_to_orpheus, orpheus_to_codes
from bicodec_shm.codecs.layout import default_max_frames
from bicodec_shm.model.snac import SNACDecoder
from bicodec_shm.protocol.header import read_header, stats_from_header
from bicodec_shm.protocol.layout import FREE, LAYOUT_VERSION, Layout
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.tools.model_args import resolve_preset

HERE = os.path.dirname(os.path.abspath(__file__))
SNAC_WORKER = os.path.join(HERE, "snac_worker.py")


def lone(decoder, levels, *, seed=0, noise=True) -> np.ndarray:
    """The unpadded decode of one request: (spf·n,) float32."""
    codes = [torch.as_tensor(np.asarray(level, np.int64))[None] for level in levels]
    return decoder.detokenize(codes, noise=noise, noise_seeds=[seed])[0].numpy()


def request(rng, frames, layout=SNAC_24KHZ):
    return [rng.integers(0, v, frames * r) for r, v in zip(layout.level_rates, layout.level_vocab)]


@pytest.fixture(scope="module")
def tiny24():
    return SNACDecoder.from_config("tiny-24khz", seed=0)


@pytest.fixture
def snac_server(thread_server, tiny24):
    return thread_server(tiny24, slots=8, max_tokens=32, max_wait_ms=30, min_fill=0.0)


# -- the seam ---------------------------------------------------------------------------------


def test_the_header_names_the_codec_and_sizes_the_areas_by_its_layout(shm_name):
    assert LAYOUT_VERSION == 13
    seg = Segment.create(shm_name, n_slots=3, max_tokens=10, codec=SNAC_32KHZ)
    try:
        seg.start_serving()
        att = Segment.attach(shm_name)
        try:
            assert att.codec == SNAC_32KHZ
            assert att.tokens.shape == (3, 10 * 15) and att.globals.shape == (3, 0)
            assert att.pcm32.shape[1] * 4 >= 10 * 3072 * 4
            assert [att.layout.level_offset(i) for i in range(4)] == [0, 10, 30, 70]
        finally:
            att.close()
        assert stats_from_header(read_header(shm_name))["codec"] == "snac-32khz"
    finally:
        seg.unlink()
        seg.close()


def test_bicodec_keeps_the_areas_of_layout_version_3():
    """Same offsets as before the seam: one level of 1500 tokens, 32 globals, 320 samples each."""
    lay = Layout(64, 1500)
    assert lay.codec == BICODEC
    assert lay.globals_off - lay.tokens_off == 64 * 1500 * 4
    assert lay.pcm_stride == -(-1500 * 320 * 4 // 4096) * 4096
    assert Layout(64, 1500, replace(BICODEC, level_vocab=(100,))).total_size == lay.total_size


def test_presets_and_default_lengths_per_codec():
    assert resolve_preset("bicodec", None) == "spark-tts-0.5b"
    assert resolve_preset("snac-24khz", None) == "snac-24khz"
    assert resolve_preset("snac-44khz", "tiny") == "tiny-44khz"
    with pytest.raises(ValueError, match="snac-24khz"):
        resolve_preset("bicodec", "tiny-24khz")
    with pytest.raises(ValueError, match="not a snac-32khz model"):
        resolve_preset("snac-32khz", "spark-tts-0.5b")
    assert default_max_frames("bicodec") == 1500 and default_max_frames("snac-24khz") == 352


# -- the client -------------------------------------------------------------------------------


def test_snac_decodes_are_reproducible_and_seeded(snac_server, tiny24):
    rng = np.random.default_rng(1)
    levels = request(rng, 5)
    with DecoderClient(snac_server.name) as client:
        assert client.codec == SNAC_24KHZ
        a = client.decode_codes(levels, dtype="float32")
        b = client.decode_codes(levels, dtype="float32", noise_seed=0)  # the documented default
        c = client.decode_codes(levels, dtype="float32", noise_seed=7)
        quiet = client.decode_codes(levels, dtype="float32", noise=False)
        orpheus = client.decode_orpheus(codes_to_orpheus(levels), dtype="float32", noise_seed=7)
        pcm = client.decode_codes(levels, noise_seed=7)
    assert a.shape == (5 * 2048,) and np.array_equal(a, b)
    np.testing.assert_allclose(a, lone(tiny24, levels), atol=1e-5, rtol=0)
    np.testing.assert_allclose(c, lone(tiny24, levels, seed=7), atol=1e-5, rtol=0)
    assert np.abs(a - c).max() > 1e-4, "another seed must give other noise"
    np.testing.assert_allclose(quiet, lone(tiny24, levels, noise=False), atol=1e-5, rtol=0)
    assert np.array_equal(orpheus, c)
    assert pcm.dtype == np.int16
    assert np.abs(pcm.astype(np.int32) - seed_int16(lone(tiny24, levels, seed=7))).max() <= 1


def test_rows_with_and_without_noise_batch_together_exactly(snac_server, tiny24):
    """One batch of mixed lengths, seeds and noise settings: each row equals its lone decode."""
    import asyncio

    rng = np.random.default_rng(2)
    reqs = [(request(rng, n), seed, n % 2 == 0) for seed, n in enumerate((9, 2, 6, 1, 4, 7))]

    async def run(client):
        return await asyncio.gather(*(client.decode_codes_async(lv, noise_seed=s, noise=on, dtype="float32")
                                      for lv, s, on in reqs))  # fmt: skip

    with DecoderClient(snac_server.name, slots=6) as client:
        outs = asyncio.run(run(client))
    for (levels, seed, on), out in zip(reqs, outs):
        np.testing.assert_allclose(out, lone(tiny24, levels, seed=seed, noise=on), atol=1e-5, rtol=0)
    hist = stats_from_header(snac_server.segment.header)["batch_size_histogram"]
    assert max(hist) > 1, hist


BAD = {
    "wrong number of levels": (lambda c, lv: c.decode_codes(lv[:2]), "3 level"),
    "ratio broken": (lambda c, lv: c.decode_codes([lv[0], lv[1][:-1], lv[2]]), "levels\\[1\\] has 5 codes"),
    "id out of range": (lambda c, lv: c.decode_codes([lv[0], lv[1], np.r_[lv[2][:-1], 4096]]),
                        "levels\\[2\\]\\[11\\] = 4096"),
    "orpheus count": (lambda c, lv: c.decode_orpheus(codes_to_orpheus(lv)[:-1]), "not a multiple of 7"),
    "orpheus offset": (lambda c, lv: c.decode_orpheus(np.roll(codes_to_orpheus(lv), 1)),
                       "token 0 \\(frame 0, position 0"),
    "global ids to snac": (lambda c, lv: c.decode_codes(lv, global_ids=[0] * 32), "takes no global ids"),
    "bicodec request to snac": (lambda c, lv: c.decode([1, 2, 3], [0] * 32), "BiCodec.*serves snac-24khz"),
    "another snac variant": (lambda c, lv: c.decode_codes(lv, codec="snac-32khz"),
                             "snac-32khz.*serves snac-24khz"),
    "bad seed": (lambda c, lv: c.decode_codes(lv, noise_seed=2**63), "noise_seed"),
    "bad start frame": (lambda c, lv: c.decode_codes(lv, start_frame=-1), "start_frame must be an int"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_snac_input_is_refused_before_anything_is_written(snac_server, case):
    call, words = BAD[case]
    levels = request(np.random.default_rng(3), 3)
    seg = snac_server.segment
    with DecoderClient(snac_server.name) as client:
        with pytest.raises(ValueError, match=words):
            call(client, levels)
        assert not client._att.owned, "no slot may be claimed for a refused request"
    assert not seg.tokens.any() and (seg.slots["state"] == FREE).all()
    assert stats_from_header(seg.header)["requests"] == 0


def test_a_snac_request_to_a_bicodec_server_names_both_codecs(thread_server):
    server = thread_server()
    levels = request(np.random.default_rng(4), 2)
    with DecoderClient(server.name) as client:
        with pytest.raises(ValueError, match="snac-24khz codes.*serves bicodec"):
            client.decode_codes(levels)
        with pytest.raises(ValueError, match="Orpheus.*serves bicodec"):
            client.decode_orpheus(codes_to_orpheus(levels))
        assert not client._att.owned
    assert stats_from_header(server.segment.header)["requests"] == 0


def test_orpheus_tokens_round_trip_through_the_client_helper():
    levels = request(np.random.default_rng(5), 4)
    back = orpheus_to_codes(codes_to_orpheus(levels))
    assert all(np.array_equal(a, b) for a, b in zip(levels, back))


# -- real processes ---------------------------------------------------------------------------


def serve_to_client_processes(start_server, name, tmp_path, codec, *, preset="tiny", clients=4,
                              requests=6, max_frames=9, threads=1) -> dict:
    """`serve --codec X --preset P` to torch-free client processes (tests/snac_worker.py) of mixed
    lengths, seeds and noise settings, alternately float32 and int16; checks every row against
    its lone decode (float32 within 1e-5, int16 within 1 LSB) and returns the server's stats."""
    start_server("--codec", codec, "--preset", preset, "--threads", str(threads), "--slots", "8",
                 "--max-wait-ms", "20", "--min-fill", "0", "--metrics-port", "0")  # fmt: skip
    outs = [str(tmp_path / f"c{i}.npz") for i in range(clients)]
    dtypes = ["float32", "int16"] * clients
    procs = [subprocess.Popen([sys.executable, SNAC_WORKER, name, str(10 + i), str(requests), outs[i],
                               "--dtype", dtypes[i], "--max-frames", str(max_frames)])
             for i in range(clients)]  # fmt: skip
    for p in procs:
        assert p.wait(timeout=240) == 0
    decoder = SNACDecoder.from_config(resolve_preset(codec, preset), seed=0)
    worst32 = worst16 = 0.0
    for out, dtype in zip(outs, dtypes):
        data = np.load(out)
        for j in range(requests):
            levels = [data[f"lvl_{j}_{i}"] for i in range(decoder.config.n_levels)]
            expected = lone(decoder, levels, seed=int(data[f"seed_{j}"]), noise=j % 3 != 2)
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


@pytest.mark.parametrize("codec", ["snac-24khz", "snac-32khz", "snac-44khz"])
def test_four_client_processes_get_their_lone_decodes(start_server, shm_name, tmp_path, codec):
    """4 torch-free client processes through `serve --codec X --preset tiny`."""
    serve_to_client_processes(start_server, shm_name, tmp_path, codec)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_full_size_snac_24khz_batches_mixed_lengths_exactly_through_the_server(start_server, shm_name,
                                                                                tmp_path):  # fmt: skip
    """The full-size snac-24khz architecture (random weights) served to 2 client processes, 3
    requests of 1-6 frames in flight each: mixed lengths batch together, each row its lone decode."""
    serve_to_client_processes(start_server, shm_name, tmp_path, "snac-24khz", preset="snac-24khz",
                              clients=2, requests=3, max_frames=6, threads=2)


def test_the_prometheus_server_info_names_the_codec():
    from bicodec_shm.protocol.header import write_codec
    from bicodec_shm.protocol.layout import HEADER_DT
    from bicodec_shm.server.metrics import metric_families

    header = np.zeros((), HEADER_DT)
    write_codec(header, SNAC_24KHZ)
    state, handles = np.zeros(2, np.uint32), np.zeros(2, np.uint64)
    families = {f.name: f for f in metric_families(header, state, handles, name="x", version="v")}
    assert families["bicodec_shm_server"].samples[0].labels["codec"] == "snac-24khz"


# -- one validation per request -----------------------------------------------------------------


def _count_validations(monkeypatch) -> dict[str, int]:
    """Wrap the client's two validators, where the handle and its requests call them, so that
    each call is counted."""
    import bicodec_shm.client.decoder_client as dc
    import bicodec_shm.client.requests as rq

    calls = {"as_token_array": 0, "check_request": 0}
    for module in (dc, rq):
        for fn in calls:
            real = getattr(module, fn, None)
            if real is None:
                continue

            def counted(*args, _real=real, _fn=fn, **kwargs):
                calls[_fn] += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, fn, counted)
    return calls


def test_a_bicodec_request_is_validated_once_per_array_however_many_calls(
        thread_server, shm_name, monkeypatch):
    thread_server(slots=4, max_tokens=64)
    rng = np.random.default_rng(3)
    with DecoderClient(shm_name, slots=1, timeout=30) as client:
        client.decode(rng.integers(0, 8192, 10), rng.integers(0, 4096, 32))  # attach first
        calls = _count_validations(monkeypatch)
        for _ in range(3):
            client.decode(rng.integers(0, 8192, 10), rng.integers(0, 4096, 32))
    # Semantic and global ids, once each per request: the attachment's check costs a comparison.
    assert calls == {"as_token_array": 6, "check_request": 0}


def test_a_code_request_is_validated_once_however_many_calls(snac_server, shm_name, monkeypatch):
    rng = np.random.default_rng(4)
    with DecoderClient(shm_name, slots=1, timeout=30) as client:
        client.decode_codes(request(rng, 4))
        calls = _count_validations(monkeypatch)
        for _ in range(3):
            client.decode_codes(request(rng, 4))
    assert calls == {"as_token_array": 0, "check_request": 3}
