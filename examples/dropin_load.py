"""The load the drop-in examples put on a decoder: N worker processes, one stream at a time each.

Each worker runs a TTS's own serving loop (``examples/orpheus_tts``, ``examples/spark_tts``,
``examples/qwen3_tts``) with a stand-in language model, decoding either through one shared
``bicodec-shm serve`` process (``shared``) or with a decoder of its own in the process (``own``,
as the TTS does by itself). All workers load first, then start together; each records, per
utterance, its time to first audio (from the request to the first PCM in hand), its audio and
its wall time, and how many of its chunks arrived after the audio before them had finished
playing (``late``: a player started at the first chunk would have stalled).

Used as a library by the examples' ``run.py``; not part of the installed package.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MODES = ("own", "shared")


@dataclass
class Record:
    """One utterance of one worker."""

    worker: int
    ttfa_s: float  # request -> first PCM
    audio_s: float  # seconds of audio returned
    wall_s: float  # request -> last PCM
    chunks: int
    late: int  # chunks that arrived after the audio before them had played out


class Clock:
    """Times one utterance's chunks as they arrive (``start`` at the request)."""

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate
        self.start = time.perf_counter()
        self.first: float | None = None
        self.samples = 0
        self.chunks = 0
        self.late = 0
        self.last = self.start

    def chunk(self, n_samples: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        elif now > self.first + self.samples / self.sample_rate:  # the player ran dry before it
            self.late += 1
        self.samples += n_samples
        self.chunks += 1
        self.last = now

    def record(self, worker: int) -> Record:
        first = self.first if self.first is not None else self.last
        return Record(worker, first - self.start, self.samples / self.sample_rate, self.last - self.start,
                      self.chunks, self.late)  # fmt: skip


def start_server(name: str, options: Sequence[str], log_path: str | None = None) -> subprocess.Popen:
    """``bicodec-shm serve --name NAME OPTIONS`` in this interpreter; returns once it serves."""
    from bicodec_shm import DecoderClient

    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen([sys.executable, "-m", "bicodec_shm", "serve", "--name", name, *options],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    log.close()
    deadline = time.monotonic() + 180
    while True:
        try:
            DecoderClient(name, connect_timeout=1.0).close()
            return proc
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_server(proc)
                code = proc.returncode
                raise RuntimeError(f"the decoder server did not start (exit code {code})") from None


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (a clean stop unlinks the segment), SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_workers(target: Callable[..., list[Record]], workers: int, settings: dict[str, Any],
                timeout: float = 600.0) -> tuple[list[Record], float]:  # fmt: skip
    """Start ``workers`` processes of ``target(index, settings)`` (it loads its decoder, calls
    ``settings["ready"]()`` and runs its utterances); returns every record and the wall time
    from the common start to the last worker's end."""
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: a shared-mode worker loads no model
    barrier, results = ctx.Barrier(workers + 1), ctx.Queue()
    # Workers exit together, once every one has finished: a process's exit takes CPU (a torch
    # interpreter's teardown), and a worker that finished early would take it from the decodes
    # still running, which a serving loop's long-lived workers never do. Without this, 32
    # Spark-TTS workers through the shared server saw their last utterance's slowest first
    # audio at 3.8 s against 2.0-2.4 s for their first and second (2026-12-07, 2-core CPU).
    finished = ctx.Barrier(workers)
    procs = [ctx.Process(target=_worker, args=(target, i, settings, barrier, results, finished),
                         daemon=True) for i in range(workers)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout)
        start = time.perf_counter()
        records: list[Record] = []
        for _ in range(workers):
            index, got = results.get(timeout=timeout)
            if isinstance(got, str):
                raise RuntimeError(f"worker {index} failed: {got}")
            records.extend(Record(**r) for r in got)
        wall = time.perf_counter() - start
        for p in procs:
            p.join(timeout)
            if p.exitcode != 0:
                raise RuntimeError(f"a worker exited with {p.exitcode}")
        return records, wall
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _worker(target, index, settings, barrier, results, finished) -> None:
    try:
        got = target(index, {**settings, "ready": lambda: barrier.wait(600)})
        results.put((index, [asdict(r) for r in got]))
    except BaseException as exc:  # reported to the parent, which fails the run (and kills the rest)
        results.put((index, f"{type(exc).__name__}: {exc}"))
        raise
    finished.wait(600)  # exit with the others (run_workers says why)


def summary(mode: str, workers: int, records: list[Record], wall: float,
            server: str | None, threads: int) -> dict[str, Any]:  # fmt: skip
    """One row of the table; ``threads``: each own decoder's torch threads, or the server's."""
    ttfa = sorted(r.ttfa_s for r in records)
    audio = sum(r.audio_s for r in records)
    return {
        "mode": mode,
        "server": server,
        "audio_s": audio,
        "streams": workers,
        "threads": threads,
        "utterances": len(records),
        "ttfa_p50_ms": 1000 * ttfa[len(ttfa) // 2],
        "ttfa_p95_ms": 1000 * ttfa[min(len(ttfa) - 1, (95 * len(ttfa)) // 100)],
        "ttfa_max_ms": 1000 * ttfa[-1],
        "audio_s_per_s": audio / wall,
        "late_chunks": sum(r.late for r in records),
        "chunks": sum(r.chunks for r in records),
    }


HEADER = (f"{'decoder':<8} {'streams':>7} {'threads':>7} {'utts':>5} {'TTFA p50':>9} {'TTFA p95':>9} "
          f"{'TTFA max':>9} {'audio s/s':>9} "
          f"{'late chunks':>12}")  # fmt: skip


def row_line(r: dict[str, Any]) -> str:
    return (f"{r['mode']:<8} {r['streams']:>7} {r['threads']:>7} {r['utterances']:>5} "
            f"{r['ttfa_p50_ms']:>7.0f}ms {r['ttfa_p95_ms']:>7.0f}ms {r['ttfa_max_ms']:>7.0f}ms "
            f"{r['audio_s_per_s']:>9.2f} {r['late_chunks']:>5}/{r['chunks']:<6}")  # fmt: skip


def machine_line() -> str:
    load = os.getloadavg()
    return (f"{time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} CPUs, load average "
            f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")  # fmt: skip


def own_threads(args: Any, workers: int) -> int:
    """Each own decoder's torch threads: ``--threads``, else its share of the cores. So both modes
    use every core at every worker count; N workers of torch's default (every core each) would
    oversubscribe the CPU N times over, and one thread each would leave cores idle below N = cores."""
    return args.threads or max(1, (os.cpu_count() or 1) // workers)


def server_threads(args: Any) -> int:
    """The shared server's torch threads: ``--server-threads``, else every core, as a server
    deployed alone on the machine runs."""
    return args.server_threads or os.cpu_count() or 1


def main(args: Any, target: Callable[..., list[Record]], server_options: list[str],
         settings: dict[str, Any]) -> int:  # fmt: skip
    """Run ``args.modes`` x ``args.workers`` and print the table (``--json``: write it too)."""
    rows = []
    print(machine_line(), flush=True)
    print(HEADER, flush=True)
    for workers in args.workers:
        for mode in args.modes:
            server = None
            name = f"bcshm-example-{secrets.token_hex(6)}"
            if mode == "shared":
                options = [*server_options, "--slots", str(2 * workers + 8)]
                server = start_server(name, options, args.server_log)
            try:
                run = {**settings, "mode": mode, "name": name, "threads": own_threads(args, workers)}
                records, wall = run_workers(target, workers, run)
            finally:
                if server is not None:
                    stop_server(server)
            threads = server_threads(args) if server is not None else run["threads"]
            rows.append(summary(mode, workers, records, wall, name if server is not None else None, threads))
            print(row_line(rows[-1]), flush=True)
    print(machine_line(), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), "rows": rows}, f, indent=1)
    return 0


def add_arguments(parser: Any, *, rate: float, default_preset: str, unit: str = "tokens") -> None:
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4],
                        help="worker processes (concurrent streams), one run for each count")  # fmt: skip
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="own: a decoder in every worker; shared: one server for all")  # fmt: skip
    parser.add_argument("--utterances", type=int, default=3, help="utterances per worker, one after another")
    parser.add_argument("--rate", type=float, default=rate,
                        help=f"stand-in language model, {unit} per second")  # fmt: skip
    parser.add_argument("--preset", default=default_preset, choices=["tiny", "full"],
                        help="codec size (random weights: the audio is noise)")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="torch device of every decoder (e.g. cuda:0)")
    parser.add_argument("--threads", type=int, help="torch threads of each own decoder (default: its "
                        "share of the cores, cores // workers, at least 1)")  # fmt: skip
    parser.add_argument("--server-threads", type=int, help="torch CPU threads of the shared server "
                        "(default: every core)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the table here as JSON")
    parser.add_argument("--server-log", help="the shared server's log (default: discarded)")
