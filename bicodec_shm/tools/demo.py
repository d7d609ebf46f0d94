"""``bicodec-shm demo``: one server process, N client processes, results checked locally.

The server runs in its own process (``python -m bicodec_shm serve``); the clients are spawned
processes that import no torch. Each client decodes random-length requests one after another,
as a TTS worker would, and reports each latency to this process, which shows a progress bar.
A sample of the results is then decoded again in this process, alone and unpadded, and
compared with what the server returned (int16: within 1 LSB).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from ..deploy.processes import serve_command, stop_server, wait_until_serving
from ..errors import BiCodecShmError
from ..protocol.header import read_header, stats_from_header
from ..protocol.layout import HOP, N_GLOBAL
from ..protocol.names import leftover_objects, random_name, unlink_all

SAMPLE_RATE = 16_000


@dataclass
class DemoSummary:
    clients: int
    requests: int
    failed: int
    audio_seconds: float
    wall_seconds: float
    audio_seconds_per_second: float
    requests_per_second: float
    avg_batch_size: float
    batch_size_histogram: dict
    latency_p50_ms: float
    latency_p99_ms: float
    checked: int
    max_lsb_error: int
    shm_left_behind: list


def make_request(rng: np.random.Generator, min_len: int, max_len: int) -> np.ndarray:
    """Random semantic ids of a random length in [min_len, max_len]."""
    n = int(rng.integers(min_len, max_len + 1))
    return rng.integers(0, 8192, n, dtype=np.int64)


def client_main(name: str, index: int, n_requests: int, min_len: int, max_len: int, seed: int,
                check: list[int], events: mp.Queue) -> None:  # fmt: skip
    """One TTS worker: decode ``n_requests`` random requests through the shared server."""
    from ..client.decoder_client import DecoderClient

    rng = np.random.default_rng([seed, index])
    speaker = rng.integers(0, 4096, N_GLOBAL, dtype=np.int64)
    try:
        with DecoderClient(name, connect_timeout=300, timeout=600) as client:
            for k in range(n_requests):
                semantic = make_request(rng, min_len, max_len)
                t0 = time.perf_counter()
                try:
                    pcm = client.decode(semantic, speaker)
                except BiCodecShmError as exc:
                    events.put(("failed", index, k, str(exc)))
                    continue
                latency = time.perf_counter() - t0
                sample = (semantic, speaker, pcm) if k in check else None
                events.put(("done", index, k, latency, len(semantic), sample))
    finally:
        events.put(("exit", index))


def run_demo(args: argparse.Namespace) -> int:
    name = random_name("bcshm-demo")
    server = _start_server(args, name)
    ctx = mp.get_context("spawn")  # clients must not inherit torch or the server's state
    events: mp.Queue = ctx.Queue()
    checks = _check_plan(args.clients, args.requests, args.check)
    clients = []
    latencies: list[float] = []
    samples: list[tuple] = []
    failed = 0
    tokens = 0
    try:
        wait_until_serving(name, server, timeout=600)
        t0 = time.perf_counter()
        for i in range(args.clients):
            client_args = (name, i, args.requests, args.min_len, args.max_len, args.seed, checks[i], events)
            p = ctx.Process(target=client_main, args=client_args)
            p.start()
            clients.append(p)
        total = args.clients * args.requests
        exited = 0
        with tqdm(total=total, desc="decoding", unit="req", file=sys.stderr) as bar:
            while exited < args.clients:
                event = events.get(timeout=900)
                if event[0] == "exit":
                    exited += 1
                elif event[0] == "failed":
                    failed += 1
                    bar.write(f"client {event[1]} request {event[2]} failed: {event[3]}")
                    bar.update()
                else:
                    _, _, _, latency, n_tokens, sample = event
                    latencies.append(latency)
                    tokens += n_tokens
                    if sample is not None:
                        samples.append(sample)
                    bar.update()
        wall = time.perf_counter() - t0
        for p in clients:
            p.join(timeout=30)
        header = read_header(name)
        stats = stats_from_header(header) if header is not None else {}
    finally:
        for p in clients:
            if p.is_alive():
                p.kill()
        _stop_server(server, name)
    max_err = _check_samples(args, samples)
    audio_s = tokens * HOP / SAMPLE_RATE
    lat_ms = np.array(latencies) * 1000 if latencies else np.zeros(1)
    summary = DemoSummary(
        clients=args.clients,
        requests=len(latencies) + failed,
        failed=failed,
        audio_seconds=round(audio_s, 2),
        wall_seconds=round(wall, 2),
        audio_seconds_per_second=round(audio_s / wall, 2),
        requests_per_second=round(len(latencies) / wall, 2),
        avg_batch_size=round(stats.get("avg_batch_size", 0.0), 2),
        batch_size_histogram=stats.get("batch_size_histogram", {}),
        latency_p50_ms=round(float(np.percentile(lat_ms, 50)), 1),
        latency_p99_ms=round(float(np.percentile(lat_ms, 99)), 1),
        checked=len(samples),
        max_lsb_error=max_err,
        shm_left_behind=leftover_objects(name),
    )
    _print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(summary), f, indent=2)
    ok = failed == 0 and max_err <= 1 and not summary.shm_left_behind
    return 0 if ok else 1


def _check_plan(clients: int, requests: int, check: int) -> list[list[int]]:
    """Which request indices each client sends back in full for verification."""
    plan: list[list[int]] = [[] for _ in range(clients)]
    for j in range(min(check, clients * requests)):
        plan[j % clients].append(j // clients)
    return plan


def _start_server(args: argparse.Namespace, name: str) -> subprocess.Popen:
    cmd = serve_command(name, "--preset", args.preset,
           "--seed", str(args.seed), "--device", args.device, "--slots", str(args.slots),
           "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms),
           "--rejoin-ms", str(args.rejoin_ms),
           "--max-batch-tokens", str(args.max_batch_tokens), "--min-fill", str(args.min_fill),
           "--max-tokens", str(args.max_tokens), "--log-level", args.log_level)  # fmt: skip
    if args.lanes:
        cmd += ["--lanes", str(args.lanes)]
    if args.model_dir:
        cmd += ["--model-dir", args.model_dir]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    print(f"starting server: {shlex.join(cmd)}", file=sys.stderr)  # runnable as printed
    return subprocess.Popen(cmd)


def _stop_server(server: subprocess.Popen, name: str) -> None:
    stop_server(server)
    if leftover_objects(name):  # only if the server could not clean up after itself
        unlink_all(name)


def _check_samples(args: argparse.Namespace, samples: list[tuple]) -> int:
    """Decode each sample alone in this process; return the largest int16 difference."""
    if not samples:
        return 0
    import torch

    from .model_args import load_decoder

    decoder = load_decoder(args, announce=False)
    worst = 0
    for semantic, speaker, pcm in samples:
        audio = decoder.detokenize(torch.as_tensor(semantic)[None], torch.as_tensor(speaker)[None])
        expected = (np.clip(audio[0].cpu().numpy(), -1, 1) * 32767).astype(np.int16)
        worst = max(worst, int(np.abs(expected.astype(np.int32) - pcm.astype(np.int32)).max()))
    return worst


def _print_summary(s: DemoSummary) -> None:
    rows = [
        ("client processes", s.clients),
        ("requests", f"{s.requests} ({s.failed} failed)"),
        ("audio decoded", f"{s.audio_seconds:.1f} s"),
        ("wall time", f"{s.wall_seconds:.1f} s"),
        ("throughput", f"{s.audio_seconds_per_second:.2f} audio s/s, {s.requests_per_second:.2f} req/s"),
        ("avg batch size", f"{s.avg_batch_size:.2f}  (sizes: "
         + " ".join(f"{b}x{n}" for b, n in s.batch_size_histogram.items()) + ")"),
        ("latency p50 / p99", f"{s.latency_p50_ms:.0f} ms / {s.latency_p99_ms:.0f} ms"),
        ("checked vs local decode", f"{s.checked} results, max error {s.max_lsb_error} LSB"),
        ("left in /dev/shm", ", ".join(s.shm_left_behind) or "nothing"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))

