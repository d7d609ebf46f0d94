"""How often batching flips a code of the Qwen3-TTS 12 Hz encoder (random weights).

``Qwen3TTSEncoder`` computes, for every row of a padded batch, what that row's lone encode
computes, but not in the same floating-point order: the convolutions, the transformer and the
quantizer's distances run on other shapes, and their float32 results differ in the last bits
(about 1e-6 of a codeword distance). A code flips when its nearest and second-nearest codewords
are closer than that. For mixed-length batches of random audio this measures, against the lone
encode of every row:

- ``flipped``: codes that differ;
- ``change``: how much batching moves the gap between each code's two nearest distances
  (max, mean);
- ``gaps``: how many of those gaps (lone encode) fall under 1e-6, 1e-5, 1e-4, 1e-3;
- ``expected``: the flips the gap distribution predicts, the sum over codes of the fraction of
  gaps smaller than that code's change (an estimate for when too few flips are seen to count).

    python benchmarks/bench_qwen3_encoder_ties.py [--variant tiny] [--trials 40]
        [--max-seconds 1.25] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bicodec_shm.model.qwen3_tts import Qwen3TTSEncoder  # noqa: E402
from bicodec_shm.model.qwen3_tts.encoder import _codebooks  # noqa: E402

GAP_LIMITS = (1e-6, 1e-5, 1e-4, 1e-3)


@contextlib.contextmanager
def recorded_distances(model: Qwen3TTSEncoder) -> Iterator[list[torch.Tensor]]:
    """Every codebook's (N, codebook_size) distances, in quantizer order, as the encoder computes
    them (``MimiEuclideanCodebook.quantize``: ``torch.cdist``, then the argmin)."""
    seen: list[torch.Tensor] = []
    books = _codebooks(model.encoder)
    for book in books:

        def quantize(h: torch.Tensor, book: Any = book) -> torch.Tensor:
            dists = torch.cdist(h[None].float(), book.embed[None].float(), p=2)[0]
            seen.append(dists)
            return dists.argmin(dim=-1)

        book.quantize = quantize
    try:
        yield seen
    finally:
        for book in books:
            del book.quantize


def bench_ties(variant: str, trials: int, max_samples: int, seed: int = 0) -> dict[str, Any]:
    """``trials`` batches of 2 to 4 rows of 1 to ``max_samples`` samples of random audio."""
    model = Qwen3TTSEncoder.from_config(variant, seed=seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    gaps, changes, flipped, codes = [], [], 0, 0
    start = time.perf_counter()
    with recorded_distances(model) as seen:
        for _ in range(trials):
            lengths = [rng.randint(1, max_samples) for _ in range(rng.randint(2, 4))]
            audio = 0.3 * torch.randn(len(lengths), max(lengths), generator=gen)
            seen.clear()
            batched = model.tokenize(audio, lengths).codes
            in_batch = list(seen)
            for i, n in enumerate(lengths):
                seen.clear()
                alone = model.tokenize(audio[i, :n]).codes[0]
                frames = alone.shape[1]
                for lone_d, batch_d in zip(seen, in_batch):
                    rows = batch_d.shape[0] // len(lengths)  # cdist rows: row-major (B, F)
                    batch_d = batch_d[i * rows : i * rows + frames]
                    top = lone_d.topk(2, largest=False)
                    gaps.append(top.values[:, 1] - top.values[:, 0])
                    moved = (batch_d - lone_d).gather(1, top.indices)
                    changes.append((moved[:, 1] - moved[:, 0]).abs())
                flipped += int((batched[i, :, :frames] != alone).sum())
                codes += alone.numel()
    gap, change = torch.cat(gaps), torch.cat(changes)
    expected = (torch.searchsorted(gap.sort().values, change) / gap.numel()).sum().item()
    return {
        "variant": variant, "trials": trials, "max_samples": max_samples, "codes": codes,
        "flipped": flipped, "expected": expected, "change_max": change.max().item(),
        "change_mean": change.mean().item(), "gap_min": gap.min().item(),
        "gaps_under": {f"{limit:g}": int((gap < limit).sum()) for limit in GAP_LIMITS},
        "seconds": time.perf_counter() - start,
    }  # fmt: skip


def format_result(r: dict[str, Any]) -> str:
    under = "  ".join(f"<{k}: {v}" for k, v in r["gaps_under"].items())
    return "\n".join([
        f"{r['variant']}: {r['trials']} batches, {r['codes']} codes, {r['seconds']:.1f} s",
        f"  flipped by batching  {r['flipped']}   expected from the gaps  {r['expected']:.2f} "
        f"({r['expected'] / r['codes']:.1e} a code)",
        f"  gap change           max {r['change_max']:.2e}  mean {r['change_mean']:.2e}",
        f"  top-2 gaps           min {r['gap_min']:.2e}  {under}",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="tiny", help="tiny or qwen3-tts-12hz (random weights)")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--max-seconds", type=float, default=1.25, help="longest row, at 24 kHz")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = bench_ties(args.variant, args.trials, max(1, round(args.max_seconds * 24000)), args.seed)
    result.update(torch=torch.__version__, machine=platform.machine(), threads=torch.get_num_threads())
    print(format_result(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
