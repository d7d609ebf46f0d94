"""A validated request (``Request``: what ``Attachment.submit`` writes) and its fit to the
attachment that sends it.

A request is validated twice: once when it is made, against its codec's own bounds (anything some
server could hold), and again against the attachment that will actually send it (``fit``): a
server restarted with a smaller ``--max-tokens``, or one that serves another codec, refuses it
there, before anything is written. numpy only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..codecs.audio import at_codec_rate, check_audio_length
from ..codecs.layout import DEFAULT_NOISE_SEED, LAYOUTS, CodecLayout, check_request
from ..codecs.validation import SLOT_LIMIT, as_token_array
from ..errors import NoEncoderError
from ..protocol.attachment import Attachment
from ..protocol.layout import MAX_DUE_IN_US, N_GLOBAL


def due_time(due_in: float) -> int:
    """The CLOCK_MONOTONIC time (ns) at which audio due in ``due_in`` seconds from now is due
    (a stream's audio still buffered at its listener), or 0 for ``due_in`` 0: due whenever it
    is sent. The server decodes what is due soonest first and caps it at ``MAX_DUE_IN_US`` after
    the submit. A negative, NaN or non-number ``due_in`` is a ``ValueError``."""
    if isinstance(due_in, bool) or not isinstance(due_in, (int, float)) or not due_in >= 0:
        raise ValueError(f"due_in must be a number of seconds >= 0, got {due_in!r}")
    if due_in == 0:
        return 0
    return time.monotonic_ns() + int(min(due_in, MAX_DUE_IN_US / 1e6) * 1e9)


@dataclass
class Request:
    """A validated request: what ``Attachment.submit`` writes."""

    kind: str  # "bicodec" (decode), "orpheus" (snac-24khz codes), "codes" (decode_codes), "encode"
    codec: str | None  # the codec the caller named (decode_codes(codec=...)), else None
    levels: list[np.ndarray]  # (T·r_i,) int32 per level; BiCodec: [semantic]
    global_ids: np.ndarray | None  # (n_global,) int32, or None for a codec without them
    dtype: int  # OutputDtype
    noise_seed: int = DEFAULT_NOISE_SEED
    flags: int = 0  # FLAG_NO_NOISE
    start_frame: int = 0  # SNAC: where a streaming window starts in its utterance
    due_at_ns: int = 0  # CLOCK_MONOTONIC time its audio is due (``due_time``); 0: due when sent
    checked: CodecLayout | None = None  # the layout it was last checked against
    # An encode's clip as the caller gave it, (N,) float32 or float64 (``codecs.audio.read_audio``),
    # at ``sample_rate`` (None: the codec's); ``fit`` makes ``audio`` from it for the server that
    # takes it, resampled to that server's codec's rate, and ``submit`` writes that.
    source: np.ndarray | None = None
    sample_rate: int | None = None
    audio: np.ndarray | None = None  # (M,) float32 at the rate of ``audio_for``
    audio_for: tuple[int, Any] | None = None  # (rate, resampling) ``audio`` was made for


def fit(att: Attachment, request: Request) -> None:
    """Check a validated request against the limits of the server that will decode it, before
    anything is written (a restarted server may have a smaller --max-tokens, or serve another
    codec). Raises ``Gone`` rather than refuse it for a server that no longer serves: its
    successor, with limits of its own, decides."""
    if request.source is not None:
        try:
            _fit_audio(att, request)
        except ValueError:
            att.check_alive()  # as below
            raise
        return
    # The common case costs one comparison: checked against this very layout already (the
    # layout holds every vocabulary), and short enough for this server's slots.
    if request.checked == att.codec and request.levels[0].shape[0] <= att.max_tokens:
        return
    try:
        _fit_slow(att, request)
    except ValueError:
        att.check_alive()  # raises Gone (and retires the attachment) if its server went away
        raise


def _fit_audio(att: Attachment, request: Request) -> None:
    """An encode request against the server that will take it: one that encodes, and a clip,
    resampled to its codec's rate where the caller's is another, that its encoder and its slots
    take."""
    if not att.encode_min_samples:
        att.check_alive()  # a server gone is not refusing: its successor may encode
        raise NoEncoderError(
            f"{att.name!r} does not encode: its server was started without --encode (start it with "
            f"`bicodec-shm serve --encode`, or DecoderServer(..., encoder=...)); it serves {att.codec.name} "
            "decodes only"
        )
    codec = att.codec
    key = (codec.sample_rate, codec.resampling)
    if request.audio_for != key:  # made once, again only for a successor of another codec
        request.audio = at_codec_rate(request.source, request.sample_rate, codec)
        request.audio_for = key
    rate = request.sample_rate
    resampled = rate is not None and rate != codec.sample_rate
    check_audio_length(request.audio.shape[0], min_samples=att.encode_min_samples,
                       max_samples=att.max_audio_samples, sample_rate=codec.sample_rate, name=att.name,
                       resampled_from=(request.source.shape[0], rate) if resampled else None)  # fmt: skip


def _fit_slow(att: Attachment, request: Request) -> None:
    if request.kind != "bicodec":
        check_for_layout(request, att.codec, att.max_tokens, att.name)
        return
    check_codec("bicodec", None, att.codec, att.name)
    request.levels[0], request.global_ids = _fit_bicodec(att, request.levels[0], request.global_ids)
    request.checked = att.codec


def _fit_bicodec(att: Attachment, semantic: np.ndarray,
                 globals_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    if (
        semantic.shape[0] > att.max_tokens
        or int(semantic.max()) >= att.semantic_vocab
        or int(globals_.max()) >= att.global_vocab
    ):
        semantic = as_token_array(semantic, what="semantic_ids", vocab=att.semantic_vocab,
                                  max_len=att.max_tokens)  # fmt: skip
        globals_ = as_token_array(globals_, what="global_ids", vocab=att.global_vocab,
                                  max_len=N_GLOBAL, exact_len=N_GLOBAL)  # fmt: skip
    return semantic, globals_


def submit(att: Attachment, slot: int, seq: int, request: Request, bell: int) -> None:
    att.submit(slot, seq, request.levels, request.global_ids, request.dtype, bell,
               noise_seed=request.noise_seed, flags=request.flags,
               start_frame=request.start_frame, due_at_ns=request.due_at_ns,
               audio=request.audio)  # fmt: skip


def check_codec(kind: str, codec: str | None, served: CodecLayout, name: str) -> None:
    """Refuse a request for another codec than the one ``name`` serves, naming both."""
    wanted = {"bicodec": "bicodec", "orpheus": "snac-24khz"}.get(kind, codec)
    if wanted is None or wanted == served.name:
        return
    hint = {
        "bicodec": "send its code levels with decode_codes(levels), or Orpheus tokens with "
                   "decode_orpheus(token_ids)",
        "orpheus": "Orpheus tokens need a `serve --codec snac-24khz` server",
    }.get(kind, f"start a `serve --codec {wanted}` server, or send {served.name} codes")
    what = {"bicodec": "decode() sends BiCodec semantic and global ids",
            "orpheus": "Orpheus audio tokens are snac-24khz codes",
            }.get(kind, f"these are {wanted} codes")  # fmt: skip
    raise ValueError(f"{what}, but {name!r} serves {served.name} ({served.describe()}): {hint}")


def check_for_layout(request: Request, layout: CodecLayout, max_frames: int, name: str, *,
                   limit: str = SLOT_LIMIT) -> None:  # fmt: skip
    """Validate a code-level request against ``layout`` in place (its levels become int32
    arrays); a request shaped for another codec is refused naming both codecs. ``limit`` says
    what ``max_frames`` is, for the message of a request that is too long."""
    check_codec(request.kind, request.codec, layout, name)
    levels = request.levels
    n_levels = len(levels) if isinstance(levels, (list, tuple)) or getattr(levels, "ndim", 0) == 2 else None
    globs = request.global_ids is not None
    if n_levels is not None and n_levels != layout.n_levels:
        guess = sorted(c.name for c in LAYOUTS.values()
                       if c.n_levels == n_levels and c.takes_global_ids == globs)  # fmt: skip
        shape = f"{n_levels} code level(s) {'with' if globs else 'without'} global ids"
        like = f" (the shape of {' or '.join(guess)} codes)" if guess else ""
        raise ValueError(
            f"this request has {shape}{like}, but {name!r} serves {layout.name}: "
            f"{layout.describe()}"
        )
    request.levels, request.global_ids, _ = check_request(
        layout, levels, request.global_ids, max_frames=max_frames, slot_limit=limit
    )
    request.checked = layout
