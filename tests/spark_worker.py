"""A Spark-TTS worker process for tests/test_spark_worker.py: ``install()``, then build
``SparkTTS`` from a stand-in ``cli/SparkTTS.py`` (STANDIN_DIR) and tokenize prompt wavs through
the server, all at once from threads.

Usage: python spark_worker.py NAME|- STANDIN_DIR MODEL_DIR OUT.npz [WAV ...]

Records every file opened under MODEL_DIR while the model is built (an audit hook), and writes
``opened`` (those paths), ``modules`` (torch, transformers, bicodec_shm.model: whether each was
imported), ``tokenizer`` (its class name), and ``glb_i``/``sem_i`` for each WAV. Imports no torch.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def main() -> int:
    name, standin, model_dir, out, *wavs = sys.argv[1:]
    model_dir = os.path.realpath(model_dir)
    opened: list[str] = []
    watching = [True]

    def hook(event: str, args: tuple) -> None:
        if watching[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(model_dir + os.sep):
                opened.append(path)

    sys.addaudithook(hook)
    sys.path.insert(0, standin)
    if name != "-":  # "-": Spark-TTS's own tokenizer (the stand-in's), to show what it opens
        from bicodec_shm.integrations import spark_tts

        spark_tts.install(name, timeout=120)
    from cli.SparkTTS import SparkTTS  # the stand-in: SparkTTS's __init__ builds its tokenizer

    model = SparkTTS(model_dir, "cpu")
    watching[0] = False
    with ThreadPoolExecutor(max(1, len(wavs))) as pool:
        results = list(pool.map(model.audio_tokenizer.tokenize, wavs)) if wavs else []
    arrays = {"opened": np.array(opened, dtype=str),
              "modules": np.array([m in sys.modules for m in ("torch", "transformers", "bicodec_shm.model")]),
              "tokenizer": np.array(type(model.audio_tokenizer).__name__)}  # fmt: skip
    for i, (glb, sem) in enumerate(results):
        arrays[f"glb_{i}"], arrays[f"sem_{i}"] = glb, sem
    np.savez(out, **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
