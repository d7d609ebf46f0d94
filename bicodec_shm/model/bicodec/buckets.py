"""Shape buckets for CUDA graphs: which padded (batch, length) shape a batch runs at.

A CUDA graph replays one fixed shape, so every batch is padded up to the smallest captured
bucket that holds it: ``B_bucket >= B`` rows and ``T_bucket >= T`` tokens. The grid is the
product of a list of batch sizes and a list of lengths; it trades padding (work the GPU does for
nothing) against graph count (capture time and memory). :func:`padding_cost` scores a grid on a
workload so that the choice can come from measurements. Pure Python: no torch here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# Streaming chunks are 25-50 tokens and utterances 100-300 (the bench's default mix); steps of
# about 1.5x keep the padding of a uniformly drawn length under ~20 %.
DEFAULT_LENGTHS = (25, 50, 75, 100, 150, 200, 300)


@dataclass(frozen=True, order=True)
class Bucket:
    """One padded shape: ``batch`` rows of ``frames`` semantic tokens."""

    batch: int
    frames: int

    @property
    def tokens(self) -> int:
        """Padded tokens the GPU computes for this shape (batch x frames)."""
        return self.batch * self.frames

    def __str__(self) -> str:
        return f"{self.batch}x{self.frames}"


@dataclass(frozen=True)
class BucketGrid:
    """Every (batch size, length) pair of two sorted lists.

    Args:
        batch_sizes: row counts, each >= 1 (sorted and de-duplicated here).
        lengths: token counts, each >= 1 (sorted and de-duplicated here).
    """

    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    lengths: tuple[int, ...] = DEFAULT_LENGTHS

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "lengths"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {values!r}")
            object.__setattr__(self, name, tuple(sorted(set(values))))

    @classmethod
    def geometric(
        cls,
        *,
        max_batch: int = 32,
        max_frames: int = 300,
        min_frames: int = 25,
        ratio: float = 1.5,
        multiple: int = 25,
    ) -> BucketGrid:
        """Batch sizes 1, 2, 4, ... up to ``max_batch`` (included); lengths from ``min_frames``
        growing by ``ratio`` and rounded up to a ``multiple``, up to ``max_frames`` (included).

        ``ratio`` bounds the padding of a length that falls just past a bucket: 1.5 wastes at
        most a third of a batch's tokens, 2 at most half, and each step costs one graph per
        batch size.
        """
        if max_batch < 1 or min_frames < 1 or max_frames < min_frames or multiple < 1:
            raise ValueError(
                "need max_batch >= 1, 1 <= min_frames <= max_frames and multiple >= 1, got "
                f"max_batch={max_batch}, min_frames={min_frames}, max_frames={max_frames}, "
                f"multiple={multiple}"
            )
        if ratio <= 1:
            raise ValueError(f"ratio must be > 1, got {ratio}")
        batches = [2**i for i in range(max_batch.bit_length()) if 2**i < max_batch] + [max_batch]
        lengths, length = [], float(min_frames)
        while length < max_frames:
            lengths.append(min(max_frames, multiple * math.ceil(length / multiple)))
            length = max(length * ratio, lengths[-1] + 1)
        return cls(tuple(batches), tuple(lengths + [max_frames]))

    @classmethod
    def for_max_batch(cls, max_batch: int, lengths: Sequence[int] = DEFAULT_LENGTHS) -> BucketGrid:
        """Batch sizes 1, 2, 4, ... below ``max_batch``, then ``max_batch`` itself: a server
        never forms a larger batch, so larger buckets would only cost capture time and memory
        (the default grid's 32-row buckets are 7 of its 42 graphs)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        return cls(tuple(2**i for i in range(max_batch.bit_length()) if 2**i < max_batch) + (max_batch,),
                   tuple(lengths))  # fmt: skip

    @classmethod
    def parse(cls, text: str) -> BucketGrid:
        """``"1,2,4,8x25,50,100"`` -> batch sizes (1, 2, 4, 8) x lengths (25, 50, 100).

        Raises:
            ValueError: not two comma-separated integer lists joined by ``x``.
        """
        try:
            batches, lengths = text.split("x")
            return cls(_ints(batches), _ints(lengths))
        except ValueError as exc:
            raise ValueError(
                f"a bucket grid is BATCHES x LENGTHS, e.g. '1,2,4,8x25,50,100'; got {text!r} ({exc})"
            ) from None

    def buckets(self) -> list[Bucket]:
        """Every bucket, largest first (most tokens, then most rows): the capture order, so that
        the first graph sizes the shared memory pool and the smaller ones reuse it."""
        every = [Bucket(b, t) for b in self.batch_sizes for t in self.lengths]
        return sorted(every, key=lambda k: (k.tokens, k.batch), reverse=True)

    def choose(self, batch: int, frames: int) -> Bucket | None:
        """The smallest bucket holding ``batch`` rows of ``frames`` tokens, or None (too large).

        The grid is a product, so the smallest batch size >= ``batch`` with the smallest length
        >= ``frames`` is also the bucket with the fewest padded tokens.
        """
        if batch < 1 or frames < 1:
            raise ValueError(f"batch and frames must be >= 1, got {batch} and {frames}")
        b = next((v for v in self.batch_sizes if v >= batch), None)
        t = next((v for v in self.lengths if v >= frames), None)
        return None if b is None or t is None else Bucket(b, t)

    def __len__(self) -> int:
        return len(self.batch_sizes) * len(self.lengths)

    def __str__(self) -> str:
        return f"{_join(self.batch_sizes)}x{_join(self.lengths)}"


@dataclass(frozen=True)
class PaddingCost:
    """How a grid fits a workload of batches.

    Attributes:
        real_tokens: tokens the requests asked for, summed over the batches a bucket holds.
        bucket_tokens: tokens computed for those batches at their bucket shapes.
        eager_batches: batches that fit no bucket (they run eagerly, unpadded).
        batches: all batches.
    """

    real_tokens: int
    bucket_tokens: int
    eager_batches: int
    batches: int

    @property
    def waste(self) -> float:
        """Share of the bucketed work that is padding: 1 - real / computed (0 = none)."""
        return 1.0 - self.real_tokens / self.bucket_tokens if self.bucket_tokens else 0.0

    @property
    def eager_share(self) -> float:
        """Share of the batches that run eagerly."""
        return self.eager_batches / self.batches if self.batches else 0.0


def padding_cost(grid: BucketGrid, batches: Iterable[Sequence[int]]) -> PaddingCost:
    """Score ``grid`` on ``batches``, each the token lengths of one batch's rows.

    Counts the bucket's padding against the tokens the rows really have, so it includes both the
    padding up to the bucket and the padding up to the batch's longest row.
    """
    real = computed = eager = count = 0
    for lengths in batches:
        count += 1
        bucket = grid.choose(len(lengths), max(lengths))
        if bucket is None:
            eager += 1
            continue
        real += sum(lengths)
        computed += bucket.tokens
    return PaddingCost(real, computed, eager, count)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _join(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)
