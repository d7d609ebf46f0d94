"""Checks of the encode path's audio: each bad value is a ValueError that names the argument and,
for a bad sample, its row and position."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..inputs import check_waves

AudioLike = torch.Tensor | np.ndarray

# The widest batch: transformers' MimiConv1d computes its right padding in float32, which rounds
# widths past 2**24 (699 s at 24 kHz) and drops a stride-4 convolution's last, partial output.
MAX_SAMPLES = 2**24


def check_audio(audio: AudioLike, lengths: Any, *, sample_rate: int | None,
                expected_rate: int) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
    """``audio`` as a float32 (B, T) tensor (a (T,) waveform becomes a batch of one) and each row's
    valid samples, in ``[1, T]`` (all T if ``lengths`` is None): ``model.inputs.check_waves``,
    and at most ``MAX_SAMPLES`` a row at ``expected_rate``."""
    if sample_rate is not None and sample_rate != expected_rate:
        raise ValueError(
            f"sample_rate={sample_rate!r}: the encoder takes {expected_rate} Hz audio only; resample it "
            f"first (DecoderClient.encode(audio, sample_rate=...) resamples as qwen-tts does)"
        )
    width = audio.shape[-1] if isinstance(audio, (torch.Tensor, np.ndarray)) and audio.ndim else 0
    if width > MAX_SAMPLES:
        raise ValueError(f"audio has {width} samples a row; the encoder takes at most {MAX_SAMPLES} "
                         f"(transformers' convolutions compute their padding in float32)")  # fmt: skip
    wave, lens = check_waves("audio", audio, lengths, dtype=torch.float32, one_row=True)
    return wave, lens.tolist()
