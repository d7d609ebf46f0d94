"""examples/http_tts: the decoder server and ``uvicorn --workers 4`` as real processes, loaded with
httpx; plus the app's error mapping in-process (httpx's ASGI transport, a thread server).

Ground truth for every WAV is the lone unpadded decode (support.single_decode), within 1 LSB.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import ROOT
from support import TESTS, bound_socket, seed_int16, single_decode

for _module in ("starlette", "uvicorn", "httpx"):
    pytest.importorskip(_module, reason='the HTTP example needs its extra: pip install -e ".[examples]"')

import httpx  # noqa: E402
import psutil  # noqa: E402

from bicodec_shm.client.decoder_client import DecoderClient  # noqa: E402
from bicodec_shm.deploy import processes  # noqa: E402
from bicodec_shm.protocol.header import read_header, stats_from_header  # noqa: E402
from bicodec_shm.protocol.names import leftover_objects  # noqa: E402

if ROOT not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the root on the path
    sys.path.insert(0, ROOT)
from examples.http_tts import load  # noqa: E402
from examples.http_tts.app import ConfigError, Settings, create_app  # noqa: E402

STARTED = "Application startup complete."


def _assert_matches_lone_decode(pcm: np.ndarray, semantic, global_ids) -> None:
    expected = seed_int16(single_decode(np.asarray(semantic), np.asarray(global_ids)))
    assert pcm.shape == expected.shape
    assert np.abs(pcm.astype(np.int32) - expected).max() <= 1


class Uvicorn:
    """``uvicorn examples.http_tts.app:app --workers N`` in front of the decoder ``name``."""

    def __init__(self, name: str, workers: int, log_path: str, *, timeout: float = 120.0) -> None:
        self.workers, self.log_path = workers, log_path
        env = dict(os.environ, BICODEC_SHM_NAME=name, BICODEC_SHM_TIMEOUT=str(timeout))
        # uvicorn serves on a socket we bound: the port is its own from the start (`--fd`).
        with bound_socket() as sock, open(log_path, "w") as log_file:
            self.port = sock.getsockname()[1]
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "examples.http_tts.app:app", "--workers", str(workers),
                 "--fd", str(sock.fileno()), "--no-access-log"],
                cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, pass_fds=(sock.fileno(),),
            )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_started(self, timeout: float = 90.0) -> None:
        """Until every worker has run its start-up (and so attached its client)."""
        deadline = time.monotonic() + timeout
        while self.log().count(STARTED) < self.workers:
            assert self.proc.poll() is None, f"uvicorn exited ({self.proc.returncode}):\n{self.log()}"
            assert time.monotonic() < deadline, f"uvicorn did not start in {timeout} s:\n{self.log()}"
            time.sleep(0.1)

    def worker_pids(self) -> set[int]:
        """The live worker processes (multiprocessing's resource tracker is a child too)."""
        children = psutil.Process(self.proc.pid).children()
        return {p.pid for p in children if p.is_running() and "spawn_main" in " ".join(p.cmdline())}

    def stop(self) -> int:
        """SIGTERM: each worker runs its shutdown (closing its client), then the parent exits.

        Returns 0 for a clean stop: every worker logged the end of its shutdown. (A lone
        uvicorn process re-raises the SIGTERM it handled, so its exit status is -15.)"""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                for child in psutil.Process(self.proc.pid).children():
                    child.kill()
                self.proc.kill()
                self.proc.wait()
        clean = self.proc.returncode in (0, -signal.SIGTERM)
        return 0 if clean and self.log().count("Application shutdown complete.") == self.workers else 1


@pytest.fixture
def start_uvicorn(shm_name: str, tmp_path) -> Iterator[Callable[..., Uvicorn]]:
    started: list[Uvicorn] = []

    def start(workers: int = 4, timeout: float = 120.0) -> Uvicorn:
        service = Uvicorn(shm_name, workers, str(tmp_path / f"uvicorn{len(started)}.log"), timeout=timeout)
        started.append(service)
        service.wait_started()
        return service

    yield start
    for service in started:
        service.stop()


def test_64_concurrent_requests_through_4_workers_then_decoder_down_and_back(
    start_server, start_uvicorn, shm_name
):
    decoder = start_server()
    service = start_uvicorn(workers=4)
    workers = service.worker_pids()
    assert len(workers) == 4

    cases = load.make_cases(64, seed=0)
    assert {c.kind for c in cases} == {"decode", "stream", "bad"}
    results = asyncio.run(load.run_load(service.url, cases, concurrency=64))
    summary = load.summarize(results)
    print(f"\nhttp_tts load test, 4 uvicorn workers, tiny decoder:\n{load.format_summary(summary)}")
    problems = [f"{r.case.kind} {r.case.path}: {r.problems}" for r in results if r.problems]
    assert problems == [], "\n".join(problems) + "\n" + service.log()
    for r in results:
        if r.case.status == 200:
            _assert_matches_lone_decode(load.read_wav(r.body), r.case.semantic, r.case.global_ids)
        else:
            assert r.status == 422 and r.case.error in json.loads(r.body)["error"]
    assert summary["requests"] == 64 and summary["failures"] == 0

    # The decoder stops: a new request gets a 503 at once, no worker dies.
    processes.stop_server(decoder, timeout=20)
    assert decoder.returncode == 0
    sem, glb = list(range(100, 160)), list(range(32))
    with httpx.Client(base_url=service.url, timeout=60) as client:
        for path in ("/v1/decode", "/v1/decode/stream"):
            r = client.post(path, json={"semantic_ids": sem, "global_ids": glb})
            assert r.status_code == 503, r.text
            assert shm_name in r.json()["error"] and r.headers["retry-after"] == "1"
        assert client.get("/healthz").status_code == 503
        assert service.worker_pids() == workers  # the same 4 processes, none restarted

        # A new decoder under the same name: the workers' clients re-attach by themselves.
        second = start_server()
        assert client.get("/healthz").json()["serving"] is True
        for _ in range(8):  # reaches several workers, each with a client attached to the old one
            r = client.post("/v1/decode", json={"semantic_ids": sem, "global_ids": glb})
            assert r.status_code == 200, r.text
            _assert_matches_lone_decode(load.read_wav(r.content), sem, glb)
    assert service.worker_pids() == workers

    assert service.stop() == 0, service.log()
    assert "Traceback" not in service.log()
    processes.stop_server(second, timeout=20)
    assert second.returncode == 0
    assert leftover_objects(shm_name) == []


# -- a stream's first audio leaves before the rest is decoded ------------------------------------


class GatedDecoder:
    """The tiny model; every decode after the first waits until the file ``gate`` exists."""

    def __init__(self, gate: str) -> None:
        from bicodec_shm.model import BiCodecDecoder

        self.model = BiCodecDecoder.from_config("tiny", seed=0)
        self.device, self.config, self.gate, self.calls = self.model.device, self.model.config, gate, 0

    def detokenize(self, *args):
        self.calls += 1
        deadline = time.monotonic() + 120  # never hang a test run on a gate nobody opens
        while self.calls > 1 and not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.model.detokenize(*args)


def serve_gated(name: str, gate: str) -> None:
    """Entry point of the gated server process."""
    import torch

    from bicodec_shm.server.server import DecoderServer

    torch.set_num_threads(1)
    DecoderServer(GatedDecoder(gate), name).serve_forever()


@pytest.fixture
def gated_server(shm_name, tmp_path) -> Iterator[tuple[subprocess.Popen, object]]:
    """A tiny-model server process that decodes one batch, then waits for the file ``gate``."""
    gate = tmp_path / "gate"
    code = (f"import sys; sys.path.insert(0, {TESTS!r}); import test_http_example as t; "
            "t.serve_gated(*sys.argv[1:])")  # fmt: skip
    server = subprocess.Popen([sys.executable, "-c", code, shm_name, str(gate)], cwd=ROOT)
    try:
        processes.wait_until_serving(shm_name, server, timeout=60)
        yield server, gate
    finally:
        gate.touch()
        processes.stop_server(server, timeout=20)


def _first_audio(response: httpx.Response) -> tuple[bytes, Iterator[bytes]]:
    """Read a streamed response until its first PCM bytes; -> (bytes so far, the rest)."""
    chunks = response.iter_raw()
    received = b""
    while len(received) <= load.HEADER_BYTES:
        received += next(chunks)
    return received, chunks


# 400 tokens with the "exact" preset: 50-token regions, 67 tokens of context on each side, so 7
# windows; a decode's first audio is the first region, 50 tokens.
STREAM_TOKENS, STREAM_WINDOWS, FIRST_REGION_BYTES = 400, 7, 2 * 320 * 50


def _stream_request() -> dict:
    rng = np.random.default_rng(5)
    sem, glb = rng.integers(0, 8192, STREAM_TOKENS).tolist(), rng.integers(0, 4096, 32).tolist()
    return {"semantic_ids": sem, "global_ids": glb, "preset": "exact"}


def test_stream_sends_the_first_audio_before_the_rest_is_decoded(shm_name, gated_server, start_uvicorn):
    server, gate = gated_server
    service = start_uvicorn(workers=1)
    body = _stream_request()
    with httpx.Client(base_url=service.url, timeout=120) as client:
        with client.stream("POST", "/v1/decode/stream", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
            received, rest = _first_audio(r)
            # Audio is here, and the decoder has answered exactly one window: the gate holds the
            # second, so the rest of the utterance cannot have been decoded yet.
            assert stats_from_header(read_header(shm_name))["requests"] == 1
            assert load.HEADER_BYTES < len(received) <= load.HEADER_BYTES + FIRST_REGION_BYTES
            gate.touch()
            audio = load.read_wav(b"".join([received, *rest]))
    _assert_matches_lone_decode(audio, body["semantic_ids"], body["global_ids"])
    assert stats_from_header(read_header(shm_name))["requests"] == STREAM_WINDOWS
    processes.stop_server(server, timeout=20)
    assert server.returncode == 0
    assert service.stop() == 0
    assert leftover_objects(shm_name) == []


def test_a_stream_whose_decoder_dies_is_cut_off_not_ended(gated_server, start_uvicorn):
    """A truncated stream must not look like a complete (shorter) WAV: no final chunk."""
    server, _ = gated_server
    service = start_uvicorn(workers=1, timeout=3)  # how long a window waits for a new decoder
    workers = service.worker_pids()
    with httpx.Client(base_url=service.url, timeout=120) as client:
        with client.stream("POST", "/v1/decode/stream", json=_stream_request()) as r:
            received, rest = _first_audio(r)
            server.kill()  # mid-utterance: the second window is inside the decoder
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                received += b"".join(rest)
        assert len(received) <= load.HEADER_BYTES + FIRST_REGION_BYTES
        assert client.get("/healthz").status_code == 503
    assert service.worker_pids() == workers
    assert "stream cut off after 16000 samples" in service.log()


# -- error mapping, in-process ------------------------------------------------------------------


class SlowDecoder:
    """The tiny model, ``delay`` seconds a batch: makes a short client timeout expire."""

    def __init__(self, delay: float) -> None:
        from support import reference_model

        self.model, self.delay = reference_model(), delay
        self.device, self.config = self.model.device, self.model.config

    def detokenize(self, *args):
        time.sleep(self.delay)
        return self.model.detokenize(*args)


async def _call(app, *requests: tuple[str, str, dict | bytes | None]) -> list[httpx.Response]:
    """Run ``app``'s lifespan around the requests (httpx's ASGI transport does not)."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            out = []
            for method, path, body in requests:
                kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
                out.append(await client.request(method, path, **kwargs))
            return out


def test_no_decoder_at_start_then_503_until_one_serves(shm_name, thread_server):
    app = create_app(Settings(name=shm_name, timeout=30))
    ok = {"semantic_ids": [1, 2, 3], "global_ids": list(range(32))}
    (r,) = asyncio.run(_call(app, ("POST", "/v1/decode", ok)))
    assert r.status_code == 503 and "no decoder server is serving" in r.json()["error"]

    thread_server()
    r, health = asyncio.run(_call(app, ("POST", "/v1/decode", ok), ("GET", "/healthz", None)))
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    _assert_matches_lone_decode(load.read_wav(r.content), ok["semantic_ids"], ok["global_ids"])
    assert health.json() == {"decoder": shm_name, "serving": True, "worker_pid": os.getpid()}


def test_timeout_is_504_and_a_huge_body_413(shm_name, thread_server):
    thread_server(SlowDecoder(1.0))
    app = create_app(Settings(name=shm_name, timeout=0.2))
    ok = {"semantic_ids": [1, 2, 3], "global_ids": list(range(32))}
    slow, huge, bad_preset = asyncio.run(_call(
        app,
        ("POST", "/v1/decode", ok),
        ("POST", "/v1/decode", b"[" + b"1," * (1 << 20) + b"1]"),
        ("POST", "/v1/decode/stream", {**ok, "preset": ["exact"]}),
    ))  # fmt: skip
    assert slow.status_code == 504 and "within the timeout" in slow.json()["error"]
    assert huge.status_code == 413 and "at most" in huge.json()["error"]
    assert bad_preset.status_code == 422 and "preset must be a string" in bad_preset.json()["error"]


def test_no_free_slot_at_the_decoder_until_the_deadline_is_504_naming_slots(shm_name, thread_server):
    thread_server(SlowDecoder(2.0), slots=1)
    ok = {"semantic_ids": [1, 2, 3], "global_ids": list(range(32))}
    with DecoderClient(shm_name) as other:  # another process's worker holds the only slot
        busy = threading.Thread(target=other.decode, args=(ok["semantic_ids"], ok["global_ids"]))
        busy.start()
        time.sleep(0.3)
        (r,) = asyncio.run(_call(create_app(Settings(name=shm_name, timeout=0.5)),
                                 ("POST", "/v1/decode", ok)))  # fmt: skip
        busy.join()
    assert r.status_code == 504 and "--slots" in r.json()["error"]


def test_a_bad_decoder_name_stops_the_worker_at_start():
    with pytest.raises(ValueError, match="name"):
        create_app(Settings(name="no/slashes"))


@pytest.mark.parametrize("variable, value, words", [
    ("BICODEC_SHM_NAME", "a/b", "invalid segment name 'a/b'"),
    ("BICODEC_SHM_TIMEOUT", "0", "must be > 0"),
    ("BICODEC_SHM_TIMEOUT", "soon", "not a float"),
    ("BICODEC_SHM_CLIENT_SLOTS", "2.5", "not an int"),
])  # fmt: skip
def test_every_setting_is_checked_when_the_app_is_made(monkeypatch, variable, value, words):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=f"^{variable}='{re.escape(value)}': .*{words}"):
        create_app()


def test_a_bad_setting_stops_uvicorns_master_once_with_one_line():
    """Not a crash loop of tracebacks: each worker exits with uvicorn's STARTUP_FAILURE, the
    first of them says why in one line, and the master stops."""
    variable, value, words = "BICODEC_SHM_NAME", "bad name!", "invalid segment name 'bad name!'"
    env = dict(os.environ, **{variable: value})
    started = time.monotonic()
    with bound_socket() as sock:
        done = subprocess.run(
            [sys.executable, "-m", "uvicorn", "examples.http_tts.app:app", "--workers", "2",
             "--fd", str(sock.fileno())],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, pass_fds=(sock.fileno(),),
        )  # fmt: skip
    log = done.stdout + done.stderr
    errors = [line for line in log.splitlines() if "bad setting" in line]
    assert errors == [errors[0]] and f"{variable}={value!r}" in errors[0] and words in errors[0], log
    assert "Traceback" not in log and "died" not in log, log
    assert time.monotonic() - started < 30


# Another user (uid 1000: the unprivileged_python fixture) takes the claim's abstract
# socket name first: any user may bind any abstract name. It listens, as a worker's claim does.
_SQUAT_CLAIM = """
import socket, sys
claim = socket.socket(socket.AF_UNIX)
claim.bind(f"\\0bicodec-shm-http-bad-setting-{sys.argv[1]}")
claim.listen()
print("bound", flush=True)
sys.stdin.read()
"""


def test_another_user_holding_the_claim_name_does_not_silence_the_bad_setting_line(unprivileged_python):
    other = unprivileged_python
    squatter = subprocess.Popen(other.argv("-c", _SQUAT_CLAIM, str(os.getpid())), env=other.env,
                                cwd=other.home, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline() == "bound\n"
        # A worker as uvicorn starts it, a child of this process: it claims "...-{our pid}".
        worker = subprocess.run([sys.executable, "-c", "import examples.http_tts.app"], cwd=ROOT,
                                env=dict(os.environ, BICODEC_SHM_NAME="bad name!"), capture_output=True,
                                text=True, timeout=60)  # fmt: skip
    finally:
        squatter.stdin.close()
        squatter.wait(timeout=30)
        squatter.stdout.close()
    errors = [line for line in worker.stderr.splitlines() if "bad setting" in line]
    assert worker.returncode == 3 and len(errors) == 1, worker.stderr
    assert "invalid segment name 'bad name!'" in errors[0] and "Traceback" not in worker.stderr


def test_the_stream_length_error_names_the_apps_limit_not_the_servers(shm_name):
    too_long = {"semantic_ids": [1] * 30_001, "global_ids": list(range(32))}
    (r,) = asyncio.run(_call(create_app(Settings(name=shm_name)), ("POST", "/v1/decode/stream", too_long)))
    error = r.json()["error"]
    assert r.status_code == 422 and "30001 ids, more than the 30000" in error
    assert "MAX_STREAM_TOKENS" in error and "server's --max-tokens" not in error


def test_a_decode_body_longer_than_the_decoders_max_tokens_is_one_whole_decode(shm_name, thread_server):
    """/v1/decode of more ids than a slot holds (here 700 against --max-tokens 200; 2,000 against
    the default 1,500 alike) is decoded in windows as the stream route does, not refused with
    "split the request": the WAV is the lone decode of all of it, within 1 LSB."""
    thread_server(slots=8, max_tokens=200, max_wait_ms=5, min_fill=0.0)
    rng = np.random.default_rng(5)
    body = {"semantic_ids": rng.integers(0, 8192, 700).tolist(),
            "global_ids": rng.integers(0, 4096, 32).tolist()}
    short = {"semantic_ids": body["semantic_ids"][:150], "global_ids": body["global_ids"]}
    app = create_app(Settings(name=shm_name, timeout=120))
    long_r, short_r = asyncio.run(_call(app, ("POST", "/v1/decode", body), ("POST", "/v1/decode", short)))
    assert long_r.status_code == 200, long_r.text
    for r, sent in ((long_r, body), (short_r, short)):
        _assert_matches_lone_decode(load.read_wav(r.content), sent["semantic_ids"], sent["global_ids"])
