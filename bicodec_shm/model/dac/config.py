"""Typed configuration of a DAC codec: the ``metadata["kwargs"]`` of a published ``weights.pth``.

Field names and defaults are those of ``dac.DAC.__init__`` (descript-audio-codec 1.0.0), so a
checkpoint's kwargs mean here what they mean to ``DAC(**kwargs)``. The encoder fields are not
used to decode; ``encoder_dim`` and ``encoder_rates`` still fix ``latent_dim`` when it is null.

A *frame* is one code of every codebook; it decodes to ``prod(decoder_rates)`` samples, except
that a transposed convolution of odd stride ``s`` (kernel ``2s``, padding ``ceil(s/2)``, as in
DAC) gives ``s·L - 1`` samples for ``L`` inputs: the 24 and 16 kHz models decode ``n`` frames to
``320·n - 8`` samples (:meth:`DACConfig.decoded_samples`).
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
    as_int,
    as_ints,
    from_preset,
    plain,
    require_at_most,
    require_positive,
    shown,
)


@dataclass(frozen=True)
class DACConfig:
    """Everything the decoder needs to know about a DAC checkpoint's dimensions.

    Build one with :meth:`from_dict` (a checkpoint's kwargs) or :meth:`preset`.
    ``codebook_dim`` is one width for every codebook, or one per codebook (as upstream allows).
    """

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: int | None = None
    decoder_dim: int = 1536
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    n_codebooks: int = 9
    codebook_size: int = 1024
    codebook_dim: int | tuple[int, ...] = 8
    sample_rate: int = 44100

    def __post_init__(self) -> None:
        _check_consistent(self)

    @property
    def latent(self) -> int:
        """Channels of the quantizer's output: ``latent_dim``, or ``encoder_dim ·
        2^len(encoder_rates)`` when that is null (as in dac)."""
        return self.latent_dim or self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def codebook_dims(self) -> tuple[int, ...]:
        """The width of each codebook's vectors."""
        if isinstance(self.codebook_dim, int):
            return (self.codebook_dim,) * self.n_codebooks
        return self.codebook_dim

    @property
    def samples_per_frame(self) -> int:
        """Samples per frame: the product of the decoder's rates (512 at 44.1 kHz, 320 at 24/16)."""
        return math.prod(self.decoder_rates)

    def stage_lengths(self, frames: int) -> tuple[int, ...]:
        """Time steps of ``frames`` frames at the decoder's input and after each upsampling block:
        ``L -> (L + 1)·s - 2·ceil(s/2)`` per stride ``s``, i.e. ``s·L`` for an even ``s`` and
        ``s·L - 1`` for an odd one."""
        lengths = [frames]
        for s in self.decoder_rates:
            lengths.append((lengths[-1] + 1) * s - 2 * math.ceil(s / 2))
        return tuple(lengths)

    def decoded_samples(self, frames: int) -> int:
        """Samples that ``dac.DAC.decode`` returns for ``frames`` frames: ``samples_per_frame ·
        frames - layout.end_trim``; a detokenized row and a served answer have this length."""
        return self.stage_lengths(frames)[-1]

    @property
    def codec_name(self) -> str:
        """``dac-44khz``, ``dac-24khz``, ``dac-16khz``: from the sample rate."""
        return f"dac-{self.sample_rate // 1000}khz"

    @property
    def layout(self) -> CodecLayout:
        """The torch-free token layout a client checks requests against: one level per codebook."""
        return CodecLayout(
            name=self.codec_name,
            level_rates=(1,) * self.n_codebooks,
            level_vocab=(self.codebook_size,) * self.n_codebooks,
            samples_per_frame=self.samples_per_frame,
            sample_rate=self.sample_rate,
            # stage_lengths is affine in frames: every n falls short by what one frame does.
            end_trim=self.samples_per_frame - self.decoded_samples(1),
        )

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> DACConfig:
        """Parse a checkpoint's kwargs; missing keys take dac's defaults, unknown keys (such as
        ``quantizer_dropout``, a training setting) are ignored.

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
                values[f.name] = _convert(f.name, mapping[f.name])
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ValueError("bad DAC config: " + "; ".join(problems))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The kwargs mapping (lists, not tuples), readable by ``dac.DAC(**mapping)``."""
        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def preset(cls, name: str) -> DACConfig:
        """A named configuration: ``dac-44khz``, ``dac-24khz``, ``dac-16khz`` (the published
        sizes), ``tiny-44khz``, ``tiny-24khz``, ``tiny-16khz`` (same token layout, small widths,
        for tests), ``tiny`` (= ``tiny-44khz``)."""
        return from_preset(cls, PRESETS, name)


_RATE_FIELDS = ("encoder_rates", "decoder_rates")


def _convert(name: str, value: Any) -> Any:
    if name in _RATE_FIELDS:
        return as_ints(name, value)
    if value is None and name == "latent_dim":
        return None
    if name == "codebook_dim" and not isinstance(value, int):
        return as_ints(name, value)
    return as_int(name, value)


def _check_consistent(cfg: DACConfig) -> None:
    """Raise ValueError if the fields cannot form one decode path."""
    require_positive({
        "decoder_dim": cfg.decoder_dim,
        "n_codebooks": cfg.n_codebooks,
        "codebook_size": cfg.codebook_size,
        "sample_rate": cfg.sample_rate,
        "latent": cfg.latent,
    })  # fmt: skip
    require_at_most({"n_codebooks": cfg.n_codebooks}, MAX_LIST)  # before codebook_dims repeats it
    require_at_most({"decoder_dim": cfg.decoder_dim, "codebook_size": cfg.codebook_size,
                     "latent": cfg.latent, "encoder_dim": cfg.encoder_dim, "codebook_dim": cfg.codebook_dims,
                     "decoder_rates": cfg.decoder_rates}, MAX_DIM)  # fmt: skip
    dims = cfg.codebook_dims
    if len(dims) != cfg.n_codebooks or min(dims) < 1:
        raise ValueError(
            f"codebook_dim must be >= 1, one for all codebooks or one per codebook "
            f"(n_codebooks={cfg.n_codebooks}), got {shown(plain(cfg.codebook_dim))}"
        )
    # Stride 1 would shorten time by one step (kernel 2, padding 1); no DAC model has it, and
    # with every stride >= 2 each stage is longer than the one before (the masks' keys).
    if not cfg.decoder_rates or min(cfg.decoder_rates) < 2:
        raise ValueError(f"decoder_rates must be non-empty, each >= 2: {shown(cfg.decoder_rates)}")
    require_at_most({"samples_per_frame (the product of decoder_rates)": cfg.samples_per_frame}, MAX_DIM)
    if cfg.decoder_dim % 2 ** len(cfg.decoder_rates):
        raise ValueError(
            f"decoder_dim={cfg.decoder_dim} must be divisible by 2**{len(cfg.decoder_rates)}"
        )


def _variant(sr: int, enc: int, enc_rates: list, dec: int, dec_rates: list,
             codebooks: int) -> dict[str, Any]:  # fmt: skip
    return {
        "encoder_dim": enc, "encoder_rates": enc_rates, "latent_dim": None, "decoder_dim": dec,
        "decoder_rates": dec_rates, "n_codebooks": codebooks, "codebook_size": 1024,
        "codebook_dim": 8, "sample_rate": sr,
    }  # fmt: skip


# The kwargs of descript-audio-codec's published weights (44khz 8kbps 0.0.1, 24khz 0.0.4, 16khz
# 0.0.5; dac.utils' download names them). Checked against the descript/dac_* configs on the HF hub
# (encoder 64, decoder 1536, hop 512 or 320, 9/32/12 codebooks of 1024) and upstream's own
# parameter counts (tests/test_dac_model.py).
PRESETS: dict[str, dict[str, Any]] = {
    "dac-44khz": _variant(44100, 64, [2, 4, 8, 8], 1536, [8, 8, 4, 2], 9),
    "dac-24khz": _variant(24000, 64, [2, 4, 5, 8], 1536, [8, 5, 4, 2], 32),
    "dac-16khz": _variant(16000, 64, [2, 4, 5, 8], 1536, [8, 5, 4, 2], 12),
    # Same token layout (codebooks, vocabulary, rates: the odd stride of 24/16 kHz included), small
    # widths: a decode of a few frames takes milliseconds on a CPU. encoder_dim 4 makes the latent
    # 64 wide, and upstream's twin of a tiny model small too.
    "tiny-44khz": _variant(44100, 4, [2, 4, 8, 8], 64, [8, 8, 4, 2], 9),
    "tiny-24khz": _variant(24000, 4, [2, 4, 5, 8], 64, [8, 5, 4, 2], 32),
    "tiny-16khz": _variant(16000, 4, [2, 4, 5, 8], 64, [8, 5, 4, 2], 12),
}
PRESETS["tiny"] = PRESETS["tiny-44khz"]
