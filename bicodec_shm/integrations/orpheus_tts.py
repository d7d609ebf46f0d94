"""Orpheus TTS's streaming decoder with its own calls, decoded by a shared ``snac-24khz`` server.

Orpheus's package (``orpheus-speech``, module ``orpheus_tts.decoder``) loads a SNAC model onto
``"cuda"`` in every process that imports it and decodes each request alone. Its two functions
take the language model's streamed text (vLLM's ``outputs[0].text``, the whole text so far, in
``OrpheusModel``) and yield 24 kHz mono int16 PCM as bytes. These do the same through one decoder
server, so that the windows of every stream of every worker process are batched::

    from orpheus_tts.decoder import tokens_decoder_sync                    # before
    from bicodec_shm.integrations.orpheus_tts import tokens_decoder_sync   # after

    for pcm in tokens_decoder_sync(token_gen):   # bytes, int16, 24 kHz
        ...

The server: ``bicodec-shm serve --codec snac-24khz`` (name ``bicodec-shm`` unless ``name=``).
Code that goes through ``OrpheusModel.generate_speech`` calls Orpheus's module itself: call
:func:`install` before the first ``import orpheus_tts`` and Orpheus's own code uses these, and
never loads its SNAC (the package still imports vLLM, in ``orpheus_tts.engine_class``).

Items: each item is read as text. An item that starts with the text read so far is the whole
text so far (vLLM's ``outputs[0].text``): what follows that text is new, so an item that repeats
it adds nothing (vLLM's last item, for the step that sampled the stop token) and one that grew by
several tokens adds them all (steps merged for a consumer that lagged). Any other item is a delta
(vLLM's ``RequestOutputKind.DELTA``, or one token per item) and all of it is new. Every complete
``<custom_token_N>`` of the new text counts, in order; other text adds nothing, and so do
Orpheus's control tokens (``N < 10``); an unclosed ``<custom_token_...`` at the end waits for
the next item (a delta may split a token). A delta can only be misread as the whole text if it
starts with everything before it, which a stream of audio tokens does not do: consecutive
tokens sit at different positions, whose ids differ, so a delta would have to repeat the whole
utterance so far, a multiple of 7 tokens, right after it. Token ``k`` carries code
``N - 10 - 4096·(k % 7)``; 7 tokens make a SNAC frame (2048 samples, 85.3 ms). Unlike Orpheus
(which reads only the last token of each item), a code 0 is kept (Orpheus drops it, and every
later frame then shifts by one token) and a token outside its position's 4096 ids raises
``ValueError`` naming it, and nothing of its item is kept (Orpheus skips the 4 windows around a
code over 4096, and its SNAC fails on code 4096). A last frame with fewer than 7 tokens is not
played (as Orpheus).

Presets, measured by ``benchmarks/bench_orpheus_dropin.py`` (2-core x86_64 CPU VM, 2026-12-01;
full-size 24 kHz SNAC, random weights, 4 utterances of 47 frames, one token per item; SNR of the
int16 output against the whole utterance decoded at once with the same noise seed, over the
samples each preset plays, and against ``orpheus``'s output over the frames both play):

=========  =================  ==========  =========================  ========  ==========
preset     first audio after  chunk       what plays                 SNR       vs orpheus
=========  =================  ==========  =========================  ========  ==========
default    4 frames, 28 tok   2 frames    every frame                53.9 dB   15.4 dB
exact      7 frames, 49 tok   4 frames    every frame                111.1 dB  15.4 dB
orpheus    4 frames, 28 tok   1 frame     frames 1 .. n-3            15.4 dB   (itself)
=========  =================  ==========  =========================  ========  ==========

Only ``orpheus`` gives Orpheus's chunks; the others play 3 more frames (0, n-2 and n-1), in
other chunks (the last one 2 or 3 frames for ``default``, 3 to 6 for ``exact``; an item that
completes several frames may make a longer one), and differ from Orpheus's audio as much as
Orpheus's differs from the whole decode.

``orpheus`` decodes Orpheus's windows (frames ``[m-3, m+1)`` once frame ``m`` is complete) and
keeps Orpheus's slice of each (samples 2048..4096), so its chunks are Orpheus's within 1 LSB
(the server's SNAC and Orpheus's differ by float rounding, ~2e-6): it never plays frame 0 nor
the last 2 frames (256 ms an utterance), and nothing under 4 frames. 111 dB is int16 rounding
(the two are equal up to float rounding); 15 dB is the cost of one frame of left context.
``default`` and ``exact`` are ``DecodeStream``'s ``snac-24khz`` presets. Orpheus itself draws
fresh noise for every window, so its own output is not reproducible from run to run; here each
window draws the whole decode's noise at its frames (``noise_seed``).
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.util
import re
import sys
import types
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from bicodec_shm.client.streaming import DecodeStream
from bicodec_shm.codecs import DEFAULT_NOISE_SEED, SNAC_24KHZ, check_noise_seed, orpheus_to_codes
from bicodec_shm.integrations.inputs import shared_client

SAMPLE_RATE = SNAC_24KHZ.sample_rate  # 24000
SAMPLES_PER_FRAME = SNAC_24KHZ.samples_per_frame  # 2048
TOKENS_PER_FRAME = 7
CODEBOOK_SIZE = 4096
CONTROL_TOKENS = 10  # <custom_token_0..9> are Orpheus's control tokens, not audio
PRESETS = ("default", "exact", "orpheus")
# Orpheus's scheme: once frame m is complete, decode frames [m-3, m+1) and keep samples
# [2048:4096] of them, frame m-2.
ORPHEUS_WINDOW = 4
ORPHEUS_SLICE = (SAMPLES_PER_FRAME, 2 * SAMPLES_PER_FRAME)
_PREFIX = "<custom_token_"
_CUSTOM_TOKEN = re.compile(r"<custom_token_([0-9]+)>")  # ASCII digits, as a tokenizer writes them

@dataclass(frozen=True)
class _Reading:
    """What a stream has read, replaced whole by each item (so an item is taken in one step)."""

    text: str = ""  # the text read so far: an item that starts with it is the whole text so far
    rest: str = ""  # an unclosed "<custom_token_..." at its end, read with the next item's text
    partial: tuple[int, ...] = ()  # the current frame's <custom_token_N> numbers, < 7 of them
    audio_tokens: int = 0  # audio tokens so far (their count sets each one's position)
    frames: int = 0  # whole frames so far
    recent: tuple[tuple[np.ndarray, ...], ...] = ()  # the last ORPHEUS_WINDOW frames' levels
    # Work not done yet: frames' levels the DecodeStream has not taken (default, exact), or
    # Orpheus's windows (levels, first frame) not decoded yet (orpheus).
    todo: tuple[Any, ...] = ()


class OrpheusStream:
    """One utterance: ``push`` Orpheus's streamed items one at a time, then ``finish``.

    Args:
        decoder: a ``DecoderClient`` of a ``snac-24khz`` server, or an in-process
            ``SNACDecoder`` (each process its own, for comparison).
        preset: ``"default"``, ``"exact"`` or ``"orpheus"`` (see the module's docstring).
        noise_seed: SNAC's noise seed for the utterance (as ``DecoderClient.decode_codes``).
        timeout: seconds per decode (None: the client's default).

    Items are read as the module's docstring says (the whole text so far, or a delta). ``push``
    and ``finish`` return the int16 PCM (little-endian bytes) that became final, maybe ``b""``;
    ``push_async`` and ``finish_async`` are their asyncio twins. One stream serves one caller at
    a time. A decode that fails (``DecodeTimeoutError``, ``ServerUnavailableError``) raises with
    the item taken, and the next ``push`` or ``finish`` decodes it again: no audio is lost.

    Raises:
        ValueError: a decoder of another codec, an unknown preset; later, an item that is not a
            str, or an audio token outside its position's ids (nothing of its item is kept).
    """

    def __init__(self, decoder: Any, *, preset: str = "default", noise_seed: int = DEFAULT_NOISE_SEED,
                 timeout: float | None = None) -> None:  # fmt: skip
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; expected one of {list(PRESETS)}")
        self._in_process = _check_decoder(decoder)
        self.preset = preset
        self._decoder = decoder
        self._noise_seed = check_noise_seed(noise_seed)
        self._timeout = timeout
        self._stream: DecodeStream | None = None
        if preset != "orpheus":
            self._stream = DecodeStream(decoder, None, preset=preset, dtype="int16", noise_seed=noise_seed,
                                        timeout=timeout)  # fmt: skip
        self._reading = _Reading()
        self._retry = False  # a DecodeStream's decode failed: the next push or finish decodes again

    @property
    def audio_tokens(self) -> int:
        """Audio tokens read so far."""
        return self._reading.audio_tokens

    @property
    def frames(self) -> int:
        """Whole frames read so far."""
        return self._reading.frames

    def push(self, item: str) -> bytes:
        """Take one streamed item; returns the PCM it made final (often ``b""``)."""
        return b"".join(self.push_chunks(item))

    async def push_async(self, item: str) -> bytes:
        """``push`` for asyncio; windows left by a failed call are decoded concurrently."""
        return b"".join(await self.push_chunks_async(item))

    def finish(self) -> bytes:
        """End the utterance; returns the rest of its PCM (``orpheus``: none past Orpheus's last
        window, as Orpheus)."""
        return b"".join(self.finish_chunks())

    async def finish_async(self) -> bytes:
        """``finish`` for asyncio."""
        return b"".join(await self.finish_chunks_async())

    def push_chunks(self, item: str) -> list[bytes]:
        """``push``, as the chunks Orpheus would yield: one per window for ``orpheus`` (an item
        may complete several frames), at most one for the other presets."""
        self._reading = self._read(item)
        if self._stream is None:
            chunks = [_orpheus_slice(self._decode(*w)) for w in self._reading.todo]
            self._reading = replace(self._reading, todo=())
            return chunks
        if not self._reading.todo and not self._retry:
            return []
        self._retry = True  # until the decodes below succeed: the next call decodes them again
        received = self._stream.tokens_received
        try:
            out = self._stream.push(_frames_levels(self._reading.todo))
        finally:
            if self._stream.tokens_received != received:  # it holds them, decoded or to retry
                self._reading = replace(self._reading, todo=())
        self._retry = False
        return [out] if out else []

    async def push_chunks_async(self, item: str) -> list[bytes]:
        """``push_chunks`` for asyncio."""
        self._reading = self._read(item)
        if self._stream is None:
            pcm = await asyncio.gather(*(self._decode_async(*w) for w in self._reading.todo))
            self._reading = replace(self._reading, todo=())
            return [_orpheus_slice(p) for p in pcm]
        if not self._reading.todo and not self._retry:
            return []
        self._retry = True
        received = self._stream.tokens_received
        try:
            out = await self._stream.push_async(_frames_levels(self._reading.todo))
        finally:
            if self._stream.tokens_received != received:
                self._reading = replace(self._reading, todo=())
        self._retry = False
        return [out] if out else []

    def finish_chunks(self) -> list[bytes]:
        """``finish``, as chunks (``push_chunks``)."""
        if self._stream is None:
            return self.push_chunks("")  # decodes the windows a failed decode left, if any
        # Frames an interrupted push did not hand over go first; a failed decode the stream
        # holds is decoded again by its finish.
        head = self.push_chunks("") if self._reading.todo else []
        out = self._stream.finish()
        return [*head, out] if out else head

    async def finish_chunks_async(self) -> list[bytes]:
        """``finish_chunks`` for asyncio."""
        if self._stream is None:
            return await self.push_chunks_async("")
        head = await self.push_chunks_async("") if self._reading.todo else []
        out = await self._stream.finish_async()
        return [*head, out] if out else head

    @property
    def frames_decoded(self) -> int:
        """Frames sent to the decoder so far, context included (the cost of streaming)."""
        if self._stream is not None:
            return self._stream.tokens_decoded
        return ORPHEUS_WINDOW * max(0, self.frames - ORPHEUS_WINDOW + 1)

    def __repr__(self) -> str:
        return f"<OrpheusStream preset={self.preset} audio_tokens={self.audio_tokens} frames={self.frames}>"

    # -- items ----------------------------------------------------------------------------------

    def _read(self, item: str) -> _Reading:
        """What the stream has read once ``item`` is read too; ValueError (and nothing read) for
        a bad item."""
        if not isinstance(item, str):
            raise ValueError(
                f"a streamed item must be a str holding <custom_token_N>, got {type(item).__name__}"
            )
        was = self._reading
        whole = item.startswith(was.text)  # the whole text so far (an equal item adds nothing)
        new = item[len(was.text) :] if whole else item
        if not new:
            return was
        text = was.rest + new
        audio, end = [], 0
        for match in _CUSTOM_TOKEN.finditer(text):
            digits, end = match.group(1), match.end()
            if len(digits) > 9 or int(digits) >= CONTROL_TOKENS:  # else a control token
                self._check(was.audio_tokens + len(audio), digits)
                audio.append(int(digits))
        tokens = was.partial + tuple(audio)
        n_whole = len(tokens) - len(tokens) % TOKENS_PER_FRAME
        frames, recent, todo = was.frames, was.recent, was.todo
        for k in range(0, n_whole, TOKENS_PER_FRAME):
            levels = orpheus_to_codes(tokens[k : k + TOKENS_PER_FRAME], base=CONTROL_TOKENS)
            frames += 1
            if self.preset != "orpheus":
                todo += (levels,)
                continue
            recent = (*recent, levels)[-ORPHEUS_WINDOW:]
            if frames >= ORPHEUS_WINDOW:
                window = [np.concatenate(level) for level in zip(*recent)]
                todo += ((window, frames - ORPHEUS_WINDOW),)
        return _Reading(text=item if whole else was.text + item, rest=_unclosed(text[end:]),
                        partial=tokens[n_whole:], audio_tokens=was.audio_tokens + len(audio),
                        frames=frames, recent=recent, todo=todo)  # fmt: skip

    @staticmethod
    def _check(index: int, digits: str) -> None:
        """ValueError unless ``<custom_token_{digits}>`` is an audio token of position index % 7."""
        position = index % TOKENS_PER_FRAME
        lo = CONTROL_TOKENS + CODEBOOK_SIZE * position
        n = int(digits) if len(digits) <= 9 else None
        if n is not None and lo <= n < lo + CODEBOOK_SIZE:
            return
        code = f"code {n - lo}" if n is not None else "not an audio token"
        raise ValueError(
            f"audio token {index} of the stream (frame {index // TOKENS_PER_FRAME}, position "
            f"{position}) is <custom_token_{digits}>, {code}: position {position} takes "
            f"<custom_token_{lo}>..<custom_token_{lo + CODEBOOK_SIZE - 1}> (codes 0..4095); "
            "nothing of its item is kept"
        )

    # -- Orpheus's windows ----------------------------------------------------------------------

    def _decode(self, levels: list[np.ndarray], start: int) -> np.ndarray:
        if self._in_process:
            return _pcm16(_model_decode(self._decoder, levels, start, self._noise_seed))
        return self._decoder.decode_codes(levels, noise_seed=self._noise_seed, start_frame=start,
                                          codec=SNAC_24KHZ.name, timeout=self._timeout)  # fmt: skip

    async def _decode_async(self, levels: list[np.ndarray], start: int) -> np.ndarray:
        if self._in_process:
            audio = await asyncio.to_thread(_model_decode, self._decoder, levels, start, self._noise_seed)
            return _pcm16(audio)
        return await self._decoder.decode_codes_async(
            levels, noise_seed=self._noise_seed, start_frame=start, codec=SNAC_24KHZ.name,
            timeout=self._timeout,
        )


async def tokens_decoder(token_gen: AsyncIterable[str], *, client: Any = None, name: str | None = None,
                         preset: str = "default", noise_seed: int = DEFAULT_NOISE_SEED,
                         timeout: float | None = None) -> AsyncIterator[bytes]:  # fmt: skip
    """Orpheus's ``tokens_decoder``: an async iterable of streamed text items in, int16 PCM
    bytes (24 kHz, mono) out, through the shared server.

    Args:
        token_gen: the language model's streamed items (the whole text so far, or deltas).
        client: a ``DecoderClient`` (or an in-process ``SNACDecoder``); None: this process's
            shared client for ``name`` (:func:`shared_client`).
        name: the server's name when ``client`` is None (default ``"bicodec-shm"``).
        preset: ``"default"``, ``"exact"`` or ``"orpheus"`` (the module's docstring).
        noise_seed, timeout: as :class:`OrpheusStream`.
    """
    stream = OrpheusStream(client if client is not None else shared_client(name), preset=preset,
                           noise_seed=noise_seed, timeout=timeout)  # fmt: skip
    async for item in token_gen:
        for pcm in await stream.push_chunks_async(item):
            yield pcm
    for pcm in await stream.finish_chunks_async():
        yield pcm


def tokens_decoder_sync(syn_token_gen: Iterable[str], *, client: Any = None, name: str | None = None,
                        preset: str = "default", noise_seed: int = DEFAULT_NOISE_SEED,
                        timeout: float | None = None) -> Iterator[bytes]:  # fmt: skip
    """Orpheus's ``tokens_decoder_sync``: an iterable of streamed text items in, int16 PCM bytes
    (24 kHz, mono) out. Decodes in the calling thread (Orpheus starts a thread and an event
    loop per call); arguments as :func:`tokens_decoder`."""
    stream = OrpheusStream(client if client is not None else shared_client(name), preset=preset,
                           noise_seed=noise_seed, timeout=timeout)  # fmt: skip
    for item in syn_token_gen:
        yield from stream.push_chunks(item)
    yield from stream.finish_chunks()


# -- install: Orpheus's own code decodes here ---------------------------------------------------

ORPHEUS_MODULE = "orpheus_tts.decoder"


def install(*, client: Any = None, name: str | None = None, preset: str = "default",
            noise_seed: int = DEFAULT_NOISE_SEED, timeout: float | None = None) -> None:  # fmt: skip
    """Make ``orpheus_tts.decoder`` these functions with these settings, for code that calls
    Orpheus's module itself (``OrpheusModel.generate_speech``).

    Called before the first ``import orpheus_tts``, Orpheus's module is never run, so no process
    loads its SNAC. Called after, the functions are replaced where Orpheus's package holds them
    (its SNAC stays loaded). :func:`uninstall` undoes it.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {list(PRESETS)}")
    settings = dict(client=client, name=name, preset=preset, noise_seed=noise_seed, timeout=timeout)

    def bound_async(token_gen: AsyncIterable[str]) -> AsyncIterator[bytes]:
        return tokens_decoder(token_gen, **settings)

    def bound_sync(syn_token_gen: Iterable[str]) -> Iterator[bytes]:
        return tokens_decoder_sync(syn_token_gen, **settings)

    bound_async.__doc__, bound_sync.__doc__ = tokens_decoder.__doc__, tokens_decoder_sync.__doc__
    functions = {"tokens_decoder": bound_async, "tokens_decoder_sync": bound_sync}
    uninstall()
    sys.meta_path.insert(0, _OrpheusDecoderFinder(functions))
    loaded = sys.modules.get(ORPHEUS_MODULE)
    if loaded is not None:
        _rebind(loaded, functions)


def uninstall() -> None:
    """Undo :func:`install` for later imports (a module already imported keeps what it has)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _OrpheusDecoderFinder)]


class _OrpheusDecoderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import orpheus_tts.decoder`` with a module holding the bound functions."""

    def __init__(self, functions: dict[str, Any]) -> None:
        self.functions = functions

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != ORPHEUS_MODULE:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> None:
        return None  # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = "Orpheus's decoder functions, decoded by a shared bicodec-shm server."
        module.SAMPLE_RATE = SAMPLE_RATE
        for key, value in self.functions.items():
            setattr(module, key, value)


def _rebind(decoder_module: types.ModuleType, functions: dict[str, Any]) -> None:
    """Replace the functions in Orpheus's decoder module and where its package imported them."""
    holders = [decoder_module] + [sys.modules.get(m) for m in ("orpheus_tts", "orpheus_tts.engine_class")]
    for holder in holders:
        for key, value in functions.items():
            if holder is not None and hasattr(holder, key):
                setattr(holder, key, value)


# -- helpers ------------------------------------------------------------------------------------


def _check_decoder(decoder: Any) -> bool:
    """True for an in-process SNACDecoder, False for a client; ValueError for another codec."""
    if hasattr(decoder, "decode_codes") and hasattr(decoder, "codec"):
        layout, what, in_process = decoder.codec, f"the server {getattr(decoder, 'name', '?')!r}", False
    elif hasattr(decoder, "detokenize") and hasattr(getattr(decoder, "config", None), "layout"):
        layout, what, in_process = decoder.config.layout, "this decoder", True
    else:
        raise ValueError(
            f"client must be a DecoderClient of a `serve --codec snac-24khz` server or a SNACDecoder, "
            f"got {type(decoder).__name__}"
        )
    if layout.name != SNAC_24KHZ.name:
        raise ValueError(
            f"Orpheus's tokens are snac-24khz codes, but {what} decodes {layout.name}: start the "
            "server with `bicodec-shm serve --codec snac-24khz`"
        )
    return in_process


def _model_decode(model: Any, levels: list[np.ndarray], start: int, seed: int) -> np.ndarray:
    """In-process decode of one window: levels -> (2048·n,) float32, the noise of its frames."""
    audio = model.detokenize([level.astype(np.int64)[None] for level in levels], noise_seeds=[seed],
                             start_frames=[start])  # fmt: skip
    return audio[0].cpu().numpy()


def _pcm16(audio: np.ndarray) -> np.ndarray:
    """The server's (and Orpheus's) conversion: scale by 32767 in float32, truncate to int16."""
    return (np.clip(audio.astype(np.float32), -1.0, 1.0) * np.float32(32767)).astype("<i2")


def _unclosed(tail: str) -> str:
    """The end of ``tail`` that a later item may complete into a ``<custom_token_N>``, else ""."""
    start = tail.rfind("<")
    end = tail[start:] if start >= 0 else ""
    digits = end[len(_PREFIX) :]
    if _PREFIX.startswith(end) or (end.startswith(_PREFIX) and digits.isascii() and digits.isdigit()):
        return end
    return ""


def _frames_levels(frames: tuple[tuple[np.ndarray, ...], ...]) -> list[np.ndarray]:
    """Frames' levels [(1,), (2,), (4,)] each -> the levels of all of them, [] for none."""
    return [np.concatenate(level) for level in zip(*frames)]


def _orpheus_slice(pcm: np.ndarray) -> bytes:
    a, b = ORPHEUS_SLICE
    return np.ascontiguousarray(pcm[a:b], dtype="<i2").tobytes()
