"""SNAC's decode-path blocks, with per-row masking so that a padded row decodes as it does alone.

Module and parameter names follow ``snac`` 1.2.1 (``quantizer.quantizers.i``, ``decoder.model.j``,
``block.k``), so a published state dict loads as is. Shapes: ``B`` batch, ``C`` channels, ``T``
frames at the block's own time resolution.

What keeps a padded row exact (the ground truth is its lone, unpadded decode):

- every time-mixing convolution's input is zeroed past the row's length (``TimeMask``), as a
  lone decode's convolutions pad with zeros;
- ``LocalMHA`` attends within fixed windows of ``window`` latent frames counted from frame 0;
  a key past the row's length is masked out, so no window ever sees padding or another row. A
  lone row whose length is not a multiple of the window attends within its shorter last window
  (snac itself needs a multiple of the window);
- the noise is given per row (``noise.py``), not drawn here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import ResidualUnit, Snake1d, TimeMask, WNConv1d, WNConvTranspose1d, masked
from .config import DIM_HEAD, SNACConfig


@dataclass
class BatchContext:
    """What one forward needs to know about its rows besides the codes.

    Args:
        mask: zeroes each row's padding at every time resolution, or None (no padding).
        latent_lengths: (B,) latent frames of each row on the model's device, or None when every
            row has the padded length.
        noise: per decoder block, (B, 1, T·f) noise in the compute dtype; None adds no noise.
    """

    mask: TimeMask | None = None
    latent_lengths: torch.Tensor | None = None
    noise: list[torch.Tensor] | None = None


class VectorDequantizer(nn.Module):
    """One level: ``codebook`` lookup, 1x1 ``out_proj`` to the latent, repeated ``stride`` times.

    float32 in every precision (see ``precision.py``): a few thousand FLOPs per code.
    """

    keep_float32 = True

    def __init__(self, latent_dim: int, codebook_size: int, codebook_dim: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.codebook = nn.Embedding(codebook_size, codebook_dim)
        self.out_proj = WNConv1d(codebook_dim, latent_dim, kernel_size=1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, T_level) int64 -> (B, latent, T_level·stride) float32"""
        z = self.codebook(codes).transpose(1, 2)  # (B, T, D) -> (B, D, T)
        return self.out_proj(z).repeat_interleave(self.stride, dim=-1)


class ResidualDequantizer(nn.Module):
    """The sum of every level's de-quantised latent, level 0 first (as ``snac``'s ``from_codes``)."""

    def __init__(self, cfg: SNACConfig) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(
            VectorDequantizer(cfg.latent, cfg.codebook_size, cfg.codebook_dim, s)
            for s in cfg.vq_strides
        )

    def forward(self, codes: list[torch.Tensor]) -> torch.Tensor:
        """codes[i] (B, T·rate_i) -> (B, latent, T·latents_per_frame) float32"""
        z = self.quantizers[0](codes[0])
        for quantizer, level in zip(self.quantizers[1:], codes[1:], strict=True):
            z = z + quantizer(level)
        return z


class Rotary(nn.Module):
    """Rotary position embedding over each window's positions 0..n-1 (snac's
    ``SinusoidalEmbeddings`` without xpos, whose scale is 1). float32 in every precision."""

    keep_float32 = True

    def __init__(self, dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # fixed: not loaded

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (..., n, d) -> rotated q, k, in their dtype"""
        t = torch.arange(k.shape[-2], device=k.device, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)  # (n, d)
        cos, sin = freqs.cos(), freqs.sin()
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    half_turn = torch.cat((-x2, x1), dim=-1)
    return (x * cos + half_turn * sin).to(x.dtype)


class ChannelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm(dim)`` (eps 1e-5, affine) computed in float32; returns x's dtype."""

    keep_float32 = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)"""
        return super().forward(x.float()).to(x.dtype)


class LocalMHA(nn.Module):
    """Pre-norm multi-head attention within windows of ``window`` frames, plus the residual.

    Args:
        dim: channels C (heads of 64).
        window: frames per window; windows start at frame 0.
    """

    def __init__(self, dim: int, window: int) -> None:
        super().__init__()
        self.norm = ChannelLayerNorm(dim)
        self.heads = dim // DIM_HEAD
        self.window_size = window
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.rel_pos = Rotary(DIM_HEAD)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, C, T), lengths (B,) valid frames or None (all T) -> (B, C, T)"""
        batch, channels, frames = x.shape
        size = self.window_size
        windows = -(-frames // size)
        h = self.norm(x.transpose(1, 2))  # (B, C, T) -> (B, T, C)
        h = F.pad(h, (0, 0, 0, windows * size - frames))  # (B, W·n, C)
        q, k, v = (
            t.reshape(batch, windows, size, self.heads, DIM_HEAD).transpose(2, 3)
            .reshape(batch * windows, self.heads, size, DIM_HEAD)
            for t in self.to_qkv(h).chunk(3, dim=-1)
        )  # (B, W·n, C) -> (B·W, H, n, 64)  # fmt: skip
        q, k = self.rel_pos(q, k)
        keep = _window_mask(lengths, batch, frames, windows, size, x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        out = out.reshape(batch, windows, self.heads, size, DIM_HEAD).transpose(2, 3)
        out = out.reshape(batch, windows * size, channels)[:, :frames]  # (B·W, H, n, 64) -> (B, T, C)
        return self.to_out(out).transpose(1, 2) + x  # (B, T, C) -> (B, C, T)


def _window_mask(
    lengths: torch.Tensor | None, batch: int, frames: int, windows: int, size: int, device: torch.device
) -> torch.Tensor | None:
    """(B·W, 1, 1, n) bool: which keys each window may attend to; None when all of them.

    A key past its row's length is masked. A window with no valid key at all (pure padding)
    attends to all of its keys instead, so that softmax stays finite; its output is padding,
    zeroed before any convolution reads it.
    """
    if lengths is None and frames % size == 0:
        return None
    if lengths is None:
        lengths = torch.full((batch,), frames, device=device)
    positions = torch.arange(windows * size, device=device)
    valid = (positions < lengths[:, None]).view(-1, windows, size)  # (B, W, n)
    valid |= ~valid.any(dim=-1, keepdim=True)
    return valid.view(-1, 1, 1, size)


class NoiseBlock(nn.Module):
    """``x + noise · linear(x)``: the noise (B, 1, T) comes from the caller (``noise.py``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = WNConv1d(dim, dim, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """x (B, C, T), noise (B, 1, T) or None -> (B, C, T)"""
        return x if noise is None else x + noise * self.linear(x)


class DecoderBlock(nn.Module):
    """Snake, a transposed conv that lengthens time by exactly ``stride``, noise, 3 residual units.

    Args:
        input_dim: channels C_in.
        output_dim: channels C_out.
        stride: upsampling factor s (kernel 2s, padding ceil(s/2), output padding s mod 2).
        noise: whether the block has a NoiseBlock (it shifts the residual units' names).
        groups: groups of the residual units' k=7 convs.
    """

    def __init__(self, input_dim: int, output_dim: int, stride: int, noise: bool, groups: int) -> None:
        super().__init__()
        up = WNConvTranspose1d(
            input_dim, output_dim, kernel_size=2 * stride, stride=stride,
            padding=math.ceil(stride / 2), output_padding=stride % 2,
        )  # fmt: skip
        layers: list[nn.Module] = [Snake1d(input_dim), up]
        if noise:
            layers.append(NoiseBlock(output_dim))
        layers += [ResidualUnit(output_dim, d, groups) for d in (1, 3, 9)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, ctx: BatchContext, noise: torch.Tensor | None) -> torch.Tensor:
        """(B, C_in, T) -> (B, C_out, s·T)"""
        snake, up, *rest = self.block
        x = up(masked(snake(x), ctx.mask))
        for layer in rest:
            x = layer(x, noise) if isinstance(layer, NoiseBlock) else layer(x, ctx.mask)
        return x


class WaveDecoder(nn.Module):
    """``decoder.model``: input conv(s), optional LocalMHA, upsampling blocks, Snake, conv, tanh.

    Args:
        cfg: the codec's config; channels halve at every block.
    """

    def __init__(self, cfg: SNACConfig) -> None:
        super().__init__()
        latent, ch = cfg.latent, cfg.decoder_dim
        if cfg.depthwise:
            layers: list[nn.Module] = [
                WNConv1d(latent, latent, kernel_size=7, padding=3, groups=latent),
                WNConv1d(latent, ch, kernel_size=1),
            ]
        else:
            layers = [WNConv1d(latent, ch, kernel_size=7, padding=3)]
        if cfg.attn_window_size is not None:
            layers.append(LocalMHA(ch, cfg.attn_window_size))
        for i, stride in enumerate(cfg.decoder_rates):
            out_dim = ch // 2 ** (i + 1)
            layers.append(DecoderBlock(ch // 2**i, out_dim, stride, cfg.noise,
                                       groups=out_dim if cfg.depthwise else 1))  # fmt: skip
        conv_out = WNConv1d(out_dim, 1, kernel_size=7, padding=3)
        conv_out.keep_float32 = True  # C -> 1 channel, < 0.1 % of the FLOPs; see precision.py
        layers += [Snake1d(out_dim), conv_out, nn.Tanh()]
        self.model = nn.Sequential(*layers)
        # Upsampling at the input (1) and after each block: 1, 8, 64, 256, 512 at 24 kHz.
        self.time_factors = tuple(
            math.prod(cfg.decoder_rates[:i]) for i in range(len(cfg.decoder_rates) + 1)
        )

    def forward(self, z: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """(B, latent, T) -> (B, 1, hop·T) in (-1, 1), float32"""
        *body, snake, conv_out, tanh = self.model
        x, block = z, 0
        for layer in body:
            if isinstance(layer, LocalMHA):
                x = layer(x, ctx.latent_lengths)
            elif isinstance(layer, DecoderBlock):
                x = layer(x, ctx, ctx.noise[block] if ctx.noise is not None else None)
                block += 1
            elif layer.kernel_size[0] > 1:  # the input convs; only k=7 mixes time
                x = layer(masked(x, ctx.mask))
            else:
                x = layer(x)
        x = snake(x.to(conv_out.weight.dtype))  # the last Snake and conv run in float32
        return tanh(conv_out(masked(x, ctx.mask)))
