"""The batch policy as pure functions: who goes together, and within what budget."""

from __future__ import annotations

import random

from bicodec_shm.batching import Pending, plan_batch, split_in_half


def _pending(lengths, t0=0):
    return [Pending(slot=i, length=n, submitted_ns=t0 + i) for i, n in enumerate(lengths)]


def test_empty_ready_list_gives_empty_batch():
    assert plan_batch([], max_batch=8, max_batch_tokens=1000) == []


def test_oldest_request_always_goes_first_even_if_over_budget():
    ready = _pending([1400, 10, 10])
    batch = plan_batch(ready, max_batch=8, max_batch_tokens=500)
    assert [p.slot for p in batch] == [0]


def test_max_batch_caps_rows():
    batch = plan_batch(_pending([20] * 30), max_batch=8, max_batch_tokens=None)
    assert len(batch) == 8
    assert batch[0].slot == 0 or 0 in {p.slot for p in batch}


def test_similar_lengths_are_grouped_with_the_oldest():
    ready = _pending([50, 400, 55, 45, 390, 52])
    batch = plan_batch(ready, max_batch=4, max_batch_tokens=None)
    assert {p.slot for p in batch} == {0, 2, 3, 5}


def test_padded_token_budget_is_respected_and_shorter_ones_still_fit():
    ready = _pending([100, 300, 90])
    batch = plan_batch(ready, max_batch=8, max_batch_tokens=250)
    # 300 cannot join (2 x 300 > 250) but 90 can (2 x 100 <= 250).
    assert {p.slot for p in batch} == {0, 2}
    rows, longest = len(batch), max(p.length for p in batch)
    assert rows * longest <= 250


def test_batch_is_sorted_longest_first():
    batch = plan_batch(_pending([10, 30, 20]), max_batch=8, max_batch_tokens=None)
    assert [p.length for p in batch] == [30, 20, 10]


def test_random_ready_sets_always_satisfy_the_invariants():
    rng = random.Random(0)
    for _ in range(500):
        ready = [Pending(i, rng.randint(1, 1500), rng.randint(0, 10**6)) for i in range(rng.randint(1, 40))]
        max_batch = rng.randint(1, 16)
        budget = rng.choice([None, 1000, 4096])
        batch = plan_batch(ready, max_batch=max_batch, max_batch_tokens=budget)
        oldest = min(ready, key=lambda p: (p.submitted_ns, p.slot))
        assert oldest in batch
        assert 1 <= len(batch) <= max_batch
        assert len({p.slot for p in batch}) == len(batch)
        if budget is not None and len(batch) > 1:
            assert len(batch) * max(p.length for p in batch) <= budget


def test_split_in_half_keeps_every_row_once():
    rows = _pending([5, 4, 3, 2, 1])
    a, b = split_in_half(rows)
    assert a and b and a + b == rows
