"""Spark-TTS's ``inference`` in N worker processes: each its own BiCodec decoder, or one shared.

Each worker serves utterances one after another as ``SparkTTS.inference`` does in voice creation
(``gender``/``pitch``/``speed``): its language model writes 32 global tokens and then the
semantic tokens as text, the ids are parsed out of it into ``torch.long`` tensors of shapes
(1, 32) and (1, T), and ``audio_tokenizer.detokenize`` turns them into the waveform
(``SparkTTS.inference_tail`` below). The language model is a stand-in that writes random ids at
``--rate`` tokens per second. The default, 100 tokens/s, is
twice BiCodec's real-time rate of 50 semantic tokens per second of audio; ``inference`` returns
nothing before the whole utterance is written and decoded, so time to first audio is the
generation time plus the decode.

- ``own``: ``audio_tokenizer`` decodes with a BiCodec decoder of the worker's own, as
  ``BiCodecTokenizer`` does in every Spark-TTS process;
- ``shared``: ``model.audio_tokenizer = SharedAudioTokenizer(NAME)``, one ``bicodec-shm
  serve`` that this script starts and stops::

    python -m examples.spark_tts.run --workers 1 4 16              # tiny decoder, on the CPU
    python -m examples.spark_tts.run --preset full --device cuda:0 --workers 1 4 16
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

import numpy as np

from examples import dropin_load

SAMPLE_RATE = 16000
RATE = 100.0  # tokens per second; 50 semantic tokens are one second of audio
PRESETS = {"tiny": "tiny", "full": "spark-tts-0.5b"}


class OwnAudioTokenizer:
    """``BiCodecTokenizer.detokenize`` on a decoder in this process (Spark-TTS's own path)."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def detokenize(self, global_tokens: Any, semantic_tokens: Any) -> np.ndarray:
        wav_rec = self.decoder.detokenize(semantic_tokens, global_tokens)  # (B, 320·T)
        return wav_rec.detach().squeeze().cpu().numpy()


class SparkTTS:
    """What ``SparkTTS.inference`` does after its language model, with a stand-in for the model."""

    def __init__(self, audio_tokenizer: Any, device: str, rate: float) -> None:
        import torch

        self.audio_tokenizer = audio_tokenizer
        self.device = torch.device(device)
        self.rate = rate

    def stand_in_lm(self, rng: np.random.Generator, semantic: int, start: float) -> str:
        """The decoded text of ``model.generate``: 32 global ids, then ``semantic`` ids, returned
        once all of them would have been generated at ``rate`` tokens/s after ``start``."""
        text = "".join(f"<|bicodec_global_{i}|>" for i in rng.integers(0, 4096, 32))
        text += "".join(f"<|bicodec_semantic_{i}|>" for i in rng.integers(0, 8192, semantic))
        delay = start + (32 + semantic) / self.rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return text

    def inference_tail(self, predicts: str) -> np.ndarray:
        """From the generated text on, as ``SparkTTS.inference`` goes (voice creation): the ids
        are parsed out of the text into int64 tensors on the model's device, global ids (1, 1,
        32) given as (1, 32), semantic ids (1, T); the tokenizer returns the waveform."""
        import torch

        def ids(kind: str) -> torch.Tensor:
            return torch.tensor([int(i) for i in re.findall(rf"bicodec_{kind}_(\d+)", predicts)]).long()

        global_ids = ids("global")[None, None].to(self.device)  # (1, 1, 32)
        semantic_ids = ids("semantic")[None].to(self.device)  # (1, T)
        return self.audio_tokenizer.detokenize(global_ids.squeeze(0), semantic_ids)


def load_tokenizer(settings: dict[str, Any]) -> Any:
    import torch

    torch.set_num_threads(settings["threads"])
    if settings["mode"] == "shared":
        from bicodec_shm.integrations.spark_tts import SharedAudioTokenizer

        return SharedAudioTokenizer(settings["name"])
    from bicodec_shm import BiCodecDecoder

    decoder = BiCodecDecoder.from_config(PRESETS[settings["preset"]], seed=settings["seed"])
    return OwnAudioTokenizer(decoder.to(settings["device"]))


def worker(index: int, settings: dict[str, Any]) -> list[dropin_load.Record]:
    model = SparkTTS(load_tokenizer(settings), settings["device"], settings["rate"])
    model.inference_tail(model.stand_in_lm(np.random.default_rng(index), 50, 0.0))  # warm-up
    settings["ready"]()
    records = []
    for u in range(settings["utterances"]):
        rng = np.random.default_rng([settings["seed"], index, u])
        clock = dropin_load.Clock(SAMPLE_RATE)
        wav = model.inference_tail(model.stand_in_lm(rng, settings["tokens"], clock.start))
        clock.chunk(len(wav))  # the whole utterance at once: Spark-TTS does not stream
        records.append(clock.record(index))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dropin_load.add_arguments(parser, rate=RATE, default_preset="tiny")
    parser.add_argument("--tokens", type=int, default=150, help="semantic tokens per utterance (150 = 3 s)")
    args = parser.parse_args(argv)
    server = ["--preset", PRESETS[args.preset], "--seed", str(args.seed), "--device", args.device,
              "--threads", str(dropin_load.server_threads(args))]  # fmt: skip
    settings = {"preset": args.preset, "seed": args.seed, "device": args.device,
                "utterances": args.utterances, "tokens": args.tokens, "rate": args.rate}  # fmt: skip
    print(f"Spark-TTS stand-in: {args.tokens} semantic tokens ({args.tokens / 50:.1f} s) per utterance at "
          f"{args.rate:g} tokens/s, decoder {PRESETS[args.preset]} on {args.device}")  # fmt: skip
    return dropin_load.main(args, worker, server, settings)


if __name__ == "__main__":
    raise SystemExit(main())
