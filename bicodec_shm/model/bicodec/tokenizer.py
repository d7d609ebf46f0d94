"""``BiCodecEncoder``: 16 kHz waveforms -> BiCodec's semantic and global ids, as Spark-TTS's
``BiCodecTokenizer.tokenize`` computes them.

    waveform ──volume normalisation (waveforms.py)──┬── wav2vec2 features (wav2vec2_features.py)
                                                    │     -> FeatureEncoder -> SemanticQuantizer
                                                    │     -> semantic ids (B, T), 50 per second
                                                    └── reference clip -> mel (mel.py)
                                                          -> SpeakerTokenizer (speaker.py)
                                                          -> global ids (B, 32)

A batch is right-padded with its lengths; each row gets exactly the ids of its lone encode
(the features within float rounding): see the batching notes of each module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from ...errors import CheckpointError
from .. import weights
from ..inputs import IdsLike, check_waves
from ..modules import ConvNeXtBlock, TimeMask
from ..random_weights import WeightDraw, init_common_layers, seeded
from . import checkpoint
from .encode_config import BiCodecEncodeConfig
from .encoder import FeatureEncoder, SemanticQuantizer
from .mel import MelSpectrogram
from .speaker import FrozenBatchNorm1d, PerceiverResampler, RMSNorm, SpeakerTokenizer
from .wav2vec2_features import TINY_WAV2VEC2, XLSR53_WAV2VEC2, Wav2Vec2Features
from .waveforms import reference_clip, volume_normalize

WAV2VEC2_SUBFOLDER = "wav2vec2-large-xlsr-53"
SEMANTIC_PAD = 0  # a valid id, so that (ids, lengths) can go to the decoder as they are


class BiCodecTokens(NamedTuple):
    """What :meth:`BiCodecEncoder.tokenize` returns (all int64, on the model's device)."""

    global_ids: torch.Tensor  # (B, 32): one speaker's tokens per row
    semantic_ids: torch.Tensor  # (B, T): SEMANTIC_PAD past each row's length
    lengths: torch.Tensor  # (B,): semantic tokens of each row


class PreparedWaves(NamedTuple):
    """Waveforms as the networks read them (see :meth:`BiCodecEncoder.prepare`)."""

    wav: torch.Tensor  # (B, N) float32, volume-normalised, zero past each row's length
    lengths: torch.Tensor  # (B,) int64 samples
    ref_clip: torch.Tensor  # (B, ref_segment_length) float32


class CodecEncodeModules(nn.Module):
    """BiCodec's encode-path networks under their checkpoint names (``encoder``,
    ``quantizer``, ``speaker_encoder``), so that its state dict is a subset of the file's."""

    def __init__(self, cfg: BiCodecEncodeConfig) -> None:
        super().__init__()
        self.encoder = FeatureEncoder(cfg.encoder)
        self.quantizer = SemanticQuantizer(cfg.codec.quantizer)
        self.speaker_encoder = SpeakerTokenizer(cfg.codec.speaker_encoder)


class BiCodecEncoder(nn.Module):
    """Encode path of BiCodec: ``(B, N)`` 16 kHz waveforms -> ``(B, 32)`` global and ``(B, T)``
    semantic ids. Float32 only.

    Build with :meth:`from_pretrained` (a Spark-TTS model folder) or :meth:`from_config`
    (random weights); encode with :meth:`tokenize`.

    Args:
        config: dimensions and waveform settings.
        features: the wav2vec2 feature model.
    """

    def __init__(self, config: BiCodecEncodeConfig, features: Wav2Vec2Features) -> None:
        super().__init__()
        if features.hidden_size != config.encoder.input_channels:
            raise ValueError(f"wav2vec2 hidden_size={features.hidden_size} must equal "
                             f"encoder.input_channels={config.encoder.input_channels}")  # fmt: skip
        self.config = config
        self.features = features
        self.codec = CodecEncodeModules(config)
        self.mel = MelSpectrogram(config.mel)

    @property
    def device(self) -> torch.device:
        return self.codec.quantizer.codebook.weight.device

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        device: str | torch.device | None = None,
        *,
        wav2vec2: str | os.PathLike[str] | None = None,
    ) -> BiCodecEncoder:
        """Load a Spark-TTS model folder (or its ``BiCodec/`` folder): ``BiCodec/``
        (``config.yaml`` + ``model.safetensors``, whose encode-path tensors the decoder skips),
        ``wav2vec2-large-xlsr-53/`` (a transformers folder, or ``wav2vec2``) and the model
        folder's own ``config.yaml`` (reference clip, volume normalisation; the released
        model's values if it is absent).

        Raises:
            CheckpointError: a missing folder or file, bad YAML, encode-path tensors missing or
                of the wrong shape (all listed), or a wav2vec2 model this path cannot batch.
        """
        given = Path(path)
        # A model folder has a config.yaml of its own beside BiCodec/: look for BiCodec/ first.
        if (given / checkpoint.SUBFOLDER).is_dir():
            folder, root = checkpoint.find_folder(given / checkpoint.SUBFOLDER), given
        else:  # the BiCodec folder itself: the model folder is its parent
            folder = checkpoint.find_folder(given)
            root = folder.parent
        config = checkpoint.read_encode_config(folder, root)
        w2v = Path(wav2vec2) if wav2vec2 is not None else root / WAV2VEC2_SUBFOLDER
        if not (w2v / "config.json").is_file():
            raise CheckpointError(f"{w2v}: no wav2vec2 folder (config.json and weights); pass "
                                  "wav2vec2= to name one")  # fmt: skip
        try:
            features = Wav2Vec2Features.from_pretrained(w2v)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
        file = folder / checkpoint.WEIGHTS_FILE
        state = weights.read_state_dict(file, weights.meta_model(CodecEncodeModules, config, file))
        model = cls(config, features)
        model.codec.load_state_dict(state)
        return model.to(device).eval()

    @classmethod
    def from_config(
        cls,
        cfg: BiCodecEncodeConfig | str,
        *,
        wav2vec2: Mapping[str, Any] | None = None,
        seed: int | None = None,
    ) -> BiCodecEncoder:
        """Random weights, for tests and benchmarks: ``cfg`` a config or a preset name
        (``"tiny"``, ``"spark-tts-0.5b"``); ``wav2vec2`` a ``Wav2Vec2Config`` mapping (default:
        xlsr-53's own architecture where its hidden size is the preset's, as at full size, else
        a tiny xlsr-53 with the preset's hidden size)."""
        config = BiCodecEncodeConfig.preset(cfg) if isinstance(cfg, str) else cfg
        gen = seeded(seed)
        width = config.encoder.input_channels
        released = width == XLSR53_WAV2VEC2["hidden_size"]
        w2v = dict(wav2vec2 or (XLSR53_WAV2VEC2 if released else {**TINY_WAV2VEC2, "hidden_size": width}))
        features = Wav2Vec2Features.from_config(w2v, seed=int(torch.randint(0, 2**31, (), generator=gen)))
        model = cls(config, features)
        _random_init(model.codec, gen)
        return model.eval()

    def prepare(
        self, wavs: torch.Tensor | np.ndarray, lengths: IdsLike | Sequence[int] | None = None
    ) -> PreparedWaves:
        """Check and shape a right-padded batch: each row volume-normalised over its own
        samples (when the config says so), padding zeroed, its reference clip cut.

        Raises:
            ValueError: naming the bad argument (type, dtype, ndim, empty, a length out of
                range or too short for wav2vec2, a NaN or infinite sample).
        """
        wav, lens = _check_waves(wavs, lengths, self.features.min_samples())
        clip = self.config.clip
        rows, refs = [], []
        for i, n in enumerate(lens.tolist()):
            row = wav[i, :n]
            if clip.volume_normalize:
                row = volume_normalize(row)
            row = row.to(torch.float32)  # upstream's .float() and feature extractor both round here
            rows.append(row)
            refs.append(reference_clip(row, clip.ref_segment_length))
        out = torch.zeros(wav.shape, dtype=torch.float32)
        for i, row in enumerate(rows):
            out[i, : row.shape[0]] = row
        device = self.device
        return PreparedWaves(out.to(device), lens.to(device), torch.stack(refs).to(device))

    @torch.inference_mode()
    def tokenize(
        self, wavs: torch.Tensor | np.ndarray, lengths: IdsLike | Sequence[int] | None = None
    ) -> BiCodecTokens:
        """Encode a right-padded batch of 16 kHz waveforms.

        Args:
            wavs: (B, N) float waveforms (a lone one as ``wav[None]``), in [-1, 1] as read from
                a file; float64 keeps upstream's volume-normalisation arithmetic exactly.
            lengths: (B,) valid samples per row, each in [min_samples, N]; None means all N.

        Returns:
            global ids (B, 32), semantic ids (B, T) with T = frames of the longest row (50 per
            second), and each row's semantic length.

        Raises:
            ValueError: as :meth:`prepare`.
        """
        prepared = self.prepare(wavs, lengths)
        features, frames = self.semantic_features(prepared)
        n_frames = features.shape[1]
        mask = None
        if int(frames.min()) < n_frames:
            mask = TimeMask(frames, n_frames, (1,), dtype=features.dtype)
        semantic = self.codec.quantizer(self.codec.encoder(features, mask))  # (B, T)
        past_end = torch.arange(n_frames, device=semantic.device)[None, :] >= frames[:, None]
        semantic = semantic.masked_fill(past_end, SEMANTIC_PAD)
        global_ids = self.codec.speaker_encoder(self.mel(prepared.ref_clip))  # (B, 32)
        return BiCodecTokens(global_ids, semantic, frames)

    def semantic_features(self, prepared: PreparedWaves) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H) mixed wav2vec2 hidden states, trimmed to the longest row, and (B,) frames."""
        frames = self.features.frames(prepared.lengths)
        features = self.features(prepared.wav, prepared.lengths)
        return features[:, : int(frames.max())], frames


def _check_waves(
    wavs: Any, lengths: IdsLike | Sequence[int] | None, min_samples: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N) float64 CPU waveforms and (B,) int64 lengths (``model.inputs.check_waves``), each
    row at least ``min_samples`` long; or a ValueError naming the fault."""
    wav, lens = check_waves("wavs", wavs, lengths, dtype=torch.float64, one_row=False)
    short = (lens < min_samples).nonzero()
    if len(short):
        i = int(short[0, 0])
        raise ValueError(f"wavs row {i} has {int(lens[i])} samples; wav2vec2 needs at least "
                         f"{min_samples} ({min_samples / 16:.0f} ms at 16 kHz)")  # fmt: skip
    return wav.cpu(), lens


def _random_init(codec: CodecEncodeModules, gen: torch.Generator) -> None:
    """The shared rule (``random_weights``), then what it leaves: BatchNorm statistics near
    their trained ranges, ConvNeXt's γ small, the perceiver's latents and RMSNorm scale."""
    draw = WeightDraw(gen)
    with torch.no_grad():
        init_common_layers(codec, draw)
        for module in codec.modules():
            if isinstance(module, FrozenBatchNorm1d):
                draw.uniform(module.weight, 0.8, 1.2)
                draw.uniform(module.bias, -0.1, 0.1)
                draw.uniform(module.running_mean, -0.1, 0.1)
                draw.uniform(module.running_var, 0.5, 2.0)
            elif isinstance(module, ConvNeXtBlock):
                draw.uniform(module.gamma, 0.05, 0.2)
            elif isinstance(module, PerceiverResampler):
                draw.uniform(module.latents, -1.0, 1.0)
            elif isinstance(module, RMSNorm):
                draw.uniform(module.gamma, 0.8, 1.2)
