"""Typed configuration of the BiCodec encode path.

Three sources, as a Spark-TTS model folder lays them out:

    <model>/config.yaml             ``RefClipConfig``: sample rate, reference clip length, volume
                                    normalisation (the tokenizer's own settings)
    <model>/BiCodec/config.yaml     ``audio_tokenizer``: the decode sections (``BiCodecConfig``),
                                    plus ``encoder`` (``FeatEncoderConfig``) and ``mel_params``
                                    (``MelConfig``)
    <model>/wav2vec2-large-xlsr-53  a transformers folder, read by transformers
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..config_values import (
    MAX_DIM,
    MAX_LIST,
    as_bool,
    as_int,
    as_ints,
    plain,
    require_at_most,
    require_positive,
    shown,
)
from .config import PRESETS, BiCodecConfig

# The wav2vec2 hidden states Spark-TTS averages into the encoder's input features.
FEATURE_LAYERS = (11, 14, 16)
SAMPLE_RATE = 16000  # the only rate wav2vec2-large-xlsr-53 and BiCodec were trained at


@dataclass(frozen=True)
class FeatEncoderConfig:
    """``encoder``: a Vocos backbone over the wav2vec2 features, sampling stages, ``project``."""

    input_channels: int
    vocos_dim: int
    vocos_intermediate_dim: int
    vocos_num_layers: int
    out_channels: int
    sample_ratios: tuple[int, ...] = (1, 1)


@dataclass(frozen=True)
class MelConfig:
    """``mel_params``: the speaker encoder's mel spectrogram (see ``mel.py``)."""

    sample_rate: int = SAMPLE_RATE
    n_fft: int = 1024
    win_length: int = 640
    hop_length: int = 320
    mel_fmin: float = 10.0
    mel_fmax: float | None = None
    num_mels: int = 128


@dataclass(frozen=True)
class RefClipConfig:
    """The model folder's ``config.yaml`` keys that shape the waveform before it is encoded.

    Defaults are the released Spark-TTS-0.5B's.
    """

    sample_rate: int = SAMPLE_RATE
    ref_segment_duration: float = 6.0
    latent_hop_length: int = 320
    volume_normalize: bool = True

    @property
    def ref_segment_length(self) -> int:
        """Samples of the speaker encoder's reference clip: the duration, floored to whole
        latent hops, computed as upstream does (96000 for 6 s)."""
        samples = int(self.sample_rate * self.ref_segment_duration)
        return samples // self.latent_hop_length * self.latent_hop_length


@dataclass(frozen=True)
class BiCodecEncodeConfig:
    """Everything the encode path needs: the codec's sections, the encoder, mel and clip."""

    codec: BiCodecConfig
    encoder: FeatEncoderConfig
    mel: MelConfig
    clip: RefClipConfig

    def __post_init__(self) -> None:
        e, c = self.encoder, self.codec
        require_positive({f"encoder.{f.name}": getattr(e, f.name) for f in fields(e)
                          if f.name != "sample_ratios"})  # fmt: skip
        require_at_most({"encoder.input_channels": e.input_channels, "encoder.vocos_dim": e.vocos_dim,
                         "encoder.vocos_intermediate_dim": e.vocos_intermediate_dim,
                         "encoder.out_channels": e.out_channels, "mel_params.num_mels": self.mel.num_mels,
                         "mel_params.n_fft": self.mel.n_fft}, MAX_DIM)  # fmt: skip
        require_at_most({"encoder.vocos_num_layers": e.vocos_num_layers}, MAX_LIST)
        if any(r != 1 for r in e.sample_ratios):
            raise ValueError(
                f"only encoder.sample_ratios of 1 are supported, got {shown(e.sample_ratios)}"
            )
        if e.out_channels != c.quantizer.input_dim:
            raise ValueError(f"encoder.out_channels={e.out_channels} must equal "
                             f"quantizer.input_dim={c.quantizer.input_dim}")  # fmt: skip
        if self.mel.num_mels != c.speaker_encoder.input_dim:
            raise ValueError(f"mel_params.num_mels={self.mel.num_mels} must equal "
                             f"speaker_encoder.input_dim={c.speaker_encoder.input_dim}")  # fmt: skip
        m = self.mel
        if not 0 < m.win_length <= m.n_fft or m.hop_length < 1:
            raise ValueError(
                "mel_params need 0 < win_length <= n_fft and hop_length >= 1, got win_length="
                f"{m.win_length}, n_fft={m.n_fft}, hop_length={m.hop_length}"
            )
        top = m.mel_fmax if m.mel_fmax is not None else m.sample_rate / 2
        if not 0 <= m.mel_fmin < top <= m.sample_rate / 2:
            raise ValueError(f"mel_params need 0 <= mel_fmin < mel_fmax <= sample_rate / 2, got "
                             f"mel_fmin={m.mel_fmin}, mel_fmax={m.mel_fmax}")  # fmt: skip
        rates = {"model config sample_rate": self.clip.sample_rate,
                 "mel_params.sample_rate": m.sample_rate, "BiCodec sample_rate": c.sample_rate}  # fmt: skip
        if set(rates.values()) != {SAMPLE_RATE}:
            raise ValueError(f"every sample rate must be {SAMPLE_RATE}: {rates}")
        if self.clip.ref_segment_length <= m.n_fft // 2:
            raise ValueError(
                f"the reference clip ({self.clip.ref_segment_length} samples) must be longer "
                f"than n_fft / 2 = {m.n_fft // 2}: check ref_segment_duration and latent_hop_length"
            )

    @classmethod
    def from_dict(
        cls, audio_tokenizer: Mapping[str, Any], model_config: Mapping[str, Any] | None = None
    ) -> BiCodecEncodeConfig:
        """Parse BiCodec's ``audio_tokenizer`` mapping and the model folder's ``config.yaml``
        mapping (None: the released model's values).

        Raises:
            ValueError: a missing or malformed section or field, named.
        """
        codec = BiCodecConfig.from_dict(audio_tokenizer)
        if "audio_tokenizer" in audio_tokenizer and "decoder" not in audio_tokenizer:
            audio_tokenizer = audio_tokenizer["audio_tokenizer"]
        encoder = audio_tokenizer.get("encoder")
        if not isinstance(encoder, Mapping):
            raise ValueError("bad audio_tokenizer config: missing section 'encoder'")
        known = {f.name for f in fields(FeatEncoderConfig)}
        missing = sorted(known - set(encoder) - {"sample_ratios"})
        if missing:
            raise ValueError(f"bad audio_tokenizer config: missing field(s) "
                             f"{', '.join('encoder.' + k for k in missing)}")  # fmt: skip
        enc = FeatEncoderConfig(
            **{k: as_int(f"encoder.{k}", encoder[k]) for k in known - {"sample_ratios"}},
            sample_ratios=as_ints("encoder.sample_ratios", encoder.get("sample_ratios", [1, 1])),
        )
        return cls(codec, enc, _mel(audio_tokenizer.get("mel_params")), _clip(model_config))

    def to_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(BiCodec's ``config.yaml`` document, the model folder's ``config.yaml`` document)."""
        section = self.codec.to_dict()
        section["encoder"] = {f.name: plain(getattr(self.encoder, f.name)) for f in fields(self.encoder)}
        section["mel_params"] = {f.name: getattr(self.mel, f.name) for f in fields(self.mel)}
        clip = {f.name: getattr(self.clip, f.name) for f in fields(self.clip)}
        return {"audio_tokenizer": section}, clip

    @classmethod
    def preset(cls, name: str) -> BiCodecEncodeConfig:
        """``"spark-tts-0.5b"`` (the released sizes) or ``"tiny"`` (tests)."""
        if name not in ENCODER_PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(ENCODER_PRESETS)}")
        section = {**PRESETS[name], "encoder": ENCODER_PRESETS[name]}
        section["mel_params"] = {**PRESETS["spark-tts-0.5b"]["mel_params"]}
        return cls.from_dict(section, None)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {shown(value)}")
    return float(value)


def _mel(raw: Any) -> MelConfig:
    if raw is None:
        return MelConfig()
    if not isinstance(raw, Mapping):
        raise ValueError(f"mel_params must be a mapping, got {type(raw).__name__}")
    values: dict[str, Any] = {}
    for key in ("sample_rate", "n_fft", "win_length", "hop_length", "num_mels"):
        if key in raw:
            values[key] = as_int(f"mel_params.{key}", raw[key])
    if "mel_fmin" in raw:
        values["mel_fmin"] = _number("mel_params.mel_fmin", raw["mel_fmin"])
    if raw.get("mel_fmax") is not None:
        values["mel_fmax"] = _number("mel_params.mel_fmax", raw["mel_fmax"])
    return MelConfig(**values)


def _clip(raw: Mapping[str, Any] | None) -> RefClipConfig:
    if raw is None:
        return RefClipConfig()
    if not isinstance(raw, Mapping):
        raise ValueError(f"the model config must be a mapping, got {type(raw).__name__}")
    values: dict[str, Any] = {}
    for key in ("sample_rate", "latent_hop_length"):
        if key in raw:
            values[key] = as_int(key, raw[key])
    if "ref_segment_duration" in raw:
        values["ref_segment_duration"] = _number("ref_segment_duration", raw["ref_segment_duration"])
    if "volume_normalize" in raw:
        values["volume_normalize"] = as_bool("volume_normalize", raw["volume_normalize"])
    clip = RefClipConfig(**values)
    if clip.latent_hop_length < 1 or not 0 < clip.ref_segment_duration <= 600:
        raise ValueError(f"need latent_hop_length >= 1 and 0 < ref_segment_duration <= 600 s, got "
                         f"{clip.latent_hop_length} and {clip.ref_segment_duration}")  # fmt: skip
    return clip


ENCODER_PRESETS: dict[str, dict[str, Any]] = {
    "spark-tts-0.5b": {"input_channels": 1024, "vocos_dim": 384, "vocos_intermediate_dim": 2048,
                       "vocos_num_layers": 12, "out_channels": 1024, "sample_ratios": [1, 1]},
    # Input width = the tiny wav2vec2's hidden size (wav2vec2_features.TINY_WAV2VEC2).
    "tiny": {"input_channels": 32, "vocos_dim": 32, "vocos_intermediate_dim": 64,
             "vocos_num_layers": 2, "out_channels": 64, "sample_ratios": [1, 1]},
}  # fmt: skip
