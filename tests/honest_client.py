"""A well-behaved client process for the hostile-client tests: it attaches, says so, waits for
the test's go, then decodes its requests and saves them with their answers and times.

Usage: python honest_client.py NAME SEED N_REQUESTS OUT.npz [--timeout S] [--max-len T]

Prints "attached" once its handle decoded a first request (so that it attached before anything
hostile starts), then reads one line from stdin (the go), then decodes N_REQUESTS requests one
after another (each must come within --timeout seconds: a DecodeTimeoutError exits non-zero),
writes ``sem_i``, ``glb_i``, ``pcm_i`` and ``seconds_i`` to OUT.npz and exits 0. Imports no torch.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bicodec_shm.client.decoder_client import DecoderClient


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("name")
    p.add_argument("seed", type=int)
    p.add_argument("n", type=int)
    p.add_argument("out")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds each request may take")
    p.add_argument("--max-len", type=int, default=40)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    reqs = [(rng.integers(0, 8192, int(rng.integers(5, args.max_len + 1))), rng.integers(0, 4096, 32))
            for _ in range(args.n)]  # fmt: skip
    arrays = {}
    with DecoderClient(args.name, slots=1, connect_timeout=60, timeout=args.timeout) as client:
        client.decode(*reqs[0], dtype="float32")
        print("attached", flush=True)
        sys.stdin.readline()
        for i, (sem, glb) in enumerate(reqs):
            t0 = time.monotonic()
            arrays[f"pcm_{i}"] = client.decode(sem, glb, dtype="float32")
            arrays[f"seconds_{i}"] = np.float64(time.monotonic() - t0)
            arrays[f"sem_{i}"], arrays[f"glb_{i}"] = sem, glb
    np.savez(args.out, **arrays)
    assert "torch" not in sys.modules, "a client process imported torch"
    return 0


if __name__ == "__main__":
    sys.exit(main())
