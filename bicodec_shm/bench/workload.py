"""The requests: lengths drawn from a mix, random ids, and how many per client."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..transport import (
    HOP,
    N_GLOBAL,
)

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


def draw_lengths(mix: Sequence[Band], n_clients: int, n_requests: int, seed: int) -> list[list[int]]:
    """Token lengths of each client's requests. Client i's list depends on (seed, i) only."""
    weights = np.array([b.weight for b in mix], float)
    weights /= weights.sum()
    out = []
    for i in range(n_clients):
        rng = np.random.default_rng([seed, i])
        bands = rng.choice(len(mix), size=n_requests, p=weights)
        out.append([int(rng.integers(mix[b].lo, mix[b].hi + 1)) for b in bands])
    return out


def _requests(index: int, lengths: list[int], seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Client ``index``'s requests: random ids of the given lengths, one speaker per client."""
    rng = np.random.default_rng([seed, index, 1])
    speaker = rng.integers(0, GLOBAL_VOCAB, N_GLOBAL, dtype=np.int64)
    return [(rng.integers(0, SEMANTIC_VOCAB, n, dtype=np.int64), speaker) for n in lengths]


def audio_seconds(tokens: int) -> float:
    return tokens * HOP / SAMPLE_RATE


def requests_per_client(n: int, requests: int | None, total: int = TOTAL_REQUESTS) -> int:
    """M: ``requests`` if given, else ``total`` shared out over N clients (at least 2 each)."""
    return requests if requests is not None else max(MIN_REQUESTS, total // n)
