"""What a worker holds and waits for when it encodes voice-clone prompts: a speech tokenizer of
its own, against a client of one shared ``bicodec-shm serve --encode``.

Two codecs (``--codec``, one or both):

- ``bicodec``: a Spark-TTS worker builds a ``BiCodecTokenizer``: BiCodec's encoder, quantizer,
  speaker encoder and decoder, and wav2vec2-large-xlsr-53. ``own`` builds ``BiCodecEncoder`` and
  ``BiCodecDecoder``; clips are 16 kHz.
- ``qwen3-tts-12hz``: a Qwen3-TTS worker (qwen-tts's ``Qwen3TTSModel``) holds a
  ``Qwen3TTSTokenizer``: the Mimi-based 12 Hz encoder and the decoder. ``own`` builds
  ``Qwen3TTSEncoder`` and ``Qwen3TTSDecoder``; clips are 24 kHz.

Each of N worker processes either builds its codec's networks (``own``: at the preset's size,
random weights) and encodes with them, or holds only a ``DecoderClient`` (``shared``: numpy and
posix_ipc, no torch) of one server started for the run with that codec and ``--encode``. Every
worker encodes ``--clips`` clips of ``--seconds`` seconds one after another, all workers at once.
Per codec, mode and N the table gives a worker's resident memory (mean over the workers, after its
model is loaded and after its clips: the peak), the server's, all of it together, encode latency
(p50, p95) and clips per second.

    python benchmarks/bench_encode.py                           # BiCodec, full size, 1 4 16 workers
    python benchmarks/bench_encode.py --codec qwen3-tts-12hz    # Qwen3-TTS's 12 Hz tokenizer
    python benchmarks/bench_encode.py --codec bicodec qwen3-tts-12hz --memory-gib 14
    python benchmarks/bench_encode.py --preset tiny --workers 1 4 --json encode.json

N own workers at full size need N times a tokenizer's memory: a count whose estimate (from that
codec's largest own worker run so far) exceeds the memory allowed (``--memory-gib``, default 0.8 of
what is available) is skipped and says so. Progress goes to stderr, one line per run. Under each
table, as ``bicodec-shm bench`` does, a row that rests on fewer than 20 encodes is flagged
``few`` (noise, not a result: its p95 is about its slowest encode, and one slow encode moves its
clips per second; not its memory) and a clip rate ratio with a flagged row is marked ``?``; the
JSON rows carry the flags.
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

from bicodec_shm.codecs.layout import LAYOUTS  # noqa: E402
from examples.dropin_load import start_server, stop_server  # noqa: E402

MIB = 2**20
CODECS = ("bicodec", "qwen3-tts-12hz")
# --preset -> each codec's model preset (the names serve --preset and from_config take).
PRESETS = {
    "full": {"bicodec": "spark-tts-0.5b", "qwen3-tts-12hz": "qwen3-tts-12hz"},
    "tiny": {"bicodec": "tiny", "qwen3-tts-12hz": "tiny-12hz"},
}
FEW_ENCODES = 20  # as bicodec-shm bench's MIN_REQUESTS: fewer, and one encode more or less moves a rate


def sample_rate(codec: str) -> int:
    """The rate the codec's encoder takes: BiCodec 16 kHz, Qwen3-TTS 12 Hz 24 kHz."""
    return LAYOUTS[codec].sample_rate


def clip(index: int, seconds: float, rate: int = 16000) -> np.ndarray:
    """A voice-clone prompt stand-in: ``seconds`` of seeded noise at ``rate`` Hz, float32."""
    return np.random.default_rng(index).uniform(-0.5, 0.5, int(seconds * rate)).astype(np.float32)


def own_encoder(codec: str, preset: str, threads: int):
    """What a worker's own tokenizer holds, encoder and decoder (random weights of ``preset``):
    Spark-TTS's ``BiCodecTokenizer`` or Qwen3-TTS's ``Qwen3TTSTokenizer``. Returns the encode
    call (one clip at the codec's rate) and the decoder, which the worker only holds."""
    import torch

    torch.set_num_threads(threads)
    if codec == "bicodec":
        from bicodec_shm.model.bicodec.decoder import BiCodecDecoder
        from bicodec_shm.model.bicodec.tokenizer import BiCodecEncoder

        encoder = BiCodecEncoder.from_config(preset, seed=0)
        decoder = BiCodecDecoder.from_config(preset, seed=0)
        return lambda audio: encoder.tokenize(audio[None]), decoder
    if codec == "qwen3-tts-12hz":
        from bicodec_shm.model.qwen3_tts.decoder import Qwen3TTSDecoder
        from bicodec_shm.model.qwen3_tts.encoder import Qwen3TTSEncoder

        encoder = Qwen3TTSEncoder.from_config(preset, seed=0)
        decoder = Qwen3TTSDecoder.from_config(preset, seed=0)
        return lambda audio: encoder.tokenize(audio[None], sample_rate=sample_rate(codec)), decoder
    raise ValueError(f"no own tokenizer for {codec}; the codecs here are {', '.join(CODECS)}")


def worker(index: int, settings: dict, barrier, results) -> None:
    rate = settings["rate"]
    try:
        if settings["mode"] == "own":
            encode, _decoder = own_encoder(settings["codec"], settings["preset"], settings["threads"])
        else:
            from bicodec_shm import DecoderClient

            client = DecoderClient(settings["name"])
            encode = lambda audio: client.encode(audio, sample_rate=rate, timeout=600)  # noqa: E731
        encode(clip(10_000 + index, 1.0, rate))  # the first encode pays for allocation
        loaded = psutil.Process().memory_info().rss
        barrier.wait(900)
        latencies = []
        for k in range(settings["clips"]):
            audio = clip(index * 1000 + k, settings["seconds"], rate)
            t0 = time.perf_counter()
            encode(audio)
            latencies.append(time.perf_counter() - t0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        results.put((index, {"loaded_rss": loaded, "peak_rss": peak, "latencies": latencies}))
    except BaseException as exc:  # reported to the parent, which fails the run
        results.put((index, f"{type(exc).__name__}: {exc}"))
        raise


def run(codec: str, mode: str, workers: int, args: argparse.Namespace) -> dict:
    name = f"bcshm-bench-encode-{secrets.token_hex(6)}"
    preset = PRESETS[args.preset][codec]
    server = None
    if mode == "shared":
        options = ["--codec", codec, "--encode", "--preset", preset, "--threads", str(os.cpu_count()),
                   "--slots", str(2 * workers + 8)]  # fmt: skip
        server = start_server(name, options)
    try:
        ctx = multiprocessing.get_context("spawn")
        barrier, results = ctx.Barrier(workers + 1), ctx.Queue()
        settings = {"codec": codec, "mode": mode, "name": name, "preset": preset, "rate": sample_rate(codec),
                    "clips": args.clips, "seconds": args.seconds,
                    "threads": max(1, (os.cpu_count() or 1) // workers)}  # fmt: skip
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
        "codec": codec, "mode": mode, "workers": workers, "preset": preset, "encodes": len(latencies),
        "worker_loaded_mib": float(np.mean([r["loaded_rss"] for r in got])) / MIB,
        "worker_peak_mib": worker_peak / MIB,
        "server_mib": server_rss / MIB,
        "total_mib": (workers * worker_peak + server_rss) / MIB,
        "latency_p50_ms": 1000 * latencies[len(latencies) // 2],
        "latency_p95_ms": 1000 * latencies[min(len(latencies) - 1, 95 * len(latencies) // 100)],
        "clips_per_s": len(latencies) / wall,
    }  # fmt: skip


def flags(row: dict) -> list[str]:
    """A row's noise flags, as ``bicodec-shm bench`` writes them: ``few`` when it rests on fewer
    than ``FEW_ENCODES`` encodes (a row without a count is taken as enough)."""
    return ["few"] if row.get("encodes", FEW_ENCODES) < FEW_ENCODES else []


def table(rows: list[dict]) -> str:
    """One codec's rows (a row without ``codec`` is BiCodec's): each shared row's total memory and
    clip rate over the own row of its worker count, where that count's own row was run; a row
    resting on few encodes is flagged ``few`` and a clip rate ratio with a flagged row marked
    ``?``, with the legend under the table."""
    head = (f"{'mode':<7} {'N':>3} {'worker MiB':>11} {'peak':>7} {'server MiB':>10} {'total MiB':>10} "
            f"{'vs own':>7} {'p50':>8} {'p95':>8} {'clips/s':>8} {'vs own':>7}  noise")  # fmt: skip
    own = {(r.get("codec", "bicodec"), r["workers"]): r for r in rows
           if r["mode"] == "own" and "skipped" not in r}  # fmt: skip
    lines = [head, "-" * len(head)]
    marked = False
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['mode']:<7} {r['workers']:>3} skipped: {r['skipped']}")
            continue
        o = own.get((r.get("codec", "bicodec"), r["workers"])) if r["mode"] == "shared" else None
        mark = " ?" if o and (flags(r) or flags(o)) else ""
        marked = marked or bool(mark)
        mem_vs = f"{r['total_mib'] / o['total_mib']:.2f}x" if o else ""  # memory does not wait on encodes
        rate_vs = f"{r['clips_per_s'] / o['clips_per_s']:.2f}x{mark}" if o else ""
        lines.append(f"{r['mode']:<7} {r['workers']:>3} {r['worker_loaded_mib']:>11.0f} "
                     f"{r['worker_peak_mib']:>7.0f} {r['server_mib']:>10.0f} {r['total_mib']:>10.0f} "
                     f"{mem_vs:>7} {r['latency_p50_ms']:>6.0f}ms {r['latency_p95_ms']:>6.0f}ms "
                     f"{r['clips_per_s']:>8.2f} {rate_vs:>7}  {' '.join(flags(r))}".rstrip())  # fmt: skip
    few = [r["encodes"] for r in rows if "skipped" not in r and flags(r)]
    if few:
        lines += ["noise: a flagged row's latencies and clips/s are noise, not a result (its memory is not):",
                  f"  few: fewer than {FEW_ENCODES} encodes (fewest here: {min(few)}): its p95 is about its "
                  "slowest encode, and one slow encode (another process on the same cores) moves its "
                  "clips/s; more --clips, or a repeated run, before comparing"]  # fmt: skip
    if marked:
        lines.append("?  noise, not a result: a clip rate ratio with a flagged row (noise column above)")
    return "\n".join(lines)


def skip_reason(workers: int, per_worker_mib: float, allowed_mib: float, available_mib: float) -> str | None:
    """Why N own workers are not run, or None: ``per_worker_mib`` (this codec's largest own
    worker so far; 0 before the first) times N exceeds the memory allowed."""
    need = workers * per_worker_mib
    if need <= allowed_mib:
        return None
    return (f"needs ~{need / 1024:.1f} GiB, more than the {allowed_mib / 1024:.1f} GiB allowed "
            f"({available_mib / 1024:.1f} GiB available)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", dest="codecs", nargs="+", choices=CODECS, default=["bicodec"],
                   help="the tokenizer measured; several run one after another, each its own table "
                        "(default: bicodec)")  # fmt: skip
    p.add_argument("--preset", default="full", choices=list(PRESETS) + ["spark-tts-0.5b"],
                   help="full: each codec's released size (BiCodec spark-tts-0.5b, qwen3-tts-12hz); "
                        "tiny: a small model of the same layout (default full)")  # fmt: skip
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--modes", nargs="+", choices=["own", "shared"], default=["own", "shared"])
    p.add_argument("--clips", type=int, default=2, help="clips per worker")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per clip")
    p.add_argument("--memory-gib", type=float, default=None, metavar="GIB",
                   help="skip a count of own workers estimated to need more (default: 0.8 of the "
                        "memory available when the count starts)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = p.parse_args(argv)
    if args.preset == "spark-tts-0.5b":  # the name this option took when it measured BiCodec only
        args.preset = "full"
    rows: list[dict] = []
    t0 = time.perf_counter()
    for codec in args.codecs:
        per_own_worker = 0.0  # MiB, this codec's largest own worker seen: the estimate for the next count
        for workers in args.workers:
            for mode in args.modes:
                available = psutil.virtual_memory().available / MIB
                allowed = 1024 * args.memory_gib if args.memory_gib is not None else 0.8 * available
                why = skip_reason(workers, per_own_worker, allowed, available) if mode == "own" else None
                where = f"[{time.perf_counter() - t0:6.0f} s] {codec} {mode} x{workers}"
                if why is not None:
                    rows.append({"codec": codec, "mode": mode, "workers": workers,
                                 "preset": PRESETS[args.preset][codec], "skipped": why})  # fmt: skip
                    print(f"{where}: skipped, {why}", file=sys.stderr, flush=True)
                    continue
                print(f"{where} ...", file=sys.stderr, flush=True)
                rows.append(run(codec, mode, workers, args))
                if mode == "own":
                    per_own_worker = max(per_own_worker, rows[-1]["worker_peak_mib"])
    load = os.getloadavg()
    memory = psutil.virtual_memory().total / 2**30
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, {memory:.0f} GiB, load "
          f"{load[0]:.1f}; {args.clips} clips of {args.seconds:g} s a worker")
    for codec in args.codecs:
        mine = [r for r in rows if r["codec"] == codec]
        print(f"\n{codec}: preset {PRESETS[args.preset][codec]}, clips at {sample_rate(codec) // 1000} kHz")
        print(table(mine))
    for r in rows:
        if "skipped" not in r:
            r["noise"] = flags(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
