"""Speed of the full-size BiCodec decoder (Spark-TTS-0.5B dimensions, random weights) on CPU.

Measures ``BiCodecDecoder.detokenize`` for batch sizes 1, 2, 4, 8 and lengths 25, 50, 100
tokens (0.5, 1, 2 s of audio), against two baselines:

- the same decode at batch size 1: is batching worth it? (``gain`` = per-item time at B divided
  by per-item time at B=1; below 1 means batching saves time per item);
- the same padded batch decoded with ``mask=False``: what does per-layer padding masking cost?
  Rows' lengths are spread evenly from T/2 to T and passed as ``lengths`` (B=1 has no padding,
  so it takes the no-mask fast path and shows the noise floor).

Each configuration runs once as warm-up, then ``--repeats`` rounds that alternate mask on/off;
times are medians (``time.perf_counter``), the overhead is the median of the per-round ratios.
Because that A/B difference is small next to run-to-run noise on a shared 2-core machine, one
more masked run times the masking itself (building the masks and every in-place multiply) and
reports it as a share of that run (``mask ms``, ``mask %``).

    python benchmarks/bench_model.py [--quick] [--repeats N] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bicodec_shm.model import BiCodecDecoder, modules  # noqa: E402

BATCH_SIZES = (1, 2, 4, 8)
LENGTHS = (25, 50, 100)


def spread_lengths(batch: int, frames: int) -> list[int]:
    """``batch`` lengths from T down to T/2, evenly spaced; [T] for a batch of one."""
    if batch == 1:
        return [frames]
    half = frames / 2
    return [round(frames - half * i / (batch - 1)) for i in range(batch)]


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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


def bench_model(
    *,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    lengths: tuple[int, ...] = LENGTHS,
    repeats: int = 3,
    preset: str = "spark-tts-0.5b",
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Time every (length, batch) pair with masking on and off; one dict per pair."""
    model = BiCodecDecoder.from_config(preset, seed=0)
    gen = torch.Generator().manual_seed(0)
    pairs = [(t, b) for t in lengths for b in batch_sizes]
    rows = []
    for frames, batch in tqdm(pairs, desc="bench_model", file=sys.stderr, disable=not progress):
        semantic = torch.randint(0, model.config.semantic_vocab, (batch, frames), generator=gen)
        glob = torch.randint(0, model.config.global_vocab, (batch, 32), generator=gen)
        lens = torch.tensor(spread_lengths(batch, frames))
        on = partial(model.detokenize, semantic, glob, lens, mask=True)
        off = partial(model.detokenize, semantic, glob, lens, mask=False)
        on(), off()  # warm-up: oneDNN builds its kernels for each new shape
        times_on, times_off = [], []
        for _ in range(repeats):
            times_on.append(_time(on))
            times_off.append(_time(off))
        ratios = [a / b for a, b in zip(times_on, times_off, strict=True)]
        spent = [0.0]
        with _timing_masks(spent):
            total = _time(on)
        rows.append(
            {
                "tokens": frames,
                "batch": batch,
                "lengths": lens.tolist(),
                "ms_batch": 1e3 * statistics.median(times_on),
                "ms_batch_nomask": 1e3 * statistics.median(times_off),
                "mask_overhead_pct": 100 * (statistics.median(ratios) - 1),
                "mask_ms": 1e3 * spent[0],
                "mask_pct": 100 * spent[0] / total,
                "times_on_s": times_on,
                "times_off_s": times_off,
            }
        )
    for row in rows:
        single = next((r for r in rows if r["tokens"] == row["tokens"] and r["batch"] == 1), None)
        row["ms_item"] = row["ms_batch"] / row["batch"]
        row["gain"] = row["ms_item"] / single["ms_batch"] if single else float("nan")
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table, one line per (tokens, batch)."""
    head = (
        f"{'tokens':>6} {'B':>3} {'ms/batch':>10} {'ms/item':>9} {'gain':>6} "
        f"{'ms/batch nomask':>16} {'A/B ovh %':>10} {'mask ms':>8} {'mask %':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['tokens']:>6} {r['batch']:>3} {r['ms_batch']:>10.1f} {r['ms_item']:>9.1f} "
            f"{r['gain']:>6.2f} {r['ms_batch_nomask']:>16.1f} {r['mask_overhead_pct']:>+10.2f} "
            f"{r['mask_ms']:>8.1f} {r['mask_pct']:>7.2f}"
        )
    lines.append("gain = (ms per item at B) / (ms per item at B=1); < 1 means batching helps")
    lines.append("A/B ovh = masked vs mask=False on the same batch; mask ms/% = time in masking")
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="25 tokens, B in {1, 2}, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per config")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/out/bench_model.json")
    parser.add_argument("--lengths", type=_ints, default=LENGTHS, help="e.g. 25,50,100")
    parser.add_argument("--batch-sizes", type=_ints, default=BATCH_SIZES, help="e.g. 1,2,4,8")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes, lengths = ((1, 2), (25,)) if args.quick else (args.batch_sizes, args.lengths)
    repeats = 1 if args.quick and args.repeats == 3 else args.repeats
    rows = bench_model(
        batch_sizes=batch_sizes, lengths=lengths, repeats=repeats, progress=not args.no_progress
    )
    print(format_table(rows))
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "repeats": repeats,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
