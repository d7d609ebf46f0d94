"""SNAC streaming (``DecodeStream`` on an in-process ``SNACDecoder``) against the full decode.

For each SNAC variant and each streaming preset (``streaming.CODEC_PRESETS``), random codes of
``--frames`` frames are pushed one frame at a time, as a language model emits them, and the
stream's audio is compared with the full single decode of the same codes (same noise seed: a
window draws the noise the full decode draws at its frames). Reported: SNR (dB), the largest
|Δ|, frames before the first audio, and the decode cost (frames decoded / frames).

    python benchmarks/bench_snac_streaming.py [--variants snac-24khz,snac-32khz] [--frames 24]
        [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bicodec_shm.client.streaming import CODEC_PRESETS, DecodeStream  # noqa: E402
from bicodec_shm.model.precision import snr_db  # noqa: E402
from bicodec_shm.model.snac import SNACDecoder  # noqa: E402


def bench_variant(model: SNACDecoder, frames: int, seed: int = 0) -> list[dict[str, Any]]:
    cfg = model.config
    rng = np.random.default_rng(seed)
    levels = [rng.integers(0, cfg.codebook_size, frames * r) for r in cfg.level_rates]
    full = model.detokenize([torch.from_numpy(v)[None] for v in levels])[0]
    rows = []
    for name, settings in CODEC_PRESETS[cfg.codec_name].items():
        stream = DecodeStream(model, None, preset=name, dtype="float32")
        start, parts, first = time.perf_counter(), [], None
        for f in range(frames):
            out = stream.push([v[f * r : (f + 1) * r] for v, r in zip(levels, cfg.level_rates)])
            if out and first is None:
                first = f + 1
            parts.append(out)
        parts.append(stream.finish())
        seconds = time.perf_counter() - start
        audio = torch.from_numpy(np.frombuffer(b"".join(parts), "<f4").copy())
        rows.append({
            "codec": cfg.codec_name, "preset": name, "settings": vars(settings) | {},
            "snr_db": snr_db(audio, full), "max_abs": (audio - full).abs().max().item(),
            "first_audio_frames": first, "cost": stream.tokens_decoded / frames, "seconds": seconds,
        })  # fmt: skip
        print(f"  {cfg.codec_name} {name}: {rows[-1]['snr_db']:.1f} dB", file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'codec':>11} {'preset':>8} {'chunk':>5} {'left':>4} {'ahead':>5} {'SNR dB':>7} "
            f"{'max |Δ|':>9} {'first audio':>11} {'cost':>5}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        s = r["settings"]
        snr = "exact" if r["snr_db"] == float("inf") else f"{r['snr_db']:.1f}"
        lines.append(
            f"{r['codec']:>11} {r['preset']:>8} {s['chunk_tokens']:>5} {s['left_context']:>4} "
            f"{s['lookahead']:>5} {snr:>7} {r['max_abs']:>9.1e} {r['first_audio_frames']:>11} "
            f"{r['cost']:>5.2f}"
        )
    lines.append("chunk/left/ahead in frames; first audio = frames pushed before the first PCM; "
                 "cost = frames decoded / frames")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="snac-24khz,snac-32khz,snac-44khz")
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/out/bench_snac_streaming.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for variant in args.variants.split(","):
        rows += bench_variant(SNACDecoder.from_config(variant, seed=0), args.frames)
    print(format_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"frames": args.frames, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
