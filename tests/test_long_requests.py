"""bicodec_shm.client.long_requests: an utterance longer than the server's slots, decoded as
exact overlapping windows. Ground truth: the whole, unpadded decode of the in-process model."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from support import seed_int16, single_decode

from bicodec_shm.client.long_requests import exact_windows
from bicodec_shm.client.streaming import RECEPTIVE_FIELD
from bicodec_shm.integrations.batch_decoder import BiCodecBatchDecoder


def test_windows_tile_the_sequence_within_the_limit_with_the_whole_receptive_field_of_context():
    for n in (1, 134, 135, 1500, 1501, 2999, 3000, 7777):
        for limit in (135, 136, 200, 1500, 3000):
            windows = exact_windows(n, limit)
            assert [w[1] for w in windows] == [0] + [w[2] for w in windows[:-1]]  # regions tile
            assert windows[-1][2] == n
            for w0, r0, r1, w1 in windows:
                assert 0 <= w0 <= r0 < r1 <= w1 <= n and w1 - w0 <= limit
                assert r0 - w0 >= min(r0, RECEPTIVE_FIELD)  # context, or the sequence's start
                assert w1 - r1 >= min(n - r1, RECEPTIVE_FIELD)  # context, or its end
            assert len(windows) == 1 or n > limit


def test_slots_too_short_for_both_contexts_are_refused_naming_the_limit_needed():
    assert exact_windows(134, 134) == [(0, 0, 134, 134)]
    with pytest.raises(ValueError, match=r"135 tokens are more than the 134 a slot holds.* --max-tokens 135"):
        exact_windows(135, 134)


def test_the_batch_decoder_drop_in_decodes_3000_tokens_within_one_int16_step(thread_server, shm_name):
    thread_server(slots=8, max_wait_ms=5)  # --max-tokens 1500
    rng = np.random.default_rng(11)
    semantic, glb = rng.integers(0, 8192, 3000), rng.integers(0, 4096, 32)
    dropin = BiCodecBatchDecoder(shm_name, request_timeout=60)
    dropin.start()
    try:
        pcm = np.frombuffer(asyncio.run(dropin.decode_async(semantic, glb)), "<i2")
    finally:
        dropin.stop()
    want = seed_int16(single_decode(semantic, glb))
    assert pcm.shape == want.shape == (320 * 3000,)
    assert np.abs(pcm.astype(np.int32) - want).max() <= 1
