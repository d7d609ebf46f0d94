"""The batch policy: which ready requests are decoded together.

A pure function over arrays of (length, submit time), so the policy can be tested and tuned
without shared memory or a model.

The rules (shared/docs/design.md, "Batching policy"):

- The oldest ready request always goes first, so no request starves.
- Others join in order of how close their length is to the oldest's, which groups similar
  lengths together. Masking keeps results exact whatever the grouping; grouping only saves the
  compute wasted on padding.
- A row joins only if the batch stays within ``max_batch`` rows, within the padded-token budget
  ``max_batch_tokens`` (rows x longest length), and within the padding bound ``min_fill``: the
  shortest row must be at least ``min_fill`` x the longest, so no row is padded to more than
  1/min_fill of its length. A single request always fits, whatever its length, so an
  over-budget request is decoded alone rather than refused.
- Where the server measures what a batch costs (batch_costs.py), a row also joins only if
  ``joins(rows, longest, length)`` says the batch with it costs less than the batch without it
  and the row decoded alone.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# Defaults of the policy, from the sweeps in benchmarks/RESULTS.md (2-core CPU, default mix of
# 25-50-token chunks and 100-300-token utterances, N = 8): a wait window changed neither padding
# nor CPU per audio second, so none; on a CPU a batch costs as much per item as single decodes,
# so padding is pure waste, and a 512-token budget kept it at ~33% where 1024 gave 70-142% and
# 2048-8192 gave 146-179%. ``min_fill`` bounds the waste per row directly.
DEFAULT_MAX_BATCH = 16
DEFAULT_MAX_WAIT_MS = 0.0
DEFAULT_MAX_BATCH_TOKENS = 512
# On a GPU a batch costs far less per row than on a CPU, up to the batch that fills the device,
# and 512 tokens would cap a batch at 10 rows of 50 tokens, which a CUDA graph then pads to the
# 16-row bucket (+60 % work). 2400 = 16 x 150 = 8 x 300: 16 chunks of up to 150 tokens fit, and
# 300-token utterances batch 8 at a time, both exactly one bucket of buckets.py's grid. Larger
# budgets form few larger batches on the bench's mix and hold chunks behind utterance batches:
# at ~1.18 GFLOP per token (benchmarks/bench_model.py) a 2400-token batch is ~2.8 TFLOP, tens of
# ms of float32 on an H100-class GPU (an estimate from FLOPs; benchmarks/device_check.sh
# measures it).
DEFAULT_CUDA_MAX_BATCH_TOKENS = 2400
DEFAULT_MIN_FILL = 0.5
# A free lane waits up to this long for the clients it has just answered to send their next
# request. With a device-shaped decoder (benchmarks/RESULTS.md, N = 4 / 16) 2 ms took the
# engine from 0.67 / 0.86 to 0.90 / 0.92 of the ideal batcher: without it, a client that
# resubmits right after its answer misses the batch planned in the meantime.
DEFAULT_REJOIN_MS = 2.0


def default_max_batch_tokens(device_type: str) -> int:
    """The padded-token budget for batches decoded on ``device_type`` ("cpu", "cuda", ...)."""
    return DEFAULT_CUDA_MAX_BATCH_TOKENS if device_type == "cuda" else DEFAULT_MAX_BATCH_TOKENS


def plan_batch(
    lengths: np.ndarray,
    submitted_ns: np.ndarray,
    *,
    max_batch: int,
    max_batch_tokens: int | None,
    min_fill: float = 0.0,
    joins: Callable[[int, int, int], bool] | None = None,
    within: Callable[[int, int], bool] | None = None,
) -> np.ndarray:
    """Choose the next batch among ready requests; the rest wait for the next round.

    Args:
        lengths: (R,) tokens of each ready request.
        submitted_ns: (R,) when each request's audio is due (the server passes its seen time
            plus the request's ``due_in``: ``Requests.due``); the soonest always goes first, so
            a request is passed over only by ones due before it and never starves.
        joins: ``joins(rows, longest, length)``: may a row of ``length`` tokens join a batch of
            ``rows`` rows whose longest has ``longest`` tokens (None: every row that fits may)?
        within: ``within(rows, longest)``: may a batch of ``rows`` rows padded to ``longest``
            tokens run, for the sake of its most urgent row (a CPU lane's latency bound,
            batch_costs.py; None: any)?
    Returns:
        (B,) indices into the arrays, 1 <= B <= R when R > 0, longest first.
    """
    n = len(lengths)
    if n <= 1:
        return np.zeros(n, np.int64)
    longest, shortest = int(lengths.max()), int(lengths.min())
    if (
        joins is None
        and n <= max_batch
        and (max_batch_tokens is None or n * longest <= max_batch_tokens)
        and shortest >= min_fill * longest
        and (within is None or within(n, longest))
    ):
        return np.argsort(-lengths, kind="stable")  # everything fits: the common case
    oldest = int(np.lexsort((np.arange(n), submitted_ns))[0])
    # The others by closeness of length to the oldest's, then by age.
    order = np.lexsort((submitted_ns, np.abs(lengths - lengths[oldest])))
    chosen = [oldest]
    longest = shortest = int(lengths[oldest])
    for j in order.tolist():
        if len(chosen) >= max_batch:
            break
        if j == oldest:
            continue
        length = int(lengths[j])
        new_longest, new_shortest = max(longest, length), min(shortest, length)
        if max_batch_tokens is not None and (len(chosen) + 1) * new_longest > max_batch_tokens:
            continue  # a shorter one further down the list may still fit
        if new_shortest < min_fill * new_longest:
            continue
        if joins is not None and not joins(len(chosen), longest, length):
            continue
        if within is not None and not within(len(chosen) + 1, new_longest):
            continue
        chosen.append(j)
        longest, shortest = new_longest, new_shortest
    picked = np.asarray(chosen, np.int64)
    return picked[np.argsort(-lengths[picked], kind="stable")]


def check_options(*, max_batch: int, max_wait_ms: float, rejoin_ms: float, max_batch_tokens: int | None,
                  min_fill: float, lanes: int | None) -> None:  # fmt: skip
    """The bounds of the server's batching options (``DecoderServer``'s arguments): a
    ``ValueError`` naming the first one out of range."""
    checks = [
        (max_batch >= 1, f"max_batch must be >= 1, got {max_batch}"),
        (max_wait_ms >= 0, f"max_wait_ms must be >= 0, got {max_wait_ms}"),
        (rejoin_ms >= 0, f"rejoin_ms must be >= 0, got {rejoin_ms}"),
        (max_batch_tokens is None or max_batch_tokens >= 1,
         f"max_batch_tokens must be >= 1 or None, got {max_batch_tokens}"),
        (0.0 <= min_fill <= 1.0, f"min_fill must be in [0, 1], got {min_fill}"),
        (lanes is None or 1 <= lanes <= 64, f"lanes must be in 1..64, got {lanes}"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
