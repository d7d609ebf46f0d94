"""Typed configuration of Qwen3-TTS's 12 Hz speech tokenizer, the encode path: the
``encoder_config`` of a published ``Qwen3-TTS-Tokenizer-12Hz/config.json`` (a transformers
``MimiConfig``), plus the three top-level keys qwen-tts's ``Qwen3TTSTokenizerV2Model.encode``
reads beside it: ``encoder_valid_num_quantizers`` (16: the codebooks kept of the encoder's 32),
``encode_downsample_rate`` (1920: samples a frame) and ``input_sample_rate`` (24 kHz).

Field names and defaults are transformers' ``MimiConfig``'s (the published file's values are its
defaults), so a checkpoint's values mean here what they mean to qwen-tts. Keys that only the Mimi
decoder reads (``upsample_groups``, ``trim_right_ratio``) are ignored. Importing this module
imports neither torch nor transformers; :meth:`Qwen3EncoderConfig.mimi_config` imports them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ...codecs.layout import CodecLayout
from ..config_values import (
    MAX_DIM,
    MAX_LIST,
    as_bool,
    as_float,
    as_int,
    as_ints,
    from_preset,
    given_fields,
    plain,
    require_at_most,
    require_positive,
    shown,
)

# The top-level keys of config.json (beside encoder_config) that the encode path reads.
TOP_LEVEL = ("encoder_valid_num_quantizers", "encode_downsample_rate", "input_sample_rate")
# MimiModel halves the SEANet encoder's frame rate with one strided convolution (25 -> 12.5 Hz).
DOWNSAMPLE_STRIDE = 2


@dataclass(frozen=True)
class Qwen3EncoderConfig:
    """Everything the encode path needs to know about a checkpoint's dimensions.

    Build one with :meth:`from_dict` (an ``encoder_config`` mapping with the ``TOP_LEVEL`` keys
    beside it) or :meth:`preset`. ``head_dim`` None means ``hidden_size // num_attention_heads``.
    """

    sampling_rate: int = 24000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    use_causal_conv: bool = True
    pad_mode: str = "constant"
    compress: int = 2
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    use_conv_shortcut: bool = False
    vector_quantization_hidden_dimension: int = 256
    num_semantic_quantizers: int = 1
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "gelu"
    max_position_embeddings: int = 8000
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 250
    layer_scale_initial_scale: float = 0.01
    attention_bias: bool = False
    # Top-level keys of config.json.
    encoder_valid_num_quantizers: int = 16
    encode_downsample_rate: int = 1920
    input_sample_rate: int = 24000

    def __post_init__(self) -> None:
        _check_consistent(self)

    @property
    def samples_per_frame(self) -> int:
        """Samples one frame of codes stands for: every stride multiplied (1920)."""
        return math.prod(self.upsampling_ratios) * DOWNSAMPLE_STRIDE

    @property
    def num_codebooks(self) -> int:
        """Codebooks in a frame of codes (upstream's ``encoder_valid_num_quantizers``, 16)."""
        return self.encoder_valid_num_quantizers

    @property
    def layout(self) -> CodecLayout:
        """The token layout the encoder's codes follow: the ``qwen3-tts-12hz`` codec's, one level
        per kept codebook, one code per frame each (what ``Qwen3CodecConfig.layout`` decodes)."""
        return CodecLayout(
            name="qwen3-tts-12hz",
            level_rates=(1,) * self.num_codebooks,
            level_vocab=(self.codebook_size,) * self.num_codebooks,
            samples_per_frame=self.samples_per_frame,
            sample_rate=self.input_sample_rate,
        )

    def frames(self, samples: int) -> int:
        """Frames of codes for ``samples`` samples: ``ceil(samples / 1920)``, as qwen-tts trims
        each row of a batch (a last, partial frame counts)."""
        return -(-samples // self.samples_per_frame)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> Qwen3EncoderConfig:
        """Parse an ``encoder_config`` mapping (the ``TOP_LEVEL`` keys in it too); missing keys
        take upstream's defaults, keys the encode path does not read are ignored.

        Raises:
            ValueError: naming every field of the wrong type, or an inconsistent config.
        """
        if not isinstance(mapping, Mapping):
            raise ValueError(f"encoder_config must be a mapping, got {type(mapping).__name__}")
        values, problems = given_fields(cls, mapping, _convert)
        if mapping.get("rope_scaling") is not None:
            problems.append(f"'rope_scaling' must be null (plain RoPE), got {shown(mapping['rope_scaling'])}")
        # A published file names its frame rate "_frame_rate" (MimiConfig's attribute).
        for key in ("frame_rate", "_frame_rate"):
            stated = mapping.get(key)
            if stated is not None and not _is_rate(stated, values):
                problems.append(f"'{key}' must be sampling_rate / (2 * prod(upsampling_ratios)) (Mimi's "
                                f"encode downsamples once, by 2), got {shown(stated)}")  # fmt: skip
        if problems:
            raise ValueError("bad Qwen3-TTS tokenizer encoder_config: " + "; ".join(problems))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The mapping :meth:`from_dict` reads (lists, not tuples)."""
        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}

    def encoder_config(self) -> dict[str, Any]:
        """The ``encoder_config`` mapping of config.json (the ``TOP_LEVEL`` keys left out)."""
        return {k: v for k, v in self.to_dict().items() if k not in TOP_LEVEL}

    def mimi_config(self) -> Any:
        """transformers' ``MimiConfig`` of this encoder (SDPA attention, qwen-tts's default
        when it loads the tokenizer). ``upsample_groups`` is 1: the encode path builds no
        decoder, and its grouped upsampling would only constrain ``hidden_size``."""
        from transformers import MimiConfig

        frame_rate = self.sampling_rate / self.samples_per_frame
        return MimiConfig(**self.encoder_config(), frame_rate=frame_rate, upsample_groups=1,
                          attn_implementation="sdpa")  # fmt: skip

    @classmethod
    def preset(cls, name: str) -> Qwen3EncoderConfig:
        """``qwen3-tts-12hz`` (the published size) or ``tiny-12hz`` / ``tiny`` (the same strides,
        16 codebooks of 2048 and quantizer projection; small widths, for tests)."""
        return from_preset(cls, PRESETS, name)


_FLOATS = ("norm_eps", "rope_theta", "layer_scale_initial_scale")
_BOOLS = ("use_causal_conv", "use_conv_shortcut", "attention_bias")


def _convert(name: str, value: Any) -> Any:
    if name == "upsampling_ratios":
        return as_ints(name, value)
    if name in _BOOLS:
        return as_bool(name, value)
    if name in ("hidden_act", "pad_mode"):
        if not isinstance(value, str):
            raise ValueError(f"'{name}' must be a string, got {shown(value)}")
        return value
    if name in _FLOATS:
        return as_float(name, value)
    return as_int(name, value)


def _is_rate(stated: Any, values: Mapping[str, Any]) -> bool:
    if isinstance(stated, bool) or not isinstance(stated, (int, float)):
        return False
    sampling_rate = values.get("sampling_rate", Qwen3EncoderConfig.sampling_rate)
    ratios = values.get("upsampling_ratios", Qwen3EncoderConfig.upsampling_ratios)
    hop = math.prod(ratios) * DOWNSAMPLE_STRIDE
    return hop > 0 and math.isclose(stated, sampling_rate / hop, rel_tol=1e-9)


def _check_consistent(cfg: Qwen3EncoderConfig) -> None:
    """Raise ValueError if the fields cannot form the encode path qwen-tts runs."""
    widths = {
        "hidden_size": cfg.hidden_size, "num_filters": cfg.num_filters, "kernel_size": cfg.kernel_size,
        "last_kernel_size": cfg.last_kernel_size, "residual_kernel_size": cfg.residual_kernel_size,
        "dilation_growth_rate": cfg.dilation_growth_rate, "compress": cfg.compress,
        "codebook_size": cfg.codebook_size, "codebook_dim": cfg.codebook_dim,
        "num_quantizers": cfg.num_quantizers, "num_hidden_layers": cfg.num_hidden_layers,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "sliding_window": cfg.sliding_window,
        "vector_quantization_hidden_dimension": cfg.vector_quantization_hidden_dimension,
        "num_semantic_quantizers": cfg.num_semantic_quantizers, "sampling_rate": cfg.sampling_rate,
        "encoder_valid_num_quantizers": cfg.encoder_valid_num_quantizers,
        "head_dim": cfg.head_dim or cfg.hidden_size // max(cfg.num_attention_heads, 1),
    }  # fmt: skip
    require_positive({**widths, "upsampling_ratios": min(cfg.upsampling_ratios, default=0)})
    require_at_most({**{k: v for k, v in widths.items() if k != "sampling_rate"},
                     "upsampling_ratios": cfg.upsampling_ratios}, MAX_DIM)  # fmt: skip
    require_at_most({"num_hidden_layers": cfg.num_hidden_layers, "num_quantizers": cfg.num_quantizers,
                     "num_residual_layers": cfg.num_residual_layers}, MAX_LIST)  # fmt: skip
    # Every choice below changes what the encoder computes into something qwen-tts's published
    # tokenizer never runs, or that right padding would change (a non-causal convolution).
    fixed = {"audio_channels": (cfg.audio_channels, 1), "use_causal_conv": (cfg.use_causal_conv, True),
             "pad_mode": (cfg.pad_mode, "constant"), "hidden_act": (cfg.hidden_act, "gelu")}  # fmt: skip
    for name, (value, allowed) in fixed.items():
        if value != allowed:
            raise ValueError(f"{name} must be {allowed!r} (the published encoder's), got {shown(value)}")
    if cfg.codebook_size & (cfg.codebook_size - 1):
        raise ValueError(f"codebook_size must be a power of 2, got {cfg.codebook_size}")
    if cfg.codebook_dim != cfg.vector_quantization_hidden_dimension:
        raise ValueError(
            f"codebook_dim={cfg.codebook_dim} must equal vector_quantization_hidden_dimension="
            f"{cfg.vector_quantization_hidden_dimension} (the width the quantizer projects to)"
        )
    if not cfg.num_semantic_quantizers <= cfg.encoder_valid_num_quantizers <= cfg.num_quantizers:
        raise ValueError(
            f"encoder_valid_num_quantizers={cfg.encoder_valid_num_quantizers} must be between "
            f"num_semantic_quantizers={cfg.num_semantic_quantizers} and num_quantizers={cfg.num_quantizers}"
        )
    if cfg.num_semantic_quantizers >= cfg.num_quantizers:
        raise ValueError(f"num_semantic_quantizers={cfg.num_semantic_quantizers} must be below "
                         f"num_quantizers={cfg.num_quantizers}")  # fmt: skip
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                         f"num_key_value_heads={cfg.num_key_value_heads}")  # fmt: skip
    if (cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads) % 2:
        raise ValueError("the attention head width must be even for RoPE")
    if cfg.num_filters % cfg.compress:
        raise ValueError(f"num_filters={cfg.num_filters} must be a multiple of compress={cfg.compress}")
    hop = math.prod(cfg.upsampling_ratios)
    if cfg.sampling_rate % hop:
        raise ValueError(
            f"sampling_rate={cfg.sampling_rate} must be a multiple of prod(upsampling_ratios)={hop}"
        )
    if cfg.input_sample_rate != cfg.sampling_rate:
        raise ValueError(f"input_sample_rate={cfg.input_sample_rate} but the encoder's sampling_rate "
                         f"is {cfg.sampling_rate}")  # fmt: skip
    if cfg.encode_downsample_rate != cfg.samples_per_frame:
        raise ValueError(f"encode_downsample_rate={cfg.encode_downsample_rate} but the encoder's strides "
                         f"multiply to {cfg.samples_per_frame}")  # fmt: skip


PRESETS: dict[str, dict[str, Any]] = {
    # The published Qwen3-TTS-Tokenizer-12Hz/config.json's encoder_config (MimiConfig's defaults:
    # 8 layers of width 512 in heads of 64, 32 codebooks of 2048 x 256, 16 of them kept).
    "qwen3-tts-12hz": {**Qwen3EncoderConfig().to_dict(), "head_dim": 64},
    # The same strides, window, codebook count and size, and a quantizer projection (16 -> 8).
    "tiny-12hz": {
        **Qwen3EncoderConfig().to_dict(),
        "hidden_size": 16, "num_filters": 2, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32, "codebook_dim": 8,
        "vector_quantization_hidden_dimension": 8, "num_quantizers": 20,
    },  # fmt: skip
}
PRESETS["tiny"] = PRESETS["tiny-12hz"]
