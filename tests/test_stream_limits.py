"""A DecodeStream's windows fit the server it is attached to: planned from that server's
``--max-tokens``, and planned again when a restart brings another limit, larger or smaller, with
no audio lost. Real in-process servers on real shared memory; a stand-in decoder where only the
bookkeeping is under test.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from support import reference_model, single_decode

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.client.streaming import HOP, PRESETS, DecodeStream, StreamSettings
from bicodec_shm.server.server import DecoderServer

EXACT_TOL = 1e-5  # the exact preset against the lone decode (tests/test_streaming.py)


def _serve(name: str, max_tokens: int) -> tuple[DecoderServer, threading.Thread]:
    server = DecoderServer(reference_model(), name, slots=4, max_tokens=max_tokens, max_wait_ms=5)
    return server, server.start_thread()


def _stop(running: tuple[DecoderServer, threading.Thread]) -> None:
    server, thread = running
    server.stop()
    thread.join(30)
    assert not thread.is_alive()


def _request(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 8192, n), rng.integers(0, 4096, 32)


class RestartOnLimitRead:
    """A client whose server is replaced right after the stream reads its limit for a plan, the
    interleaving where a window planned for the old server reaches the new one. Counts the
    windows sent."""

    def __init__(self, client: DecoderClient, restart) -> None:
        self._client, self._restart, self.sent = client, restart, 0

    def restart_at_next_read(self, restart) -> None:
        self._restart = restart

    @property
    def max_tokens(self) -> int:
        limit = self._client.max_tokens
        restart, self._restart = self._restart, None
        if restart is not None:
            restart()
        return limit

    def decode(self, *args, **kwargs):
        self.sent += 1
        return self._client.decode(*args, **kwargs)

    async def decode_async(self, *args, **kwargs):
        self.sent += 1
        return await self._client.decode_async(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._client, attr)


@pytest.mark.parametrize("preset", ["exact", "default"])
def test_a_stream_plans_its_windows_from_the_attached_server_s_max_tokens(shm_name, preset):
    """Against ``--max-tokens 200`` a 400-token push decodes (not "split the request" for good),
    and all 128,000 samples come out; the exact preset's equal the lone decode."""
    running = _serve(shm_name, max_tokens=200)
    semantic, glb = _request(400, seed=1)
    try:
        with DecoderClient(shm_name, timeout=60) as client:
            assert client.max_tokens == 200
            stream = DecodeStream(client, glb, preset=preset, dtype="float32")
            first = stream.push(semantic)
            assert len(first) > 0
            audio = np.frombuffer(first + stream.finish(), "<f4")
    finally:
        _stop(running)
    assert audio.shape == (400 * HOP,)
    if preset == "exact":
        np.testing.assert_allclose(audio, single_decode(semantic, glb), atol=EXACT_TOL, rtol=0)


@pytest.mark.parametrize(("new_limit", "when", "api"), [
    (150, "between pushes", "sync"),
    (1500, "between pushes", "sync"),
    (150, "between plan and decode", "sync"),
    (150, "between plan and decode", "async"),
    (1500, "between plan and decode", "async"),
])  # fmt: skip
def test_a_stream_replans_for_a_server_restarted_with_another_max_tokens_and_loses_no_audio(
        shm_name, new_limit, when, api):  # fmt: skip
    """The server (--max-tokens 200) is replaced mid-stream by one with a smaller limit (150,
    under the exact preset's 184-token window) or a larger one (1500). Between two pushes, the
    next push is planned for the new limit; between a plan and its decodes, the new server
    refuses the windows planned for the old one (when smaller) and the stream plans them again."""
    running = [_serve(shm_name, max_tokens=200)]
    semantic, glb = _request(1000, seed=2)

    def restart() -> None:
        _stop(running.pop())
        running.append(_serve(shm_name, max_tokens=new_limit))

    try:
        with DecoderClient(shm_name, timeout=60) as real:
            client = RestartOnLimitRead(real, None)
            stream = DecodeStream(client, glb, preset="exact", dtype="float32")
            out = [stream.push(semantic[:300])]  # planned for 200: several windows
            if when == "between pushes":
                restart()
            else:
                client.restart_at_next_read(restart)
            before = client.sent
            if api == "sync":
                out += [stream.push(semantic[300:]), stream.finish()]
            else:
                async def rest() -> list[bytes]:
                    return [await stream.push_async(semantic[300:]), await stream.finish_async()]
                out += asyncio.run(rest())
            assert real.max_tokens == new_limit
    finally:
        for r in running:
            _stop(r)
    audio = np.frombuffer(b"".join(out), "<f4")
    assert audio.shape == (1000 * HOP,)
    np.testing.assert_allclose(audio, single_decode(semantic, glb), atol=EXACT_TOL, rtol=0)
    if new_limit > 200 and when == "between pushes":
        assert client.sent - before == 2  # the rest of the push in one window, then finish's
    if new_limit < 200:
        assert client.sent - before > 700 // 16  # planned for the new limit: 16-token regions


class LimitedDecoder:
    """A client stand-in with a server limit that changes, whose audio for a token depends on
    that token only (so any plan must reproduce the full decode exactly); refuses a window
    longer than its limit as a server does."""

    def __init__(self, limits: list[int]) -> None:
        self.limits = limits
        self.max_tokens = limits[0]

    def decode(self, semantic_ids, global_ids, *, dtype="int16", timeout=None) -> np.ndarray:
        if len(semantic_ids) > self.max_tokens:
            raise ValueError(f"more than the {self.max_tokens} a slot holds; split the request")
        ids = np.asarray(semantic_ids, np.float32)
        ramp = np.arange(HOP, dtype=np.float32) / HOP
        return ((ids[:, None] + ramp[None, :]) / 8192).reshape(-1)

    async def decode_async(self, semantic_ids, global_ids, *, dtype="int16", timeout=None):
        return self.decode(semantic_ids, global_ids, dtype=dtype, timeout=timeout)


@pytest.mark.parametrize("preset", ["default", "exact", "peers"])
def test_windows_fit_every_limit_even_below_one_window_and_the_samples_stay_exact(preset):
    """Limits change between pushes, down to 1 token (the context and crossfade shrink to fit):
    every window is sent, and the output is the full decode, sample for sample."""
    rng = np.random.default_rng(3)
    semantic = rng.integers(0, 8192, 900)
    decoder = LimitedDecoder([200, 1, 3, 4, 5, 30, 46, 70, 1500, 71, 2, 184, 12])
    stream = DecodeStream(decoder, np.zeros(32, np.int64), preset=preset, dtype="float32")
    out, i = [], 0
    for limit in decoder.limits * 3:
        decoder.max_tokens = limit
        size = int(rng.integers(1, 60))
        out.append(stream.push(semantic[i : i + size]))
        i += size
        assert sum(map(len, out)) == 4 * stream.samples_emitted
    decoder.max_tokens = 2
    out += [stream.push(semantic[i:]), stream.finish()]
    audio = np.frombuffer(b"".join(out), "<f4")
    decoder.max_tokens = len(semantic)
    # Exact but for the crossfade's float rounding (6e-8); one sample off would be 3.8e-7.
    np.testing.assert_allclose(audio, decoder.decode(semantic, None), atol=1e-7, rtol=0)


def test_fitted_settings_shrink_the_chunk_first_then_context_and_lookahead():
    default = PRESETS["default"]  # chunk 25, left 25, lookahead 20, crossfade 640
    assert default.fitted(70) is default
    assert default.fitted(60) == StreamSettings(chunk_tokens=15, left_context=25, lookahead=20,
                                                crossfade=640)  # fmt: skip
    assert default.fitted(10) == StreamSettings(chunk_tokens=1, left_context=5, lookahead=4,
                                                crossfade=320)  # fmt: skip
    assert default.fitted(1) == StreamSettings(chunk_tokens=1, left_context=0, lookahead=0,
                                               crossfade=0)  # fmt: skip
    for limit in range(1, 80):
        assert default.fitted(limit).window_tokens <= limit
    exact = PRESETS["exact"]  # down to 135 tokens it keeps its whole context: still exact
    assert exact.fitted(135) == StreamSettings(chunk_tokens=1, left_context=67, lookahead=67,
                                               crossfade=0)  # fmt: skip
