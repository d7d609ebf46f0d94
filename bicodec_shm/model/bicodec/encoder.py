"""The semantic half of BiCodec's encode path: wav2vec2 features -> semantic ids.

``FeatureEncoder`` (checkpoint prefix ``encoder.``) is a Vocos backbone, ratio-1 sampling
stages each followed by a 2-layer backbone, and a linear ``project``; ``SemanticQuantizer``
(prefix ``quantizer.``) projects to the codebook's width and picks the nearest code by cosine.

Batching: the backbones' convolutions (k=7) are the only time mixing, and each zeroes a
row's padding frames first (``TimeMask``), as a lone row's zero padding would be, so a row of
a right-padded batch gets exactly its lone encode's features up to float rounding.

Shapes: ``B`` batch, ``T`` feature frames (50 per second), ``C`` channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import TimeMask, WNConv1d
from .backbone import UnitSamplingBlock, VocosBackbone
from .config import SAMPLING_BACKBONE_LAYERS, QuantizerConfig
from .encode_config import FeatEncoderConfig


class FeatureEncoder(nn.Module):
    """wav2vec2 features -> latents: names ``encoder``, ``downsample.i.1``, ``project``.

    Args:
        cfg: the ``encoder`` section of the config.
    """

    def __init__(self, cfg: FeatEncoderConfig) -> None:
        super().__init__()
        dim, hidden = cfg.vocos_dim, cfg.vocos_intermediate_dim
        self.encoder = VocosBackbone(cfg.input_channels, dim, hidden, cfg.vocos_num_layers)
        stage = SAMPLING_BACKBONE_LAYERS
        self.downsample = nn.Sequential(
            *(
                nn.Sequential(UnitSamplingBlock(), VocosBackbone(dim, dim, hidden, num_layers=stage))
                for _ in cfg.sample_ratios
            )
        )
        self.project = nn.Linear(dim, cfg.out_channels)

    def forward(self, features: torch.Tensor, mask: TimeMask | None = None) -> torch.Tensor:
        """features (B, T, C_in) -> latents (B, C_out, T)"""
        # The backbone masks its input in place: work on a copy, not the caller's features.
        x = self.encoder(features.transpose(1, 2).clone(), mask=mask)  # (B, T, C) -> (B, C, T)
        for sampler, backbone in self.downsample:
            x = backbone(sampler(x), mask=mask)  # (B, T, C) -> (B, C, T) -> (B, T, C)
        return self.project(x).transpose(1, 2)  # (B, T, C) -> (B, C, T)


class SemanticQuantizer(nn.Module):
    """Latents -> ids: the weight-normalised 1x1 ``in_project`` to the codebook's width, then
    the nearest code by cosine (both sides L2-normalised); names ``in_project``, ``codebook``.

    The decode half (``out_project``) is ``quantizers.SemanticDequantizer``.
    """

    def __init__(self, cfg: QuantizerConfig) -> None:
        super().__init__()
        self.in_project = WNConv1d(cfg.input_dim, cfg.codebook_dim, kernel_size=1)
        self.codebook = nn.Embedding(cfg.codebook_size, cfg.codebook_dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, C, T) -> ids (B, T) int64"""
        batch = z.shape[0]
        e = F.normalize(self.in_project(z).transpose(1, 2).reshape(-1, self.codebook.embedding_dim))
        c = F.normalize(self.codebook.weight)  # (K, d)
        # The squared distance written out as upstream writes it, not argmax(e @ c.T): the two
        # agree in exact arithmetic, and this way a near-tie rounds the same way too.
        dist = e.pow(2).sum(1, keepdim=True) - 2 * e @ c.t() + c.pow(2).sum(1, keepdim=True).t()
        return (-dist).max(dim=1).indices.reshape(batch, -1)  # (B·T,) -> (B, T)
