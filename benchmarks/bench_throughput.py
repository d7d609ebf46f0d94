"""Decode throughput of bicodec-shm against a decoder in every process, a Queue server, and
the limit (bicodec-shm's own batches run on the model with no IPC).

N client processes (default 1, 2, 4, 8, 16) each send M requests one after another, lengths
drawn from a mix of streaming chunks (25-50 tokens) and utterances (100-300 tokens). Reported
per system and N: audio seconds per wall second, requests per second, p50/p99 latency, average
batch size and peak summed RSS, with ratios against the limit and the per-process decoders.
``--sweep`` tunes ``max_wait_ms`` x ``max_batch_tokens`` instead.

The implementation is the package ``bicodec_shm/bench/`` (also ``bicodec-shm bench``), so that it works
from a fresh install without this folder; this script only puts its outputs in benchmarks/out/.

    python benchmarks/bench_throughput.py            # full size model, ~20-25 min on 2 cores
    python benchmarks/bench_throughput.py --quick    # tiny model, N = 1, 2 (< 2 min)
    python benchmarks/bench_throughput.py --sweep    # batching policy grid at N = 8
"""

from __future__ import annotations

import os
import sys

from bicodec_shm.bench import main

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")

if __name__ == "__main__":
    sys.exit(main(prog="bench_throughput.py", out_dir=OUT_DIR))
