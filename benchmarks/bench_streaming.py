"""Streaming decode (``bicodec_shm.client.streaming.DecodeStream``) against the full single decode.

For random token sequences of 5-20 s (250-1000 tokens) on the full-size architecture
(``spark-tts-0.5b``, random weights, seed 0), decoded in-process with ``BiCodecDecoder``, each
streaming setting is fed the tokens one at a time (as a language model emits them) and its
float output is compared with the full single, unpadded decode of the same sequence:

- SNR (dB) and max |Δ|, over all samples and within ±20 ms of each joint (where one decode's
  region meets the next), plus the largest int16 difference in LSB after the int16 conversion;
- latency to the first audio: the tokens that must arrive before the first non-empty ``push``,
  and the measured wall time of that push (its decode);
- the added delay (``lookahead``) and the work (tokens decoded per token streamed).

Rows: the ``peers`` scheme (50-token chunks decoded independently, 5 tokens of overlap, a
1600-sample linear crossfade), the ``default`` and ``exact`` presets, and any ``--settings``.
It also probes the receptive field structurally: a NaN planted in one token's features spreads
exactly as far as the convolutions reach.

    python benchmarks/bench_streaming.py                 # 3 sequences, full size (minutes)
    python benchmarks/bench_streaming.py --quick         # tiny model, short sequences (seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bicodec_shm.client.streaming import (
    HOP,
    PRESETS,
    SAMPLE_RATE,
    DecodeStream,
    StreamSettings,
)
from bicodec_shm.model import BiCodecDecoder

JOINT_MS = 20.0
DEFAULT_ROWS = ("peers", "default", "exact")
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "out", "bench_streaming.json")


def receptive_field(model: BiCodecDecoder, n_tokens: int = 200) -> dict[str, int]:
    """Tokens on each side that one token's features reach in the output (structural).

    A NaN put into the de-quantised features of the middle token propagates through every
    convolution that touches it (0·NaN is NaN), so the NaN span is the receptive field whatever
    the weights' scale; random weights make far influence tiny but not zero.
    """
    mid = n_tokens // 2
    gen = torch.Generator().manual_seed(0)
    semantic = torch.randint(0, model.config.semantic_vocab, (1, n_tokens), generator=gen)
    n_global = model.config.n_global
    global_ids = torch.randint(0, model.config.global_vocab, (1, n_global), generator=gen)

    def plant_nan(_module: Any, _inputs: Any, z: torch.Tensor) -> torch.Tensor:
        z = z.clone()
        z[:, :, mid] = float("nan")  # z (B, C, T)
        return z

    handle = model.quantizer.register_forward_hook(plant_nan)
    try:
        with torch.inference_mode():
            audio = model(semantic, global_ids)[0, 0].numpy()  # (1, 1, N) -> (N,)
    finally:
        handle.remove()
    nan = np.flatnonzero(np.isnan(audio))
    return {
        "left_tokens": mid - int(nan[0]) // HOP,
        "right_tokens": int(nan[-1]) // HOP - mid,
        "left_samples": HOP * mid - int(nan[0]),
        "right_samples": int(nan[-1]) - (HOP * mid + HOP - 1),
    }


def _stream(model: BiCodecDecoder, semantic: np.ndarray, global_ids: np.ndarray,
            settings: StreamSettings) -> dict[str, Any]:  # fmt: skip
    """Push ``semantic`` one token at a time; the float output and the first-audio timing."""
    stream = DecodeStream(model, global_ids, dtype="float32", **asdict(settings))
    parts: list[bytes] = []
    first_tokens, first_wall = None, None
    for i in range(len(semantic)):
        t0 = time.perf_counter()
        out = stream.push(semantic[i : i + 1])
        if out and first_tokens is None:
            first_tokens, first_wall = i + 1, time.perf_counter() - t0
        parts.append(out)
    t0 = time.perf_counter()
    parts.append(stream.finish())
    if first_tokens is None:  # the whole sequence was shorter than one chunk + lookahead
        first_tokens, first_wall = len(semantic), time.perf_counter() - t0
    audio = np.frombuffer(b"".join(parts), dtype="<f4")
    assert len(audio) == HOP * len(semantic), "streamed length is not hop x tokens"
    return {"audio": audio, "joints": stream.joints, "first_tokens": first_tokens,
            "first_wall_s": first_wall, "decoded": stream.tokens_decoded}  # fmt: skip


def _int16(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, -1.0, 1.0) * np.float32(32767)).astype(np.int16)


def _snr_db(signal_energy: float, error_energy: float) -> float | None:
    """None when the error is exactly zero (infinite SNR)."""
    if error_energy == 0.0:
        return None
    return 10.0 * math.log10(signal_energy / error_energy)


def bench_streaming(
    *,
    preset: str = "spark-tts-0.5b",
    sequences: int = 3,
    min_tokens: int = 250,
    max_tokens: int = 1000,
    rows: dict[str, StreamSettings] | None = None,
    seed: int = 0,
    probe_receptive_field: bool = True,
) -> dict[str, Any]:
    """Stream random sequences under each setting and compare with the full decode.

    Returns:
        {"model": ..., "sequences": [lengths], "receptive_field": {...} or None,
         "full_decode_s": [...], "rows": [{"name", settings..., metrics...}, ...]}
    """
    rows = {name: PRESETS[name] for name in DEFAULT_ROWS} if rows is None else rows
    model = BiCodecDecoder.from_config(preset, seed=0)
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(min_tokens, max_tokens + 1, sequences)]
    data = [(rng.integers(0, 8192, n), rng.integers(0, 4096, 32)) for n in lengths]
    field = receptive_field(model) if probe_receptive_field else None  # also warms the model up

    full, full_s = [], []
    for semantic, global_ids in tqdm(data, desc="full decodes", file=sys.stderr):
        t0 = time.perf_counter()
        full.append(model.detokenize(semantic[None], global_ids[None])[0].numpy())
        full_s.append(time.perf_counter() - t0)

    half = round(JOINT_MS * SAMPLE_RATE / 1000)
    results = []
    total = sum(lengths) * len(rows)
    with tqdm(total=total, desc="streamed tokens", unit="tok", file=sys.stderr) as bar:
        for name, settings in rows.items():
            acc = dict.fromkeys(("sig", "err", "jsig", "jerr", "max", "jmax", "lsb"), 0.0)
            first_tokens, first_wall, work = [], [], 0
            for (semantic, global_ids), ref in zip(data, full, strict=True):
                run = _stream(model, semantic, global_ids, settings)
                diff = run["audio"] - ref
                near = np.zeros(len(ref), bool)
                for j in run["joints"]:
                    near[max(0, j - half) : j + half] = True
                acc["sig"] += float(np.sum(ref.astype(np.float64) ** 2))
                acc["err"] += float(np.sum(diff.astype(np.float64) ** 2))
                acc["jsig"] += float(np.sum(ref[near].astype(np.float64) ** 2))
                acc["jerr"] += float(np.sum(diff[near].astype(np.float64) ** 2))
                acc["max"] = max(acc["max"], float(np.abs(diff).max()))
                acc["jmax"] = max(acc["jmax"], float(np.abs(diff[near]).max(initial=0.0)))
                lsb = np.abs(_int16(run["audio"]).astype(np.int32) - _int16(ref))
                acc["lsb"] = max(acc["lsb"], float(lsb.max()))
                first_tokens.append(run["first_tokens"])
                first_wall.append(run["first_wall_s"])
                work += run["decoded"]
                bar.update(len(semantic))
            results.append({
                "name": name,
                **asdict(settings),
                "first_audio_tokens": int(max(first_tokens)),
                "first_decode_ms": 1000 * float(np.median(first_wall)),
                "added_delay_ms": settings.lookahead * 1000 * HOP / SAMPLE_RATE,
                "work": work / sum(lengths),
                "snr_db": _snr_db(acc["sig"], acc["err"]),
                "max_abs": acc["max"],
                "snr_joint_db": _snr_db(acc["jsig"], acc["jerr"]) if acc["jsig"] else None,
                "max_abs_joint": acc["jmax"],
                "max_lsb": int(acc["lsb"]),
            })  # fmt: skip
    return {
        "model": preset,
        "sequences": lengths,
        "receptive_field": field,
        "full_decode_s": full_s,
        "joint_window_ms": JOINT_MS,
        "rows": results,
    }


def format_table(result: dict[str, Any]) -> str:
    """The rows as a fixed-width text table, with a header naming the conditions."""
    lengths = result["sequences"]
    lines = [
        f"model {result['model']} (random weights, seed 0); {len(lengths)} sequences of "
        f"{', '.join(map(str, lengths))} tokens; pushes of 1 token; joint = ±"
        f"{result['joint_window_ms']:g} ms around each region boundary",
    ]
    field = result["receptive_field"]
    if field:
        lines.append(
            f"receptive field (NaN probe): {field['left_tokens']} tokens left, "
            f"{field['right_tokens']} right ({field['left_samples']} / {field['right_samples']} "
            "samples beyond the token's own)"
        )
    header = (
        f"{'setting':<10} {'chunk':>5} {'left':>4} {'look':>4} {'xfade':>5} | "
        f"{'1st tok':>7} {'1st ms':>7} {'delay ms':>8} {'work':>5} | "
        f"{'SNR dB':>7} {'max|Δ|':>8} {'joint SNR':>9} {'joint max':>9} {'LSB':>5}"
    )
    lines += [header, "-" * len(header)]

    def db(v: float | None) -> str:
        return "exact" if v is None else f"{v:.1f}"

    for r in result["rows"]:
        lines.append(
            f"{r['name']:<10} {r['chunk_tokens']:>5} {r['left_context']:>4} {r['lookahead']:>4} "
            f"{r['crossfade']:>5} | {r['first_audio_tokens']:>7} {r['first_decode_ms']:>7.0f} "
            f"{r['added_delay_ms']:>8.0f} {r['work']:>5.2f} | {db(r['snr_db']):>7} "
            f"{r['max_abs']:>8.2g} {db(r['snr_joint_db']):>9} {r['max_abs_joint']:>9.2g} "
            f"{r['max_lsb']:>5}"
        )
    lines.append(
        "1st tok: tokens pushed before the first audio; 1st ms: wall time of that push (median); "
        "delay: lookahead; work: tokens decoded per token; LSB: largest int16 difference"
    )
    return "\n".join(lines)


def _parse_setting(text: str) -> tuple[str, StreamSettings]:
    """``NAME=CHUNK/LEFT/LOOKAHEAD/CROSSFADE`` -> (NAME, settings)."""
    try:
        name, spec = text.split("=", 1)
        chunk, left, look, fade = (int(v) for v in spec.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected NAME=CHUNK/LEFT/LOOKAHEAD/CROSSFADE, e.g. mine=25/25/20/0, got {text!r}"
        ) from None
    try:
        return name, StreamSettings(chunk, left, look, fade)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=None, help="model size: spark-tts-0.5b or tiny")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 2 sequences of 250-400 tokens (seconds)")  # fmt: skip
    parser.add_argument("--sequences", type=int, default=None, help="default 3 (quick: 2)")
    parser.add_argument("--min-tokens", type=int, default=None, help="default 250")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 1000 (quick: 400)")
    parser.add_argument("--settings", type=_parse_setting, action="append", default=[],
                        metavar="NAME=C/L/A/X",
                        help="extra row: chunk/left_context/lookahead/crossfade")  # fmt: skip
    parser.add_argument("--only", action="store_true", help="run only the --settings rows")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token sequences")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", default=DEFAULT_OUT, help=f"output file (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = {} if args.only else {name: PRESETS[name] for name in DEFAULT_ROWS}
    rows.update(dict(args.settings))
    if not rows:
        parser.error("--only needs at least one --settings row")
    result = bench_streaming(
        preset=args.preset or ("tiny" if args.quick else "spark-tts-0.5b"),
        sequences=args.sequences or (2 if args.quick else 3),
        min_tokens=args.min_tokens or 250,
        max_tokens=args.max_tokens or (400 if args.quick else 1000),
        rows=rows,
        seed=args.seed,
    )
    print(format_table(result))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
