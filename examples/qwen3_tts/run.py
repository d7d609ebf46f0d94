"""Qwen3-TTS's streaming loop in N worker processes: each its own 12 Hz decoder, or one shared server.

Each worker serves utterances one after another as a streaming Qwen3-TTS server does: its talker
emits one frame of 16 codes at a time (a 12.5 Hz frame, 80 ms of audio), each frame goes into a
``DecodeStream`` at once, and the PCM it returns goes out to the listener. The talker is a
stand-in: random codes, ``--rate`` frames per second. The default, 25 frames/s, is twice
real time (12.5 frames/s), as a talker on a GPU streams.

- ``own``: the worker decodes with a ``Qwen3TTSDecoder`` of its own, as ``qwen-tts`` does in
  every process that loads the model;
- ``shared``: the stream goes through one ``bicodec-shm serve --codec qwen3-tts-12hz`` that this
  script starts and stops, so every worker's windows batch together there.

Both run the same windows (``--stream-preset``), so only where the decode runs differs::

    python -m examples.qwen3_tts.run --workers 1 4 16            # tiny decoder, on the CPU
    python -m examples.qwen3_tts.run --preset full --device cuda:0 --workers 1 4 16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from examples import dropin_load

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
RATE = 25.0  # frames per second; 12.5 is real time
PRESETS = {"tiny": "tiny-12hz", "full": "qwen3-tts-12hz"}


def stand_in_talker(rng: np.random.Generator, frames: int, rate: float, start: float) -> Iterator[np.ndarray]:
    """A talker's frames of an utterance of ``frames`` frames, each ``(16, 1)`` codes in
    ``[0, 2048)``: frame ``i`` is ready ``(i + 1) / rate`` seconds after ``start``; a late reader
    finds it waiting."""
    for i in range(frames):
        delay = start + (i + 1) / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        yield rng.integers(0, 2048, (16, 1))


def load_decoder(settings: dict[str, Any]) -> Any:
    if settings["mode"] == "shared":
        from bicodec_shm import DecoderClient

        return DecoderClient(settings["name"], slots=4, timeout=120)  # imports no torch
    import torch

    from bicodec_shm.model.qwen3_tts import Qwen3TTSDecoder

    torch.set_num_threads(settings["threads"])
    model = Qwen3TTSDecoder.from_config(PRESETS[settings["preset"]], seed=settings["seed"])
    return model.to(settings["device"])


def speak(decoder: Any, frames: Iterator[np.ndarray], preset: str, clock: dropin_load.Clock | None) -> None:
    """Stream one utterance's frames through ``decoder``; each chunk of PCM goes to ``clock``."""
    from bicodec_shm.client.streaming import DecodeStream

    stream = DecodeStream(decoder, None, preset=preset)
    for frame in frames:
        pcm = stream.push(frame)
        if pcm and clock is not None:
            clock.chunk(len(pcm) // 2)  # here a server would send the chunk to its listener
    pcm = stream.finish()
    if pcm and clock is not None:
        clock.chunk(len(pcm) // 2)


def worker(index: int, settings: dict[str, Any]) -> list[dropin_load.Record]:
    decoder = load_decoder(settings)
    warm_up = stand_in_talker(np.random.default_rng(index), 8, 1e9, 0.0)
    speak(decoder, warm_up, settings["stream_preset"], None)
    settings["ready"]()  # the first decodes paid for allocation (and for CUDA, kernel loading)
    records = []
    for u in range(settings["utterances"]):
        rng = np.random.default_rng([settings["seed"], index, u])
        clock = dropin_load.Clock(SAMPLE_RATE)
        frames = stand_in_talker(rng, settings["frames"], settings["rate"], clock.start)
        speak(decoder, frames, settings["stream_preset"], clock)
        records.append(clock.record(index))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dropin_load.add_arguments(parser, rate=RATE, default_preset="tiny", unit="frames")
    parser.add_argument("--frames", type=int, default=50, help="frames per utterance (50 = 4 s)")
    parser.add_argument("--stream-preset", default="default", choices=["default", "exact", "peers"])
    args = parser.parse_args(argv)
    server = ["--codec", "qwen3-tts-12hz", "--preset", PRESETS[args.preset], "--seed", str(args.seed),
              "--device", args.device, "--threads", str(dropin_load.server_threads(args))]  # fmt: skip
    settings = {"preset": args.preset, "seed": args.seed, "device": args.device,
                "utterances": args.utterances, "frames": args.frames, "rate": args.rate,
                "stream_preset": args.stream_preset}  # fmt: skip
    seconds = args.frames * SAMPLES_PER_FRAME / SAMPLE_RATE
    print(f"Qwen3-TTS stand-in talker: {args.frames} frames ({seconds:.1f} s) per utterance at "
          f"{args.rate:g} frames/s, stream preset {args.stream_preset}, decoder "
          f"{PRESETS[args.preset]} on {args.device}")  # fmt: skip
    return dropin_load.main(args, worker, server, settings)


if __name__ == "__main__":
    raise SystemExit(main())
