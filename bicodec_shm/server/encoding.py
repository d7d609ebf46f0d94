"""The encode direction in the server (audio in, codes back): the encoder checked against the
served codec, which kind of request a plan takes, and publishing either kind's result.

An encode request is a decode run backwards through the same slot (protocol/layout.py): the
server confirms, validates, plans, holds, runs, publishes and reaps it as it does a decode. Only
two things differ, and they are here: a batch runs one model, so a plan takes rows of one kind
(``one_kind``); and its result is codes, not audio (``publish_result``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..codecs.layout import CodecLayout
from ..protocol.segment import Segment
from ..protocol.slot_io import Requests, publish, publish_codes
from .adapters import encode_adapter
from .lanes import Decoded, Encoded


def encoder_for(encoder: Any, codec: CodecLayout) -> Any:
    """The encode adapter (adapters.py) of ``encoder`` for a server of ``codec``, or None for
    no encoder; a ``ValueError`` if its codes are not the ones the decoder takes."""
    if encoder is None:
        return None
    adapter = encode_adapter(encoder)
    if adapter.layout != codec:
        raise ValueError(f"the encoder makes {adapter.layout.describe()}, but the decoder takes "
                         f"{codec.describe()}: load both from one model")  # fmt: skip
    return adapter


def one_kind(ready: Requests) -> tuple[Requests, bool]:
    """The rows of ``ready`` of the kind (encode or decode) whose request is due soonest, and
    whether that kind is encode. The other kind's rows wait for the next plan, due sooner the
    longer they wait, so neither kind starves."""
    encodes = ready.encodes()
    if not encodes.any():
        return ready, False
    if encodes.all():
        return ready, True
    encode = bool(encodes[int(np.argmin(ready.due()))])
    return ready.take(np.flatnonzero(encodes if encode else ~encodes)), encode


def publish_result(seg: Segment, req: Requests, result: Decoded | Encoded) -> tuple[int, list[int]]:
    """Write a batch's result into its slots: audio (``slot_io.publish``) or codes
    (``slot_io.publish_codes``). Returns the time and the rows left unanswered (``moved_on``)."""
    if isinstance(result, Encoded):
        return publish_codes(seg, req, result.codes, result.global_ids, result.frames)
    return publish(seg, req, result.pcm16, result.rows16, result.pcm32, result.rows32)
