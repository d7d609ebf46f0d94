"""The encode direction: audio in, codes back, through the same slots, identities, deadlines,
restarts and clean-up as a decode.

Real server and client processes and real shared memory where the test is about the protocol;
each result is compared with ``BiCodecEncoder.tokenize`` of the same clip alone, on the tiny
random weights every test server builds (``serve --encode --preset tiny --seed 0``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import ROOT, serve_command, wait_until_serving
from support import (
    TESTS,
    assert_lone_encode,
    assert_lone_int16,
    encode_clip,
    join_within,
    plant_ready,
    reap,
    reference_encoder,
    seeded_request,
    wait_for,
)

from bicodec_shm import EncodedAudio, NoEncoderError
from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import DecodeError
from bicodec_shm.protocol.header import read_header, stats_from_header
from bicodec_shm.protocol.layout import FLAG_ENCODE, HOP, Status
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.protocol.slot_io import check_headers, gather
from bicodec_shm.tools.stats_cmd import stats_rows

ENCODE_WORKER = os.path.join(TESTS, "encode_worker.py")
MIN_SAMPLES = 400  # the tiny wav2vec2's (xlsr-53's strides)


class GatedEncoder:
    """The reference encoder, but every batch waits for ``gate`` and its row counts are
    recorded; a clip of ``poison`` samples makes its batch raise (a failing model)."""

    def __init__(self, poison: int | None = None) -> None:
        self.model = reference_encoder()
        self.config, self.features = self.model.config, self.model.features
        self.gate = threading.Event()
        self.rows: list[int] = []
        self.poison = poison

    def tokenize(self, wavs, lengths):
        self.gate.wait(60)
        self.rows.append(int(wavs.shape[0]))
        if self.poison is not None and int(self.poison) in lengths.tolist():
            raise RuntimeError("the encoder failed on this clip")
        return self.model.tokenize(wavs, lengths)


def _in_flight(server, n: int) -> None:
    seg = server.segment
    wait_for(lambda: int(((seg.slots["state"] == 2) | (seg.slots["state"] == 3)).sum()) >= n,
             what=f"{n} requests submitted")  # fmt: skip


# -- through one server, in threads and processes ----------------------------------------------


def test_client_processes_encode_and_decode_at_once_each_getting_its_lone_result(thread_server, shm_name,
                                                                                 tmp_path):  # fmt: skip
    """Two client processes, each with three encodes and a decode in flight at once: every
    clip gets exactly its lone encode's ids, every decode its lone audio."""
    thread_server(encoder=reference_encoder(), max_tokens=100, min_fill=0.0, batching="static")
    outs = [str(tmp_path / f"w{k}.npz") for k in range(2)]
    procs = [subprocess.Popen([sys.executable, ENCODE_WORKER, shm_name, str(10 + k), "3", outs[k]],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])})
             for k in range(2)]  # fmt: skip
    for proc in procs:
        assert proc.wait(120) == 0
    for k, out in enumerate(outs):
        with np.load(out) as got:
            assert_lone_int16(got["pcm"], *seeded_request(10 + k, 30))
            for i in range(3):
                assert_lone_encode((got[f"sem_{i}"], got[f"glb_{i}"]), encode_clip(10 + k, i))


def test_encode_rows_batch_together_apart_from_decodes_and_each_equals_its_lone_encode(thread_server,
                                                                                       shm_name):  # fmt: skip
    """Encodes of different lengths (int16, float64, float32) queued behind a running batch form
    one padded batch of encode rows only; each row's ids are its lone encode's."""
    encoder = GatedEncoder()
    server = thread_server(encoder=encoder, max_tokens=100, min_fill=0.0, batching="static")
    stats = stats_from_header(server.segment.header)  # `bicodec-shm stats` says it encodes
    assert stats["encode_min_samples"] == server.segment.layout.encode_min_samples > 0
    assert dict(stats_rows(stats))["encodes"].startswith("yes (audio of")
    clips = [encode_clip(3, i) for i in range(4)]
    clips[1] = (clips[1] * 32767).astype(np.int16)
    clips[2] = clips[2].astype(np.float64)
    results: dict = {}
    sem, glb = seeded_request(3, 20)
    with DecoderClient(shm_name, slots=8, timeout=60) as client:

        async def main():
            calls = [client.encode_async(c) for c in clips] + [client.decode_async(sem, glb)]
            return await asyncio.gather(*calls)

        runner = threading.Thread(target=lambda: results.update(out=asyncio.run(main())))
        runner.start()
        _in_flight(server, 5)  # the first encode (or all four) holds the gate
        encoder.gate.set()
        join_within([runner], within=60)
    *encoded, pcm = results["out"]
    assert_lone_int16(pcm, sem, glb)
    as_float = [c.astype(np.float32) / 32768 if c.dtype == np.int16 else c.astype(np.float32) for c in clips]
    for result, clip in zip(encoded, as_float):
        assert isinstance(result, EncodedAudio) and result.global_ids.shape == (32,)
        assert result.semantic_ids.dtype == np.int32 and len(result.codes) == 1
        assert_lone_encode(result, clip)
    # Batched, never with the decode: the batch held at the gate (one encode or more, as many as
    # were ready when it was planned) and one batch of the rest.
    assert sum(encoder.rows) == 4 and len(encoder.rows) <= 2, encoder.rows


def test_a_failing_encode_fails_alone_and_its_batchmates_get_their_ids(thread_server, shm_name):
    """The model raises on one clip of a batch: the server splits and retries; that request gets
    a DecodeError naming the failure, the others their ids."""
    clips = [encode_clip(4, i) for i in range(3)]
    encoder = GatedEncoder(poison=len(clips[1]))
    server = thread_server(encoder=encoder, max_tokens=100, min_fill=0.0, batching="static")
    with DecoderClient(shm_name, slots=4, timeout=60) as client:

        async def main():
            return await asyncio.gather(*(client.encode_async(c) for c in clips), return_exceptions=True)

        results: dict = {}
        runner = threading.Thread(target=lambda: results.update(out=asyncio.run(main())))
        runner.start()
        _in_flight(server, 3)
        encoder.gate.set()
        join_within([runner], within=60)
        got = results["out"]
        assert isinstance(got[1], DecodeError) and "the encoder failed on this clip" in str(got[1])
        for i in (0, 2):
            assert_lone_encode(got[i], clips[i])
        assert_lone_encode(client.encode(clips[1][:8000]), clips[1][:8000])  # the server is fine


def test_bad_audio_is_a_value_error_naming_it_and_harms_no_other_request(thread_server, shm_name):
    thread_server(encoder=reference_encoder(), max_tokens=50)  # a slot holds 50 x 320 samples
    good = encode_clip(5, 0)[:12000]
    bad = {
        "empty": np.zeros(0, np.float32),
        "not finite": np.array([0.1, np.nan, 0.2] * 200, np.float32),
        "not finite (inf)": np.array([0.1, 0.0, np.inf] * 200, np.float64),
        "1-D": np.zeros((2, 800), np.float32),
        "dtype int32": np.zeros(800, np.int32),
        "too short": np.zeros(MIN_SAMPLES - 1, np.float32),
        "longer than a slot": np.zeros(50 * HOP + 1, np.float32),
        "audio must be": "not audio",
    }
    with DecoderClient(shm_name, timeout=30) as client:
        for what, audio in bad.items():
            with pytest.raises(ValueError, match=what.split(" (")[0]):
                client.encode(audio)
        with pytest.raises(ValueError, match="sample_rate=0 Hz is not a sample rate"):
            client.encode(good, sample_rate=0)
        assert_lone_encode(client.encode(good, sample_rate=16000), good)
        assert_lone_encode(client.encode(np.zeros(50 * HOP, np.float32)), np.zeros(50 * HOP, np.float32))


def test_a_hostile_encode_request_fails_alone_in_the_server(shm_name):
    """What the client would refuse, written straight into the slots: audio that is not finite,
    and a length that does not match its frames, each fail with BAD_AUDIO; their batchmate is
    gathered. A server without an encoder answers NO_ENCODER."""
    seg = Segment.create(shm_name, n_slots=4, max_tokens=10, encode_min_samples=MIN_SAMPLES)
    try:
        seg.start_serving()
        for slot, n in enumerate((1000, 1000, 1000)):
            seg.pcm32[slot, :n] = 0.1
            plant_ready(seg, slot, n_tokens=-(-n // HOP), audio_samples=n, flags=FLAG_ENCODE, dtype=1)
        seg.pcm32[1, 500] = np.nan
        seg.slots["n_tokens"][2] = 9  # 1000 samples span 4 frames
        seen = np.full(3, time.monotonic_ns(), np.int64)
        req, failures = check_headers(seg, np.arange(3), seen, n_bells=4)
        assert [(s, st) for s, st, _ in failures] == [(2, Status.BAD_AUDIO)]
        batch, failures = gather(seg, req)
        assert [(s, st) for s, st, _ in failures] == [(1, Status.BAD_AUDIO)]
        assert "not finite" in failures[0][2]
        assert batch.slots.tolist() == [0] and batch.audio.shape == (1, 1000)
    finally:
        seg.unlink()
        seg.close()
    plain = Segment.create(shm_name, n_slots=2, max_tokens=10)
    try:
        plant_ready(plain, 0, n_tokens=4, audio_samples=1000, flags=FLAG_ENCODE, dtype=1)
        _, failures = check_headers(plain, np.arange(1), np.zeros(1, np.int64), n_bells=2)
        assert failures[0][1] == Status.NO_ENCODER and "--encode" in failures[0][2]
    finally:
        plain.unlink()
        plain.close()


# -- servers started with and without --encode, killed and replaced -----------------------------


def _serve_reporting_imports(name: str, *extra: str) -> subprocess.Popen:
    """``serve`` in a process that prints, as it exits, which encoder modules it imported."""
    report = ("import atexit, sys; atexit.register(lambda: print('IMPORTED', sorted(m for m in sys.modules "
              "if m.split('.')[0] == 'transformers' or m.endswith('bicodec.tokenizer')), flush=True)); "
              "from bicodec_shm.tools.cli import main; sys.exit(main(sys.argv[1:]))")  # fmt: skip
    command = serve_command(name, *extra)
    return subprocess.Popen([sys.executable, "-c", report, *command[3:]], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip


def test_a_server_without_encode_loads_no_encoder_and_refuses_encodes_naming_it(shm_name):
    proc = _serve_reporting_imports(shm_name)
    try:
        wait_until_serving(shm_name, proc=proc)
        assert int(read_header(shm_name)["encodes"]) == 0
        stats = stats_from_header(read_header(shm_name))
        assert stats["encode_min_samples"] == 0
        assert ("encodes", "no (started without --encode)") in stats_rows(stats)
        sem, glb = seeded_request(6, 20)
        with DecoderClient(shm_name, timeout=30) as client:
            with pytest.raises(NoEncoderError, match="--encode"):
                client.encode(encode_clip(6, 0))
            with pytest.raises(NoEncoderError, match="--encode"):
                asyncio.run(client.encode_async(encode_clip(6, 0)))
            assert_lone_int16(client.decode(sem, glb), sem, glb)  # decodes as ever
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "IMPORTED []" in out, out


def test_encodes_waiting_on_a_killed_server_get_their_ids_from_its_replacement(start_server, shm_name):
    """SIGKILL with encodes in its slot and waiting for one (sync and asyncio): a new server under
    the same name (started with --encode) answers each with its own clip's ids."""
    server = start_server("--encode", "--max-tokens", "100")
    clips = [encode_clip(7, i) for i in range(4)]
    outcomes: dict = {}
    with DecoderClient(shm_name, slots=1, timeout=60) as client:
        assert int(read_header(shm_name)["encodes"]) == 1
        assert_lone_encode(client.encode(clips[0]), clips[0])
        os.kill(server.pid, signal.SIGSTOP)  # hung: requests pile up in and behind its slot

        def sync(i):
            outcomes[i] = client.encode(clips[i])

        async def two_async():
            return await asyncio.gather(*(client.encode_async(c) for c in clips[2:]))

        def run_async():
            outcomes.update(zip((2, 3), asyncio.run(two_async())))

        threads = [threading.Thread(target=sync, args=(1,)), threading.Thread(target=run_async)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        server.kill()
        reap(server)
        start_server("--encode", "--max-tokens", "100")
        join_within(threads, within=90)
    for i in (1, 2, 3):
        assert_lone_encode(outcomes[i], clips[i])
