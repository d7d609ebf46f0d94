"""The prenet: a Vocos (ConvNeXt) feature decoder conditioned on the speaker vector.

Checkpoint prefix ``prenet.``. Shapes: ``B`` batch, ``T`` frames, ``C`` channels, ``D`` condition.
"""

from __future__ import annotations

import torch
from torch import nn

from ..modules import AdaLayerNorm, ConvNeXtBlock, LayerNorm, TimeMask, masked
from .config import SAMPLING_BACKBONE_LAYERS, PrenetConfig


class VocosBackbone(nn.Module):
    """``embed`` conv (k=7), (Ada)LayerNorm, ConvNeXt blocks, final LayerNorm.

    Args:
        input_channels: channels C_in of the input.
        dim: model width C.
        intermediate_dim: hidden width of each ConvNeXt MLP.
        num_layers: number of ConvNeXt blocks.
        condition_dim: size D of the condition for AdaLayerNorm everywhere, or None (LayerNorm).
    """

    def __init__(
        self,
        input_channels: int,
        dim: int,
        intermediate_dim: int,
        num_layers: int,
        condition_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Conv1d(input_channels, dim, kernel_size=7, padding=3)
        self.norm = LayerNorm(dim) if condition_dim is None else AdaLayerNorm(condition_dim, dim)
        self.convnext = nn.ModuleList(
            ConvNeXtBlock(dim, intermediate_dim, condition_dim) for _ in range(num_layers)
        )
        self.final_layer_norm = LayerNorm(dim)  # eps 1e-6, float32 in every precision

    def forward(
        self, x: torch.Tensor, cond: torch.Tensor | None = None, mask: TimeMask | None = None
    ) -> torch.Tensor:
        """x (B, C_in, T), cond (B, D) or None -> (B, T, C)"""
        x = self.embed(masked(x, mask)).transpose(1, 2)  # (B, C, T) -> (B, T, C)
        x = self.norm(x, cond).transpose(1, 2)  # (B, T, C) -> (B, C, T)
        for block in self.convnext:
            x = block(x, cond, mask)
        return self.final_layer_norm(x.transpose(1, 2))  # (B, C, T) -> (B, T, C)


class UnitSamplingBlock(nn.Module):
    """Spark-TTS's sampling block at ratio 1: ``repeat + deconv + skip``, each the identity: 3·x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, C, T)"""
        return 3 * x.transpose(1, 2)  # (B, T, C) -> (B, C, T)


class Prenet(nn.Module):
    """``linear_pre``, sampling stages (each a ratio-1 block and a 2-layer backbone), the
    speaker-conditioned ``vocos_backbone``, and ``linear``.

    Args:
        cfg: the ``prenet`` section of the config.
    """

    def __init__(self, cfg: PrenetConfig) -> None:
        super().__init__()
        dim, hidden = cfg.vocos_dim, cfg.vocos_intermediate_dim
        self.linear_pre = nn.Linear(cfg.input_channels, dim)
        stage = SAMPLING_BACKBONE_LAYERS
        self.downsample = nn.Sequential(
            *(
                nn.Sequential(UnitSamplingBlock(), VocosBackbone(dim, dim, hidden, num_layers=stage))
                for _ in cfg.sample_ratios
            )
        )
        self.vocos_backbone = VocosBackbone(
            dim, dim, hidden, cfg.vocos_num_layers, condition_dim=cfg.condition_dim
        )
        self.linear = nn.Linear(dim, cfg.out_channels)
        self.use_tanh_at_final = cfg.use_tanh_at_final

    def forward(
        self, z: torch.Tensor, cond: torch.Tensor, mask: TimeMask | None = None
    ) -> torch.Tensor:
        """z (B, C_in, T) and speaker vector cond (B, D) -> (B, C_out, T)"""
        x = self.linear_pre(z.transpose(1, 2))  # (B, C, T) -> (B, T, C)
        for sampler, backbone in self.downsample:
            x = backbone(sampler(x), mask=mask)  # (B, T, C) -> (B, C, T) -> (B, T, C)
        x = self.vocos_backbone(x.transpose(1, 2), cond, mask)  # (B, T, C) -> (B, C, T)
        x = self.linear(x)
        if self.use_tanh_at_final:
            x = torch.tanh(x)
        return x.transpose(1, 2)  # (B, T, C) -> (B, C, T)
