"""How the server decodes a batch of 12 Hz tokenizer requests (``server.adapters.CodecAdapter``),
and how it encodes one (the encode adapter of ``server.adapters.encode_adapter``).

A request is one level per codebook, one code per frame each; the batch's levels stack into the
decoder's (B, 16, T). The codec has no noise and no global ids, so a slot's seed and flags are
not read; its start frame places a stream's window on the utterance's chunk grid. An encode
batch goes the other way: its right-padded (B, A) audio and each row's samples go to
``Qwen3TTSEncoder.tokenize``, and its (B, 16, F) codes come back as the same 16 levels, row i's
first ``ceil(samples_i / 1920)`` of them its codes (each row's lone encode's).
"""

from __future__ import annotations

import numpy as np
import torch

from ...codecs.layout import CodecLayout
from ...protocol.slot_io import Batch
from ..traced import TracedForward, cpu_lane_graphs


class Qwen3TTSAdapter:
    """Adapter of a ``Qwen3TTSDecoder``: the codebooks' levels stacked, lengths in frames."""

    def __init__(self, decoder) -> None:  # noqa: ANN001 - a Qwen3TTSDecoder (no import cycle)
        self.decoder = decoder
        self.layout: CodecLayout = decoder.config.layout
        # On a CPU the lanes replay the window decoder as one graph that runs without the GIL,
        # so lanes decode at once as processes would (traced.py); one per decoder, all lanes'.
        self.window_decoder = cpu_lane_graphs(decoder, lambda: TracedForward(decoder.decoder))

    def detokenize(self, batch: Batch) -> torch.Tensor:
        """(B, 1920·T) float32 audio; row i equals its lone decode."""
        codes = torch.from_numpy(np.stack(batch.codes, axis=1))  # 16 x (B, T) -> (B, 16, T)
        starts = batch.requests.start_frames
        starts = None if starts is None else starts.tolist()
        return self.decoder.detokenize(codes, torch.from_numpy(batch.lengths), start_frames=starts,
                                       window_decoder=self.window_decoder)  # fmt: skip


class Qwen3TTSEncodeAdapter:
    """Encode adapter of a ``Qwen3TTSEncoder``: audio rows in, its codes as 16 levels of one code
    per frame each (``decode_codes`` takes them back as they are), no global ids."""

    def __init__(self, encoder) -> None:  # noqa: ANN001 - a Qwen3TTSEncoder (no import cycle)
        self.encoder = encoder
        self.layout: CodecLayout = encoder.config.layout
        self.min_samples = 1  # one sample is one (partial) frame: the encoder pads it as upstream

    def encode(self, batch: Batch) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(B, A) float32 audio and its (B,) lengths -> 16 x (B, F) codes, (B, 0) global ids,
        (B,) frames; row i exact for its frames (``Qwen3TTSEncoder.tokenize``)."""
        out = self.encoder.tokenize(torch.from_numpy(batch.audio), torch.from_numpy(batch.audio_lengths))
        levels = list(out.codes.unbind(1))  # (B, 16, F) -> 16 x (B, F)
        return levels, out.codes.new_zeros((out.codes.shape[0], 0)), out.lengths
