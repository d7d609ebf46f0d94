"""What Spark-TTS does to a waveform before it encodes it: volume normalisation and the
reference clip.

Spark-TTS's tokenizer reads a file (``load_audio``: resampled to 16 kHz, volume-normalised when
the model folder's config says ``volume_normalize: true``, as the released one does), encodes
that waveform, and cuts the speaker encoder's reference clip from it. The encode path here
starts from a 16 kHz float waveform, so it takes over the volume normalisation (it changes the
ids: wav2vec2's own normalisation removes the scale, the mel spectrogram does not) and the clip,
but not the file reading or the resampling.
"""

from __future__ import annotations

import torch

# Spark-TTS's audio_volume_normalize constants.
TARGET_VOLUME = 0.2  # the loud end of the signal (the 90th to 99th percentile of |x|) goes here
QUIET_PEAK = 0.1  # a signal whose peak is below this is first scaled up to peak at it
MIN_PEAK = 1e-3  # ... dividing by at least this
SIGNIFICANT = 0.01  # samples at or below this |x| are left out of the volume estimate
MIN_SIGNIFICANT = 10  # with this many significant samples or fewer, no volume scaling
SCALE_RANGE = (0.1, 10.0)


def volume_normalize(wav: torch.Tensor) -> torch.Tensor:
    """One waveform (N,) scaled as Spark-TTS's ``audio_volume_normalize`` scales it; float64.

    Upstream computes on the float64 samples ``soundfile`` reads; so does this, and the caller
    rounds to float32 afterwards as upstream does (``.float()``, the feature extractor).
    """
    x = wav.to(torch.float64)
    magnitudes = torch.sort(x.abs()).values
    peak = float(magnitudes[-1])
    if peak < QUIET_PEAK:
        x = x / max(peak, MIN_PEAK) * QUIET_PEAK
    # The volume estimate reads the magnitudes from before that first scaling, as upstream does.
    significant = magnitudes[magnitudes > SIGNIFICANT]
    count = significant.numel()
    if count <= MIN_SIGNIFICANT:
        return x
    volume = significant[int(0.9 * count) : int(0.99 * count)].mean()
    x = x * torch.clamp(TARGET_VOLUME / volume, *SCALE_RANGE)
    top = x.abs().max()
    return x / top if top > 1 else x


def reference_clip(wav: torch.Tensor, length: int) -> torch.Tensor:
    """The speaker encoder's clip of one waveform (N,): its first ``length`` samples, the
    waveform repeated end to end first when it is shorter (Spark-TTS's ``get_ref_clip``)."""
    n = wav.shape[-1]
    if n < length:
        wav = wav.repeat(length // n + 1)
    return wav[:length]
