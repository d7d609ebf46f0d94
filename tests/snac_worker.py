"""A SNAC client process for multi-process tests: decode random code levels, save them with results.

Usage: python snac_worker.py NAME SEED N_REQUESTS OUT.npz [--dtype D] [--concurrent N] [--max-frames T]

Level ``i`` of request ``j`` is saved as ``lvl_j_i``, its seed as ``seed_j`` and its PCM as
``pcm_j``. Each request gets its own noise seed (``SEED·1000 + j``), and every third asks for
no noise. Imports no torch, as a real TTS worker would not.
"""

from __future__ import annotations

import sys

import numpy as np
from support import client_worker_arguments, run_limited

from bicodec_shm.client.decoder_client import DecoderClient


def main() -> int:
    p = client_worker_arguments(__doc__, dtype="float32", concurrent=2)
    p.add_argument("--max-frames", type=int, default=9)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    with DecoderClient(args.name, slots=args.concurrent, connect_timeout=60, timeout=120) as client:
        rates, vocab = client.codec.level_rates, client.codec.level_vocab
        reqs = []
        for _ in range(args.n):
            frames = int(rng.integers(1, args.max_frames + 1))
            reqs.append([rng.integers(0, v, frames * r) for r, v in zip(rates, vocab)])
        seeds = [args.seed * 1000 + j for j in range(args.n)]
        calls = [lambda j=j: client.decode_codes_async(reqs[j], noise_seed=seeds[j], noise=j % 3 != 2,
                                                       dtype=args.dtype)
                 for j in range(args.n)]  # fmt: skip
        pcms = run_limited(calls, args.concurrent)
    out = {f"pcm_{j}": pcm for j, pcm in enumerate(pcms)}
    for j, levels in enumerate(reqs):
        out.update({f"lvl_{j}_{i}": level for i, level in enumerate(levels)})
        out[f"seed_{j}"] = np.array(seeds[j])
    np.savez(args.out, **out)
    return 0 if "torch" not in sys.modules else 3


if __name__ == "__main__":
    sys.exit(main())
