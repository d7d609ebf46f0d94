"""A worker that uses an asyncio handle (so its waiter thread runs), forks, and holds on.

Usage: python fork_and_hold.py NAME

Prints "<slots owned> <child pid>" once the child exists, then sleeps until killed. The child
(which inherited the handle with a thread running in the parent at fork time) sleeps too.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import warnings

from bicodec_shm.client.decoder_client import DecoderClient

if __name__ == "__main__":
    client = DecoderClient(sys.argv[1], slots=4)

    async def two():
        await asyncio.gather(*(client.decode_async([5] * 20, list(range(32))) for _ in range(2)))

    asyncio.run(two())
    assert client._att.waiter is not None and client._att.waiter.is_alive()
    # Two requests about to be written hold their slots (an idle handle holds none) at the fork.
    held = [client._att.take_slot(time.monotonic() + 10) for _ in range(2)]
    assert len(held) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads: the point here
        child = os.fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(len(client._att.owned), child, flush=True)
    time.sleep(120)
