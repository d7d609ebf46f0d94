"""wav2vec2 features as Spark-TTS computes them: the mean of hidden states 11, 14 and 16.

Spark-TTS runs ``Wav2Vec2FeatureExtractor`` (each waveform to zero mean and unit variance) and
then transformers' ``Wav2Vec2Model`` (wav2vec2-large-xlsr-53) with ``output_hidden_states``.
``Wav2Vec2Features`` runs the same transformers model, in two respects cut down:

- only the first 16 transformer layers are kept, and the final layer norm is replaced by the
  identity: hidden state k is the input of layer k, so states 11, 14 and 16 need layers 0-15
  only, and with 16 layers kept, transformers returns the final layer norm's output as state 16
  (hence the identity). A third of the 24-layer model's compute and weights is not spent.
- the normalisation is computed here in torch (float64 statistics per row over its own samples;
  the feature extractor computes them in float32 numpy, ~1e-7 apart).

Batching: rows are right-padded with zeros and passed with an ``attention_mask``. With xlsr-53's
``feat_extract_norm="layer"`` this is exact: the conv stack has no padding and a per-frame
LayerNorm, so a row's valid frames read only its valid samples; transformers zeroes the padding
frames before the positional convolution and masks them as attention keys; everything else is
per frame. (With ``"group"``, as in wav2vec2-base, GroupNorm's statistics run over the padded
time axis; such a model is refused.) Shapes: ``B`` batch, ``N`` samples, ``T`` frames, ``H``
hidden size.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .encode_config import FEATURE_LAYERS

NORM_EPS = 1e-7  # Wav2Vec2FeatureExtractor's, under the square root of the variance

# facebook/wav2vec2-large-xlsr-53's architecture (its config.json), for random weights at the
# released size: 24 layers of 1024 (16 are kept), 16 heads, the 320-sample hop.
XLSR53_WAV2VEC2: dict[str, Any] = {
    "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
    "conv_dim": [512] * 7, "conv_stride": [5, 2, 2, 2, 2, 2, 2], "conv_kernel": [10, 3, 3, 3, 3, 2, 2],
    "conv_bias": True, "feat_extract_norm": "layer", "do_stable_layer_norm": True,
    "num_conv_pos_embeddings": 128, "num_conv_pos_embedding_groups": 16,
}  # fmt: skip
# xlsr-53's structure at tiny widths (random-weight tests): 16 layers, the 320-sample hop.
TINY_WAV2VEC2: dict[str, Any] = {
    "hidden_size": 32, "num_hidden_layers": 16, "num_attention_heads": 2, "intermediate_size": 64,
    "conv_dim": [16] * 7, "conv_stride": [5, 2, 2, 2, 2, 2, 2], "conv_kernel": [10, 3, 3, 3, 3, 2, 2],
    "conv_bias": True, "feat_extract_norm": "layer", "do_stable_layer_norm": True,
    "num_conv_pos_embeddings": 128, "num_conv_pos_embedding_groups": 16,
}  # fmt: skip


def check_wav2vec2_config(config: Any, source: str) -> None:
    """Raise ValueError unless ``config`` (a ``Wav2Vec2Config``) is one this module computes
    exactly as Spark-TTS does, batched or not."""
    if config.feat_extract_norm != "layer" or not config.do_stable_layer_norm:
        raise ValueError(
            f"{source}: need feat_extract_norm='layer' and do_stable_layer_norm=True (as "
            f"wav2vec2-large-xlsr-53 has), got {config.feat_extract_norm!r} and "
            f"{config.do_stable_layer_norm!r}: a 'group' conv norm mixes padding into every row"
        )
    if config.num_hidden_layers < max(FEATURE_LAYERS):
        raise ValueError(f"{source}: need at least {max(FEATURE_LAYERS)} hidden layers, got "
                         f"{config.num_hidden_layers}")  # fmt: skip
    if getattr(config, "add_adapter", False):
        raise ValueError(f"{source}: wav2vec2 adapters are not supported")


class Wav2Vec2Features(nn.Module):
    """Waveforms -> the mean of hidden states 11, 14, 16, through transformers' Wav2Vec2Model.

    Build with :meth:`from_pretrained` (a transformers folder) or :meth:`from_config`.

    Args:
        model: a ``Wav2Vec2Model`` (it is cut down here: see the module docstring).
        do_normalize: the feature extractor's zero-mean unit-variance normalisation.
    """

    def __init__(self, model: nn.Module, *, do_normalize: bool = True) -> None:
        super().__init__()
        check_wav2vec2_config(model.config, "wav2vec2 config")
        keep = max(FEATURE_LAYERS)
        model.encoder.layers = model.encoder.layers[:keep]
        model.encoder.layer_norm = nn.Identity()
        model.config.num_hidden_layers = keep
        self.model = model.eval()
        self.do_normalize = do_normalize

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Wav2Vec2Features:
        """Load a transformers wav2vec2 folder (``config.json``, weights, and the feature
        extractor's ``preprocessor_config.json`` when present)."""
        from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

        config = Wav2Vec2Config.from_pretrained(path)
        check_wav2vec2_config(config, str(path))
        keep = max(FEATURE_LAYERS)
        # Layers past 16 are not built (their weights are left unread).
        model = Wav2Vec2Model.from_pretrained(path, num_hidden_layers=keep)
        do_normalize = True
        if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            do_normalize = bool(Wav2Vec2FeatureExtractor.from_pretrained(path).do_normalize)
        return cls(model, do_normalize=do_normalize)

    @classmethod
    def from_config(cls, config: dict[str, Any], *, seed: int) -> Wav2Vec2Features:
        """Random weights (transformers' own initialisation, seeded), for tests."""
        from transformers import Wav2Vec2Config, Wav2Vec2Model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Wav2Vec2Model(Wav2Vec2Config(**config))
        return cls(model)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def frames(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B,) samples -> (B,) int64 feature frames (the conv stack's output lengths)."""
        return self.model._get_feat_extract_output_lengths(lengths).to(torch.int64)

    def min_samples(self) -> int:
        """The fewest samples that give one frame (400 at xlsr-53's strides)."""
        n = 1
        for kernel, stride in reversed(tuple(zip(self.model.config.conv_kernel,
                                                 self.model.config.conv_stride, strict=True))):  # fmt: skip
            n = (n - 1) * stride + kernel
        return n

    def normalize(self, wav: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Each row (B, N) to zero mean, unit variance over its own samples; padding stays 0."""
        valid = torch.arange(wav.shape[1], device=wav.device)[None, :] < lengths[:, None]
        x = wav.to(torch.float64) * valid
        n = lengths.to(torch.float64)[:, None]
        mean = x.sum(dim=1, keepdim=True) / n
        var = ((x - mean) ** 2 * valid).sum(dim=1, keepdim=True) / n  # population variance
        return ((x - mean) / torch.sqrt(var + NORM_EPS) * valid).to(torch.float32)

    def forward(self, wav: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """wav (B, N) float32, lengths (B,) or None (all N) -> features (B, T, H) float32.

        Frames of a row past ``frames(lengths)`` hold no meaning.
        """
        if lengths is None:
            lengths = torch.full((wav.shape[0],), wav.shape[1], device=wav.device)
        x = self.normalize(wav, lengths) if self.do_normalize else wav
        # Without padding, no mask: Spark-TTS passes none either, and a mask of ones is a no-op.
        mask = None
        if bool((lengths < wav.shape[1]).any()):
            mask = (torch.arange(wav.shape[1], device=wav.device)[None, :] < lengths[:, None]).long()
        states = self.model(x, attention_mask=mask, output_hidden_states=True).hidden_states
        return sum(states[k] for k in FEATURE_LAYERS) / len(FEATURE_LAYERS)
