"""A client process for the encode tests: encode seeded clips (and decode one request) through a
server, and save what came back.

Usage: python encode_worker.py NAME SEED N_CLIPS OUT.npz

Clip i is ``encode_clip(SEED, i)`` (support.py): 16 kHz noise 0.4 to 1 s long.
Writes ``sem_i``/``glb_i`` for every clip, and ``pcm`` for one decode of ``seeded_request(SEED,
30)``, sent while the encodes are in flight (asyncio, all at once). Exits 0 on success. Imports
no torch, as a real TTS worker would not.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
from support import encode_clip, seeded_request

from bicodec_shm.client.decoder_client import DecoderClient


async def run(client: DecoderClient, seed: int, n: int):
    sem, glb = seeded_request(seed, 30)
    encodes = [client.encode_async(encode_clip(seed, i), sample_rate=16000) for i in range(n)]
    return await asyncio.gather(client.decode_async(sem, glb), *encodes)


def main() -> int:
    name, seed, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    with DecoderClient(name, slots=4, connect_timeout=60, timeout=120) as client:
        pcm, *encoded = asyncio.run(run(client, seed, n))
    arrays = {"pcm": pcm}
    for i, result in enumerate(encoded):
        arrays[f"sem_{i}"], arrays[f"glb_{i}"] = result.semantic_ids, result.global_ids
    np.savez(out, **arrays)
    assert "torch" not in sys.modules, "a client process imported torch"
    return 0


if __name__ == "__main__":
    sys.exit(main())
