"""Speed and accuracy of the full-size BiCodec decoder (Spark-TTS-0.5B dimensions, random weights).

Measures ``detokenize`` for batch sizes 1, 2, 4, 8 and lengths 25, 50, 100 tokens (0.5, 1, 2 s
of audio) by default, on CPU in float32, against these baselines:

- the same decode at batch size 1: is batching worth it? (``gain`` = per-item time at B divided
  by per-item time at B=1; below 1 means batching saves time per item);
- the same padded batch decoded with ``mask=False``: what does per-layer padding masking cost?
  Rows' lengths are spread evenly from T/2 to T and passed as ``lengths`` (B=1 has no padding,
  so it takes the no-mask fast path and shows the noise floor);
- with ``--dtype float32,bfloat16,float16``: each precision, its achieved TFLOPS and share of the
  device's peak for that dtype, and its audio against float32's (SNR per length) and batched
  rows against their lone decodes (max |Δ|);
- with ``--cuda-graphs both``: the same shapes replayed from CUDA graphs (``GraphedDecoder``,
  one bucket per shape, so there is no padding), ``speedup`` = eager time / graph time.

FLOPs are counted once with ``torch.utils.flop_counter.FlopCounterMode`` (about 1.18 GFLOP per
semantic token at full size) and multiplied by the B x T tokens a batch computes, padding
included. Each configuration runs once as warm-up, then ``--repeats`` rounds that alternate mask
on/off; times are medians (``time.perf_counter``, after a device synchronise on CUDA), the
overhead is the median of the per-round ratios. On CPU one more masked run times the masking
itself (building the masks and every in-place multiply) and reports it as a share of that run.

    python benchmarks/bench_model.py [--quick] [--repeats N] [--threads N] [--json PATH]
        [--device cuda:0] [--dtype float32,bfloat16] [--cuda-graphs off|on|both] [--grid]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bicodec_shm.model import BiCodecDecoder, modules  # noqa: E402
from bicodec_shm.model.bicodec.buckets import BucketGrid  # noqa: E402
from bicodec_shm.model.bicodec.graphs import GraphedDecoder  # noqa: E402
from bicodec_shm.model.devices import exact_cuda_math, resolve_device  # noqa: E402
from bicodec_shm.model.precision import DTYPES, resolve_dtype, snr_db  # noqa: E402

BATCH_SIZES = (1, 2, 4, 8)
LENGTHS = (25, 50, 100)
GRID_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
GRID_LENGTHS = (25, 50, 100, 200, 300)
QUALITY_LENGTHS = (25, 50, 100)
GFLOP_PER_TOKEN_EXPECTED = 1.18
# Dense peak TFLOPS by GPU (vendor datasheets, without sparsity). float32 is the CUDA-core rate:
# the server turns TF32 off to keep batched rows exact.
PEAK_TFLOPS = {
    "H200": {"float32": 67.0, "bfloat16": 989.4, "float16": 989.4},
    "H100": {"float32": 67.0, "bfloat16": 989.4, "float16": 989.4},  # SXM; PCIe is lower
    "A100": {"float32": 19.5, "bfloat16": 312.0, "float16": 312.0},
    "L40S": {"float32": 91.6, "bfloat16": 362.0, "float16": 362.0},
}


def spread_lengths(batch: int, frames: int) -> list[int]:
    """``batch`` lengths from T down to T/2, evenly spaced; [T] for a batch of one."""
    if batch == 1:
        return [frames]
    half = frames / 2
    return [round(frames - half * i / (batch - 1)) for i in range(batch)]


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Seconds one call takes, waiting for the device's queue before and after."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    return timed


@contextmanager
def _timing_masks(spent: list[float]) -> Iterator[None]:
    """Add the seconds spent building and applying every TimeMask to ``spent[0]``."""
    cls = modules.TimeMask
    original_init, original_call = cls.__init__, cls.__call__

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return wrapper

    cls.__init__, cls.__call__ = timed(original_init), timed(original_call)
    try:
        yield
    finally:
        cls.__init__, cls.__call__ = original_init, original_call


def gflop_per_token(model: BiCodecDecoder, frames: int = 50) -> float:
    """FLOPs of one decode of ``frames`` tokens, counted by torch, per token (GFLOP)."""
    semantic = torch.zeros(1, frames, dtype=torch.long)
    glob = torch.zeros(1, model.config.n_global, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        model.detokenize(semantic, glob)
    return counter.get_total_flops() / frames / 1e9


def peak_tflops(device: torch.device, dtype: str, override: float | None = None) -> float | None:
    """The device's dense peak for ``dtype`` (TFLOPS), or None when unknown (e.g. a CPU)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks[dtype] for key, peaks in PEAK_TFLOPS.items() if key in name), None)


def build_models(preset: str, device: torch.device, dtypes: tuple[str, ...]) -> dict[str, BiCodecDecoder]:
    """One model per dtype, all from the same float32 weights (seed 0)."""
    return {name: BiCodecDecoder.from_config(preset, seed=0, dtype=name).to(device) for name in dtypes}


def bench_model(
    *,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    lengths: tuple[int, ...] = LENGTHS,
    repeats: int = 3,
    preset: str = "spark-tts-0.5b",
    device: str = "cpu",
    dtypes: tuple[str, ...] = ("float32",),
    graphs: tuple[bool, ...] = (False,),
    mask_ab: bool = True,
    graph_memory_gib: float = 40.0,
    gflop: float | None = None,
    peak_override: float | None = None,
    models: dict[str, BiCodecDecoder] | None = None,
    on_row: Callable[[list[dict[str, Any]]], None] | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Time every (dtype, length, batch, graphs) with masking on (and off); one dict each.

    Shapes run smallest first, eager and graphs side by side, and ``on_row(rows)`` is called
    after each row, so that a run cut short still has the small shapes of both.
    """
    dev = resolve_device(device)
    models = models or build_models(preset, dev, dtypes)
    gflop = gflop or gflop_per_token(models[dtypes[0]])
    timed = _timer(dev)
    gen = torch.Generator().manual_seed(0)
    pairs = [(t, b) for t in lengths for b in batch_sizes]
    inputs = {}
    for frames, batch in pairs:
        semantic = torch.randint(0, 8192, (batch, frames), generator=gen)
        glob = torch.randint(0, 4096, (batch, 32), generator=gen)
        inputs[frames, batch] = semantic, glob, torch.tensor(spread_lengths(batch, frames))
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(pairs) * len(dtypes) * len(graphs), desc="bench_model", file=sys.stderr,
               disable=not progress)  # fmt: skip
    for name in dtypes:
        decoders: dict[bool, BiCodecDecoder | GraphedDecoder] = {False: models[name]}
        if True in graphs:  # one bucket per benchmarked shape: no padding, only the graph differs
            bar.set_postfix_str(f"capturing {name} graphs")
            decoders[True] = GraphedDecoder(models[name], grid=BucketGrid(batch_sizes, lengths),
                                            memory_gib=graph_memory_gib, mode="graphs")  # fmt: skip
        for frames, batch in pairs:
            for graphed in graphs:
                decoder = decoders[graphed]
                bar.set_postfix_str(f"{name} graphs={'on' if graphed else 'off'} B={batch} T={frames}")
                row = _bench_one(decoder, inputs[frames, batch], timed, repeats=repeats,
                                 mask_ab=mask_ab and not graphed, time_masks=dev.type == "cpu")  # fmt: skip
                peak = peak_tflops(dev, name, peak_override)
                tflops = gflop * batch * frames / (row["ms_batch"] / 1e3) / 1e3
                rows.append({
                    "dtype": name, "graphs": graphed, "tokens": frames, "batch": batch,
                    "graphed": graphed and (batch, frames) in {(k.batch, k.frames) for k in decoder.buckets},
                    **row, "tflops": tflops, "peak_tflops": peak,
                    "peak_pct": 100 * tflops / peak if peak else None,
                    "graph_mib": decoder.graph_bytes / 2**20 if graphed else None,
                    "graph_capture_s": decoder.capture_seconds if graphed else None,
                })  # fmt: skip
                _derive(rows)
                if on_row:
                    on_row(rows)
                bar.update()
        del decoders
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    return rows


def _bench_one(decoder, batch_inputs, timed, *, repeats: int, mask_ab: bool, time_masks: bool) -> dict:
    semantic, glob, lens = batch_inputs
    on = partial(decoder.detokenize, semantic, glob, lens, mask=True)
    off = partial(decoder.detokenize, semantic, glob, lens, mask=False)
    on()  # warm-up: oneDNN / cuDNN pick their kernels for each new shape
    if mask_ab:
        off()
    times_on, times_off = [], []
    for _ in range(repeats):
        times_on.append(timed(on))
        if mask_ab:
            times_off.append(timed(off))
    row = {
        "lengths": lens.tolist(),
        "ms_batch": 1e3 * statistics.median(times_on),
        "ms_batch_nomask": 1e3 * statistics.median(times_off) if mask_ab else None,
        "mask_overhead_pct": None,
        "mask_ms": None,
        "mask_pct": None,
        "times_on_s": times_on,
        "times_off_s": times_off,
    }
    if mask_ab:
        ratios = [a / b for a, b in zip(times_on, times_off, strict=True)]
        row["mask_overhead_pct"] = 100 * (statistics.median(ratios) - 1)
    if mask_ab and time_masks:  # host time is the mask's time only where ops are synchronous
        spent = [0.0]
        with _timing_masks(spent):
            total = timed(on)
        row["mask_ms"], row["mask_pct"] = 1e3 * spent[0], 100 * spent[0] / total
    return row


def _derive(rows: list[dict[str, Any]]) -> None:
    """Per-item time, batching gain against B=1 and graph speedup against eager, in place."""
    index = {(r["dtype"], r["graphs"], r["tokens"], r["batch"]): r for r in rows}
    for r in rows:
        single = index.get((r["dtype"], r["graphs"], r["tokens"], 1))
        r["ms_item"] = r["ms_batch"] / r["batch"]
        r["gain"] = r["ms_item"] / single["ms_batch"] if single else float("nan")
        eager = index.get((r["dtype"], False, r["tokens"], r["batch"]))
        r["speedup"] = eager["ms_batch"] / r["ms_batch"] if r["graphs"] and eager else None


def bench_quality(
    models: dict[str, BiCodecDecoder],
    *,
    lengths: tuple[int, ...] = QUALITY_LENGTHS,
    batch: int = 4,
    graphs: bool = False,
) -> list[dict[str, Any]]:
    """Per dtype: SNR against float32 at each length (2 rows of full length), and batched rows
    (``batch`` rows, lengths T..T/2, T the longest length) against their lone decodes; with
    ``graphs``, the same batch through CUDA graphs too."""
    reference = models.get("float32") or next(iter(models.values()))
    gen = torch.Generator().manual_seed(1)
    rows = []
    for name, model in models.items():
        row: dict[str, Any] = {"dtype": name, "snr_db": {}}
        for frames in lengths:
            semantic = torch.randint(0, 8192, (2, frames), generator=gen)
            glob = torch.randint(0, 4096, (2, 32), generator=gen)
            if model is not reference:
                want = reference.detokenize(semantic, glob)
                row["snr_db"][frames] = snr_db(model.detokenize(semantic, glob), want)
        frames = max(lengths)
        semantic = torch.randint(0, 8192, (batch, frames), generator=gen)
        glob = torch.randint(0, 4096, (batch, 32), generator=gen)
        lens = torch.tensor(spread_lengths(batch, frames))
        row["batched_vs_lone_max_abs"] = _batched_vs_lone(model, model, semantic, glob, lens)
        if graphs:
            graphed = GraphedDecoder(model, grid=BucketGrid((batch,), (frames,)), mode="graphs")
            row["graphs_vs_lone_max_abs"] = _batched_vs_lone(graphed, model, semantic, glob, lens)
        rows.append(row)
    return rows


def _batched_vs_lone(batched_decoder, model, semantic, glob, lens) -> float:
    audio = batched_decoder.detokenize(semantic, glob, lens).cpu()
    worst = 0.0
    for i, n in enumerate(lens.tolist()):
        alone = model.detokenize(semantic[i : i + 1, :n], glob[i : i + 1])[0].cpu()
        worst = max(worst, (audio[i, : 320 * n] - alone).abs().max().item())
    return worst


def _num(value: float | None, fmt: str, width: int) -> str:
    if value is None or math.isnan(value):
        return f"{'-':>{width}}"
    sign = "+" if fmt.startswith("+") else ""
    return f"{value:>{sign}{width}{fmt.lstrip('+')}}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table, one line per (dtype, graphs, tokens, batch)."""
    head = (
        f"{'dtype':>8} {'graphs':>6} {'tokens':>6} {'B':>3} {'ms/batch':>10} {'ms/item':>9} {'gain':>6} "
        f"{'ms/batch nomask':>16} {'A/B ovh %':>10} {'mask ms':>8} {'mask %':>7} "
        f"{'TFLOPS':>7} {'% peak':>7} {'speedup':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        graphs = ("on" if r["graphed"] else "eager*") if r["graphs"] else "off"
        lines.append(
            f"{r['dtype']:>8} {graphs:>6} {r['tokens']:>6} {r['batch']:>3} {r['ms_batch']:>10.1f} "
            f"{r['ms_item']:>9.1f} {_num(r['gain'], '.2f', 6)} {_num(r['ms_batch_nomask'], '.1f', 16)} "
            f"{_num(r['mask_overhead_pct'], '+.2f', 10)} {_num(r['mask_ms'], '.1f', 8)} "
            f"{_num(r['mask_pct'], '.2f', 7)} {r['tflops']:>7.3f} {_num(r['peak_pct'], '.1f', 7)} "
            f"{_num(r['speedup'], '.2f', 7)}"
        )
    lines.append("gain = (ms per item at B) / (ms per item at B=1); < 1 means batching helps")
    lines.append("A/B ovh = masked vs mask=False on the same batch; mask ms/% = time in masking (CPU)")
    lines.append("TFLOPS = counted FLOPs of the B x T tokens / time; % peak = of the device's dense peak")
    lines.append("speedup = eager ms / graph ms; eager* = no graph for this shape (memory budget)")
    return "\n".join(lines)


def format_quality(rows: list[dict[str, Any]]) -> str:
    """SNR against float32 per length, and batched-vs-lone max |Δ|, one line per dtype."""
    lengths = sorted({t for r in rows for t in r["snr_db"]}) or [max(QUALITY_LENGTHS)]
    head = f"{'dtype':>8} " + " ".join(f"{f'SNR@{t} dB':>11}" for t in lengths)
    head += f" {'batched vs lone':>16} {'graphs vs lone':>15}"
    lines = [head, "-" * len(head)]
    for r in rows:
        snrs = " ".join(_num(r["snr_db"].get(t), ".2f", 11) for t in lengths)
        graphs = r.get("graphs_vs_lone_max_abs")
        lines.append(f"{r['dtype']:>8} {snrs} {r['batched_vs_lone_max_abs']:>16.2e} "
                     f"{'-' if graphs is None else f'{graphs:.2e}':>15}")  # fmt: skip
    lines.append("SNR of each dtype's decode against float32's (same weights and inputs)")
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _dtypes(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    for name in names:
        try:
            resolve_dtype(name)
        except ValueError as exc:  # argparse shows only an ArgumentTypeError's message
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (``benchmarks/device_check.sh`` passes it flags)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="25 tokens, B in {1, 2}, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per config")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/out/bench_model.json")
    parser.add_argument("--lengths", type=_ints, default=LENGTHS, help="e.g. 25,50,100")
    parser.add_argument("--batch-sizes", type=_ints, default=BATCH_SIZES, help="e.g. 1,2,4,8")
    parser.add_argument("--grid", action="store_true",
                        help=f"B {GRID_BATCH_SIZES} x T {GRID_LENGTHS} (a GPU's grid)")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda:0 (default cpu)")
    parser.add_argument("--dtype", type=_dtypes, default=("float32",), metavar="DTYPES",
                        help=f"comma-separated, of {','.join(DTYPES)} (default float32)")  # fmt: skip
    parser.add_argument("--cuda-graphs", choices=("off", "on", "both"), default="off",
                        help="time eager decodes, CUDA graph replays, or both (default off)")  # fmt: skip
    parser.add_argument("--graph-memory-gib", type=float, default=40.0, help="graph budget (default 40)")
    parser.add_argument("--no-mask-ab", action="store_true", help="skip the mask=False A/B runs")
    parser.add_argument("--no-quality", action="store_true", help="skip SNR and batched-vs-lone")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak for %% peak when it is not in the table")  # fmt: skip
    parser.add_argument("--preset", default="spark-tts-0.5b", choices=("spark-tts-0.5b", "tiny"))
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    graphs = {"off": (False,), "on": (True,), "both": (False, True)}[args.cuda_graphs]
    if any(graphs) and device.type != "cuda":
        parser.error(f"--cuda-graphs {args.cuda_graphs} needs a CUDA --device, got {args.device}")
    if args.quick:
        batch_sizes, lengths, quality_lengths = (1, 2), (25,), (25,)
    elif args.grid:
        batch_sizes, lengths, quality_lengths = GRID_BATCH_SIZES, GRID_LENGTHS, GRID_LENGTHS
    else:
        batch_sizes, lengths, quality_lengths = args.batch_sizes, args.lengths, QUALITY_LENGTHS
    repeats = 1 if args.quick and args.repeats == 3 else args.repeats
    if device.type == "cuda":  # the server's flags: no TF32, deterministic cuDNN
        exact_cuda_math()
    dtypes = args.dtype if "float32" in args.dtype or args.no_quality else ("float32", *args.dtype)
    models = build_models(args.preset, device, dtypes)
    flops_model = models.get("float32") or models[dtypes[0]]
    gflop = gflop_per_token(flops_model, frames=min(lengths))
    print(f"counted {gflop:.4f} GFLOP per token at T={min(lengths)} "
          f"(expected ~{GFLOP_PER_TOKEN_EXPECTED} at full size)", file=sys.stderr)  # fmt: skip
    meta = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "preset": args.preset,
        "repeats": repeats,
        "dtypes": list(args.dtype),
        "cuda_graphs": args.cuda_graphs,
        "gflop_per_token": gflop,
        "load_average": os.getloadavg(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)

    def write(rows: list[dict[str, Any]], quality: list[dict[str, Any]]) -> None:
        # Rewritten after every row: a run cut short by a timeout keeps what it measured.
        args.json.write_text(json.dumps({"meta": meta, "results": rows, "quality": quality}, indent=2))

    rows = bench_model(
        batch_sizes=batch_sizes, lengths=lengths, repeats=repeats, device=args.device,
        dtypes=args.dtype, graphs=graphs, mask_ab=not args.no_mask_ab,
        graph_memory_gib=args.graph_memory_gib, gflop=gflop, peak_override=args.peak_tflops,
        models=models, on_row=lambda rows: write(rows, []), progress=not args.no_progress,
    )  # fmt: skip
    print(format_table(rows), flush=True)
    quality = []
    if not args.no_quality:
        quality = bench_quality(models, lengths=quality_lengths, graphs=any(graphs))
        print()
        print(format_quality(quality))
    write(rows, quality)
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
