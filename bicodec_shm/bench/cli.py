"""``bicodec-shm bench``: decode throughput of bicodec-shm against what users do today.

What it measures: N client processes each send M requests, one after another (a TTS worker
waits for its audio before it asks for more). Request lengths are drawn from a mix (default:
80% streaming chunks of 25-50 tokens, 20% utterances of 100-300 tokens; 50 tokens = 1 s). The
same requests, from the same seed, go through each system in one invocation:

1. ``bicodec-shm``: one ``DecoderServer`` process (all cores), N torch-free ``DecoderClient``
   processes. The server's decoder is wrapped so that it records every batch it forms.
2. ``decoder per process``: each of the N processes loads its own ``BiCodecDecoder``
   (max(1, cores // N) torch threads each) and decodes its own requests one by one, unpadded.
   This is what users do today.
3. ``queue server``: one server process (all cores) fed pickled numpy requests through a
   ``multiprocessing.Queue``, replying through one Queue per client. It batches exactly like
   bicodec-shm (``batching.plan_batch``, the same ``max_wait_ms`` window, the same masked
   ``detokenize(..., lengths)``): only the transport differs.
4. ``limit (no IPC)``: the batches bicodec-shm formed at this N, replayed on the model in one
   process (all cores) with inputs built in advance: no IPC, no clients, nothing to wait for.

Per system and N: audio seconds decoded per wall second and requests per second (wall = from
the moment every process is loaded, warmed up and released at once, to the last reply), p50/p99
request latency as the client sees it, the average batch size, the peak of the summed resident
memory (RSS) of the system's processes (sampled with psutil every ``--sample-ms``), the CPU
seconds they used, and the share of the machine's CPU that *other* processes used meanwhile
(the noise). Ratios are given against the limit and against ``decoder per process``.

``--sweep`` instead runs bicodec-shm alone at one N over a grid of ``max_wait_ms`` and
``max_batch_tokens``, to choose the batching defaults from data.

Usage::

    bicodec-shm bench                      # full size, N = 1 2 4 8 16 (tens of minutes on 2 CPUs)
    bicodec-shm bench --quick              # tiny model, N = 1 2, a few requests (< 2 min)
    bicodec-shm bench --n 8 --requests 4   # one N, 4 requests per client
    bicodec-shm bench --sweep --n 8        # the batching-policy grid

Results go to a table on stdout, JSON (default ``benchmarks/out/bench_throughput.json``) and a
PNG of throughput and p99 against N (needs matplotlib: ``pip install bicodec-shm[plot]``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ..batching import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_WAIT_MS,
)
from ..transport import (
    leftover_objects,
    unlink_all,
)
from .config import (
    DEFAULT_NS,
    DEFAULT_OMP_WAIT_POLICY,
    LIMIT,
    QUICK_NS,
    QUICK_REQUESTS,
    REQUEST_TIMEOUT,
    SHM,
    SWEEP_TOKENS,
    SWEEP_WAITS,
    SYSTEM_KEYS,
    TARGET_N,
    Policy,
    Setup,
)
from .plot import plot
from .report import _json_default, compare, format_sweep, format_table, format_targets, sweep_summary, targets
from .sampling import _cores, environment
from .systems import bench_all, bench_sweep, per_process_threads
from .workers import DEVICE_ENV
from .workload import DEFAULT_MIX, TOTAL_REQUESTS, parse_mix, requests_per_client


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser, *, out_dir: str = os.path.join("benchmarks", "out")) -> None:
    """The options of ``bicodec-shm bench`` (also used by benchmarks/bench_throughput.py)."""
    p.add_argument("--quick", action="store_true",
                   help=f"tiny model, N = {','.join(map(str, QUICK_NS))}, {QUICK_REQUESTS} "
                        "requests per client (under 2 minutes)")  # fmt: skip
    p.add_argument("--device", default="cpu",
                   help="torch device of every model process, e.g. cuda:0 (default cpu)")  # fmt: skip
    p.add_argument("--preset", default=None, choices=("spark-tts-0.5b", "tiny"),
                   help="architecture, random weights (default spark-tts-0.5b; --quick: tiny)")
    p.add_argument("--n", type=_ints, default=None, metavar="N,N,...",
                   help="client processes (default 1,2,4,8,16; with --sweep 8)")  # fmt: skip
    p.add_argument("--requests", type=int, default=None, metavar="M",
                   help="requests per client (default max(2, TOTAL // N))")
    p.add_argument("--total-requests", type=int, default=TOTAL_REQUESTS, metavar="TOTAL",
                   help="requests per N when --requests is not given (default %(default)s)")
    p.add_argument("--mix", default=DEFAULT_MIX,
                   help="request lengths in tokens, LO-HI:WEIGHT,... (default %(default)s)")
    p.add_argument("--systems", default=",".join(SYSTEM_KEYS),
                   help=f"comma-separated subset of {','.join(SYSTEM_KEYS)} (limit needs shm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cores", type=int, default=None,
                   help="CPU cores to share out (default: those this process may use)")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    p.add_argument("--max-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS)
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS)
    p.add_argument("--sweep", action="store_true",
                   help="bicodec-shm alone over a grid of --sweep-wait x --sweep-tokens")
    p.add_argument("--sweep-wait", type=_floats, default=SWEEP_WAITS, metavar="MS,MS,...",
                   help="max_wait_ms values (default 0,2,5,10)")
    p.add_argument("--sweep-tokens", type=_ints, default=SWEEP_TOKENS, metavar="T,T,...",
                   help="max_batch_tokens values (default 512,1024,2048,4096)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the sweep grid (default 1)")
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
                   help=f"PNG (default {os.path.join(out_dir, 'bench_throughput.png')})")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(bench_out_dir=out_dir)


def _resolve(args: argparse.Namespace) -> tuple[Setup, tuple[int, ...], list[str]]:
    out_dir = getattr(args, "bench_out_dir", os.path.join("benchmarks", "out"))
    preset = args.preset or ("tiny" if args.quick else "spark-tts-0.5b")
    ns = args.n or ((TARGET_N,) if args.sweep else (QUICK_NS if args.quick else DEFAULT_NS))
    if args.quick and args.requests is None:
        args.requests = QUICK_REQUESTS
    if args.sweep and args.quick and args.n is None:
        ns = (2,)
    if any(n < 1 for n in ns) or (args.requests is not None and args.requests < 1):
        raise ValueError("--n and --requests must be >= 1")
    if args.total_requests < 1:
        raise ValueError(f"--total-requests must be >= 1, got {args.total_requests}")
    if args.sweep and len(ns) != 1:
        raise ValueError(f"--sweep runs at one N; got --n {','.join(map(str, ns))}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    keys = [k.strip() for k in args.systems.split(",") if k.strip()]
    bad = [k for k in keys if k not in SYSTEM_KEYS]
    if bad or not keys:
        raise ValueError(f"--systems: unknown {bad}; choose from {', '.join(SYSTEM_KEYS)}")
    systems = [SYSTEM_KEYS[k] for k in keys]
    if LIMIT in systems and SHM not in systems:
        raise ValueError("--systems: limit replays the batches of shm; include shm")
    setup = Setup(
        preset=preset, seed=args.seed, mix=parse_mix(args.mix), cores=args.cores or _cores(),
        policy=Policy(args.max_batch, args.max_wait_ms, args.max_batch_tokens),
        sample_interval=args.sample_ms / 1000, timeout=args.timeout,
    )  # fmt: skip
    stem = "bench_throughput_sweep" if args.sweep else "bench_throughput"
    args.json = args.json or os.path.join(out_dir, f"{stem}.json")
    if args.plot is None and not args.sweep:
        args.plot = os.path.join(out_dir, "bench_throughput.png")
    return setup, ns, systems


def _describe(setup: Setup, ns: Sequence[int], requests: dict[int, int], sweep: bool) -> str:
    mix = ", ".join(f"{b.lo}-{b.hi} tokens x{b.weight:g}" for b in setup.mix)
    per_n = ", ".join(f"N={n}: {requests[n]}" for n in ns)
    threads = (f"torch threads: servers and the limit {setup.cores} (all cores); decoder per "
               f"process max(1, {setup.cores} // N) each "
               f"({', '.join(f'N={n}: {per_process_threads(setup.cores, n)}' for n in ns)}); "
               "bicodec-shm and queue clients import no torch")  # fmt: skip
    p = setup.policy
    return "\n".join([
        f"model {setup.preset} (random weights, seed {setup.seed}); {setup.cores} cores; "
        f"load average {os.getloadavg()[0]:.2f}",
        f"mix: {mix}; requests per client: {per_n}",
        threads if not sweep else f"torch threads: server {setup.cores}",
        f"batching (bicodec-shm and queue server): max_batch {p.max_batch}, max_wait_ms "
        f"{p.max_wait_ms:g}, max_batch_tokens {p.max_batch_tokens}" if not sweep else
        f"batching: max_batch {p.max_batch}, max_wait_ms x max_batch_tokens swept",
    ])  # fmt: skip


def run_and_report(args: argparse.Namespace) -> int:
    """Run what ``args`` asks for, print the tables, write JSON (and the plot); 0 if clean."""
    try:
        import psutil  # noqa: F401  (the memory and CPU sampler)
    except ImportError:
        print("bicodec-shm bench needs psutil: pip install psutil", file=sys.stderr)
        return 2
    os.environ[DEVICE_ENV] = args.device
    setup, ns, systems = _resolve(args)
    requests = {n: requests_per_client(n, args.requests, args.total_requests) for n in ns}
    print(_describe(setup, ns, requests, args.sweep), flush=True)
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
    try:
        if args.sweep:
            results = bench_sweep(setup, ns[0], requests=requests[ns[0]], waits=args.sweep_wait,
                                  tokens=args.sweep_tokens, repeats=args.repeats,
                                  progress=not args.no_progress, names=names)  # fmt: skip
        else:
            results = bench_all(setup, ns, requests=requests, systems=systems,
                                progress=not args.no_progress, names=names)  # fmt: skip
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
            "preset": setup.preset, "seed": setup.seed, "mix": [asdict(b) for b in setup.mix],
            "n_clients": list(ns),
            "requests_per_client": {str(n): m for n, m in requests.items()},
            "cores": setup.cores, "policy": asdict(setup.policy),
            "threads": {"server": setup.cores, "limit": setup.cores, "queue_server": setup.cores,
                        "per_process": {str(n): per_process_threads(setup.cores, n) for n in ns},
                        "clients": "no torch"},
            "sample_interval_s": setup.sample_interval, "systems": list(systems),
            "omp_wait_policy": args.omp_wait_policy if args.omp_wait_policy != "inherit"
            else omp_before,
        },  # fmt: skip
        "environment": environment(),
        "elapsed_s": elapsed,
        "results": [{k: v for k, v in asdict(r).items() if k != "batches"} for r in results],
        "shm_names": names,
        "left_in_dev_shm": left,
    }
    failed = sum(r.failed for r in results)
    if args.sweep:
        report["config"].update(sweep_wait=list(args.sweep_wait), sweep_tokens=list(args.sweep_tokens),
                                repeats=args.repeats)  # fmt: skip
        report["summary"] = sweep_summary(results)
        print(format_sweep(results))
    else:
        comparison = compare(results)
        report["comparison"] = {str(n): c for n, c in comparison.items()}
        report["targets"] = targets(comparison)
        print(format_table(results, comparison))
        print()
        print(format_targets(report["targets"]))
    print(f"\nwall time {elapsed:.0f} s; failed requests {failed}; left in /dev/shm: "
          f"{', '.join(left) or 'nothing'}")  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2, default=_json_default)
        f.write("\n")
    print(f"wrote {args.json}")
    if not args.sweep and not args.no_plot:
        print(plot(results, args.plot))
    return 1 if failed or left else 0


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
