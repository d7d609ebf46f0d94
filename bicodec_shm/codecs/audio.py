"""The encode direction for the client: audio checked before it is written, and the codes that
come back. numpy only (a torch tensor is read by duck typing, as token arrays are); soxr where a
clip comes at another rate than the codec's.

An encode request is one clip of mono audio: a 1-D float array in [-1, 1] (float32 or float64)
or int16 PCM (read as ``x / 32768``, as soundfile reads it), at the codec's sample rate or at a
rate the caller states, from which it is resampled here as the codec's upstream resamples
(``codecs/resample.py``). It crosses shared memory as float32 at the codec's rate, so the codes
are those of that float32 clip.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .layout import CodecLayout
from .resample import check_rate


class EncodedAudio(NamedTuple):
    """What ``DecoderClient.encode`` returns: the codes of one clip.

    ``codes``: one 1-D int32 array per code level, coarsest first; for ``n`` frames level ``i``
    holds ``n · rate_i`` codes (BiCodec: one level, its semantic ids at 50 per second).
    ``global_ids``: the clip's global ids, (n_global,) int32 (BiCodec: its 32 speaker ids), or
    None for a codec without them.
    """

    codes: tuple[np.ndarray, ...]
    global_ids: np.ndarray | None

    @property
    def semantic_ids(self) -> np.ndarray:
        """(T,) int32: level 0's codes (BiCodec's semantic ids), what ``decode`` takes first."""
        return self.codes[0]

    @property
    def frames(self) -> int:
        """T: frames of codes (BiCodec: semantic tokens)."""
        return int(self.codes[0].shape[0])


def check_sample_rate(sample_rate: Any) -> int | None:
    """A stated sample rate as an int, None for none (the clip is at the codec's rate); a
    ``ValueError`` naming it for anything but an int in [1, 1 MHz]."""
    return None if sample_rate is None else check_rate(sample_rate)


def at_codec_rate(audio: np.ndarray, sample_rate: int | None, codec: CodecLayout) -> np.ndarray:
    """A clip from :func:`read_audio` at ``sample_rate`` (None: the codec's) as the contiguous
    (M,) float32 array the codec's encoder takes: resampled to ``codec.sample_rate`` as its
    upstream does (``codec.resampling``) where the rates differ."""
    if sample_rate is not None and sample_rate != codec.sample_rate:
        audio = codec.resampling.resample(audio, sample_rate, codec.sample_rate)
    return np.ascontiguousarray(audio, dtype=np.float32)


def as_audio(audio: Any) -> np.ndarray:
    """One clip as a contiguous (N,) float32 array, or a ``ValueError`` naming what is wrong
    (:func:`read_audio`)."""
    return np.ascontiguousarray(read_audio(audio), dtype=np.float32)


def read_audio(audio: Any) -> np.ndarray:
    """One clip as a contiguous (N,) float32 array, float64 where it is float64 (resampled so,
    as Spark-TTS resamples what soundfile reads), or a ``ValueError`` naming what is wrong: not
    an array, a dtype other than float32, float64 or int16, not 1-D, empty, or a sample that is
    not finite (the position named)."""
    if audio is None or isinstance(audio, (str, bytes)):
        raise ValueError(f"audio must be a 1-D numpy array (float in [-1, 1], or int16), got "
                         f"{type(audio).__name__}")  # fmt: skip
    if hasattr(audio, "detach") and hasattr(audio, "cpu"):  # a torch tensor, never imported here
        audio = audio.detach().cpu().numpy()
    try:
        arr = np.asarray(audio)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"audio: cannot read a {type(audio).__name__} as an array ({exc})") from None
    if arr.dtype == np.int16:
        arr = arr.astype(np.float32) / np.float32(32768)  # exact in float32
    elif arr.dtype not in (np.float32, np.float64):
        raise ValueError(f"audio must be float32 or float64 in [-1, 1], or int16, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"audio must be 1-D, one mono clip, got shape {arr.shape} (a batch or "
                         "several channels: send one clip per call, mixed down to mono)")  # fmt: skip
    if arr.shape[0] == 0:
        raise ValueError("audio is empty: at least one sample is needed")
    out = np.ascontiguousarray(arr, dtype=np.float64 if arr.dtype == np.float64 else np.float32)
    finite = np.isfinite(out)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ValueError(f"audio[{int(bad[0])}] = {arr[bad[0]]} is not finite ({len(bad)} such "
                         "sample(s))")  # fmt: skip
    return out


def check_audio_length(n: int, *, min_samples: int, max_samples: int, sample_rate: int, name: str,
                       resampled_from: tuple[int, int] | None = None) -> None:  # fmt: skip
    """Refuse a clip a server's encoder cannot take: shorter than ``min_samples`` or longer
    than its slot's ``max_samples``. ``resampled_from``: ``(samples, rate)`` of the caller's
    clip where ``n`` is its length resampled to ``sample_rate``, which the message names."""
    what = f"audio of {n} samples"
    if resampled_from is not None:
        what += f" at {sample_rate} Hz (resampled from {resampled_from[0]} samples at {resampled_from[1]} Hz)"
    if n < min_samples:
        raise ValueError(f"{what} is too short: the encoder of {name!r} needs at least "
                         f"{min_samples} ({1000 * min_samples / sample_rate:.0f} ms)")  # fmt: skip
    if n > max_samples:
        raise ValueError(
            f"{what} ({n / sample_rate:.2f} s) is longer than a slot of {name!r} holds: "
            f"{max_samples} samples ({max_samples / sample_rate:.2f} s, the server's --max-tokens); "
            "encode a shorter clip (a reference clip of a few seconds is enough)"
        )
