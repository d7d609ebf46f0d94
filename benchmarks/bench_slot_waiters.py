"""Many more requests than slots on one handle: how long each waits, and how many time out.

    python benchmarks/bench_slot_waiters.py --mode asyncio --workers 512
    python benchmarks/bench_slot_waiters.py --mode threads --workers 192

One ``DecoderClient`` with ``slots=8`` (what every stream of a process shares through
``orpheus_tts.shared_client``), ``--workers`` coroutines or threads on it, each decoding back to
back for ``--duration`` seconds with a ``--timeout`` per request. The server runs in a thread of
this process with a paced decoder (silence after ``--pace-ms`` per batch), so the handle's own
waiting, not a model, decides who is served when. Prints the requests, their mean and slowest
latency, the slowest over the mean, and the timeouts.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import threading
import time

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import DecodeTimeoutError
from bicodec_shm.protocol.layout import HOP

GLB = [0] * 32


class PacedDecoder:
    """Silence, after ``pace`` seconds per batch: (B, T) ids -> (B, HOP·T) zeros."""

    def __init__(self, pace: float) -> None:
        import torch

        self.torch, self.pace = torch, pace
        self.device = torch.device("cpu")

    def detokenize(self, semantic_ids, global_ids, lengths):
        time.sleep(self.pace)
        return self.torch.zeros(semantic_ids.shape[0], HOP * semantic_ids.shape[1])


def closed_loop(client: DecoderClient, mode: str, workers: int, duration: float,
                timeout: float) -> tuple[list[float], int]:  # fmt: skip
    """Each worker decodes back to back until ``duration`` is up: (latencies, timeouts)."""
    latencies: list[float] = []
    timeouts = [0]
    end = time.monotonic() + duration

    def one(t0: float, call) -> None:
        try:
            call()
        except DecodeTimeoutError:
            timeouts[0] += 1
        latencies.append(time.monotonic() - t0)

    if mode == "asyncio":

        async def worker() -> None:
            while time.monotonic() < end:
                t0 = time.monotonic()
                try:
                    await client.decode_async([1, 2], GLB, timeout=timeout)
                except DecodeTimeoutError:
                    timeouts[0] += 1
                latencies.append(time.monotonic() - t0)

        async def main() -> None:
            await asyncio.gather(*(worker() for _ in range(workers)))

        asyncio.run(main())
    else:

        def worker() -> None:
            while time.monotonic() < end:
                one(time.monotonic(), lambda: client.decode([1, 2], GLB, timeout=timeout))

        threads = [threading.Thread(target=worker) for _ in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return latencies, timeouts[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("asyncio", "threads"), default="asyncio")
    parser.add_argument("--workers", type=int, default=512)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--pace-ms", type=float, default=10.0)
    args = parser.parse_args()
    from bicodec_shm.server.server import DecoderServer

    name = f"bcshm-bench-{secrets.token_hex(4)}"
    server = DecoderServer(PacedDecoder(args.pace_ms / 1000), name, max_batch=args.slots)
    thread = server.start_thread()
    try:
        with DecoderClient(name, slots=args.slots, timeout=args.timeout) as client:
            latencies, timeouts = closed_loop(client, args.mode, args.workers, args.duration, args.timeout)
    finally:
        server.stop()
        thread.join(20)
    mean = statistics.fmean(latencies)
    print(f"{args.mode}: {args.workers} workers on one {args.slots}-slot handle, timeout "
          f"{args.timeout:g} s, {args.pace_ms:g} ms a batch: {len(latencies)} requests, mean "
          f"{mean:.3f} s, slowest {max(latencies):.3f} s ({max(latencies) / mean:.1f}x the mean), "
          f"{timeouts} timeouts")  # fmt: skip


if __name__ == "__main__":
    main()
