"""A client process for multi-process tests: decode random requests, save them with results.

Usage: python decode_worker.py NAME SEED N_REQUESTS OUT.npz [--concurrent N] [--slots K] [--max-len T]

Writes every request's tokens and PCM to OUT.npz (as ``sem_i``, ``glb_i``, ``pcm_i``) and exits
0 on success. Imports no torch, as a real TTS worker would not.
"""

from __future__ import annotations

import sys

import numpy as np
from support import client_worker_arguments, run_limited

from bicodec_shm.client.decoder_client import DecoderClient


def main() -> int:
    p = client_worker_arguments(__doc__, dtype="int16", concurrent=1)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--max-len", type=int, default=60, help="longest request in tokens")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    lo = min(5, args.max_len)
    reqs = [(rng.integers(0, 8192, int(rng.integers(lo, args.max_len + 1))), rng.integers(0, 4096, 32))
            for _ in range(args.n)]  # fmt: skip
    with DecoderClient(args.name, slots=args.slots, connect_timeout=60, timeout=args.timeout) as client:
        if args.concurrent > 1:
            calls = [lambda s=s, g=g: client.decode_async(s, g, dtype=args.dtype) for s, g in reqs]
            results = run_limited(calls, args.concurrent)
        else:
            results = [client.decode(s, g, dtype=args.dtype) for s, g in reqs]
    arrays = {}
    for i, ((s, g), pcm) in enumerate(zip(reqs, results)):
        arrays[f"sem_{i}"], arrays[f"glb_{i}"], arrays[f"pcm_{i}"] = s, g, pcm
    np.savez(args.out, **arrays)
    assert "torch" not in sys.modules, "a client process imported torch"
    return 0


if __name__ == "__main__":
    sys.exit(main())
