"""How the server decodes a batch of DAC requests (``server.adapters.CodecAdapter`` for DAC).

A DAC request is one level per codebook, each one code per frame; the batch's levels stack into
the decoder's (B, n_codebooks, T). DAC has no noise and no global ids, so a slot's seed, flags
and start frame are not read.
"""

from __future__ import annotations

import numpy as np
import torch

from ...codecs.layout import CodecLayout
from ...protocol.slot_io import Batch


class DACAdapter:
    """Adapter of a ``DACDecoder``: the codebooks' levels stacked, lengths in frames."""

    def __init__(self, decoder) -> None:  # noqa: ANN001 - a DACDecoder (no import cycle)
        self.decoder = decoder
        self.layout: CodecLayout = decoder.config.layout

    def detokenize(self, batch: Batch) -> torch.Tensor:
        """(B, decoded_samples(T)) float32 audio; row i equals its lone decode, then zeros."""
        codes = torch.from_numpy(np.stack(batch.codes, axis=1))  # n x (B, T) -> (B, n, T)
        return self.decoder.detokenize(codes, torch.from_numpy(batch.lengths))
