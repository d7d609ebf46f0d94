"""How the server decodes a batch of SNAC requests (``adapters.CodecAdapter`` for SNAC).

Each row carries its own noise seed (and the frame its streaming window starts at) and may ask
for no noise (``protocol.layout.FLAG_NO_NOISE``): the rows with noise and those without are decoded as
two batches, each exact (masking), so a row decodes the same whatever its batchmates want.
"""

from __future__ import annotations

import numpy as np
import torch

from ...codecs.layout import MAX_NOISE_SEED, CodecLayout
from ...protocol.layout import FLAG_NO_NOISE
from ...protocol.slot_io import Batch
from ..traced import shared_graphs
from .decoder import UnpaddedForward


class SNACAdapter:
    """Adapter of a ``SNACDecoder``: levels, lengths in frames, per-row noise seeds."""

    def __init__(self, decoder) -> None:  # noqa: ANN001 - a SNACDecoder (no import cycle)
        self.decoder = decoder
        self.layout: CodecLayout = decoder.config.layout
        # On a CPU the lanes decode a batch without padding (every stream window, every lone
        # request) through graphs that run without the GIL, so lanes decode at once as
        # processes would (traced.py); one set per decoder, all lanes'.
        cpu = decoder.device.type == "cpu"
        make = lambda: UnpaddedForward(decoder).traced()  # noqa: E731
        self.unpadded_forward = shared_graphs(decoder, make) if cpu else None

    def detokenize(self, batch: Batch) -> torch.Tensor:
        """(B, spf·T) float32 audio; row i equals its lone decode with its seed."""
        req = batch.requests
        b = len(req)
        # A seed is the slot's 64 bits with the top one dropped: the client sends [0, 2**63),
        # and garbage from a misbehaving client must not fail its batchmates.
        seeds = np.zeros(b, np.uint64) if req.noise_seeds is None else req.noise_seeds
        seeds = (seeds & np.uint64(MAX_NOISE_SEED)).tolist()
        quiet = np.zeros(b, bool) if req.flags is None else (req.flags & FLAG_NO_NOISE) != 0
        starts = [0] * b if req.start_frames is None else req.start_frames.tolist()
        if not quiet.any() or quiet.all():
            return self._decode(batch.codes, batch.lengths, not quiet[0], seeds, starts)
        audio = None
        for rows in (np.flatnonzero(~quiet), np.flatnonzero(quiet)):
            t = int(batch.lengths[rows].max())
            codes = [c[rows, : c.shape[1] // batch.semantic.shape[1] * t] for c in batch.codes]
            part = self._decode(codes, batch.lengths[rows], not quiet[rows[0]], [seeds[i] for i in rows],
                                [starts[i] for i in rows])
            if audio is None:
                audio = part.new_zeros((b, self.layout.samples_per_frame * batch.semantic.shape[1]))
            audio[torch.from_numpy(rows).to(part.device), : part.shape[1]] = part
        return audio

    def _decode(self, codes: list[np.ndarray], lengths: np.ndarray, noise: bool, seeds: list[int],
                starts: list[int]) -> torch.Tensor:  # fmt: skip
        return self.decoder.detokenize([torch.from_numpy(c) for c in codes], torch.from_numpy(lengths),
                                       noise=bool(noise), noise_seeds=seeds, start_frames=starts,
                                       unpadded_forward=self.unpadded_forward)  # fmt: skip
