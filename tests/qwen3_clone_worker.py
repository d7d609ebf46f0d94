"""A Qwen3-TTS worker process for the voice-cloning replay test: ask a ``SharedSpeechTokenizer``
what ``generate_voice_clone`` asked of qwen-tts's own tokenizer in
``fixtures/qwen3_clone_reference.npz``, every call of every round at once, and save what came
back.

Usage: python qwen3_clone_worker.py NAME FIXTURE.npz ROUNDS OUT.npz

Each round sends, concurrently, for each case: ``encode`` of the reference clip at its own rate
(``sr=24000`` or ``sr=16000``, as ``create_voice_clone_prompt`` passes it: the 16 kHz one is
resampled in this process as qwen-tts's tokenizer does) and ``decode([{"audio_codes": codes}])``
of the codes upstream's run decoded, as torch tensors (qwen-tts's). Writes, per round r and case:
``r/<case>/encode_codes``, ``r/<case>/decoded``, and ``r/<case>/wav``: the
decoded audio cut after the reference's frames as ``generate_voice_clone`` cuts it. Exits 0 on
success.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from bicodec_shm.integrations.qwen3_tts import SharedSpeechTokenizer

CASES = ("ref24k", "ref16k")


def clone_tail(tokenizer: SharedSpeechTokenizer, ref_codes: np.ndarray, codes: np.ndarray) -> tuple:
    """``generate_voice_clone``'s end: decode the reference's and the talker's codes as one row,
    then cut the reference's share of the audio off; (decoded, wav)."""
    wavs, fs = tokenizer.decode([{"audio_codes": torch.from_numpy(codes)}])
    assert fs == 24000
    cut = int(len(ref_codes) / max(len(codes), 1) * wavs[0].shape[0])
    return wavs[0], wavs[0][cut:]


def main() -> int:
    name, fixture, rounds, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with np.load(fixture) as data:
        ran = {k: data[k] for k in data.files}
    tokenizer = SharedSpeechTokenizer(name, timeout=120)
    arrays = {}
    with ThreadPoolExecutor(max_workers=4 * rounds) as pool:
        encodes = {(r, case): pool.submit(tokenizer.encode, ran[f"{case}/ref_wav"],
                                          sr=int(ran[f"{case}/ref_sr"]))
                   for r in range(rounds) for case in CASES}  # fmt: skip
        decodes = {(r, case): pool.submit(clone_tail, tokenizer, ran[f"{case}/encode_codes"],
                                          ran[f"{case}/decode_codes"])
                   for r in range(rounds) for case in CASES}  # fmt: skip
        for (r, case), future in encodes.items():
            (codes,) = future.result().audio_codes
            assert isinstance(codes, torch.Tensor) and codes.dtype == torch.int64
            arrays[f"{r}/{case}/encode_codes"] = codes.numpy()
        for (r, case), future in decodes.items():
            arrays[f"{r}/{case}/decoded"], arrays[f"{r}/{case}/wav"] = future.result()
    np.savez(out, **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
