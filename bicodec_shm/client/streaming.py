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
``finish``), so the concatenated output has exactly the full decode's length: ``320 × tokens``
(``spf × frames`` for a codec of code levels, less the decoder's ``end_trim`` at the end: DAC
24 and 16 kHz end 8 samples short, as their full decode does).

Through a ``DecoderClient`` every window is an ordinary request to the shared server, so the
windows of many streams (in many worker processes) are batched together there; a push that makes
several regions final sends their windows concurrently from ``push_async``. A window is at most
the attached server's ``--max-tokens`` (``DecoderClient.max_tokens``, read at every push and
finish; a window a restarted server refuses as too long is planned again for its limit). The
client side needs numpy only. On a SNAC server a window goes out with ``decode_codes(..., noise_seed,
start_frame)``, so the server draws the noise the full decode draws at the window's frames. On a
DAC server (no noise) a push takes whole frames of every codebook, ``(n_codebooks, n)``.

A failed decode (server gone, timeout) raises and leaves the stream as it was, with the new tokens
buffered: calling ``push([])`` or ``finish()`` again retries.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
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
from .stream_settings import (  # noqa: F401 (re-exported: the stream's public names)
    CODEC_PRESETS,
    DEFAULT_MAX_WINDOW,
    GLOBAL_VOCAB,
    HOP,
    N_GLOBAL,
    PRESETS,
    RECEPTIVE_FIELD,
    SAMPLE_RATE,
    SEMANTIC_VOCAB,
    StreamSettings,
)

# Seconds a playing stream's windows count as due after its listener would run dry. Among
# requests that are all late (a server that cannot keep up), a new stream's first window, or
# a whole utterance, goes before the windows of streams already playing: first audio is what a
# listener waits for with nothing to hear. A window passed over that way waits at most this much
# longer than by its own due time, so none starves.
PLAYING_LEAD_S = 1.0


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
        preset: ``"default"``, ``"exact"`` or ``"peers"`` (see :data:`PRESETS`); the five
            keyword settings below override single fields of it.
        chunk_tokens, left_context, lookahead, crossfade, first_chunk_tokens: see
            :class:`StreamSettings`.
        dtype: ``"int16"`` (clipped, scaled by 32767 and truncated, little-endian) or
            ``"float32"`` (the model's output, little-endian) for the bytes returned.
        max_window: the most tokens one decode may carry. None: a client's server's
            ``--max-tokens``, read again at every push and finish (a restarted server may have
            another; a window it refuses as too long is planned again for it), and for an
            in-process decoder the codec's default (1500 tokens for BiCodec, 30 s for SNAC). A
            large push is split into several windows; a limit below one window's
            ``left_context + chunk_tokens + lookahead`` shrinks the windows
            (:meth:`StreamSettings.fitted`).
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
        first_chunk_tokens: int | None = None,
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
            "first_chunk_tokens": first_chunk_tokens,
        }
        snac_config = _snac_config(decoder)
        # A codec of code levels (SNAC), decoded here or by the server the client attached to.
        layout = snac_config.layout if snac_config is not None else _served_codes_layout(decoder)
        codec = layout.name if layout is not None else "bicodec"
        settings = StreamSettings.preset(preset, codec)
        settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
        if max_window is not None and settings.window_tokens > max_window:
            raise ValueError(
                f"left_context + chunk_tokens + lookahead = {settings.window_tokens} tokens is "
                f"more than max_window = {max_window}: raise max_window or shrink the settings"
            )
        self.settings = settings
        self._float = output_dtype_code(dtype) == 1
        self._max_window = max_window  # None: the server's limit (a client), or the codec's
        self._default_window = default_max_frames(codec)
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
            if layout.end_trim and settings.lookahead < 1:
                # A window's decode ends end_trim samples short: only the last region may.
                raise ValueError(
                    f"{codec} decodes a window {layout.end_trim} samples short of its last frame: "
                    f"lookahead must be >= 1, got {settings.lookahead}"
                )
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
        # The listener's clock: its first audio went out at ``_first_audio`` (monotonic), and it
        # plays ``_rate`` samples a second from then. A window sent to a server says when its
        # audio is due (``due_in``), so the server decodes a stream about to run dry before one
        # with seconds of audio ahead, and a first window (nothing playing yet) at once.
        self._first_audio: float | None = None
        self._rate = layout.sample_rate if layout is not None else SAMPLE_RATE
        self._says_due = not self._in_process and _takes_due_in(
            decoder, "decode_codes" if layout is not None else "decode")  # fmt: skip

    # -- public API -----------------------------------------------------------------------------

    def push(self, semantic_ids: Any) -> bytes:
        """Add new semantic ids (possibly none); returns the PCM that became final, maybe b""."""
        with self._turn():
            self._append(semantic_ids)
            while True:
                limit, settings, windows = self._plan(final=False)
                try:
                    audio = [self._decode(w) for w in windows]
                except ValueError:
                    if self._replan(limit):
                        continue
                    raise
                return self._assemble(windows, audio, settings)

    def finish(self) -> bytes:
        """End the utterance; returns the rest of its PCM. The stream is then finished."""
        with self._turn():
            while True:
                limit, settings, windows = self._plan(final=True)
                try:
                    audio = [self._decode(w) for w in windows]
                except ValueError:
                    if self._replan(limit):
                        continue
                    raise
                out = self._assemble(windows, audio, settings, final=True)
                self._finished = True
                return out

    async def push_async(self, semantic_ids: Any) -> bytes:
        """``push`` for asyncio: the windows of one push are decoded concurrently."""
        with self._turn():
            self._append(semantic_ids)
            while True:
                limit, settings, windows = self._plan(final=False)
                try:
                    audio = await self._decode_all_async(windows)
                except ValueError:
                    if self._replan(limit):
                        continue
                    raise
                return self._assemble(windows, audio, settings)

    async def finish_async(self) -> bytes:
        """``finish`` for asyncio."""
        with self._turn():
            while True:
                limit, settings, windows = self._plan(final=True)
                try:
                    audio = await self._decode_all_async(windows)
                except ValueError:
                    if self._replan(limit):
                        continue
                    raise
                out = self._assemble(windows, audio, settings, final=True)
                self._finished = True
                return out

    @property
    def tokens_received(self) -> int:
        """Semantic tokens pushed so far."""
        return self._received

    @property
    def samples_emitted(self) -> int:
        """Samples returned so far; the full decode's length (``HOP × tokens_received``,
        ``layout.decoded_samples(frames)``) once finished."""
        short = self._layout.end_trim if self._finished and self._layout is not None and self._emitted else 0
        return self._hop * self._emitted - len(self._tail) - short

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

    def _limit(self) -> int:
        """The most tokens one window may carry now: ``max_window``, else the server's limit."""
        if self._max_window is not None:
            return self._max_window
        limit = getattr(self._decoder, "max_tokens", None) if not self._in_process else None
        return limit if isinstance(limit, int) else self._default_window

    def _replan(self, limit: int) -> bool:
        """After a window was refused as bad input: has the limit changed since it was planned
        for ``limit``? (The server was replaced by one with another ``--max-tokens``: plan the
        windows again for it; nothing was kept of the refused call's decodes.)"""
        return self._limit() != limit

    def _plan(self, *, final: bool) -> tuple[int, StreamSettings, list[_Window]]:
        """The limit planned for, the settings fitted to it, and the windows to decode now;
        ``final``: everything left, without lookahead."""
        limit = self._limit()
        s = self.settings.fitted(limit)
        e, n = self._emitted, self._received
        windows: list[_Window] = []
        # Longest region one window may carry, in whole chunks.
        room = limit - s.left_context - s.lookahead  # >= chunk_tokens: the settings are fitted
        most = max(s.chunk_tokens, room // s.chunk_tokens * s.chunk_tokens)
        while True:
            if e < s.chunk_tokens and s.first_chunk < s.chunk_tokens:  # the ramp: one region each
                step = min(s.chunk_tokens, max(s.first_chunk, e))
                if n - s.lookahead - e < step:
                    break
                r1 = e + step
            else:
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
        return limit, s, windows

    def _assemble(self, windows: list[_Window], audio: list[np.ndarray], settings: StreamSettings,
                  *, final: bool = False) -> bytes:  # fmt: skip
        """Cut each window's region out, crossfade the joints, update the state; -> bytes.
        ``settings``: those the windows were planned with (fitted to the server's limit)."""
        parts: list[np.ndarray] = []
        tail = self._tail
        for w, wav in zip(windows, audio, strict=True):
            hop = self._hop
            want = hop * (w.w1 - w.w0) - (self._layout.end_trim if self._layout is not None else 0)
            if len(wav) != want:
                raise ValueError(  # a decoder that does not give hop samples per token
                    f"decode of {w.w1 - w.w0} tokens returned {len(wav)} samples, expected {want}"
                )
            start = hop * (w.r0 - w.w0)  # sample index of the joint inside this window
            # The held tail is blended with what this window decodes of it; a window fitted to
            # a smaller limit than the tail's may hold less of it: the rest goes out as it is.
            blend = min(len(tail), start)
            if len(tail):
                fade, kept = _fade_in(blend), len(tail) - blend
                parts += [tail[:kept], tail[kept:] * (1.0 - fade) + wav[start - blend : start] * fade]
            if w.r0 > 0:
                self._joints.append(hop * w.r0)
            region = wav[start : hop * (w.r1 - w.w0)]
            last = final and w is windows[-1]
            keep = 0 if last else settings.crossfade
            parts.append(region[: len(region) - keep])
            tail = region[len(region) - keep :].copy()
        if final and not windows and len(tail):
            parts.append(tail)  # nothing left to decode: the held tail is final as it is
            tail = tail[:0]
        out = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        # Order matters: state changes only once every decode of this call has succeeded.
        if len(out) and self._first_audio is None:
            self._first_audio = time.monotonic()  # the listener starts playing now
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

    def _due(self, w: _Window) -> dict[str, float]:
        """``due_in`` for the request of window ``w``: 0 before any audio; afterwards the
        seconds until the listener, playing since the first audio, reaches the start of ``w``'s
        region (0 for a stream that has run dry), plus ``PLAYING_LEAD_S``; nothing for a
        decoder that does not take it."""
        if not self._says_due:
            return {}
        if self._first_audio is None:
            return {"due_in": 0.0}
        ahead = (self._hop * w.r0 - len(self._tail)) / self._rate  # audio sent before w's region
        return {"due_in": max(0.0, self._first_audio + ahead - time.monotonic()) + PLAYING_LEAD_S}

    def _decode(self, w: _Window) -> np.ndarray:
        if self._layout is not None:
            if self._in_process:
                return _snac_decode(self._decoder, self._window_levels(w), w.w0, self._noise_seed)
            audio = self._decoder.decode_codes(self._window_levels(w), dtype="float32",
                                               noise_seed=self._noise_seed, start_frame=w.w0,
                                               timeout=self._timeout, **self._due(w))  # fmt: skip
            return np.asarray(audio, dtype=np.float32)
        ids = self._window_ids(w)
        if self._in_process:
            return _model_decode(self._decoder, ids, self._globals)
        return np.asarray(
            self._decoder.decode(ids, self._globals, dtype="float32", timeout=self._timeout, **self._due(w)),
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
                                                 timeout=self._timeout, **self._due(w))
                for w in windows
            ]  # fmt: skip
            return [np.asarray(a, dtype=np.float32) for a in await _all_of(requests)]
        if self._in_process:
            ids = [self._window_ids(w) for w in windows]
            model, glb = self._decoder, self._globals
            return await asyncio.to_thread(lambda: [_model_decode(model, i, glb) for i in ids])
        requests = [
            self._decoder.decode_async(
                self._window_ids(w), self._globals, dtype="float32", timeout=self._timeout, **self._due(w)
            )
            for w in windows
        ]
        return [np.asarray(a, dtype=np.float32) for a in await _all_of(requests)]


def _takes_due_in(decoder: Any, method: str) -> bool:
    """Whether ``decoder.method`` takes ``due_in`` (a ``DecoderClient`` does; a stand-in with
    an older signature is called without it)."""
    try:
        params = inspect.signature(getattr(decoder, method)).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return False
    return any(p.name == "due_in" or p.kind is p.VAR_KEYWORD for p in params)


async def _all_of(requests: list) -> list:
    """Await every request, then raise the first failure: none of a call's windows is still in
    flight when it raises (a retry sends them again)."""
    results = await asyncio.gather(*requests, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


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

    ``start_frames`` makes the window draw the noise the full decode draws at these frames
    (SNAC), or places it on the utterance's chunk grid (Qwen3-TTS); DAC takes neither.
    """
    if getattr(model.config, "noise", False):
        where = {"noise_seeds": [seed], "start_frames": [start]}
    else:
        where = {"start_frames": [start]} if getattr(model, "takes_start_frames", False) else {}
    audio = model.detokenize([lv.astype(np.int64)[None] for lv in levels], **where)
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
