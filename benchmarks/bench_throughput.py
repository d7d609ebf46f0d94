"""Decode throughput of bicodec-shm against a decoder in every process, a Queue server, and
the limit (bicodec-shm's own batches run on the model with no IPC).

N client processes (default 1, 2, 4, 8, 16) send requests one after another for a fixed window
(default 60 s per system and N, 3 repeats), lengths drawn from a mix of streaming chunks
(25-50 tokens) and utterances (100-300 tokens); only requests completed inside the window
count. Reported per system and N as median (min-max) over the repeats: audio seconds per wall
second, requests per second, p50/p99 latency, CPU seconds per audio second, average batch size
and peak summed RSS, with ratios (computed per repeat) against the limit, the per-process
decoders and the Queue server. ``--model stand-in`` swaps the model for a device-shaped
stand-in (a sleep of a + b·rows·longest ms per batch) and adds the ideal batcher; ``--lanes``
and ``--server-arg`` pass options to the server; ``--sweep`` tunes ``max_wait_ms`` x
``max_batch_tokens`` instead.

The implementation is the package ``bicodec_shm/tools/bench/`` (also ``bicodec-shm bench``), so that
it works from a fresh install without this folder; this script only puts its outputs in
benchmarks/out/.

    python benchmarks/bench_throughput.py            # full size model, ~1.5 h on 2 cores
    python benchmarks/bench_throughput.py --quick    # tiny model, N = 1, 2, 2 s windows (< 1 min)
    python benchmarks/bench_throughput.py --model stand-in --n 1,4,16 --window 10 --repeats 1
    python benchmarks/bench_throughput.py --n 8 --lanes 1,2      # a server option, swept
    python benchmarks/bench_throughput.py --sweep --window 20    # batching policy grid at N = 8
"""

from __future__ import annotations

import os
import sys

from bicodec_shm.tools.bench import main

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")

if __name__ == "__main__":
    sys.exit(main(prog="bench_throughput.py", out_dir=OUT_DIR))
