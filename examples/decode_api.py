"""The HTTP decode API that both examples serve: routes, request parsing, errors, WAV output.

``create_app(settings)`` builds a Starlette app; ``examples/http_tts`` runs it under ``uvicorn
--workers N`` beside one decoder, ``examples/ray_serve`` as the ASGI app of each Ray Serve
replica beside its node's decoder. Each process that runs the app holds one ``DecoderClient``,
attached at start-up (lifespan) and closed at shutdown. Routes:

- ``POST /v1/decode``: ``{"semantic_ids": [...], "global_ids": [32 ints]}`` -> ``audio/wav``
  (16 kHz mono int16, written by the standard library's ``wave``), up to ``MAX_STREAM_TOKENS``
  ids. A body longer than the decoder's ``--max-tokens`` is decoded as the stream route does, in
  overlapping windows, with ``DecodeStream``'s ``exact`` preset: the same audio as one decode
  (int16 within 1 LSB).
- ``POST /v1/decode/stream``: the same body, plus an optional ``"preset"`` (``"default"``,
  ``"exact"`` or ``"peers"``, see ``bicodec_shm.client.streaming``) -> ``audio/wav`` as a chunked
  response: a 44-byte WAV header whose two size fields are 0xFFFFFFFF ("length unknown", as
  streaming WAV writers do; ffmpeg/ffplay, sox and Python's ``wave`` read it), then PCM as each
  window of ``DecodeStream`` is decoded.
- ``GET /healthz``: 200 while the decoder server is serving, else 503 (for a readiness probe).

Every answer of the two decode routes names the decoder that served it in the header
``X-Bicodec-Shm-Decoder`` (on Ray: which node's).

Errors are JSON ``{"error": message}``: 422 for bad input (the library's ``ValueError`` text,
malformed JSON, missing or unknown fields), 413 for a body over ``MAX_BODY_BYTES``, 503 with
``Retry-After`` while no decoder server serves (at once for a new request; one in flight when the
decoder dies is resubmitted to its replacement until its deadline), 504 when a decode misses its
deadline (waiting for a free slot at the decoder included). A stream whose decode fails after its
header was sent is cut off (no final chunk), so a client sees a truncated transfer, never a short
file that looks complete.

``Settings.from_env()`` reads:

==============================  =========================================================
``BICODEC_SHM_NAME``            the decoder's name (``bicodec-shm serve --name``), default
                                the CLI's ``bicodec-shm``
``BICODEC_SHM_TIMEOUT``         seconds one decode may take end to end, waiting for a
                                restarted decoder included (default 30)
``BICODEC_SHM_CLIENT_SLOTS``    requests one process can have in flight at the decoder; more
                                wait in the process (default 8)
==============================  =========================================================
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.client.streaming import (
    DEFAULT_MAX_WINDOW,
    SAMPLE_RATE,
    SEMANTIC_VOCAB,
    DecodeStream,
)
from bicodec_shm.codecs.validation import as_token_array
from bicodec_shm.deploy.processes import is_serving
from bicodec_shm.errors import BiCodecShmError, DecodeError, DecodeTimeoutError, ServerUnavailableError
from bicodec_shm.protocol.names import validate_name
from bicodec_shm.tools.cli import DEFAULT_NAME
from bicodec_shm.tools.decode_cmd import wav_bytes

log = logging.getLogger("uvicorn.error")  # uvicorn's own logger: our lines share its format

# A request longer than the decoder's --max-tokens (1500 = 30 s) is cut into windows, stream or
# not: either may hold up to 10 minutes of audio.
MAX_STREAM_TOKENS = 30_000
STREAM_LIMIT = (
    "ids this service decodes in one request (its MAX_STREAM_TOKENS, 10 minutes of audio; the "
    "decoder's --max-tokens does not limit a request here); split the utterance"
)
# A body past the decoder's --max-tokens: windows that cover the receptive field, so the audio
# is that of one decode.
LONG_BODY_PRESET = "exact"
MAX_BODY_BYTES = 1 << 20
FIELDS = ("semantic_ids", "global_ids")
STREAM_FIELDS = (*FIELDS, "preset")
DECODER_HEADER = "X-Bicodec-Shm-Decoder"  # the decoder that served an answer: on Ray, its node's


@dataclass(frozen=True)
class Settings:
    """What one worker needs to reach the decoder (see the module docstring for the variables)."""

    name: str = DEFAULT_NAME
    timeout: float = 30.0
    client_slots: int = 8
    # False: a new request while no decoder serves gets a 503 at once (a load balancer can send
    # it elsewhere). True: once attached, it waits for a restarted decoder until its deadline,
    # as requests in flight do; for Ray, where the node's decoder comes back by itself within
    # seconds and a replica cannot hand a request to another node.
    wait_for_decoder: bool = False

    @classmethod
    def from_env(cls) -> Settings:
        """The settings of the environment, checked: ``ConfigError`` names a bad variable."""
        env = os.environ
        return cls(
            name=_setting(env, "BICODEC_SHM_NAME", DEFAULT_NAME, validate_name),
            timeout=_setting(env, "BICODEC_SHM_TIMEOUT", "30", _positive(float)),
            client_slots=_setting(env, "BICODEC_SHM_CLIENT_SLOTS", "8", _positive(int)),
        )


class ConfigError(ValueError):
    """A setting of the environment is unusable: the worker cannot start."""


def _setting(env: Any, variable: str, default: str, parse: Any) -> Any:
    text = env.get(variable, default)
    try:
        return parse(text)
    except ValueError as exc:
        raise ConfigError(f"{variable}={text!r}: {exc}") from None


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"not a{'n' if kind is int else ''} {kind.__name__}") from None
        if not value > 0:
            raise ValueError("must be > 0")
        return value

    return parse


class BadRequest(ValueError):
    """Input the library never saw: a body that is not the JSON object we expect."""


class BodyTooLarge(Exception):
    """The request body is over ``MAX_BODY_BYTES``."""


class _Decoder:
    """This worker's one ``DecoderClient``, attached at start-up or, if no decoder server was
    there yet, at the first request that finds one."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._client: DecoderClient | None = None

    def attach(self) -> DecoderClient:
        """The client for a new request, or ServerUnavailableError at once if no decoder serves.

        The check costs one header read (~tens of µs). Without it a request that arrives while
        the decoder is down would wait its whole timeout for a replacement; an HTTP client
        would rather get a fast 503 with Retry-After (unless ``wait_for_decoder``). Requests
        already in flight when the decoder dies are still resubmitted to its replacement by the
        client, until their deadline.
        """
        if self._client is not None and self.settings.wait_for_decoder:
            return self._client
        if not is_serving(self.settings.name):
            raise ServerUnavailableError(f"no decoder server is serving {self.settings.name!r}")
        if self._client is None:  # no await in between: one coroutine at a time gets here
            s = self.settings
            self._client = DecoderClient(s.name, timeout=s.timeout, slots=s.client_slots)
        return self._client

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


def create_app(settings: Settings | None = None) -> Starlette:
    """The ASGI app; ``settings`` default to the environment's (``ConfigError`` if unusable)."""
    settings = settings or Settings.from_env()
    try:
        validate_name(settings.name)  # a bad name stops the worker at start, not every request
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    decoder = _Decoder(settings)
    served_by = {DECODER_HEADER: settings.name}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            decoder.attach()
            log.info("worker %d attached to decoder %r", os.getpid(), decoder.settings.name)
        except BiCodecShmError as exc:  # no server yet, or no free slot: answer 503s meanwhile
            log.warning("worker %d: %s; will attach at the first request", os.getpid(), exc)
        try:
            yield
        finally:
            decoder.close()  # releases this worker's slots at the decoder at once

    async def decode(request: Request) -> Response:
        try:
            payload = _parse(await _read_body(request), FIELDS)
            semantic = _semantic_ids(payload)
            client = decoder.attach()
            max_tokens = client.get_stats().get("max_tokens", DEFAULT_MAX_WINDOW)
            if len(semantic) <= max_tokens:
                pcm = await client.decode_async(semantic, payload["global_ids"])
            else:  # longer than a slot: the stream route's windows, all of them at once
                stream = DecodeStream(client, payload["global_ids"], preset=LONG_BODY_PRESET,
                                      max_window=max_tokens)  # fmt: skip
                whole = await stream.push_async(semantic) + await stream.finish_async()
                pcm = np.frombuffer(whole, "<i2")
        except Exception as exc:  # every failure becomes a status code: no worker dies of input
            return _error_response(exc, served_by)
        return Response(wav_bytes(pcm), media_type="audio/wav", headers=served_by)

    async def decode_stream(request: Request) -> Response:
        try:
            payload = _parse(await _read_body(request), STREAM_FIELDS)
            # Everything is checked before the 200 goes out: after that an error can only cut
            # the stream off.
            semantic = _semantic_ids(payload)
            preset = payload.get("preset", "default")
            if not isinstance(preset, str):
                raise BadRequest(f"preset must be a string such as 'default', got {preset!r}")
            client = decoder.attach()
            max_window = client.get_stats().get("max_tokens", DEFAULT_MAX_WINDOW)
            stream = DecodeStream(client, payload["global_ids"], preset=preset,
                                  max_window=max_window)  # fmt: skip
        except Exception as exc:
            return _error_response(exc, served_by)
        return StreamingResponse(
            _stream_body(stream, semantic),
            media_type="audio/wav",
            headers={"X-Accel-Buffering": "no", **served_by},  # ask nginx-style proxies not to buffer it
        )

    async def healthz(request: Request) -> Response:
        name = decoder.settings.name
        serving = is_serving(name)
        return JSONResponse({"decoder": name, "serving": serving, "worker_pid": os.getpid()},
                            status_code=200 if serving else 503)  # fmt: skip

    return Starlette(
        routes=[
            Route("/v1/decode", decode, methods=["POST"]),
            Route("/v1/decode/stream", decode_stream, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


async def _stream_body(stream: DecodeStream, semantic: np.ndarray) -> AsyncIterator[bytes]:
    """The WAV header, then each piece of PCM as soon as the stream makes it final.

    The ids are pushed ``chunk_tokens`` at a time, as a language model would emit them, so the
    first audio leaves after ``chunk_tokens + lookahead`` tokens, not after the whole utterance.
    """
    yield streaming_wav_header()
    step = stream.settings.chunk_tokens
    try:
        for start in range(0, len(semantic), step):
            pcm = await stream.push_async(semantic[start : start + step])
            if pcm:
                yield pcm
        tail = await stream.finish_async()
        if tail:
            yield tail
    except Exception as exc:
        # The status line is gone already; re-raising makes uvicorn drop the connection without
        # the final empty chunk, so the client sees a truncated transfer.
        log.warning("stream cut off after %d samples: %s", stream.samples_emitted, exc)
        raise


def _semantic_ids(payload: dict[str, Any]) -> np.ndarray:
    """The request's semantic ids, checked against this service's limit (not the decoder's)."""
    return as_token_array(payload["semantic_ids"], what="semantic_ids", vocab=SEMANTIC_VOCAB,
                          max_len=MAX_STREAM_TOKENS, limit=STREAM_LIMIT)  # fmt: skip


async def _read_body(request: Request) -> bytes:
    """The body, refused once it passes ``MAX_BODY_BYTES`` (before all of it is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLarge(f"the body is {declared} bytes; at most {MAX_BODY_BYTES} are accepted")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(f"the body is over {MAX_BODY_BYTES} bytes")
        parts.append(part)
    return b"".join(parts)


def _parse(body: bytes, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The JSON object of a request; its values are checked later, by the library."""
    try:
        payload = json.loads(body)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"the body must be a JSON object with the fields {list(FIELDS)}, "
                         f"got a JSON {type(payload).__name__}")  # fmt: skip
    missing = [k for k in FIELDS if k not in payload]
    unknown = sorted(set(payload) - set(allowed))
    if missing or unknown:
        raise BadRequest(
            (f"missing field(s) {missing}; " if missing else "")
            + (f"unknown field(s) {unknown}; " if unknown else "")
            + f"the fields are {list(allowed)}"
        )
    return payload


def _error_response(exc: Exception, served_by: dict[str, str]) -> JSONResponse:
    """Map the library's exception tree onto HTTP statuses (see the module docstring)."""
    headers = dict(served_by)
    if isinstance(exc, BodyTooLarge):
        status = 413
    elif isinstance(exc, DecodeTimeoutError):  # before its base class, ServerUnavailableError
        status = 504
    elif isinstance(exc, ValueError):  # BadRequest, and every input check of the library
        status = 422
    elif isinstance(exc, DecodeError):  # the decoder failed this one request
        status = 500
    elif isinstance(exc, BiCodecShmError):  # no server, or not a usable segment
        status = 503
        headers["Retry-After"] = "1"
    else:
        log.exception("unexpected error")
        status, exc = 500, RuntimeError(f"internal error: {type(exc).__name__}")
    return JSONResponse({"error": str(exc)}, status_code=status, headers=headers)


def streaming_wav_header() -> bytes:
    """A 44-byte 16 kHz mono int16 WAV header whose RIFF and data sizes are 0xFFFFFFFF.

    ``wave`` cannot write a header before it knows the length (it seeks back on close), so the
    header is packed here; the fields are those ``wave`` writes, with both sizes unknown.
    """
    unknown = 0xFFFFFFFF
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", unknown, b"WAVE",
        b"fmt ", 16, 1, 1, SAMPLE_RATE, 2 * SAMPLE_RATE, 2, 16,  # PCM, mono, 2 bytes a frame
        b"data", unknown,
    )  # fmt: skip
