"""Two CPU lanes decoding at once: the eager forward against the traced graph the lanes replay.

A CPU server's lanes are threads of one process; an eager forward gives the GIL up and takes it
back around every torch call, so lanes running at once wait for each other where worker
processes would not (bicodec_shm/model/traced.py). For each window length this measures, on one
torch thread per lane, the time per decode of one window:

- ``alone``: one lane decoding, nothing beside it;
- ``2 at once``: two lanes (threads) decoding different windows at the same time, each its own;

eagerly and through the traced graph, with the ratios: ``at once / alone`` (1.0: the lanes do
not slow each other; 2.0: they take turns) and ``graph / eager``.

Usage::

    python benchmarks/bench_lane_graphs.py                          # tiny Qwen3-TTS decoder
    python benchmarks/bench_lane_graphs.py --preset qwen3-tts-12hz --frames 8 32 --repeats 3
    python benchmarks/bench_lane_graphs.py --codec bicodec --frames 50 150 --calls 10

For BiCodec a "window" is a whole utterance of ``frames`` semantic tokens (50 per second of
audio) and its 32 global ids: the unpadded forward its CPU lanes replay.

Each cell is the median of ``--repeats`` runs of ``--calls`` decodes; a cell whose runs spread
by more than ``NOISE`` of its median is marked ``~`` (noise on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bicodec_shm.model.bicodec.decoder import BiCodecDecoder  # noqa: E402
from bicodec_shm.model.qwen3_tts import Qwen3TTSDecoder  # noqa: E402
from bicodec_shm.model.traced import TracedForward  # noqa: E402

NOISE = 0.15


def qwen3_inputs(frames: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 2048, (1, 16, frames), generator=gen),)


def bicodec_inputs(frames: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return torch.randint(0, 8192, (1, frames), generator=gen), torch.randint(0, 4096, (1, 32), generator=gen)


def forwards_of(codec: str, preset: str | None) -> tuple[str, dict, object]:
    """(preset, {"eager": forward, "graph": its TracedForward}, input maker) of ``codec``."""
    if codec == "bicodec":
        model = BiCodecDecoder.from_config(preset or "tiny", seed=0).eval()
        return preset or "tiny", {"eager": model, "graph": TracedForward(model)}, bicodec_inputs
    model = Qwen3TTSDecoder.from_config(preset or "tiny-12hz", seed=0).decoder
    return preset or "tiny-12hz", {"eager": model, "graph": TracedForward(model)}, qwen3_inputs


def per_call_ms(forward, inputs, frames: int, calls: int, lanes: int, seed: int) -> float:
    """Mean ms per decode of one lane while ``lanes`` lanes decode at once."""
    times: list[float] = []
    start = threading.Barrier(lanes)

    def lane(i: int) -> None:
        torch.set_num_threads(1)
        x = inputs(frames, torch.Generator().manual_seed(seed + i))
        with torch.inference_mode():
            forward(*x)  # warm: the graph is traced and profiled here
            forward(*x)
            start.wait()
            t0 = time.perf_counter()
            for _ in range(calls):
                forward(*x)
            times.append((time.perf_counter() - t0) / calls * 1e3)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.mean(times)


def cell(forward, inputs, frames: int, calls: int, lanes: int, repeats: int) -> dict:
    runs = [per_call_ms(forward, inputs, frames, calls, lanes, seed=r) for r in range(repeats)]
    mid = statistics.median(runs)
    return {"ms": mid, "noisy": (max(runs) - min(runs)) > NOISE * mid, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", choices=["qwen3-tts-12hz", "bicodec"], default="qwen3-tts-12hz")
    p.add_argument("--preset", help="the decoder's preset, random weights (default: the codec's tiny one)")
    p.add_argument("--frames", type=int, nargs="+", default=[2, 8, 32],
                   help="window lengths (BiCodec: semantic tokens of an utterance)")
    p.add_argument("--calls", type=int, default=30, help="decodes per lane per run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = p.parse_args(argv)
    preset, forwards, inputs = forwards_of(args.codec, args.preset)
    machine = f"{time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), torch {torch.__version__}"  # noqa: E501
    print(f"{args.codec} {preset}, one torch thread per lane; {machine}", flush=True)
    head = (f"{'frames':>6} {'forward':<7} {'alone':>9} {'2 at once':>10} {'at once/alone':>14} "
            f"{'graph/eager alone':>18} {'at once':>8}")  # fmt: skip
    print(head + "\n" + "-" * len(head), flush=True)
    rows = []
    for frames in args.frames:
        by = {}
        for name, forward in forwards.items():
            alone = cell(forward, inputs, frames, args.calls, 1, args.repeats)
            both = cell(forward, inputs, frames, args.calls, 2, args.repeats)
            by[name] = {"frames": frames, "forward": name, "alone": alone, "two_at_once": both,
                        "at_once_over_alone": both["ms"] / alone["ms"]}  # fmt: skip
        for name in forwards:
            r = by[name]
            vs = (f"{r['alone']['ms'] / by['eager']['alone']['ms']:>17.2f}x "
                  f"{r['two_at_once']['ms'] / by['eager']['two_at_once']['ms']:>7.2f}x")  # fmt: skip
            mark = "~" if r["alone"]["noisy"] or r["two_at_once"]["noisy"] else " "
            print(f"{frames:>6} {name:<7} {r['alone']['ms']:>7.2f}ms {r['two_at_once']['ms']:>8.2f}ms "
                  f"{r['at_once_over_alone']:>13.2f}x{mark}{vs}", flush=True)  # fmt: skip
            rows.append(r)
    print("~: the runs of that row spread by more than 15 % of their median (noise)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "codec": args.codec, "preset": preset, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
