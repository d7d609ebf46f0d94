"""How the server decodes a batch of SNAC requests (``adapters.CodecAdapter`` for SNAC).

Each row carries its own noise seed (and the frame its streaming window starts at) and may ask
for no noise (``protocol.layout.FLAG_NO_NOISE``): the rows with noise and those without are decoded as
two batches, each exact (masking), so a row decodes the same whatever its batchmates want.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ...codecs.layout import MAX_NOISE_SEED, CodecLayout
from ...protocol.layout import FLAG_NO_NOISE
from ...protocol.slot_io import Batch
from ..traced import TracedForward, cpu_lane_graphs
from .layers import BatchContext


class SNACAdapter:
    """Adapter of a ``SNACDecoder``: levels, lengths in frames, per-row noise seeds."""

    def __init__(self, decoder) -> None:  # noqa: ANN001 - a SNACDecoder (no import cycle)
        self.decoder = decoder
        self.layout: CodecLayout = decoder.config.layout
        # On a CPU the lanes decode a batch without padding (every stream window, every lone
        # request) through graphs that run without the GIL, so lanes decode at once as
        # processes would (traced.py); one set per decoder, all lanes'.
        self.unpadded_forward = cpu_lane_graphs(decoder, lambda: UnpaddedForward(decoder).traced())

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


class UnpaddedForward(nn.Module):
    """``SNACDecoder.forward`` of a batch without padding, over tensors only, so that it can be
    traced (model/traced.py): ``(*codes, *noise)`` -> float32 audio (B, 1, spf·T), where codes
    are the levels' (B, T·r_i) and noise is one (B, 1, T·f) per decoder block, or none."""

    def __init__(self, model) -> None:  # noqa: ANN001 - a SNACDecoder (no import cycle)
        super().__init__()
        self.model = model
        self.levels = len(model.config.level_rates)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        noise = list(tensors[self.levels :])
        return self.model(list(tensors[: self.levels]), BatchContext(noise=noise or None))

    def branch(self, *tensors: torch.Tensor) -> tuple[int, bool]:
        """The branches these arguments take: with noise or without, and whether the latent
        length fills the attention's windows (then it needs no mask)."""
        window = self.model.config.attn_window_size
        latent = tensors[0].shape[1] * self.model.config.latents_per_frame
        return len(tensors), window is None or latent % window == 0

    def traced(self) -> TracedForward:
        """This forward through a graph for each ``branch`` (model/traced.py)."""
        return TracedForward(self, key=self.branch)
