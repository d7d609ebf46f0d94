"""The client handle: validate a request, send it through the current attachment, and carry it
across server restarts, forks and ``close()``.

numpy and posix_ipc only: a worker that decodes through the server never imports torch. The
per-incarnation machinery (slots, semaphores, the asyncio waiter) is in attachment.py; this
module decides *which* attachment a request uses and what the caller sees:

- The handle attaches at construction (waiting up to ``connect_timeout``) but claims no slot
  until a request needs one.
- If the server goes away (crash, SIGKILL, SIGTERM, a rolling restart), every request in flight
  or waiting for a slot wakes at once, the old attachment is dropped whole (its slots, the
  abandoned ones too, and its mapping), and the requests re-attach to the next server under the
  same name and resubmit (decoding is a pure function, so a retry is safe), or raise
  ``ServerUnavailableError`` when their timeout runs out.
- ``close()`` ends every call in flight within a second with ``ClientClosedError``.
- In a forked child the handle notices the new pid and attaches afresh; it never shares the
  parent's slots (protocol/locks.py closes the child's copies of every lock descriptor at fork).

Every exception a caller sees is a ``ValueError`` (bad input) or a ``BiCodecShmError``.

Codecs: the server names its codec and token layout in the segment header (protocol/layout.py).
``decode`` sends BiCodec's semantic and global ids; ``decode_codes`` sends any codec's code
levels (SNAC's 3 or 4, DAC's codebooks), ``decode_orpheus`` Orpheus's audio token ids (SNAC
24 kHz), ``decode_dia`` Dia's delayed audio tokens (DAC 44 kHz). Each is
checked against the layout of the server that will decode it, and a request for another codec
is refused with a ``ValueError`` naming both.

``encode`` runs the other way (a server started with ``--encode``): a clip in, its codes back
(BiCodec: semantic and global ids, for voice cloning), through the same slots and the same
restart, deadline and clean-up rules as a decode.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

from ..codecs.audio import EncodedAudio, check_sample_rate, read_audio
from ..codecs.dia import dia_to_codes
from ..codecs.layout import (
    ANY_SLOT_LIMIT,
    BICODEC,
    DEFAULT_NOISE_SEED,
    LAYOUTS,
    MAX_FRAMES,
    CodecLayout,
    check_noise_seed,
    check_start_frame,
)
from ..codecs.orpheus import AUDIO_TOKEN_BASE, orpheus_to_codes
from ..codecs.validation import as_token_array, output_dtype_code
from ..errors import BiCodecShmError, ClientClosedError, ServerUnavailableError
from ..protocol.attachment import Attachment
from ..protocol.group import read_group
from ..protocol.header import stats_from_header
from ..protocol.layout import FLAG_NO_NOISE, N_GLOBAL, NO_BELL
from ..protocol.names import ServerState, probe, validate_name
from ..protocol.served import describe_served
from ..protocol.waiting import SLICE, Gone
from .requests import Request, check_codec, check_for_layout, due_time, fit, submit
from .router import GroupRouter

DEFAULT_TIMEOUT = 30.0
DEFAULT_CLIENT_SLOTS = 8
# After a server stopped on purpose, how long requests wait for a successor to take the name
# before they fail with ServerUnavailableError (a crashed server is waited for until the
# request's own deadline: a supervisor restarts it). A rolling restart's new `serve` takes the
# name before it loads its model, but only once its interpreter is up: 0.5 s here when idle,
# over 2 s on a loaded 2-core machine (the 10-minute soak failed 88% of its requests at 2 s).
STOP_GRACE = 5.0
REATTACH_PAUSE = SLICE / 5  # between attachments lost in quick succession (see ``_drop``)

_live_clients: weakref.WeakSet[DecoderClient] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_live_clients):
        client._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DecoderClient:
    """A handle on the shared decoder served under ``name``.

    Args:
        name: the server's segment name (``bicodec-shm serve --name``; default "bicodec-shm").
        timeout: default seconds a request may take end to end, waiting for a slot and for a
            restarted server included (None: wait forever). On expiry it raises
            ``DecodeTimeoutError``, or ``ServerUnavailableError`` if no server came back.
        slots: most requests of this handle in flight at once; each claims a shared-memory
            slot on demand. More requests wait in the handle, first come, first served.
        connect_timeout: seconds to wait for a server at construction (0: fail at once with
            ``ServerUnavailableError``).
        owner_uid: the uid that must own the server's segment (default: this process's).
        stop_grace: seconds requests wait for a successor after their server stopped on
            purpose (SIGTERM, Ctrl-C) before failing with ``ServerUnavailableError``; raise
            it where a rolling restart's new server takes long to start.

    Thread-safe and asyncio-safe; one handle can serve many threads and coroutines.

    If ``name`` is a server group (``bicodec-shm serve --device cuda:0,cuda:1``), each request
    goes to the member with the fewest outstanding requests, and to another live member if its
    own dies (group.py); ``slots`` then applies to each member.
    """

    _att: Attachment | None = None
    _group: GroupRouter | None = None  # set when ``name`` is a server group
    _closed = True

    def __init__(
        self,
        name: str = "bicodec-shm",
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        slots: int = DEFAULT_CLIENT_SLOTS,
        connect_timeout: float = 0.0,
        owner_uid: int | None = None,
        stop_grace: float = STOP_GRACE,
    ) -> None:
        validate_name(name)
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
        self.name = name
        self.timeout = timeout
        self.max_slots = slots
        self.owner_uid = owner_uid
        self.stop_grace = stop_grace
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._requests = 0
        self._last_error: Exception | None = None
        self._stopped_at: float | None = None  # when a server that stopped on purpose went away
        self._last_dropped: Attachment | None = None  # see ``_drop``
        self._dropped_at = float("-inf")
        self._quick_drops = 0  # attachments lost less than a slice apart, in a row
        self._closed = False
        self._t_asked = time.monotonic()
        att = self._connect(self._t_asked + connect_timeout)
        if self._group is None:
            self._att = att
        _live_clients.add(self)

    # -- public API ---------------------------------------------------------------------------

    def decode(self, semantic_ids: Any, global_ids: Any, *, dtype: str = "int16",
               timeout: float | None = None, due_in: float = 0.0) -> np.ndarray:  # fmt: skip
        """Decode one utterance; blocks the calling thread.

        Args:
            semantic_ids: (T,) ints in [0, 8192): list, numpy array or tensor.
            global_ids: (32,) ints in [0, 4096).
            dtype: "int16" (clipped, scaled by 32767, truncated) or "float32" (the model's output).
            timeout: seconds for this call (default: the handle's).
            due_in: seconds until the audio is due (a stream's audio still buffered at its
                listener; 0: now): the server decodes what is due soonest first.
        Returns:
            (320·T,) int16 or float32 samples at 16 kHz.
        Raises:
            ValueError: bad ids, or a server that serves another codec than BiCodec.
        """
        return self._decode(self._prepare(semantic_ids, global_ids, dtype, due_in), timeout)

    def decode_codes(self, levels: Any, *, global_ids: Any = None,
                     noise_seed: int = DEFAULT_NOISE_SEED, noise: bool = True,
                     dtype: str = "int16", codec: str | None = None, start_frame: int = 0,
                     timeout: float | None = None, due_in: float = 0.0) -> np.ndarray:  # fmt: skip
        """Decode one utterance given as code levels, for the codec the server serves (SNAC).

        Args:
            levels: one 1-D sequence of ids per level, coarsest first; for ``n`` frames level
                ``i`` holds ``n·rate_i`` ids (SNAC 24 kHz: (n,), (2n,), (4n,)). DAC's codes may
                be one ``(n_codebooks, n)`` array.
            global_ids: for a codec that takes them (BiCodec's 32), else None.
            noise_seed: SNAC's decoder noise is a pure function of this seed (in [0, 2**63);
                default ``codecs.DEFAULT_NOISE_SEED`` = 0): the same codes and seed always
                give the same audio, alone or batched.
            noise: False decodes without SNAC's noise.
            dtype: "int16" or "float32".
            codec: the codec the codes are for (``"snac-24khz"``, ...); if given, a server of
                another codec is refused even when the shapes happen to fit.
            start_frame: the frame of the utterance at which these codes start (a streaming
                window): SNAC then draws the noise the whole utterance's decode draws at those
                frames. 0 (default) for a whole utterance.
            timeout: seconds for this call (default: the handle's).
            due_in: seconds until the audio is due, as for ``decode``.
        Returns:
            (codec.decoded_samples(n),) int16 or float32 samples at the codec's sample rate:
            samples_per_frame·n, 8 fewer for DAC 24 and 16 kHz (their decoders' own length).
        Raises:
            ValueError: before anything is written: a wrong number of levels, lengths that
                break the rates, an id out of range for its level, global ids a codec does not
                take, a bad seed, or a server of another codec (naming both).
        """
        request = self._prepare_codes(levels, global_ids, noise_seed, noise, dtype, codec,
                                      start_frame=start_frame, due_in=due_in)  # fmt: skip
        return self._decode(request, timeout)

    async def decode_codes_async(self, levels: Any, *, global_ids: Any = None,
                                 noise_seed: int = DEFAULT_NOISE_SEED, noise: bool = True,
                                 dtype: str = "int16", codec: str | None = None,
                                 start_frame: int = 0, timeout: float | None = None,
                                 due_in: float = 0.0) -> np.ndarray:  # fmt: skip
        """``decode_codes`` for asyncio."""
        request = self._prepare_codes(levels, global_ids, noise_seed, noise, dtype, codec,
                                      start_frame=start_frame, due_in=due_in)  # fmt: skip
        return await self._decode_async(request, timeout)

    def decode_orpheus(self, token_ids: Any, *, base: int = AUDIO_TOKEN_BASE,
                       noise_seed: int = DEFAULT_NOISE_SEED, noise: bool = True,
                       dtype: str = "int16", timeout: float | None = None) -> np.ndarray:  # fmt: skip
        """Decode Orpheus's audio token ids (7 per frame) on a ``snac-24khz`` server.

        ``base``: 128266 for language-model ids (default), 10 for ``<custom_token_N>`` numbers
        (``codecs.orpheus``). Other arguments as ``decode_codes``. Returns 24 kHz samples.
        """
        request = self._prepare_codes(orpheus_to_codes(token_ids, base=base), None, noise_seed,
                                      noise, dtype, "snac-24khz", kind="orpheus")  # fmt: skip
        return self._decode(request, timeout)

    async def decode_orpheus_async(self, token_ids: Any, *, base: int = AUDIO_TOKEN_BASE,
                                   noise_seed: int = DEFAULT_NOISE_SEED, noise: bool = True,
                                   dtype: str = "int16",
                                   timeout: float | None = None) -> np.ndarray:  # fmt: skip
        """``decode_orpheus`` for asyncio."""
        request = self._prepare_codes(orpheus_to_codes(token_ids, base=base), None, noise_seed,
                                      noise, dtype, "snac-24khz", kind="orpheus")  # fmt: skip
        return await self._decode_async(request, timeout)

    def decode_dia(self, tokens: Any, *, dtype: str = "int16", timeout: float | None = None) -> np.ndarray:
        """Decode Dia's delayed audio tokens, ``(rows, 9)`` (``codecs.dia``), on a ``dac-44khz``
        server. Other arguments as ``decode_codes``. Returns 44.1 kHz samples."""
        request = self._prepare_codes(dia_to_codes(tokens), None, DEFAULT_NOISE_SEED, True, dtype,
                                      "dac-44khz")  # fmt: skip
        return self._decode(request, timeout)

    async def decode_dia_async(self, tokens: Any, *, dtype: str = "int16",
                               timeout: float | None = None) -> np.ndarray:  # fmt: skip
        """``decode_dia`` for asyncio."""
        request = self._prepare_codes(dia_to_codes(tokens), None, DEFAULT_NOISE_SEED, True, dtype,
                                      "dac-44khz")  # fmt: skip
        return await self._decode_async(request, timeout)

    def encode(self, audio: Any, *, sample_rate: int | None = None, timeout: float | None = None,
               due_in: float = 0.0) -> EncodedAudio:  # fmt: skip
        """Encode one clip into the served codec's codes (a voice-cloning reference clip);
        blocks the calling thread. Needs a server started with ``--encode``.

        Args:
            audio: (N,) mono samples at the codec's sample rate (BiCodec: 16 kHz) or at
                ``sample_rate``: float32 or float64 in [-1, 1], or int16 (read as
                ``x / 32768``). It crosses shared memory as float32 at the codec's rate: the
                codes are those of that float32 clip.
            sample_rate: the clip's rate in Hz (None: the codec's). At another rate than the
                codec's the clip is resampled here, in this process, to the codec's rate as the
                codec's upstream does (``CodecLayout.resampling``: BiCodec
                ``soxr.resample(x, sample_rate, 16000, quality="VHQ")`` as Spark-TTS;
                qwen3-tts-12hz ``librosa.resample``'s default, soxr "HQ", as qwen-tts), so the
                codes are the ones upstream computes for the clip; float64 audio is resampled
                as float64, float32 and int16 as float32. Needs ``soxr``.
            timeout: seconds for this call (default: the handle's).
            due_in: seconds until the codes are due, as for ``decode``.
        Returns:
            ``EncodedAudio``: for BiCodec ``semantic_ids`` (T,) int32 at 50 per second and
            ``global_ids`` (32,) int32, exactly what ``BiCodecEncoder.tokenize`` gives the clip
            alone; for qwen3-tts-12hz 16 ``codes`` arrays (one per codebook, ``ceil(N / 1920)``
            codes each) and no ``global_ids``, what ``Qwen3TTSEncoder.tokenize`` gives the clip
            alone; in general ``codes``, one array per code level, and ``global_ids`` or None.
        Raises:
            ValueError: before anything is written: audio that is not a 1-D float or int16
                array, empty, with a NaN or infinite sample, shorter than the encoder takes or
                longer than a slot holds (``max_tokens · samples_per_frame`` samples), both
                counted at the codec's rate (after resampling); or a ``sample_rate`` that is
                not an int in [1, 1 000 000] Hz.
            NoEncoderError: the server was started without ``--encode``.
        """
        return self._decode(self._prepare_audio(audio, sample_rate, due_in), timeout)

    async def encode_async(self, audio: Any, *, sample_rate: int | None = None,
                           timeout: float | None = None, due_in: float = 0.0) -> EncodedAudio:  # fmt: skip
        """``encode`` for asyncio: never blocks the event loop, starts no thread per call."""
        return await self._decode_async(self._prepare_audio(audio, sample_rate, due_in), timeout)

    @property
    def codec(self) -> CodecLayout:
        """The token layout of the codec the server last attached serves."""
        return self._codec

    @property
    def max_tokens(self) -> int:
        """The longest request, in frames (BiCodec: semantic tokens), the server under the name
        takes now: its ``--max-tokens`` (a group: the least of its live members'). A server that
        went away is let go of and its successor attached, without waiting; while none serves,
        the last one's."""
        if os.getpid() != self._pid:
            self._forked()
        att = self._att
        if self._group is None and att is not None and att.retired is None and not att.serving():
            att.retire_gone()  # replaced: let go of it, and attach its successor below
            self._drop(att, float("inf"), Gone())
        try:
            att = self._attachment(float("inf"), block=False)
        except ServerUnavailableError:  # stopped on purpose and no successor within the grace
            att = None
        limit = group.max_tokens() if (group := self._group) is not None else None
        if limit is None and att is not None and att.retired is None:
            limit = att.max_tokens
        if limit is not None:
            self._max_tokens = limit
        return self._max_tokens

    def _decode(self, request: Request, timeout: float | None) -> np.ndarray:
        try:
            return self._decode_sync(request, timeout)
        except Gone as exc:  # never expected here: the loop resubmits; but never let it out
            raise self._lost_error(exc) from None

    async def _decode_async(self, request: Request, timeout: float | None) -> np.ndarray:
        try:
            return await self._decode_async_loop(request, timeout)
        except Gone as exc:  # as in ``_decode``
            raise self._lost_error(exc) from None

    def _decode_sync(self, request: Request, timeout: float | None) -> np.ndarray:
        deadline = self._deadline(timeout)
        while True:
            att = self._attachment(deadline)
            try:
                fit(att, request)
            except Gone as exc:
                self._drop(att, deadline, exc)
                continue
            seq = att.new_seq()  # before the try: its cleanup must know what to look for
            try:
                slot, _ = att.take_slot(deadline, seq)
                submit(att, slot, seq, request, NO_BELL)
                self._requests += 1
                return att.wait_result(slot, seq, deadline)
            except Gone as exc:
                self._drop(att, deadline, exc)
            except BaseException:
                # Ctrl-C, a signal handler's exception (a SIGALRM timeout), a timeout, an
                # error answer, wherever it lands from taking the slot on: the slot goes back,
                # or is let go of if the server may still have the request, and a step it
                # interrupted is finished (see attachment.py). Never kept out of use.
                att.abandon(seq)
                raise

    async def decode_async(self, semantic_ids: Any, global_ids: Any, *, dtype: str = "int16",
                           timeout: float | None = None, due_in: float = 0.0) -> np.ndarray:  # fmt: skip
        """``decode`` for asyncio: never blocks the event loop, starts no thread per call."""
        request = self._prepare(semantic_ids, global_ids, dtype, due_in)
        return await self._decode_async(request, timeout)

    async def _decode_async_loop(self, request: Request, timeout: float | None) -> np.ndarray:
        deadline = self._deadline(timeout)
        loop = asyncio.get_running_loop()
        while True:
            att = self._attachment(deadline, block=False)
            if att is None:  # the server is being replaced: wait without blocking the loop
                await asyncio.sleep(SLICE)
                continue
            try:
                fit(att, request)
            except Gone as exc:
                self._drop(att, deadline, exc)
                continue
            seq = att.new_seq()  # before the try: see ``_decode``
            future = loop.create_future()
            try:
                slot, _ = await att.take_slot_async(deadline, seq)
                bell = att.register(slot, seq, loop, future)
                submit(att, slot, seq, request, bell)
                self._requests += 1
                left = deadline - time.monotonic()
                try:
                    return await asyncio.wait_for(
                        asyncio.shield(future), None if left == float("inf") else max(0.0, left)
                    )
                except asyncio.TimeoutError:
                    if not att.serving():
                        raise Gone() from None
                    att.forget_pending(slot, seq)
                    raise att.timeout_error() from None
            except Gone as exc:
                _discard(future)
                att.abandon(seq)
                self._drop(att, deadline, exc)
            except BaseException:  # cancelled, or an error answer: see ``decode``
                _discard(future)
                att.abandon(seq)
                raise

    def get_stats(self) -> dict:
        """The server's live counters plus this handle's own, as a dict."""
        stats: dict[str, Any] = {"name": self.name, "handle_requests": self._requests}
        if self._group is not None:
            return stats | self._group.stats()
        att = self._att
        if att is not None:
            try:
                with att.use() as seg:
                    stats.update(stats_from_header(seg.header))
                    stats["handle_slots"] = len(att.owned)
            except (Gone, BiCodecShmError):
                pass
        return stats

    def close(self) -> None:
        """End every call in flight (``ClientClosedError``) and give this handle's slots back.

        Safe to call twice, from any thread, and after a failed ``__init__``.
        """
        with self._lock:  # no attachment made by a call in flight can slip in after this
            self._closed = True
            att, self._att = self._att, None
            group = self._group
        if group is not None and self._pid == os.getpid():
            group.close(self._closed_error())
        if att is not None and self._pid == os.getpid():
            att.close(self._closed_error())

    def __enter__(self) -> DecoderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        att = self._att
        owned = len(att.owned) if att is not None else 0
        return f"<DecoderClient {self.name!r} slots={owned}/{self.max_slots} timeout={self.timeout}>"

    def _closed_error(self) -> ClientClosedError:
        """A fresh one per caller (one instance raised in several threads would garble its
        traceback)."""
        return ClientClosedError(f"this DecoderClient of {self.name!r} is closed")

    # -- request plumbing ---------------------------------------------------------------------

    def _prepare(self, semantic_ids: Any, global_ids: Any, dtype: str, due_in: float = 0.0) -> Request:
        """Validate against BiCodec's own bounds: refuse here only what no server could take.
        ``fit`` checks the limits of the attachment a request actually uses (a server may have
        been replaced by one with other limits, or a group's members may differ)."""
        if self._closed:
            raise self._closed_error()
        semantic = as_token_array(semantic_ids, what="semantic_ids", vocab=BICODEC.level_vocab[0],
                                  max_len=MAX_FRAMES, limit=ANY_SLOT_LIMIT)  # fmt: skip
        globals_ = as_token_array(global_ids, what="global_ids", vocab=BICODEC.global_vocab,
                                  max_len=N_GLOBAL, exact_len=N_GLOBAL)  # fmt: skip
        return Request("bicodec", None, [semantic], globals_, output_dtype_code(dtype),
                       due_at_ns=due_time(due_in), checked=BICODEC)  # fmt: skip

    def _prepare_codes(self, levels: Any, global_ids: Any, noise_seed: int, noise: bool,
                       dtype: str, codec: str | None, *, kind: str = "codes",
                       start_frame: int = 0, due_in: float = 0.0) -> Request:  # fmt: skip
        """Validate a code-level request against its codec's own bounds: the codec it names
        (``codec``, or snac-24khz for Orpheus tokens), else the one the server last attached
        serves; any length a server could hold. ``fit`` checks the attachment's limits."""
        if self._closed:
            raise self._closed_error()
        if codec is not None and codec not in LAYOUTS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {sorted(LAYOUTS)}")
        if not isinstance(noise, bool):
            raise ValueError(f"noise must be True or False, got {noise!r}")
        request = Request(kind, codec, levels, global_ids, output_dtype_code(dtype),
                           check_noise_seed(noise_seed), 0 if noise else FLAG_NO_NOISE,
                           check_start_frame(start_frame), due_time(due_in))  # fmt: skip
        layout = LAYOUTS[codec] if codec is not None else self._codec
        try:
            check_for_layout(request, layout, MAX_FRAMES, self.name, limit=ANY_SLOT_LIMIT)
        except ValueError:
            # Codes that do not fit the codec they name, sent to a server of another codec: say
            # that first (the likelier slip), naming both codecs.
            check_codec(kind, codec, self._codec, self.name)
            raise
        return request

    def _prepare_audio(self, audio: Any, sample_rate: int | None, due_in: float) -> Request:
        """Validate a clip to encode and its stated rate (``fit`` resamples it to the rate of the
        server that takes it and checks it against that server's encoder and slots)."""
        if self._closed:
            raise self._closed_error()
        rate = check_sample_rate(sample_rate)
        return Request("encode", None, [], None, output_dtype_code("float32"), due_at_ns=due_time(due_in),
                       source=read_audio(audio), sample_rate=rate)  # fmt: skip

    def _deadline(self, timeout: float | None) -> float:
        timeout = self.timeout if timeout is None else timeout
        return float("inf") if timeout is None else time.monotonic() + timeout

    # -- attachment lifecycle -----------------------------------------------------------------

    def _connect(self, deadline: float, *, block: bool = True) -> Attachment | None:
        """Attach to whatever serves the name now (a server, or a group's member), retrying
        every slice until ``deadline`` while nothing does."""
        while True:
            try:
                att = self._connect_once()
                self._codec, self._max_tokens = att.codec, att.max_tokens
                return att
            except ServerUnavailableError as exc:
                self._last_error = exc
            except Gone as exc:  # what it attached to went away at once
                self._last_error = self._lost_error(exc)
            if time.monotonic() >= deadline:
                waited = "" if deadline <= self._t_asked else " before the deadline"
                raise ServerUnavailableError(
                    f"no decoder server serves {self.name!r}{waited} ({self._last_error})"
                    f"{_served_hint(self.name)}"
                ) from None
            if not block:
                return None
            time.sleep(min(SLICE, max(0.0, deadline - time.monotonic())))

    def _connect_once(self) -> Attachment:
        if self._group is None:
            info = read_group(self.name, owner_uid=self.owner_uid)
            if info is not None and not info.alive:  # a group starting, stopping or dead
                raise ServerUnavailableError(f"the server group {self.name!r} is not up")
            if info is not None:
                self._group = GroupRouter(info, max_slots=self.max_slots, owner_uid=self.owner_uid)
        if self._group is not None:
            return self._group.connect()
        return Attachment(self.name, max_slots=self.max_slots, owner_uid=self.owner_uid)

    def _attachment(self, deadline: float, *, block: bool = True) -> Attachment | None:
        """The live attachment, attaching again if the last one was dropped. With ``block``
        False, None means "no server yet; ask again after a slice" (asyncio must not sleep).

        Raises ``ServerUnavailableError`` at ``deadline``, or sooner when the server stopped on
        purpose (SIGTERM, Ctrl-C) and no new one has claimed the name within ``STOP_GRACE``
        seconds: a rolling restart's successor claims it well within that, and is waited for
        as long as it is starting."""
        if os.getpid() != self._pid:
            self._forked()
        pause = self._reattach_pause()
        if pause:
            if not block:
                return None
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        while True:
            if self._closed:
                raise self._closed_error()
            group = self._group
            if group is not None:
                # A group: the router picks a member per request. If no member serves, or the
                # group under the name changed, find out again what serves the name.
                att = None if group.outdated() else group.pick()
                if att is not None:
                    return att
                self._regroup(group)
            else:
                att = self._att
                if att is not None and att.retired is None:
                    return att
            with self._lock:
                if self._closed:
                    continue
                if self._att is not None and self._att.retired is None:
                    return self._att
                try:
                    new = self._connect(0.0, block=False)
                except ServerUnavailableError:
                    new = None
                if new is not None:
                    if self._group is None:
                        self._att = new
                    self._stopped_at = None
                    return new
            self._give_up_if_stopped(deadline)
            if not block:
                return None
            time.sleep(min(SLICE, max(0.0, deadline - time.monotonic())))

    def _give_up_if_stopped(self, deadline: float) -> None:
        now = time.monotonic()
        stopped = self._stopped_at
        if now >= deadline:
            raise ServerUnavailableError(
                f"the decoder server {self.name!r} is gone and no new one started before the "
                f"request's deadline ({self._last_error}){_served_hint(self.name)}"
            )
        if stopped is not None and now >= stopped + self.stop_grace:
            if probe(self.name, owner_uid=self.owner_uid) is ServerState.BUSY:
                self._stopped_at = now  # a successor is starting (it owns the name): wait on
                return
            raise ServerUnavailableError(
                f"the decoder server {self.name!r} stopped (SIGTERM or Ctrl-C) and no new server "
                f"took the name within {self.stop_grace:g} s{_served_hint(self.name)}"
            )

    def _regroup(self, group: GroupRouter) -> None:
        """Forget a group router whose group no longer serves the name as it did (a member
        set or epoch change, a single server in its place): its calls in flight resubmit."""
        with self._lock:
            if self._group is not group:
                return
            self._group = None
            self._att = None
        group.close(Gone())

    def _drop(self, att: Attachment, deadline: float, exc: Gone) -> None:
        """Forget an attachment whose server went away (``exc``); the next call attaches
        afresh. At the request's deadline, raise ``ServerUnavailableError`` instead: a server
        that serves but cannot be used (its semaphores removed, say) must not keep a request
        re-attaching past its timeout."""
        att.retire(Gone())
        now = time.monotonic()
        with self._lock:
            if self._att is att:
                self._att = None
                if att.stopped_cleanly and self._stopped_at is None:
                    self._stopped_at = now
            if self._last_dropped is not att:  # each lost attachment once, whoever saw it
                self._last_dropped = att
                self._quick_drops = self._quick_drops + 1 if now - self._dropped_at < SLICE else 1
                self._dropped_at = now
        if self._closed:
            raise self._closed_error()
        if now >= deadline:
            raise self._lost_error(exc)

    def _reattach_pause(self) -> float:
        """Seconds to wait before attaching again: 0, unless attachments have been lost in
        quick succession (a server that serves but fails every attachment), then a short pause
        between tries rather than a spin."""
        if self._quick_drops < 2:
            return 0.0
        return max(0.0, self._dropped_at + REATTACH_PAUSE - time.monotonic())

    def _lost_error(self, exc: BaseException) -> ServerUnavailableError:
        why = exc.__cause__ or exc.__context__
        detail = f" ({why})" if why is not None and str(why) else ""
        return ServerUnavailableError(
            f"lost the decoder server {self.name!r} and no attachment took the request before its "
            f"deadline{detail}"
        )

    def _forked(self) -> None:
        """In a forked child: the parent's attachment (and its slots) are not ours."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._lock = threading.Lock()
        att, self._att = self._att, None
        if att is not None:
            att.forget_after_fork()
        if self._group is not None:
            self._group.forget_after_fork()


def _discard(future: asyncio.Future) -> None:
    """A future nobody will await: cancel it, or mark its exception as retrieved, so that
    asyncio never logs "Future exception was never retrieved" for it."""
    if not future.cancel() and not future.cancelled():
        future.exception()


def _served_hint(name: str) -> str:
    """"; served now: 'a', 'b'" for an error about a name nobody serves (a typo, say)."""
    return "; " + describe_served(exclude=name)
