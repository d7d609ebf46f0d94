"""``bicodec-shm bench``: decode throughput of bicodec-shm against what users do today.

What it measures: N client processes each send requests one after another (a TTS worker
waits for its audio before it asks for more) for a fixed window of wall time (default 60 s per
system and N), repeated (default 3 times). Request lengths are drawn from a mix (default: 80%
streaming chunks of 25-50 tokens, 20% utterances of 100-300 tokens; 50 tokens = 1 s). Client
i's k-th request is the same in every system of one invocation:

1. ``bicodec-shm``: one ``DecoderServer`` process (all cores), N torch-free ``DecoderClient``
   processes. The server's decoder is wrapped so that it records every batch it forms.
   ``--lanes 1,2`` runs it once per value (rows ``bicodec-shm (lanes=2)``), ``--server-arg
   KEY=VALUE`` passes any other ``DecoderServer`` keyword.
2. ``decoder per process``: each of the N processes loads its own ``BiCodecDecoder``
   (max(1, cores // N) torch threads each) and decodes its own requests one by one, unpadded.
   This is what users do today.
3. ``queue server``: one server process (all cores) fed pickled numpy requests through a
   ``multiprocessing.Queue``, replying through one Queue per client. It batches exactly like
   bicodec-shm (``batching.plan_batch``, the same ``max_wait_ms`` window, the same masked
   ``detokenize(..., lengths)``): only the transport differs.
4. ``limit (no IPC)``: the batches bicodec-shm formed in its window, replayed in a loop on the
   model in one process (all cores) with inputs built in advance: no IPC, no clients.

The window (see ``systems.py``): every process is loaded, warmed up and released at once;
clients send until the window closes; only requests that completed inside it count, so the
work in flight at the close (at most one request per client) is left out of every system
alike. ``--requests M`` instead sends exactly M requests per client and counts them all.

``--model stand-in`` (or ``--stand-in A,B``) replaces the model by a device-shaped stand-in
that sleeps ``A + B·rows·longest`` ms per batch and holds no CPU (``standin.py``, which also
derives the defaults A ≈ 29.2, B ≈ 0.0167 from 10 x 30 ms decodes costing one 35-40 ms batch).
Its decoder-per-process baseline takes one cross-process lock around every decode, the one
device the processes time-slice. Its rows add ``ideal batcher (computed)``: every batch
planned from all N outstanding requests with zero overhead; ``x ideal`` is the share of the
ideal batching gain a system keeps. An asynchronous stand-in (``--stand-in modern``) also adds
``pipelined ideal (computed)``: the same, held to one pipelined lane, which plans each batch
while the one before it runs and so without that batch's clients; ``x pipelined ideal`` is the
share of what a pipelined lane can reach at all.

Per system and N, as median (min-max) over the repeats: audio seconds decoded per wall second,
requests per second, p50/p99 request latency as the client sees it, CPU seconds per audio
second, the average batch size and padding, the peak of the summed resident memory (RSS) of
the system's processes (sampled with psutil every ``--sample-ms``), and the share of the
machine's CPU that *other* processes used meanwhile (the noise). Ratios (against the limit,
the decoder per process, the queue server, the ideal batchers) are computed within each repeat
and then summarised.

Before the runs it names the model and, from a calibration (one process started, one request
of the mix's mean length timed; ``--no-calibrate`` skips it), estimates the run's time and the
requests a window will hold; it warns of a long full-size run on a CPU (``--quick`` or ``--model
tiny`` for a short one) and of windows too short to count, and prints the first window's count
as soon as it ends. A row whose numbers are noise is flagged, in the table, the JSON and the
PNG (hollow markers): ``few`` (a window held fewer than 20 requests), ``spread`` (its
throughput's max / min over the repeats above 1.5) and ``tuner`` (the lane tuner explored during
more than 10 % of a window); a ratio computed from a flagged row is marked ``?``, and a ratio to
the limit above 1 is marked ``!`` with a footnote saying why it is not a result (report.py).

``--sweep`` instead runs bicodec-shm alone at one N over a grid of ``max_wait_ms`` and
``max_batch_tokens``, to choose the batching defaults from data.

``--codec snac-24khz`` (or 32/44 kHz) runs the same systems on SNAC, the codec of Orpheus TTS:
requests are per-level code arrays drawn with the codec's layout (1 : 2 : 4 codes per frame at
24 kHz), the mix counts frames (default: the seconds of the BiCodec mix, 6-12 and 23-70 frames
at 24 kHz), and the model is the full-size SNAC architecture with random weights (``--quick``:
the tiny one). Every system decodes through the codec's adapter, the server's own call.

Usage::

    bicodec-shm bench                           # full size, N = 1 2 4 8 16, 60 s x 3 (~1.5 h)
    bicodec-shm bench --quick                   # tiny model, N = 1 2, 2 s windows (< 1 min)
    bicodec-shm bench --model stand-in --n 16   # the device-shaped stand-in
    bicodec-shm bench --n 8 --lanes 1,2         # the server with 1 and with 2 decode lanes
    bicodec-shm bench --sweep --n 8 --window 20 # the batching-policy grid
    bicodec-shm bench --codec snac-24khz --n 4,8 --window 30   # SNAC (Orpheus), full size

Results go to a table on stdout, JSON (default ``benchmarks/out/bench_throughput.json``) and a
PNG of throughput, p99 latency and peak memory against N (needs matplotlib: ``pip install
"bicodec-shm[plot]"``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ...codecs.layout import LAYOUTS, get_layout
from ...protocol.names import leftover_objects, unlink_all
from ...server.batch_costs import BATCHING_MODES
from ...server.batching import (
    DEFAULT_CUDA_MAX_BATCH_TOKENS,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_WAIT_MS,
    default_max_batch_tokens,
)
from ...server.dispatch_policy import DISPATCH_MODES
from ..model_args import CODEC_PRESETS, resolve_preset
from .calibrate import Calibration, calibrate, estimate_seconds, mean_frames, run_seconds, sweep_seconds
from .config import (
    COMPUTED,
    DEFAULT_NS,
    DEFAULT_OMP_WAIT_POLICY,
    DEFAULT_REPEATS,
    DEFAULT_WINDOW_S,
    LIMIT,
    MODELS,
    QUICK_NS,
    QUICK_WINDOW_S,
    REQUEST_TIMEOUT,
    SHM,
    STAND_IN,
    SWEEP_N,
    SWEEP_TOKENS,
    SWEEP_WAITS,
    SYSTEM_KEYS,
    Policy,
    Setup,
)
from .decoding import DEVICE_ENV
from .options import (
    _floats,
    _ints,
    _lane_counts,
    _policy_names,
    _stand_in_costs,
    check_server_options,
    parse_server_arg,
    shm_variants,
)
from .orchestrate import bench_all, bench_sweep, runs_per_repeat
from .plot import PLOT_EXTRA, plot
from .report import (
    MIN_REQUESTS,
    NOISE_RULES,
    _json_default,
    compare,
    format_sweep,
    format_table,
    format_targets,
    summary,
    sweep_summary,
    targets,
)
from .sampling import _cores, environment
from .standin import DEFAULT_A_MS, DEFAULT_B_MS, IDEAL_DEFINITION, PIPELINED_DEFINITION, STAND_IN_PRESETS
from .systems import per_process_threads
from .workload import DEFAULT_MIX, default_mix, parse_mix, requests_per_client


def add_arguments(p: argparse.ArgumentParser, *, out_dir: str = os.path.join("benchmarks", "out")) -> None:
    """The options of ``bicodec-shm bench`` (also used by benchmarks/bench_throughput.py)."""
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: tiny model, N = {','.join(map(str, QUICK_NS))}, "
                        f"{QUICK_WINDOW_S:g} s windows, 1 repeat (under a minute)")  # fmt: skip
    p.add_argument("--device", default="cpu",
                   help="torch device of every model process, e.g. cuda:0 (default cpu)")  # fmt: skip
    p.add_argument("--codec", default="bicodec", choices=sorted(LAYOUTS),
                   help="the codec benchmarked (default bicodec): its layout draws the requests, "
                        "its model decodes them")  # fmt: skip
    p.add_argument("--model", "--preset", dest="preset", default=None, choices=MODELS + CODEC_PRESETS,
                   help="architecture with random weights, or the device-shaped stand-in (BiCodec "
                        "only); default the codec's full size (spark-tts-0.5b, snac-24khz, ...), "
                        "--quick its tiny one")  # fmt: skip
    p.add_argument("--stand-in", type=_stand_in_costs, default=None, metavar="PRESET|A_MS,B_MS[,async]",
                   help="the stand-in: a preset, " + "; ".join(
                       f"{k}: {v.a_ms:.4g} + {v.b_ms:.4g} x rows x longest ms, {v.about}"
                       for k, v in STAND_IN_PRESETS.items())
                   + "; or A,B for those costs, synchronous, or A,B,async, an asynchronous device "
                     "(benchmarks/fit_batch_costs.py prints a device's); implies --model stand-in "
                     "(default seed)")  # fmt: skip
    p.add_argument("--n", type=_ints, default=None, metavar="N,N,...",
                   help=f"client processes (default 1,2,4,8,16; with --sweep {SWEEP_N})")  # fmt: skip
    p.add_argument("--window", type=float, default=None, metavar="SECONDS",
                   help=f"seconds each system runs per N and repeat (default {DEFAULT_WINDOW_S:g}; "
                        f"--quick {QUICK_WINDOW_S:g})")  # fmt: skip
    p.add_argument("--repeats", type=int, default=None, metavar="R",
                   help=f"runs of every system per N, or passes over the sweep grid (default "
                        f"{DEFAULT_REPEATS}; --quick and --sweep 1)")  # fmt: skip
    p.add_argument("--requests", type=int, default=None, metavar="M",
                   help="instead of a window: exactly M requests per client")
    p.add_argument("--total-requests", type=int, default=None, metavar="TOTAL",
                   help="instead of a window: max(2, TOTAL // N) requests per client")
    p.add_argument("--mix", default=None,
                   help=f"request lengths in frames of the codec (BiCodec: tokens), LO-HI:WEIGHT,... "
                        f"(default {DEFAULT_MIX}; SNAC 24 kHz {default_mix(get_layout('snac-24khz'))}: "
                        "the same seconds)")  # fmt: skip
    p.add_argument("--systems", default=",".join(SYSTEM_KEYS),
                   help=f"comma-separated subset of {','.join(SYSTEM_KEYS)} (limit needs shm)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the random weights")
    p.add_argument("--cores", type=int, default=None,
                   help="CPU cores to share out (default: those this process may use)")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help="most rows per batch, for every batching system")  # fmt: skip
    p.add_argument("--max-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS,
                   help="how long a batch may wait to grow, for every batching system")  # fmt: skip
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help=f"padded-token budget per batch (default {DEFAULT_MAX_BATCH_TOKENS} on CPU, "
                        f"{DEFAULT_CUDA_MAX_BATCH_TOKENS} on CUDA)")  # fmt: skip
    p.add_argument("--per-process-max-n", type=int, default=None, metavar="N",
                   help="run the decoder per process only at N <= this (default: every N)")
    p.add_argument("--memory-gib", type=float, default=None, metavar="GIB",
                   help="memory this machine has for decoder-per-process runs (default: what is "
                        "available now; a VM whose memory grows on use reports too little)")  # fmt: skip
    p.add_argument("--server-arg", type=parse_server_arg, action="append", default=[],
                   metavar="KEY=VALUE",
                   help="an extra DecoderServer keyword for bicodec-shm, e.g. lanes=2 "
                        "(repeatable; VALUE is read as a Python literal, else a string)")  # fmt: skip
    p.add_argument("--lanes", type=_lane_counts, default=None, metavar="K,K,...",
                   help="run bicodec-shm once per value with DecoderServer(lanes=K) (rows "
                        "'bicodec-shm (lanes=K)'); 'auto' is the default, measured on the live "
                        "traffic (row 'bicodec-shm (lanes=auto)'); without it, lanes= is not "
                        "passed")  # fmt: skip
    p.add_argument("--dispatch", type=_policy_names(DISPATCH_MODES), default=None, metavar="MODE,...",
                   help="run bicodec-shm once per value with DecoderServer(dispatch=MODE), of "
                        f"{', '.join(DISPATCH_MODES)} (rows 'bicodec-shm (dispatch=MODE)'; with "
                        "--lanes, every pair); without it, dispatch= is not passed (auto)")  # fmt: skip
    p.add_argument("--batching", type=_policy_names(BATCHING_MODES), default=None, metavar="MODE,...",
                   help="likewise for DecoderServer(batching=MODE), of "
                        f"{', '.join(BATCHING_MODES)} (auto: measured; static: every row that "
                        "fits)")  # fmt: skip
    p.add_argument("--sweep", action="store_true",
                   help="bicodec-shm alone over a grid of --sweep-wait x --sweep-tokens")
    p.add_argument("--sweep-wait", type=_floats, default=SWEEP_WAITS, metavar="MS,MS,...",
                   help="max_wait_ms values (default 0,2,5,10)")
    p.add_argument("--sweep-tokens", type=_ints, default=SWEEP_TOKENS, metavar="T,T,...",
                   help="max_batch_tokens values (default 512,1024,2048,4096)")
    p.add_argument("--omp-wait-policy", default=DEFAULT_OMP_WAIT_POLICY,
                   choices=("PASSIVE", "ACTIVE", "inherit"),
                   help="OMP_WAIT_POLICY of every model process (default %(default)s; "
                        "inherit: leave the environment alone)")  # fmt: skip
    p.add_argument("--sample-ms", type=float, default=50.0, help="RSS sampling period (default 50)")
    p.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT,
                   help="seconds one request, or the wait for the next event, may take")
    p.add_argument("--json", default=None, metavar="PATH",
                   help=f"results file (default {os.path.join(out_dir, 'bench_throughput.json')}, "
                        "or bench_throughput_sweep.json with --sweep)")  # fmt: skip
    p.add_argument("--plot", default=None, metavar="PATH",
                   help=f"PNG (default {os.path.join(out_dir, 'bench_throughput.png')}); needs "
                        f"matplotlib, the [plot] extra: {PLOT_EXTRA}")  # fmt: skip
    p.add_argument("--out-dir", default=out_dir, metavar="DIR",
                   help=f"folder of the default JSON and PNG (default {out_dir}, relative to the "
                        "current folder; the run prints the full path first)")  # fmt: skip
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip the calibration before the runs (one model process timing a request, "
                        "for the estimated time and requests per window); the requests of the first "
                        "window are printed when it ends")  # fmt: skip


class Plan:
    """What ``args`` asks for, checked: the setup, the Ns, the systems, the repeats, and the
    requests per client when there is no window."""

    def __init__(self, args: argparse.Namespace) -> None:
        out_dir = getattr(args, "out_dir", None) or os.path.join("benchmarks", "out")
        if args.stand_in is not None and args.preset not in (None, STAND_IN):
            raise ValueError(f"--stand-in needs --model {STAND_IN}, got --model {args.preset}")
        stand_in = args.stand_in is not None or args.preset == STAND_IN
        if stand_in and args.codec != "bicodec":
            raise ValueError(f"--model {STAND_IN} is BiCodec-shaped; --codec {args.codec} needs a real model")
        size = args.preset or ("tiny" if args.quick else None)  # None: the codec's full size
        preset = STAND_IN if stand_in else resolve_preset(args.codec, size)
        ns = args.n or ((SWEEP_N,) if args.sweep else (QUICK_NS if args.quick else DEFAULT_NS))
        if args.sweep and args.quick and args.n is None:
            ns = (2,)
        if not ns or min(ns) < 1:
            raise ValueError("--n needs values >= 1")
        if args.sweep and len(ns) != 1:
            raise ValueError(f"--sweep runs at one N; got --n {','.join(map(str, ns))}")
        counted = args.requests is not None or args.total_requests is not None
        if counted and args.window is not None:
            raise ValueError("--window and --requests/--total-requests exclude each other")
        for flag, value in (("--requests", args.requests), ("--total-requests", args.total_requests)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        window = args.window
        if window is None and not counted:
            window = QUICK_WINDOW_S if args.quick else DEFAULT_WINDOW_S
        if window is not None and window <= 0:
            raise ValueError(f"--window must be > 0 seconds, got {window:g}")
        repeats = args.repeats
        if repeats is None:
            repeats = 1 if args.quick or args.sweep else DEFAULT_REPEATS
        if repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {repeats}")
        keys = [k.strip() for k in args.systems.split(",") if k.strip()]
        bad = [k for k in keys if k not in SYSTEM_KEYS]
        if bad or not keys:
            raise ValueError(f"--systems: unknown {bad}; choose from {', '.join(SYSTEM_KEYS)}")
        systems = [SYSTEM_KEYS[k] for k in keys]
        if LIMIT in systems and SHM not in systems:
            raise ValueError("--systems: limit replays the batches of shm; include shm")
        variants = shm_variants(args.server_arg, args.lanes, getattr(args, "dispatch", None),
                                getattr(args, "batching", None))
        check_server_options({k: v for variant in variants for k, v in variant.server_options.items()})
        if args.per_process_max_n is not None and args.per_process_max_n < 1:
            raise ValueError(f"--per-process-max-n must be >= 1, got {args.per_process_max_n}")
        if args.memory_gib is not None and args.memory_gib <= 0:
            raise ValueError(f"--memory-gib must be > 0, got {args.memory_gib:g}")
        budget = args.max_batch_tokens
        if budget is None:
            budget = default_max_batch_tokens(args.device.split(":")[0])
        self.setup = Setup(
            preset=preset, seed=args.seed, codec=args.codec,
            mix=parse_mix(args.mix or default_mix(get_layout(args.codec))), cores=args.cores or _cores(),
            policy=Policy(args.max_batch, args.max_wait_ms, budget),
            sample_interval=args.sample_ms / 1000, timeout=args.timeout, window=window,
            stand_in_ms=(args.stand_in or (DEFAULT_A_MS, DEFAULT_B_MS))[:2],
            stand_in_async=bool(args.stand_in and args.stand_in[2]), shm=variants,
            per_process_max_n=args.per_process_max_n, memory_gib=args.memory_gib,
        )  # fmt: skip
        self.device = args.device
        self.ns: tuple[int, ...] = tuple(ns)
        self.systems = systems
        self.repeats = repeats
        self.requests = ({n: requests_per_client(n, args.requests, args.total_requests or 0)
                          for n in ns} if counted else None)  # fmt: skip
        stem = "bench_throughput_sweep" if args.sweep else "bench_throughput"
        args.json = args.json or os.path.join(out_dir, f"{stem}.json")
        if args.plot is None and not args.sweep:
            args.plot = os.path.join(out_dir, "bench_throughput.png")

    def describe(self, *, sweep: bool, grid: int = 1) -> str:
        setup, ns = self.setup, self.ns
        unit = "tokens" if setup.codec == "bicodec" else f"frames ({setup.layout.frame_rate:.3g}/s)"
        mix = ", ".join(f"{b.lo}-{b.hi} {unit} x{b.weight:g}" for b in setup.mix)
        if self.requests is None:
            per_pass = grid if sweep else len(ns) * runs_per_repeat(setup, self.systems)
            runs = per_pass * self.repeats
            total = runs * setup.window
            span = f"{total / 60:.0f} min" if total >= 120 else f"{total:.0f} s"
            load = (f"window {setup.window:g} s per run, {self.repeats} repeat(s): {runs} runs, "
                    f"{span} of windows plus start-up")  # fmt: skip
        else:
            load = "requests per client: " + ", ".join(f"N={n}: {self.requests[n]}" for n in ns)
        if setup.stand_in:
            a, b = setup.stand_in_ms
            device = ", an asynchronous device (one pipelined lane)" if setup.stand_in_async else ""
            model = f"model {STAND_IN}: {a:.4g} + {b:.4g} x rows x longest ms per batch, no CPU{device}"
        else:
            size = "the tiny test size" if setup.preset.startswith("tiny") else "the full size"
            model = (f"codec {setup.codec}, model {setup.preset} ({size}), random weights (seed "
                     f"{setup.seed}; the bench builds a preset, it loads no folder), on "
                     f"{self.device}")  # fmt: skip
        threads = (f"torch threads: servers and the limit {setup.cores} (all cores); decoder per "
                   f"process max(1, {setup.cores} // N) each "
                   f"({', '.join(f'N={n}: {per_process_threads(setup.cores, n)}' for n in ns)}); "
                   "bicodec-shm and queue clients import no torch")  # fmt: skip
        p = setup.policy
        lines = [
            f"{model}; {setup.cores} cores; load average {os.getloadavg()[0]:.2f}",
            f"mix: {mix}; {load}",
            threads if not sweep else f"torch threads: server {setup.cores}",
            f"batching (bicodec-shm and queue server): max_batch {p.max_batch}, max_wait_ms "
            f"{p.max_wait_ms:g}, max_batch_tokens {p.max_batch_tokens}" if not sweep else
            f"batching: max_batch {p.max_batch}, max_wait_ms x max_batch_tokens swept",
        ]  # fmt: skip
        extra = [f"{v.label}: " + ", ".join(f"{k}={o!r}" for k, o in v.server_options.items())
                 for v in setup.shm if v.server_options]  # fmt: skip
        return "\n".join(lines + extra)


    @property
    def full_size_on_cpu(self) -> bool:
        setup = self.setup
        return not setup.stand_in and not setup.preset.startswith("tiny") and self.device.startswith("cpu")

    def estimate(self, cal: Calibration | None, *, sweep: bool, grid: int = 1) -> float | None:
        """About how long the runs take (None: not calibrated)."""
        if cal is None:
            return None
        setup, count = self.setup, self.requests
        if sweep:
            return sweep_seconds(cal, setup, self.ns[0], grid, self.repeats, count and count[self.ns[0]])
        return estimate_seconds(cal, setup, self.ns, self.systems, self.repeats, count)

    def expectations(self, cal: Calibration | None, *, sweep: bool, grid: int = 1) -> list[str]:
        """The lines printed before the runs: how long they take, how many requests a window
        holds, and a warning for a long full-size run on a CPU or windows too short to count."""
        setup = self.setup
        runs = (grid if sweep else len(self.ns) * runs_per_repeat(setup, self.systems)) * self.repeats
        total = self.estimate(cal, sweep=sweep, grid=grid)
        lines = []
        if cal is not None:
            assert total is not None
            frames = round(mean_frames(setup.mix))
            decode = (f"on {setup.cores} cores" if cal.how == "measured" else f"({cal.how})")
            lines.append(f"estimated time: about {_span(total)} for {runs} runs (calibration: a process "
                         f"starts in {_span(cal.process_s)}, builds and warms its model in "
                         f"{_span(cal.model_s)}; one request of {frames} frames, the mix's mean, "
                         f"decodes in {_span(cal.request_s)} {decode})")  # fmt: skip
        else:
            windows = (f"{_span(runs * setup.window)} of windows" if setup.window is not None
                       else "the requests")  # fmt: skip
            lines.append(f"estimated time: {windows} plus start-up for {runs} runs (not calibrated: "
                         "--no-calibrate; the first window's requests are printed when it ends)")  # fmt: skip
        if self.requests is not None:
            least = min(n * self.requests[n] for n in self.ns)
            lines.append("requests per run (counted, no window): "
                         + ", ".join(f"N={n}: {n * self.requests[n]}" for n in self.ns))  # fmt: skip
            if least < MIN_REQUESTS:
                lines.append(f"warning: a run of {least} requests, fewer than {MIN_REQUESTS}: its "
                             "numbers will be noise (flagged 'few'); --requests or --total-requests "
                             "larger")  # fmt: skip
        elif cal is not None:
            expected = cal.requests_per_window(setup.window)
            lines.append(f"expected requests per window: about {expected:.0f} or more (all clients "
                         f"together, one request at a time: the decoder per process's pace; a "
                         "batching system holds more)")  # fmt: skip
            if expected < MIN_REQUESTS:
                need = math.ceil(MIN_REQUESTS * cal.request_s)
                lines.append(f"warning: a {setup.window:g} s window holds about {_requests(expected)}, "
                             f"fewer than {MIN_REQUESTS}: its numbers will be noise (flagged 'few'); "
                             f"--window {need} or more holds {MIN_REQUESTS}")  # fmt: skip
        long = total if total is not None else (runs * setup.window if setup.window is not None else 0)
        if self.full_size_on_cpu and long >= LONG_RUN_S:
            quick = f"N = {','.join(map(str, QUICK_NS))}, {QUICK_WINDOW_S:g} s windows, 1 repeat"
            lines.append(f"warning: the full-size model ({setup.preset}) on a CPU: this run takes about "
                         f"{_span(long)}{'' if total is not None else ' plus start-up'}. For a quick one: "
                         f"--quick (the tiny model, {quick}), or --model tiny (the tiny model, these N "
                         "and windows)")  # fmt: skip
        return lines


# A full-size run on a CPU at least this long (seconds) is warned about before it starts.
LONG_RUN_S = 120.0


def _requests(count: float) -> str:
    k = round(count)
    return f"{k} request" if k == 1 else f"{k} requests"


def _span(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    if seconds < 0.1:
        return f"{seconds * 1000:.2g} ms"
    return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"


class _RunReporter:
    """Called with the runs' results so far after each system's run: prints the first run's
    count of requests as soon as it ends, with the time the runs so far took against the
    estimate and what that makes of the rest; warns once per system whose run counted too few."""

    def __init__(self, plan: Plan, cal: Calibration | None, total: float | None, started: float) -> None:
        self.plan, self.cal, self.total, self.started = plan, cal, total, started
        self.done = 0
        self.first = True
        self.few: set[str] = set()

    def __call__(self, done: list) -> None:
        from tqdm import tqdm

        new = [r for r in done[self.done:] if r.wall_seconds > 0 and r.system not in COMPUTED]  # ran
        self.done = len(done)
        for r in new:
            span = f"its {r.window_s:g} s window" if r.window_s else "its run"
            if self.first:
                self.first = False
                tqdm.write(f"first run: N={r.n_clients} {r.system}: {_requests(r.requests)} in {span}"
                           f"{self._expected(r)}{self._pace(done)}", file=sys.stdout)  # fmt: skip
            if r.requests < MIN_REQUESTS and r.system not in self.few:
                self.few.add(r.system)
                tqdm.write(f"warning: N={r.n_clients} {r.system}: {_requests(r.requests)} in {span}, "
                           f"fewer than {MIN_REQUESTS}: flagged 'few' (noise); a longer --window "
                           "holds more", file=sys.stdout)  # fmt: skip

    def _expected(self, r: Any) -> str:
        if self.cal is None or not r.window_s:
            return ""
        return f" (calibration: about {self.cal.requests_per_window(r.window_s):.0f} or more)"

    def _pace(self, done: list) -> str:
        """The runs so far against their estimate, and the rest scaled by that."""
        if self.cal is None or self.total is None:
            return ""
        plan, count = self.plan, self.plan.requests
        ran = [r for r in done if r.system not in COMPUTED]
        guessed = sum(run_seconds(self.cal, plan.setup, r.system, r.n_clients, count and count[r.n_clients])
                      for r in ran)  # fmt: skip
        took = time.perf_counter() - self.started
        rest = max(0.0, self.total - guessed) * (took / guessed if guessed > 0 else 1.0)
        return (f"; {len(ran)} run(s) took {_span(took)} (estimated {_span(guessed)}), the rest "
                f"about {_span(rest)}")  # fmt: skip


def run_and_report(args: argparse.Namespace) -> int:
    """Run what ``args`` asks for, print the tables, write JSON (and the plot); 0 if clean."""
    try:
        import psutil  # noqa: F401  (the memory and CPU sampler)
    except ImportError:
        print("bicodec-shm bench needs psutil: pip install psutil", file=sys.stderr)
        return 2
    os.environ[DEVICE_ENV] = args.device
    plan = Plan(args)
    setup, ns = plan.setup, plan.ns
    grid = len(args.sweep_wait) * len(args.sweep_tokens)
    print(plan.describe(sweep=args.sweep, grid=grid), flush=True)
    plot_path = "" if args.sweep or args.no_plot else f" and {os.path.abspath(args.plot)}"
    print(f"results will be written to {os.path.abspath(args.json)}{plot_path} "
          "(--out-dir, --json and --plot change that)", flush=True)  # fmt: skip
    print(f"OMP_WAIT_POLICY={args.omp_wait_policy} in every model process\n", flush=True)
    names: list[str] = []
    omp_before = os.environ.get("OMP_WAIT_POLICY")
    if args.omp_wait_policy != "inherit":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy  # spawned children inherit it
    # SIGTERM (a CI timeout, a kill) unwinds like Ctrl-C, so that every finally block runs and
    # every child process and /dev/shm object is cleaned up.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.perf_counter()
    cal: Calibration | None = None
    reporter = None

    def save_partial(done: list) -> None:
        """The runs so far, so that a run cut short (a step's timeout) still leaves them."""
        partial = {"benchmark": "bench_throughput", "partial": True, "environment": environment(),
                   "results": [{k: v for k, v in asdict(r).items() if k != "batches"} for r in done]}
        _write_json(args.json, partial)
        if reporter is not None:
            reporter(done)

    try:
        if not args.no_calibrate:
            print("calibrating: one process starts, builds the model and times a request ...", flush=True)
            cal = calibrate(setup)
        print("\n".join(plan.expectations(cal, sweep=args.sweep, grid=grid)) + "\n", flush=True)
        reporter = _RunReporter(plan, cal, plan.estimate(cal, sweep=args.sweep, grid=grid),
                                time.perf_counter())  # fmt: skip
        if args.sweep:
            results = bench_sweep(setup, ns[0], requests=plan.requests and plan.requests[ns[0]],
                                  waits=args.sweep_wait, tokens=args.sweep_tokens,
                                  repeats=plan.repeats, progress=not args.no_progress,
                                  names=names)  # fmt: skip
        else:
            results = bench_all(setup, ns, requests=plan.requests, repeats=plan.repeats,
                                systems=plan.systems, progress=not args.no_progress,
                                names=names, on_result=save_partial)  # fmt: skip
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if omp_before is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        else:
            os.environ["OMP_WAIT_POLICY"] = omp_before
        left = [o for name in names for o in leftover_objects(name)]
        for name in names:
            unlink_all(name)
    elapsed = time.perf_counter() - started
    report: dict[str, Any] = {
        "benchmark": "bench_throughput" + ("_sweep" if args.sweep else ""),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "config": {
            "codec": setup.codec, "preset": setup.preset, "seed": setup.seed,
            "mix": [asdict(b) for b in setup.mix], "mix_unit": "frames (BiCodec: tokens)",
            "n_clients": list(ns), "window_s": setup.window, "repeats": plan.repeats,
            "requests_per_client": plan.requests and {str(n): m for n, m in plan.requests.items()},
            "edge": "requests completed after the window closed are left out (cut_at_edge)",
            "cores": setup.cores, "policy": asdict(setup.policy),
            "bicodec_shm": [asdict(v) for v in setup.shm],
            "threads": {"server": setup.cores, "limit": setup.cores, "queue_server": setup.cores,
                        "per_process": {str(n): per_process_threads(setup.cores, n) for n in ns},
                        "clients": "no torch"},
            "sample_interval_s": setup.sample_interval, "systems": list(plan.systems),
            "omp_wait_policy": args.omp_wait_policy if args.omp_wait_policy != "inherit"
            else omp_before,
        },  # fmt: skip
        "environment": environment(),
        "elapsed_s": elapsed,
        "calibration": asdict(cal) if cal is not None else None,
        "estimated_s": plan.estimate(cal, sweep=args.sweep, grid=grid),
        "noise_rules": NOISE_RULES,
        "results": [{k: v for k, v in asdict(r).items() if k != "batches"} for r in results],
        "shm_names": names,
        "left_in_dev_shm": left,
    }
    if setup.stand_in:
        a, b = setup.stand_in_ms
        report["config"]["stand_in"] = {"a_ms": a, "b_ms": b, "cost": "a + b x rows x longest ms",
                                        "asynchronous": setup.stand_in_async,
                                        "ideal": IDEAL_DEFINITION}  # fmt: skip
        if setup.stand_in_async:
            report["config"]["stand_in"]["pipelined_ideal"] = PIPELINED_DEFINITION
    failed = sum(r.failed for r in results)
    if args.sweep:
        report["config"].update(sweep_wait=list(args.sweep_wait), sweep_tokens=list(args.sweep_tokens))
        report["summary"] = sweep_summary(results)
        print(format_sweep(results))
    else:
        comparison = compare(results)
        report["summary"] = summary(results)
        report["comparison"] = {str(n): c for n, c in comparison.items()}
        # The targets were set for BiCodec's model and mix.
        report["targets"] = (targets(comparison, stand_in=setup.stand_in, mix=setup.mix)
                             if setup.codec == "bicodec" else [])  # fmt: skip
        print(format_table(results, comparison))
        print()
        print(format_targets(report["targets"], ran=ns) if setup.codec == "bicodec"
              else f"targets: none for {setup.codec} (the targets are BiCodec's)")  # fmt: skip
    estimated = plan.estimate(cal, sweep=args.sweep, grid=grid)
    estimated_text = f" (estimated {_span(estimated)})" if estimated is not None else ""
    print(f"\nwall time {elapsed:.0f} s{estimated_text}; failed requests {failed}; left in /dev/shm: "
          f"{', '.join(left) or 'nothing'}")  # fmt: skip
    _write_json(args.json, report)
    print(f"wrote {os.path.abspath(args.json)}")
    if not args.sweep and not args.no_plot:
        print(plot(results, args.plot))
    return 1 if failed or left else 0


def _write_json(path: str, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` through a temporary file: a reader never sees half of it.

    The temporary file is a fresh one (``mkstemp``: O_EXCL, a random name, no link followed)
    beside ``path``, never a predictable ``PATH.part`` that another user of a shared directory
    could have made a symbolic link to a file of ours."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, part = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".part")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # what open(path, "w") makes (mkstemp: 0o600)
            json.dump(report, f, indent=2, default=_json_default)
            f.write("\n")
        os.replace(part, path)
    except BaseException:
        try:
            os.unlink(part)
        except FileNotFoundError:
            pass
        raise


def _umask() -> int:
    """This process's umask, read without setting it (which would race the run's threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def main(argv: Sequence[str] | None = None, *, prog: str = "bicodec-shm bench",
         out_dir: str = os.path.join("benchmarks", "out")) -> int:  # fmt: skip
    """Parse ``argv``, run, report; ``out_dir`` holds the default JSON and PNG."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(p, out_dir=out_dir)
    args = p.parse_args(argv)
    try:
        return run_and_report(args)
    except ValueError as exc:
        p.error(str(exc))
        return 2  # not reached
    except KeyboardInterrupt:
        print("interrupted; every process and shared-memory object was cleaned up", file=sys.stderr)
        return 130
