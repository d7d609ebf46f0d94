"""Latency at light load: a few clients that each take tens of milliseconds between requests
(a language model's step), served with the server's dispatch choices and without any waiting.

With so few clients, and clients this slow to come back, nothing is gained by holding a ready
request back for the clients just answered: the batch cannot grow. A server that waits anyway
adds its whole wait window to every request's latency. This script measures that: the mean
submit-to-answer latency each client sees, and the server's own counters (its deliberate
waits, its host gap), for each ``--dispatch`` mode against ``rejoin_ms=0`` (never waiting).

Two lanes, each served by a server in this process (a thread), fed by client processes:

- ``cpu``: the tiny BiCodec model on the CPU, one sequential lane;
- ``pipelined``: the modern stand-in (4 ms + 0.006 ms a padded token, launched
  asynchronously), a pipelined lane, as on a GPU.

Usage::

    python benchmarks/bench_light_load.py                     # both lanes, 2 clients, 30-45 ms
    python benchmarks/bench_light_load.py --lanes pipelined --clients 2 --think 30,45 --requests 80

Prints one row per lane and mode; ``--json PATH`` writes them too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = {"auto": dict(dispatch="auto"), "pipeline": dict(dispatch="pipeline"),
         "never wait": dict(rejoin_ms=0.0)}  # fmt: skip


def client_main(name: str, tokens: int, think_lo: float, think_hi: float, requests: int, seed: int) -> None:
    """One client process: ``requests`` decodes of ``tokens`` tokens, each after a think time
    drawn from [think_lo, think_hi] ms; prints its latencies (ms) as one JSON line."""
    from bicodec_shm.client.decoder_client import DecoderClient

    rng = np.random.default_rng(seed)
    latencies = []
    with DecoderClient(name, connect_timeout=30, timeout=30) as client:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        for _ in range(requests):
            time.sleep(rng.uniform(think_lo, think_hi) / 1000)
            sem, glb = rng.integers(0, 8192, tokens), rng.integers(0, 4096, 32)
            t0 = time.perf_counter()
            client.decode(sem, glb)
            latencies.append((time.perf_counter() - t0) * 1000)
    print(json.dumps(latencies), flush=True)


def _decoder(lane: str):
    if lane == "pipelined":
        from bicodec_shm.tools.bench.standin import StandInDecoder

        return StandInDecoder(a_ms=4.0, b_ms=0.006, asynchronous=True)
    import torch

    from bicodec_shm.model import BiCodecDecoder

    torch.set_num_threads(1)
    return BiCodecDecoder.from_config("tiny", seed=0)


def run(lane: str, mode: str, args: argparse.Namespace) -> dict:
    from bicodec_shm.server.server import DecoderServer

    name = f"bicodec_light_{uuid.uuid4().hex[:8]}"
    server = DecoderServer(_decoder(lane), name, lanes=1, **MODES[mode])
    thread = server.start_thread()
    lo, hi = args.think
    procs = [subprocess.Popen([sys.executable, __file__, "--client", name, str(args.tokens), str(lo), str(hi),
                               str(args.requests), str(1000 + i)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(args.clients)]  # fmt: skip
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        latencies = []
        for p in procs:
            out = json.loads(p.stdout.readline())
            latencies.extend(out[args.warmup :])  # the policy measures the first ones
        h = server.segment.header
        row = {"lane": lane, "mode": mode, "requests": len(latencies),
               "mean_ms": statistics.fmean(latencies), "median_ms": statistics.median(latencies),
               "server_avg_latency_ms": int(h["latency_ns"]) / 1e6 / max(1, int(h["requests"])),
               "host_gap_ms": int(h["host_gap_ns"]) / 1e6}  # fmt: skip
        if "waited_ns" in h.dtype.names:
            row["waited_ms"] = int(h["waited_ns"]) / 1e6
        return row
    finally:
        for p in procs:
            p.stdin.close()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        server.stop()
        thread.join(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lanes", default="cpu,pipelined", help="cpu, pipelined or both (default both)")
    p.add_argument("--modes", default=",".join(MODES), help="auto, pipeline, never wait (default all)")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--think", type=lambda s: tuple(map(float, s.split(","))), default=(30.0, 45.0),
                   metavar="LO_MS,HI_MS", help="each client's time between requests (default 30,45)")
    p.add_argument("--tokens", type=int, default=50)
    p.add_argument("--requests", type=int, default=80, help="per client (default 80)")
    p.add_argument("--warmup", type=int, default=15, help="first requests per client left out (default 15)")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    rows = []
    for lane in args.lanes.split(","):
        for mode in args.modes.split(","):
            row = run(lane, mode, args)
            rows.append(row)
            extra = f", waited {row['waited_ms']:.0f} ms" if "waited_ms" in row else ""
            print(f"{lane:9s} {mode:10s}: mean {row['mean_ms']:.2f} ms, median {row['median_ms']:.2f} ms "
                  f"({row['requests']} requests; server: avg {row['server_avg_latency_ms']:.2f} ms, "
                  f"host gap {row['host_gap_ms']:.0f} ms{extra})", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        a = sys.argv[2:]
        client_main(a[0], int(a[1]), float(a[2]), float(a[3]), int(a[4]), int(a[5]))
    else:
        main()
