"""Typed configuration of a SNAC codec: the ``config.json`` of a published checkpoint.

Field names and defaults are those of ``snac.SNAC.__init__`` (snac 1.2.1), so a ``config.json``
means here what it means to ``SNAC(**config)``. The encoder fields are not used to decode;
``encoder_dim`` and ``encoder_rates`` still fix ``latent_dim`` when it is null.

A *frame* is one code of the coarsest level; it spans ``vq_strides[0]`` latent frames, and each
latent frame decodes to ``prod(decoder_rates)`` samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ...codecs.layout import CodecLayout
from ..config_values import (
    MAX_DIM,
    as_bool,
    as_int,
    as_ints,
    from_preset,
    plain,
    require_at_most,
    require_positive,
    shown,
)

DIM_HEAD = 64  # LocalMHA's head width in snac; heads = decoder_dim // 64


@dataclass(frozen=True)
class SNACConfig:
    """Everything the decoder needs to know about a SNAC checkpoint's dimensions.

    Build one with :meth:`from_dict` (a ``config.json`` mapping) or :meth:`preset`.
    """

    sampling_rate: int = 44100
    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (3, 3, 7, 7)
    latent_dim: int | None = None
    decoder_dim: int = 1536
    decoder_rates: tuple[int, ...] = (7, 7, 3, 3)
    attn_window_size: int | None = 32
    codebook_size: int = 4096
    codebook_dim: int = 8
    vq_strides: tuple[int, ...] = (8, 4, 2, 1)
    noise: bool = True
    depthwise: bool = True

    def __post_init__(self) -> None:
        _check_consistent(self)

    @property
    def latent(self) -> int:
        """Channels of the latent the quantizer produces: ``latent_dim``, or
        ``encoder_dim · 2^len(encoder_rates)`` when that is null (as in snac)."""
        return self.latent_dim or self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def n_levels(self) -> int:
        """Number of code levels (3 for 24 kHz, 4 for 32 and 44 kHz)."""
        return len(self.vq_strides)

    @property
    def level_rates(self) -> tuple[int, ...]:
        """Codes per frame at each level, coarsest first: (1, 2, 4) or (1, 2, 4, 8)."""
        return tuple(self.vq_strides[0] // s for s in self.vq_strides)

    @property
    def latents_per_frame(self) -> int:
        """Latent frames one frame spans (``vq_strides[0]``)."""
        return self.vq_strides[0]

    @property
    def hop_length(self) -> int:
        """Samples per latent frame: the product of the decoder's rates."""
        return math.prod(self.decoder_rates)

    @property
    def samples_per_frame(self) -> int:
        """Samples per frame: 2048 (24 kHz), 3072 (32 kHz and 44 kHz)."""
        return self.hop_length * self.latents_per_frame

    @property
    def codec_name(self) -> str:
        """``snac-24khz``, ``snac-32khz``, ``snac-44khz``: from the sample rate."""
        return f"snac-{self.sampling_rate // 1000}khz"

    @property
    def layout(self) -> CodecLayout:
        """The torch-free token layout a client checks requests against."""
        return CodecLayout(
            name=self.codec_name,
            level_rates=self.level_rates,
            level_vocab=(self.codebook_size,) * self.n_levels,
            samples_per_frame=self.samples_per_frame,
            sample_rate=self.sampling_rate,
        )

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> SNACConfig:
        """Parse a ``config.json`` mapping; missing keys take snac's defaults, unknown keys are
        ignored.

        Raises:
            ValueError: naming every field of the wrong type, or an inconsistent config.
        """
        if not isinstance(mapping, Mapping):
            raise ValueError(f"config must be a mapping, got {type(mapping).__name__}")
        values: dict[str, Any] = {}
        problems: list[str] = []
        for f in fields(cls):
            if f.name not in mapping:
                continue
            try:
                values[f.name] = _convert(f.name, f.default, mapping[f.name])
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ValueError("bad SNAC config: " + "; ".join(problems))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` mapping (lists, not tuples), readable by ``snac.SNAC(**mapping)``."""
        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def preset(cls, name: str) -> SNACConfig:
        """A named configuration: ``snac-24khz``, ``snac-32khz``, ``snac-44khz`` (the published
        sizes), ``tiny-24khz``, ``tiny-32khz``, ``tiny-44khz`` (same token layout, small widths,
        for tests), ``tiny`` (= ``tiny-24khz``)."""
        return from_preset(cls, PRESETS, name)


def _convert(name: str, default: Any, value: Any) -> Any:
    if isinstance(default, bool):
        return as_bool(name, value)
    if isinstance(default, tuple):
        return as_ints(name, value)
    if value is None and name in ("latent_dim", "attn_window_size"):
        return None
    return as_int(name, value)


def _check_consistent(cfg: SNACConfig) -> None:
    """Raise ValueError if the fields cannot form one decode path."""
    positive = {
        "sampling_rate": cfg.sampling_rate,
        "decoder_dim": cfg.decoder_dim,
        "codebook_size": cfg.codebook_size,
        "codebook_dim": cfg.codebook_dim,
        "latent": cfg.latent,
    }
    require_positive(positive)
    dims = {k: v for k, v in positive.items() if k != "sampling_rate"}
    require_at_most({**dims, "encoder_dim": cfg.encoder_dim, "attn_window_size": cfg.attn_window_size or 0,
                     "decoder_rates": cfg.decoder_rates, "vq_strides": cfg.vq_strides}, MAX_DIM)  # fmt: skip
    if not cfg.decoder_rates or min(cfg.decoder_rates) < 1:
        raise ValueError(f"decoder_rates must be non-empty, each >= 1: {shown(cfg.decoder_rates)}")
    strides = cfg.vq_strides
    if not strides or min(strides) < 1 or any(strides[0] % s for s in strides):
        raise ValueError(
            f"vq_strides must be non-empty, each >= 1 and dividing vq_strides[0]: {shown(strides)}"
        )
    require_at_most({"samples_per_frame (prod(decoder_rates) * vq_strides[0])": cfg.samples_per_frame},
                    MAX_DIM)  # fmt: skip
    if cfg.decoder_dim % 2 ** len(cfg.decoder_rates):
        raise ValueError(
            f"decoder_dim={cfg.decoder_dim} must be divisible by 2**{len(cfg.decoder_rates)}"
        )
    window = cfg.attn_window_size
    if window is not None and (window < 1 or cfg.decoder_dim % DIM_HEAD):
        raise ValueError(
            f"attention needs attn_window_size >= 1 (got {window}) and decoder_dim divisible by "
            f"{DIM_HEAD} (got {cfg.decoder_dim})"
        )


def _variant(sr: int, enc: int, enc_rates: list, dec: int, dec_rates: list, window: int | None,
             strides: list) -> dict[str, Any]:  # fmt: skip
    return {
        "sampling_rate": sr, "encoder_dim": enc, "encoder_rates": enc_rates, "latent_dim": None,
        "decoder_dim": dec, "decoder_rates": dec_rates, "attn_window_size": window,
        "codebook_size": 4096, "codebook_dim": 8, "vq_strides": strides, "noise": True,
        "depthwise": True,
    }  # fmt: skip


# The config.json of hubertsiuzdak/snac_24khz, _32khz and _44khz. Checked against the snac README:
# 19.8 M / 54.5 M / 54.5 M parameters for snac.SNAC(**config), and 0.98 / 1.9 / 2.6 kbps
# (12 bits a code at 46.9 + 23.4 + 11.7, 83.3 + ... and 114.8 + ... codes per second).
PRESETS: dict[str, dict[str, Any]] = {
    "snac-24khz": _variant(24000, 48, [2, 4, 8, 8], 1024, [8, 8, 4, 2], None, [4, 2, 1]),
    "snac-32khz": _variant(32000, 64, [2, 3, 8, 8], 1536, [8, 8, 3, 2], 32, [8, 4, 2, 1]),
    "snac-44khz": _variant(44100, 64, [2, 3, 8, 8], 1536, [8, 8, 3, 2], 32, [8, 4, 2, 1]),
    # Same token layout (rates, strides, window, vocabulary), small widths: a decode of a few
    # frames takes milliseconds on a CPU. decoder_dim 128 keeps 2 attention heads of 64.
    "tiny-24khz": _variant(24000, 4, [2, 4, 8, 8], 64, [8, 8, 4, 2], None, [4, 2, 1]),
    "tiny-32khz": _variant(32000, 4, [2, 3, 8, 8], 128, [8, 8, 3, 2], 32, [8, 4, 2, 1]),
    "tiny-44khz": _variant(44100, 4, [2, 3, 8, 8], 128, [8, 8, 3, 2], 32, [8, 4, 2, 1]),
}
PRESETS["tiny"] = PRESETS["tiny-24khz"]
