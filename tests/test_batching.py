"""The batch policy as a pure function: who goes together, within what budget and padding bound."""

from __future__ import annotations

import random

import numpy as np

from bicodec_shm.server.batching import plan_batch


def _plan(lengths, *, submitted=None, **policy):
    lengths = np.asarray(lengths, np.int64)
    submitted = np.arange(len(lengths)) if submitted is None else np.asarray(submitted)
    policy.setdefault("max_batch", 8)
    policy.setdefault("max_batch_tokens", None)
    return plan_batch(lengths, submitted, **policy).tolist()


def test_empty_ready_list_gives_empty_batch():
    assert _plan([]) == []


def test_oldest_request_always_goes_first_even_if_over_budget():
    assert _plan([1400, 10, 10], max_batch_tokens=500) == [0]


def test_oldest_is_chosen_by_submit_time_not_position():
    assert _plan([1400, 10, 10], submitted=[5, 1, 9], max_batch_tokens=500, min_fill=0.5) == [1, 2]


def test_max_batch_caps_rows_and_keeps_the_oldest():
    batch = _plan([20] * 30, submitted=list(range(30, 0, -1)))
    assert len(batch) == 8 and 29 in batch


def test_similar_lengths_are_grouped_with_the_oldest():
    assert set(_plan([50, 400, 55, 45, 390, 52], max_batch=4)) == {0, 2, 3, 5}


def test_padded_token_budget_is_respected_and_shorter_ones_still_fit():
    # 300 cannot join (2 x 300 > 250) but 90 can (2 x 100 <= 250).
    assert set(_plan([100, 300, 90], max_batch_tokens=250)) == {0, 2}


def test_min_fill_keeps_short_rows_out_of_long_batches():
    lengths = [100, 40, 60, 95]
    assert set(_plan(lengths, min_fill=0.5)) == {0, 2, 3}  # 40 < 0.5 x 100
    assert set(_plan(lengths, min_fill=0.0)) == {0, 1, 2, 3}
    # The bound holds against the batch's longest row, whichever row that turns out to be.
    assert set(_plan([40, 100, 60], min_fill=0.5)) == {0, 2}


def test_batch_is_sorted_longest_first():
    assert _plan([10, 30, 20]) == [1, 2, 0]


def test_random_ready_sets_always_satisfy_the_invariants():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 40)
        lengths = np.array([rng.randint(1, 1500) for _ in range(n)])
        submitted = np.array([rng.randint(0, 10**6) for _ in range(n)])
        max_batch = rng.randint(1, 16)
        budget = rng.choice([None, 1000, 4096])
        fill = rng.choice([0.0, 0.5, 0.9])
        batch = plan_batch(lengths, submitted, max_batch=max_batch, max_batch_tokens=budget, min_fill=fill)
        oldest = int(np.lexsort((np.arange(n), submitted))[0])
        assert oldest in batch.tolist()
        assert 1 <= len(batch) <= max_batch
        assert len(set(batch.tolist())) == len(batch)
        chosen = lengths[batch]
        assert list(chosen) == sorted(chosen, reverse=True)
        if len(batch) > 1:
            if budget is not None:
                assert len(batch) * chosen.max() <= budget
            assert chosen.min() >= fill * chosen.max()


def test_cuda_defaults_form_16_x_50_and_8_x_300_batches_that_are_buckets() -> None:
    """On a GPU the default budget lets 16 rows of 50 tokens form one batch (512 capped it at
    10, which a CUDA graph pads to 16 rows), and the server's grid has that batch's shape."""
    from bicodec_shm.model.bicodec.buckets import Bucket, BucketGrid
    from bicodec_shm.server.batching import DEFAULT_MAX_BATCH, default_max_batch_tokens

    budget = default_max_batch_tokens("cuda")
    assert default_max_batch_tokens("cpu") == 512
    grid = BucketGrid.for_max_batch(DEFAULT_MAX_BATCH)
    assert grid.batch_sizes == (1, 2, 4, 8, 16)
    assert BucketGrid.for_max_batch(12).batch_sizes == (1, 2, 4, 8, 12)
    for length, rows in ((50, 16), (150, 16), (300, 8)):
        picked = _plan([length] * 20, max_batch=DEFAULT_MAX_BATCH, max_batch_tokens=budget)
        assert len(picked) == rows, length
        assert grid.choose(rows, length) == Bucket(rows, length)
    assert len(_plan([50] * 20, max_batch=DEFAULT_MAX_BATCH, max_batch_tokens=512)) == 10
