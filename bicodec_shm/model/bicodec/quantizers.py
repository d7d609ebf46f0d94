"""Token de-quantisers: semantic ids -> features, global (speaker) ids -> speaker vector.

Checkpoint prefixes ``quantizer.`` and ``speaker_encoder.``. Shapes: ``B`` batch, ``T`` semantic
tokens, ``N`` global tokens per utterance (32).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import WNConv1d
from .config import QuantizerConfig, SpeakerEncoderConfig


class SemanticDequantizer(nn.Module):
    """Codebook lookup, then the weight-normalised 1x1 ``out_project`` (no L2 norm when decoding).

    Args:
        cfg: the ``quantizer`` section of the config.
    """

    keep_float32 = True  # a few FLOPs per token; see precision.py

    def __init__(self, cfg: QuantizerConfig) -> None:
        super().__init__()
        self.codebook = nn.Embedding(cfg.codebook_size, cfg.codebook_dim)
        self.out_project = WNConv1d(cfg.codebook_dim, cfg.input_dim, kernel_size=1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) int64 -> z (B, input_dim, T)"""
        codes = self.codebook(ids).transpose(1, 2)  # (B, T, d) -> (B, d, T)
        return self.out_project(codes)


def fsq_code_table(levels: tuple[int, ...]) -> torch.Tensor:
    """Every FSQ code, (prod(levels), len(levels)): row i holds ``(d_j - h_j) / h_j``.

    ``d_j = floor(i / b_j) mod L_j`` with basis ``b = cumprod([1, L_0, L_1, ...])`` and
    ``h_j = floor(L_j / 2)``; for levels of 4 each value is one of -1, -0.5, 0, 0.5.
    """
    lv = torch.tensor(levels, dtype=torch.int64)
    basis = torch.cumprod(torch.tensor((1, *levels[:-1]), dtype=torch.int64), dim=0)
    digits = (torch.arange(math.prod(levels))[:, None] // basis) % lv  # (K, n_dims)
    half = lv // 2
    return (digits - half).to(torch.float32) / half.to(torch.float32)


class FSQDequantizer(nn.Module):
    """The speaker encoder's residual FSQ with one quantiser (scale 1): code table, ``project_out``.

    Args:
        levels: FSQ levels per code dimension.
        dim: output width of ``project_out`` (the latent dim).
    """

    def __init__(self, levels: tuple[int, ...], dim: int) -> None:
        super().__init__()
        self.register_buffer("code_table", fsq_code_table(levels), persistent=False)
        self.project_out = nn.Linear(len(levels), dim)

    def codes(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, N) int64 -> codes (B, N, len(levels))"""
        return F.embedding(ids, self.code_table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, N) int64 -> (B, N, dim)"""
        return self.project_out(self.codes(ids))


class SpeakerDequantizer(nn.Module):
    """Global ids -> speaker vector d: FSQ codes, project_out, channel-major flatten, project.

    Args:
        cfg: the ``speaker_encoder`` section of the config.
    """

    keep_float32 = True  # one vector per utterance that conditions every AdaLayerNorm

    def __init__(self, cfg: SpeakerEncoderConfig) -> None:
        super().__init__()
        self.quantizer = FSQDequantizer(cfg.fsq_levels, cfg.latent_dim)
        self.project = nn.Linear(cfg.latent_dim * cfg.token_num, cfg.out_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, N) int64 -> d (B, out_dim)"""
        x = self.quantizer(ids).transpose(1, 2)  # (B, N, C) -> (B, C, N)
        # Channel-major flatten (index c·N + t), as the checkpoint was trained; the other order
        # gives wrong audio.
        return self.project(x.reshape(x.shape[0], -1))
