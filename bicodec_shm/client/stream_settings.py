"""How a :class:`~bicodec_shm.client.streaming.DecodeStream` cuts a token sequence into decodes:
:class:`StreamSettings`, each codec's presets, and the BiCodec constants the windows are measured in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

HOP = 320  # samples per semantic token (16 kHz, 50 tokens/s)
SAMPLE_RATE = 16000
# Vocabularies of the released BiCodec; a BiCodecDecoder reports its own.
SEMANTIC_VOCAB = 8192
GLOBAL_VOCAB = 4096
N_GLOBAL = 32
# The server's default --max-tokens: the longest window one request may carry (BiCodec; a SNAC
# stream defaults to its codec's, codecs.default_max_frames).
DEFAULT_MAX_WINDOW = 1500
# The receptive field, in tokens to each side, of the released architecture (prenet 57 + wave
# generator 10; tiny: 37): this much context makes a window decode equal the full decode up to
# float rounding whatever the weights.
RECEPTIVE_FIELD = 67


@dataclass(frozen=True)
class StreamSettings:
    """How a :class:`DecodeStream` cuts the token sequence into decodes.

    Args:
        chunk_tokens: new final tokens that trigger a decode; regions are multiples of it.
        left_context: already emitted tokens re-decoded before each region (0..RECEPTIVE_FIELD
            useful).
        lookahead: tokens held back until their right context has arrived: the added delay.
        crossfade: samples blended linearly at each joint, in ``[0, hop · min(left_context,
            chunk_tokens)]``; they sit just before the joint, inside the next window's context.
        first_chunk_tokens: the first region's length, in ``[1, chunk_tokens]`` (None: a chunk):
            first audio after ``first_chunk_tokens + lookahead`` tokens. Each next region is as
            long as the audio before it, up to ``chunk_tokens`` (2, 2, 4, 8, 16, then chunks):
            a listener who starts playing at the first audio is not starved by a model that
            generates twice as fast as real time, and the short decodes are few.
    """

    chunk_tokens: int
    left_context: int
    lookahead: int
    crossfade: int
    first_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        names = ("chunk_tokens", "left_context", "lookahead", "crossfade", "first_chunk_tokens")
        for name in names:
            value = getattr(self, name)
            if value is None and name == "first_chunk_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.first_chunk_tokens is not None and not 1 <= self.first_chunk_tokens <= self.chunk_tokens:
            raise ValueError(
                f"first_chunk_tokens must be in [1, chunk_tokens = {self.chunk_tokens}], got "
                f"{self.first_chunk_tokens}"
            )
        if self.left_context < 0 or self.lookahead < 0 or self.crossfade < 0:
            raise ValueError(
                f"left_context, lookahead and crossfade must be >= 0, got {self.left_context}, "
                f"{self.lookahead} and {self.crossfade}"
            )
        limit = HOP * min(self.left_context, self.first_chunk)
        if self.crossfade > limit:
            raise ValueError(
                f"crossfade must be in [0, {limit}] samples (hop {HOP} x min(left_context, "
                f"first_chunk_tokens, chunk_tokens)): the blended samples are decoded again as "
                f"left context, got {self.crossfade}"
            )

    @property
    def first_chunk(self) -> int:
        """The first region's length in tokens."""
        return self.chunk_tokens if self.first_chunk_tokens is None else self.first_chunk_tokens

    @property
    def first_audio_tokens(self) -> int:
        """Tokens that must have arrived before the first audio is returned."""
        return self.first_chunk + self.lookahead

    @property
    def window_tokens(self) -> int:
        """Longest window of a one-chunk decode: ``left_context + chunk_tokens + lookahead``."""
        return self.left_context + self.chunk_tokens + self.lookahead

    def opening_windows(self, count: int) -> list[int]:
        """The lengths in tokens of the first ``count`` decodes of a stream whose tokens arrive
        one at a time (what ``DecodeStream`` sends first; the ramp of ``first_chunk_tokens``
        included), before any limit: a server prepares these shapes before serving."""
        widths, emitted = [], 0
        while len(widths) < count:
            ramp = emitted < self.chunk_tokens and self.first_chunk < self.chunk_tokens
            step = min(self.chunk_tokens, max(self.first_chunk, emitted)) if ramp else self.chunk_tokens
            widths.append(emitted + step + self.lookahead - max(0, emitted - self.left_context))
            emitted += step
        return widths

    def fitted(self, limit: int) -> StreamSettings:
        """These settings cut down to windows of at most ``limit`` tokens (a server's
        ``--max-tokens``): the chunk first, then, below ``left_context + lookahead + 1``, the
        context and lookahead in proportion; the crossfade within what is left."""
        if self.window_tokens <= limit:
            return self
        chunk, left, ahead = limit - self.left_context - self.lookahead, self.left_context, self.lookahead
        if chunk < 1:  # even a one-token region leaves less room than the context wants
            chunk, left = 1, (limit - 1) * self.left_context // (self.left_context + self.lookahead)
            ahead = limit - 1 - left
        first = None if self.first_chunk_tokens is None else min(self.first_chunk_tokens, chunk)
        crossfade = min(self.crossfade, HOP * min(left, chunk, first or chunk))
        return StreamSettings(chunk_tokens=chunk, left_context=left, lookahead=ahead, crossfade=crossfade,
                              first_chunk_tokens=first)  # fmt: skip

    @classmethod
    def preset(cls, name: str, codec: str = "bicodec") -> StreamSettings:
        """One of the codec's presets (:data:`PRESETS` for BiCodec, :data:`CODEC_PRESETS`):
        ``"default"``, ``"exact"`` or ``"peers"``. For SNAC a "token" is a frame (one code of
        the coarsest level, 7 Orpheus tokens at 24 kHz)."""
        presets = CODEC_PRESETS.get(codec)
        if presets is None:
            known = sorted(CODEC_PRESETS)
            raise ValueError(f"no streaming presets for codec {codec!r}; expected one of {known}")
        try:
            return presets[name]
        except KeyError:
            known = sorted(presets)
            raise ValueError(f"unknown preset {name!r}; expected one of {known}") from None


PRESETS: Mapping[str, StreamSettings] = {
    # First audio after 45 tokens (peers: 50). Measured on spark-tts-0.5b, random weights, one
    # 259-token sequence (benchmarks/bench_streaming.py): max |Δ| at a joint is 0.1 with 10 tokens
    # of lookahead, 8e-3 with 15, 1.7e-4 with 20; 25 tokens of left context leave ~3e-6. A
    # 640-sample crossfade moves the blend to where the older decode has more right context:
    # 1.7e-4 -> 6e-5 (93 dB SNR; peers 12 dB), against an int16 step of 3e-5.
    "default": StreamSettings(chunk_tokens=25, left_context=25, lookahead=20, crossfade=640),
    # Covers the whole receptive field: equal to the full decode up to float rounding.
    "exact": StreamSettings(
        chunk_tokens=50, left_context=RECEPTIVE_FIELD, lookahead=RECEPTIVE_FIELD, crossfade=0
    ),
    # What other projects do: 50-token chunks decoded independently, 5 tokens of overlap and a
    # 1600-sample linear crossfade at each joint, no lookahead.
    "peers": StreamSettings(chunk_tokens=50, left_context=5, lookahead=0, crossfade=1600),
}

# SNAC, in frames (2048 samples at 24 kHz, 3072 at 32 and 44.1 kHz). A NaN planted in one latent
# frame reaches 2.6 frames to each side at 24 kHz, whatever the weights; at 32/44 kHz it fills its
# 4-frame attention window (and the one before), ~0.8 frame more on each side, so windows there
# start on multiples of 4 frames (chunk and left context are multiples of 4). SNR against the
# full decode: benchmarks/bench_snac_streaming.py (full size, random weights, frame by frame;
# each window draws the full decode's noise), numbers in the comments.
_SNAC_WINDOWED = {
    "default": StreamSettings(chunk_tokens=4, left_context=8, lookahead=4, crossfade=0),  # 48 dB
    "exact": StreamSettings(chunk_tokens=8, left_context=8, lookahead=8, crossfade=0),
    # Orpheus's scheme (orpheus_tts/decoder.py) on 4-frame windows: [2048:4096] is frame 1 of 4.
    "peers": StreamSettings(chunk_tokens=1, left_context=1, lookahead=2, crossfade=0),
}
# DAC, in frames (512 samples at 44.1 kHz, 11.6 ms; 320 at 24 and 16 kHz). A NaN planted in one
# frame's latent reaches 9.3 frames to each side at 44.1 kHz and 9.8 at 24/16 kHz, and with random
# weights the far frames still weigh in: at full size and 44.1 kHz, 4-frame chunks with 10 frames
# of left context are 16.5 dB off the full decode with 4 frames of lookahead, 24.5 dB with 6 and
# 51 dB with 8. SNR of each preset against the full decode (benchmarks/bench_dac_streaming.py,
# full size, random weights, 96 frames; RESULTS.md) in the comments: 44.1 / 24 / 16 kHz.
_DAC = {
    # First audio after 16 frames (186 ms at 44.1 kHz); each frame decoded ~3 times. 54.6 / 53.5 /
    # 53.5 dB, within 241-316 int16 steps of the full decode.
    "default": StreamSettings(chunk_tokens=8, left_context=10, lookahead=8, crossfade=0),
    # 10 frames of context on each side cover the receptive field: float rounding only (113-119 dB,
    # 1 int16 step at most).
    "exact": StreamSettings(chunk_tokens=10, left_context=10, lookahead=10, crossfade=0),
    # What Parler-TTS's streamer does at 44.1 kHz: 0.5 s chunks (43 frames), each decoded with the
    # whole utterance so far (left context: the receptive field is as good) and the last ~5.7
    # frames held back for the next decode (its stride, 2901 samples): lookahead 6. 34.2 / 36.6 /
    # 35.5 dB; first audio after 49 frames (569 ms at 44.1 kHz).
    "peers": StreamSettings(chunk_tokens=43, left_context=10, lookahead=6, crossfade=0),
}
# Qwen3-TTS's 12 Hz tokenizer, in frames (1920 samples, 80 ms). Every layer is causal, so no
# lookahead is needed; qwen-tts's decode cuts the utterance every 300 frames and decodes each
# chunk with the 25 frames before it, and a window carries its start frame, so the server keeps
# that grid. SNR against qwen-tts's decode of the whole utterance: benchmarks/bench_qwen3_streaming.py
# (full size, random weights; RESULTS.md).
_QWEN3 = {
    # First audio after 2 frames (160 ms of audio), then 24-frame regions with the 72-frame
    # attention window as left context: each frame decoded ~4 times.
    "default": StreamSettings(
        chunk_tokens=24, left_context=72, lookahead=0, crossfade=0, first_chunk_tokens=2
    ),
    # qwen-tts's own chunks: equal to its decode of the whole utterance (float rounding only);
    # first audio after 300 frames (24 s).
    "exact": StreamSettings(chunk_tokens=300, left_context=25, lookahead=0, crossfade=0),
    # vLLM-Omni's streamed Code2Wav windows: 25-frame chunks decoded with the 25 frames before
    # them.
    "peers": StreamSettings(chunk_tokens=25, left_context=25, lookahead=0, crossfade=0),
}
CODEC_PRESETS: Mapping[str, Mapping[str, StreamSettings]] = {
    "bicodec": PRESETS,
    "snac-24khz": {
        # First audio after 4 frames, as Orpheus (28 tokens), at 54 dB instead of 16 dB.
        "default": StreamSettings(chunk_tokens=2, left_context=3, lookahead=2, crossfade=0),
        # 3 frames of context on each side cover the receptive field: float rounding only.
        "exact": StreamSettings(chunk_tokens=4, left_context=3, lookahead=3, crossfade=0),
        # What Orpheus does: each new frame n decodes the last 4 frames (28 tokens) and keeps
        # samples [2048:4096], frame n-3. (Orpheus never plays frame 0 nor the last 2 frames;
        # a DecodeStream does, with the same windows between.)
        "peers": StreamSettings(chunk_tokens=1, left_context=1, lookahead=2, crossfade=0),
    },
    "snac-32khz": _SNAC_WINDOWED,
    "snac-44khz": _SNAC_WINDOWED,
    "dac-44khz": _DAC,
    "dac-24khz": _DAC,
    "dac-16khz": _DAC,
    "qwen3-tts-12hz": _QWEN3,
}
