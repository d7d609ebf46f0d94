"""The batch policy: which ready requests are decoded together.

Pure functions over (slot, length, submit time) tuples, so the policy can be tested and tuned
without shared memory or a model.

The rules (shared/docs/design.md, "Batching policy"):

- The oldest ready request always goes first, so no request starves.
- Others join in order of how close their length is to the oldest's, which groups similar
  lengths together. Masking keeps results exact whatever the grouping; grouping only saves the
  compute wasted on padding.
- A batch stops growing at ``max_batch`` rows or when ``rows x longest length`` would exceed
  ``max_batch_tokens`` (the padded-token budget). A single request always fits, whatever its
  length, so an over-budget request is decoded alone rather than refused.
"""

from __future__ import annotations

from dataclasses import dataclass

# Defaults of the policy, from the sweep in benchmarks/RESULTS.md (2-core CPU, default mix of
# 25-50-token chunks and 100-300-token utterances, N = 8): a wait window changed neither padding
# nor CPU per audio second, so none; on a CPU a batch costs as much per item as single decodes,
# so padding is pure waste, and a 512-token budget kept it at ~33% where 1024 gave 70-142% and
# 2048-8192 gave 146-179%. A GPU, where batching is cheap, may want a larger budget (unmeasured).
DEFAULT_MAX_BATCH = 16
DEFAULT_MAX_WAIT_MS = 0.0
DEFAULT_MAX_BATCH_TOKENS = 512


@dataclass(frozen=True)
class Pending:
    """A ready request as the policy sees it."""

    slot: int
    length: int
    submitted_ns: int


def plan_batch(
    ready: list[Pending], *, max_batch: int, max_batch_tokens: int | None
) -> list[Pending]:
    """Choose the next batch from ``ready``; the rest wait for the next round.

    Returns a non-empty list when ``ready`` is non-empty, sorted longest first.
    """
    if not ready:
        return []
    oldest = min(ready, key=lambda p: (p.submitted_ns, p.slot))
    others = sorted(
        (p for p in ready if p is not oldest),
        key=lambda p: (abs(p.length - oldest.length), p.submitted_ns, p.slot),
    )
    batch = [oldest]
    longest = oldest.length
    for p in others:
        if len(batch) >= max_batch:
            break
        new_longest = max(longest, p.length)
        if max_batch_tokens is not None and (len(batch) + 1) * new_longest > max_batch_tokens:
            continue  # a shorter one further down the list may still fit
        batch.append(p)
        longest = new_longest
    batch.sort(key=lambda p: -p.length)
    return batch


def split_in_half(rows: list[Pending]) -> tuple[list[Pending], list[Pending]]:
    """Halves for split-and-retry after a failed batch (each half non-empty if len > 1)."""
    mid = len(rows) // 2
    return rows[:mid], rows[mid:]
