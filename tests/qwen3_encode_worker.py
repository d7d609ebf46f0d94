"""A client process for the Qwen3-TTS encode tests: encode seeded 24 kHz clips through a server,
all at once, decode each clip's codes back, and save what came back.

Usage: python qwen3_encode_worker.py NAME SEED N_CLIPS OUT.npz

Clip i is ``qwen3_clip(SEED, i)`` (support.py). Writes ``codes_i`` ((16, frames) int32, one row
per level) and ``pcm_i`` (``decode_codes`` of those codes as they came back). Exits 0 on success.
Imports no torch, as a real TTS worker's client side would not.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
from support import qwen3_clip

from bicodec_shm.client.decoder_client import DecoderClient


async def run(client: DecoderClient, seed: int, n: int):
    calls = [client.encode_async(qwen3_clip(seed, i), sample_rate=24000) for i in range(n)]
    return await asyncio.gather(*calls)


def main() -> int:
    name, seed, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    arrays = {}
    with DecoderClient(name, slots=4, connect_timeout=60, timeout=120) as client:
        for i, result in enumerate(asyncio.run(run(client, seed, n))):
            arrays[f"codes_{i}"] = np.stack(result.codes)
            assert result.global_ids is None and result.frames == arrays[f"codes_{i}"].shape[1]
            arrays[f"pcm_{i}"] = client.decode_codes(result.codes, dtype="float32")
    np.savez(out, **arrays)
    assert "torch" not in sys.modules, "a client process imported torch"
    return 0


if __name__ == "__main__":
    sys.exit(main())
