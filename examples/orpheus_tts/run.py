"""Orpheus TTS's streaming loop in N worker processes: each its own SNAC, or one shared server.

Each worker serves utterances one after another the way Orpheus's ``OrpheusModel.generate_speech``
does: its language model's streamed text goes into ``tokens_decoder_sync``, whose int16 chunks
go out to the listener as they come. The language model is a stand-in: random audio tokens, as
vLLM streams them (each item the whole text so far), ``--rate`` tokens per second. The default,
100 tokens/s, is 1.2x Orpheus's real-time rate of 82 tokens/s (7 tokens per 2048-sample frame at
24 kHz): a model that generated slower than that would stall whatever decodes it.

- ``own``: the worker decodes with a SNAC of its own (``client=`` an in-process ``SNACDecoder``),
  as Orpheus's module does in every process that imports it;
- ``shared``: ``tokens_decoder_sync(..., name=NAME)``, through one ``bicodec-shm serve --codec
  snac-24khz`` that this script starts and stops.

Both run the same windows (``--stream-preset``), so only where the decode runs differs::

    python -m examples.orpheus_tts.run --workers 1 4 16            # tiny codec, on the CPU
    python -m examples.orpheus_tts.run --preset full --device cuda:0 --workers 1 4 16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from examples import dropin_load

SAMPLE_RATE = 24000
RATE = 100.0  # tokens per second; 82 is real time
PRESETS = {"tiny": "tiny-24khz", "full": "snac-24khz"}


def stand_in_lm(rng: np.random.Generator, frames: int, rate: float, start: float) -> Iterator[str]:
    """vLLM's streamed ``outputs[0].text`` of an utterance of ``frames`` frames: token ``i`` is
    ready ``(i + 1) / rate`` seconds after ``start``; a late reader finds it waiting."""
    text = ""
    for i in range(frames * 7):
        code = int(rng.integers(0, 4096))
        delay = start + (i + 1) / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        text += f"<custom_token_{10 + 4096 * (i % 7) + code}>"
        yield text


def load_decoder(settings: dict[str, Any]) -> Any:
    from bicodec_shm.integrations.orpheus_tts import shared_client

    if settings["mode"] == "shared":
        return shared_client(settings["name"])  # imports no torch
    import torch

    from bicodec_shm.model.snac import SNACDecoder

    torch.set_num_threads(settings["threads"])
    return SNACDecoder.from_config(PRESETS[settings["preset"]], seed=settings["seed"]).to(settings["device"])


def worker(index: int, settings: dict[str, Any]) -> list[dropin_load.Record]:
    from bicodec_shm.integrations.orpheus_tts import tokens_decoder_sync

    decoder = load_decoder(settings)
    warm_up = np.random.default_rng(index)
    for _ in tokens_decoder_sync(stand_in_lm(warm_up, 8, 1e9, 0.0), client=decoder):
        pass  # the first decodes pay for allocation (and for CUDA, kernel loading)
    settings["ready"]()
    records = []
    for u in range(settings["utterances"]):
        rng = np.random.default_rng([settings["seed"], index, u])
        clock = dropin_load.Clock(SAMPLE_RATE)
        tokens = stand_in_lm(rng, settings["frames"], settings["rate"], clock.start)
        for pcm in tokens_decoder_sync(tokens, client=decoder, preset=settings["stream_preset"]):
            clock.chunk(len(pcm) // 2)  # here a server would send the chunk to its listener
        records.append(clock.record(index))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dropin_load.add_arguments(parser, rate=RATE, default_preset="tiny")
    parser.add_argument("--frames", type=int, default=40, help="frames per utterance (40 = 3.4 s)")
    parser.add_argument("--stream-preset", default="default", choices=["default", "exact", "orpheus"])
    args = parser.parse_args(argv)
    server = ["--codec", "snac-24khz", "--preset", PRESETS[args.preset], "--seed", str(args.seed),
              "--device", args.device, "--threads", str(dropin_load.server_threads(args))]  # fmt: skip
    settings = {"preset": args.preset, "seed": args.seed, "device": args.device,
                "utterances": args.utterances, "frames": args.frames, "rate": args.rate,
                "stream_preset": args.stream_preset}  # fmt: skip
    seconds = args.frames * 2048 / SAMPLE_RATE
    print(f"Orpheus stand-in: {args.frames} frames ({seconds:.1f} s) per utterance at {args.rate:g} "
          f"tokens/s, stream preset {args.stream_preset}, codec {PRESETS[args.preset]} on "
          f"{args.device}")  # fmt: skip
    return dropin_load.main(args, worker, server, settings)


if __name__ == "__main__":
    raise SystemExit(main())
