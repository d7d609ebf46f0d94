"""DAC streaming (``DecodeStream`` on an in-process ``DACDecoder``) against the full decode.

For each DAC variant and each streaming preset (``streaming.CODEC_PRESETS``), random codes of
``--frames`` frames are pushed one frame at a time, as a language model emits them, and the
stream's audio is compared with the full single decode of the same codes. Reported: SNR (dB),
the largest |Δ| in float and in int16 steps (both converted to PCM as the server converts), frames before
the first audio, and the decode cost (frames decoded / frames). ``--settings`` measures other
settings too (``chunk,left,lookahead`` in frames, comma-separated, several separated by ``;``).

    python benchmarks/bench_dac_streaming.py [--variants dac-44khz,dac-24khz] [--frames 96]
        [--preset tiny] [--settings "4,10,8;8,8,8"] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bicodec_shm.client.streaming import CODEC_PRESETS, DecodeStream, StreamSettings  # noqa: E402
from bicodec_shm.model.dac import DACDecoder  # noqa: E402
from bicodec_shm.model.precision import snr_db  # noqa: E402


def to_int16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1.0, 1.0) * np.float32(32767)).astype(np.int16)


def bench_variant(model: DACDecoder, frames: int, extra: list[StreamSettings],
                  seed: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    """One row per preset (and per extra setting) of ``model``'s codec."""
    cfg = model.config
    codes = np.random.default_rng(seed).integers(0, cfg.codebook_size, (cfg.n_codebooks, frames))
    full = model.detokenize(torch.from_numpy(codes)[None])[0].numpy()
    runs = list(CODEC_PRESETS[cfg.codec_name].items()) + [("custom", s) for s in extra]
    rows = []
    for name, settings in runs:
        stream = DecodeStream(model, None, dtype="float32", **vars(settings))
        start, parts, first = time.perf_counter(), [], None
        for f in range(frames):
            out = stream.push(codes[:, f : f + 1])
            if out and first is None:
                first = f + 1
            parts.append(out)
        parts.append(stream.finish())
        seconds = time.perf_counter() - start
        first = first or frames  # no audio before finish()
        audio = np.frombuffer(b"".join(parts), "<f4")
        lsb = np.abs(to_int16(audio).astype(np.int32) - to_int16(full)).max()
        rows.append({
            "codec": cfg.codec_name, "preset": name, "settings": vars(settings) | {},
            "snr_db": snr_db(torch.from_numpy(audio.copy()), torch.from_numpy(full)),
            "max_abs": float(np.abs(audio - full).max()), "max_lsb": int(lsb),
            "first_audio_frames": first,
            "first_audio_ms": 1000 * first * cfg.samples_per_frame / cfg.sample_rate,
            "cost": stream.tokens_decoded / frames, "seconds": seconds,
        })  # fmt: skip
        print(f"  {cfg.codec_name} {name} {tuple(vars(settings).values())[:3]}: "
              f"{rows[-1]['snr_db']:.1f} dB, {seconds:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'codec':>9} {'preset':>7} {'chunk':>5} {'left':>4} {'ahead':>5} {'SNR dB':>7} "
            f"{'max |Δ|':>9} {'max LSB':>7} {'first audio':>14} {'cost':>5}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        s = r["settings"]
        snr = "exact" if r["snr_db"] == float("inf") else f"{r['snr_db']:.1f}"
        first = f"{r['first_audio_frames']} ({r['first_audio_ms']:.0f} ms)"
        lines.append(
            f"{r['codec']:>9} {r['preset']:>7} {s['chunk_tokens']:>5} {s['left_context']:>4} "
            f"{s['lookahead']:>5} {snr:>7} {r['max_abs']:>9.1e} {r['max_lsb']:>7} {first:>14} "
            f"{r['cost']:>5.2f}"
        )
    lines.append("chunk/left/ahead in frames; first audio = frames pushed before the first PCM; "
                 "max LSB in int16 steps; cost = frames decoded / frames")  # fmt: skip
    return "\n".join(lines)


def _settings(text: str) -> list[StreamSettings]:
    out = []
    for item in filter(None, text.split(";")):
        chunk, left, ahead = (int(v) for v in item.split(","))
        out.append(StreamSettings(chunk, left, ahead, 0))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="dac-44khz,dac-24khz,dac-16khz")
    parser.add_argument("--preset", choices=("full", "tiny"), default="full",
                        help="full size (default) or the tiny model of each variant")  # fmt: skip
    parser.add_argument("--frames", type=int, default=96)
    parser.add_argument("--settings", type=_settings, default=[])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/out/bench_dac_streaming.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for variant in args.variants.split(","):
        name = variant if args.preset == "full" else variant.replace("dac-", "tiny-")
        rows += bench_variant(DACDecoder.from_config(name, seed=0), args.frames, args.settings)
    print(format_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"frames": args.frames, "preset": args.preset, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    args.json.write_text(json.dumps({**meta, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
