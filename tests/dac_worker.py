"""A client process for multi-process tests of a codec whose codebooks have one code per frame each
(DAC, Qwen3-TTS's 12 Hz tokenizer): decode random codebook codes, save them with results.

Usage: python dac_worker.py NAME SEED N_REQUESTS OUT.npz [--dtype D] [--concurrent N] [--max-frames T]
       [--min-frames T] [--dia]

Request ``j``'s codes are saved as ``codes_j`` ((n_codebooks, frames), sent as one 2-D array)
and its PCM as ``pcm_j``. With ``--dia`` every other request goes out as Dia's delayed tokens
(``decode_dia_async``). Imports no torch, as a real TTS worker would not.
"""

from __future__ import annotations

import sys

import numpy as np
from support import client_worker_arguments, run_limited

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.codecs import codes_to_dia


def main() -> int:
    p = client_worker_arguments(__doc__, dtype="float32", concurrent=2)
    p.add_argument("--max-frames", type=int, default=9)
    p.add_argument("--min-frames", type=int, default=1)
    p.add_argument("--dia", action="store_true")
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    with DecoderClient(args.name, slots=args.concurrent, connect_timeout=60, timeout=120) as client:
        layout = client.codec
        frames = rng.integers(args.min_frames, args.max_frames + 1, args.n)
        reqs = [rng.integers(0, layout.level_vocab[0], (layout.n_levels, int(n))) for n in frames]

        def call(j: int):
            if args.dia and j % 2:
                return client.decode_dia_async(codes_to_dia(reqs[j]), dtype=args.dtype)
            return client.decode_codes_async(reqs[j], dtype=args.dtype)

        pcms = run_limited([lambda j=j: call(j) for j in range(args.n)], args.concurrent)
    out = {f"pcm_{j}": pcm for j, pcm in enumerate(pcms)}
    out.update({f"codes_{j}": codes for j, codes in enumerate(reqs)})
    np.savez(args.out, **out)
    return 0 if "torch" not in sys.modules else 3


if __name__ == "__main__":
    sys.exit(main())
