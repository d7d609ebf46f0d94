"""What a worker holds and waits for when it encodes voice-clone prompts: a BiCodec tokenizer of
its own, against a client of one shared ``bicodec-shm serve --encode``.

A Spark-TTS worker builds a ``BiCodecTokenizer``: BiCodec's encoder, quantizer, speaker encoder
and decoder, and wav2vec2-large-xlsr-53. Here each of N worker processes either builds the same
networks (``own``: ``BiCodecEncoder`` and ``BiCodecDecoder`` at the preset's size, random
weights) and encodes with them, or holds only a ``DecoderClient`` (``shared``: numpy and
posix_ipc, no torch) of one server started for the run. Every worker encodes ``--clips`` clips of
``--seconds`` seconds one after another, all workers at once. Per mode and N the table gives a
worker's resident memory (mean over the workers, after its model is loaded and after its clips:
the peak), the server's, all of it together, encode latency (p50, p95) and clips per second.

    python benchmarks/bench_encode.py                           # full size, 1 4 16 workers
    python benchmarks/bench_encode.py --preset tiny --workers 1 4 --json encode.json

N own workers at full size need N times a tokenizer's memory: a count whose estimate (from the
largest count run so far) exceeds the memory available is skipped and says so. Progress goes to
stderr, one line per run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import secrets
import sys
import time

import numpy as np
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from examples.dropin_load import start_server, stop_server  # noqa: E402

SAMPLE_RATE = 16000
MIB = 2**20


def clip(index: int, seconds: float) -> np.ndarray:
    """A voice-clone prompt stand-in: ``seconds`` of seeded noise at 16 kHz, float32."""
    return np.random.default_rng(index).uniform(-0.5, 0.5, int(seconds * SAMPLE_RATE)).astype(np.float32)


def own_encoder(preset: str, threads: int):
    """What a Spark-TTS worker's ``BiCodecTokenizer`` holds: encoder and decoder."""
    import torch

    from bicodec_shm.model.bicodec.decoder import BiCodecDecoder
    from bicodec_shm.model.bicodec.tokenizer import BiCodecEncoder

    torch.set_num_threads(threads)
    encoder = BiCodecEncoder.from_config(preset, seed=0)
    decoder = BiCodecDecoder.from_config(preset, seed=0)
    return lambda audio: encoder.tokenize(audio[None]), decoder


def worker(index: int, settings: dict, barrier, results) -> None:
    try:
        if settings["mode"] == "own":
            encode, _decoder = own_encoder(settings["preset"], settings["threads"])
        else:
            from bicodec_shm import DecoderClient

            client = DecoderClient(settings["name"])
            encode = lambda audio: client.encode(audio, timeout=600)  # noqa: E731
        encode(clip(10_000 + index, 1.0))  # the first encode pays for allocation
        loaded = psutil.Process().memory_info().rss
        barrier.wait(900)
        latencies = []
        for k in range(settings["clips"]):
            audio = clip(index * 1000 + k, settings["seconds"])
            t0 = time.perf_counter()
            encode(audio)
            latencies.append(time.perf_counter() - t0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        results.put((index, {"loaded_rss": loaded, "peak_rss": peak, "latencies": latencies}))
    except BaseException as exc:  # reported to the parent, which fails the run
        results.put((index, f"{type(exc).__name__}: {exc}"))
        raise


def run(mode: str, workers: int, args: argparse.Namespace) -> dict:
    name = f"bcshm-bench-encode-{secrets.token_hex(6)}"
    server = None
    if mode == "shared":
        options = ["--encode", "--preset", args.preset, "--threads", str(os.cpu_count()),
                   "--slots", str(2 * workers + 8)]  # fmt: skip
        server = start_server(name, options)
    try:
        ctx = multiprocessing.get_context("spawn")
        barrier, results = ctx.Barrier(workers + 1), ctx.Queue()
        settings = {"mode": mode, "name": name, "preset": args.preset, "clips": args.clips,
                    "seconds": args.seconds, "threads": max(1, (os.cpu_count() or 1) // workers)}  # fmt: skip
        procs = [ctx.Process(target=worker, args=(i, settings, barrier, results), daemon=True)
                 for i in range(workers)]  # fmt: skip
        for p in procs:
            p.start()
        try:
            barrier.wait(900)
            start = time.perf_counter()
            got = []
            for _ in range(workers):
                index, r = results.get(timeout=1800)
                if isinstance(r, str):
                    raise RuntimeError(f"worker {index} failed: {r}")
                got.append(r)
            wall = time.perf_counter() - start
            server_rss = psutil.Process(server.pid).memory_info().rss if server is not None else 0
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    finally:
        if server is not None:
            stop_server(server)
    latencies = sorted(x for r in got for x in r["latencies"])
    worker_peak = float(np.mean([r["peak_rss"] for r in got]))
    return {
        "mode": mode, "workers": workers, "preset": args.preset,
        "worker_loaded_mib": float(np.mean([r["loaded_rss"] for r in got])) / MIB,
        "worker_peak_mib": worker_peak / MIB,
        "server_mib": server_rss / MIB,
        "total_mib": (workers * worker_peak + server_rss) / MIB,
        "latency_p50_ms": 1000 * latencies[len(latencies) // 2],
        "latency_p95_ms": 1000 * latencies[min(len(latencies) - 1, 95 * len(latencies) // 100)],
        "clips_per_s": len(latencies) / wall,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    head = (f"{'mode':<7} {'N':>3} {'worker MiB':>11} {'peak':>7} {'server MiB':>10} {'total MiB':>10} "
            f"{'vs own':>7} {'p50':>8} {'p95':>8} {'clips/s':>8} {'vs own':>7}")  # fmt: skip
    own = {r["workers"]: r for r in rows if r["mode"] == "own" and "skipped" not in r}
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['mode']:<7} {r['workers']:>3} skipped: {r['skipped']}")
            continue
        o = own.get(r["workers"]) if r["mode"] == "shared" else None
        mem_vs = f"{r['total_mib'] / o['total_mib']:.2f}x" if o else ""
        rate_vs = f"{r['clips_per_s'] / o['clips_per_s']:.2f}x" if o else ""
        lines.append(f"{r['mode']:<7} {r['workers']:>3} {r['worker_loaded_mib']:>11.0f} "
                     f"{r['worker_peak_mib']:>7.0f} {r['server_mib']:>10.0f} {r['total_mib']:>10.0f} "
                     f"{mem_vs:>7} {r['latency_p50_ms']:>6.0f}ms {r['latency_p95_ms']:>6.0f}ms "
                     f"{r['clips_per_s']:>8.2f} {rate_vs:>7}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="spark-tts-0.5b", choices=["spark-tts-0.5b", "tiny"])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--modes", nargs="+", choices=["own", "shared"], default=["own", "shared"])
    p.add_argument("--clips", type=int, default=2, help="clips per worker")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per clip")
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = p.parse_args(argv)
    rows: list[dict] = []
    t0 = time.perf_counter()
    per_own_worker = 0.0  # MiB, the largest own worker seen: the estimate for the next count
    for workers in args.workers:
        for mode in args.modes:
            need = workers * per_own_worker
            available = psutil.virtual_memory().available / MIB
            if mode == "own" and need > 0.8 * available:
                why = f"needs ~{need / 1024:.1f} GiB, {available / 1024:.1f} GiB available"
                rows.append({"mode": mode, "workers": workers, "preset": args.preset, "skipped": why})
                print(f"[{time.perf_counter() - t0:6.0f} s] {mode} x{workers}: skipped", file=sys.stderr)
                continue
            print(f"[{time.perf_counter() - t0:6.0f} s] {mode} x{workers} ...", file=sys.stderr, flush=True)
            rows.append(run(mode, workers, args))
            if mode == "own":
                per_own_worker = max(per_own_worker, rows[-1]["worker_peak_mib"])
    load = os.getloadavg()
    memory = psutil.virtual_memory().total / 2**30
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, {memory:.0f} GiB, load "
          f"{load[0]:.1f}; preset {args.preset}, {args.clips} clips of {args.seconds:g} s a worker")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
