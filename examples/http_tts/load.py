"""Load a running http_tts service with concurrent requests; print requests, failures, p50/p99.

The mix (the same one tests/test_http_example.py sends): utterances of random lengths, every
``--stream-every``-th one streamed, every ``--bad-every``-th one a bad request (ids out of range,
31 globals, an empty list, malformed JSON, ...) that must get a 422. A failure is any response
other than the expected one: a good request must get a valid 16 kHz mono int16 WAV of exactly
320 samples per token, a bad one a 422 whose JSON names the problem. Latency is measured from
sending the request to the last byte of the response.

    python examples/http_tts/load.py --url http://127.0.0.1:8000 --requests 64

Needs httpx (``pip install -e ".[examples]"``); nothing here imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
import wave
from dataclasses import dataclass, field

import httpx
import numpy as np

HOP = 320
SAMPLE_RATE = 16_000
HEADER_BYTES = 44  # the streaming WAV header of examples/http_tts/app.py


@dataclass(frozen=True)
class Case:
    """One request of the load and what must come back.

    ``semantic``/``global_ids`` are set for good requests (status 200); ``error`` is a piece of
    the 422 message for bad ones.
    """

    kind: str  # "decode", "stream" or "bad"
    path: str
    body: bytes
    status: int
    semantic: tuple[int, ...] | None = None
    global_ids: tuple[int, ...] | None = None
    error: str | None = None


@dataclass
class Result:
    """What one request got back; ``chunks`` counts the reads of a streamed body."""

    case: Case
    status: int = 0
    content_type: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    latency_s: float = 0.0
    chunks: int = 0
    transport_error: str | None = None
    problems: list[str] = field(default_factory=list)


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


def _bad_cases(rng: np.random.Generator) -> list[tuple[str, bytes, str]]:
    """(path, body, a piece of the expected 422 message), one of each kind of mistake."""
    sem = [int(x) for x in rng.integers(0, 8192, 40)]
    glb = [int(x) for x in rng.integers(0, 4096, 32)]
    d, s = "/v1/decode", "/v1/decode/stream"
    return [
        (d, _json({"semantic_ids": sem[:10] + [8192] + sem[10:], "global_ids": glb}), "out of range"),
        (d, _json({"semantic_ids": [-1] + sem, "global_ids": glb}), "out of range"),
        (d, _json({"semantic_ids": sem, "global_ids": glb[:31] + [4096]}), "out of range"),
        (d, _json({"semantic_ids": sem, "global_ids": glb[:31]}), "exactly 32"),
        (d, _json({"semantic_ids": [], "global_ids": glb}), "empty"),
        (d, b'{"semantic_ids": [1, 2, 3], "global_ids": [', "not valid JSON"),
        (d, _json({"semantic_ids": sem}), "missing field"),
        (d, _json({"semantic_ids": [1.5] + sem, "global_ids": glb}), "not an int id"),
        (d, _json({"semantic_ids": "1 2 3", "global_ids": glb}), "sequence of int ids"),
        (d, _json([sem, glb]), "JSON object"),
        (d, _json({"semantic_ids": sem, "global_ids": glb, "speed": 2}), "unknown field"),
        (d, _json({"semantic_ids": None, "global_ids": glb}), "None"),
        (s, _json({"semantic_ids": sem, "global_ids": glb[:31]}), "exactly 32"),
        (s, _json({"semantic_ids": sem, "global_ids": glb, "preset": "fastest"}), "unknown preset"),
        (s, _json({"semantic_ids": [], "global_ids": glb}), "empty"),
        (s, b"\xff\xfe not json", "not valid JSON"),
    ]


def make_cases(n: int, *, seed: int = 0, min_len: int = 5, max_len: int = 300, stream_every: int = 4,
               bad_every: int = 5, stream_preset: str = "exact") -> list[Case]:  # fmt: skip
    """``n`` requests: every ``bad_every``-th bad (cycling through the kinds of mistake), every
    ``stream_every``-th of the rest streamed with ``stream_preset``; lengths uniform in
    ``[min_len, max_len]`` tokens (streams at least 2 windows long)."""
    rng = np.random.default_rng(seed)
    bad = _bad_cases(rng)
    cases: list[Case] = []
    for i in range(n):
        if bad_every and i % bad_every == bad_every - 1:
            path, body, error = bad[(i // bad_every) % len(bad)]
            cases.append(Case("bad", path, body, 422, error=error))
            continue
        streamed = stream_every and i % stream_every == 0
        lo = max(min_len, 150) if streamed else min_len
        length = int(rng.integers(lo, max(lo, max_len) + 1))
        sem = tuple(int(x) for x in rng.integers(0, 8192, length))
        glb = tuple(int(x) for x in rng.integers(0, 4096, 32))
        payload: dict = {"semantic_ids": list(sem), "global_ids": list(glb)}
        if streamed:
            payload["preset"] = stream_preset
        path = "/v1/decode/stream" if streamed else "/v1/decode"
        cases.append(Case("stream" if streamed else "decode", path, _json(payload), 200, sem, glb))
    return cases


async def run_load(url: str, cases: list[Case], *, concurrency: int = 64,
                   timeout: float = 120.0) -> list[Result]:  # fmt: skip
    """Send every case, at most ``concurrency`` at a time; one ``Result`` per case, in order."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def one(case: Case) -> Result:
            result = Result(case)
            async with gate:
                t0 = time.perf_counter()
                try:
                    headers = {"content-type": "application/json"}
                    async with client.stream("POST", case.path, content=case.body, headers=headers) as r:
                        parts = []
                        async for part in r.aiter_raw():
                            parts.append(part)
                        result.status, result.body, result.chunks = r.status_code, b"".join(parts), len(parts)
                        result.content_type = r.headers.get("content-type", "")
                        result.headers = dict(r.headers)
                except httpx.HTTPError as exc:
                    result.transport_error = f"{type(exc).__name__}: {exc}"
                result.latency_s = time.perf_counter() - t0
            result.problems = check(result)
            return result

        return list(await asyncio.gather(*(one(c) for c in cases)))


def read_wav(body: bytes) -> np.ndarray:
    """A 16 kHz mono int16 WAV (complete, or streamed with unknown sizes) -> (N,) int16."""
    with wave.open(io.BytesIO(body)) as w:
        if (w.getnchannels(), w.getsampwidth(), w.getframerate()) != (1, 2, SAMPLE_RATE):
            raise ValueError(f"not 16 kHz mono int16: {w.getparams()}")
        frames = w.readframes(w.getnframes())
    return np.frombuffer(frames, "<i2")


def check(result: Result) -> list[str]:
    """What is wrong with a response (empty: it is the one expected)."""
    case = result.case
    if result.transport_error:
        return [result.transport_error]
    if result.status != case.status:
        return [f"status {result.status}, expected {case.status}: {result.body[:200]!r}"]
    if case.status != 200:
        try:
            message = json.loads(result.body)["error"]
        except (ValueError, KeyError, TypeError):
            return [f"the {result.status} body is not JSON with an 'error': {result.body[:200]!r}"]
        return [] if case.error in message else [f"422 message {message!r} lacks {case.error!r}"]
    if not result.content_type.startswith("audio/wav"):
        return [f"content type {result.content_type!r}"]
    try:
        pcm = read_wav(result.body)
    except (wave.Error, EOFError, ValueError) as exc:
        return [f"not a valid WAV: {exc}"]
    expected = HOP * len(case.semantic or ())
    return [] if len(pcm) == expected else [f"{len(pcm)} samples, expected {expected}"]


def summarize(results: list[Result]) -> dict:
    """Counts and latency percentiles (ms), over all requests and per kind."""
    ms = np.array([r.latency_s * 1e3 for r in results])
    summary = {
        "requests": len(results),
        "failures": sum(bool(r.problems) for r in results),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "by_kind": {},
    }
    for kind in ("decode", "stream", "bad"):
        k = np.array([r.latency_s * 1e3 for r in results if r.case.kind == kind])
        if len(k):
            summary["by_kind"][kind] = {"requests": len(k), "p50_ms": float(np.percentile(k, 50)),
                                        "p99_ms": float(np.percentile(k, 99))}  # fmt: skip
    return summary


def format_summary(summary: dict) -> str:
    lines = [
        f"requests {summary['requests']}  failures {summary['failures']}  "
        f"latency p50 {summary['p50_ms']:.0f} ms  p99 {summary['p99_ms']:.0f} ms"
    ]
    for kind, s in summary["by_kind"].items():
        lines.append(
            f"  {kind:<7} {s['requests']:>4} requests  p50 {s['p50_ms']:.0f} ms  p99 {s['p99_ms']:.0f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service's base URL")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    p.add_argument("--max-len", type=int, default=300, help="longest utterance in tokens (50 a second)")
    p.add_argument("--stream-preset", default="exact", help="DecodeStream preset of the streamed requests")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be >= 1")
    cases = make_cases(args.requests, seed=args.seed, max_len=args.max_len, stream_preset=args.stream_preset)
    results = asyncio.run(run_load(args.url, cases, concurrency=args.concurrency))
    for r in results:
        if r.problems:
            print(f"FAILED {r.case.kind} {r.case.path}: {'; '.join(r.problems)}", file=sys.stderr)
    print(format_summary(summarize(results)))
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
