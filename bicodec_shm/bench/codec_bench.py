"""``bicodec-shm bench --codec snac-...``: throughput of a code-level codec through the shared server.

Three systems on the same requests, each a fresh set of processes (spawned, so no torch state is
shared), counting audio seconds decoded per wall second:

- ``bicodec-shm``: one ``DecoderServer`` process (all the cores) and N torch-free client
  processes that send their requests one after another with ``decode_codes``;
- ``per-process``: N processes, each with its own decoder (cores / N threads each): what a
  worker pool does without a shared decoder;
- ``limit``: the server's batches without IPC: one process decodes the same requests in
  batches of N rows (mixed lengths, masked), the ceiling for the shared server.

Requests: every client draws ``--requests`` lengths in frames from ``--frames LO-HI`` and random
codes; the noise seed is the request's index. Short windows on purpose: a loaded CPU.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from ..codecs.layout import get_layout
from ..transport import random_name, unlink_all


def requests_of(codec: str, index: int, count: int, frames: tuple[int, int], seed: int) -> list[list[np.ndarray]]:
    """Client ``index``'s requests: per level (n·rate,) int64 codes, n in ``frames``."""
    layout = get_layout(codec)
    rng = np.random.default_rng([seed, index])
    out = []
    for _ in range(count):
        n = int(rng.integers(frames[0], frames[1] + 1))
        out.append([rng.integers(0, v, n * r) for r, v in zip(layout.level_rates, layout.level_vocab)])
    return out


def _model(preset: str, threads: int):
    import torch

    from ..model.snac import SNACDecoder

    torch.set_num_threads(threads)
    model = SNACDecoder.from_config(preset, seed=0)
    rates = model.config.level_rates
    model.detokenize([torch.zeros(2, 4 * r, dtype=torch.long) for r in rates], torch.tensor([4, 3]))
    return model


def _server(name: str, preset: str, threads: int, max_batch: int, ready: Any) -> None:
    from ..server import DecoderServer

    server = DecoderServer(_model(preset, threads), name, slots=64, max_batch=max_batch,
                           max_tokens=512, lanes=1, min_fill=0.0, max_batch_tokens=None)  # fmt: skip
    ready.set()
    server.serve_forever()


def _client(name: str, reqs: list, start: Any, out: Any) -> None:
    from ..client import DecoderClient

    with DecoderClient(name, connect_timeout=120, timeout=600) as client:
        out.put("ready")
        start.wait()
        for k, levels in enumerate(reqs):
            client.decode_codes(levels, noise_seed=k)
    out.put(time.perf_counter())


def _own(preset: str, threads: int, reqs: list, start: Any, out: Any) -> None:
    import torch

    model = _model(preset, threads)
    out.put(("ready", 0.0))
    start.wait()
    for k, levels in enumerate(reqs):
        model.detokenize([torch.from_numpy(c)[None] for c in levels], noise_seeds=[k])
    out.put(("done", time.perf_counter()))


def bench_shm(ctx: Any, codec: str, preset: str, all_reqs: list, cores: int) -> float:
    name = random_name("bench-snac")
    ready, start, out = ctx.Event(), ctx.Event(), ctx.Queue()
    server = ctx.Process(target=_server, args=(name, preset, cores, len(all_reqs), ready), daemon=True)
    server.start()
    try:
        if not ready.wait(600):
            raise RuntimeError("the server did not start")
        clients = [ctx.Process(target=_client, args=(name, reqs, start, out), daemon=True) for reqs in all_reqs]
        for c in clients:
            c.start()
        for _ in clients:
            assert out.get(timeout=600) == "ready"
        t0 = time.perf_counter()
        start.set()
        ends = [out.get(timeout=1800) for _ in clients]
        for c in clients:
            c.join(30)
        return max(ends) - t0
    finally:
        server.terminate()
        server.join(30)
        unlink_all(name)


def bench_per_process(ctx: Any, preset: str, all_reqs: list, cores: int) -> float:
    start, out = ctx.Event(), ctx.Queue()
    threads = max(1, cores // len(all_reqs))
    procs = [ctx.Process(target=_own, args=(preset, threads, reqs, start, out), daemon=True) for reqs in all_reqs]
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get(timeout=600)[0] == "ready"
    t0 = time.perf_counter()
    start.set()
    ends = [out.get(timeout=1800)[1] for _ in procs]
    for p in procs:
        p.join(30)
    return max(ends) - t0


def _limit(preset: str, threads: int, all_reqs: list, out: Any) -> None:
    import torch

    model = _model(preset, threads)
    rounds = [[reqs[k] for reqs in all_reqs] for k in range(len(all_reqs[0]))]  # N rows each
    t0 = time.perf_counter()
    for rows in rounds:
        lengths = [len(r[0]) for r in rows]
        t = max(lengths)
        codes = []
        for i, rate in enumerate(model.config.level_rates):
            level = np.zeros((len(rows), t * rate), np.int64)
            for j, r in enumerate(rows):
                level[j, : len(r[i])] = r[i]
            codes.append(torch.from_numpy(level))
        model.detokenize(codes, torch.tensor(lengths), noise_seeds=list(range(len(rows))))
    out.put(time.perf_counter() - t0)


def bench_limit(ctx: Any, preset: str, all_reqs: list, cores: int) -> float:
    out = ctx.Queue()
    p = ctx.Process(target=_limit, args=(preset, cores, all_reqs, out), daemon=True)
    p.start()
    elapsed = out.get(timeout=1800)
    p.join(30)
    return elapsed


def run_codec_bench(args: argparse.Namespace) -> int:
    codec = args.codec
    layout = get_layout(codec)
    preset = args.preset or codec  # full size unless --model tiny-...
    lo, hi = (int(v) for v in args.frames.split("-"))
    ns = args.n or [4, 8]
    cores = args.cores or len(os.sched_getaffinity(0))  # threads of the server and the limit
    count = args.requests or 4
    ctx = mp.get_context("spawn")
    print(f"bench --codec {codec}: model {preset} (random weights), {cores} cores, {count} requests "
          f"per client of {lo}-{hi} frames ({lo * layout.samples_per_frame / layout.sample_rate:.2f}-"
          f"{hi * layout.samples_per_frame / layout.sample_rate:.2f} s), load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)  # fmt: skip
    print(f"{'N':>3}  {'system':<12} {'wall s':>8} {'audio s/s':>10}", flush=True)
    systems = [s for s in args.systems.split(",") if s in ("shm", "per-process", "limit")] or ["shm", "per-process", "limit"]
    for n in ns:
        all_reqs = [requests_of(codec, i, count, (lo, hi), args.seed) for i in range(n)]
        audio_s = sum(len(r[0]) for reqs in all_reqs for r in reqs) * layout.samples_per_frame / layout.sample_rate
        for system in systems:
            if system == "shm":
                wall = bench_shm(ctx, codec, preset, all_reqs, cores)
            elif system == "per-process":
                wall = bench_per_process(ctx, preset, all_reqs, cores)
            else:
                wall = bench_limit(ctx, preset, all_reqs, cores)
            name = {"shm": "bicodec-shm"}.get(system, system)
            print(f"{n:>3}  {name:<12} {wall:>8.2f} {audio_s / wall:>10.2f}", flush=True)
    return 0
