"""The mel spectrogram BiCodec's speaker encoder reads, without torchaudio.

Spark-TTS builds ``torchaudio.transforms.MelSpectrogram(sample_rate, n_fft, win_length,
hop_length, f_min, f_max, n_mels=num_mels, power=1, norm="slaney", mel_scale="slaney")``; its
other arguments keep torchaudio's defaults: a periodic Hann window of ``win_length`` centred in
``n_fft``, ``center=True`` with reflect padding, one-sided, not normalised, ``f_max`` None
meaning ``sample_rate / 2``. This module computes the same with ``torch.stft`` and a Slaney
filterbank built here (torchaudio cannot be installed beside the project's torch build); it is
checked against torchaudio's own output in ``tests/test_spark_encode_reference.py``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .encode_config import MelConfig

# Slaney's mel scale (librosa's default, torchaudio's mel_scale="slaney"): linear below 1 kHz
# at 200/3 Hz per mel, logarithmic above, 27 mels per factor 6.4.
_HZ_PER_MEL = 200.0 / 3.0
_LOG_START_HZ = 1000.0
_LOG_START_MEL = _LOG_START_HZ / _HZ_PER_MEL
_LOG_STEP = math.log(6.4) / 27.0


def hz_to_mel(hz: float) -> float:
    """Slaney mel of a frequency in Hz."""
    if hz < _LOG_START_HZ:
        return hz / _HZ_PER_MEL
    return _LOG_START_MEL + math.log(hz / _LOG_START_HZ) / _LOG_STEP


def mel_to_hz(mels: torch.Tensor) -> torch.Tensor:
    """Slaney mels -> Hz, elementwise, in ``mels``' dtype."""
    linear = mels * _HZ_PER_MEL
    logarithmic = _LOG_START_HZ * torch.exp(_LOG_STEP * (mels - _LOG_START_MEL))
    return torch.where(mels >= _LOG_START_MEL, logarithmic, linear)


def mel_filterbank(cfg: MelConfig) -> torch.Tensor:
    """(n_fft // 2 + 1, num_mels) float32: triangles between mel-spaced edges, each scaled by
    ``2 / (upper edge - lower edge)`` (Slaney's area normalisation).

    Computed in float32 in torchaudio's order of operations: its edges carry float32 rounding
    (~1e-3 Hz at 8 kHz), which moves the narrow low-frequency triangles by ~1e-5 of their
    height; a float64 filterbank would differ from torchaudio's by that much.
    """
    n_freqs = cfg.n_fft // 2 + 1
    f_max = cfg.mel_fmax if cfg.mel_fmax is not None else cfg.sample_rate / 2
    freqs = torch.linspace(0, cfg.sample_rate // 2, n_freqs, dtype=torch.float32)
    mels = torch.linspace(hz_to_mel(cfg.mel_fmin), hz_to_mel(f_max), cfg.num_mels + 2,
                          dtype=torch.float32)  # fmt: skip
    edges = mel_to_hz(mels)  # (num_mels + 2,)
    widths = edges[1:] - edges[:-1]  # (num_mels + 1,)
    slopes = edges[None, :] - freqs[:, None]  # (n_freqs, num_mels + 2)
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    bank = torch.clamp(torch.minimum(rising, falling), min=0.0)  # (n_freqs, num_mels)
    return bank * (2.0 / (edges[2:] - edges[:-2]))[None, :]


class MelSpectrogram(nn.Module):
    """Magnitude (power 1) mel spectrogram, as Spark-TTS's mel transform computes it.

    Args:
        cfg: the ``mel_params`` section of the BiCodec config.
    """

    def __init__(self, cfg: MelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("window", torch.hann_window(cfg.win_length), persistent=False)
        self.register_buffer("filterbank", mel_filterbank(cfg), persistent=False)

    def n_frames(self, n_samples: int) -> int:
        """Frames of a clip of ``n_samples`` (centred frames: one per hop, plus one)."""
        return n_samples // self.cfg.hop_length + 1

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        """wav (B, N) float32 -> mel (B, num_mels, N // hop + 1) float32.

        Each row is transformed alone (no mixing across the batch), so a batch of equal-length
        clips gives each row its lone result.
        """
        if wav.shape[-1] <= self.cfg.n_fft // 2:
            # Reflect padding needs more samples than it pads; say so in our own words.
            raise ValueError(
                f"a mel spectrogram needs more than n_fft / 2 = {self.cfg.n_fft // 2} samples, "
                f"got {wav.shape[-1]}"
            )
        spec = torch.stft(wav, self.cfg.n_fft, self.cfg.hop_length, self.cfg.win_length,
                          self.window, center=True, pad_mode="reflect", normalized=False,
                          onesided=True, return_complex=True)  # fmt: skip
        magnitude = spec.abs()  # (B, n_freqs, F)
        # (B, F, n_freqs) @ (n_freqs, num_mels) -> (B, F, num_mels) -> (B, num_mels, F)
        return torch.matmul(magnitude.transpose(1, 2), self.filterbank).transpose(1, 2)
