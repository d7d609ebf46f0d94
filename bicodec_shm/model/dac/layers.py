"""DAC's decode-path blocks, with per-row masking so that a padded row decodes as it does alone.

Module and parameter names follow ``dac`` 1.0.0 (``quantizer.quantizers.i``, ``decoder.model.j``,
``block.k``), so a published state dict loads as is. Shapes: ``B`` batch, ``C`` channels, ``T``
time steps at the block's own resolution.

What keeps a padded row exact (the ground truth is its lone, unpadded decode): every
time-mixing convolution's input is zeroed past the row's own length at that stage
(``StageMask``), as a lone decode's convolutions pad with zeros. The lengths are those of the lone
decode at each stage (``DACConfig.stage_lengths``): a transposed conv of odd stride ``s`` gives
``s·L - 1`` steps, not ``s·L``, so a stage's valid length is not the frames times the upsampling
so far. A transposed conv's outputs below the lone decode's length get nothing from zeroed
inputs; the ones past it (which the lone decode crops) are masked before the next conv.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..modules import ResidualUnit, Snake1d, TimeMask, WNConv1d, WNConvTranspose1d, masked
from .config import DACConfig


class StageMask(TimeMask):
    """``TimeMask`` with each stage's lengths given: zeroes each row's steps at and beyond its
    length at that stage, keyed by the stage's padded length (which grows stage by stage).

    Args:
        lengths: per stage, (B,) valid steps of each row on the model's device.
        padded: per stage, the batch's padded length at that stage.
        shortest: per stage, the shortest row's length (host ints: reading it from the device
            would wait for the device).
        dtype: dtype of the activations to mask.
    """

    def __init__(self, lengths: list[torch.Tensor], padded: tuple[int, ...], shortest: tuple[int, ...],
                 *, dtype: torch.dtype) -> None:  # fmt: skip
        self._masks = {}
        for lens, n, low in zip(lengths, padded, shortest, strict=True):
            steps = torch.arange(low, n, device=lens.device)
            valid = steps[None, :] < lens[:, None]  # (B, n - low)
            self._masks[n] = (low, valid.to(dtype)[:, None, :])  # (B, 1, n - low)


class VectorDequantizer(nn.Module):
    """One codebook: ``codebook`` lookup, then the 1x1 ``out_proj`` to the latent.

    float32 in every precision (see ``precision.py``): a few thousand FLOPs per code.
    """

    keep_float32 = True

    def __init__(self, latent_dim: int, codebook_size: int, codebook_dim: int) -> None:
        super().__init__()
        self.codebook = nn.Embedding(codebook_size, codebook_dim)
        self.out_proj = WNConv1d(codebook_dim, latent_dim, kernel_size=1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, T) int64 -> (B, latent, T) float32"""
        return self.out_proj(self.codebook(codes).transpose(1, 2))  # (B, T, D) -> (B, D, T)


class ResidualDequantizer(nn.Module):
    """The sum of every codebook's de-quantised latent, codebook 0 first (``dac``'s
    ``ResidualVectorQuantize.from_codes``)."""

    def __init__(self, cfg: DACConfig) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(
            VectorDequantizer(cfg.latent, cfg.codebook_size, dim) for dim in cfg.codebook_dims
        )

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, n_codebooks, T) int64 -> (B, latent, T) float32"""
        z = self.quantizers[0](codes[:, 0])
        for i, quantizer in enumerate(self.quantizers[1:], start=1):
            z = z + quantizer(codes[:, i])
        return z


class DecoderBlock(nn.Module):
    """Snake, a transposed conv that upsamples by ``stride``, three residual units.

    Args:
        input_dim: channels C_in.
        output_dim: channels C_out.
        stride: upsampling factor s (kernel 2s, padding ceil(s/2): ``(L + 1)·s - 2·ceil(s/2)``
            steps out for L in).
    """

    def __init__(self, input_dim: int, output_dim: int, stride: int) -> None:
        super().__init__()
        up = WNConvTranspose1d(input_dim, output_dim, kernel_size=2 * stride, stride=stride,
                               padding=math.ceil(stride / 2))  # fmt: skip
        self.block = nn.Sequential(
            Snake1d(input_dim), up, *(ResidualUnit(output_dim, d) for d in (1, 3, 9))
        )

    def forward(self, x: torch.Tensor, mask: StageMask | None = None) -> torch.Tensor:
        """(B, C_in, L) -> (B, C_out, (L + 1)·s - 2·ceil(s/2))"""
        snake, up, *units = self.block
        x = up(masked(snake(x), mask))
        for unit in units:
            x = unit(x, mask)
        return x


class WaveDecoder(nn.Module):
    """``decoder.model``: a k=7 conv, the upsampling blocks, Snake, a k=7 conv to one channel, tanh.

    Args:
        cfg: the codec's config; channels halve at every block.
    """

    def __init__(self, cfg: DACConfig) -> None:
        super().__init__()
        ch = cfg.decoder_dim
        blocks = [DecoderBlock(ch // 2**i, ch // 2 ** (i + 1), s) for i, s in enumerate(cfg.decoder_rates)]
        out_dim = ch // 2 ** len(blocks)
        conv_out = WNConv1d(out_dim, 1, kernel_size=7, padding=3)
        conv_out.keep_float32 = True  # C -> 1 channel, < 0.1 % of the FLOPs; see precision.py
        self.model = nn.Sequential(
            WNConv1d(cfg.latent, ch, kernel_size=7, padding=3),
            *blocks,
            Snake1d(out_dim),
            conv_out,
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor, mask: StageMask | None = None) -> torch.Tensor:
        """(B, latent, T) -> (B, 1, stage_lengths(T)[-1]) in (-1, 1), float32"""
        conv_in, *blocks, snake, conv_out, tanh = self.model
        x = conv_in(masked(z, mask))
        for block in blocks:
            x = block(x, mask)
        x = snake(x.to(conv_out.weight.dtype))  # the last Snake and conv run in float32
        return tanh(conv_out(masked(x, mask)))
