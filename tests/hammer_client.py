"""A client process that decodes random requests forever (sync and asyncio at once), until the
test SIGKILLs it at a random moment. Prints "ready" once attached."""

from __future__ import annotations

import asyncio
import sys
import threading

import numpy as np

from bicodec_shm.client.decoder_client import DecoderClient


def main(name: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    client = DecoderClient(name, slots=2, connect_timeout=30)
    print("ready", flush=True)

    def sync_loop():
        r = np.random.default_rng(seed + 1)
        while True:
            client.decode(r.integers(0, 8192, int(r.integers(1, 80))), r.integers(0, 4096, 32))

    threading.Thread(target=sync_loop, daemon=True).start()

    async def async_loop():
        while True:
            reqs = [(rng.integers(0, 8192, int(rng.integers(1, 80))), rng.integers(0, 4096, 32))
                    for _ in range(3)]  # fmt: skip
            await asyncio.gather(*(client.decode_async(s, g) for s, g in reqs))

    asyncio.run(async_loop())


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
