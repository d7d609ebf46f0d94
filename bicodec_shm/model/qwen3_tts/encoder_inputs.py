"""Checks of the encode path's audio: each bad value is a ValueError that names the argument and,
for a bad sample, its row and position."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..inputs import check_lengths

AudioLike = torch.Tensor | np.ndarray

# The widest batch: transformers' MimiConv1d computes its right padding in float32, which rounds
# widths past 2**24 (699 s at 24 kHz) and drops a stride-4 convolution's last, partial output.
MAX_SAMPLES = 2**24


def check_audio(audio: AudioLike, lengths: Any, *, sample_rate: int | None,
                expected_rate: int) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
    """``audio`` as a float32 (B, T) tensor (a (T,) waveform becomes a batch of one) and each row's
    valid samples, in ``[1, T]`` (all T if ``lengths`` is None)."""
    if sample_rate is not None and sample_rate != expected_rate:
        raise ValueError(
            f"sample_rate={sample_rate!r}: the encoder takes {expected_rate} Hz audio only; resample it "
            f"first (qwen-tts resamples with librosa's soxr_hq, which this package does not reproduce)"
        )
    wave = torch.from_numpy(audio) if isinstance(audio, np.ndarray) else audio
    if not isinstance(wave, torch.Tensor):
        raise ValueError(f"audio must be a torch.Tensor or numpy array, got {type(audio).__name__}")
    if not wave.is_floating_point():
        raise ValueError(
            f"audio must be floating point, scaled to [-1, 1], got {wave.dtype} (divide int16 PCM by 32768)"
        )
    if wave.dim() == 1:
        wave = wave[None]  # (T,) -> (1, T)
    if wave.dim() != 2:
        raise ValueError(
            f"audio must be (T,) or (B, T) mono waveforms, got {wave.dim()}-D with shape {tuple(wave.shape)}"
        )
    batch, width = wave.shape
    if batch == 0 or width == 0:
        raise ValueError(f"audio has shape {tuple(wave.shape)}; need B >= 1 rows of T >= 1 samples")
    if width > MAX_SAMPLES:
        raise ValueError(f"audio has {width} samples a row; the encoder takes at most {MAX_SAMPLES} "
                         f"(transformers' convolutions compute their padding in float32)")  # fmt: skip
    lens = [width] * batch if lengths is None else check_lengths(lengths, batch, width).tolist()
    wave = wave.float()
    valid = torch.arange(width, device=wave.device) < torch.tensor(lens, device=wave.device)[:, None]
    bad = (~wave.isfinite() & valid).nonzero()
    if len(bad):
        row, pos = (int(v) for v in bad[0])
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ValueError(f"audio[{row}, {pos}] = {wave[row, pos].item()} is not finite{more}")
    return wave, lens
