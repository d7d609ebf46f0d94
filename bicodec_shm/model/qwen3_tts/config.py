"""Typed configuration of Qwen3-TTS's 12 Hz speech tokenizer, the decode path only: the
``decoder_config`` of a published ``Qwen3-TTS-Tokenizer-12Hz/config.json`` (qwen-tts 0.1.1's
``Qwen3TTSTokenizerV2DecoderConfig``), plus the file's ``output_sample_rate``.

Field names and defaults are upstream's, so a checkpoint's values mean here what they mean to
qwen-tts. The published file also names ``semantic_codebook_size`` (4096) and
``vector_quantization_hidden_dimension``; qwen-tts's decoder reads neither (every codebook,
the semantic one included, has ``codebook_size`` entries of ``codebook_dim / 2``), so neither is
read here. A *frame* is one code of each of the 16 codebooks (80 ms); it decodes to
``prod(upsampling_ratios + upsample_rates)`` = 1920 samples at 24 kHz.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ...codecs.layout import CodecLayout
from ..config_values import (
    as_bool,
    as_float,
    as_int,
    as_ints,
    from_preset,
    given_fields,
    plain,
    require_positive,
)

CODEC_NAME = "qwen3-tts-12hz"


@dataclass(frozen=True)
class Qwen3CodecConfig:
    """Everything the decoder needs to know about a checkpoint's dimensions.

    Build one with :meth:`from_dict` (a ``decoder_config`` mapping, ``output_sample_rate`` beside
    it) or :meth:`preset`. ``head_dim`` None means ``hidden_size // num_attention_heads``.
    """

    codebook_size: int = 2048
    codebook_dim: int = 512
    hidden_size: int = 1024
    latent_dim: int = 1024
    max_position_embeddings: int = 8000
    rope_theta: float = 10000.0
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    attention_bias: bool = False
    sliding_window: int = 72
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536
    output_sample_rate: int = 24000

    def __post_init__(self) -> None:
        _check_consistent(self)

    @property
    def heads_dim(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def samples_per_frame(self) -> int:
        """Samples one frame decodes to: every upsampling factor multiplied (1920)."""
        return math.prod(self.upsampling_ratios + self.upsample_rates)

    @property
    def codec_name(self) -> str:
        return CODEC_NAME

    @property
    def layout(self) -> CodecLayout:
        """The torch-free token layout: one level per codebook, one code per frame each."""
        return CodecLayout(
            name=CODEC_NAME,
            level_rates=(1,) * self.num_quantizers,
            level_vocab=(self.codebook_size,) * self.num_quantizers,
            samples_per_frame=self.samples_per_frame,
            sample_rate=self.output_sample_rate,
        )

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> Qwen3CodecConfig:
        """Parse a ``decoder_config`` mapping; missing keys take upstream's defaults, keys the
        decoder does not read are ignored.

        Raises:
            ValueError: naming every field of the wrong type, or an inconsistent config.
        """
        if not isinstance(mapping, Mapping):
            raise ValueError(f"config must be a mapping, got {type(mapping).__name__}")
        values, problems = given_fields(cls, mapping, _convert)
        # RoPE variants (rope_scaling) change the positions' frequencies; no published model has one.
        if mapping.get("rope_scaling") is not None:
            problems.append(f"'rope_scaling' must be null (plain RoPE), got {mapping['rope_scaling']!r}")
        if problems:
            raise ValueError("bad Qwen3-TTS tokenizer config: " + "; ".join(problems))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The mapping :meth:`from_dict` reads (lists, not tuples)."""
        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def preset(cls, name: str) -> Qwen3CodecConfig:
        """``qwen3-tts-12hz`` (the published size) or ``tiny-12hz`` / ``tiny`` (same token layout,
        window and chunking, small widths, for tests)."""
        return from_preset(cls, PRESETS, name)


_FLOATS = ("rope_theta", "layer_scale_initial_scale", "rms_norm_eps")


def _convert(name: str, value: Any) -> Any:
    if name in ("upsample_rates", "upsampling_ratios"):
        return as_ints(name, value)
    if name == "attention_bias":
        return as_bool(name, value)
    if name == "hidden_act":
        if value != "silu":
            raise ValueError(f"'hidden_act' must be 'silu' (the published models'), got {value!r}")
        return value
    if name in _FLOATS:
        return as_float(name, value)
    return as_int(name, value)


def _check_consistent(cfg: Qwen3CodecConfig) -> None:
    """Raise ValueError if the fields cannot form one decode path."""
    require_positive({
        "codebook_size": cfg.codebook_size, "hidden_size": cfg.hidden_size,
        "latent_dim": cfg.latent_dim, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "sliding_window": cfg.sliding_window,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "decoder_dim": cfg.decoder_dim, "output_sample_rate": cfg.output_sample_rate,
        "heads_dim": cfg.heads_dim,
    })  # fmt: skip
    if cfg.codebook_dim < 2 or cfg.codebook_dim % 2:
        raise ValueError(
            f"codebook_dim must be even and >= 2 (codebooks are half as wide), got {cfg.codebook_dim}"
        )
    if cfg.num_quantizers < 2:
        raise ValueError(f"num_quantizers must be >= 2 (1 semantic + acoustic), got {cfg.num_quantizers}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if cfg.heads_dim % 2:
        raise ValueError(f"the head width must be even for RoPE, got {cfg.heads_dim}")
    rates = cfg.upsample_rates + cfg.upsampling_ratios
    if not cfg.upsample_rates or min(rates) < 1:
        raise ValueError(f"upsample_rates must be non-empty and every rate >= 1: {list(rates)}")
    if cfg.decoder_dim % 2 ** len(cfg.upsample_rates):
        raise ValueError(f"decoder_dim={cfg.decoder_dim} must be divisible by 2**{len(cfg.upsample_rates)}")


def _decoder(**overrides: Any) -> dict[str, Any]:
    return {**Qwen3CodecConfig().to_dict(), **overrides}


# The published Qwen3-TTS-Tokenizer-12Hz/config.json's decoder_config (also every Qwen3-TTS-12Hz
# model's speech_tokenizer/): 8 layers of width 512, 16 heads of 64, 1024 latent, 1536 decoder.
PRESETS: dict[str, dict[str, Any]] = {
    CODEC_NAME: _decoder(
        codebook_dim=512, hidden_size=512, latent_dim=1024, head_dim=64, intermediate_size=1024
    ),  # fmt: skip
    # Same token layout, window (72), rates and chunking; small widths, 2 layers, grouped heads
    # (2 query heads per key head, which the published model does not use but upstream supports).
    "tiny-12hz": _decoder(
        codebook_dim=16,
        hidden_size=16,
        latent_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        decoder_dim=16,
        num_hidden_layers=2,
    ),  # fmt: skip
}
PRESETS["tiny"] = PRESETS["tiny-12hz"]
