"""Audio at another sample rate brought to a codec's, as the codec's own upstream does it, so that
the codes are those upstream computes for the same clip. Runs in the client process (the server
only ever sees audio at its codec's rate). numpy, and ``soxr``, imported when first needed.

Each codec says how its upstream resamples (``CodecLayout.resampling``):

    bicodec         Spark-TTS's ``load_audio``: ``soxr.resample(x, sr, 16000, quality="VHQ")``,
                    as long as soxr makes it
    qwen3-tts-12hz  qwen-tts's ``Qwen3TTSTokenizer.encode``: ``librosa.resample(y, orig_sr=sr,
                    target_sr=24000)``, whose default ``res_type="soxr_hq"`` is
                    ``soxr.resample(y, sr, 24000, quality="HQ")``, padded with zeros (or cut) to
                    ``ceil(N · 24000 / sr)`` samples (librosa's ``fix=True``)

soxr resamples in the precision it is given: float64 audio stays float64 until it is resampled
(Spark-TTS resamples the float64 samples soundfile reads), float32 and int16 audio (``x / 32768``)
are resampled as float32 (qwen-tts casts to float32 first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_SAMPLE_RATE = 1_000_000  # Hz: a rate above this is a slip (samples passed for the rate), never audio


@dataclass(frozen=True)
class Resampling:
    """How one codec's upstream resamples audio at another rate to the codec's.

    Args:
        quality: soxr's quality (``"VHQ"``, ``"HQ"``, ...).
        fixed_length: whether the result is padded with zeros (or cut) to ``ceil(N · to / from)``
            samples, as ``librosa.resample`` does; otherwise it is as long as soxr makes it.
    """

    quality: str
    fixed_length: bool = False

    def resample(self, audio: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
        """``audio``, (N,) float32 or float64, at ``to_rate``: an array of the same dtype."""
        if from_rate == to_rate:
            return audio
        out = soxr_module().resample(audio, from_rate, to_rate, quality=self.quality)
        if self.fixed_length:
            n = math.ceil(audio.shape[0] * (float(to_rate) / from_rate))  # librosa's n_samples
            out = out[:n] if out.shape[0] >= n else np.pad(out, (0, n - out.shape[0]))
        return out


# Spark-TTS's sparktts/utils/audio.py load_audio: soxr.resample(audio, sr, sampling_rate, quality="VHQ").
SOXR_VHQ = Resampling("VHQ")
# librosa.resample's defaults (res_type="soxr_hq", fix=True), as qwen-tts's encode calls it.
LIBROSA = Resampling("HQ", fixed_length=True)
# soxr's own default, for a codec whose upstream encodes nothing at another rate.
SOXR_HQ = Resampling("HQ")


def check_rate(rate: Any, what: str = "sample_rate") -> int:
    """``rate`` as an int in ``[1, MAX_SAMPLE_RATE]`` Hz; a ``ValueError`` naming it otherwise
    (bools, floats and other types refused: a rate is a whole number of samples per second)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)):
        raise ValueError(f"{what} must be an int (Hz), got {rate!r}")
    if not 1 <= int(rate) <= MAX_SAMPLE_RATE:
        raise ValueError(f"{what}={int(rate)} Hz is not a sample rate: it must be in "
                         f"[1, {MAX_SAMPLE_RATE}] Hz")  # fmt: skip
    return int(rate)


def soxr_module() -> Any:
    """The ``soxr`` module, or an ``ImportError`` saying how to install it."""
    try:
        import soxr
    except ImportError:
        raise ImportError(
            "audio at another sample rate than the codec's is resampled with soxr, which is not "
            "installed: pip install soxr (or pass the audio at the codec's rate)"
        ) from None
    return soxr
