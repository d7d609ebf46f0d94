"""Streaming decode: turn semantic tokens into PCM while the language model is still emitting them.

BiCodec's decoder is non-causal: the prenet reaches 57 frames to each side and the wave generator
another 10, so one token's audio depends on the 67 tokens before it and the 67 after it. Measured
(benchmarks/bench_streaming.py): a NaN planted in one token's features spreads to 67 tokens on
each side on spark-tts-0.5b and 37 on the tiny preset; with random weights the influence decays
fast, and in float32 a window with 25 tokens of context on each side is already within float
rounding of the full decode (~2e-6), 20 tokens within 2e-4, 10 tokens within 0.1.

A stream therefore decodes overlapping *windows* of the tokens received so far::

    token  0 ........... w0 ............. e .................... r1 ........... w1 ...... n
           |   emitted    | left_context  |  region: final now   |  lookahead   |  later  |
                          |<------------------ one decode (window) -------------->|

Each decode covers ``[e - left_context, r1 + lookahead)`` and keeps only the samples of the region
``[e, r1)``; the context on each side is decoded and thrown away. A region ends on a multiple of
``chunk_tokens`` after ``e``, and is only decoded once its ``lookahead`` tokens have arrived, so
audio becomes final ``lookahead`` tokens late. With ``crossfade`` samples the last ``crossfade``
samples of each region are held back and blended linearly (in float) with the same samples of the
next window, which decodes them as part of its left context. ``finish()`` decodes the rest with
no lookahead: the end of the utterance is the end of the sequence, as in the full decode.

Bookkeeping that makes the output exact in length: after every call the stream has returned
``hop · e - held`` samples, where ``held`` is the crossfade tail it holds back (0 after
``finish``), so the concatenated output has exactly ``320 × tokens`` samples.

Through a ``DecoderClient`` every window is an ordinary request to the shared server, so the
windows of many streams (in many worker processes) are batched together there; a push that makes
several regions final sends their windows concurrently from ``push_async``. The client side needs
numpy only. On a SNAC server a window goes out with ``decode_codes(..., noise_seed,
start_frame)``, so the server draws the noise the full decode draws at the window's frames. On a
DAC server (no noise) a push takes whole frames of every codebook, ``(n_codebooks, n)``.

A failed decode (server gone, timeout) raises and leaves the stream as it was, with the new tokens
buffered: calling ``push([])`` or ``finish()`` again retries.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..codecs.layout import (
    DEFAULT_NOISE_SEED,
    CodecLayout,
    check_noise_seed,
    check_request,
    default_max_frames,
)
from ..codecs.validation import as_token_array, output_dtype_code
from ..errors import StreamFinishedError

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
    """

    chunk_tokens: int
    left_context: int
    lookahead: int
    crossfade: int

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "left_context", "lookahead", "crossfade"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.left_context < 0 or self.lookahead < 0 or self.crossfade < 0:
            raise ValueError(
                f"left_context, lookahead and crossfade must be >= 0, got {self.left_context}, "
                f"{self.lookahead} and {self.crossfade}"
            )
        limit = HOP * min(self.left_context, self.chunk_tokens)
        if self.crossfade > limit:
            raise ValueError(
                f"crossfade must be in [0, {limit}] samples (hop {HOP} x min(left_context, "
                f"chunk_tokens)): the blended samples are decoded again as left context, "
                f"got {self.crossfade}"
            )

    @property
    def first_audio_tokens(self) -> int:
        """Tokens that must have arrived before the first audio is returned."""
        return self.chunk_tokens + self.lookahead

    @property
    def window_tokens(self) -> int:
        """Longest window of a one-chunk decode: ``left_context + chunk_tokens + lookahead``."""
        return self.left_context + self.chunk_tokens + self.lookahead

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
}


@dataclass(frozen=True)
class _Window:
    """One decode: tokens ``[w0, w1)`` are decoded; the audio of ``[r0, r1)`` becomes final."""

    w0: int
    r0: int
    r1: int
    w1: int


class DecodeStream:
    """Decode one utterance incrementally: ``push`` tokens as they arrive, then ``finish``.

    Args:
        decoder: a ``DecoderClient`` of a BiCodec or SNAC server (windows go through the shared
            server and batch with other streams), a ``BiCodecDecoder`` or a ``SNACDecoder``
            (decoded in this process).
        global_ids: the utterance's 32 global (speaker) ids in ``[0, 4096)``; None for SNAC.
        preset: ``"default"``, ``"exact"`` or ``"peers"`` (see :data:`PRESETS`); the four
            keyword settings below override single fields of it.
        chunk_tokens, left_context, lookahead, crossfade: see :class:`StreamSettings`.
        dtype: ``"int16"`` (clipped, scaled by 32767 and truncated, little-endian) or
            ``"float32"`` (the model's output, little-endian) for the bytes returned.
        max_window: the most tokens one decode may carry (the server's ``--max-tokens``; None:
            its default for the codec, 1500 tokens for BiCodec, 30 s for SNAC); a large push is
            split into several windows.
        timeout: seconds per decode for a client (None: the client's default).
        noise_seed: SNAC's noise seed for the whole utterance (as ``decode_codes``'s); BiCodec
            has no noise and takes only the default.

    For SNAC a "token" is a frame: ``push`` takes whole frames of every level (``[level0,
    level1, ...]``, rates 1:2:4 or 1:2:4:8; ``codecs.orpheus_to_codes`` makes them from Orpheus
    ids), the settings count frames, and each window draws the noise the full decode draws at its
    frames (``start_frames``), so the ``exact`` preset equals the full decode.

    ``push`` / ``finish`` return the PCM that is final so far as bytes, possibly empty; their
    async twins ``push_async`` / ``finish_async`` use ``decode_async`` on a client (and a worker
    thread for an in-process model). One stream serves one utterance and one caller at a time;
    many streams may share one client.

    Raises:
        ValueError: bad global ids or settings; later, bad semantic ids (nothing is buffered).
        StreamFinishedError: ``push`` or ``finish`` after ``finish``.
    """

    def __init__(
        self,
        decoder: Any,
        global_ids: Any,
        *,
        preset: str = "default",
        chunk_tokens: int | None = None,
        left_context: int | None = None,
        lookahead: int | None = None,
        crossfade: int | None = None,
        dtype: str = "int16",
        max_window: int | None = None,
        timeout: float | None = None,
        noise_seed: int = DEFAULT_NOISE_SEED,
    ) -> None:
        overrides = {
            "chunk_tokens": chunk_tokens,
            "left_context": left_context,
            "lookahead": lookahead,
            "crossfade": crossfade,
        }
        snac_config = _snac_config(decoder)
        # A codec of code levels (SNAC), decoded here or by the server the client attached to.
        layout = snac_config.layout if snac_config is not None else _served_codes_layout(decoder)
        codec = layout.name if layout is not None else "bicodec"
        settings = StreamSettings.preset(preset, codec)
        settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
        if max_window is None:
            max_window = default_max_frames(codec)
        if settings.window_tokens > max_window:
            raise ValueError(
                f"left_context + chunk_tokens + lookahead = {settings.window_tokens} tokens is "
                f"more than max_window = {max_window} (the server's --max-tokens)"
            )
        self.settings = settings
        self._float = output_dtype_code(dtype) == 1
        self._max_window = max_window
        self._timeout = timeout
        self._decoder = decoder
        self._hop = HOP  # samples per token (BiCodec) or per frame (SNAC)
        self._layout: CodecLayout | None = layout  # None: BiCodec (semantic ids + global ids)
        self._noise_seed = check_noise_seed(noise_seed)
        if layout is None and self._noise_seed != DEFAULT_NOISE_SEED:
            raise ValueError("BiCodec's decoder has no noise: noise_seed is for SNAC")
        if layout is not None:
            self._in_process = snac_config is not None
            self._hop = layout.samples_per_frame
            if global_ids is not None:
                raise ValueError(f"{codec} takes no global ids: pass global_ids=None")
            self._globals = np.zeros(0, np.int32)
            # One row per frame: its codes of every level, level 0 first.
            self._tokens = np.zeros((0, layout.codes_per_frame), np.int32)
        elif hasattr(decoder, "decode_async") and hasattr(decoder, "decode"):
            self._in_process = False
            self._vocab, gvocab, n_global = SEMANTIC_VOCAB, GLOBAL_VOCAB, N_GLOBAL
        elif hasattr(decoder, "detokenize") and hasattr(decoder, "config"):
            self._in_process = True
            cfg = decoder.config
            if cfg.hop_length != HOP:
                raise ValueError(f"the decoder's hop is {cfg.hop_length}; streaming needs {HOP}")
            self._vocab, gvocab, n_global = cfg.semantic_vocab, cfg.global_vocab, cfg.n_global
        else:
            raise ValueError(
                f"decoder must be a DecoderClient or a BiCodecDecoder (or a SNACDecoder), "
                f"got {type(decoder).__name__}"
            )
        if layout is None:
            self._globals = as_token_array(
                global_ids, what="global_ids", vocab=gvocab, max_len=n_global, exact_len=n_global
            )
            self._tokens = np.zeros(0, np.int32)  # tokens [offset, received): what windows still need
        self._offset = 0
        self._received = 0
        self._emitted = 0  # e: tokens whose audio is final (all of it but the held tail)
        self._tail = np.zeros(0, np.float32)  # last `crossfade` samples of the last region
        self._joints: list[int] = []
        self._decoded = 0
        self._finished = False
        self._busy = threading.Lock()

    # -- public API -----------------------------------------------------------------------------

    def push(self, semantic_ids: Any) -> bytes:
        """Add new semantic ids (possibly none); returns the PCM that became final, maybe b""."""
        with self._turn():
            self._append(semantic_ids)
            windows = self._plan(final=False)
            return self._assemble(windows, [self._decode(w) for w in windows])

    def finish(self) -> bytes:
        """End the utterance; returns the rest of its PCM. The stream is then finished."""
        with self._turn():
            windows = self._plan(final=True)
            out = self._assemble(windows, [self._decode(w) for w in windows], final=True)
            self._finished = True
            return out

    async def push_async(self, semantic_ids: Any) -> bytes:
        """``push`` for asyncio: the windows of one push are decoded concurrently."""
        with self._turn():
            self._append(semantic_ids)
            windows = self._plan(final=False)
            return self._assemble(windows, await self._decode_all_async(windows))

    async def finish_async(self) -> bytes:
        """``finish`` for asyncio."""
        with self._turn():
            windows = self._plan(final=True)
            audio = await self._decode_all_async(windows)
            out = self._assemble(windows, audio, final=True)
            self._finished = True
            return out

    @property
    def tokens_received(self) -> int:
        """Semantic tokens pushed so far."""
        return self._received

    @property
    def samples_emitted(self) -> int:
        """Samples returned so far; ``HOP × tokens_received`` once finished."""
        return self._hop * self._emitted - len(self._tail)

    @property
    def tokens_decoded(self) -> int:
        """Tokens sent to the decoder so far, context included (the cost of streaming)."""
        return self._decoded

    @property
    def joints(self) -> tuple[int, ...]:
        """Sample offsets where one decode's region meets the next (for diagnostics)."""
        return tuple(self._joints)

    @property
    def finished(self) -> bool:
        """True once ``finish`` (or ``finish_async``) has returned."""
        return self._finished

    def __repr__(self) -> str:
        s = self.settings
        state = "finished" if self._finished else "open"
        return (
            f"<DecodeStream {state} received={self._received} emitted={self._emitted} "
            f"chunk={s.chunk_tokens} left={s.left_context} lookahead={s.lookahead} "
            f"crossfade={s.crossfade}>"
        )

    # -- planning and assembly ------------------------------------------------------------------

    def _turn(self) -> _Turn:
        if self._finished:
            raise StreamFinishedError(
                "this DecodeStream is finished: push/finish after finish(); start a new stream "
                "for the next utterance"
            )
        return _Turn(self._busy)

    def _append(self, semantic_ids: Any) -> None:
        if self._layout is not None:
            return self._append_frames(semantic_ids)
        if _is_empty(semantic_ids):
            return  # a push of nothing is allowed (e.g. to retry a failed decode)
        ids = as_token_array(
            semantic_ids, what="semantic_ids", vocab=self._vocab, max_len=np.iinfo(np.int64).max
        )
        self._tokens = np.concatenate([self._tokens, ids])
        self._received += len(ids)

    def _append_frames(self, levels: Any) -> None:
        """SNAC: ``levels`` holds whole frames of every level; each becomes one row of tokens."""
        if _is_empty(levels) or (
            isinstance(levels, (list, tuple)) and levels and all(_is_empty(v) for v in levels)
        ):
            return
        arrays, _, frames = check_request(self._layout, levels)
        rows = np.concatenate(
            [a.reshape(frames, rate) for a, rate in zip(arrays, self._layout.level_rates, strict=True)],
            axis=1,
        )  # (frames, codes per frame)
        self._tokens = np.concatenate([self._tokens, rows])
        self._received += frames

    def _plan(self, *, final: bool) -> list[_Window]:
        """The windows to decode now; ``final``: everything left, without lookahead."""
        s = self.settings
        e, n = self._emitted, self._received
        windows: list[_Window] = []
        # Longest region one window may carry, in whole chunks.
        most = max(
            s.chunk_tokens,
            (self._max_window - s.left_context - s.lookahead) // s.chunk_tokens * s.chunk_tokens,
        )
        while True:
            ready = (n - s.lookahead - e) // s.chunk_tokens * s.chunk_tokens
            if ready < s.chunk_tokens:
                break
            r1 = e + min(ready, most)
            windows.append(_Window(max(0, e - s.left_context), e, r1, r1 + s.lookahead))
            e = r1
        if final and e < n:
            # After the last push fewer than chunk_tokens + lookahead tokens remain, so this
            # window is never longer than a one-chunk window.
            windows.append(_Window(max(0, e - s.left_context), e, n, n))
        return windows

    def _assemble(self, windows: list[_Window], audio: list[np.ndarray], *, final: bool = False) -> bytes:
        """Cut each window's region out, crossfade the joints, update the state; -> bytes."""
        parts: list[np.ndarray] = []
        tail = self._tail
        for w, wav in zip(windows, audio, strict=True):
            hop = self._hop
            if len(wav) != hop * (w.w1 - w.w0):
                raise ValueError(  # a decoder that does not give hop samples per token
                    f"decode of {w.w1 - w.w0} tokens returned {len(wav)} samples, "
                    f"expected {hop * (w.w1 - w.w0)}"
                )
            start = hop * (w.r0 - w.w0)  # sample index of the joint inside this window
            if len(tail):
                fade = _fade_in(len(tail))
                parts.append(tail * (1.0 - fade) + wav[start - len(tail) : start] * fade)
            if w.r0 > 0:
                self._joints.append(hop * w.r0)
            region = wav[start : hop * (w.r1 - w.w0)]
            last = final and w is windows[-1]
            keep = 0 if last else self.settings.crossfade
            parts.append(region[: len(region) - keep])
            tail = region[len(region) - keep :].copy()
        if final and not windows and len(tail):
            parts.append(tail)  # nothing left to decode: the held tail is final as it is
            tail = tail[:0]
        out = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        # Order matters: state changes only once every decode of this call has succeeded.
        if windows:
            self._emitted = windows[-1].r1
            self._decoded += sum(w.w1 - w.w0 for w in windows)
        self._tail = tail
        drop = max(0, self._emitted - self.settings.left_context) - self._offset
        if drop > 0:  # keep only the tokens a later window can still need
            self._tokens, self._offset = self._tokens[drop:], self._offset + drop
        return _to_bytes(out, as_float=self._float)

    # -- decoding -------------------------------------------------------------------------------

    def _window_ids(self, w: _Window) -> np.ndarray:
        return self._tokens[w.w0 - self._offset : w.w1 - self._offset]

    def _window_levels(self, w: _Window) -> list[np.ndarray]:
        """SNAC: the window's codes per level, ``[(n·r_0,), (n·r_1,), ...]`` int32."""
        return _split_levels(self._window_ids(w), self._layout.level_rates)

    def _decode(self, w: _Window) -> np.ndarray:
        if self._layout is not None:
            if self._in_process:
                return _snac_decode(self._decoder, self._window_levels(w), w.w0, self._noise_seed)
            audio = self._decoder.decode_codes(self._window_levels(w), dtype="float32",
                                               noise_seed=self._noise_seed, start_frame=w.w0,
                                               timeout=self._timeout)  # fmt: skip
            return np.asarray(audio, dtype=np.float32)
        ids = self._window_ids(w)
        if self._in_process:
            return _model_decode(self._decoder, ids, self._globals)
        return np.asarray(
            self._decoder.decode(ids, self._globals, dtype="float32", timeout=self._timeout),
            dtype=np.float32,
        )

    async def _decode_all_async(self, windows: list[_Window]) -> list[np.ndarray]:
        if not windows:
            return []
        if self._layout is not None and self._in_process:
            model, seed = self._decoder, self._noise_seed
            work = [(self._window_levels(w), w.w0) for w in windows]
            return await asyncio.to_thread(lambda: [_snac_decode(model, lv, s, seed) for lv, s in work])
        if self._layout is not None:
            requests = [
                self._decoder.decode_codes_async(self._window_levels(w), dtype="float32",
                                                 noise_seed=self._noise_seed, start_frame=w.w0,
                                                 timeout=self._timeout)
                for w in windows
            ]  # fmt: skip
            return [np.asarray(a, dtype=np.float32) for a in await asyncio.gather(*requests)]
        if self._in_process:
            ids = [self._window_ids(w) for w in windows]
            model, glb = self._decoder, self._globals
            return await asyncio.to_thread(lambda: [_model_decode(model, i, glb) for i in ids])
        requests = [
            self._decoder.decode_async(
                self._window_ids(w), self._globals, dtype="float32", timeout=self._timeout
            )
            for w in windows
        ]
        return [np.asarray(a, dtype=np.float32) for a in await asyncio.gather(*requests)]


class _Turn:
    """Refuses a second concurrent call on one stream instead of corrupting its state."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "another push/finish of this DecodeStream is in progress: a stream serves one "
                "caller at a time (use one stream per utterance)"
            )

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _model_decode(model: Any, ids: np.ndarray, global_ids: np.ndarray) -> np.ndarray:
    """In-process decode of one window: (n,), (32,) -> (HOP·n,) float32."""
    audio = model.detokenize(ids.astype(np.int64)[None], global_ids.astype(np.int64)[None])
    return audio[0].cpu().numpy()  # (1, N) -> (N,)


def _snac_config(decoder: Any) -> Any:
    """The config of an in-process decoder of code levels (SNAC, DAC: its config has a layout),
    else None."""
    config = getattr(decoder, "config", None)
    layout = getattr(config, "layout", None)
    return config if hasattr(decoder, "detokenize") and isinstance(layout, CodecLayout) else None


def _served_codes_layout(decoder: Any) -> CodecLayout | None:
    """The layout of a client's server when it serves a codec of code levels (SNAC), else None."""
    layout = getattr(decoder, "codec", None)
    if isinstance(layout, CodecLayout) and hasattr(decoder, "decode_codes") and layout.name != "bicodec":
        return layout
    return None


def _split_levels(rows: np.ndarray, rates: tuple[int, ...]) -> list[np.ndarray]:
    """Frames as rows (n, codes per frame) -> per level ``[(n·r_0,), (n·r_1,), ...]``."""
    edges = np.cumsum((0, *rates))
    return [np.ascontiguousarray(rows[:, a:b]).reshape(-1) for a, b in zip(edges[:-1], edges[1:])]


def _snac_decode(model: Any, levels: list[np.ndarray], start: int, seed: int) -> np.ndarray:
    """In-process decode of one SNAC window: per-level codes -> (spf·n,) float32.

    ``start_frames`` makes the window draw the noise the full decode draws at these frames; a
    codec without noise (DAC) takes neither.
    """
    noise = {"noise_seeds": [seed], "start_frames": [start]} if getattr(model.config, "noise", False) else {}
    audio = model.detokenize([lv.astype(np.int64)[None] for lv in levels], **noise)
    return audio[0].cpu().numpy()  # (1, N) -> (N,)


def _is_empty(values: Any) -> bool:
    if isinstance(values, (str, bytes)) or getattr(values, "ndim", 1) != 1:
        return False
    try:
        return len(values) == 0
    except TypeError:
        return False


def _fade_in(n: int) -> np.ndarray:
    """Linear ramp strictly inside (0, 1): no sample is all old or all new."""
    return ((np.arange(n, dtype=np.float32) + 0.5) / n).astype(np.float32)


def _to_bytes(audio: np.ndarray, *, as_float: bool) -> bytes:
    if as_float:
        return np.ascontiguousarray(audio, dtype="<f4").tobytes()
    # The server's int16 conversion exactly: clip, scale by 32767 in float32, truncate toward zero.
    scaled = np.clip(audio.astype(np.float32), -1.0, 1.0) * np.float32(32767)
    return scaled.astype("<i2").tobytes()
