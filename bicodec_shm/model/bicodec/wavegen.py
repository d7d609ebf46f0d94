"""The wave generator: DAC-style upsampling blocks with Snake activations, ending in tanh.

Checkpoint prefix ``decoder.``. Shapes: ``B`` batch, ``C`` channels, ``T`` frames at the
block's input resolution.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..modules import ResidualUnit, Snake1d, TimeMask, WNConv1d, WNConvTranspose1d, masked
from .config import RESIDUAL_DILATIONS, WaveGeneratorConfig


class UpsampleBlock(nn.Module):
    """Snake, a transposed conv that lengthens time by exactly ``stride``, three residual units.

    Args:
        input_dim: channels C_in.
        output_dim: channels C_out.
        kernel_size: transposed-conv kernel k; ``k - stride`` must be even.
        stride: upsampling factor s.
    """

    def __init__(self, input_dim: int, output_dim: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        up = WNConvTranspose1d(
            input_dim, output_dim, kernel_size, stride=stride, padding=(kernel_size - stride) // 2
        )
        self.block = nn.Sequential(
            Snake1d(input_dim), up, *(ResidualUnit(output_dim, d) for d in RESIDUAL_DILATIONS)
        )

    def forward(self, x: torch.Tensor, mask: TimeMask | None = None) -> torch.Tensor:
        """(B, C_in, T) -> (B, C_out, s·T)"""
        snake, up, *units = self.block
        x = up(masked(snake(x), mask))
        for unit in units:
            x = unit(x, mask)
        return x


class WaveGenerator(nn.Module):
    """``model.0`` conv, upsampling blocks ``model.1..n``, Snake, conv to one channel, tanh.

    Args:
        cfg: the ``decoder`` section of the config; channels halve at every block.
    """

    def __init__(self, cfg: WaveGeneratorConfig) -> None:
        super().__init__()
        ch = cfg.channels
        blocks = [
            UpsampleBlock(ch // 2**i, ch // 2 ** (i + 1), k, s)
            for i, (k, s) in enumerate(zip(cfg.kernel_sizes, cfg.rates, strict=True))
        ]
        out_dim = ch // 2 ** len(blocks)
        conv_out = WNConv1d(out_dim, 1, kernel_size=7, padding=3)
        conv_out.keep_float32 = True  # 96 -> 1 channel, < 0.1 % of the FLOPs; see precision.py
        self.model = nn.Sequential(
            WNConv1d(cfg.input_channel, ch, kernel_size=7, padding=3),
            *blocks,
            Snake1d(out_dim),
            conv_out,
            nn.Tanh(),
        )
        # Time resolutions (upsampling so far) at which convolutions run: 1, 8, 40, 160, 320.
        self.time_factors = tuple(math.prod(cfg.rates[:i]) for i in range(len(cfg.rates) + 1))

    def forward(self, x: torch.Tensor, mask: TimeMask | None = None) -> torch.Tensor:
        """(B, C_in, T) -> (B, 1, hop·T), in (-1, 1), in the output conv's dtype (float32)"""
        conv_in, *blocks, snake, conv_out, tanh = self.model
        x = conv_in(masked(x, mask))
        for block in blocks:
            x = block(x, mask)
        x = snake(x.to(conv_out.weight.dtype))  # the last Snake and conv run in float32
        return tanh(conv_out(masked(x, mask)))
