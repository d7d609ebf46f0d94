"""The TTS loops users run, side by side in one run: a decoder in every worker against one shared
server, for Orpheus, Spark-TTS and Qwen3-TTS, at several worker counts and model sizes.

Each loop is its example (``examples/orpheus_tts``, ``examples/spark_tts``, ``examples/qwen3_tts``):
N worker processes, each serving utterances one after another with a stand-in language model, and
decoding either with a decoder of its own (``own``) or through one ``bicodec-shm serve`` started
for the run (``shared``). Both modes use every core: each own decoder gets its share
(``cores // N`` threads, at least 1), the server all of them. Per loop, size and worker count the
table gives, for each mode: time to first audio (p50, p95, max), audio seconds per second and
late chunks (a chunk is late when it arrives after the audio before it has finished playing), and
the shared server's ratios to its own-decoder row: audio per second (higher is better), TTFA p95
(lower is better).

Usage::

    python benchmarks/bench_loops.py                                # tiny, 1 4 16 32 workers
    python benchmarks/bench_loops.py --sizes tiny full --workers 1 4 --json loops.json
    python benchmarks/bench_loops.py --loops qwen3_tts --workers 4 16 --utterances 2

Each cell collects at least ``--min-samples`` first chunks (default ``MIN_SAMPLES``): a worker
count below it runs more utterances per worker (``utterances_for``), so that the TTFA p95 is a
percentile and not the slowest of a dozen (of 12 samples, p95 is their maximum, and one chunk
the OS scheduled late decides it). One run of each cell: a ratio within ``NOISE`` of 1 is marked
``~`` (noise on a shared machine, not a difference). ``--repeats R`` runs the whole set R times,
one after another (so a change in the machine's load falls on both modes alike), and adds a
summary per loop and worker count: the median ratio with its range over the R paired runs, and
in how many of them the shared server met the criterion (``meets``): audio per second at least
its own decoders', TTFA p95 at most theirs and no more late chunks; at one worker, both ratios
within 5 %. Progress goes to stderr, one line per example run.

    python benchmarks/bench_loops.py --loops orpheus_tts --workers 16 --repeats 5

``--control`` runs a decoder in every worker a second time, after the shared server (own,
shared, own again), and applies the same criterion to that second run against the first, as if
it were the shared one (``control`` rows, ``control meets``). Two runs of the same decoders
differ only by noise, so this says how often the criterion holds by chance in that cell (it
asks three things at once, so even two equal runs fail it more often than not: 3 of 9 runs at
four workers, benchmarks/RESULTS.md), and a shared server that meets it no more often than its
control is level with its own decoders, neither better nor worse.

    python benchmarks/bench_loops.py --workers 4 --min-samples 96 --repeats 3 --control
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPS = ("orpheus_tts", "spark_tts", "qwen3_tts")
NOISE = 0.05  # one run per cell: a ratio within 5 % of 1 is not a difference
ONE_WORKER_TOLERANCE = 0.05  # at one worker the shared server need only come within 5 %
MIN_SAMPLES = 32  # first chunks per cell: p95 of 32 is the second slowest, not the slowest


def utterances_for(workers: int, utterances: int, min_samples: int) -> int:
    """Utterances per worker at ``workers`` workers: ``utterances``, or more where the cell
    would otherwise collect fewer than ``min_samples`` first chunks."""
    return max(utterances, -(-min_samples // workers))


def run_loop(loop: str, size: str, workers: list[int], utterances: int, extra: list[str]) -> dict:
    """One example's run over ``workers``: its machine line and rows (``examples.dropin_load``);
    ``extra`` may repeat a mode (``--modes own shared own``: ``label_controls``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", f"examples.{loop}.run", "--preset", size, "--workers",
               *map(str, workers), "--utterances", str(utterances), "--json", out, *extra]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd[1:])} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        with open(out) as f:
            return json.load(f)


def label_controls(rows: list[dict]) -> list[dict]:
    """The second ``own`` row of each worker count becomes its ``control`` (``--control``: the
    example ran own, shared, own)."""
    seen = set()
    for r in rows:
        if r["mode"] == "own":
            if r["streams"] in seen:
                r["mode"] = "control"
            seen.add(r["streams"])
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Each shared (and control) row gains ``vs_own``: its audio per second and TTFA p95 over
    the own row's."""
    own = {r["streams"]: r for r in rows if r["mode"] == "own"}
    for r in rows:
        o = own.get(r["streams"])
        if r["mode"] in ("shared", "control") and o is not None:
            r["vs_own"] = {"audio_s_per_s": r["audio_s_per_s"] / o["audio_s_per_s"],
                           "ttfa_p95": r["ttfa_p95_ms"] / o["ttfa_p95_ms"]}  # fmt: skip
    return rows


def meets(shared: dict, own: dict) -> bool:
    """Whether one paired run meets the criterion: at N >= 2, the shared server's audio per
    second >= its own decoders', its TTFA p95 <= theirs and its late chunks <= theirs; at N = 1,
    audio per second and TTFA p95 within ``ONE_WORKER_TOLERANCE`` of theirs."""
    vs = shared["vs_own"]
    if shared["streams"] == 1:
        return vs["audio_s_per_s"] >= 1 - ONE_WORKER_TOLERANCE and vs["ttfa_p95"] <= 1 + ONE_WORKER_TOLERANCE
    return vs["audio_s_per_s"] >= 1 and vs["ttfa_p95"] <= 1 and shared["late_chunks"] <= own["late_chunks"]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def repeated(cells: list[dict]) -> list[dict]:
    """Per loop, size and worker count, over the repeats of ``cells``: the shared server's
    ratios to its own decoders' (median, min, max), both modes' late chunks (median), in how
    many paired runs it ``meets`` the criterion, and, where the cells have ``control`` rows, in
    how many of those the control met it (``control_meets`` of ``control_runs``)."""
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    controls: dict[tuple, list[bool]] = {}
    for c in cells:
        own = {r["streams"]: r for r in c["rows"] if r["mode"] == "own"}
        for r in c["rows"]:
            key = (c["loop"], c["size"], r["streams"])
            if r["mode"] == "shared" and r["streams"] in own:
                groups.setdefault(key, []).append((r, own[r["streams"]]))
            elif r["mode"] == "control" and r["streams"] in own:
                controls.setdefault(key, []).append(meets(r, own[r["streams"]]))
    out = []
    for (loop, size, streams), pairs in groups.items():
        control = controls.get((loop, size, streams), [])
        out.append({"loop": loop, "size": size, "streams": streams, "runs": len(pairs),
                    "audio_vs_own": spread([s["vs_own"]["audio_s_per_s"] for s, _ in pairs]),
                    "p95_vs_own": spread([s["vs_own"]["ttfa_p95"] for s, _ in pairs]),
                    "late_own": statistics.median(o["late_chunks"] for _, o in pairs),
                    "late_shared": statistics.median(s["late_chunks"] for s, _ in pairs),
                    "meets": sum(meets(s, o) for s, o in pairs),
                    "control_runs": len(control), "control_meets": sum(control)})  # fmt: skip
    return out


def repeated_table(summary: list[dict]) -> str:
    def shown(x: dict) -> str:
        return f"{x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f})"

    head = (f"{'loop':<12} {'size':<5} {'N':>3} {'runs':>4} {'audio vs own':>20} {'p95 vs own':>20} "
            f"{'late own':>8} {'late shared':>11} {'meets':>6}")  # fmt: skip
    with_control = any(g.get("control_runs") for g in summary)
    head += f" {'control meets':>13}" if with_control else ""
    lines = [head, "-" * len(head)]
    for g in summary:
        control = f" {g['control_meets']:>10}/{g['control_runs']:<2}" if with_control else ""
        lines.append(f"{g['loop']:<12} {g['size']:<5} {g['streams']:>3} {g['runs']:>4} "
                     f"{shown(g['audio_vs_own']):>20} {shown(g['p95_vs_own']):>20} "
                     f"{g['late_own']:>8g} {g['late_shared']:>11g} "
                     f"{g['meets']:>3}/{g['runs']:<2}{control}")  # fmt: skip
    return "\n".join(lines)


def ratio_text(x: float) -> str:
    return f"{'~' if abs(x - 1) < NOISE else ''}{x:.2f}x"


def table(cells: list[dict]) -> str:
    head = (f"{'loop':<12} {'size':<5} {'N':>3} {'decoder':<7} {'thr':>3} {'utts':>4} {'TTFA p50':>9} "
            f"{'p95':>8} {'max':>8} {'audio s/s':>9} {'late':>11} {'audio vs own':>12} "
            f"{'p95 vs own':>10}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for c in cells:
        for r in c["rows"]:
            vs = r.get("vs_own")
            late = f"{r['late_chunks']}/{r['chunks']}"
            audio_vs = ratio_text(vs["audio_s_per_s"]) if vs else ""
            p95_vs = ratio_text(vs["ttfa_p95"]) if vs else ""
            lines.append(
                f"{c['loop']:<12} {c['size']:<5} {r['streams']:>3} {r['mode']:<7} {r['threads']:>3} "
                f"{r['utterances']:>4} {r['ttfa_p50_ms']:>7.0f}ms {r['ttfa_p95_ms']:>6.0f}ms "
                f"{r['ttfa_max_ms']:>6.0f}ms "
                f"{r['audio_s_per_s']:>9.2f} {late:>11} "
                f"{audio_vs:>12} {p95_vs:>10}"
            )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS))
    p.add_argument("--sizes", nargs="+", choices=["tiny", "full"], default=["tiny"],
                   help="codec sizes (random weights); full takes minutes per cell on a CPU")  # fmt: skip
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--utterances", type=int, default=3, help="utterances per worker (at least)")
    p.add_argument("--min-samples", type=int, default=MIN_SAMPLES,
                   help="first chunks per cell: fewer workers run more utterances each "
                        f"(default {MIN_SAMPLES})")  # fmt: skip
    p.add_argument("--device", default="cpu")
    p.add_argument("--example-args", default="", metavar="ARGS",
                   help='more options for every example, e.g. "--rate 2000" (see each --help)')  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="run everything this many times and summarise the paired runs")  # fmt: skip
    p.add_argument("--control", action="store_true",
                   help="run each cell's own decoders again after the shared server, and judge "
                        "that run against the first by the same criterion: how often it holds "
                        "by chance")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write every row here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    cells = []
    t0 = time.perf_counter()
    for repeat in range(args.repeats):
        for size in args.sizes:
            for loop in args.loops:
                extra = ["--device", args.device, *shlex.split(args.example_args)]
                if args.control:
                    extra += ["--modes", "own", "shared", "own"]
                rows, machine = [], None
                for n in args.workers:  # one example run per count: each its own utterances
                    each = utterances_for(n, args.utterances, args.min_samples)
                    print(f"[{time.perf_counter() - t0:6.0f} s] run {repeat + 1}/{args.repeats}: {loop} "
                          f"{size}: workers [{n}], {each} utterances each ...",
                          file=sys.stderr, flush=True)  # fmt: skip
                    got = run_loop(loop, size, [n], each, extra)
                    rows += label_controls(got["rows"])
                    machine = machine or got["machine"]
                cells.append({"loop": loop, "size": size, "repeat": repeat, "machine": machine,
                              "rows": ratios(rows)})  # fmt: skip
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, device {args.device}; "
          f"first and last load: {cells[0]['machine']} | {cells[-1]['machine']}")  # fmt: skip
    print(table(cells))
    print(f"\none run per cell: ratios marked ~ are within {NOISE:.0%} of 1 (noise, not a difference)")
    summary = repeated(cells)
    if args.repeats > 1:
        print(f"\nover {args.repeats} paired runs: median ratio (min-max), median late chunks, and in "
              "how many runs the shared server met the criterion"
              + (" (control: the own decoders' second run, judged alike)" if args.control else ""))
        print(repeated_table(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"noise": NOISE, "cells": cells, "repeated": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
