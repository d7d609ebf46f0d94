"""Building blocks shared by the prenet and the wave generators (BiCodec's and SNAC's), and the
per-item time mask.

Shapes: ``B`` batch, ``C`` channels, ``T`` frames at the block's own time resolution.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


class TimeMask:
    """Zeroes each item's frames at and beyond its own length, at every time resolution.

    The decoder is non-causal, so a right-padded item would hear its padding. Zeroing the input
    of every time-mixing convolution makes a padded item decode exactly as it does alone: a lone
    item's convolutions pad with zeros too. The masks for every upsampling factor ``f`` are
    built once per forward and keyed by the padded length T·f, which differs for every factor,
    so a layer needs nothing but its input to find its mask. Frames before the shortest length
    are valid in every row and are not touched.

    Args:
        lengths: (B,) valid frames of each item, 1 <= lengths <= n_frames.
        n_frames: padded frame count T of the batch.
        factors: the upsampling factors at which convolutions run (1 = token rate).
        dtype: dtype of the activations to mask.
        shortest: ``lengths.min()`` if the caller knows it from host memory: reading it from a
            device tensor would wait for the device (a host sync).
    """

    def __init__(
        self,
        lengths: torch.Tensor,
        n_frames: int,
        factors: Iterable[int],
        *,
        dtype: torch.dtype,
        shortest: int | None = None,
    ) -> None:
        if shortest is None:
            shortest = int(lengths.min())
        self._masks: dict[int, tuple[int, torch.Tensor]] = {}
        for f in sorted(set(factors)):
            steps = torch.arange(shortest * f, n_frames * f, device=lengths.device)
            valid = steps[None, :] < (lengths[:, None] * f)  # (B, (T - shortest)·f)
            self._masks[n_frames * f] = (shortest * f, valid.to(dtype)[:, None, :])  # (B, 1, ...)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Zero ``x`` (B, C, T·f) past each item's length, in place; returns ``x``."""
        start, mask = self._masks[x.shape[-1]]
        x[..., start:].mul_(mask)
        return x


def masked(x: torch.Tensor, mask: TimeMask | None) -> torch.Tensor:
    """``x`` (B, C, T) with each item's padding zeroed (in place), or ``x`` as is without a mask."""
    return x if mask is None else mask(x)


class WNConv1d(nn.Conv1d):
    """A Conv1d stored weight-normalised in checkpoints; it holds the folded weight (out, in, k)."""


class WNConvTranspose1d(nn.ConvTranspose1d):
    """A ConvTranspose1d stored weight-normalised; weight (in, out, k), so g is (in, 1, 1)."""


class Snake1d(nn.Module):
    """Snake activation ``x + sin²(αx) / (α + 1e-9)`` with one learned α per channel.

    α stays float32 in every precision (see ``precision.py``): with a bfloat16 or float16 ``x``,
    type promotion computes ``sin²(αx)`` and the sum in float32, rounded once on the way out.

    Args:
        channels: number of channels C; ``alpha`` has shape (1, C, 1).
    """

    keep_float32 = True

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C, T), in x's dtype"""
        s = torch.sin(self.alpha * x).square_()
        return torch.addcmul(x, s, (self.alpha + 1e-9).reciprocal()).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm over channels, eps 1e-6, taking (and ignoring) a condition like AdaLayerNorm.

    Statistics and affine are float32 in every precision; the result has x's dtype.
    """

    keep_float32 = True

    def __init__(self, dim: int) -> None:
        super().__init__(dim, eps=1e-6)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)"""
        y = F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps)
        return y.to(x.dtype)


class AdaLayerNorm(nn.Module):
    """LayerNorm without affine, then a scale and shift predicted from the speaker vector.

    Computed in float32 in every precision (the condition is the float32 speaker vector); the
    result has x's dtype.

    Args:
        condition_dim: size D of the condition vector.
        dim: channels C to normalise.
    """

    keep_float32 = True

    def __init__(self, condition_dim: int, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.scale = nn.Linear(condition_dim, dim)
        self.shift = nn.Linear(condition_dim, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C) and cond (B, D) -> (B, T, C)"""
        if cond is None:
            raise ValueError("AdaLayerNorm needs a condition vector")
        y = F.layer_norm(x.float(), (self.dim,), eps=1e-6)
        y = torch.addcmul(self.shift(cond)[:, None, :], y, self.scale(cond)[:, None, :])
        return y.to(x.dtype)


class ConvNeXtBlock(nn.Module):
    """``x + gamma · pwconv2(GELU(pwconv1(norm(dwconv(x)))))``, the Vocos 1-D ConvNeXt block.

    Args:
        dim: channels C.
        intermediate_dim: hidden width of the pointwise MLP.
        condition_dim: size of the condition vector for AdaLayerNorm, or None for LayerNorm.
    """

    def __init__(self, dim: int, intermediate_dim: int, condition_dim: int | None = None) -> None:
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = LayerNorm(dim) if condition_dim is None else AdaLayerNorm(condition_dim, dim)
        self.pwconv1 = nn.Linear(dim, intermediate_dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(intermediate_dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, cond: torch.Tensor | None = None, mask: TimeMask | None = None
    ) -> torch.Tensor:
        """x (B, C, T), cond (B, D) or None -> (B, C, T)"""
        # Zeroing the residual's padding too is harmless: padding reaches valid frames only
        # through convolutions, whose inputs are masked again.
        x = masked(x, mask)
        y = self.dwconv(x).transpose(1, 2)  # (B, C, T) -> (B, T, C)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y, cond))))
        return x + (self.gamma * y).transpose(1, 2)  # (B, T, C) -> (B, C, T)


class ResidualUnit(nn.Module):
    """``x + conv1x1(snake(conv7_dilated(snake(x))))``, the DAC residual unit of BiCodec's and
    SNAC's wave generators; names ``block.0`` ... ``block.3``.

    Args:
        dim: channels C.
        dilation: dilation of the k=7 convolution (padding 3·dilation keeps T).
        groups: groups of the k=7 convolution (SNAC's depthwise units: ``dim``).
    """

    def __init__(self, dim: int, dilation: int, groups: int = 1) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim),
            WNConv1d(dim, dim, kernel_size=7, dilation=dilation, padding=3 * dilation, groups=groups),
            Snake1d(dim),
            WNConv1d(dim, dim, kernel_size=1),
        )

    def forward(self, x: torch.Tensor, mask: TimeMask | None = None) -> torch.Tensor:
        """(B, C, T) -> (B, C, T)"""
        snake1, conv7, snake2, conv1 = self.block
        return x + conv1(snake2(conv7(masked(snake1(x), mask))))
