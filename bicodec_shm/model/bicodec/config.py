"""Typed configuration of the BiCodec decode path: the ``audio_tokenizer`` mapping of config.yaml.

Each section dataclass mirrors one section of the real file and uses its key names, so parsing
and writing are symmetric. Only the keys the decode path needs are modelled; others are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, get_type_hints

from ..config_values import (
    MAX_DIM,
    MAX_LIST,
    as_bool,
    as_int,
    as_ints,
    from_preset,
    plain,
    require_at_most,
    require_positive,
    shown,
)


@dataclass(frozen=True)
class QuantizerConfig:
    """``quantizer``: semantic codebook and 1x1 ``out_project`` (codebook_dim -> input_dim)."""

    input_dim: int
    codebook_size: int
    codebook_dim: int


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """``speaker_encoder``: FSQ global tokens, ``project_out`` (levels -> latent_dim), ``project``.

    ``input_dim`` (mel bins) is not used to decode; it is kept so that written files stay complete.
    """

    out_dim: int
    latent_dim: int
    token_num: int
    fsq_levels: tuple[int, ...]
    fsq_num_quantizers: int = 1
    input_dim: int = 128


@dataclass(frozen=True)
class PrenetConfig:
    """``prenet``: the speaker-conditioned feature decoder (Vocos backbones) before the vocoder."""

    input_channels: int
    vocos_dim: int
    vocos_intermediate_dim: int
    vocos_num_layers: int
    out_channels: int
    condition_dim: int
    sample_ratios: tuple[int, ...] = (1, 1)
    use_tanh_at_final: bool = False


@dataclass(frozen=True)
class WaveGeneratorConfig:
    """``decoder``: the wave generator; block i upsamples by rates[i] with kernel_sizes[i]."""

    input_channel: int
    channels: int
    rates: tuple[int, ...]
    kernel_sizes: tuple[int, ...]


# The decode path's time-mixing convolutions but the upsampling ones have kernel 7 and padding
# 3 (backbone.py, wavegen.py, modules.py): each reaches 3 frames (times its dilation) each side.
CONV_REACH = 3
SAMPLING_BACKBONE_LAYERS = 2  # the ConvNeXt blocks of each prenet sampling stage's backbone
RESIDUAL_DILATIONS = (1, 3, 9)  # the residual units of each wave-generator upsampling block

_SECTIONS = {
    "quantizer": QuantizerConfig,
    "speaker_encoder": SpeakerEncoderConfig,
    "prenet": PrenetConfig,
    "decoder": WaveGeneratorConfig,
}


@dataclass(frozen=True)
class BiCodecConfig:
    """Everything the decoder needs to know about a BiCodec checkpoint's dimensions.

    Build one with :meth:`from_dict` (the ``audio_tokenizer`` mapping of ``config.yaml``) or
    :meth:`preset` (``"spark-tts-0.5b"`` or ``"tiny"``).
    """

    quantizer: QuantizerConfig
    speaker_encoder: SpeakerEncoderConfig
    prenet: PrenetConfig
    decoder: WaveGeneratorConfig
    sample_rate: int = 16000

    def __post_init__(self) -> None:
        _check_consistent(self)

    @property
    def semantic_vocab(self) -> int:
        """Number of semantic token ids: valid ids are ``[0, semantic_vocab)``."""
        return self.quantizer.codebook_size

    @property
    def global_vocab(self) -> int:
        """Number of global (speaker) token ids: the product of the FSQ levels."""
        return math.prod(self.speaker_encoder.fsq_levels)

    @property
    def n_global(self) -> int:
        """Global tokens per utterance (``token_num``)."""
        return self.speaker_encoder.token_num

    @property
    def hop_length(self) -> int:
        """Audio samples per semantic token: the product of the wave generator's rates."""
        return math.prod(self.decoder.rates)

    @property
    def receptive_field(self) -> int:
        """Tokens to each side that one token's audio depends on (67 for spark-tts-0.5b, 37 for
        tiny): a window decoded with this much context on each side of a region gives the
        region's audio of the whole decode, up to float rounding, whatever the weights.

        Derived from the layers: the prenet's convolutions (each backbone's embed conv and
        ConvNeXt depthwise convs, kernel 7), then the wave generator's, walked back from one
        token's samples: the output conv, each upsampling block's residual units (kernel 7,
        dilations 1, 3, 9) and transposed conv, the input conv.
        """
        p, d = self.prenet, self.decoder
        stages = len(p.sample_ratios) * (1 + SAMPLING_BACKBONE_LAYERS) + 1 + p.vocos_num_layers
        token = 10 * (1 + stages)  # any token far from the sequence's ends
        first, last = self.hop_length * token, self.hop_length * (token + 1) - 1  # its samples
        first, last = first - CONV_REACH, last + CONV_REACH  # the output conv
        for rate, kernel in reversed(tuple(zip(d.rates, d.kernel_sizes, strict=True))):
            reach = CONV_REACH * sum(RESIDUAL_DILATIONS)
            first, last = first - reach, last + reach
            # Transposed conv: output t reads inputs i with 0 <= t + pad - i·rate < kernel.
            pad = (kernel - rate) // 2
            first, last = -(-(first + pad - kernel + 1) // rate), (last + pad) // rate
        prenet_reach = CONV_REACH * stages
        first, last = first - CONV_REACH - prenet_reach, last + CONV_REACH + prenet_reach
        return max(token - first, last - token)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> BiCodecConfig:
        """Parse the ``audio_tokenizer`` mapping (a whole ``config.yaml`` document is unwrapped).

        Raises:
            ValueError: naming every missing section or field, or a field of the wrong type.
        """
        if not isinstance(mapping, Mapping):
            raise ValueError(f"config must be a mapping, got {type(mapping).__name__}")
        if "audio_tokenizer" in mapping and "decoder" not in mapping:
            mapping = mapping["audio_tokenizer"]
            if not isinstance(mapping, Mapping):
                raise ValueError("'audio_tokenizer' must be a mapping")
        problems: list[str] = []
        sections = {
            name: _parse_section(name, kind, mapping.get(name), problems)
            for name, kind in _SECTIONS.items()
        }
        mel = mapping.get("mel_params")
        sample_rate = mel.get("sample_rate", 16000) if isinstance(mel, Mapping) else 16000
        if problems:
            raise ValueError("bad audio_tokenizer config: " + "; ".join(problems))
        return cls(**sections, sample_rate=as_int("mel_params.sample_rate", sample_rate))

    def to_dict(self) -> dict[str, Any]:
        """The ``audio_tokenizer`` mapping, with the real file's names for the sections we model."""
        out: dict[str, Any] = {
            "mel_params": {"sample_rate": self.sample_rate, "hop_length": self.hop_length}
        }
        for name in _SECTIONS:
            section = getattr(self, name)
            out[name] = {f.name: plain(getattr(section, f.name)) for f in fields(section)}
        return out

    @classmethod
    def preset(cls, name: str) -> BiCodecConfig:
        """A named configuration: ``"spark-tts-0.5b"`` (the released size) or ``"tiny"`` (tests)."""
        return from_preset(cls, PRESETS, name)


def _parse_section(name: str, kind: type, raw: Any, problems: list[str]) -> Any:
    if raw is None:
        problems.append(f"missing section '{name}'")
        return None
    if not isinstance(raw, Mapping):
        problems.append(f"section '{name}' must be a mapping, got {type(raw).__name__}")
        return None
    hints = get_type_hints(kind)
    values: dict[str, Any] = {}
    n_problems = len(problems)
    for f in fields(kind):
        key = f"{name}.{f.name}"
        if f.name in raw:
            try:
                values[f.name] = _convert(key, hints[f.name], raw[f.name])
            except ValueError as exc:
                problems.append(str(exc))
        elif f.default is MISSING:
            problems.append(f"missing field '{key}'")
    return kind(**values) if len(problems) == n_problems else None


def _convert(key: str, hint: Any, value: Any) -> Any:
    if hint is bool:
        return as_bool(key, value)
    if hint is int:
        return as_int(key, value)
    return as_ints(key, value)


def _check_consistent(cfg: BiCodecConfig) -> None:
    """Raise ValueError if the sections cannot form one decode path."""
    q, s, p, d = cfg.quantizer, cfg.speaker_encoder, cfg.prenet, cfg.decoder
    positive = {
        "quantizer.input_dim": q.input_dim,
        "quantizer.codebook_size": q.codebook_size,
        "quantizer.codebook_dim": q.codebook_dim,
        "speaker_encoder.out_dim": s.out_dim,
        "speaker_encoder.latent_dim": s.latent_dim,
        "speaker_encoder.token_num": s.token_num,
        "prenet.vocos_dim": p.vocos_dim,
        "prenet.vocos_intermediate_dim": p.vocos_intermediate_dim,
        "prenet.vocos_num_layers": p.vocos_num_layers,
        "decoder.channels": d.channels,
        "sample_rate": cfg.sample_rate,
    }
    require_positive(positive)
    layers = "prenet.vocos_num_layers"
    dims = {k: v for k, v in positive.items() if k not in ("sample_rate", layers)}
    require_at_most({**dims, "speaker_encoder.input_dim": s.input_dim,
                     "speaker_encoder.fsq_levels": s.fsq_levels, "decoder.rates": d.rates,
                     "decoder.kernel_sizes": d.kernel_sizes}, MAX_DIM)  # fmt: skip
    require_at_most({layers: p.vocos_num_layers}, MAX_LIST)
    if not s.fsq_levels or min(s.fsq_levels) < 2:
        raise ValueError(f"speaker_encoder.fsq_levels must be non-empty, each >= 2: {shown(s.fsq_levels)}")
    # The speaker de-quantiser holds a table of every global id (global_vocab x levels).
    require_at_most({"global_vocab (the product of speaker_encoder.fsq_levels)": cfg.global_vocab,
                     "hop_length (the product of decoder.rates)": cfg.hop_length}, MAX_DIM)  # fmt: skip
    if s.fsq_num_quantizers != 1:
        raise ValueError(
            f"only speaker_encoder.fsq_num_quantizers=1 is supported, got {s.fsq_num_quantizers}"
        )
    if any(r != 1 for r in p.sample_ratios):
        raise ValueError(
            f"only prenet.sample_ratios of 1 are supported, got {shown(p.sample_ratios)}"
        )
    links = {
        "prenet.input_channels": (p.input_channels, "quantizer.input_dim", q.input_dim),
        "prenet.condition_dim": (p.condition_dim, "speaker_encoder.out_dim", s.out_dim),
        "prenet.out_channels": (p.out_channels, "speaker_encoder.out_dim", s.out_dim),
        "decoder.input_channel": (d.input_channel, "prenet.out_channels", p.out_channels),
    }
    for key, (value, other, expected) in links.items():
        if value != expected:
            raise ValueError(f"{key}={value} must equal {other}={expected}")
    if not d.rates or len(d.rates) != len(d.kernel_sizes):
        raise ValueError(
            f"decoder.rates {shown(d.rates)} and decoder.kernel_sizes "
            f"{shown(d.kernel_sizes)} must be non-empty and of equal length"
        )
    for i, (k, r) in enumerate(zip(d.kernel_sizes, d.rates, strict=True)):
        # Transposed conv, padding (k - r) // 2: exactly r·T frames out only if k - r is even.
        if r < 1 or k < r or (k - r) % 2:
            raise ValueError(
                f"decoder block {i}: kernel {k} and rate {r} need k >= r >= 1 and "
                "k - r even, so that the block upsamples by exactly r"
            )
    if d.channels % 2 ** len(d.rates):
        raise ValueError(f"decoder.channels={d.channels} must be divisible by 2**{len(d.rates)}")


PRESETS: dict[str, dict[str, Any]] = {
    "spark-tts-0.5b": {
        "mel_params": {
            "sample_rate": 16000,
            "n_fft": 1024,
            "win_length": 640,
            "hop_length": 320,
            "mel_fmin": 10,
            "mel_fmax": None,
            "num_mels": 128,
        },
        "decoder": {
            "input_channel": 1024,
            "channels": 1536,
            "rates": [8, 5, 4, 2],
            "kernel_sizes": [16, 11, 8, 4],
        },
        "quantizer": {"input_dim": 1024, "codebook_size": 8192, "codebook_dim": 8},
        "speaker_encoder": {
            "input_dim": 128,
            "out_dim": 1024,
            "latent_dim": 128,
            "token_num": 32,
            "fsq_levels": [4, 4, 4, 4, 4, 4],
            "fsq_num_quantizers": 1,
        },
        "prenet": {
            "input_channels": 1024,
            "vocos_dim": 384,
            "vocos_intermediate_dim": 2048,
            "vocos_num_layers": 12,
            "out_channels": 1024,
            "condition_dim": 1024,
            "sample_ratios": [1, 1],
            "use_tanh_at_final": False,
        },
    },
    # Same structure and token vocabularies, small widths: a decode takes milliseconds on a CPU.
    "tiny": {
        "mel_params": {"sample_rate": 16000},
        "decoder": {
            "input_channel": 64,
            "channels": 64,
            "rates": [8, 5, 4, 2],
            "kernel_sizes": [16, 11, 8, 4],
        },
        "quantizer": {"input_dim": 64, "codebook_size": 8192, "codebook_dim": 8},
        "speaker_encoder": {
            "input_dim": 128,
            "out_dim": 64,
            "latent_dim": 16,
            "token_num": 32,
            "fsq_levels": [4, 4, 4, 4, 4, 4],
            "fsq_num_quantizers": 1,
        },
        "prenet": {
            "input_channels": 64,
            "vocos_dim": 32,
            "vocos_intermediate_dim": 64,
            "vocos_num_layers": 2,
            "out_channels": 64,
            "condition_dim": 64,
            "sample_ratios": [1, 1],
            "use_tanh_at_final": False,
        },
    },
}
