"""The speaker half of BiCodec's encode path: the reference clip's mel -> 32 global ids.

``SpeakerTokenizer`` (checkpoint prefix ``speaker_encoder.``) is ECAPA-TDNN (its frame-level
``latent``, not its embedding), a perceiver resampler to ``token_num`` latents, and one finite
scalar quantiser. Upstream fixes the ECAPA widths (512 channels, a 3·512 = 1536-wide latent)
and the perceiver's (8 heads of 64) in code, not in the config; so does this module.

Every clip of a batch has the same length (the reference clip's), so nothing here is padded:
the time means (squeeze-excitation) and the attention see only
real frames, and a batch row equals its lone encode.

Shapes: ``B`` batch, ``M`` mel bins, ``F`` mel frames, ``C`` channels, ``N`` global tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import SpeakerEncoderConfig

ECAPA_CHANNELS = 512
LATENT_CHANNELS = 3 * 512  # ECAPA's ``conv`` output: the perceiver's context width
RES2_SCALE = 8
SE_BOTTLENECK = 128
PERCEIVER_DEPTH = 2
PERCEIVER_HEADS = 8
PERCEIVER_HEAD_DIM = 64
PERCEIVER_FF_MULT = 4
BN_EPS = 1e-5  # torch's BatchNorm1d default, which upstream keeps


class FrozenBatchNorm1d(nn.Module):
    """BatchNorm1d in eval mode: the running statistics and affine, nothing trained.

    Same tensor names as ``nn.BatchNorm1d`` but no ``num_batches_tracked`` (an integer
    counter that inference never reads), so that every tensor loaded is a float.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) or (B, C) -> same shape"""
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            training=False, eps=BN_EPS)  # fmt: skip


class ConvReluBn(nn.Module):
    """``bn(relu(conv(x)))`` (upstream's order: ReLU before the norm); names ``conv``, ``bn``."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int = 1, padding: int = 0) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size, padding=padding)
        self.bn = FrozenBatchNorm1d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, T) -> (B, C_out, T)"""
        return self.bn(F.relu(self.conv(x)))


class Res2Conv(nn.Module):
    """Res2Net's hierarchical convolution: the channels split in ``scale`` groups; group i
    (i >= 1) adds group i-1's output before its own conv -> ReLU -> BN; the last group passes
    through untouched. Names ``convs.i``, ``bns.i``."""

    def __init__(self, channels: int, kernel_size: int, dilation: int, scale: int) -> None:
        super().__init__()
        self.width = channels // scale
        padding = dilation * (kernel_size - 1) // 2
        self.convs = nn.ModuleList(
            nn.Conv1d(self.width, self.width, kernel_size, padding=padding, dilation=dilation)
            for _ in range(scale - 1)
        )
        self.bns = nn.ModuleList(FrozenBatchNorm1d(self.width) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C, T)"""
        groups = torch.split(x, self.width, dim=1)
        out, y = [], None
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns, strict=True)):
            y = groups[i] if y is None else y + groups[i]
            y = bn(F.relu(conv(y)))
            out.append(y)
        out.append(groups[-1])
        return torch.cat(out, dim=1)


class SqueezeExcite(nn.Module):
    """Channel gates from the time mean: ``x · sigmoid(linear2(relu(linear1(mean_t x))))``."""

    def __init__(self, channels: int, bottleneck: int = SE_BOTTLENECK) -> None:
        super().__init__()
        self.linear1 = nn.Linear(channels, bottleneck)
        self.linear2 = nn.Linear(bottleneck, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C, T)"""
        gate = torch.sigmoid(self.linear2(F.relu(self.linear1(x.mean(dim=2)))))  # (B, C)
        return x * gate[:, :, None]


class SERes2Block(nn.Module):
    """``x + SE(conv1x1(Res2(conv1x1(x))))``; names ``se_res2block.0`` ... ``.3``."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.se_res2block = nn.Sequential(
            ConvReluBn(channels, channels),
            Res2Conv(channels, kernel_size=3, dilation=dilation, scale=RES2_SCALE),
            ConvReluBn(channels, channels),
            SqueezeExcite(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C, T)"""
        return x + self.se_res2block(x)


class ECAPATDNN(nn.Module):
    """ECAPA-TDNN up to its frame-level latent (upstream's ``ECAPA_TDNN_GLOB_c512``).

    Only the latent feeds the global tokens. The pooled embedding after it (``pool``, ``bn``,
    ``linear``: BiCodec's x-vector, a training signal) is not built; the loader ignores its
    weights.

    Args:
        feat_dim: mel bins M.
    """

    def __init__(self, feat_dim: int) -> None:
        super().__init__()
        c = ECAPA_CHANNELS
        self.layer1 = ConvReluBn(feat_dim, c, kernel_size=5, padding=2)
        self.layer2 = SERes2Block(c, dilation=2)
        self.layer3 = SERes2Block(c, dilation=3)
        self.layer4 = SERes2Block(c, dilation=4)
        self.conv = nn.Conv1d(3 * c, LATENT_CHANNELS, kernel_size=1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel (B, M, F) -> latent (B, 1536, F)"""
        out1 = self.layer1(mel)
        out2 = self.layer2(out1)
        out3 = self.layer3(out2)
        out4 = self.layer4(out3)
        return F.relu(self.conv(torch.cat([out2, out3, out4], dim=1)))


class CrossAttention(nn.Module):
    """Multi-head attention of the latents over [latents; context]; names ``to_q``, ``to_kv``,
    ``to_out`` (no biases)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        inner = PERCEIVER_HEADS * PERCEIVER_HEAD_DIM
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, 2 * inner, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """latents (B, N, D), context (B, F, D) -> (B, N, D)"""
        # Upstream's cross_attn_include_queries: the latents attend to themselves too.
        keys = torch.cat((latents, context), dim=1)  # (B, N + F, D)
        k, v = self.to_kv(keys).chunk(2, dim=-1)
        q, k, v = (self._heads(t) for t in (self.to_q(latents), k, v))  # (B, H, *, 64)
        weights = torch.softmax(q @ k.transpose(-1, -2) * PERCEIVER_HEAD_DIM**-0.5, dim=-1)
        out = (weights @ v).transpose(1, 2)  # (B, H, N, 64) -> (B, N, H, 64)
        return self.to_out(out.reshape(out.shape[0], out.shape[1], -1))

    @staticmethod
    def _heads(t: torch.Tensor) -> torch.Tensor:
        """(B, L, H·64) -> (B, H, L, 64)"""
        return t.reshape(t.shape[0], t.shape[1], PERCEIVER_HEADS, -1).transpose(1, 2)


class GEGLUFeedForward(nn.Sequential):
    """``Linear(D, 2·I)``, GEGLU (``gelu(gate) · x`` of the two halves), ``Linear(I, D)`` with
    I = int(D · 4 · 2/3); names ``0`` and ``2`` as upstream's Sequential has them."""

    def __init__(self, dim: int) -> None:
        inner = int(dim * PERCEIVER_FF_MULT * 2 / 3)
        super().__init__(nn.Linear(dim, 2 * inner), GEGLU(), nn.Linear(inner, dim))


class GEGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., 2I) -> (..., I)"""
        x, gate = x.chunk(2, dim=-1)
        return F.gelu(gate) * x


class RMSNorm(nn.Module):
    """``normalize(x) · sqrt(D) · gamma`` over the last dim."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D)"""
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class PerceiverResampler(nn.Module):
    """``num_latents`` learned queries that read the ECAPA latent through two cross-attention +
    feed-forward layers; names ``proj_context``, ``latents``, ``layers.i.0/1``, ``norm``."""

    def __init__(self, dim: int, context_dim: int, num_latents: int) -> None:
        super().__init__()
        self.proj_context = nn.Linear(context_dim, dim) if context_dim != dim else nn.Identity()
        self.latents = nn.Parameter(torch.zeros(num_latents, dim))
        self.layers = nn.ModuleList(
            nn.ModuleList([CrossAttention(dim), GEGLUFeedForward(dim)])
            for _ in range(PERCEIVER_DEPTH)
        )
        self.norm = RMSNorm(dim)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        """context (B, F, C_ctx) -> (B, num_latents, dim)"""
        x = self.proj_context(context)
        latents = self.latents.expand(x.shape[0], -1, -1)
        for attention, feed_forward in self.layers:
            latents = attention(latents, x) + latents
            latents = feed_forward(latents) + latents
        return self.norm(latents)


class FSQQuantizer(nn.Module):
    """The residual FSQ's encode half with one quantiser: ``project_in`` (latent -> levels),
    then each dimension bounded by tanh and rounded to one of its L levels; the digits form
    the id in mixed radix (dimension 0 least significant), as ``fsq_code_table`` reads them.

    ``project_out`` is the decode half's (``quantizers.FSQDequantizer``); it is not built here.
    """

    def __init__(self, levels: tuple[int, ...], dim: int) -> None:
        super().__init__()
        self.project_in = nn.Linear(dim, len(levels))
        lv = torch.tensor(levels, dtype=torch.float32)
        basis = torch.cumprod(torch.tensor((1, *levels[:-1]), dtype=torch.int64), dim=0)
        self.register_buffer("levels", lv, persistent=False)
        self.register_buffer("basis", basis, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, dim) -> ids (B, N) int64"""
        z = self.project_in(x).float()  # upstream quantises in float32 whatever the dtype
        half_l = (self.levels - 1) * (1 + 1e-3) / 2
        # Even L: levels sit at half-integers; the offset and shift centre them on integers.
        offset = torch.where(self.levels % 2 == 0, 0.5, 0.0)
        shift = torch.atanh(offset / half_l)
        rounded = torch.round(torch.tanh(z + shift) * half_l - offset)  # ties to even, as upstream
        half_width = torch.floor(self.levels / 2)
        digits = (rounded + half_width).to(torch.int64)  # in [0, L)
        return (digits * self.basis).sum(dim=-1)


class SpeakerTokenizer(nn.Module):
    """Mel of the reference clip -> global ids: ECAPA latent, perceiver, FSQ.

    Args:
        cfg: the ``speaker_encoder`` section of the config.
    """

    def __init__(self, cfg: SpeakerEncoderConfig) -> None:
        super().__init__()
        self.speaker_encoder = ECAPATDNN(cfg.input_dim)
        self.perceiver_sampler = PerceiverResampler(cfg.latent_dim, LATENT_CHANNELS, cfg.token_num)
        self.quantizer = FSQQuantizer(cfg.fsq_levels, cfg.latent_dim)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel (B, M, F) -> global ids (B, token_num) int64"""
        latent = self.speaker_encoder(mel)  # (B, 1536, F)
        latents = self.perceiver_sampler(latent.transpose(1, 2))  # (B, C, F) -> (B, F, C)
        return self.quantizer(latents)
