"""The requests: lengths drawn from a mix, random ids, and how many per client."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..batching import DEFAULT_MIN_FILL, plan_batch
from ..transport import HOP, N_GLOBAL

SAMPLE_RATE = 16_000
SEMANTIC_VOCAB = 8192
GLOBAL_VOCAB = 4096
DEFAULT_MIX = "25-50:0.8,100-300:0.2"
# Full mode: M = max(MIN_REQUESTS, TOTAL_REQUESTS // N), so every N decodes about as much audio
# (~34 s). The full-size model decodes ~0.5-1 audio s per wall s on 2 cores: ~20-25 min in all.
TOTAL_REQUESTS = 24
MIN_REQUESTS = 2


@dataclass(frozen=True)
class Band:
    """Requests of ``lo..hi`` tokens (inclusive), drawn with relative ``weight``."""

    lo: int
    hi: int
    weight: float


def parse_mix(text: str) -> tuple[Band, ...]:
    """``"25-50:0.8,100-300:0.2"`` -> bands; a lone ``"40"`` means ``"40-40:1"``."""
    bands = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        span, _, weight = part.partition(":")
        lo, _, hi = span.partition("-")
        try:
            band = Band(int(lo), int(hi or lo), float(weight or 1.0))
        except ValueError:
            raise ValueError(f"bad mix entry {part!r}; expected LO-HI:WEIGHT, e.g. 25-50:0.8") from None
        if not 1 <= band.lo <= band.hi or band.weight <= 0:
            raise ValueError(f"bad mix entry {part!r}; need 1 <= LO <= HI and WEIGHT > 0")
        bands.append(band)
    if not bands:
        raise ValueError(f"empty mix {text!r}; expected e.g. {DEFAULT_MIX}")
    return tuple(bands)


def length_stream(mix: Sequence[Band], seed: int, index: int) -> Iterator[int]:
    """Client ``index``'s request lengths, endless. The k-th depends on (seed, index, k) only,
    so every system (and the ideal batcher) sees the same requests in the same order."""
    weights = np.array([b.weight for b in mix], float)
    weights /= weights.sum()
    lo = np.array([b.lo for b in mix])
    hi = np.array([b.hi for b in mix])
    rng = np.random.default_rng([seed, index])
    while True:  # in blocks, because a window may take thousands of requests
        bands = rng.choice(len(mix), size=_BLOCK, p=weights)
        yield from rng.integers(lo[bands], hi[bands] + 1).tolist()


_BLOCK = 64


def draw_lengths(mix: Sequence[Band], n_clients: int, n_requests: int, seed: int) -> list[list[int]]:
    """The first ``n_requests`` lengths of each client's stream (``length_stream``)."""
    return [list(itertools.islice(length_stream(mix, seed, i), n_requests)) for i in range(n_clients)]


def request_stream(mix: Sequence[Band], seed: int, index: int,
                   count: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """Client ``index``'s requests: (T,) int64 semantic ids of the stream's lengths and the
    client's (32,) int64 speaker; endless unless ``count`` is given."""
    rng = np.random.default_rng([seed, index, 1])
    speaker = rng.integers(0, GLOBAL_VOCAB, N_GLOBAL, dtype=np.int64)
    lengths = itertools.islice(length_stream(mix, seed, index), count)
    for n in lengths:
        yield rng.integers(0, SEMANTIC_VOCAB, n, dtype=np.int64), speaker


def audio_seconds(tokens: int) -> float:
    return tokens * HOP / SAMPLE_RATE


def requests_per_client(n: int, requests: int | None, total: int = TOTAL_REQUESTS) -> int:
    """M: ``requests`` if given, else ``total`` shared out over N clients (at least 2 each)."""
    return requests if requests is not None else max(MIN_REQUESTS, total // n)


@dataclass(frozen=True)
class Pending:
    """A queued request as the bench's own batchers (Queue server, ideal) see it."""

    key: int  # whatever identifies the request to its batcher
    length: int
    submitted: int  # any increasing order: the oldest always goes first


def plan(pending: Sequence[Pending], *, max_batch: int, max_batch_tokens: int | None,
         min_fill: float = DEFAULT_MIN_FILL) -> list[Pending]:  # fmt: skip
    """The server's policy (``batching.plan_batch``) over ``pending``: the next batch,
    longest first."""
    chosen = plan_batch(np.array([p.length for p in pending], np.int64),
                        np.array([p.submitted for p in pending], np.int64), max_batch=max_batch,
                        max_batch_tokens=max_batch_tokens, min_fill=min_fill)  # fmt: skip
    return [pending[i] for i in chosen.tolist()]
