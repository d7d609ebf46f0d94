"""``BiCodecDecoder``: the BiCodec decode path, semantic + global tokens -> 16 kHz audio.

Submodule names follow the Spark-TTS checkpoint (``quantizer``, ``speaker_encoder``, ``prenet``,
``decoder``), so the folded state dict uses the checkpoint's keys.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import weights
from ..config_values import as_config
from ..inputs import IdsLike, as_ids, check_lengths, check_range
from ..modules import AdaLayerNorm, ConvNeXtBlock, ResidualUnit, TimeMask
from ..precision import apply_dtype
from ..random_weights import WeightDraw, init_common_layers, seeded
from . import checkpoint
from .backbone import Prenet
from .config import BiCodecConfig
from .quantizers import SemanticDequantizer, SpeakerDequantizer
from .wavegen import WaveGenerator

# Random-init gains, measured: with these, seed-0 audio has RMS 0.12 (tiny) and 0.14 (full size)
# and no sample past |0.99|; with gain 1 every block triples the RMS and tanh saturates.
RESIDUAL_GAIN = 0.3
OUTPUT_GAIN = 0.05


class BiCodecDecoder(nn.Module):
    """Decode path of BiCodec: ``(B, T)`` semantic ids and ``(B, 32)`` global ids -> ``(B, 320·T)``.

    Build with :meth:`from_pretrained` (a Spark-TTS ``BiCodec/`` folder) or :meth:`from_config`
    (random weights); decode with :meth:`detokenize`.

    Args:
        config: dimensions of every part.
    """

    def __init__(self, config: BiCodecConfig) -> None:
        super().__init__()
        self.config = config
        self.quantizer = SemanticDequantizer(config.quantizer)
        self.speaker_encoder = SpeakerDequantizer(config.speaker_encoder)
        self.prenet = Prenet(config.prenet)
        self.decoder = WaveGenerator(config.decoder)  # the wave generator, named as in checkpoints

    @property
    def device(self) -> torch.device:
        """Device of the weights; :meth:`detokenize` moves its inputs there."""
        return self.quantizer.codebook.weight.device

    @classmethod
    def from_config(
        cls,
        cfg: BiCodecConfig | Mapping[str, Any] | str,
        *,
        seed: int | None = None,
        dtype: str | torch.dtype = torch.float32,
    ) -> BiCodecDecoder:
        """A decoder with random weights, for tests and benchmarks.

        Args:
            cfg: a config, an ``audio_tokenizer`` mapping, or a preset name
                (``"spark-tts-0.5b"``, ``"tiny"``).
            seed: makes the weights identical in every process (same torch version); None draws
                the seed from torch's global generator.
            dtype: compute dtype, ``float32`` (default), ``bfloat16`` or ``float16``; the
                weights are drawn in float32 and then rounded, so every dtype shares one model.

        Raises:
            ValueError: an unknown preset or dtype.
        """
        model = cls(as_config(cfg, BiCodecConfig))
        _random_init(model, seeded(seed))
        return apply_dtype(model, dtype).eval()

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        device: str | torch.device | None = None,
        *,
        dtype: str | torch.dtype = torch.float32,
    ) -> BiCodecDecoder:
        """Load a ``BiCodec/`` folder (``config.yaml`` + ``model.safetensors``) or a model folder
        that contains one. Weight norm is folded here, once, in float32.

        Args:
            dtype: compute dtype, ``float32`` (default), ``bfloat16`` or ``float16``; norms,
                Snake α and the de-quantisers stay float32 (see ``precision.py``).

        Raises:
            CheckpointError: a missing file, bad YAML, or decode-path tensors missing or of the
                wrong shape (all of them are listed).
            ValueError: an unknown dtype.
        """
        folder = checkpoint.find_folder(path)
        file = folder / checkpoint.WEIGHTS_FILE
        config = checkpoint.read_config(folder / checkpoint.CONFIG_FILE)
        # Shapes first, on the meta device: nothing the config asks for is allocated unless the
        # file holds it.
        state = weights.read_state_dict(file, weights.meta_model(cls, config, file))
        model = cls(config)
        model.load_state_dict(state)
        return apply_dtype(model.to(device), dtype).eval()

    def save_pretrained(self, path: str | os.PathLike[str]) -> int:
        """Write ``path/config.yaml`` and ``path/model.safetensors`` (Spark-TTS layout, weight norm
        as ``weight_g``/``weight_v``); returns the number of tensors written."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        checkpoint.write_config(folder / checkpoint.CONFIG_FILE, self.config)
        return checkpoint.write_state_dict(folder / checkpoint.WEIGHTS_FILE, self)

    def forward(
        self, semantic_ids: torch.Tensor, global_ids: torch.Tensor, mask: TimeMask | None = None
    ) -> torch.Tensor:
        """semantic_ids (B, T) int64, global_ids (B, 32) int64 -> float32 audio (B, 1, hop·T).

        No input checks: use :meth:`detokenize`.
        """
        z = self.quantizer(semantic_ids).to(self.dtype)  # (B, C, T); float32 -> compute dtype
        d = self.speaker_encoder(global_ids)  # (B, D), float32 in every precision
        x = (self.prenet(z, d, mask) + d[:, :, None]).to(self.dtype)
        return self.decoder(x, mask)

    @torch.inference_mode()
    def detokenize(
        self,
        semantic_ids: IdsLike,
        global_ids: IdsLike,
        lengths: IdsLike | Sequence[int] | None = None,
        *,
        mask: bool = True,
        unpadded_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Decode a right-padded batch; each row's audio is exactly its unpadded decode.

        Args:
            semantic_ids: (B, T) integer ids in ``[0, semantic_vocab)``.
            global_ids: (B, n_global) integer ids in ``[0, global_vocab)``.
            lengths: (B,) valid tokens per row, each in ``[1, T]``; None means all T.
            mask: zero each row's padding before every time-mixing conv. False lets padding leak
                into the last ~350 ms of short rows (for benchmarks); the tail is zeroed anyway.
            unpadded_forward: what decodes a batch whose rows all have length T, ``(semantic,
                global) -> (B, 1, hop·T)`` as ``forward`` without a mask; None: this module.
                The server's CPU lanes pass a traced graph of it (model/traced.py).

        Returns:
            float32 audio (B, hop·T) in (-1, 1) on the model's device; row i is 0 from
            ``hop·lengths[i]`` on.

        Raises:
            ValueError: naming the bad argument (dtype, shape, out-of-range id or length).
        """
        semantic, glob, lens = _check_inputs(self.config, semantic_ids, global_ids, lengths)
        device, n_frames = self.device, semantic.shape[1]
        # Without padding there is nothing to mask: this path costs no more than forward().
        # The checks read lengths where the caller keeps them (the server: host memory), before
        # they move to the device, so that nothing here waits for the device.
        shortest = int(lens.min()) if lens is not None else n_frames
        lens = to_device(lens, device) if shortest < n_frames else None
        time_mask = None
        if lens is not None and mask:
            time_mask = TimeMask(lens, n_frames, self.decoder.time_factors, dtype=self.dtype,
                                 shortest=shortest)  # fmt: skip
        semantic, glob = to_device(semantic, device), to_device(glob, device)
        if unpadded_forward is not None and lens is None:
            audio = unpadded_forward(semantic, glob)
        else:
            audio = self(semantic, glob, time_mask)
        audio = audio[:, 0].float()  # (B, 1, N) -> (B, N)
        if lens is not None:
            ends = lens[:, None] * self.config.hop_length  # (B, 1)
            audio.masked_fill_(torch.arange(audio.shape[1], device=device) >= ends, 0.0)
        return audio

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype: that of the convolutions and linear layers (norms, Snake α and the
        de-quantisers are float32 in every precision)."""
        return self.decoder.model[0].weight.dtype


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; host -> CUDA goes through page-locked memory without waiting.

    A copy from pageable host memory waits until the stream has caught up, so a lane launching
    batch k would wait for batch k-1 to finish. From a pinned staging copy it is queued like a
    kernel; torch's pinned-memory cache keeps the staging buffer until the copy has run.
    """
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _check_inputs(
    cfg: BiCodecConfig,
    semantic_ids: IdsLike,
    global_ids: IdsLike,
    lengths: IdsLike | Sequence[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate and convert to int64 tensors: (B, T), (B, n_global), (B,) or None."""
    semantic = as_ids("semantic_ids", semantic_ids, dims=2)
    glob = as_ids("global_ids", global_ids, dims=2)
    batch, n_frames = semantic.shape
    if batch == 0:
        raise ValueError("semantic_ids is an empty batch (B = 0)")
    if n_frames == 0:
        raise ValueError("semantic_ids has T = 0 tokens per row; need at least 1")
    if glob.shape != (batch, cfg.n_global):
        raise ValueError(
            f"global_ids must have shape (B, {cfg.n_global}) = ({batch}, "
            f"{cfg.n_global}), got {tuple(glob.shape)}"
        )
    check_range("semantic_ids", semantic, cfg.semantic_vocab)
    check_range("global_ids", glob, cfg.global_vocab)
    if lengths is None:
        return semantic, glob, None
    return semantic, glob, check_lengths(lengths, batch, n_frames)


def _random_init(model: BiCodecDecoder, gen: torch.Generator) -> None:
    """Fill every weight from ``gen`` (``random_weights``), then give the blocks whose parts need
    other scales their own: AdaLayerNorm near identity, ConvNeXt's γ and the residual branches
    small, the output conv quiet."""
    draw = WeightDraw(gen)
    with torch.no_grad():
        init_common_layers(model, draw)
        for module in model.modules():
            if isinstance(module, AdaLayerNorm):  # scale(d) ~ 1, shift(d) ~ 0, as when trained
                draw.fan_in(module.scale.weight, module.scale.in_features, gain=0.1)
                draw.uniform(module.scale.bias, 0.8, 1.2)
                draw.fan_in(module.shift.weight, module.shift.in_features, gain=0.1)
            elif isinstance(module, ConvNeXtBlock):
                draw.uniform(module.gamma, 0.05, 0.2)
            elif isinstance(module, ResidualUnit):  # 12 stacked residuals: keep each branch small
                conv1 = module.block[3]
                draw.fan_in(conv1.weight, conv1.in_channels, gain=RESIDUAL_GAIN)
        out_conv = model.decoder.model[-2]
        draw.fan_in(out_conv.weight, out_conv.weight[0].numel(), gain=OUTPUT_GAIN)
