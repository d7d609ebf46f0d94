"""The requests: lengths drawn from a mix, random codes of the codec's layout, and how many per
client.

Lengths count frames (one code of the coarsest level; BiCodec: one semantic token, 20 ms; SNAC
24 kHz: 2048 samples, ~85 ms). A request of ``n`` frames holds ``n·rate_i`` codes at level ``i``
(SNAC 24 kHz: 1 : 2 : 4) and the codec's global ids, if it takes any (BiCodec's 32 per client).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ...codecs.layout import BICODEC, CodecLayout
from ...server.batching import DEFAULT_MIN_FILL, plan_batch

DEFAULT_MIX = "25-50:0.8,100-300:0.2"  # BiCodec tokens: 0.5-1 s chunks, 2-6 s utterances
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


def default_mix(layout: CodecLayout = BICODEC) -> str:
    """``DEFAULT_MIX``'s seconds of audio in ``layout``'s frames (SNAC 24 kHz: 6-12, 23-70)."""
    if layout.frame_rate == BICODEC.frame_rate:
        return DEFAULT_MIX
    scale = layout.frame_rate / BICODEC.frame_rate
    return ",".join(f"{max(1, round(b.lo * scale))}-{max(1, round(b.hi * scale))}:{b.weight:g}"
                    for b in parse_mix(DEFAULT_MIX))  # fmt: skip


class Request(NamedTuple):
    """One request: ``levels`` [(n·r_0,), (n·r_1,), ...] int64 codes, ``global_ids``
    (n_global,) int64 or None for a codec without them."""

    levels: list[np.ndarray]
    global_ids: np.ndarray | None

    @property
    def frames(self) -> int:
        return len(self.levels[0])


def request_stream(mix: Sequence[Band], seed: int, index: int, count: int | None = None,
                   layout: CodecLayout = BICODEC) -> Iterator[Request]:  # fmt: skip
    """Client ``index``'s requests of the stream's lengths, random codes of every level and the
    client's own global ids (one speaker per client); endless unless ``count`` is given."""
    rng = np.random.default_rng([seed, index, 1])
    speaker = _global_ids(rng, layout)
    lengths = itertools.islice(length_stream(mix, seed, index), count)
    for n in lengths:
        levels = [rng.integers(0, vocab, n * rate, dtype=np.int64)
                  for rate, vocab in zip(layout.level_rates, layout.level_vocab)]  # fmt: skip
        yield Request(levels, speaker)


def random_request(rng: np.random.Generator, layout: CodecLayout, frames: int) -> Request:
    """A request of ``frames`` frames with random codes and global ids."""
    levels = [rng.integers(0, vocab, frames * rate, dtype=np.int64)
              for rate, vocab in zip(layout.level_rates, layout.level_vocab)]  # fmt: skip
    return Request(levels, _global_ids(rng, layout))


def _global_ids(rng: np.random.Generator, layout: CodecLayout) -> np.ndarray | None:
    """(n_global,) int64 random global ids, or None for a codec that takes none."""
    if not layout.takes_global_ids:
        return None
    return rng.integers(0, layout.global_vocab, layout.n_global, dtype=np.int64)


def zero_request(layout: CodecLayout, frames: int) -> Request:
    """A request of ``frames`` frames of code 0 (for warm-ups)."""
    glob = np.zeros(layout.n_global, np.int64) if layout.n_global else None
    return Request([np.zeros(frames * r, np.int64) for r in layout.level_rates], glob)


def audio_seconds(frames: int, layout: CodecLayout = BICODEC) -> float:
    return frames * layout.samples_per_frame / layout.sample_rate


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
