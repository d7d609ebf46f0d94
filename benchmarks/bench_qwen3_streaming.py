"""Qwen3-TTS streaming (``DecodeStream`` on an in-process ``Qwen3TTSDecoder``) against the whole
decode.

For each streaming preset (``streaming.CODEC_PRESETS["qwen3-tts-12hz"]``, and ``--settings``),
random codes of ``--frames`` frames are pushed one frame at a time, as the talker emits them, and
the stream's audio is compared with the decode of the whole utterance (qwen-tts's chunk schedule,
``Qwen3TTSDecoder.detokenize``). Reported: SNR (dB), the largest |Δ| in float and in int16 steps,
frames before the first audio and the time its decode took, and the decode cost (frames decoded
per frame of audio).

    python benchmarks/bench_qwen3_streaming.py [--preset full|tiny] [--frames 400]
        [--settings "chunk,left,first;..."] [--threads N] [--json PATH]
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
from bicodec_shm.model.precision import snr_db  # noqa: E402
from bicodec_shm.model.qwen3_tts import Qwen3TTSDecoder  # noqa: E402

MODELS = {"full": "qwen3-tts-12hz", "tiny": "tiny-12hz"}


def to_int16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1.0, 1.0) * np.float32(32767)).astype(np.int16)


def run_stream(model: Qwen3TTSDecoder, codes: np.ndarray, settings: StreamSettings) -> dict[str, Any]:
    """Push ``codes`` (16, T) frame by frame; the audio, first-audio frames and decode times."""
    # Every field given (None would keep the default preset's first chunk).
    fields = vars(settings) | {"first_chunk_tokens": settings.first_chunk}
    stream = DecodeStream(model, None, dtype="float32", **fields)
    parts, first, first_ms = [], None, None
    start = time.perf_counter()
    for f in range(codes.shape[1]):
        t = time.perf_counter()
        parts.append(stream.push(codes[:, f : f + 1]))
        if parts[-1] and first is None:
            first, first_ms = f + 1, 1000 * (time.perf_counter() - t)
    t = time.perf_counter()
    parts.append(stream.finish())
    if first is None:  # no audio before finish()
        first, first_ms = codes.shape[1], 1000 * (time.perf_counter() - t)
    audio = np.frombuffer(b"".join(parts), "<f4")
    return {"audio": audio, "first": first, "first_ms": first_ms, "seconds": time.perf_counter() - start,
            "cost": stream.tokens_decoded / codes.shape[1]}  # fmt: skip


def bench(model: Qwen3TTSDecoder, frames: int, extra: list[StreamSettings],
          seed: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    cfg = model.config
    codes = np.random.default_rng(seed).integers(0, cfg.codebook_size, (cfg.num_quantizers, frames))
    print(f"  whole decode of {frames} frames ...", file=sys.stderr, flush=True)
    whole = model.detokenize(torch.from_numpy(codes)[None])[0].numpy()
    runs = list(CODEC_PRESETS["qwen3-tts-12hz"].items()) + [("custom", s) for s in extra]
    rows = []
    for name, settings in runs:
        r = run_stream(model, codes, settings)
        audio = r.pop("audio")
        assert len(audio) == len(whole), (len(audio), len(whole))
        rows.append({
            "preset": name, "settings": dict(vars(settings)),
            "snr_db": snr_db(torch.from_numpy(audio.copy()), torch.from_numpy(whole)),
            "max_abs": float(np.abs(audio - whole).max()),
            "max_lsb": int(np.abs(to_int16(audio).astype(np.int32) - to_int16(whole)).max()),
            "first_audio_frames": r["first"], "first_audio_ms_of_audio": 80 * r["first"],
            "first_decode_ms": r["first_ms"], "cost": r["cost"], "seconds": r["seconds"],
        })  # fmt: skip
        print(f"  {name} {tuple(vars(settings).values())}: {rows[-1]['snr_db']:.1f} dB, "
              f"{r['seconds']:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'preset':>7} {'chunk':>5} {'left':>4} {'first':>5} {'SNR dB':>7} {'max |Δ|':>9} "
            f"{'max LSB':>7} {'first audio':>16} {'its decode':>10} {'cost':>5}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        s = r["settings"]
        snr = "exact" if r["snr_db"] == float("inf") else f"{r['snr_db']:.1f}"
        first = f"{r['first_audio_frames']} fr ({r['first_audio_ms_of_audio']} ms)"
        lines.append(
            f"{r['preset']:>7} {s['chunk_tokens']:>5} {s['left_context']:>4} "
            f"{s['first_chunk_tokens'] or s['chunk_tokens']:>5} {snr:>7} {r['max_abs']:>9.1e} "
            f"{r['max_lsb']:>7} {first:>16} {r['first_decode_ms']:>8.0f}ms {r['cost']:>5.2f}"
        )
    lines.append("chunk/left/first in frames (80 ms each); first audio = frames pushed before the first PCM "
                 "(and the audio they hold); its decode = that push's time, one run: timings on a "
                 "shared machine are noisy; cost = frames decoded per frame")  # fmt: skip
    return "\n".join(lines)


def _settings(text: str) -> list[StreamSettings]:
    out = []
    for item in filter(None, text.split(";")):
        chunk, left, first = (int(v) for v in item.split(","))
        out.append(StreamSettings(chunk, left, 0, 0, first_chunk_tokens=first))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=tuple(MODELS), default="full",  # fmt: skip
                        help="the full-size decoder (default) or the tiny one, random weights")  # fmt: skip
    parser.add_argument("--frames", type=int, default=400, help="frames (80 ms each); 400 = 32 s, two cuts")
    parser.add_argument("--settings", type=_settings, default=[],
                        help='more: "chunk,left,first" in frames, several separated by ";"')  # fmt: skip
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/out/bench_qwen3_streaming.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Qwen3TTSDecoder.from_config(MODELS[args.preset], seed=0)
    rows = bench(model, args.frames, args.settings)
    print(format_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"frames": args.frames, "preset": args.preset, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    args.json.write_text(json.dumps({**meta, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
