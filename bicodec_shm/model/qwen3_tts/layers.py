"""The convolutional half of the 12 Hz tokenizer's decode path: the split residual dequantizer,
causal convolutions, the ConvNeXt upsamplers and the SnakeBeta wave decoder.

Module and parameter names follow qwen-tts 0.1.1 (``quantizer.rvq_first.vq.layers.0._codebook``,
``upsample.0.1.dwconv.conv``, ``decoder.1.block.2.conv1.conv``, ...), so a published state dict
loads as is. Shapes: ``B`` batch, ``C`` channels, ``T`` steps at the block's own resolution.

Everything here is causal: a convolution pads ``(k - 1)·dilation`` zeros on the left and none
on the right, and a transposed convolution of stride ``s`` and kernel ``2s`` drops its last
``s`` outputs. Step ``t`` of any output depends on input steps ``<= t`` only, so a row padded
on the right decodes its own steps exactly as it does alone: no mask is needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen3CodecConfig


class SnakeBeta(nn.Module):
    """``x + sin²(e^α · x) / (e^β + 1e-9)`` per channel; α and β are stored as logarithms.

    float32 in every precision (``precision.py``), as the Snake of the other codecs.
    """

    keep_float32 = True

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C, T), in the input's dtype"""
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        y = x.float()
        return (y + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(y * alpha), 2)).to(x.dtype)


class CausalConv(nn.Module):
    """``conv``: a stride-1 Conv1d that pads ``(kernel - 1)·dilation`` zeros on the left only."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel, dilation=dilation, groups=groups)
        self.left = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, T) -> (B, C_out, T)"""
        return self.conv(F.pad(x, (self.left, 0)))


class CausalTransConv(nn.Module):
    """``conv``: a ConvTranspose1d of stride ``s`` whose last ``kernel - s`` outputs are dropped."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_ch, out_ch, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, T) -> (B, C_out, s·T)"""
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.trim] if self.trim else y


class ConvNeXtBlock(nn.Module):
    """Causal depthwise k=7 conv, LayerNorm, 4x pointwise MLP with GELU, ``gamma``, residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C, T)"""
        h = self.norm(self.dwconv(x).transpose(1, 2))  # (B, T, C)
        h = self.gamma * self.pwconv2(self.act(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class ResidualUnit(nn.Module):
    """SnakeBeta, causal k=7 conv of ``dilation``, SnakeBeta, 1x1 conv, plus the input."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    """``block``: SnakeBeta, a causal transposed conv upsampling by ``stride``, three residual
    units (dilations 1, 3, 9). (B, C_in, T) -> (B, C_out, stride·T)."""

    def __init__(self, in_dim: int, out_dim: int, stride: int) -> None:
        super().__init__()
        units = [ResidualUnit(out_dim, d) for d in (1, 3, 9)]
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalTransConv(in_dim, out_dim, 2 * stride, stride), *units]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


class Codebook(nn.Module):
    """``_codebook``: entries ``embedding_sum / max(cluster_usage, 1e-5)``, as trained (an EMA
    codebook keeps the two apart). float32 in every precision: a lookup per code."""

    keep_float32 = True

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, T) int64 -> (B, T, dim) float32"""
        return F.embedding(codes, self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None])


class _Quantization(nn.Module):
    """``_codebook`` wrapped as upstream's ``VectorQuantization`` (no projection: dims equal)."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = Codebook(size, dim)


class _Layers(nn.Module):
    def __init__(self, count: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Quantization(size, dim) for _ in range(count))


class ResidualDequantizer(nn.Module):
    """``rvq_first`` / ``rvq_rest``: the sum of its codebooks' entries, codebook 0 first, then a
    bias-free 1x1 ``output_proj`` to ``codebook_dim``."""

    def __init__(self, count: int, size: int, dim: int, out_dim: int) -> None:
        super().__init__()
        self.vq = _Layers(count, size, dim)
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)
        self.output_proj.keep_float32 = True

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, K, T) int64 -> (B, out_dim, T) float32"""
        z = self.vq.layers[0]._codebook(codes[:, 0])
        for k, layer in enumerate(self.vq.layers[1:], start=1):
            z = z + layer._codebook(codes[:, k])
        return self.output_proj(z.transpose(1, 2))


class SplitDequantizer(nn.Module):
    """``quantizer``: codebook 0 (semantic) through ``rvq_first``, the rest through ``rvq_rest``,
    summed. (B, num_quantizers, T) int64 -> (B, codebook_dim, T) float32."""

    def __init__(self, cfg: Qwen3CodecConfig) -> None:
        super().__init__()
        half = cfg.codebook_dim // 2
        self.rvq_first = ResidualDequantizer(1, cfg.codebook_size, half, cfg.codebook_dim)
        self.rvq_rest = ResidualDequantizer(cfg.num_quantizers - 1, cfg.codebook_size, half, cfg.codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


def upsamplers(cfg: Qwen3CodecConfig) -> nn.ModuleList:
    """``upsample``: per ratio ``r``, a causal transposed conv (kernel = stride = ``r``) and a
    ConvNeXt block, at ``latent_dim`` channels. (B, latent, T) -> (B, latent, prod(ratios)·T)."""
    latent = cfg.latent_dim
    return nn.ModuleList(
        nn.ModuleList([CausalTransConv(latent, latent, r, r), ConvNeXtBlock(latent)])
        for r in cfg.upsampling_ratios
    )


def wave_decoder(cfg: Qwen3CodecConfig) -> nn.ModuleList:
    """``decoder``: a causal k=7 conv to ``decoder_dim``, one ``DecoderBlock`` per rate (channels
    halve each time), SnakeBeta, a causal k=7 conv to one channel (float32, as the SnakeBeta
    before it: a sliver of the FLOPs, and the audio is not rounded to 16 bits; precision.py)."""
    dim = cfg.decoder_dim
    blocks = [DecoderBlock(dim // 2**i, dim // 2 ** (i + 1), r) for i, r in enumerate(cfg.upsample_rates)]
    out_dim = dim // 2 ** len(blocks)
    conv_out = CausalConv(out_dim, 1, 7)
    conv_out.keep_float32 = True
    return nn.ModuleList([CausalConv(cfg.latent_dim, dim, 7), *blocks, SnakeBeta(out_dim), conv_out])
