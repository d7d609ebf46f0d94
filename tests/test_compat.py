"""The drop-in for the seed: its usage snippet runs with only the construction line changed."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from support import reference_model, seed_int16, single_decode

from bicodec_shm import BiCodecBatchDecoder

SEMANTIC = [int(x) for x in np.random.default_rng(0).integers(0, 8192, 37)]
GLOBAL = [int(x) for x in np.random.default_rng(1).integers(0, 4096, 32)]


def _seed_snippet(batch_decoder, semantic_ids, global_ids):
    """The seed's documented usage, verbatim apart from the construction done by the caller."""
    batch_decoder.start()

    async def streaming_hot_loop():
        audio_bytes = await batch_decoder.decode_async(semantic_ids, global_ids)
        return audio_bytes

    audio_bytes = asyncio.run(streaming_hot_loop())
    stats = batch_decoder.get_stats()
    batch_decoder.stop()
    return audio_bytes, stats


def test_snippet_with_a_decoder_object_and_the_seeds_own_arguments():
    batch_decoder = BiCodecBatchDecoder(reference_model(), max_batch=16, timeout_ms=10)
    audio_bytes, stats = _seed_snippet(batch_decoder, SEMANTIC, GLOBAL)
    expected = seed_int16(single_decode(SEMANTIC, GLOBAL)).astype("<i2").tobytes()
    assert isinstance(audio_bytes, bytes) and len(audio_bytes) == 37 * 320 * 2
    got = np.frombuffer(audio_bytes, "<i2").astype(np.int32)
    assert np.abs(got - np.frombuffer(expected, "<i2")).max() <= 1
    assert set(stats) == {"total_batches", "total_requests", "avg_batch_size", "avg_batch_time_ms"}
    assert stats["total_requests"] == 1 and stats["total_batches"] == 1


def test_snippet_against_a_running_server_by_name(start_server, shm_name):
    start_server()
    audio_bytes, stats = _seed_snippet(BiCodecBatchDecoder(shm_name), SEMANTIC, GLOBAL)
    expected = seed_int16(single_decode(SEMANTIC, GLOBAL))
    assert np.abs(np.frombuffer(audio_bytes, "<i2").astype(np.int32) - expected).max() <= 1
    assert stats["total_requests"] >= 1


def test_the_drop_in_takes_spark_tts_shapes_and_refuses_a_batch_saying_how(thread_server, shm_name):
    import torch

    thread_server()
    # Spark-TTS's shapes: (1, T) and (1, 1, 32).
    semantic, global_ = torch.as_tensor(SEMANTIC)[None], torch.as_tensor(GLOBAL)[None, None]
    batch_decoder = BiCodecBatchDecoder(shm_name)
    batch_decoder.start()
    try:
        audio_bytes = asyncio.run(batch_decoder.decode_async(semantic, global_))
        with pytest.raises(ValueError, match=r"a batch of 2 rows; send each row as its own request"):
            asyncio.run(batch_decoder.decode_async(semantic.repeat(2, 1), global_))
    finally:
        batch_decoder.stop()
    expected = seed_int16(single_decode(SEMANTIC, GLOBAL))
    assert np.abs(np.frombuffer(audio_bytes, "<i2").astype(np.int32) - expected).max() <= 1


def test_concurrent_coroutines_share_batches_and_bad_input_fails_alone():
    batch_decoder = BiCodecBatchDecoder(reference_model(), max_batch=8, timeout_ms=5)
    batch_decoder.start()
    try:
        async def main():
            good = [batch_decoder.decode_async(SEMANTIC[: 5 + i], GLOBAL) for i in range(8)]
            bad = batch_decoder.decode_async(SEMANTIC, GLOBAL[:31])  # the seed's batch killer
            return await asyncio.gather(*good, bad, return_exceptions=True)

        results = asyncio.run(main())
        assert isinstance(results[-1], ValueError) and "exactly 32" in str(results[-1])
        for i, audio in enumerate(results[:-1]):
            expected = seed_int16(single_decode(SEMANTIC[: 5 + i], GLOBAL))
            assert np.abs(np.frombuffer(audio, "<i2").astype(np.int32) - expected).max() <= 1
        assert batch_decoder.get_stats()["avg_batch_size"] > 1
    finally:
        batch_decoder.stop()


def test_decode_before_start_is_a_clear_error():
    from bicodec_shm.errors import BiCodecShmError

    with pytest.raises(BiCodecShmError, match="start"):
        asyncio.run(BiCodecBatchDecoder("unused-name").decode_async([1], GLOBAL))
