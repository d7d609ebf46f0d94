"""The Orpheus drop-in's presets (``bicodec_shm.integrations.orpheus_tts``) against the whole decode.

Random Orpheus audio tokens of ``--utterances`` utterances of ``--frames`` frames go, one
``<custom_token_N>`` item at a time, through ``tokens_decoder_sync`` on an in-process
``SNACDecoder`` (the server gives the same audio within 1 LSB: tests/test_orpheus_tts.py), once
per preset. Each preset's int16 output is compared with the whole utterance decoded at once with
the same noise seed, over the samples it plays: all of them for ``default`` and ``exact``,
frames 1 .. n-3 for ``orpheus`` (Orpheus's own windows and slice). Reported: SNR (dB) over all
utterances, frames played, the first audio (in tokens), the frames decoded per frame, the chunk
sizes (frames), and the SNR against ``orpheus``'s output (Orpheus's chunks within 1 LSB,
tests/test_orpheus_tts.py) over the frames both play.

    python benchmarks/bench_orpheus_dropin.py [--preset snac-24khz] [--frames 47]
        [--utterances 4] [--threads N] [--json PATH]
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

from bicodec_shm.codecs import codes_to_orpheus  # noqa: E402
from bicodec_shm.integrations.orpheus_tts import PRESETS, OrpheusStream  # noqa: E402
from bicodec_shm.model.snac import SNACDecoder  # noqa: E402

SPF = 2048  # samples per frame at 24 kHz


def pcm16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1.0, 1.0) * np.float32(32767)).astype(np.int16)


def bench(model: SNACDecoder, frames: int, utterances: int) -> list[dict[str, Any]]:
    totals = {p: {"signal": 0.0, "error": 0.0, "played": 0, "first": None, "decoded": 0, "chunks": set(),
                  "vs_signal": 0.0, "vs_error": 0.0} for p in PRESETS}  # fmt: skip
    for u in range(utterances):
        rng = np.random.default_rng(100 + u)
        levels = [rng.integers(0, 4096, frames * r) for r in (1, 2, 4)]
        full = model.detokenize([torch.from_numpy(v)[None] for v in levels], noise_seeds=[0])[0].numpy()
        want = pcm16(full).astype(np.float64)
        items = [f"<custom_token_{n}>" for n in codes_to_orpheus(levels, base=10)]
        played = {}
        for preset, t in totals.items():
            stream = OrpheusStream(model, preset=preset)
            parts = []
            for i, item in enumerate(items):
                out = stream.push(item)
                if out and t["first"] is None:
                    t["first"] = i + 1
                parts.append(out)
            parts.append(stream.finish())
            got = np.frombuffer(b"".join(parts), "<i2").astype(np.float64)
            t["chunks"].update(len(c) // (2 * SPF) for c in parts if c)
            played[preset] = got
            ref = want[SPF : SPF + len(got)] if preset == "orpheus" else want
            assert len(got) == len(ref), (preset, len(got), len(ref))
            t["signal"] += float(np.sum(ref**2))
            t["error"] += float(np.sum((got - ref) ** 2))
            t["played"] += len(got) // SPF
            t["decoded"] += stream.frames_decoded
        theirs = played["orpheus"]  # PRESETS ends with it
        for preset, t in totals.items():
            same = played[preset] if preset == "orpheus" else played[preset][SPF : SPF + len(theirs)]
            t["vs_signal"] += float(np.sum(theirs**2))
            t["vs_error"] += float(np.sum((same - theirs) ** 2))
    return [{"preset": p, "snr_db": 10 * np.log10(t["signal"] / max(t["error"], 1e-30)),
             "frames_played": t["played"], "frames": frames * utterances, "first_audio_tokens": t["first"],
             "decoded_per_frame": t["decoded"] / (frames * utterances), "chunk_frames": sorted(t["chunks"]),
             "snr_vs_orpheus_db": 10 * np.log10(t["vs_signal"] / max(t["vs_error"], 1e-30))}
            for p, t in totals.items()]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="snac-24khz", choices=["snac-24khz", "tiny-24khz"])
    parser.add_argument("--frames", type=int, default=47)
    parser.add_argument("--utterances", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = SNACDecoder.from_config(args.preset, seed=0)
    start = time.perf_counter()
    rows = bench(model, args.frames, args.utterances)
    print(f"{args.preset}, random weights: {args.utterances} utterances of {args.frames} frames "
          f"({time.strftime('%Y-%m-%d')}, {time.perf_counter() - start:.0f} s)")  # fmt: skip
    print(f"{'preset':<8} {'SNR':>8} {'frames played':>14} {'first audio':>12} {'decoded/frame':>14} "
          f"{'chunks (frames)':>16} {'vs orpheus':>11}")  # fmt: skip
    for r in rows:
        print(f"{r['preset']:<8} {r['snr_db']:>5.1f} dB {r['frames_played']:>7}/{r['frames']:<6} "
              f"{r['first_audio_tokens']:>6} tok {r['decoded_per_frame']:>14.2f} "
              f"{','.join(map(str, r['chunk_frames'])):>16} "
              + (f"{'-':>11}" if r["preset"] == "orpheus" else f"{r['snr_vs_orpheus_db']:>8.1f} dB"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
