"""Codec adapters: how the server hands a gathered batch to the decoder of the codec it serves.

The protocol and the engine know a codec only by its ``CodecLayout`` (levels, rates, samples
per frame, global ids). What a decoder's ``detokenize`` takes differs per codec, so each codec
provides an adapter with two members::

    layout: CodecLayout                        written into the segment header
    detokenize(batch: slot_io.Batch) -> (B, >= decoded_samples(T)) float audio on the
                                               decoder's device (spf·T less the layout's end_trim)

A decoder that plays an asynchronous device (the bench's stand-in, ``asynchronous = True``)
also has ``launch(...)``, which returns its output at once with an event whose
``synchronize()`` waits for the "device"; the BiCodec adapter passes it on as ``launch(batch)``.
The server reads a launch's output only after its event has completed, and it launches batch
k before it reads batch k-1's output: so each launch returns an output of its own, which no
later launch writes (sharing one is safe only for an output nobody writes, as the stand-in's
zeros). Its inputs are the batch's own copies, kept unchanged until the batch is published.

A decoder names its adapter with a ``codec_adapter()`` method (``SNACDecoder`` does); one
without it is taken as BiCodec (``detokenize(semantic, global_ids, lengths)``, as
``BiCodecDecoder`` and the tests' stand-ins have). A third codec is one more model module with
its ``codec_adapter()``: nothing here or in the protocol changes.

The encode direction has adapters of its own (``encode_adapter``), with::

    layout: CodecLayout                        the token layout its codes follow (must be the
                                               served codec's: the server checks it)
    min_samples: int                           the fewest samples of audio it encodes
    encode(batch) -> (codes, global_ids, frames)   an encode batch (``Batch.audio``, (B, A)
                                               float32, ``Batch.audio_lengths``) -> every
                                               level's (B, r_i·T) codes, (B, n_global) global
                                               ids and (B,) frames, integer tensors

An encoder names its adapter with an ``encode_adapter()`` method; one without it is taken as
``BiCodecEncoder`` (``tokenize(wavs, lengths)``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import torch

from ..codecs.layout import BICODEC, CodecLayout
from ..protocol.slot_io import Batch


class Detokenizer(Protocol):
    """What the server needs from a decoder (``BiCodecDecoder`` or a test double)."""

    def detokenize(
        self, semantic_ids: torch.Tensor, global_ids: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """(B, T) int64, (B, 32) int64, (B,) int64 host tensors -> (B, 320·T) float."""
        ...


def device_of(decoder: object) -> torch.device:
    """Where ``decoder``'s batches go: its ``device``, else its first parameter's, else the CPU."""
    device = getattr(decoder, "device", None)
    if device is not None:
        return torch.device(device)
    parameters = getattr(decoder, "parameters", None)
    if callable(parameters):
        for p in parameters():
            return p.device
    return torch.device("cpu")


class CodecAdapter(Protocol):
    layout: CodecLayout

    def detokenize(self, batch: Batch) -> torch.Tensor:
        """A gathered batch -> float audio (B, >= layout.decoded_samples(T)) on the decoder's
        device; row i is meaningful up to ``decoded_samples(lengths[i])``."""
        ...


class BiCodecAdapter:
    """BiCodec: level 0 is the semantic ids, plus 32 global ids per row."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        config = getattr(decoder, "config", None)
        self.layout = replace(
            BICODEC,
            level_vocab=(int(getattr(config, "semantic_vocab", BICODEC.level_vocab[0])),),
            global_vocab=int(getattr(config, "global_vocab", BICODEC.global_vocab)),
        )
        # On a CPU the lanes decode a batch without padding (every lone request, every batch of
        # equal lengths) through a graph that runs without the GIL, so lanes decode at once as
        # processes would (model/traced.py); one per decoder, all lanes'. A test double or a
        # decoder on a device has none.
        self.unpadded_forward = _cpu_lane_graphs(decoder)

    def detokenize(self, batch: Batch) -> torch.Tensor:
        if self.unpadded_forward is None:
            return self.decoder.detokenize(*self._tensors(batch))
        return self.decoder.detokenize(*self._tensors(batch), unpadded_forward=self.unpadded_forward)

    def launch(self, batch: Batch) -> tuple[torch.Tensor, Any]:
        """An asynchronous decoder's launch: (output, event to ``synchronize()``)."""
        return self.decoder.launch(*self._tensors(batch))

    @staticmethod
    def _tensors(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.from_numpy(batch.semantic), torch.from_numpy(batch.global_ids),
                torch.from_numpy(batch.lengths))  # fmt: skip


def _cpu_lane_graphs(decoder: Any) -> Any:
    """The traced forward the CPU lanes of a ``BiCodecDecoder`` share, else None."""
    from ..model.bicodec.decoder import BiCodecDecoder  # not imported by servers of other codecs
    from ..model.traced import TracedForward, cpu_lane_graphs

    if not isinstance(decoder, BiCodecDecoder):
        return None
    return cpu_lane_graphs(decoder, lambda: TracedForward(decoder))


def codec_adapter(decoder: Any) -> CodecAdapter:
    """The adapter of ``decoder``'s codec: its own ``codec_adapter()``, else BiCodec's."""
    make = getattr(decoder, "codec_adapter", None)
    return make() if callable(make) else BiCodecAdapter(decoder)


class BiCodecEncodeAdapter:
    """BiCodec's encoder (``BiCodecEncoder.tokenize``): one level, the semantic ids at 50 per
    second, plus 32 global ids per row."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        codec = encoder.config.codec
        self.layout = replace(BICODEC, level_vocab=(int(codec.semantic_vocab),),
                              global_vocab=int(codec.global_vocab))  # fmt: skip
        self.min_samples = int(encoder.features.min_samples())

    def encode(self, batch: Batch) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        tokens = self.encoder.tokenize(torch.from_numpy(batch.audio), torch.from_numpy(batch.audio_lengths))
        return [tokens.semantic_ids], tokens.global_ids, tokens.lengths


def encode_adapter(encoder: Any) -> BiCodecEncodeAdapter:
    """The encode adapter of ``encoder``: its own ``encode_adapter()``, else BiCodec's."""
    make = getattr(encoder, "encode_adapter", None)
    return make() if callable(make) else BiCodecEncodeAdapter(encoder)
